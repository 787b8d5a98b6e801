"""One engine process over a shared store, for tests/serving/test_scale_out.py.

    python redis_worker.py STORE_URL ingest      ingest the test corpus; print the chunk ids
    python redis_worker.py STORE_URL answer IDS  answer from those chunks in every mode; print
                                                 the answers and how many caches it encoded
The tiny models are rebuilt from their seeds, so both processes hold the same weights.
"""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

from conftest import CORPUS, _tokenizer, tiny_model  # noqa: E402

from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig
from cacheclip_rag.corpus import caches  # noqa: E402

QUESTION = "What is the secret number in the kitchen drawer?"
MODES = [("full", 1.0), ("reuse", 0.0), ("cacheblend", 0.5), ("cacheclip", 0.5)]


def main() -> None:
    url, action = sys.argv[1], sys.argv[2]
    encoded = []
    real = caches.encode_segment
    caches.encode_segment = lambda lm, prefix_ids, text: encoded.append(text) or real(lm, prefix_ids, text)
    tok = _tokenizer()
    primary, aux = tiny_model("qwen2", tok, seed=1, layers=3), tiny_model("llama", tok, seed=2, layers=2)
    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4))
    with CacheClipEngine(primary, aux, url, cfg) as engine:
        if action == "ingest":
            out = {"ids": engine.ingest(CORPUS, progress=False)}
        else:
            ids = json.loads(sys.argv[3])
            out = {f"{m}@{r}": engine.answer(QUESTION, chunk_ids=ids, mode=m, recompute_ratio=r, max_new_tokens=6).text
                   for m, r in MODES}
            out["retrieved"] = [cid for cid, _ in engine.retrieve(QUESTION, 3)]
        out["encoded"] = len(encoded)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
