"""The owner of the cluster: nodes that stay joined, the job queue, and one rendezvous
engine (engine.Coordinator) per running job. Every coordinator is one: a config with
[job] + [plan] is a cluster whose one job is *declared* at start (``declared``), served
through the same code as a submitted one.

A declared job is RUNNING from its declaration and has open membership, as a
single-job coordinator always had: no node is allocated to it; its agents Join it by
name and its engine, opened over the config's RendezvousConfig (join token, node order,
vouches, spares), authenticates them and picks their node ranks. Its engine stays open
while the process runs, after the job ended too, so its nodes and workers keep the
answers of a single-job coordinator.

The cluster's events (nodes, tokens, job submissions, allocations, ends) go to the
cluster's own log; each job's rendezvous events go to that job's own log, pinned to its
id, plan and allocated nodes. Both follow the engine's rule: apply, append, and answer
only once durable. Decisions are the pure ones of jobs.py; this class only sequences
them, opens a job's engine when the job is allocated, and ends a job when its engine
says it failed or every worker of its last generation exited 0.

A job that ended costs (almost) nothing: its final rendezvous goes to the cluster's log as
a summary (JobSummarized), its engine and log are closed, and every later read of it
comes from the summary, after a restart too; its own log is deleted after
``retention_s``, or once more than ``ended_jobs_kept`` ended jobs are kept; the oldest
beyond those are then forgotten, their ids kept taken (cluster_state/forgotten.py).

Like the engine, it needs no lock: decide -> apply -> append is synchronous on one loop.
"""

from __future__ import annotations

from meshgate.words import counted

import asyncio
import logging
import secrets
import time
from typing import Awaitable, Callable, Mapping, Optional, Sequence

from meshgate import logs, metrics
from meshgate.wire import PeerVersion
from meshgate.coordinator.engine import _DONE, Coordinator, await_durable
from meshgate.coordinator.job_engines import JobEngines, JobStoreDropper, JobStoreOpener
from meshgate.coordinator.hardware import HardwareBook
from meshgate.coordinator.job_nodes import JobNodes
from meshgate.coordinator.jobspec import DEFAULT_LAUNCH_DEADLINE_S
from meshgate.coordinator.jobs import (
    DEFAULT_ENDED_JOBS_KEPT,
    DEFAULT_RETENTION_S,
    OPERATOR,
    Caller,
    ClusterEvent,
    ClusterState,
    Job,
    JobEnded,
    JobSpec,
    JobState,
    loggable,
)
from meshgate.coordinator.cluster_state.admission import QuarantinePolicy
from meshgate.coordinator.cluster_state.quotas import Quotas
from meshgate.coordinator.keys import KeyRing
from meshgate.coordinator.log_relay import LogRelay
from meshgate.coordinator.node_pool import NodePool
from meshgate.coordinator.units_shown import UnitsShown
from meshgate.coordinator.progress import ProgressBoard
from meshgate.coordinator.rendezvous import (
    Code,
    RendezvousConfig,
    RendezvousError,
)
from meshgate.coordinator.store import MemoryStore, Store

log = logging.getLogger("meshgate.coordinator")

Clock = Callable[[], float]
# A job a config declares: its spec, and the rendezvous its engine serves (join token...).
Declared = tuple[JobSpec, RendezvousConfig]


