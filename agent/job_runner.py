"""Serving one job on this node: launch its workers into each generation the coordinator
gives, take its run's signals (agent/job_run.py) until something ends the launch, report
every exit, stop the workers, Join again for the next generation; until the job is over for
this node or the agent stops.

The runner holds the job run served now and the launch of its workers now (agent/launch.py);
the agent's one loop over jobs (agent/daemon.py) hands it each job, already joined.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from typing import Awaitable, Callable, Optional

from meshgate.agent.config import AgentConfig
from meshgate.agent.decide import Act, ExitAcknowledged, JobPhase, WorkerExited
from meshgate.agent.exits import MAX_DETAIL, PendingExit
from meshgate.agent.job_run import JobRun
from meshgate.agent.launch import CANNOT_START, Launch, master_env, per_node_env, plan_env, worker_env
from meshgate.agent.local_api import LocalApi
from meshgate.agent.node import NodeContext
from meshgate.agent.reporter import Reporter
from meshgate.agent.session import AgentError
from meshgate.agent.store_activation import StoreHost, store_env, store_host_for
from meshgate.agent.worker_logs import WorkerLogs
from meshgate.launchers.local import WorkerSpec
from meshgate.v1 import nodes_pb2

log = logging.getLogger("meshgate.agent")


class Outcome(enum.Enum):
    """How one launch (supervise) or one job (serve) ended for this node."""

    OK = "ok"  # its workers exited 0
    FAILED = "failed"  # the job failed or ended
    RELAUNCH = "relaunch"  # a new generation: relaunch every worker
    STOP = "stop"  # SIGTERM


class JobRunner:
    def __init__(
        self,
        config: AgentConfig,
        node: NodeContext,
        reporter: Reporter,
        worker_logs: WorkerLogs,
        stopping: asyncio.Event,
        join: Callable[[], Awaitable[nodes_pb2.JoinResponse]],
    ) -> None:
        self.config = config
        self.node = node
        self.reporter = reporter
        self.worker_logs = worker_logs
        self.stopping = stopping
        self.join = join  # the agent's Join for the job served now (idempotent)
        self.local_api: Optional[LocalApi] = None  # the workers' vouches and address; set by the agent
        # The job served now, made fresh for each: the config's, or the one the coordinator
        # gave this pool node; None while idle in the pool.
        self.run: Optional[JobRun] = None
        self.launch: Optional[Launch] = None  # the workers of the generation launched now

    def begin(self, run: JobRun) -> None:
        """A job for this node: a fresh run of it, nothing of the last one's."""
        self.run = run
        self.local_api.ended_job, self.local_api.ended_why = "", ""

    def end(self) -> None:
        """The job is over for this node: whoami says so, its output is no longer followed."""
        run, self.run, self.launch = self.run, None, None
        self.node.release_master()
        self.worker_logs.forget(run.job_id)
        self.local_api.ended_job, self.local_api.ended_why = run.job_id, run.failure or f"job {run.job_id} is over"

    async def remove_job_dir(self) -> None:
        """What the job left on this node, once its unit is empty (agent/node.py)."""
        job_id = self.run.job_id if self.run is not None else ""
        if await self.node.remove_job_dir(job_id) and self.run is not None:
            self.run.run_dir = None  # the next job gets a directory of its own, whatever this one left

    def running(self) -> int:
        return 0 if self.launch is None else self.launch.running()

    async def serve(self, run: JobRun, joined: nodes_pb2.JoinResponse) -> Outcome:
        """Launch and supervise this node's workers of one job, relaunching them into each
        new generation, until the job is over for this node: OK (its workers exited 0),
        FAILED (the job failed or ended) or STOP (SIGTERM)."""
        finished = -1  # the generation whose workers all exited 0 on this node
        while True:
            run.relaunching()
            if joined.generation == finished:
                # Back from being declared lost in a generation this node finished: its
                # workers never run it again (the exits were resent before the Join).
                log.info("generation %d already finished on this node; following job %s", finished, run.job_id)
            elif not joined.spare:
                joined = await self.await_master(run, joined)
                if run.over:
                    return Outcome.FAILED  # it ended before its workers started
                self.start_workers(run, joined)
                if run.cannot_start:
                    for local_rank in range(joined.assignment.nprocs):
                        await self.report_exit(local_rank, 127, start_failed=True, detail=run.cannot_start)
            outcome = await self.supervise(run)
            if outcome is Outcome.OK and run.pool:
                # This node's workers are done, but a pool node serves the job until it
                # ends: a failure elsewhere may still restart the whole job.
                log.info("workers exited 0; following job %s until it ends", run.job_id)
                self.launch, finished = None, run.launched_generation
                outcome = await self._await_change(run)
                if outcome is Outcome.FAILED:  # the job is over (whatever its end)
                    return Outcome.OK
            if outcome is not Outcome.RELAUNCH:
                if outcome is not Outcome.STOP:
                    self.launch = None
                return outcome
            await self.stop_workers(run.relaunch_reason)
            await self.reporter.settle()  # what this node's workers did comes before its Join
            try:
                joined = await self.join()
            except AgentError as exc:
                # The job ended while this node was away (a lost node learns it here).
                run.end(str(exc))
                return Outcome.FAILED

    async def await_master(self, run: JobRun, joined: nodes_pb2.JoinResponse) -> nodes_pb2.JoinResponse:
        """Workers start with the job's master in their environment: until node rank 0's
        agent has joined, Join again each heartbeat interval (Join is idempotent), for at
        most join_timeout_s; after that they start without it (the log says so)."""
        interval = joined.heartbeat_interval_ms / 1000 or 5.0
        deadline = time.monotonic() + self.config.join_timeout_s
        while not joined.assignment.master_addr:  # workers that an agent does not start need it too
            if self.stopping.is_set() or run.phase is not JobPhase.FOLLOWING:
                break
            if time.monotonic() > deadline:
                log.warning(
                    "no master from node rank 0's agent after %.0fs; workers start without MASTER_ADDR / MASTER_PORT",
                    self.config.join_timeout_s,
                )
                break
            log.info("waiting for node rank 0's agent to join: it hosts the job's master")
            if await run.until_phase_moves(interval) is not JobPhase.FOLLOWING:
                break
            try:
                joined = await self.join()
            except AgentError as exc:  # the job ended meanwhile (cancelled): nothing to launch
                run.end(str(exc))
                break
        return joined

    def start_workers(self, run: JobRun, joined: nodes_pb2.JoinResponse) -> None:
        """This generation's workers, or none: a job without a command (its workers start
        otherwise), or one whose command cannot start here (run.cannot_start says why)."""
        assignment = joined.assignment
        # The master's port is never released while the job runs here (the same endpoint in
        # every generation, so no offer goes stale); who serves the store on it:
        hosting = store_host_for(bool(assignment.command), assignment.per_node, self.node.master_listener() is not None)
        run.launched_generation, run.slots = run.generation, assignment.nprocs
        if not assignment.command:
            # Workers something else starts (Ray, Fabric, torchrun) exit into this generation.
            run.joined_reply = joined  # its place, for torchrun's handler (whoami)
            log.info("the coordinator assigns no command; serving as a node for external workers")
            return
        run.starts_workers = True
        run.cannot_start, self.launch = "", None
        per_node = assignment.per_node
        if per_node:
            run.joined_reply = joined  # its place, for the launcher's handler (whoami)
        try:
            if per_node and self.config.vouch_socket is None:
                raise ValueError(
                    "a per-node launcher's workers ask the agent's socket for vouches: set [agent] vouch_socket"
                )
            if run.run_dir is None:
                run.run_dir = self.node.privileged.job_dir(run.job_id)
            spec = WorkerSpec(
                command=list(assignment.command),
                nprocs=1 if per_node else assignment.nprocs,
                per_node_slots=assignment.nprocs if per_node else 0,
                coordinator=self.local_api.coordinator_for_workers,
                job_id=run.job_id,
                node_id=self.config.node_id,
                trust_bundle=str(self.local_api.bundle_path),
                env={
                    **worker_env(self.config, self.node.route),
                    **master_env(joined),
                    **(per_node_env(joined) if per_node else {}),
                    "MESHGATE_NODE_RANK": str(joined.node_rank),
                    **plan_env(self.node.privileged, run.run_dir, assignment),
                    **(self.node.job_user.env(run.run_dir.work) if self.node.job_user is not None else {}),
                    **dict(assignment.env),
                    **store_env(hosting),  # the port is held: no worker may try to host the store on it
                },
                first_rank=assignment.first_rank,
            )
            self.node.open_unit(run.job_id, run.generation)
            launch = Launch.start(
                spec,
                self.node.unit,
                # A per-node launcher's workers ask the socket, each for its own claimed rank.
                env_for_rank=(lambda _: {}) if per_node else self.local_api.vouch_env,
                spawn_options=lambda: self._spawn_options(run),
                output=lambda local_rank: self.worker_logs.sink_for(
                    run.job_id, run.generation, assignment.first_rank + local_rank
                ),
            )
        except CANNOT_START as exc:
            # Nothing in a job's spec or files may crash the agent: the job fails, the node serves on.
            why = getattr(exc, "strerror", None) or str(exc)
            run.cannot_start = f"cannot start {assignment.command[0][:120]!r} on node {self.config.node_id!r}: {why}"
            log.error("%s", run.cannot_start)
            return
        self.launch = launch
        launch.watch(run.post)
        if hosting is StoreHost.AGENT and joined.node_rank == 0:
            self.node.serve_store_on_demand(f"job {run.job_id} generation {run.generation}")
        log.info(
            "launched %s for ranks %d-%d: %s",
            "the node's launcher" if per_node else f"{assignment.nprocs} workers",
            assignment.first_rank,
            assignment.first_rank + assignment.nprocs - 1,
            " ".join(assignment.command),
        )

    def _spawn_options(self, run: JobRun) -> dict:
        """Popen options for a worker: into its job run's unit, as the job user."""
        options = {} if self.node.unit is None else self.node.unit.spawn_options()
        options.update(self.node.privileged.popen_options(run.run_dir))
        return options

    async def supervise(self, run: JobRun) -> Outcome:
        """Take the job run's signals until something ends this launch: OK (all exited 0),
        FAILED (the job failed), RELAUNCH (a new generation: membership changed or a worker
        failed anywhere) or STOP (SIGTERM).

        A worker that fails is never restarted alone (agent/decide.py): its exit goes to the
        coordinator, which ends the generation for the whole job (every agent relaunches all
        its workers) or, with the restarts spent, fails the job."""
        launch = self.launch
        if launch is None:  # a spare, or nothing to run: wait for a change
            return await self._await_change(run)
        while True:
            if self.stopping.is_set() or run.phase is JobPhase.STOPPED:
                return Outcome.STOP
            if run.phase is JobPhase.RELAUNCH:
                return Outcome.RELAUNCH
            if run.phase is JobPhase.OVER:
                await self.stop_workers(f"job over ({run.failure})")
                return Outcome.FAILED
            signal = await run.next()
            if not isinstance(signal, WorkerExited):
                run.take(signal)
                continue
            if not launch.is_new(signal):
                continue  # a worker of a launch that is over: its stopper reports it
            launch.reported[signal.local_rank] = signal.pid
            log.log(
                logging.INFO if signal.code == 0 else logging.WARNING,
                "worker local %d (pid %d) exited %d",
                signal.local_rank,
                signal.pid,
                signal.code,
            )
            for local_rank in launch.local_ranks(signal.local_rank):
                await self.report_exit(local_rank, signal.code)
            for action in run.take(dataclasses.replace(signal, codes=launch.codes())):
                if action.act is Act.STOP_OTHERS:
                    # Its world is broken: stop the node's other workers now, then follow
                    # the coordinator's decision (already in hand, or by heartbeat).
                    log.error(
                        "worker local %d failed; stopping the others until the coordinator decides", signal.local_rank
                    )
                    await self.stop_workers(action.reason)
                    return await self._await_change(run)
                if action.act is Act.ALL_EXITED:
                    return Outcome.OK if action.reason == "ok" else Outcome.FAILED

    async def _await_change(self, run: JobRun) -> Outcome:
        """With no workers running: take the run's signals until a relaunch, the job's end
        or SIGTERM."""
        phase = await run.until_phase_moves()
        if self.stopping.is_set() or phase is JobPhase.STOPPED:
            return Outcome.STOP
        return Outcome.FAILED if phase is JobPhase.OVER else Outcome.RELAUNCH

    async def stop_workers(self, why: str) -> None:
        launch, self.launch = self.launch, None
        if launch is not None:
            log.info("%s: stopping workers (grace %.0fs)", why, self.config.drain_grace_s)
            await launch.stop(
                self.config.drain_grace_s,
                lambda local_rank, code: self.report_exit(local_rank, code, stopped_by_agent=True),
            )
        await self.node.close_unit(why)

    async def report_exit(
        self,
        local_rank: int,
        code: int,
        stopped_by_agent: bool = False,
        start_failed: bool = False,
        detail: str = "",
        run: Optional[JobRun] = None,
    ) -> None:
        """Journal one exit, send it, and act on the coordinator's decision: a new
        generation means relaunch every worker; a failed job means stop. An exit the
        coordinator has not acknowledged stays in the journal and is sent again. ``run``:
        the job the exit belongs to (the current one unless named: a report that spans
        awaits must not pass to the next job, or the pool's empty one)."""
        run = run or self.run
        pending = PendingExit(
            job_id=run.job_id,
            node_id=self.config.node_id,
            generation=run.launched_generation,
            local_rank=local_rank,
            exit_code=code,
            stopped_by_agent=stopped_by_agent,
            start_failed=start_failed,
            detail=detail[:MAX_DETAIL],
            log_tail=await self._failure_tail(local_rank) if code and not (stopped_by_agent or start_failed) else "",
        )
        reply = await self.reporter.report(pending)
        if reply is None:
            return
        run.post(ExitAcknowledged(reply.generation, reply.job_failure, stopped_by_agent))

    async def _failure_tail(self, local_rank: int) -> str:
        first_rank = self.launch.first_rank if self.launch is not None else None
        if first_rank is None:
            return ""
        return await asyncio.to_thread(self.worker_logs.exit_tail, self.run.job_id, first_rank + local_rank)
