"""Peers of `bench ttft`: the GGUF files they run, and llama.cpp itself where the optional
`peers` extra is installed (not in `make test`: it compiles llama.cpp)."""

import hashlib

import pytest
import torch

from cacheclip_bench import peers
from cacheclip_rag.models.loading import DEFAULT_AUX, EMBEDDED, GEMMA3, gguf_path


def test_a_folder_or_unknown_model_has_no_gguf(tmp_path):
    assert gguf_path(str(tmp_path)) is None
    assert gguf_path("org/some-hub-model") is None
    with pytest.raises(peers.PeerUnavailable, match="has no GGUF"):
        peers.open_peer("llamacpp", str(tmp_path), 1, 256)
    with pytest.raises(ValueError, match="peer must be one of"):
        peers.open_peer("vllm", DEFAULT_AUX, 1, 256)


@pytest.mark.real_model
def test_a_split_gguf_is_joined_once_and_a_damaged_join_is_redone(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHECLIP_CACHE_DIR", str(tmp_path))
    spec = EMBEDDED[GEMMA3]
    assert len(spec.part_paths()) > 1
    joined = gguf_path(GEMMA3)
    assert joined.parent == tmp_path / "gguf" and joined.stat().st_size == spec.size
    stamp = joined.stat().st_mtime_ns
    assert gguf_path(GEMMA3) == joined and joined.stat().st_mtime_ns == stamp  # intact: kept
    with open(joined, "r+b") as fh:  # damage one byte
        fh.seek(4096)
        byte = fh.read(1)
        fh.seek(4096)
        fh.write(bytes([byte[0] ^ 0xFF]))
    assert gguf_path(GEMMA3) == joined
    assert [p.name for p in tmp_path.joinpath("gguf").iterdir()] == [spec.gguf_name]  # no partial file left
    assert hashlib.sha256(joined.read_bytes()).hexdigest() == spec.sha256  # joined again


@pytest.mark.real_model
def test_llama_cpp_prefills_the_same_model_to_the_same_first_token():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is the optional `peers` extra")
    from cacheclip_rag.models.loading import load

    aux = load(DEFAULT_AUX)
    ids = aux.tokenizer("Monday, Tuesday, Wednesday, Thursday, Friday, Saturday,")["input_ids"]
    with torch.no_grad():
        top = aux.model(torch.tensor([ids])).logits[0, -1].float().topk(2)
    assert top.values[0] - top.values[1] > 1.0  # a clear pick (llama.cpp's Q4 kernels may swap close ones)
    peer = peers.open_peer("llamacpp", DEFAULT_AUX, torch.get_num_threads(), 512)
    try:
        seconds, first = peer.ttft(list(ids))
        assert seconds > 0 and first == int(top.indices[0])
        assert peer.ttft(list(ids))[1] == first  # each call starts from an empty context
    finally:
        peer.close()
