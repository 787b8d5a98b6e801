"""`cacheclip serve --replicas`: engine replicas on Ray Serve (a local Ray instance on 127.0.0.1,
2 CPUs, tiny models): answers equal to one process, one corpus across replicas, chunk-affinity
routing, a killed replica, keys."""

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import CORPUS

from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig
from cacheclip_rag.config import ModelConfig
from cacheclip_rag.serving.access import Keys

ray = pytest.importorskip("ray", reason="ray[serve] is in the `ray` extra that `make test` installs")
from cacheclip_rag.serving import replicas  # noqa: E402  (needs ray at build time only)

PORT = 18765
ASK, ADMIN = "ray-ask-key", "ray-admin-key"
QUESTION = "What is the code in the kitchen drawer?"


def _config():
    return EngineConfig(model=ModelConfig(dtype="float32"), chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4),
                        top_k=2, packets=None)


@pytest.fixture(scope="module")
def service(tiny_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    folders = []
    for name, lm in zip(("primary", "aux"), tiny_pair):
        lm.model.save_pretrained(root / name)
        lm.tokenizer.save_pretrained(root / name)
        folders.append(str(root / name))
    spec = replicas.ReplicaSpec(folders[0], folders[1], str(root / "store"), _config(), threads=1)
    replicas.start(None, "127.0.0.1", PORT, cpus=2)
    try:
        replicas.run(spec, 2, blocking=False, keys=Keys(ASK, ADMIN), default_max_tokens=6, imbalance=1)
        url = f"http://127.0.0.1:{PORT}"
        r = httpx.post(url + "/v1/documents", json={"documents": CORPUS[:4]}, timeout=120, headers=_auth(ADMIN))
        assert r.status_code == 200, r.text
        yield url, spec
    finally:
        replicas.shutdown()


def _auth(key=ASK):
    return {"Authorization": f"Bearer {key}"}


def _alone(spec):
    """One in-process engine as each replica opens it (same folders, same store, same config)."""
    return CacheClipEngine.from_pretrained(spec.primary, spec.aux, spec.store, spec.config)


def _replica_counts() -> dict[int, int]:
    """pid -> requests served, from both replicas (ties between idle replicas are broken at random)."""
    from ray import serve

    handle = serve.get_deployment_handle(replicas.DEPLOYMENT, app_name=replicas.APP)
    seen = {}
    for _ in range(40):
        info = handle.info.remote().result()
        seen[info["pid"]] = info["requests"]
        if len(seen) == 2:
            break
    assert len(seen) == 2, "could not reach both replicas"
    return seen


def _chat(url, content, stream=False, **extra):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 6, "stream": stream, **extra}
    if not stream:
        r = httpx.post(url + "/v1/chat/completions", json=body, headers=_auth(), timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"], r.json()["cacheclip"]["reused_chunk_ids"]
    pieces = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=_auth(), timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and '"delta"' in line:
                import json

                pieces.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
    return "".join(pieces), None


def test_two_replicas_answer_exactly_as_one_process(service, tiny_pair):
    url, spec = service
    with _alone(spec) as alone:
        stuffed = "Context:\n" + CORPUS[1] + "\n\nWhat is written there?"
        for content in (QUESTION, stuffed):
            expected = alone.chat([{"role": "user", "content": content}], max_new_tokens=6)
            text, ids = _chat(url, content)
            assert (text, ids) == (expected.text, expected.chunk_ids)
            assert _chat(url, content, stream=True)[0] == expected.text


def test_a_document_ingested_through_one_replica_is_retrieved_through_the_other(service):
    url, _ = service
    note = "The lighthouse on Kestrel Point was repainted teal in the spring of 1911."
    r = httpx.post(url + "/v1/documents", json={"documents": [note]}, headers=_auth(ADMIN), timeout=120)
    new = set(r.json()["chunk_ids"])
    before = _replica_counts()
    for _ in range(8):
        hits = httpx.post(url + "/v1/retrieve", json={"query": note, "k": 2}, headers=_auth(), timeout=60).json()
        assert new & {h["id"] for h in hits["data"]}  # whichever replica answered, it knows the new chunk
    after = _replica_counts()
    assert all(after[pid] > before[pid] for pid in before), (before, after)  # both replicas retrieved it


def test_the_router_sends_a_request_to_the_replica_holding_its_chunks(service):
    url, _ = service
    stuffed = "Context:\n" + CORPUS[2] + "\n\nSummarize it."
    _chat(url, stuffed)  # its chunk is now in one replica's memory tier
    before = _replica_counts()
    for _ in range(4):
        _chat(url, stuffed)
    after = _replica_counts()
    grew = sorted(after[pid] - before[pid] for pid in before)
    assert grew == [0, 4], (before, after)
    from ray import serve

    handle = serve.get_deployment_handle(replicas.DEPLOYMENT, app_name=replicas.APP)
    reports = [handle.record_routing_stats.remote().result()["chunks"] for _ in range(8)]
    assert any(reports)  # what the router reads: the memory tier's chunks


def test_a_killed_replica_costs_no_wrong_answer_and_no_hang(service, tiny_pair):
    url, spec = service
    with _alone(spec) as alone:
        expected = alone.chat([{"role": "user", "content": QUESTION}], max_new_tokens=6).text
    victim = next(name for name in ray.util.list_named_actors(all_namespaces=True)
                  if "cacheclip-engine" in str(name.get("name", name)))
    victim = ray.get_actor(victim["name"], namespace=victim["namespace"])

    def ask(_):
        start = time.monotonic()
        try:
            r = httpx.post(url + "/v1/chat/completions", headers=_auth(), timeout=90, json={
                "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 6})
            return r.status_code, r.json(), time.monotonic() - start
        except httpx.TimeoutException:
            return "timeout", None, time.monotonic() - start

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(ask, i) for i in range(8)]
        ray.kill(victim, no_restart=False)
        results = [f.result() for f in futures]
    assert all(status != "timeout" for status, _, _ in results)
    for status, body, _ in results:
        assert status == 200 or 500 <= status < 600, (status, body)
        if status == 200:
            assert body["choices"][0]["message"]["content"] == expected  # no wrong answer
    assert sum(status == 200 for status, _, _ in results) >= 4


def test_keys_hold_on_the_ray_ingress_too(service):
    url, _ = service
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}).status_code == 401
    r = httpx.post(url + "/v1/documents", json={"documents": ["x y z"]}, headers=_auth(ASK))
    assert r.status_code == 403