def launchers_waiting(cluster: ClusterState, engines: Mapping[str, Coordinator]) -> dict[str, tuple[str, ...]]:
    """Each running job whose launchers register its workers: its nodes whose launchers
    have not come."""
    waiting = {}
    for job_id, engine in engines.items():
        job = cluster.jobs[job_id]
        if job.state is JobState.RUNNING and job.spec.launchers_register:
            waiting[job_id] = engine.state.launchers_missing(job.nodes)
    return waiting


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
        heartbeat_interval_s: float = 0.0,
        clock: Clock = time.time,
        on_store_failure: Optional[Callable[[BaseException], None]] = None,
        drop_job_store: Optional[JobStoreDropper] = None,
        retention_s: float = DEFAULT_RETENTION_S,
        launch_deadline_s: float = DEFAULT_LAUNCH_DEADLINE_S,
        declared: Sequence[Declared] = (),
        reset_aside: Callable[[str], bool] = lambda job_id: False,
        quotas: Quotas = Quotas(),
        quarantine: QuarantinePolicy = QuarantinePolicy(),
        ended_jobs_kept: int = DEFAULT_ENDED_JOBS_KEPT,
    ) -> None:
        self.store, self.retention_s, self.launch_deadline_s = store, retention_s, launch_deadline_s
        self.keys = keys
        self.require_vouch = require_vouch
        self.clock = clock
        self.on_store_failure = on_store_failure
        self.state = ClusterState(heartbeat_timeout_s, quotas, heartbeat_interval_s, quarantine, ended_jobs_kept)
        self.state.apply_all(store.load())
        now = clock()
        for node in self.state.nodes.values():
            node.last_seen = now  # a restarted coordinator gives every node a fresh start
            node.units_clear = False  # ... but no node to a job before its agent shows no live unit
        self.job_engines = JobEngines(
            keys,
            open_job_store,
            attestation_ttl_s=attestation_ttl_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            on_store_failure=on_store_failure,
            drop_job_store=drop_job_store,
            clock=clock,
        )
        self.pool = NodePool(self)  # the nodes' own calls: join, heartbeat, leave, the job they name
        self.job_nodes = JobNodes(self)  # the nodes running jobs get: allocated, and from the pool for a lost one
        self.log_relay = LogRelay()  # readers of job logs and the agents answering them (not persisted)
        self.progress = ProgressBoard()  # what running jobs' workers report of their training (not persisted)
        self.units_shown = UnitsShown(self.state, clock)  # a cancel waits for its nodes to show its processes gone
        # Each node's agent versions (meshgate/wire.py) from its latest Join or heartbeat: liveness.
        self.node_versions: dict[str, PeerVersion] = {}
        # Each node's hardware from its latest Join or asked heartbeat (coordinator/hardware.py):
        # what the engines sign into attestations and place TP groups by.
        self.hardware = self.job_engines.hardware = HardwareBook()
        # The rendezvous of each job the config declares (its own join token and node order).
        self.declared: dict[str, Declared] = {spec.job_id: (spec, config) for spec, config in declared}
        self.reset_aside = reset_aside  # the job's log was moved aside by --reset-state --job
        self._tail: Optional["asyncio.Future[None]"] = None

    @property
    def engines(self) -> dict[str, Coordinator]:
        """The engine of each job served now (running, or declared)."""
        return self.job_engines.engines

    @property
    def unopened(self) -> dict[str, str]:
        return self.job_engines.unopened

    # ---- the one way cluster state changes ----------------------------------------------

    def apply(self, events: tuple[ClusterEvent, ...]) -> Awaitable[None]:
        """Apply ``events`` now, append them, and return the wait for their durability (with
        none: of the latest append). The one way cluster state changes (NodePool's too)."""
        if not events:
            tail = self._tail
            if tail is None or (tail.done() and not tail.cancelled() and tail.exception() is None):
                return _DONE
            return self._durable(tail)
        self.state.apply_all(events)
        durable = self._tail = self.store.append(events)
        for event in events:
            shown_event = loggable(event)  # never a job's env values
            log.info("cluster event %s", shown_event, extra=logs.event_fields(shown_event))
            if isinstance(event, JobEnded):  # counted when decided, never when a restart replays it
                metrics.count_job_ended(event.state.value)
        return self._durable(durable)

    async def _durable(self, durable: Awaitable[None]) -> None:
        await await_durable(durable, self.on_store_failure, "cluster store")

    # ---- keys ------------------------------------------------------------------------------

    def rotate_key(self):
        self.keys.rotate(retire_after_s=self.job_engines.attestation_ttl_s, now=self.clock())
        log.warning(
            "signing key rotated: now %s; trusted: %s", self.keys.active.key_id, ", ".join(self.keys.bundle.keys)
        )
        return self.keys.signed_bundle(now=self.clock())

    # ---- jobs ------------------------------------------------------------------------------

    async def submit(self, spec: JobSpec, caller: Caller = OPERATOR, wait_for_nodes: bool = False) -> Job:
        spec = spec.with_launch_deadline(self.launch_deadline_s)
        await self.apply(self.state.decide_submit(spec, self.clock(), caller, wait_for_nodes))
        what = f"{spec.plan.describe()}, {counted(spec.num_nodes, 'node')} of {counted(spec.slots_per_node, 'slot')}"
        log.info("job %s submitted: %s", spec.job_id, what)
        await self.reconcile()
        return self.state.jobs[spec.job_id]

    async def cancel(self, job_id: str, reason: str, caller: Caller = OPERATOR) -> Job:
        """Durably CANCELLED; CancelJob answers once its nodes showed its processes gone (units_shown)."""
        self.state.check_may_manage(job_id, caller, "cancel")
        await self.apply(self.state.decide_cancel(job_id, reason, self.clock()))
        await self._close_engine(job_id, f"{logs.CANCELLED_BY}{caller.describe()}: {reason or 'no reason given'}")
        await self.reconcile()
        return self.state.jobs[job_id]

    async def finish(self, job_id: str, succeeded: bool, reason: str, caller: Caller = OPERATOR) -> Job:
        self.state.check_may_manage(job_id, caller, "finish")
        await self.apply(self.state.decide_finish(job_id, succeeded, reason, self.clock()))
        await self.reconcile()
        return self.state.jobs[job_id]

    def job(self, job_id: str) -> Job:
        """``job_id``'s job; an empty id names the config's declared job, when it declares one
        (a single-job config's `meshgate status` names none)."""
        if not job_id and len(self.declared) == 1:
            job_id = next(iter(self.declared))
        return self.state.job(job_id)

    def engine(self, job_id: str, running: bool = False) -> Coordinator:
        """The rendezvous of ``job_id``: NOT_FOUND for an unknown job, FAILED_PRECONDITION
        naming why for one that was never allocated, or (``running``: for calls that
        would add to it, Register and Join) for one that has ended; UNAVAILABLE (retry)
        while its log is opened off the loop (JobEngines.served)."""
        job = self.job(job_id)
        engine = self.engines.get(job.spec.job_id)
        # Closed: what it came to is read from its summary (readmodel). A declared job's
        # engine keeps deciding after the end, as a single-job coordinator's always did.
        if job.state.ended and (engine is None or (running and not job.declared)):
            raise RendezvousError(Code.FAILED_PRECONDITION, f"job {job_id!r} is {job.state.value}: {job.reason[:200]}")
        if engine is None:
            if job.state is JobState.PENDING:
                raise RendezvousError(
                    Code.FAILED_PRECONDITION,
                    f"job {job_id!r} is PENDING ({self.state.pending_reason(job, self.clock())}); it has no ranks "
                    f"yet (meshgate job watch {job_id} follows it)",
                )
            engine = self.job_engines.served(self.rendezvous_config(job), lambda: job.state is JobState.RUNNING)
        return engine

    def rendezvous_config(self, job: Job) -> RendezvousConfig:
        """What a job's engine serves: a declared job's the config's; another over its nodes."""
        if job.spec.job_id in self.declared:
            return self.declared[job.spec.job_id][1]
        return job.spec.rendezvous_config(job.nodes, self.require_vouch)

    def retired(self, job_id: str) -> bool:
        """The job ended and its engine is closed: calls about it are answered from its
        summary (readmodel.job_status), never by reopening its log."""
        return self.state.job(job_id).state.ended and job_id not in self.engines

    # ---- the loop: allocation, job ends, liveness --------------------------------------------

    async def start(self) -> None:
        """Declare the config's jobs (a first start writes them; a restart with the same
        config adds nothing; a running one it no longer declares refuses); reopen every running
        job's engine (its own log replays it) and every declared job's. A declared job's
        log that cannot be trusted refuses the start (RendezvousError DATA_LOSS), as a
        single-job coordinator's always did."""
        for job_id in self.state.undeclared_running(self.declared):
            if self.reset_aside(job_id):  # the operator ended it on purpose: a new [job] id may run
                reason = "its state was moved aside by --reset-state --job"
                await self.apply(self.state.decide_end(job_id, JobState.FAILED, reason, self.clock()))
        self.state.check_undeclared(self.declared)
        for spec, config in self.declared.values():
            engine = self.job_engines.open(config)  # its pin refuses another plan, slots or node_order, naming the file
            await self.apply(self.state.decide_declare(spec, self.clock()))
            await self.pool.adopt(engine)  # nodes its own log keyed before they joined the cluster
        for job in list(self.state.jobs.values()):
            if job.state is JobState.RUNNING:
                await self._serve_allocated(job)
        await self.reconcile()

    async def reconcile(self) -> None:
        """End running jobs past their time limit (their workers are stopped as a cancel
        stops them) and those whose engine decided (failed, or every worker exited 0),
        give running jobs' lost blocks nodes of the pool (cluster_state/replacement.py),
        then give idle nodes to pending jobs (backfill.py)."""
        now = self.clock()
        late = self.state.decide_launch_deadlines(launchers_waiting(self.state, self.engines), now)
        for ended in self.state.decide_time_limits(now) + late:
            await self.apply((ended,))
            await self._close_engine(ended.job_id, ended.reason)
        for job_id, engine in list(self.engines.items()):
            job = self.state.jobs[job_id]
            if self.engines.get(job_id) is not engine:
                continue  # retired by a reconcile that ran while this one waited
            if job.state is not JobState.RUNNING:
                await self._retire(job)
                continue
            state = engine.state
            if state.failed:
                await self.apply(self.state.decide_end(job_id, JobState.FAILED, state.failed, now))
            elif state.succeeded:
                succeeded = f"every worker of generation {state.generation} exited 0"
                await self.apply(self.state.decide_end(job_id, JobState.SUCCEEDED, succeeded, now))
            if job.state.ended and self.engines.get(job_id) is engine:
                await self._retire(job)
        await self.job_nodes.reconcile()  # drains, and a running job's lost block before a new job's start
        allocated = self.state.decide_allocate(now)
        await self.apply(allocated)
        for event in allocated:
            job = self.state.jobs[event.job_id]
            log.info(
                "job %s allocated: nodes %s%s",
                job.spec.job_id,
                ", ".join(job.nodes),
                f"; spares {', '.join(job.spares)}" if job.spares else "",
            )
            await self._serve_allocated(job)

    async def run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self._retry_unopened()
                for job_id, engine in list(self.engines.items()):
                    job = self.state.jobs[job_id]
                    if job.state is JobState.RUNNING or job.declared:  # a declared job's engine always decides
                        await engine.sweep_lost()
                        await self.pool.blame_lost(job_id, engine.take_losses())
                await self.reconcile()
                await self.prune()
            except RendezvousError:
                pass  # a store failure is reported by _durable

    async def _serve_allocated(self, job: Job) -> None:
        """Open an allocated job's engine and admit its nodes. A running job whose log
        cannot be trusted ends FAILED, the reason naming the file (its nodes go back to the
        pool); one whose log cannot be opened now stays RUNNING until run() opens it. A
        declared job's nodes join it themselves."""
        try:  # off the loop: every other call is served meanwhile
            engine = await self.job_engines.opened(self.rendezvous_config(job), lambda: job.state is JobState.RUNNING)
        except RendezvousError as exc:
            if exc.code is Code.DATA_LOSS and job.state is JobState.RUNNING:  # (another caller may have ended it)
                await self.apply(self.state.decide_end(job.spec.job_id, JobState.FAILED, exc.message, self.clock()))
            return
        if engine is not None and not job.declared:  # None: it ended while its log was being opened
            await self.job_nodes.admit(job)

    async def _retry_unopened(self) -> None:
        for job_id in list(self.unopened):
            job = self.state.jobs[job_id]  # (opened by a call meanwhile, or nothing to serve: below)
            if job.state is JobState.RUNNING and job_id not in self.engines:
                await self._serve_allocated(job)
            elif job_id in self.engines or job.state.ended:
                self.unopened.pop(job_id, None)

    async def _close_engine(self, job_id: str, reason: str) -> None:
        """A job that ended from outside (cancel): its engine refuses every further call
        that would change it, and agents learn of the end from their next heartbeat."""
        engine = self.engines.get(job_id)
        if engine is not None and not engine.state.failed:
            await engine.end(reason)

    async def _retire(self, job: Job) -> None:
        """An ended job: its final rendezvous goes to the cluster's log, and its engine and
        log are closed. The summary is applied and the engine dropped in one step (no
        await between), so every later call finds the summary; appends made before are
        waited for before the log is closed."""
        from meshgate.coordinator.readmodel import summary  # readmodel imports this module

        if job.declared:
            return  # served while the process runs, as a single-job coordinator's job always was
        job_id = job.spec.job_id
        durable = self.apply(
            self.state.decide_summarize(job_id, summary(self.engines[job_id], job, self.progress), self.clock())
        )
        await self.job_engines.close(job_id)  # drops the engine before its first await
        self.progress.drop(job_id)  # kept in the summary
        await durable
        log.info("job %s closed (%s); its summary is in the cluster's log", job_id, job.state.value)

    async def prune(self) -> None:
        """Delete the own logs of jobs that ended ``retention_s`` ago: files first, then the
        event (a crash in between deletes them again next time, finding nothing)."""
        events = self.state.decide_prune(self.clock(), self.retention_s)
        if not events:
            return
        await self.job_engines.drop([event.job_id for event in events])
        await self.apply(events)
        log.info(
            "deleted the own logs of %d job(s) ended over %gs ago: %s",
            len(events),
            self.retention_s,
            ", ".join(e.job_id for e in events[:8]),
        )

    def close(self) -> None:
        self.job_engines.close_all()


