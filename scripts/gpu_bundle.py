"""The wheels the GPU check carries to a bare accelerator machine, and which of them it uses there.

    python scripts/gpu_bundle.py build gpu-bundle     # here (`make gpu-bundle`): download the wheels
    python scripts/gpu_bundle.py path gpu-bundle SITE # there: unpack what the machine lacks, print the path

The machine has torch, triton, transformers, tokenizers, safetensors, xxhash, tqdm, pytest and
sentence-transformers of its own versions and no network. `build` downloads, for Python 3.12 on
x86_64 Linux, the transformers this project pins and what it needs beyond what such a machine
surely has (`MACHINE_HAS`), each at the version installed here, as wheels (compressed: well under
`LIMIT_MIB`). `path` starts from transformers (taken when the machine's version differs from the
bundled one), adds every bundled dependency that a taken wheel requires and the machine does not
satisfy, unpacks the taken wheels into SITE and prints SITE (or nothing, when none is needed).
Standard library only, plus `packaging` where the machine has it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

ROOT_DIST = "transformers"
MACHINE_HAS = {"torch", "triton", "numpy", "safetensors", "xxhash", "tqdm", "pytest", "packaging", "pyyaml",
               "typing-extensions", "sentence-transformers", "setuptools", "jinja2", "markupsafe", "networkx", "sympy",
               "mpmath", "nvidia-*"}
TARGET = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64", "manylinux_2_34_x86_64")
LIMIT_MIB = 48


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _has(name: str) -> bool:
    return any(name == h or (h.endswith("*") and name.startswith(h[:-1])) for h in MACHINE_HAS)


def _requirements(dist: str) -> list[str]:
    """dist's own requirements (no extras) that apply on the target, as names."""
    from packaging.requirements import Requirement

    out = []
    for text in metadata.requires(dist) or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(TARGET):
            out.append(_norm(req.name))
    return out


def needed() -> dict[str, str]:
    """name -> version installed here, for transformers and what it needs beyond the machine's."""
    found, todo = {}, [ROOT_DIST]
    while todo:
        name = todo.pop()
        if name in found or (_has(name) and name != ROOT_DIST):
            continue
        found[name] = metadata.version(name)
        todo += _requirements(name)
    return found


def build(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    pins = needed()
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
           "--python-version", "3.12", "-d", str(folder), *(f"--platform={p}" for p in PLATFORMS),
           *(f"{name}=={version}" for name, version in pins.items())]
    subprocess.run(cmd, check=True)
    wheels = sorted(folder.glob("*.whl"))
    (folder / "bundle.json").write_text(json.dumps({"pins": pins, "wheels": [w.name for w in wheels]}, indent=1))
    size = sum(w.stat().st_size for w in wheels) / 2**20
    if size > LIMIT_MIB:
        raise SystemExit(f"the bundle is {size:.1f} MiB, over its {LIMIT_MIB} MiB limit: {[w.name for w in wheels]}")
    print(f"{folder}: {len(wheels)} wheels, {size:.1f} MiB (limit {LIMIT_MIB})")
    return wheels


def _wheel_requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    return [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]


def _satisfied(requirement: str, installed: str | None) -> bool:
    if installed is None:
        return False
    try:
        from packaging.requirements import Requirement
    except ImportError:  # no packaging: trust nothing older than the bundle
        return False
    req = Requirement(requirement)
    return req.specifier.contains(installed, prereleases=True)


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def choose(folder: Path) -> list[Path]:
    """The bundled wheels this machine needs (see the module docstring)."""
    info = json.loads((folder / "bundle.json").read_text())
    wheels = {_norm(w.split("-")[0]): folder / w for w in info["wheels"]}
    taken: dict[str, Path] = {}
    if _installed(ROOT_DIST) != info["pins"][ROOT_DIST]:
        taken[ROOT_DIST] = wheels[ROOT_DIST]
    todo = list(taken)
    while todo:
        for requirement in _wheel_requires(taken[todo.pop()]):
            if ";" in requirement and "extra ==" in requirement:
                continue
            name = _norm(re.split(r"[ ;<>=!~\[(]", requirement, maxsplit=1)[0])
            if name in wheels and name not in taken and not _satisfied(requirement.split(";")[0], _installed(name)):
                taken[name] = wheels[name]
                todo.append(name)
    return list(taken.values())


def unpack(wheels: list[Path], site: Path) -> None:
    site.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(site)


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "build":
        build(Path(argv[1]))
        return 0
    if len(argv) >= 3 and argv[0] == "path":
        folder, site = Path(argv[1]), Path(argv[2])
        if not (folder / "bundle.json").is_file():
            print(f"gpu bundle: {folder} holds no bundle (run `make gpu-bundle` and carry it); using the machine's "
                  "packages as they are", file=sys.stderr)
            return 0
        taken = choose(folder)
        if taken:
            unpack(taken, site)
            print(f"gpu bundle: using {', '.join(w.name for w in taken)}", file=sys.stderr)
            print(site.resolve())
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
