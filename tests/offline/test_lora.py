"""The concatenation-aware LoRA (peft) on tiny models: disabled == base, training lowers the loss,
the adapter's hash separates namespaces, bad folders are refused by name."""

import json

import pytest
import torch
from conftest import CORPUS, tiny_model

from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig
from cacheclip_rag.cli import main
from cacheclip_rag.corpus.packets import PacketAdapters
from cacheclip_rag.models import lora
from cacheclip_rag.offline.train_lora import LoraTrainConfig, train_lora
from cacheclip_rag.offline.train_packets import kl
from cacheclip_rag.offline.training import examples

SMALL = dict(samples=3, held_out=2, epochs=2, length=96, chunk_tokens=32, answer_tokens=3, batch=1, rank=4, alpha=8,
             lr=5e-3, full_weight=0.3)


@pytest.fixture(scope="module")
def trained(tiny_tokenizer, tmp_path_factory):
    """A fresh tiny primary, its LoRA trained a few steps and saved; (base, peft model, folder, curve)."""
    base = tiny_model("qwen2", tiny_tokenizer, seed=1, layers=3)
    student = tiny_model("qwen2", tiny_tokenizer, seed=1, layers=3)  # trained in place: keep `base` pristine
    peft_model, curve = train_lora(student, LoraTrainConfig(**SMALL))
    folder = tmp_path_factory.mktemp("lora") / "tiny-lora"
    sha = lora.save(peft_model, folder, student, {"curve": curve}, dtype=torch.float32)
    assert len(sha) == 64
    return base, peft_model, folder, student


def _logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids[None]).logits[0]


def test_a_few_steps_lower_the_block_attention_kl(trained):
    """On the training requests (same seeds, teacher = the base model): the block-diagonal
    student's KL with the LoRA on is below the base model's (LoRA off)."""
    base, peft_model, _, student = trained
    prefix, train_set, _ = examples(base, LoraTrainConfig(**SMALL))
    plain = PacketAdapters.initial(student, 0, 0)
    with torch.no_grad():
        tuned = sum(kl(student, plain, prefix, ex).item() for ex in train_set)
        with peft_model.disable_adapter():
            untuned = sum(kl(student, plain, prefix, ex).item() for ex in train_set)
    assert tuned < untuned


def test_curve_records_how_far_full_attention_moved(trained):
    """Held out per epoch: block KL, full-attention KL (0 before training: B = 0) and the weighted
    sum that picks the epoch."""
    _, _, folder, _ = trained
    curve = json.loads((folder / "cacheclip.json").read_text())["curve"]
    weight = LoraTrainConfig(**SMALL).full_weight
    assert [row["epoch"] for row in curve] == [0, 1, 2]
    assert curve[0]["held_out_full_kl"] == pytest.approx(0, abs=1e-5)
    for row in curve:
        assert row["held_out_loss"] == pytest.approx(row["held_out_kl"] + weight * row["held_out_full_kl"])
    (kept,) = [row for row in curve if row["kept"]]  # the epoch whose state the files hold: the lowest loss
    assert kept["held_out_loss"] == min(row["held_out_loss"] for row in curve)


def test_disabled_lora_is_the_base_model_exactly(trained):
    base, peft_model, _, _ = trained
    ids = torch.arange(5, 40)
    with peft_model.disable_adapter():
        assert torch.equal(_logits(peft_model, ids), _logits(base.model, ids))
    assert not torch.allclose(_logits(peft_model, ids), _logits(base.model, ids))  # trained: it does change


def test_merged_adapter_serves_with_its_own_fingerprint_and_namespaces(trained, tiny_pair, tmp_path):
    base, peft_model, folder, _ = trained
    tuned = lora.apply(base, folder)
    ids = torch.arange(5, 40)
    torch.testing.assert_close(_logits(tuned.model, ids), _logits(peft_model, ids), atol=1e-4, rtol=1e-4)
    assert tuned.fingerprint != base.fingerprint and "+lora-" in tuned.name
    _, aux = tiny_pair
    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4), packets=None)
    with CacheClipEngine(base, aux, tmp_path / "a", cfg) as plain, CacheClipEngine(tuned, aux, tmp_path / "b", cfg) as tuned_engine:
        assert plain.primary.namespace != tuned_engine.primary.namespace
        ids = tuned_engine.ingest(CORPUS[:3], progress=False)
        for mode in ("full", "reuse", "cacheblend", "cacheclip"):
            assert tuned_engine.answer("what is the code?", ids, mode=mode, max_new_tokens=2).mode == mode


