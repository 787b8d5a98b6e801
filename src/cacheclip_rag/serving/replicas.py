"""Engine replicas on Ray Serve: one OpenAI-compatible service over N engines sharing one store.

    HTTP -> Ingress (the FastAPI app of `server.py`, over a `RemoteEngine`)
              | resolves each request's chunk ids (`CorpusView`: recognizes stored chunk text,
              | or retrieves; no model runs), passes them as `route_chunks`
              v
            ChunkAffinityRouter (`routing.py`): the replica holding most of those chunks in
              | its memory tier, unless the queues are imbalanced
              v
            EngineReplica x N: a `CacheClipEngine` each (models loaded once per replica)
              |
            the shared store (redis://..., or a folder on one machine)

The replicas answer exactly as one process would: each request is prepared by the replica from
the request itself (the ingress's chunk ids only choose where it runs). A document ingested
through any replica is served by every other at once (engines catch up with the store before
they read the corpus). A replica that dies before a request starts answering is retried on
another; one that dies mid-stream ends that stream with an error event.

`ray[serve]` is an optional extra (`pip install 'cacheclip-rag[ray]'`); nothing here imports Ray
until a service is built.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

from ..config import EngineConfig
from ..corpus.index import ChunkIndex
from ..corpus.ingest import Ingestor
from ..corpus.recognize import ChunkMatcher
from ..request.answer import Answer
from ..storage.store import open_store
from .access import Keys
from .routing import ROUTE_KWARG

log = logging.getLogger(__name__)

DEPLOYMENT = "cacheclip-engine"
APP = "cacheclip"
RETRIES = 2
"""Times a request whose replica died before it started answering is sent to another."""


@dataclass(frozen=True)
class ReplicaSpec:
    """What each replica opens: the two models (embedded names or folders on every node), the
    store URL or folder, the engine config, and the torch threads it may use."""

    primary: str
    aux: str
    store: str
    config: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    threads: int = 1


@dataclass
class Finished:
    """The last item a replica's stream yields: the answer, the selection trace, and the
    replica's store counters after it (`CacheClipEngine.stats`, with its pid)."""

    answer: Answer
    trace: list[dict]
    stats: dict


READY = "__cacheclip_ready__"
"""The first item a replica's stream yields, once the request is prepared (bad input raises before)."""


class EngineReplica:
    """A Ray Serve deployment class: one engine; streams yield READY, the text pieces, Finished."""

    def __init__(self, spec: ReplicaSpec):
        import torch

        from ..engine import CacheClipEngine

        torch.set_num_threads(max(1, spec.threads))
        self.engine = CacheClipEngine.from_pretrained(spec.primary, spec.aux, spec.store, spec.config, warm_up=True)
        self.requests = 0
        log.info("replica %d ready: %s + %s on %s", os.getpid(), spec.primary, spec.aux, spec.store)

    def _stream(self, stream):
        yield READY
        yield from stream
        yield Finished(stream.answer, stream.trace, {"pid": os.getpid(), **self.engine.stats()})

    def chat(self, messages: list[dict], chunk_ids, retrieve: bool, k, options: dict, route_chunks=None):
        self.requests += 1
        yield from self._stream(self.engine.stream_chat(messages, chunk_ids, retrieve=retrieve, k=k, **options))

    def generate(self, prompt: str, chunk_ids, retrieve: bool, k, options: dict, route_chunks=None):
        self.requests += 1
        yield from self._stream(self.engine.stream_generate(prompt, chunk_ids, retrieve=retrieve, k=k, **options))

    def ingest(self, documents: list, split: bool = True, packets: bool = False, route_chunks=None) -> list[str]:
        self.requests += 1
        return self.engine.ingest(documents, progress=False, split=split, packets=packets)

    def retrieve(self, query: str, k, route_chunks=None) -> list[tuple[str, float]]:
        self.requests += 1
        return self.engine.retrieve(query, k)

    def chunk_texts(self, chunk_ids: list[str], route_chunks=None) -> list[tuple[str, str]]:
        return self.engine.chunk_texts(chunk_ids)

    def info(self, route_chunks=None) -> dict:
        stats = self.engine.store.stats
        return {**self.engine.info(), "pid": os.getpid(), "requests": self.requests, "memory_hits": stats.memory_hits,
                "disk_hits": stats.disk_hits, "misses": stats.misses}

    def record_routing_stats(self) -> dict:
        """Polled by Ray Serve for the router: the chunks in this replica's memory tier."""
        return {"chunks": self.engine.cached_chunks()}