def new_job_id(cluster: ClusterCoordinator) -> str:
    """A job id no job of the cluster holds: ``job-<date>-<6 hex>``."""
    while True:
        job_id = f"job-{time.strftime('%Y%m%d', time.gmtime(cluster.clock()))}-{secrets.token_hex(3)}"
        if not cluster.state.taken(job_id):
            return job_id


def cluster_of_engine(engine: Coordinator, spec: JobSpec) -> ClusterCoordinator:
    """A cluster (its log in memory) whose one declared job is served by ``engine``, already
    open: for tests and benchmarks that build an engine by hand."""
    log_in_memory = MemoryStore()
    cluster = ClusterCoordinator(
        log_in_memory,
        engine.keys,
        lambda config: engine.store,
        attestation_ttl_s=engine.attestation_ttl_s,
        heartbeat_timeout_s=engine.heartbeat_timeout_s,
        require_vouch=engine.config.require_vouch,
        clock=engine.clock,
        on_store_failure=engine.on_store_failure,
        declared=[(spec, engine.config)],
    )
    declaration = cluster.state.decide_declare(spec, cluster.clock())
    cluster.state.apply_all(declaration)
    adopted = cluster.state.decide_adopt(spec.job_id, engine.state.nodes.values(), engine.state.tokens, cluster.clock())
    cluster.state.apply_all(adopted)
    log_in_memory.events.extend(declaration + adopted)  # what start() would append, without a loop to await it on
    cluster.job_engines.adopt(engine)
    return cluster


__all__ = ["cluster_of_engine", "new_job_id", "ClusterCoordinator", "Declared", "JobStoreDropper", "JobStoreOpener"]
