"""Shared fixtures: tiny random Llama / Qwen2 models with a small byte-level BPE tokenizer.

TRITON_INTERPRET must be set before anything imports triton (transformers' model code can), so
it is set here, first.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from cacheclip_rag.models.loading import wrap  # noqa: E402

CORPUS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Alice keeps the blue key in the kitchen drawer; the code is 4721-9930.",
    "Qwen and SmolLM tokenize text differently, splitting digits and words.",
    "Café déjà vu: naïve façade, 東京 and Zürich, numbers 3.14159 and 2718281828.",
    "Question: what is the secret number? Answer briefly using the context above.",
    "uuid 123e4567-e89b-12d3-a456-426614174000 marks the record of the archive.",
]


def _tokenizer():
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return _tokenizer()


DEVICE = os.environ.get("CACHECLIP_TEST_DEVICE", "cpu")
"""Where the tiny models run: the GPU check runs the recompute oracles with it set to cuda."""

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]
WINDOW = 12
"""Sliding window of the tiny windowed families: well under a test request's length (~90 tokens)."""


def tiny_model(kind: str, tokenizer, seed: int = 0, layers: int = 3):
    """A tiny random model of one family. qwen2 is the plain Qwen2 shape; qwen3, mistral and
    gemma3 attend through a WINDOW-token sliding window (on some layers for qwen3 and gemma3,
    on every layer for mistral); gemma3 also has two RoPE thetas and final logit soft-capping."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    if kind == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, rope_theta=10000.0))
    elif kind == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, rope_theta=1e5))
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=16, rope_theta=1e6, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
        model = tf.Qwen3ForCausalLM(cfg)
    elif kind == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**common, rope_theta=1e4, sliding_window=WINDOW))
    elif kind == "gemma3":
        types = ["sliding_attention" if i % 3 != 2 else "full_attention" for i in range(layers)]
        rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e6}, "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
        cfg = tf.Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW, layer_types=types,
                                  rope_parameters=rope, final_logit_softcapping=30.0, pad_token_id=tokenizer.eos_token_id)
        model = tf.Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(kind)
    model = model.to(torch.float32).to(DEVICE).eval()
    # Random init gives near-uniform attention; sharper weights make the oracles meaningful.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "proj" in name and "weight" in name:
                p.mul_(4.0)
    return wrap(model, tokenizer, name=f"tiny-{kind}-{seed}")


@pytest.fixture(scope="session", params=FAMILIES)
def tiny_lm(request, tiny_tokenizer):
    """One tiny model per supported family (the correctness oracles run on each)."""
    return tiny_model(request.param, tiny_tokenizer, layers=4 if request.param == "gemma3" else 3)


@pytest.fixture(scope="session")
def tiny_pair(tiny_tokenizer):
    """(primary, aux): a Qwen2-shaped primary and a Llama-shaped aux."""
    return tiny_model("qwen2", tiny_tokenizer, seed=1, layers=3), tiny_model("llama", tiny_tokenizer, seed=2, layers=2)


@pytest.fixture(scope="session")
def real_engine(tmp_path_factory):
    """The default pair with the shipped demo corpus ingested (one per test session)."""
    from cacheclip_rag import CacheClipEngine
    from cacheclip_rag.cli.demo import demo_documents

    engine = CacheClipEngine.from_pretrained(store_dir=tmp_path_factory.mktemp("real-store"))
    engine.ingest(demo_documents(), progress=False)
    return engine


# ----- Redis: the server .ci/run starts (CACHECLIP_TEST_REDIS), else a private one -------------

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server process of the test's own on 127.0.0.1 (stopped by `stop`)."""

    def __init__(self):
        import shutil
        import subprocess
        import time

        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        self.port = _free_port()
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        client.close()
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="session")
def redis_url():
    """A Redis server for the tests: CI's (CACHECLIP_TEST_REDIS), else one started here; in CI a
    missing server fails the tests that need it instead of skipping them."""
    url = os.environ.get("CACHECLIP_TEST_REDIS")
    if url:
        yield url
        return
    try:
        server = RedisServer()
    except (FileNotFoundError, ImportError) as err:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"no Redis server: {err}")
    yield server.url
    server.stop()


@pytest.fixture
def redis_store_url(redis_url):
    """A fresh, empty store (its own key prefix) in the test Redis; flushed afterwards."""
    import uuid

    from cacheclip_rag.storage.backends.redis import RedisBackend

    url = f"{redis_url}?prefix=test-{uuid.uuid4().hex[:12]}"
    yield url
    backend = RedisBackend(url)
    backend.flush()
    backend.close()


@pytest.fixture(scope="module")
def folders(tiny_pair, tmp_path_factory):
    """The tiny pair saved as local model folders (what the command line loads): [primary, aux]."""
    root = tmp_path_factory.mktemp("models")
    out = []
    for name, lm in zip(("primary", "aux"), tiny_pair):
        path = root / name
        lm.model.save_pretrained(path)
        lm.tokenizer.save_pretrained(path)
        out.append(str(path))
    return out