class CorpusView:
    """The ingress's read-only view of the shared corpus (chunk texts, their stored embeddings,
    the FAISS index, the prompt matcher), caught up with the store before each use: enough to
    name a request's chunks without a model."""

    def __init__(self, store: str, config: EngineConfig):
        self.store = open_store(store, config.store)
        self.index = ChunkIndex(self.store.index_dir(), config.embedder, config.index)
        self.matcher = ChunkMatcher()
        self.top_k = config.top_k
        self._sync = Ingestor(self.store, self.index, self.matcher, [], config.chunk)
        self._sync.catch_up()

    def chunks_for(self, texts: list[str], query: str | None, chunk_ids, retrieve: bool, k) -> list[str]:
        """The chunk ids a request will read, as far as routing needs them: the given ids, else
        the stored chunk texts found in its texts, else (retrieve) the top-k for its query."""
        if chunk_ids:
            return list(chunk_ids)
        self._sync.catch_up()
        found = [cid for text in texts if text for _, _, cid in self.matcher.find(text, None)]
        if found or not retrieve or not query or len(self.index) == 0:
            return found
        return [cid for cid, _ in self.index.search(query, k or self.top_k)]


class RemoteStream:
    """An `AnswerStream` whose text comes from a replica: iterate for pieces; `.answer` and
    `.trace` once done; `collect()`."""

    def __init__(self, responses, on_finish=None):
        self._responses, self._on_finish = responses, on_finish
        first = self._next()
        if first != READY:
            raise RuntimeError(f"a replica's stream began with {first!r}, not the ready marker")
        self.answer: Answer | None = None
        self.trace: list[dict] = []

    def _next(self):
        return _unwrapped(lambda: next(self._responses))

    def __iter__(self) -> RemoteStream:
        return self

    def __next__(self) -> str:
        if self.answer is not None:
            raise StopIteration
        item = self._next()
        if isinstance(item, Finished):
            self.answer, self.trace = item.answer, item.trace
            if self._on_finish is not None:
                self._on_finish(item.stats)
            raise StopIteration
        return item

    def collect(self) -> Answer:
        for _ in self:
            pass
        if self.answer is None:
            raise RuntimeError("the replica's stream ended without an answer")
        return self.answer


def _unwrapped(call):
    """call() with a replica's ValueError re-raised as itself (Ray wraps it)."""
    try:
        return call()
    except Exception as err:
        cause = getattr(err, "cause", None)
        if isinstance(cause, ValueError):
            raise cause from None
        raise


class RemoteEngine:
    """What `server.create_app` serves, backed by the replicas: the methods of `CacheClipEngine`
    that the routes call, each sent through the deployment handle (and its router)."""

    def __init__(self, handle, corpus: CorpusView, primary: str, aux: str):
        self.handle, self.corpus = handle, corpus
        self.models = {"model": primary, "aux": aux}
        self._replica_stats: dict[int, dict] = {}
        """Each replica's last reported store counters, by pid."""

    def _stream(self, method: str, route: list[str], *args) -> RemoteStream:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        for attempt in range(RETRIES + 1):
            call = getattr(self.handle.options(stream=True), method)
            try:
                return RemoteStream(call.remote(*args, **{ROUTE_KWARG: route}), self._record)
            except (ActorDiedError, ActorUnavailableError, RayActorError) as err:
                if attempt == RETRIES:
                    raise RuntimeError(f"no engine replica could take the request ({err})") from err
                log.warning("replica lost before answering (%s); retrying on another", type(err).__name__)
        raise AssertionError("unreachable")

    def _call(self, method: str, *args, route: list[str] | None = None) -> Any:
        return _unwrapped(lambda: getattr(self.handle, method).remote(*args, **{ROUTE_KWARG: route or []}).result())

    def stream_chat(self, messages: list[dict], chunk_ids=None, *, retrieve: bool = True, k=None, **options):
        contents = [m.get("content") if isinstance(m.get("content"), str) else "" for m in messages]
        last_user = next((c for m, c in zip(reversed(messages), reversed(contents)) if m.get("role") == "user"), None)
        route = self.corpus.chunks_for(contents, last_user, chunk_ids, retrieve, k)
        return self._stream("chat", route, messages, chunk_ids, retrieve, k, options)

    def stream_generate(self, prompt: str, chunk_ids=None, *, retrieve: bool = True, k=None, **options):
        route = self.corpus.chunks_for([prompt], prompt, chunk_ids, retrieve, k)
        return self._stream("generate", route, prompt, chunk_ids, retrieve, k, options)

    def ingest(self, documents: list, progress: bool = False, split: bool = True, packets: bool = False) -> list[str]:
        return self._call("ingest", documents, split, packets)

    def retrieve(self, query: str, k=None) -> list[tuple[str, float]]:
        return self._call("retrieve", query, k)

    def chunk_texts(self, chunk_ids: list[str]) -> list[tuple[str, str]]:
        return self._call("chunk_texts", chunk_ids)

    def info(self) -> dict:
        """The models, the modes and the chunks the store holds now (no replica is asked: the
        health route calls this on the event loop)."""
        from ..engine import CacheClipEngine

        return {**self.models, "chunks": self.corpus.store.chunk_count(), "modes": list(CacheClipEngine.modes())}

    def _record(self, stats: dict) -> None:
        self._replica_stats[stats["pid"]] = stats

    def stats(self) -> dict:
        """The replicas' store counters summed (as each last reported them with an answer)."""
        seen = list(self._replica_stats.values())
        keys = {k for s in seen for k in s if k != "pid"} or {"memory_hits", "disk_hits", "misses", "writes"}
        total = {k: sum(s.get(k, 0) for s in seen) for k in sorted(keys)}
        return {**total, "replicas_reporting": len(seen)}