def test_a_folder_store_is_refused_across_nodes():
    with pytest.raises(ValueError, match="only processes on one machine"):
        replicas.check_store("/data/store", nodes=2)
    replicas.check_store("redis://10.0.0.1:6379/0", nodes=3)
    replicas.check_store("/data/store", nodes=1)
    with pytest.raises(ValueError, match="replicas must be"):
        replicas.build(replicas.ReplicaSpec("a", "b", "s"), 0)


def test_a_local_instance_is_quiet_unless_the_environment_says_otherwise():
    env = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1"}
    replicas.quiet(env)
    assert env == {**replicas.QUIET, "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1"}


def test_the_affinity_policy_waits_for_the_holder_unless_queues_are_imbalanced():
    from cacheclip_rag.serving.routing import home, rank

    held = {"a": {"c1", "c2"}, "b": {"c3"}, "c": set()}
    # balanced queues: only the replica holding most of the chunks is offered, so the request waits for it
    assert rank(["a", "b", "c"], {"a": 2, "b": 1, "c": 1}, held, ["c1", "c2", "c3"], imbalance=1) == [["a"]]
    # two holders of a chunk (one got it while the other was busy): its home wins
    both = {"a": {"c1"}, "b": {"c1"}, "c": set()}
    assert home("c1", ["a", "b", "c"]) == "a"  # crc32: the same everywhere
    assert rank(["a", "b", "c"], {"a": 1, "b": 0, "c": 0}, both, ["c1"], imbalance=1) == [["a"]]
    # chunks nobody holds go to their home, so the replicas partition the corpus
    for chunk in ("x1", "x2", "x3", "x4"):
        assert rank(["a", "b"], {"a": 0, "b": 0}, {}, [chunk]) == [[home(chunk, ["a", "b"])]]
    assert {home(f"k{i}", ["a", "b"]) for i in range(32)} == {"a", "b"}  # homes spread over replicas
    assert home("x1", ["a", "b"]) == home("x1", ["b", "a"])  # independent of order
    # imbalanced beyond the bound: every replica, least loaded first
    assert rank(["a", "b", "c"], {"a": 2, "b": 1, "c": 0}, held, ["c1"], imbalance=1) == [["c"], ["b"], ["a"]]
    # no chunk ids (an ingest): least loaded first, all offered
    assert rank(["a", "b"], {"a": 1, "b": 0}, held, [], imbalance=1) == [["b"], ["a"]]
    # the default bound (0): a busier holder is not waited for; an equally loaded one is preferred
    assert rank(["a", "b"], {"a": 1, "b": 0}, {"a": {"c1"}}, ["c1"]) == [["b"], ["a"]]
    assert rank(["a", "b"], {"a": 1, "b": 1}, {"a": {"c1"}}, ["c1"]) == [["a"]]
    # equal loads take turns
    firsts = {rank(["a", "b"], {}, {}, [])[0][0] for _ in range(64)}
    assert firsts == {"a", "b"}
    assert rank([], {}, {}, ["c1"]) == []


def test_serve_refuses_a_negative_route_imbalance(capsys):
    from cacheclip_rag.cli import main

    assert main(["serve", "--replicas", "2", "--route-imbalance", "-1", "--store", "redis://127.0.0.1:1/0"]) == 2
    assert "--route-imbalance must be at least 0" in capsys.readouterr().err
