"""The Ray Serve adapters of ``linnet.ray.router``: the replica deployment's ``RequestRouter`` classes.

They run in the process that calls the replicas (the ingress). ``PrefixAwareRouter`` sees each request's
``Forwarded`` (its prompt's text) and ranks the replicas with ``router.choose``; what it routes, it
records. ``RoundRobinRouter`` ignores the prompt and takes the replicas in turn (``router.round_robin``):
the baseline prefix-aware routing is measured against. With either, Ray takes the first ranked replica with
room (``max_ongoing_requests``), trying the next ranks when it has none, and backs off before trying
again once every replica is full.
"""
from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from linnet.ray.router import (
    BLOCK_CHARS,
    BUSY_MARGIN,
    MAX_BLOCKS,
    RECORD_BLOCKS,
    PrefixRecord,
    choose,
    prefix_blocks,
    round_robin,
)


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS,
                         record_blocks: int = RECORD_BLOCKS, busy_margin: int = BUSY_MARGIN, **_: Any) -> None:
        self._block_chars, self._max_blocks = block_chars, max_blocks
        self._record_blocks, self._busy_margin = record_blocks, busy_margin
        self._records: dict[ReplicaID, PrefixRecord] = {}

    def _blocks(self, pending_request: PendingRequest | None) -> list[bytes]:
        text = getattr(pending_request.args[0], "prefix_text", "") if pending_request and pending_request.args else ""
        return prefix_blocks(text, self._block_chars, self._max_blocks) if text else []

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        back_off_when_all_full(pending_request)
        loads = await self._queue_lengths(candidate_replicas)
        if not loads:  # none answered: let Ray probe them all, as its own routers do
            return [candidate_replicas]
        by_id = {r.replica_id: r for r in candidate_replicas}
        ranked = choose(self._blocks(pending_request), loads, self._records, self._busy_margin)
        return [[by_id[ranked[0]]], [by_id[r] for r in ranked[1:]]]

    async def _queue_lengths(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Requests queued or running on each replica: from Ray's cache where fresh, else asked now (a
        replica that does not answer in time is left out of this round)."""
        loads: dict[ReplicaID, int] = {}
        unknown = []
        for replica in replicas:
            cached = self.replica_queue_len_cache.get(replica.replica_id)
            if cached is None:
                unknown.append(replica)
            else:
                loads[replica.replica_id] = cached
        if unknown:
            for replica, length in await self._probe_queue_lens(unknown, 0):
                if length is not None:
                    loads[replica.replica_id] = length
        return loads

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        record = self._records.get(replica_id)
        if record is None:
            record = self._records[replica_id] = PrefixRecord(self._record_blocks)
        record.add(self._blocks(pending_request))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._records.pop(replica_id, None)  # its replacement starts with an empty cache

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        for gone in set(self._records) - {r.replica_id for r in replicas}:
            del self._records[gone]


class RoundRobinRouter(RequestRouter):
    def initialize_state(self, **_: Any) -> None:
        self._turn = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        back_off_when_all_full(pending_request)
        # a turn per choice, not per routed request: requests routed at once would otherwise share a turn
        order = round_robin(candidate_replicas, self._turn)
        self._turn += 1
        return [[replica] for replica in order]  # one a rank: a full replica's request goes to the next in turn


def back_off_when_all_full(pending_request: PendingRequest | None) -> None:
    """Have Ray wait (its backoff) before asking again when no ranked replica had room; without it Ray asks
    again at once, probing the full replicas' queues in a loop on the CPUs the replicas compute on."""
    if pending_request is not None:
        pending_request.routing_context.should_backoff = True
