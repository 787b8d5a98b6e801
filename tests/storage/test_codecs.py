"""Chunk-cache codecs: each round trip within its stated bound (random tensors and a tiny model's
real caches), the recompute oracles through decoded caches, damage in compressed records, one
codec per namespace, unknown names refused."""

import pytest
import torch
from conftest import CORPUS
from transformers import DynamicCache

from cacheclip_rag.config import StoreConfig
from cacheclip_rag.corpus.encode import encode_prefix, encode_segment, tokenize
from cacheclip_rag.request.assemble import build_layout
from cacheclip_rag.request.pipeline import assemble
from cacheclip_rag.request.recompute import recompute_rows
from cacheclip_rag.storage import codecs
from cacheclip_rag.storage.backends.base import HeldRecord
from cacheclip_rag.storage.record import ChunkKV, DamagedCacheError, LayerReader, to_record
from cacheclip_rag.storage.store import KVStore

CODECS = ["bf16", "int8", "int4"]
NS = "cd" * 16
TOL = dict(atol=2e-4, rtol=2e-4)


def _within_bound(codec, kind, x):
    c = codecs.get(codec)
    y = c.decode(kind, c.encode(kind, x), x.shape[1], x.shape[2], torch.float32)
    err = (y - x.float()).abs()
    bound = c.bound(kind, x)
    assert y.shape == x.shape
    assert (err <= bound * (1 + 1e-3) + 1e-6).all(), f"{codec}/{kind}: error {err.max():.4g} past the bound"
    return err, bound


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("shape", [(2, 250, 64), (3, 7, 16), (1, 64, 128), (2, 1, 64)])
def test_round_trip_within_the_stated_bound_on_random_tensors(codec, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 4
    x[..., 3] *= 25  # an outlier channel, as keys have
    x = x.to(torch.bfloat16)
    for kind in "kv":
        err, bound = _within_bound(codec, kind, x)
        if codec == "bf16":
            assert err.max() == 0
        else:
            assert bound.max() > 0  # the bound is not trivially zero for a lossy codec


def test_bytes_per_element_are_as_stated():
    x = torch.randn(2, 256, 64).to(torch.bfloat16)
    bf16 = x.numel() * 2
    for codec, fewer in (("int8", 1.9), ("int4", 3.5)):
        stored = codecs.get(codec).encode("k", x)
        assert bf16 / (stored.numel() * stored.element_size()) >= fewer


def test_a_constant_or_zero_group_round_trips():
    for codec in ("int8", "int4"):
        for x in (torch.zeros(1, 70, 64), torch.full((1, 70, 64), 3.25)):
            for kind in "kv":
                _within_bound(codec, kind, x.to(torch.bfloat16))


def test_values_past_float16_are_refused_by_name():
    x = torch.full((1, 4, 64), 1e6)
    for codec in ("int8", "int4"):
        with pytest.raises(ValueError, match="bf16"):
            codecs.get(codec).encode("k", x)


def test_unknown_codec_names_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"'int3'.*bf16.*int4.*int8"):
        codecs.get("int3")
    with pytest.raises(ValueError, match="'int3'"):
        KVStore(tmp_path, StoreConfig(kv_codec="int3"))
    assert not (tmp_path / "store.json").exists()  # refused before anything was written
    with pytest.raises(ValueError, match="kv_codec"):
        StoreConfig(kv_codec="")


def _request(lm):
    prefix_kv = encode_prefix(lm, "System: answer from the context.\n\n")
    kvs = {f"c{i}": encode_segment(lm, prefix_kv.token_ids, t).to(torch.bfloat16) for i, t in enumerate(CORPUS[:3])}
    pieces = [(t, f"c{i}") for i, t in enumerate(CORPUS[:3])] + [("\n\nQuestion: what is the code?\nAnswer:", None)]
    layout = build_layout(prefix_kv.token_ids, pieces, lambda s, special: tokenize(lm, s, special))
    return layout, prefix_kv, kvs


def _through_store(tmp_path, codec, kvs, prefix_kv):
    """The caches written with `codec` and read back (decoded) by a fresh store."""
    KVStore(tmp_path, StoreConfig(kv_codec=codec))
    writer = KVStore(tmp_path, StoreConfig(kv_codec=codec))
    for key, kv in {**kvs, "__prefix__": prefix_kv.to(torch.bfloat16)}.items():
        writer.put_kv(NS, key, kv)
    reader = KVStore(tmp_path)
    assert reader.codec_of(NS) == codec
    out = {key: reader.get_kv(NS, key) for key in kvs}
    return out, reader.get_kv(NS, "__prefix__")


