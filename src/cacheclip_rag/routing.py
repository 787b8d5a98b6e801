"""Chunk-affinity request routing for engine replicas on Ray Serve (its custom `RequestRouter` API).

A request's chunk caches are read from the shared store once and then kept in the memory tier of
the replica that served it; a later request over the same chunks finds them there only if it
lands on that replica. The ingress resolves each request's chunk ids before routing (recognizing
stored chunk text in the prompt, or retrieving; no model runs) and passes them as the keyword
argument `route_chunks`. This router ranks the replicas by how many of those chunks each holds:
what the replica last reported (`record_routing_stats`: its memory tier's chunk ids) plus what
this router has since sent it. When the replicas' queues differ by more than `imbalance`
requests, locality gives way to load and the least loaded replica goes first, the balance Ray
Serve LLM's prefix-cache-affinity router strikes for prompt prefixes. Requests without chunk ids
(ingests) go to the least loaded replica.

Queue lengths are this router's own count of the requests it has routed and not yet seen
complete (one ingress routes every request, so the count is the replicas' load).
"""

from __future__ import annotations

import random
from collections import defaultdict

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

ROUTE_KWARG = "route_chunks"
"""The keyword argument a routed call carries its chunk ids in."""
REMEMBERED = 4096
"""Chunk ids remembered per replica from routing (beyond what it reports)."""


class ChunkAffinityRouter(RequestRouter):
    def initialize_state(self, imbalance: int = 2, **kwargs) -> None:
        """imbalance: the queue-length gap beyond which the least loaded replica goes first."""
        self._imbalance = imbalance
        self._running: dict[ReplicaID, int] = defaultdict(int)
        self._routed: dict[ReplicaID, dict[str, None]] = defaultdict(dict)  # insertion-ordered set
        self._requests: dict[str, ReplicaID] = {}

    def holds(self, replica: RunningReplica) -> set[str]:
        """The chunk ids `replica` is expected to hold in its memory tier."""
        reported = (replica.routing_stats or {}).get("chunks", ())
        return set(reported) | set(self._routed.get(replica.replica_id, ()))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        load = {r.replica_id: self._running[r.replica_id] for r in candidate_replicas}
        ties = {r.replica_id: random.random() for r in candidate_replicas}  # equal replicas take turns
        by_load = sorted(candidate_replicas, key=lambda r: (load[r.replica_id], ties[r.replica_id]))
        chunks = set((pending_request.kwargs.get(ROUTE_KWARG) or ()) if pending_request else ())
        if not chunks or max(load.values()) - min(load.values()) > self._imbalance:
            return [[r] for r in by_load]
        overlap = {r.replica_id: len(chunks & self.holds(r)) for r in candidate_replicas}
        ranked = sorted(candidate_replicas, key=lambda r: (-overlap[r.replica_id], load[r.replica_id], ties[r.replica_id]))
        return [[r] for r in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        self._running[replica_id] += 1
        self._requests[pending_request.metadata.internal_request_id] = replica_id
        routed = self._routed[replica_id]
        for cid in pending_request.kwargs.get(ROUTE_KWARG) or ():
            routed.pop(cid, None)
            routed[cid] = None
        while len(routed) > REMEMBERED:
            routed.pop(next(iter(routed)))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._requests.pop(internal_request_id, None) is not None:
            self._running[replica_id] = max(0, self._running[replica_id] - 1)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self._running.pop(replica_id, None)
        self._routed.pop(replica_id, None)
        super().on_replica_actor_died(replica_id)
