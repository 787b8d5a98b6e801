"""Chunk-affinity request routing for engine replicas on Ray Serve (its custom `RequestRouter` API).

A request's chunk caches are read from the shared store once and then kept in the memory tier of
the replica that served it; a later request over the same chunks finds them there only if it
lands on that replica. The ingress resolves each request's chunk ids before routing (recognizing
stored chunk text in the prompt, or retrieving; no model runs) and passes them as the keyword
argument `route_chunks`. This router offers a request only to the replicas that hold most of
those chunks (what each last reported through `record_routing_stats`, its memory tier's chunk
ids, plus what this router sent it in the last few seconds, which a report may not show yet),
so when they are busy the request waits for them (Ray Serve asks the router again after a short
backoff) instead of spilling to a replica that would read its chunks from the store. Each chunk
also has a home replica (rendezvous hashing of chunk and replica ids): chunks no replica holds
go to their home, and of two replicas holding a chunk (one got it while the other was busy) the
home wins, so the replicas' tiers partition the corpus instead of each holding all of it. When
the queues differ by more than `imbalance` requests, locality gives way to load and every
replica is offered, least loaded first: the balance Ray Serve LLM's prefix-cache-affinity router
strikes for prompt prefixes. Requests without chunk ids (ingests) go to the least loaded replica.

Queue lengths are this router's own count of the requests it has routed and not yet seen
complete (one ingress routes every request, so the count is the replicas' load).
"""

from __future__ import annotations

import random
import time
import zlib
from collections import defaultdict

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

ROUTE_KWARG = "route_chunks"
"""The keyword argument a routed call carries its chunk ids in."""
IMBALANCE = 0
"""The default queue-length gap beyond which load outranks locality: 0, affinity among equally
loaded replicas only, so no request waits for a holder (measured on CPU replicas over a local
store, where a miss costs milliseconds and a wait a request: docs/scale-out.md). Raise it where
a miss costs more than a wait."""
REMEMBERED = 4096
"""Chunk ids remembered per replica from routing (beyond what it reports), at most."""
FRESH_S = 5.0
"""How long a chunk sent to a replica counts as held there without its report saying so (the
replicas report every second; what a report leaves out after that was evicted, or never kept)."""


class ChunkAffinityRouter(RequestRouter):
    def initialize_state(self, imbalance: int = IMBALANCE, **kwargs) -> None:
        """imbalance: the queue-length gap beyond which the least loaded replica goes first."""
        self._imbalance = imbalance
        self._running: dict[ReplicaID, int] = defaultdict(int)
        self._routed: dict[ReplicaID, dict[str, float]] = defaultdict(dict)  # chunk id -> when, oldest first
        self._requests: dict[str, ReplicaID] = {}

    def holds(self, replica: RunningReplica) -> set[str]:
        """The chunk ids `replica` is expected to hold in its memory tier."""
        reported = (replica.routing_stats or {}).get("chunks", ())
        since = time.monotonic() - FRESH_S
        recent = self._routed.get(replica.replica_id, {})
        return set(reported) | {cid for cid, at in recent.items() if at >= since}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        chunks = (pending_request.kwargs.get(ROUTE_KWARG) or ()) if pending_request else ()
        by_id = {r.replica_id: r for r in candidate_replicas}
        load = {i: self._running[i] for i in by_id}
        held = {i: self.holds(r) for i, r in by_id.items()} if chunks else {}
        return [[by_id[i] for i in group] for group in rank(list(by_id), load, held, chunks, self._imbalance)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        self._running[replica_id] += 1
        self._requests[pending_request.metadata.internal_request_id] = replica_id
        routed, now = self._routed[replica_id], time.monotonic()
        for cid in pending_request.kwargs.get(ROUTE_KWARG) or ():
            routed.pop(cid, None)
            routed[cid] = now
        while routed and (len(routed) > REMEMBERED or next(iter(routed.values())) < now - FRESH_S):
            routed.pop(next(iter(routed)))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._requests.pop(internal_request_id, None) is not None:
            self._running[replica_id] = max(0, self._running[replica_id] - 1)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self._running.pop(replica_id, None)
        self._routed.pop(replica_id, None)
        super().on_replica_actor_died(replica_id)


def home(chunk: str, replicas: list):
    """The chunk's home among `replicas`: the one with the highest crc32 of (chunk, replica)
    (rendezvous hashing: stable, and a replica's leaving moves only its own chunks)."""
    return max(replicas, key=lambda r: zlib.crc32(f"{chunk}|{r}".encode()))


def rank(replicas: list, load: dict, held: dict, chunks, imbalance: int = IMBALANCE) -> list[list]:
    """The groups of replica ids to offer a request, in order (Ray Serve tries each group's least
    loaded free replica, then the next group, then backs off and asks again).

    replicas: the candidates; load: id -> requests running; held: id -> chunk ids it holds;
    chunks: the request's chunk ids. With chunks and queues within `imbalance` of each other:
    one group, the replicas holding the most of them, and of those the ones that are home to
    the most of them (least loaded first), so the request waits for them. Otherwise every
    replica, least loaded first, equal loads in random order (so equal replicas take turns).
    """
    if not replicas:
        return []
    ties = {r: random.random() for r in replicas}
    by_load = sorted(replicas, key=lambda r: (load.get(r, 0), ties[r]))
    loads = [load.get(r, 0) for r in replicas]
    wanted = set(chunks)
    if not wanted or max(loads) - min(loads) > imbalance:
        return [[r] for r in by_load]
    homes = [home(c, replicas) for c in wanted]
    score = {r: (len(wanted & held.get(r, set())), homes.count(r)) for r in replicas}
    best = max(score.values())
    return [[r for r in by_load if score[r] == best]]
