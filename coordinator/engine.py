"""The owner of the rendezvous state: it serializes decisions, persists events
through the store before acknowledging them, signs attestations and runs the
barrier. It knows nothing of gRPC (coordinator/service.py adapts it).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

from coordinator.keys import KeyRing
from coordinator.rendezvous import (
    Assignment,
    Code,
    Event,
    Node,
    RankAssigned,
    RegisterInput,
    RendezvousConfig,
    RendezvousError,
    RendezvousState,
)
from coordinator.store import Store
from meshgate.attestation import build_attestation, sign_attestation
from meshgate.v1 import attestation_pb2

log = logging.getLogger("meshgate.coordinator")

Clock = Callable[[], float]


@dataclass(frozen=True)
class WorldView:
    job_id: str
    generation: int
    world_size: int
    master: Optional[tuple[str, int]]
    members: tuple[Assignment, ...]


class Coordinator:
    def __init__(
        self,
        config: RendezvousConfig,
        store: Store,
        keys: KeyRing,
        *,
        attestation_ttl_s: float,
        clock: Clock = time.time,
        heartbeat_timeout_s: float = 15.0,
    ) -> None:
        self.config = config
        self.store = store
        self.keys = keys
        self.clock = clock
        self.attestation_ttl_s = attestation_ttl_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.state = RendezvousState(config)
        replayed = store.load()
        self.state.apply_all(replayed)
        for node in self.state.nodes.values():
            node.last_seen = clock()  # a restarted coordinator gives every node a fresh start
        if replayed:
            log.info(
                "replayed %d events: generation %d, %d/%d ranks",
                len(replayed), self.state.generation, len(self.state.by_rank), self.state.world_size,
            )
        self._lock = asyncio.Lock()
        self._world_complete = asyncio.Event()
        if self.state.complete:
            self._world_complete.set()

    async def _commit(self, events: tuple[Event, ...]) -> None:
        """Persist, then apply. Callers hold the lock."""
        if events:
            await self.store.append(events)
            self.state.apply_all(events)
            if log.isEnabledFor(logging.INFO):
                for event in events:
                    # Per-rank events are too many to log at INFO in a 100k world.
                    level = logging.DEBUG if isinstance(event, RankAssigned) else logging.INFO
                    log.log(level, "event %s", event)

    async def join(
        self, job_id: str, node_id: str, hostname: str, slots: int, slot_kind: str, token: str
    ) -> Node:
        expected = self.config.join_token
        if not expected:
            raise RendezvousError(
                Code.FAILED_PRECONDITION,
                "this coordinator has no [job] join_token configured; agents cannot join",
            )
        if not hmac.compare_digest(token.encode(), expected.encode()):
            raise RendezvousError(
                Code.UNAUTHENTICATED, f"join_token for node_id {node_id!r} is not valid"
            )
        async with self._lock:
            node, events = self.state.decide_join(
                job_id, node_id, hostname, slots, slot_kind, self.clock()
            )
            await self._commit(events)
            return self.state.nodes[node_id]

    def node_heartbeat(self, job_id: str, node_id: str) -> int:
        node = self.state.decide_node_call(job_id, node_id)
        if node.state != "active":
            raise RendezvousError(
                Code.FAILED_PRECONDITION,
                f"node_id {node_id!r} is {node.state}; it must Join again",
            )
        self.state.touch_node(node_id, self.clock())
        return self.state.generation

    def report_exit(self, job_id: str, node_id: str, line: str) -> None:
        node = self.state.decide_node_call(job_id, node_id)
        node.exits = (node.exits + [line])[-16:]  # operator view, not persisted state
        log.info("node %s: %s", node_id, line)

    async def leave(self, job_id: str, node_id: str, reason: str) -> None:
        async with self._lock:
            await self._commit(self.state.decide_leave(job_id, node_id, reason, self.clock()))

    async def sweep_lost(self) -> tuple[Event, ...]:
        async with self._lock:
            events = self.state.decide_lost(self.clock(), self.heartbeat_timeout_s)
            await self._commit(events)
        for event in events:
            log.warning("node %s lost: %s", event.node_id, event.reason)
        return events

    async def run_sweeper(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.sweep_lost()

    async def register(self, request: RegisterInput) -> attestation_pb2.SignedAttestation:
        async with self._lock:
            now = self.clock()
            decision = self.state.decide_register(request, now)
            await self._commit(decision.events)
            generation = self.state.generation
            if self.state.complete:
                self._world_complete.set()
        for warning in decision.warnings:
            log.warning("topology: %s", warning)
        if decision.is_new:
            a = decision.assignment
            log.debug("registered %s as rank %d on %s", a.worker_id, a.rank, a.node_id)
        else:
            self.state.touch(request.worker_id, now)
        a = decision.assignment
        unsigned = build_attestation(
            job_id=self.config.job_id,
            generation=generation,
            plan=self.config.plan,
            rank=a.rank,
            local_rank=a.local_rank,
            node_rank=a.node_rank,
            node_id=a.node_id,
            worker_id=a.worker_id,
            nonce=request.nonce,
            issued_at=now,
            ttl_s=self.attestation_ttl_s,
        )
        return sign_attestation(unsigned, self.keys.active)

    async def await_world(
        self, job_id: str, generation: int, timeout_s: float, include_members: bool = False
    ) -> WorldView:
        self.state.check_await(job_id, generation)
        if not self._world_complete.is_set():
            try:
                await asyncio.wait_for(self._world_complete.wait(), timeout=timeout_s)
            except asyncio.TimeoutError:
                raise RendezvousError(
                    Code.DEADLINE_EXCEEDED,
                    f"world of generation {generation} not complete after {timeout_s:g}s: "
                    + self.state.describe_missing(),
                ) from None
        self.state.check_await(job_id, generation)  # a generation bump while waiting
        members = ()
        if include_members:
            members = tuple(self.state.by_rank[r] for r in range(self.state.world_size))
        return WorldView(
            job_id=job_id,
            generation=self.state.generation,
            world_size=self.state.world_size,
            master=self.state.master,
            members=members,
        )

    def heartbeat(self, job_id: str, worker_id: str, generation: int) -> int:
        self.state.decide_heartbeat(job_id, worker_id, generation)
        self.state.touch(worker_id, self.clock())
        return self.state.generation
