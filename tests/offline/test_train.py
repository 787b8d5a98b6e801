"""`cacheclip train packet` on a tiny model: it trains, writes pinned adapters, and loading checks them."""

import pytest
import torch

from cacheclip_rag.cli import main
from cacheclip_rag.config import ModelConfig
from cacheclip_rag.corpus.packets import load_adapters
from cacheclip_rag.models.loading import load
from cacheclip_rag.offline.training import TrainConfig


@pytest.fixture
def folder(tiny_pair, tmp_path):
    primary, _ = tiny_pair
    path = tmp_path / "primary"
    primary.model.save_pretrained(path)
    primary.tokenizer.save_pretrained(path)
    return path


def test_train_packet_writes_adapters_that_load_and_serve(folder, tiny_pair, tmp_path, capsys):
    out = tmp_path / "adapters.safetensors"
    rc = main(["train", "packet", "--primary", str(folder), "--dtype", "float32", "--out", str(out), "--samples", "2",
               "--held-out", "1", "--epochs", "2", "--length", "96", "--chunk-tokens", "32", "--answer-tokens", "3",
               "--n-header", "2", "--n-trailer", "2"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "held-out KL" in text and "sha256" in text
    lm = load(str(folder), ModelConfig(dtype="float32"))  # as trained: a bf16 load is another fingerprint
    adapters = load_adapters(out, lm)
    assert adapters.header.shape == (2, lm.config.hidden_size) and adapters.header.dtype == torch.float32

    # The trained file serves the packet modes through the CLI's benches, side by side with the rest.
    _, aux = tiny_pair
    aux_folder = tmp_path / "aux"
    aux.model.save_pretrained(aux_folder)
    aux.tokenizer.save_pretrained(aux_folder)
    store = str(tmp_path / "store")
    rc = main(["bench", "niah", "--store", store, "--dtype", "float32", "--primary", str(folder), "--aux", str(aux_folder), "--adapters",
               str(out), "--lengths", "150", "--samples", "1", "--variants", "single_2", "--modes", "reuse", "packet",
               "packet+cacheclip", "--ratios", "0.5", "--chunk-tokens", "48", "--max-new-tokens", "2"])
    printed = capsys.readouterr().out
    assert rc == 0 and "packet+cacheclip@0.5" in printed and "packet " in printed
    assert main(["store", "stats", "--store", store, "--dtype", "float32", "--adapters", str(out)]) == 0
    assert "KV Packet adapters" in capsys.readouterr().out


def test_damaged_or_foreign_adapters_are_refused(folder, tmp_path, tiny_pair):
    from cacheclip_rag.corpus.packets import PacketAdapters
    from cacheclip_rag.offline.train_packets import save_adapters

    lm = load(str(folder))
    path = tmp_path / "a.safetensors"
    save_adapters(path, PacketAdapters.initial(lm, 2, 2), lm, TrainConfig(), [])
    assert load_adapters(path, lm).header.shape[0] == 2
    _, aux = tiny_pair
    with pytest.raises(ValueError, match="adapters for model"):
        load_adapters(path, aux)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=str(path.name)):
        load_adapters(path, lm)
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(ValueError, match="junk.safetensors: not a readable"):
        load_adapters(tmp_path / "junk.safetensors", lm)


@pytest.mark.parametrize("field, value", [("samples", 0), ("epochs", -1), ("lr", 2.0), ("length", 1.5),
                                          ("kinds", ("needle", "recipes")), ("kinds", ()), ("kinds", ("prose", "prose"))])
def test_bad_training_config_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**{field: value})


def test_notes_requests_give_short_titled_documents_holding_both_hops(tiny_tokenizer):
    """`notes`: each note its own document, the two-hop question's facts among them; same seed, same request."""
    from cacheclip_rag.offline.traindata import make_request

    a, b = make_request("notes", 200, 7, tiny_tokenizer), make_request("notes", 200, 7, tiny_tokenizer)
    assert a == b and len(a.documents) >= 5
    assert [d.split("\n")[0] for d in a.documents] == [f"Note {i}" for i in range(1, len(a.documents) + 1)]
    subject = a.question.removeprefix("In which region did ").removeprefix("What is the profession of the sibling of ")
    subject = subject.removesuffix(" grow up?").removesuffix("?")
    assert sum(subject in d for d in a.documents) >= 1
    assert all(len(d) < 250 for d in a.documents)  # one to three short sentences


def test_packet_training_keeps_its_mix_and_lora_adds_notes():
    """The shipped packet adapters were trained on needle/twohop/prose; the LoRA also reads notes."""
    from cacheclip_rag.offline.train_lora import LoraTrainConfig

    assert TrainConfig().kinds == ("needle", "twohop", "prose")
    assert LoraTrainConfig().kinds[-1] == "notes"
    assert TrainConfig(kinds=["prose"]).kinds == ("prose",)