def test_missing_damaged_or_foreign_adapters_are_refused(trained, tiny_pair, tmp_path):
    base, _, folder, _ = trained
    with pytest.raises(ValueError, match="no such folder"):
        lora.apply(base, tmp_path / "absent")
    _, aux = tiny_pair
    with pytest.raises(ValueError, match="was trained for"):
        lora.apply(aux, folder)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for name in (*lora.FILES, lora.META):
        (damaged / name).write_bytes((folder / name).read_bytes())
    data = bytearray((damaged / "adapter_model.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (damaged / "adapter_model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="damaged"):
        lora.apply(base, damaged)
    (damaged / lora.META).write_text(json.dumps({"kind": "something else"}))
    with pytest.raises(ValueError, match="not of kind"):
        lora.apply(base, damaged)


def test_bad_lora_config_is_refused():
    with pytest.raises(ValueError, match="rank"):
        LoraTrainConfig(rank=0)
    with pytest.raises(ValueError, match="full_weight"):
        LoraTrainConfig(full_weight=-1.0)


def test_train_lora_from_the_command_line(tiny_pair, tmp_path, capsys):
    primary, _ = tiny_pair
    folder = tmp_path / "primary"
    primary.model.save_pretrained(folder)
    primary.tokenizer.save_pretrained(folder)
    out = tmp_path / "lora-out"
    args = ["train", "lora", "--primary", str(folder), "--dtype", "float32", "--out", str(out)]
    for key, value in SMALL.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    assert main(args) == 0
    assert "held-out KL" in capsys.readouterr().out
    assert (out / lora.META).is_file() and (out / "adapter_model.safetensors").is_file()


def test_bf16_storage_and_the_shipped_adapter(trained, tmp_path, monkeypatch):
    """Saved in bf16 (the default) the merged model stays close to the float32 adapter's; a
    "shipped" adapter is found in the package by the base model's name and refused when it does
    not match its pin or none ships."""
    import shutil

    base, peft_model, _, _ = trained
    folder = tmp_path / "pkg" / "tiny-lora"
    sha = lora.save(peft_model, folder, base, {})
    ids = torch.arange(5, 40)
    tuned = lora.apply(base, folder)
    torch.testing.assert_close(_logits(tuned.model, ids), _logits(peft_model, ids), atol=5e-2, rtol=5e-2)
    with pytest.raises(ValueError, match="no LoRA adapter ships for"):
        lora.apply(base, "shipped")
    monkeypatch.setattr(lora, "SHIPPED_DIR", tmp_path / "pkg")
    monkeypatch.setattr(lora, "SHIPPED", {base.name: ("tiny-lora", sha)})
    assert lora.apply(base, "shipped").fingerprint == tuned.fingerprint
    monkeypatch.setattr(lora, "SHIPPED", {base.name: ("tiny-lora", "0" * 64)})
    with pytest.raises(ValueError, match="pinned"):
        lora.apply(base, "shipped")
    shutil.rmtree(folder)
    with pytest.raises(ValueError, match="missing from the installed package"):
        lora.apply(base, "shipped")


def test_the_shipped_lora_matches_its_pin_and_ships_its_own_profile():
    """The package's LoRA for the default primary is present and matches its pinned sha256 (no
    model is loaded); the tuned pair ships a profile calibrated for it."""
    from types import SimpleNamespace

    from cacheclip_rag.request.profile_source import shipped

    (base, (folder, sha)), = lora.SHIPPED.items()
    path = lora.resolve("shipped", SimpleNamespace(name=base))
    assert path.name == folder and lora.files_digest(path) == sha
    tuned = shipped(lora.tuned_name(base, sha), "smollm2-135m-instruct")
    assert [p.source for p in tuned] == ["shipped"]  # calibrated for the tuned pair itself
    assert tuned[0].primary_name == lora.tuned_name(base, sha)
    assert shipped(lora.tuned_name(base, "0" * 64), "smollm2-135m-instruct") == []


def test_a_shipped_tuned_pair_without_its_own_profile_takes_its_base_pairs(tmp_path, monkeypatch):
    """The fallback for a shipped LoRA not yet calibrated: the base pair's profiles, marked so."""
    import shutil

    from cacheclip_rag.request import profile_source as profile

    (base, (_, sha)), = lora.SHIPPED.items()
    name = f"{base}+smollm2-135m-instruct.json"
    shutil.copy(profile.SHIPPED_DIR / name, tmp_path / name)  # the base pair's file only
    monkeypatch.setattr(profile, "SHIPPED_DIR", tmp_path)
    tuned = profile.shipped(lora.tuned_name(base, sha), "smollm2-135m-instruct")
    base_profiles = profile.shipped(base, "smollm2-135m-instruct")
    assert [p.source for p in tuned] == ["shipped for the base primary"] * len(base_profiles)
    assert [p.aux_layers for p in tuned] == [p.aux_layers for p in base_profiles]