@pytest.mark.parametrize("codec", CODECS)
def test_a_tiny_models_real_caches_round_trip_within_the_bound(tiny_pair, tmp_path, codec):
    lm = tiny_pair[0]
    _, prefix_kv, kvs = _request(lm)
    decoded, _ = _through_store(tmp_path, codec, kvs, prefix_kv)
    c = codecs.get(codec)
    for key, kv in kvs.items():
        for layer in range(lm.num_layers):
            for kind, a, b in (("k", kv.keys[layer], decoded[key].keys[layer]), ("v", kv.values[layer], decoded[key].values[layer])):
                assert b.dtype == a.dtype and b.shape == a.shape
                bound = c.bound(kind, a) * (1 + 1e-3) + a.float().abs() * 2 ** -8 + 1e-6  # + the cast back to bf16
                assert ((b.float() - a.float()).abs() <= bound).all()


def _assembled(lm, tmp_path, codec):
    """A request's layout and its cache assembled from caches written with `codec` and read back."""
    layout, prefix_kv, kvs = _request(lm)
    decoded, prefix = _through_store(tmp_path, codec, kvs, prefix_kv)
    return layout, assemble(lm, layout, prefix.to(torch.float32), {k: v.to(torch.float32) for k, v in decoded.items()})


@pytest.mark.parametrize("codec", CODECS)
def test_full_recompute_through_decoded_caches_is_a_full_prefill(tiny_pair, tmp_path, codec):
    lm = tiny_pair[0]
    layout, cache = _assembled(lm, tmp_path, codec)
    logits = recompute_rows(lm, cache, layout.input_ids, torch.arange(layout.num_tokens)).logits
    with torch.inference_mode():
        ref = lm.model(input_ids=layout.input_ids[None], cache=DynamicCache(), use_cache=True)
    torch.testing.assert_close(logits, ref.logits[0, -1], **TOL)


@pytest.mark.parametrize("codec", CODECS)
def test_zero_recompute_is_direct_reuse_of_the_decoded_caches(tiny_pair, tmp_path, codec):
    lm = tiny_pair[0]
    layout, cache = _assembled(lm, tmp_path, codec)
    question = layout.segments[-1]
    reused = [(k[:, :, :question.start].clone(), v[:, :, :question.start].clone()) for k, v in zip(cache.keys, cache.values)]
    logits = recompute_rows(lm, cache, layout.input_ids, layout.uncached_rows()).logits
    with torch.inference_mode():
        ref = lm.model(input_ids=question.ids[None], cache=DynamicCache(reused),
                       position_ids=torch.arange(question.start, question.end)[None], use_cache=True)
    torch.testing.assert_close(logits, ref.logits[0, -1], **TOL)


def _kv(t=70, layers=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ChunkKV([torch.randn(2, t, 16, generator=g).to(torch.bfloat16) for _ in range(layers)],
                   [torch.randn(2, t, 16, generator=g).to(torch.bfloat16) for _ in range(layers)],
                   torch.arange(t), torch.stack([torch.arange(t), torch.arange(t) + 1], dim=1), 5)


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_compressed_records_are_detected_and_dropped(tmp_path, codec, damage):
    s = KVStore(tmp_path, StoreConfig(kv_codec=codec))
    s.put_kv(NS, "c", _kv())
    path = s.backend.kv_path(NS, "c")
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-10] ^= 0xFF  # inside the last stored tensor: parses, fails its checksum
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))
    fresh = KVStore(tmp_path)
    assert fresh.get_kv(NS, "c") is None
    assert fresh.stats.damaged == 1 and not path.exists()


@pytest.mark.parametrize("layout", ["1", "2", None, "x"])
def test_a_record_of_another_layout_is_damage_not_misread(layout):
    # at 128 tokens int8's layout 2 (a key step per channel and 64 tokens) and layout 3 (a step and
    # a minimum per channel and 128 tokens) have the same byte count, so only the recorded layout
    # tells them apart
    tensors, meta = to_record(_kv(t=128), NS, "c", "int8")
    assert meta["codec_layout"] == str(codecs.get("int8").layout) == "3"
    if layout is None:
        del meta["codec_layout"]  # a record of the release before layouts were recorded
    else:
        meta["codec_layout"] = layout
    with pytest.raises(DamagedCacheError, match="layout|metadata"):
        LayerReader(HeldRecord(tensors, meta), NS, "c", "int8")