class Ingress:
    """The Ray Serve ingress: `server.create_app` over a `RemoteEngine` (built on the replica)."""

    def __init__(self, engines, spec: ReplicaSpec, keys: Keys, limits: dict):
        self._engines, self._spec, self._keys, self._limits = engines, spec, keys, limits

    def __serve_build_asgi_app__(self):
        from .server import create_app

        spec = self._spec
        remote = RemoteEngine(self._engines, CorpusView(spec.store, spec.config), spec.primary, spec.aux)
        return create_app(remote, keys=self._keys, **self._limits)


ROUTERS = {"chunk-affinity": "cacheclip_rag.serving.routing:ChunkAffinityRouter",
           "default": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"}
"""`--router` choices: ours, and Ray Serve's default (power of two choices) to compare with."""


def check_store(store: str, nodes: int) -> None:
    """A folder store is shared only by processes on one machine; refuse it across nodes."""
    if "://" not in store and nodes > 1:
        raise ValueError(f"store {store!r} is a folder, which only processes on one machine can share, but the Ray "
                         f"cluster has {nodes} nodes; use a shared store such as redis://host:6379/0")


def build(spec: ReplicaSpec, replicas: int, *, router: str = "chunk-affinity", keys: Keys | None = None,
          max_active: int = 2, max_waiting: int = 8, default_max_tokens: int | None = None,
          model_name: str | None = None, routing_stats_period_s: float = 1.0, imbalance: int | None = None):
    """The Ray Serve application: the ingress over `replicas` engine replicas. max_active is per
    replica (its `max_ongoing_requests`); the ingress admits max_active x replicas at once and
    queues max_waiting more (503 beyond). imbalance: the chunk-affinity router's load bound
    (`routing.IMBALANCE` when None)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be a positive integer, got {replicas!r}")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {sorted(ROUTERS)}, got {router!r}")
    engines = serve.deployment(EngineReplica, name=DEPLOYMENT, num_replicas=replicas, max_ongoing_requests=max_active,
                               ray_actor_options={"num_cpus": spec.threads},
                               request_router_config=RequestRouterConfig(
                                   request_router_class=ROUTERS[router],
                                   request_router_kwargs={"imbalance": imbalance} if (
                                       router == "chunk-affinity" and imbalance is not None) else {},
                                   request_routing_stats_period_s=routing_stats_period_s))
    ingress = serve.deployment(serve.ingress()(Ingress), name="cacheclip-ingress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=max(64, 4 * (max_active * replicas + max_waiting)))
    limits = {"max_active": max_active * replicas, "max_waiting": max_waiting, "model_name": model_name}
    if default_max_tokens is not None:
        limits["default_max_tokens"] = default_max_tokens
    return ingress.bind(engines.bind(spec), spec, keys or Keys(), limits)


QUIET = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1.0", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
         "RAY_enable_metrics_collection": "0"}
"""Ray and Ray Serve background loops slowed for a local instance, unless the environment sets
them: the Serve controller reconciles every 1 s (not 0.1 s), cached Serve metrics export every
1 s, and Ray's metrics collection is off (this service reads its own counters, `/v1/stats`).
Idle, a 1-replica service then took 7.7% of one core instead of 13% (2-core AVX512 host,
`docs/scale-out.md`); on few cores that is taken from the replicas. Read when Ray's processes
start, so on a cluster joined with `--ray-address` they are the cluster's own settings."""


def quiet(environ) -> None:
    """`QUIET`'s settings into environ (a mapping such as os.environ) where it has none of its own."""
    for name, value in QUIET.items():
        environ.setdefault(name, value)


def start(address: str | None, host: str, port: int, cpus: int | None = None) -> int:
    """Join the Ray cluster at `address`, or start a local one on 127.0.0.1 (with `QUIET`'s
    settings where the environment leaves them unset); start Serve's HTTP proxy on host:port.
    Returns the number of nodes."""
    import ray
    from ray import serve

    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    else:
        quiet(os.environ)
        ray.init(num_cpus=cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1")
    serve.start(http_options={"host": host, "port": port})
    return len([n for n in ray.nodes() if n.get("Alive")])


def run(spec: ReplicaSpec, replicas: int, *, blocking: bool = True, **options):
    """Deploy the application (after `start`); blocks serving when blocking."""
    from ray import serve

    return serve.run(build(spec, replicas, **options), name=APP, route_prefix="/", blocking=blocking)


def shutdown() -> None:
    """Stop Serve and disconnect from (or stop the local) Ray."""
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()
