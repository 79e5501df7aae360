"""The Ray Serve request router of `kvlm serve --replicas`: prefix-aware, or round-robin.

Ray Serve asks a RequestRouter which replicas may take a request (`choose_replicas`, one
rank of candidates); its base class then sends the request to the least loaded candidate
that has room, and backs off and asks again when none has. This router gives one
candidate:

    prefix       the request's route key (kvlm.cluster.keys, a kwarg of the call) on the
                 bounded-load hash ring of the replicas (kvlm.cluster.ring); no key: the
                 replica with the fewest requests in flight
    round-robin  the next replica in turn (the benchmark's baseline)

Under either policy, a request with a `replica` kwarg (the tag of the replica that stored
the response it names, kvlm.cluster.keys.affinity) goes to that replica while it lives,
and one with a `slot` kwarg (the llama-server slot it names, kvlm.cluster.keys.slot_of)
to replica slot mod R of the R candidates in the order of their ids (`slot_replica`).

Loads are the in-flight counts of Ray Serve's queue-length cache (bumped when a request is
sent, dropped when it ends, refreshed by the replicas' answers), probing the replicas
whose entry has gone stale, as Ray's own PrefixCacheAffinityRouter does.

The router runs in the ingress's process, so it also counts the requests it has routed to
each replica, for the ingress's /metrics. Ray Serve pickles this module by value into that
process (RequestRouterConfig registers it so), which copies its globals: the counts live in
kvlm.cluster.metrics, reached through the module (pickled by reference), so the router
and the ingress share one.
"""

from __future__ import annotations

import itertools

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvlm.cluster import metrics
from kvlm.cluster.keys import replica_tag
from kvlm.cluster.ring import BALANCE, HashRing, least_loaded

POLICIES = ("prefix", "round-robin")


def slot_replica(slot: int, replica_ids: list[str]) -> str:
    """The replica llama-server's slot `slot` lives on: slot mod R of the R replicas in the
    order of their ids (the ingress's GET /slots reads each slot from the same one)."""
    ids = sorted(replica_ids)
    return ids[slot % len(ids)]


class KvlmRouter(RequestRouter):
    def initialize_state(self, policy: str = "prefix", balance: float = BALANCE) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy {policy!r}: one of {', '.join(POLICIES)}")
        self.policy = policy
        self.balance = balance
        self._turn = itertools.count()
        self._ring = HashRing(())

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        kwargs = pending_request.kwargs if pending_request else {}
        tag = kwargs.get("replica")
        if tag is not None:
            held = [r for rid, r in by_id.items() if replica_tag(rid) == tag]
            if held:
                return [held]
        if kwargs.get("slot") is not None:
            return [[by_id[slot_replica(kwargs["slot"], list(by_id))]]]
        if self.policy == "round-robin":
            ids = sorted(by_id)
            return [[by_id[ids[next(self._turn) % len(ids)]]]]
        loads = await self._loads(candidate_replicas)
        key = pending_request.kwargs.get("route_key") if pending_request else None
        if key is None:
            return [[by_id[least_loaded(by_id, loads, next(self._turn))]]]
        if self._ring.members != tuple(sorted(by_id)):
            self._ring = HashRing(by_id)
        return [[by_id[self._ring.pick(key, loads, self.balance)]]]

    async def _loads(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """Requests in flight per replica id; one that cannot say counts as full."""
        cached = [(r, self.replica_queue_len_cache.get(r.replica_id)) for r in replicas]
        loads = {r.replica_id.unique_id: queued for r, queued in cached if queued is not None}
        stale = [r for r, queued in cached if queued is None]
        for r, queued in await self._probe_queue_lens(stale, 0):
            loads[r.replica_id.unique_id] = r.max_ongoing_requests if queued is None else queued
        return loads

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: object
    ) -> None:
        metrics.ROUTED.add(replica_id.unique_id)
