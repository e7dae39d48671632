"""The owner of the rendezvous state: it serializes decisions, persists events
through the store before acknowledging them, signs attestations and runs the
barrier. It knows nothing of gRPC (coordinator/service.py adapts it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

from coordinator.keys import KeyRing
from coordinator.rendezvous import (
    Assignment,
    Code,
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
    ) -> None:
        self.config = config
        self.store = store
        self.keys = keys
        self.clock = clock
        self.attestation_ttl_s = attestation_ttl_s
        self.state = RendezvousState(config)
        replayed = store.load()
        self.state.apply_all(replayed)
        if replayed:
            log.info(
                "replayed %d events: generation %d, %d/%d ranks",
                len(replayed), self.state.generation, len(self.state.by_rank), self.state.world_size,
            )
        self._lock = asyncio.Lock()
        self._world_complete = asyncio.Event()
        if self.state.complete:
            self._world_complete.set()

    async def register(self, request: RegisterInput) -> attestation_pb2.SignedAttestation:
        async with self._lock:
            now = self.clock()
            decision = self.state.decide_register(request, now)
            if decision.events:
                await self.store.append(decision.events)
                self.state.apply_all(decision.events)
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
