"""dtype "auto": bf16 only where the hardware computes it natively, decided from injected CPU flags."""

import pytest
import torch

from cacheclip_rag.config import ModelConfig
from cacheclip_rag.hardware import cpu_flags, describe, machine, native_bf16, resolve_dtype

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512_vnni"}
AMX = AVX512 | {"amx_tile", "amx_bf16", "amx_int8"}
ZEN4 = AVX512 | {"avx512_bf16"}


@pytest.mark.parametrize("flags, expected", [(AVX2, torch.float32), (AVX512, torch.float32),
                                             (AMX, torch.bfloat16), (ZEN4, torch.bfloat16)])
def test_auto_is_bf16_only_with_native_bf16(flags, expected):
    assert resolve_dtype("auto", "cpu", flags) == expected
    assert ModelConfig().torch_dtype(flags) == expected


def test_explicit_dtype_is_taken_as_given():
    assert resolve_dtype("bfloat16", "cpu", AVX2) == torch.bfloat16
    assert ModelConfig(dtype="float32").torch_dtype(AMX) == torch.float32


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype must be 'auto'"):
        ModelConfig(dtype="int8")


def test_cpu_flags_parse_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(info) == {"fpu", "avx2", "amx_bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()
    assert native_bf16("cpu", cpu_flags(info)) and not native_bf16("cpu", AVX2)
    assert "native bf16: False" in describe(AVX2)


def test_machine_names_the_cpu_its_bf16_flags_and_threads(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    said = machine(info)
    assert said.startswith("AMD EPYC; CPU flags: avx512_bf16 avx512f avx2; native bf16: True; ")
    assert f"{torch.get_num_threads()} threads" in said
    assert machine(tmp_path / "missing").startswith("unknown CPU; CPU flags: none of")


# ----- device per role (the paper's placement: primary on the GPU, aux on the CPU) ------------


def test_device_resolution():
    from cacheclip_rag.hardware import resolve_device

    assert resolve_device("auto", cuda_available=False) == torch.device("cpu")
    assert resolve_device("auto", cuda_available=True) == torch.device("cuda:0")
    assert resolve_device("cuda:1", cuda_available=True) == torch.device("cuda:1")
    assert resolve_device("cpu", cuda_available=True) == torch.device("cpu")
    with pytest.raises(ValueError, match="has no CUDA GPU"):
        resolve_device("cuda", cuda_available=False)
    with pytest.raises(ValueError, match="only 'cpu' and 'cuda"):
        resolve_device("meta", cuda_available=True)


def test_roles_default_to_the_papers_placement(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = ModelConfig()
    assert cfg.device("primary") == torch.device("cuda:0") and cfg.device("aux") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cfg.device("primary") == torch.device("cpu")
    with pytest.raises(ValueError, match="role must be"):
        cfg.device("judge")
    with pytest.raises(ValueError, match="primary_device must be"):
        ModelConfig(primary_device="gpu please")


def test_models_and_caches_land_where_the_config_says(tiny_pair, tmp_path):
    """On this CPU-only machine: both roles load on the configured device; chunk caches are
    kept on the host and the request's assembled cache and logits follow the primary."""
    from cacheclip_rag import CacheClipEngine, EngineConfig
    from cacheclip_rag.models.loading import load
    from cacheclip_rag.request.execute import execute

    primary, aux = tiny_pair
    folder = tmp_path / "primary"
    primary.model.save_pretrained(folder)
    primary.tokenizer.save_pretrained(folder)
    loaded = load(str(folder), ModelConfig(dtype="float32", primary_device="cpu"), role="primary")
    assert loaded.device == torch.device("cpu") and loaded.dtype == torch.float32
    with pytest.raises(ValueError, match="has no CUDA GPU"):
        if not torch.cuda.is_available():
            load(str(folder), ModelConfig(primary_device="cuda"), role="primary")
        else:
            raise ValueError("has no CUDA GPU")  # the check above only means something without a GPU

    from conftest import CORPUS

    engine = CacheClipEngine(loaded, aux, tmp_path / "store", EngineConfig())
    ids = engine.ingest(CORPUS[:3], progress=False)
    kv = engine.primary.get(ids[0])
    assert kv.keys[0].device == torch.device("cpu")
    done = execute(engine.prepare("what is the code?", ids, mode="cacheclip", recompute_ratio=0.5), None)
    assert done.logits.device == torch.device("cpu")
