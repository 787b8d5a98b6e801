"""The package as a user installs it: built into a wheel, installed into a fresh virtual
environment, used from outside the source tree.

The suite itself runs on an editable install, which sees every file in the clone whether or not
the wheel would carry it; these tests are what notices a subpackage or data file left out.
The fresh environment gets the project's dependencies from the test environment's
site-packages (a `.pth` line, which adds the folder but not its editable-install hooks), and the
project only from the wheel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
from conftest import CORPUS

ROOT = Path(__file__).resolve().parent.parent
SOURCE_ROOTS = ("src", "kernels", "integrations")
"""Folders whose .py files are the package's modules; each file's wheel path is its path below
the folder (src/cacheclip_rag/x.py -> cacheclip_rag/x.py)."""

DATA = ["cacheclip_rag/serving/web/index.html", "cacheclip_rag/data/demo_corpus.jsonl",
        "cacheclip_rag/data/demo_long.jsonl",
        "cacheclip_rag/data/profiles/qwen2.5-coder-0.5b-instruct+smollm2-135m-instruct.json",
        "cacheclip_rag/data/packets/qwen2.5-coder-0.5b-instruct.safetensors",
        "cacheclip_rag/data/lora/qwen2.5-coder-0.5b-instruct-lora/adapter_model.safetensors"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built offline from the working tree (setuptools from the environment)."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w",
                    str(out), str(ROOT)], check=True, cwd=out)
    (built,) = out.glob("cacheclip_rag-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment holding the wheel; returns its bin folder."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # The dependencies: this environment's site-packages as a plain path entry (its .pth files,
    # the editable install's among them, are not run from there).
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "--quiet", str(wheel)], check=True)
    return env_dir / "bin"


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return {**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRITON_INTERPRET": "1"}


def _run(args: list[str], cwd: Path) -> str:
    done = subprocess.run(args, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _source_files() -> set[str]:
    out = set()
    for root in SOURCE_ROOTS:
        for path in (ROOT / root).rglob("*.py"):
            out.add(path.relative_to(ROOT / root).as_posix())
    return out


def test_every_source_file_and_the_package_data_are_in_the_wheel(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_source_files() - names)
    assert not missing, f"the wheel lacks {missing}"
    assert not [d for d in DATA if d not in names], f"the wheel lacks package data: {[d for d in DATA if d not in names]}"
    # The research harness is a package of its own (benchmarks/): none of it ships in the library.
    harness = sorted(n for n in names if n.startswith("cacheclip_bench/") or "/eval/" in n or "/bench" in n
                     or n.endswith(("/bench.py", "/eval.py")))
    assert harness == [], f"the wheel carries benchmark code: {harness}"
    # llama_index is llama-index-core's namespace package: shipping its __init__ would shadow it.
    assert "llama_index/__init__.py" not in names and "llama_index/llms/__init__.py" not in names


def test_the_installed_wheel_imports_every_module_from_outside_the_tree(wheel, installed, tmp_path):
    modules = sorted(
        name[:-3].replace("/", ".").removesuffix(".__init__")
        for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".py")
    )
    script = (
        "import importlib, json, sys\n"
        f"mods = {modules!r}\n"
        "for m in mods: importlib.import_module(m)\n"
        "import cacheclip_rag\n"
        "print(json.dumps({'n': len(mods), 'file': cacheclip_rag.__file__}))\n"
    )
    out = json.loads(_run([str(installed / "python"), "-c", script], tmp_path).strip().splitlines()[-1])
    assert out["n"] == len(modules)
    assert Path(out["file"]).is_relative_to(installed.parent), f"imported {out['file']}, not the installed wheel"
    assert "ask" in _run([str(installed / "cacheclip"), "--help"], tmp_path)


def test_the_installed_wheel_answers_a_request_on_tiny_models(installed, tiny_pair, tmp_path):
    models = []
    for name, lm in zip(("primary", "aux"), tiny_pair):
        lm.model.save_pretrained(tmp_path / name)
        lm.tokenizer.save_pretrained(tmp_path / name)
        models.append(str(tmp_path / name))
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"title": f"d{i}", "text": t}) for i, t in enumerate(CORPUS)))
    common = ["--store", str(tmp_path / "store"), "--primary", models[0], "--aux", models[1]]
    cacheclip = str(installed / "cacheclip")
    _run([cacheclip, "ingest", str(docs), "--quiet", "--chunk-tokens", "32", *common], tmp_path)
    out = _run([cacheclip, "ask", "what is the code?", "--ratio", "0.5", "--max-new-tokens", "3", "--json", *common],
               tmp_path)
    answer = json.loads(out)
    assert answer["mode"] == "cacheclip" and answer["chunk_ids"]
