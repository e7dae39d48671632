"""The owner of the cluster: nodes that stay joined, the job queue, and one rendezvous
engine (engine.Coordinator) per allocated job.

The cluster's events (nodes, tokens, job submissions, allocations, ends) go to the
cluster's own log; each job's rendezvous events go to that job's own log, pinned to its
id, plan and allocated nodes. Both follow the engine's rule: apply, append, and answer
only once durable. Decisions are the pure ones of jobs.py; this class only sequences
them, opens a job's engine when the job is allocated, and ends a job when its engine
says it failed or every worker of its last generation exited 0.

Like the engine, it needs no lock: decide -> apply -> append is synchronous on one loop.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Awaitable, Callable, Iterable, Mapping, Optional

from meshgate import logs
from meshgate.attestation import secret_hash
from meshgate.coordinator.engine import _DONE, Coordinator, await_durable
from meshgate.coordinator.jobs import (
    ClusterEvent,
    ClusterNode,
    ClusterState,
    Job,
    JobSpec,
    JobState,
)
from meshgate.coordinator.keys import KeyRing
from meshgate.coordinator.rendezvous import (
    AdmittedNode,
    Code,
    JoinAuth,
    RendezvousConfig,
    RendezvousError,
    shown,
)
from meshgate.coordinator.store import Store

log = logging.getLogger("meshgate.coordinator")

Clock = Callable[[], float]
# Opens the log of one job (created empty on first use; refused if it cannot be trusted).
JobStoreOpener = Callable[[RendezvousConfig], Store]


class ClusterCoordinator:
    def __init__(
        self,
        store: Store,
        keys: KeyRing,
        open_job_store: JobStoreOpener,
        *,
        attestation_ttl_s: float,
        heartbeat_timeout_s: float,
        require_vouch: bool,
        clock: Clock = time.time,
        on_store_failure: Optional[Callable[[BaseException], None]] = None,
    ) -> None:
        self.store = store
        self.keys = keys
        self.open_job_store = open_job_store
        self.attestation_ttl_s = attestation_ttl_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.require_vouch = require_vouch
        self.clock = clock
        self.on_store_failure = on_store_failure
        self.state = ClusterState(heartbeat_timeout_s)
        self.state.apply_all(store.load())
        now = clock()
        for node in self.state.nodes.values():
            node.last_seen = now  # a restarted coordinator gives every node a fresh start
            node.units_clear = False  # ... but no node to a job before its agent shows no live unit
        self.engines: dict[str, Coordinator] = {}
        self._tail: Optional["asyncio.Future[None]"] = None
        self._stores: list[Store] = []

    # ---- the one way cluster state changes ----------------------------------------------

    def _apply(self, events: tuple[ClusterEvent, ...]) -> Awaitable[None]:
        if not events:
            tail = self._tail
            if tail is None or (tail.done() and not tail.cancelled() and tail.exception() is None):
                return _DONE
            return self._durable(tail)
        self.state.apply_all(events)
        durable = self._tail = self.store.append(events)
        for event in events:
            log.info("cluster event %s", event, extra=logs.event_fields(event))
        return self._durable(durable)

    async def _durable(self, durable: Awaitable[None]) -> None:
        await await_durable(durable, self.on_store_failure, "cluster store")

    # ---- nodes -----------------------------------------------------------------------------

    async def join(
        self, node_id: str, hostname: str, slots: int, slot_kind: str, labels: Mapping[str, str],
        token: str, credential: bytes = b"", public_key: bytes = b"",
    ) -> tuple[ClusterNode, bytes]:
        """A node joins the cluster (once; later Joins show its credential). Returns the
        node and, when one was issued, its new node credential."""
        new_credential = secrets.token_bytes(32)
        auth = JoinAuth(token, credential, public_key, secret_hash(new_credential))
        events = self.state.decide_join(node_id, hostname, slots, slot_kind, labels, auth, self.clock())
        await self._apply(events)
        self.state.touch(node_id, self.clock())
        node = self.state.nodes[node_id]
        if events and node.job_id in self.engines:  # a changed vouch key reaches its job too
            await self._admit(self.state.jobs[node.job_id])
        await self.reconcile()
        issued = bool(events) and events[0].token_hash != ""
        return node, new_credential if issued else b""

    async def create_join_token(self, ttl_s: float, node_id: str, any_node: bool = False) -> tuple[str, float]:
        token = secrets.token_urlsafe(32)
        events = self.state.decide_create_token(secret_hash(token), ttl_s, node_id, self.clock(), any_node)
        await self._apply(events)
        return token, events[0].expires_at

    def rotate_key(self):
        self.keys.rotate(retire_after_s=self.attestation_ttl_s, now=self.clock())
        log.warning("signing key rotated: now %s; trusted: %s", self.keys.active.key_id, ", ".join(self.keys.bundle.keys))
        return self.keys.signed_bundle(now=self.clock())

    def node_heartbeat(self, node_id: str, credential: bytes, live_units: Iterable[str] = ()) -> ClusterNode:
        """An idle node (or one between jobs) keeps itself in the pool; the answer tells
        it which job, if any, it now serves."""
        node = self.state.decide_node_call(node_id, credential)
        self.note_units(node_id, live_units)
        self.state.touch(node_id, self.clock())
        return node

    def note_units(self, node_id: str, live_units: Iterable[str]) -> None:
        """What a node's authenticated heartbeat says of its containment units."""
        self.state.note_units(node_id, live_units)

    def check_serves(self, node_id: str, job_id: str) -> None:
        """PERMISSION_DENIED unless ``node_id`` was given to ``job_id`` (member or spare)."""
        job = self.state.job(job_id)
        if node_id not in job.nodes + job.spares:
            raise RendezvousError(
                Code.PERMISSION_DENIED, f"node_id {shown(node_id)} does not serve job {job_id!r}"
            )

    def leave(self, node_id: str, credential: bytes) -> None:
        """A draining agent leaves the pool: no job is given to it until it joins again."""
        self.state.decide_node_call(node_id, credential)
        self.state.leave(node_id)
        log.info("node %s left the pool", node_id)

    def touch(self, node_id: str) -> None:
        """A node's call to its job's engine is also a sign of life to the cluster."""
        self.state.touch(node_id, self.clock())

    # ---- jobs ------------------------------------------------------------------------------

    def new_job_id(self) -> str:
        while True:
            job_id = f"job-{time.strftime('%Y%m%d', time.gmtime(self.clock()))}-{secrets.token_hex(3)}"
            if job_id not in self.state.jobs:
                return job_id

    async def submit(self, spec: JobSpec) -> Job:
        await self._apply(self.state.decide_submit(spec, self.clock()))
        log.info("job %s submitted: %s, %d nodes of %d slots", spec.job_id, spec.plan.describe(),
                 spec.num_nodes, spec.slots_per_node)
        await self.reconcile()
        return self.state.jobs[spec.job_id]

    async def cancel(self, job_id: str, reason: str) -> Job:
        await self._apply(self.state.decide_cancel(job_id, reason, self.clock()))
        await self._close_engine(job_id, f"job cancelled: {reason or 'cancelled'}")
        await self.reconcile()
        return self.state.jobs[job_id]

    async def finish(self, job_id: str, succeeded: bool, reason: str) -> Job:
        await self._apply(self.state.decide_finish(job_id, succeeded, reason, self.clock()))
        await self.reconcile()
        return self.state.jobs[job_id]

    def job(self, job_id: str) -> Job:
        return self.state.job(job_id)

    def engine(self, job_id: str, running: bool = False) -> Coordinator:
        """The rendezvous of ``job_id``: NOT_FOUND for an unknown job, FAILED_PRECONDITION
        naming why for one that was never allocated, or (``running``: for calls that
        would add to it, Register and Join) for one that has ended."""
        job = self.state.job(job_id)
        if running and job.state.ended:
            raise RendezvousError(
                Code.FAILED_PRECONDITION, f"job {job_id!r} is {job.state.value}: {job.reason[:200]}"
            )
        engine = self.engines.get(job_id)
        if engine is None:
            if job.state is JobState.PENDING:
                raise RendezvousError(
                    Code.FAILED_PRECONDITION,
                    f"job {job_id!r} is PENDING ({self.state.pending_reason(job, self.clock())}); it has no ranks yet",
                )
            if not job.nodes:  # cancelled before it was allocated
                raise RendezvousError(Code.FAILED_PRECONDITION, f"job {job_id!r} is {job.state.value}: {job.reason}")
            engine = self._open_engine(job)
        return engine

    def job_state(self, job_id: str) -> JobState:
        return self.state.job(job_id).state

    # ---- the loop: allocation, job ends, liveness --------------------------------------------

    async def start(self) -> None:
        """After a restart: reopen every running job's engine (its own log replays it)."""
        for job in self.state.jobs.values():
            if job.state is JobState.RUNNING:
                self._open_engine(job)
                await self._admit(job)
        await self.reconcile()

    async def reconcile(self) -> None:
        """End running jobs whose engine decided (failed, or every worker exited 0), then
        give idle nodes to pending jobs, oldest first."""
        now = self.clock()
        for job_id, engine in list(self.engines.items()):
            job = self.state.jobs[job_id]
            if job.state is not JobState.RUNNING:
                continue
            state = engine.state
            if state.failed:
                await self._apply(self.state.decide_end(job_id, JobState.FAILED, state.failed, now))
            elif state.succeeded:
                await self._apply(self.state.decide_end(
                    job_id, JobState.SUCCEEDED,
                    f"every worker of generation {state.generation} exited 0", now,
                ))
        allocated = self.state.decide_allocate(now)
        await self._apply(allocated)
        for event in allocated:
            job = self.state.jobs[event.job_id]
            log.info("job %s allocated: nodes %s%s", job.spec.job_id, ", ".join(job.nodes),
                     f"; spares {', '.join(job.spares)}" if job.spares else "")
            self._open_engine(job)
            await self._admit(job)

    async def run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                for job_id, engine in list(self.engines.items()):
                    if self.state.jobs[job_id].state is JobState.RUNNING:
                        await engine.sweep_lost()
                await self.reconcile()
            except RendezvousError:
                pass  # a store failure is reported by _durable

    def _open_engine(self, job: Job) -> Coordinator:
        engine = self.engines.get(job.spec.job_id)
        if engine is None:
            config = job.spec.rendezvous_config(job.nodes, self.require_vouch)
            store = self.open_job_store(config)
            self._stores.append(store)
            engine = self.engines[job.spec.job_id] = Coordinator(
                config, store, self.keys,
                attestation_ttl_s=self.attestation_ttl_s,
                heartbeat_timeout_s=self.heartbeat_timeout_s,
                on_store_failure=self.on_store_failure,
            )
        return engine

    async def _admit(self, job: Job) -> None:
        """The job's nodes join its rendezvous with their cluster credentials: members at
        their node rank, spares at -1."""
        engine = self.engines[job.spec.job_id]
        ranked = [(rank, node_id) for rank, node_id in enumerate(job.nodes)] + [(-1, s) for s in job.spares]
        admitted = []
        for node_rank, node_id in ranked:
            n = self.state.nodes[node_id]
            admitted.append(AdmittedNode(
                node_id, node_rank, n.hostname, n.slots, n.slot_kind, n.credential_hash, n.public_key.hex()
            ))
        await engine.admit(admitted)

    async def _close_engine(self, job_id: str, reason: str) -> None:
        """A job that ended from outside (cancel): its engine refuses every further call
        that would change it, and agents learn of the end from their next heartbeat."""
        engine = self.engines.get(job_id)
        if engine is not None and not engine.state.failed:
            await engine.end(reason)

    def close(self) -> None:
        for store in self._stores:
            store.close()


__all__ = ["ClusterCoordinator", "JobStoreOpener"]