def test_recompute_in_the_loop_trains_on_served_requests_and_lowers_the_loss(tiny_pair, tmp_path):
    """Packets trained with CacheClip's recompute in the loop: the requests are made as an engine
    serves them (separators between chunks, the aux model's picks at the ratio), the student is
    the parallel form with those rows recomputed, and a few epochs lower the held-out KL from
    where the given starting adapters were."""
    from cacheclip_rag.config import EngineConfig
    from cacheclip_rag.corpus.packets import PacketAdapters
    from cacheclip_rag.engine import CacheClipEngine
    from cacheclip_rag.offline.train_packets import train

    primary, aux = tiny_pair
    cfg = TrainConfig(samples=3, held_out=2, epochs=3, length=120, chunk_tokens=40, answer_tokens=3, batch=1,
                      lr=0.01, recompute=0.3, kinds=("needle",))
    with pytest.raises(ValueError, match="needs an engine"):
        train(primary, cfg)
    start = PacketAdapters.initial(primary, 2, 2, seed=5)
    with CacheClipEngine(primary, aux, tmp_path / "scratch", EngineConfig(packets=None)) as engine:
        adapters, curve = train(primary, cfg, engine=engine, init=start)
    assert curve[0]["held_out_kl"] > min(row["held_out_kl"] for row in curve[1:])
    assert adapters.shape == (2, 2) and adapters.digest() != start.digest()
    assert [row["epoch"] for row in curve] == [0, 1, 2, 3]


def test_served_examples_carry_the_engines_picks(tiny_pair, tmp_path):
    """A served training request: its documents are the chunks' primary tokens, the separator is
    the engine's, and the picked rows are the cacheclip plan's at the ratio (more at a higher one)."""
    from cacheclip_rag.config import EngineConfig
    from cacheclip_rag.engine import CacheClipEngine
    from cacheclip_rag.offline.training import served_example

    primary, aux = tiny_pair
    with CacheClipEngine(primary, aux, tmp_path / "scratch", EngineConfig(packets=None)) as engine:
        low = served_example(engine, "needle", 11, TrainConfig(length=120, chunk_tokens=40, recompute=0.1))[1]
        prefix, high = served_example(engine, "needle", 11, TrainConfig(length=120, chunk_tokens=40, recompute=0.5))
        plain = served_example(engine, "needle", 11, TrainConfig(length=120, chunk_tokens=40))[1]
    assert len(high.docs) >= 3 and high.between is not None and plain.picked is None
    assert sum(p.numel() for p in high.picked) > sum(p.numel() for p in low.picked) > 0
    assert all(int(p.max()) < d.numel() for p, d in zip(high.picked, high.docs) if p.numel())
    assert torch.equal(high.teacher, plain.teacher)  # the teacher reads the same served sequence


def test_recompute_in_the_loop_is_for_packets_only():
    from cacheclip_rag.offline.train_lora import LoraTrainConfig

    with pytest.raises(ValueError, match="recompute"):
        TrainConfig(recompute=1.5)
    with pytest.raises(ValueError, match="LoRA takes recompute=0"):
        LoraTrainConfig(recompute=0.2)


def test_cli_trains_with_recompute_from_given_adapters(folder, tiny_pair, tmp_path, capsys):
    from cacheclip_rag.corpus.packets import PacketAdapters
    from cacheclip_rag.offline.train_packets import save_adapters

    _, aux = tiny_pair
    aux_folder = tmp_path / "aux"
    aux.model.save_pretrained(aux_folder)
    aux.tokenizer.save_pretrained(aux_folder)
    lm = load(str(folder), ModelConfig(dtype="float32"))
    start = tmp_path / "start.safetensors"
    save_adapters(start, PacketAdapters.initial(lm, 2, 3, seed=3), lm, TrainConfig(), [])
    out = tmp_path / "trained.safetensors"
    rc = main(["train", "packet", "--primary", str(folder), "--aux", str(aux_folder), "--dtype", "float32", "--out",
               str(out), "--init", str(start), "--recompute", "0.3", "--samples", "2", "--held-out", "1", "--epochs",
               "1", "--length", "96", "--chunk-tokens", "32", "--answer-tokens", "2"])
    assert rc == 0 and "sha256" in capsys.readouterr().out
    trained = load_adapters(out, lm)
    assert trained.shape == (2, 3)  # the starting adapters' shape, not the config's default 8/8
    assert main(["train", "lora", "--primary", str(folder), "--out", str(tmp_path / "l"), "--init", str(start)]) == 2
    assert "--init" in capsys.readouterr().err