def test_a_damaged_compressed_record_is_rebuilt_from_its_text(tiny_pair, tmp_path):
    from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig

    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4), store=StoreConfig(kv_codec="int4"))
    with CacheClipEngine(*tiny_pair, tmp_path, cfg) as eng:
        ids = eng.ingest(CORPUS, progress=False)[:2]
        before = eng.answer("What is the code?", chunk_ids=ids, max_new_tokens=3).text
        path = eng.store.backend.kv_path(eng.primary.namespace, ids[0])
        data = bytearray(path.read_bytes())
        data[-10] ^= 0xFF
        path.write_bytes(bytes(data))
        eng.store.clear_memory()
        again = eng.answer("What is the code?", chunk_ids=ids, max_new_tokens=3)
        assert again.text == before  # rebuilt from its text: encoding is deterministic
        assert eng.store.stats.damaged >= 1 and path.exists()


def test_a_namespace_never_mixes_codecs(tmp_path):
    KVStore(tmp_path, StoreConfig(kv_codec="int8")).put_kv(NS, "a", _kv())
    s = KVStore(tmp_path, StoreConfig(kv_codec="int4"))  # the namespace keeps its codec
    assert s.codec_of(NS) == "int8"
    with pytest.raises(ValueError, match="never mixes codecs"):
        s.describe_namespace(NS, {"kv_codec": "bf16"})
    s.put_kv(NS, "b", _kv(seed=1))  # written with the namespace's codec
    assert KVStore(tmp_path).get_kv(NS, "b") is not None
    # a record of another codec found in the namespace is refused as damage, never decoded
    from cacheclip_rag.storage.record import to_record
    s.backend.put(NS, "c", *to_record(_kv(), NS, "c", "int4"))
    assert KVStore(tmp_path).get_kv(NS, "c") is None


def test_an_engine_keeps_each_codec_in_its_own_namespace(tiny_pair, tmp_path):
    from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig

    chunking = ChunkConfig(chunk_tokens=24, overlap_tokens=4)
    spaces = {}
    for codec in CODECS:
        with CacheClipEngine(*tiny_pair, tmp_path, EngineConfig(chunk=chunking, store=StoreConfig(kv_codec=codec))) as eng:
            ids = eng.ingest(CORPUS, progress=False)
            spaces[codec] = eng.primary.namespace
            assert eng.answer("What is the code?", chunk_ids=ids[:2], max_new_tokens=2, recompute_ratio=0.5).text
            info = eng.store.usage()["namespaces"][eng.primary.namespace]
            assert info["kv_codec"] == codec and info["bytes_per_token"] > 0
    assert len(set(spaces.values())) == 3
    usage = KVStore(tmp_path).usage()["namespaces"]
    per_token = {c: usage[ns]["bytes_per_token"] for c, ns in spaces.items()}
    assert per_token["bf16"] > per_token["int8"] > per_token["int4"]


def test_the_store_resolves_auto_once_and_reports_the_codec_its_records_carry(tiny_pair, tmp_path):
    """"auto" is resolved by the store alone (`choose_codec`): a new store takes the default for its
    kv_dtype, a store that already holds the model's caches keeps their codec; what the engine
    reports is what its records were written with."""
    from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig
    from cacheclip_rag.storage.record import record_codec

    chunking = ChunkConfig(chunk_tokens=24, overlap_tokens=4)

    def opened(store_dir, cfg: StoreConfig):
        with CacheClipEngine(*tiny_pair, store_dir, EngineConfig(chunk=chunking, store=cfg)) as eng:
            ids = eng.ingest(CORPUS[:2], progress=False)
            ns, reported = eng.primary.namespace, eng.primary.codec
            carried = {record_codec(eng.store.backend.get(ns, i).meta) for i in ids}
            return ns, reported, carried, eng.store.usage()["namespaces"][ns]["kv_codec"]

    ns, reported, carried, recorded = opened(tmp_path / "a", StoreConfig(kv_codec="auto"))
    assert reported == codecs.AUTO_CODEC and carried == {reported} and recorded == reported
    # a dtype asked for keeps caches as they are: "auto" is then bf16
    _, reported, carried, _ = opened(tmp_path / "b", StoreConfig(kv_codec="auto", kv_dtype="float32"))
    assert reported == codecs.DEFAULT_CODEC and carried == {reported}
    # a store written with int4 and opened again with "auto" keeps int4 (the namespace it has)
    first, _, _, _ = opened(tmp_path / "c", StoreConfig(kv_codec="int4"))
    again, reported, carried, _ = opened(tmp_path / "c", StoreConfig(kv_codec="auto"))
    assert again == first and reported == "int4" and carried == {"int4"}
    probe = KVStore(tmp_path / "c", StoreConfig(kv_codec="auto"))
    assert probe.choose_codec(lambda c: first if c == "int4" else "ff" * 16) == "int4"
    assert probe.choose_codec(lambda c: "ee" * 16) == codecs.AUTO_CODEC
