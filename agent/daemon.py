"""The node agent: join, heartbeat, launch the node's workers, supervise, drain.

  join (retrying until the coordinator answers) -> READY=1 to systemd -> heartbeats
  -> launch the assigned workers -> report every exit (journalled until the coordinator
     answers: agent/exits.py); a failure ends the generation for the whole job (the
     coordinator decides: next generation, or the job failed); a command that cannot
     start fails the job, never the agent
  -> on SIGTERM: Leave the job (its generation ends), stop the workers gracefully,
     report, leave the pool, exit 0.

Membership changes come back through heartbeats, and each one relaunches the workers
from a fresh Join (which is idempotent): a spare that is promoted gets the lost node's
rank block; a new generation restarts the workers so they re-register (same ranks) and
rebuild their process groups, as torchrun's elastic agent does; a node the coordinator
declared lost rejoins, and gets its block back or waits as a spare.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import os
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

import grpc

from meshgate.agent.config import AgentConfig
from meshgate.agent.exits import HOLD_REPORTS_ENV, MAX_DETAIL, ExitJournal, PendingExit
from meshgate.agent.reporter import Reporter
from meshgate.agent.session import AgentError, CoordinatorSession
from meshgate.agent.decide import Act, ExitAcknowledged, HeartbeatAnswer, HeartbeatRefused, JobPhase, Stop, WorkerExited
from meshgate.agent.job_run import JobRun
from meshgate.agent.local_api import LocalApi
from meshgate.agent.launch import Launch, master_env, plan_env, worker_env
from meshgate.agent.node import NodeContext
from meshgate.agent.containment import ContainmentError
from meshgate.agent.identity import NodeIdentity
from meshgate.agent.launcher import LauncherError
from meshgate.agent.liveness import HeartbeatCadence
from meshgate.agent.sdnotify import notify
from meshgate.agent.slots import detect_slots
from meshgate.launchers.local import LocalLauncher, WorkerSpec
from meshgate import logs, metrics
from meshgate.agent.vouch_socket import Refused
from meshgate.agent.worker_logs import WorkerLogs
from meshgate.attestation import AttestationError, TrustBundle, accept_trust_bundle
from meshgate.connection import Connection
from meshgate.v1 import nodes_pb2, nodes_pb2_grpc, rendezvous_pb2, rendezvous_pb2_grpc

log = logging.getLogger("meshgate.agent")


class Outcome(enum.Enum):
    """How one launch (supervise) or one job (serve_job) ended for this node."""

    OK = "ok"  # its workers exited 0
    FAILED = "failed"  # the job failed or ended
    RELAUNCH = "relaunch"  # a new generation: relaunch every worker
    STOP = "stop"  # SIGTERM


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        # The way to the coordinator every meshgate client uses, with the settings of [agent].
        self.session = CoordinatorSession(
            Connection(
                config.coordinator,
                config.tls,
                sources={"coordinator": "[agent] coordinator", "transport": "[agent] TLS keys"},
            )
        )
        self.identity = NodeIdentity(config.state_dir)
        self.credential = b""
        self.bundle: Optional[TrustBundle] = None
        self.bundle_path = config.state_dir / "trust-bundle.json"
        self.stopping = asyncio.Event()  # SIGTERM: the agent's lifetime, not a job's phase
        # The job served now (agent/job_run.py), made fresh for each: the config's, or in jobs
        # mode the one the coordinator gave this node; None while idle in the pool.
        self.run_: Optional[JobRun] = JobRun(config.job) if config.job else None
        self.launch_: Optional[Launch] = None  # the workers of the generation launched now
        # Jobs mode: the job an idle heartbeat named, and the queue the pool loop takes it from.
        self.assigned_job = ""
        self.assignments: "asyncio.Queue[str]" = asyncio.Queue()
        # Worker exits, journalled until the coordinator acknowledges them (agent/exits.py).
        self.reporter = Reporter(ExitJournal(config.state_dir / "exits"), self.session.call, lambda: self.credential)
        # Random per process start: a coordinator that sees a new one mid-job ends this
        # node's generation (the earlier instance's workers died with their units).
        self.instance = secrets.token_hex(8)
        # Built once in run(): the job user, the privileged part, the containment, the route.
        self.node = NodeContext(config)
        # Each worker's output, per job and rank, read through the coordinator (agent/worker_logs.py).
        self.worker_logs = WorkerLogs(config.state_dir / "worker-logs", config.worker_log_bytes, config.worker_log_jobs)
        # What the job's processes ask of this agent (agent/local_api.py): vouches, whoami, exits.
        self.local_api = LocalApi(
            config, self.identity, self.node, lambda: self.run_, self.report_exit, self.bundle_path
        )

    # What fan-in (agent/fanin.py) and the vouch socket read of the job served now.
    @property
    def job_id(self) -> str:
        return self.run_.job_id if self.run_ is not None else ""

    @property
    def generation(self) -> int:
        return self.run_.generation if self.run_ is not None else 0

    # The stubs fan-in forwards its workers' calls on.
    @property
    def nodes(self) -> nodes_pb2_grpc.NodesStub:
        return self.session.nodes

    @property
    def rendezvous(self) -> rendezvous_pb2_grpc.RendezvousStub:
        return self.session.rendezvous

    # ---- coordinator calls ---------------------------------------------------------------

    async def join(self) -> nodes_pb2.JoinResponse:
        """Join with the node credential if this node has one, else spend the join token."""
        slots, kind = detect_slots(self.config.slots, self.config.cpu_slots)
        request = nodes_pb2.JoinRequest(
            job_id=self.job_id,
            node_id=self.config.node_id,
            hostname=socket.gethostname(),
            slots=slots,
            slot_kind=kind,
            node_credential=self.identity.credential() or b"",
            node_public_key=self.identity.public_key,
            labels=dict(self.config.labels),
            agent_instance=self.instance,
        )
        if not request.node_credential:
            request.join_token = self.config.join_token
        # A job's Join offers the master (node rank 0's is used); the cluster Join has none.
        reservation = self.node.reserve_master() if self.job_id else None
        if reservation is not None:
            request.master_addr, request.master_port = reservation.address, reservation.port
        # A job's Join never spends the token.
        token = "" if self.config.jobs_mode and self.job_id else self.config.join_token
        joined = await self.session.join(request, token, self.config.join_timeout_s, self.stopping)
        if joined.node_credential:
            self.identity.save_credential(joined.node_credential)
        self.credential = self.identity.credential() or b""
        logs.add_secret(self.credential)  # never in a log line, in any spelling
        return joined

    async def heartbeat_loop(self, interval_s: float) -> None:
        """Heartbeats on the cadence of agent/liveness.py: short RPC timeouts and a prompt
        retry, so a blip shorter than (misses - 1) intervals never costs this node."""
        cadence = HeartbeatCadence(interval_s)
        next_refresh = time.monotonic() + self.config.bundle_refresh_s
        while not self.stopping.is_set():
            if time.monotonic() >= next_refresh:
                next_refresh = time.monotonic() + self.config.bundle_refresh_s
                await self.refresh_trust_bundle()
            running = 0 if self.launch_ is None else self.launch_.running()
            started = time.monotonic()
            ok = False
            try:
                reply = await self.session.call(
                    "NodeHeartbeat",
                    nodes_pb2.NodeHeartbeatRequest(
                        job_id=self.job_id,
                        node_id=self.config.node_id,
                        generation=self.generation,
                        running_workers=running,
                        node_credential=self.credential,
                        agent_instance=self.instance,
                        live_units=self.live_units(),
                    ),
                    timeout=cadence.rpc_timeout_s,
                )
                ok = True
                metrics.count_agent_heartbeat("OK")
                for wanted in reply.log_requests:  # readers of this node's workers' output
                    self.worker_logs.answer(wanted, self.push_logs, self.serves)
                self._follow_job(reply)
                self.reporter.resend_beside()
            except grpc.aio.AioRpcError as exc:
                metrics.count_agent_heartbeat(exc.code().name)
                log.warning("heartbeat failed: %s: %s", exc.code().name, exc.details())
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and self.run_ is not None:
                    self.run_.post(HeartbeatRefused(exc.details()))
            now = time.monotonic()
            pause = cadence.next_start(started, now, ok) - now
            try:
                await asyncio.wait_for(self.stopping.wait(), timeout=max(pause, 0.0))
            except asyncio.TimeoutError:
                pass

    def _follow_job(self, reply: nodes_pb2.NodeHeartbeatResponse) -> None:
        """The answer to the job served, as a signal on its queue; idle in the pool (jobs
        mode), an answer that names a running job assigns it to this node."""
        state = rendezvous_pb2.JobState.Name(reply.job_state) if reply.job_state else ""
        if self.run_ is not None:
            self.run_.post(
                HeartbeatAnswer(
                    job_id=reply.job_id,
                    generation=reply.generation,
                    job_state=state,
                    job_failure=reply.job_failure,
                    promoted=reply.node_state == rendezvous_pb2.NODE_STATE_ACTIVE,
                    node_rank=reply.node_rank,
                )
            )
        elif reply.job_id and state == "RUNNING" and not self.assigned_job:
            log.info("assigned to job %s", reply.job_id)
            self.assigned_job = reply.job_id
            self.assignments.put_nowait(reply.job_id)

    def live_units(self) -> list[str]:
        """The jobs whose containment unit on this node may still hold a process: a unit
        not yet seen empty, and in jobs mode the job served now (its workers may start at
        any moment), so the coordinator never gives this node away under them."""
        jobs = self.node.live_unit_jobs()
        if self.config.jobs_mode and (self.job_id or self.assigned_job):
            jobs.add(self.job_id or self.assigned_job)
        return sorted(jobs)

    async def refresh_trust_bundle(self) -> None:
        """Take the coordinator's newer bundle only if a key we trust endorses it."""
        try:
            signed = await self.session.call(
                "GetTrustBundle", rendezvous_pb2.GetTrustBundleRequest(job_id=self.job_id), timeout=10
            )
            fresh = accept_trust_bundle(signed, self.bundle)
        except grpc.aio.AioRpcError as exc:
            log.warning("trust bundle refresh failed: %s", exc.details())
            return
        except AttestationError as exc:
            metrics.count_verify_failure(exc.reason)
            log.error("trust bundle refused: %s", exc)
            return
        if fresh.version != self.bundle.version or set(fresh.keys) != set(self.bundle.keys):
            log.warning("trust bundle v%d -> v%d: keys %s", self.bundle.version, fresh.version, ", ".join(fresh.keys))
            self.bundle = fresh
            fresh.save(self.bundle_path)

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
            self._joined(joined, self.bundle_path)
        return joined

    async def report_exit(
        self, local_rank: int, code: int, stopped_by_agent: bool = False, start_failed: bool = False, detail: str = ""
    ) -> None:
        """Journal one exit, send it, and act on the coordinator's decision: a new
        generation means relaunch every worker; a failed job means stop. An exit the
        coordinator has not acknowledged stays in the journal and is sent again."""
        run = self.run_
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
        first_rank = self.launch_.first_rank if self.launch_ is not None else None
        if first_rank is None:
            return ""
        return await asyncio.to_thread(self.worker_logs.exit_tail, self.job_id, first_rank + local_rank)

    def serves(self, job_id: str) -> bool:
        """This node still runs or follows ``job_id`` (its end not learnt yet), or was just
        given it: the heartbeat answer that assigns a job may carry a reader's follow of it,
        answered before the node has joined (and while the previous job's end still shows)."""
        if self.run_ is not None and job_id == self.run_.job_id:
            return not self.run_.over
        return bool(job_id) and job_id == self.assigned_job

    async def push_logs(self, request_id: str, rank: int, data: bytes, done: bool, notice: str) -> bool:
        """One chunk of a log request's answer; True when its reader wants no more."""
        request = nodes_pb2.PushLogsRequest(
            node_id=self.config.node_id, node_credential=self.credential, request_id=request_id, rank=rank
        )
        request.data, request.done, request.notice = data, done, notice
        return (await self.session.call("PushLogs", request, timeout=60)).stop

    async def leave(self, reason: str) -> None:
        try:
            await self.session.call(
                "Leave",
                nodes_pb2.LeaveRequest(
                    job_id=self.job_id,
                    node_id=self.config.node_id,
                    reason=reason,
                    node_credential=self.credential,
                ),
                timeout=10,
            )
        except grpc.aio.AioRpcError as exc:
            log.warning("could not leave cleanly: %s", exc.details())

    # ---- workers -------------------------------------------------------------------------

    def launch(self, run: JobRun, joined: nodes_pb2.JoinResponse, bundle_path: str) -> None:
        assignment = joined.assignment
        self.node.hand_over_master(workers_started_elsewhere=not assignment.command)
        run.launched_generation = run.generation
        if not assignment.command:
            # Workers something else starts (Ray, Fabric, torchrun) exit into this generation.
            run.joined_reply = joined  # its place, for torchrun's handler (whoami)
            log.info("the coordinator assigns no command; serving as a node for external workers")
            return
        run.starts_workers = True
        run.cannot_start, self.launch_ = "", None
        launcher = None
        try:
            if run.run_dir is None:
                run.run_dir = self.node.privileged.job_dir(run.job_id)
            spec = WorkerSpec(
                command=list(assignment.command),
                nprocs=assignment.nprocs,
                coordinator=self.local_api.coordinator_for_workers,
                job_id=run.job_id,
                node_id=self.config.node_id,
                trust_bundle=bundle_path,
                env={
                    **worker_env(self.config, self.node.route),
                    **master_env(joined),
                    "MESHGATE_NODE_RANK": str(joined.node_rank),
                    **plan_env(self.node.privileged, run.run_dir, assignment),
                    **(self.node.job_user.env(run.run_dir.work) if self.node.job_user is not None else {}),
                    **dict(assignment.env),
                },
                first_rank=assignment.first_rank,
            )
            self.node.open_unit(run.job_id, run.generation)
            launcher = LocalLauncher(
                spec,
                env_for_rank=self.local_api.vouch_env,
                spawn_options=self.spawn_options,
                spawn_in=None if self.node.unit is None else self.node.unit.spawning,
                on_start=None if self.node.unit is None else self.node.unit.started,
                output=lambda local_rank: self.worker_logs.sink_for(
                    run.job_id, run.generation, assignment.first_rank + local_rank
                ),
            )
            launcher.start()
        except (OSError, ValueError, subprocess.SubprocessError, ContainmentError, LauncherError, Refused) as exc:
            # Nothing in a job's spec or files may crash the agent: the job fails, the node serves on.
            why = getattr(exc, "strerror", None) or str(exc)
            run.cannot_start = f"cannot start {assignment.command[0][:120]!r} on node {self.config.node_id!r}: {why}"
            log.error("%s", run.cannot_start)
            if launcher is not None:
                launcher.stop(0)
            return
        self.launch_ = Launch(launcher)
        self.launch_.watch(run.post)
        log.info(
            "launched %d workers for ranks %d-%d: %s",
            assignment.nprocs,
            assignment.first_rank,
            assignment.first_rank + assignment.nprocs - 1,
            " ".join(assignment.command),
        )

    def spawn_options(self) -> dict:
        """Popen options for a worker: into its job run's unit, as the job user."""
        options = {} if self.node.unit is None else self.node.unit.spawn_options()
        options.update(self.node.privileged.popen_options(self.run_.run_dir))
        return options

    async def supervise(self, run: JobRun) -> Outcome:
        """Take the job run's signals until something ends this launch: OK (all exited 0),
        FAILED (the job failed), RELAUNCH (a new generation: membership changed or a worker
        failed anywhere) or STOP (SIGTERM).

        A worker that fails is never restarted alone (agent/decide.py): its exit goes to the
        coordinator, which ends the generation for the whole job (every agent relaunches all
        its workers) or, with the restarts spent, fails the job."""
        launch = self.launch_
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
            await self.report_exit(signal.local_rank, signal.code)
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

    async def _report_remaining(self, launch: Launch) -> None:
        """Report the exits of workers this agent stopped: never failures."""
        for local_rank, process in enumerate(launch.processes):
            if launch.reported.get(local_rank) != process.pid and process.returncode is not None:
                launch.reported[local_rank] = process.pid
                await self.report_exit(local_rank, process.returncode, stopped_by_agent=True)

    async def stop_workers(self, why: str) -> None:
        launch, self.launch_ = self.launch_, None
        if launch is not None:
            log.info("%s: stopping workers (grace %.0fs)", why, self.config.drain_grace_s)
            await asyncio.to_thread(launch.launcher.stop, self.config.drain_grace_s)
            await self._report_remaining(launch)
        await self.node.close_unit(why)

    async def drain(self) -> None:
        notify("STOPPING=1")
        # Leave first: the job's generation ends (the coordinator bumps it), so what the
        # stopped workers' peers do next is never blamed on them.
        await self.leave("drained")
        await self.stop_workers("draining")
        await self.remove_job_dir()
        if self.config.jobs_mode and self.job_id:
            self.run_ = None
            await self.leave("drained")  # and out of the pool

    # ---- main ----------------------------------------------------------------------------

    async def serve_job(self, run: JobRun, joined: nodes_pb2.JoinResponse, bundle_path: Path) -> Outcome:
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
                self.launch(run, joined, str(bundle_path))
                if run.cannot_start:
                    for local_rank in range(joined.assignment.nprocs):
                        await self.report_exit(local_rank, 127, start_failed=True, detail=run.cannot_start)
            outcome = await self.supervise(run)
            if outcome is Outcome.OK and self.config.jobs_mode:
                # This node's workers are done, but the node serves the job until it
                # ends: a failure elsewhere may still restart the whole job.
                log.info("workers exited 0; following job %s until it ends", run.job_id)
                self.launch_, finished = None, run.launched_generation
                outcome = await self._await_change(run)
                if outcome is Outcome.FAILED:  # the job is over (whatever its end)
                    return Outcome.OK
            if outcome is not Outcome.RELAUNCH:
                if outcome is not Outcome.STOP:
                    self.launch_ = None
                return outcome
            await self.stop_workers(run.relaunch_reason)
            await self.reporter.settle()  # what this node's workers did comes before its Join
            try:
                joined = await self.join()
            except AgentError as exc:
                # The job ended while this node was away (a lost node learns it here).
                run.end(str(exc))
                return Outcome.FAILED
            self._joined(joined, bundle_path)

    async def serve_jobs(self, bundle_path: Path) -> int:
        """Jobs mode: idle in the pool until the coordinator gives this node a job, serve
        it, go back to the pool; job after job, until SIGTERM."""
        while not self.stopping.is_set():
            job_id = await self.assignments.get()
            if self.stopping.is_set():
                break
            await self.reporter.settle()  # a pending exit may end the job this node is given
            self._begin_job(job_id)
            try:
                joined = await self.join()
            except AgentError as exc:
                log.error("job %s: %s; back to the pool", self.job_id, exc)
                self._end_job()
                continue
            self._joined(joined, bundle_path)
            notify(f"STATUS=node_rank {joined.node_rank} of job {self.job_id}")
            outcome = await self.serve_job(self.run_, joined, bundle_path)
            if outcome is Outcome.STOP:
                break
            await self.node.close_unit(f"job {self.job_id} is over")
            await self.remove_job_dir()
            log.info(
                "job %s is over for this node (%s); back to the pool",
                self.job_id,
                "workers exited 0" if outcome is Outcome.OK else self.run_.failure or outcome.value,
            )
            self._end_job()
            notify(f"STATUS=node {self.config.node_id} idle")
        await self.drain()
        return 0

    def _begin_job(self, job_id: str) -> None:
        """A job for this node (jobs mode): a fresh run of it, nothing of the last one's."""
        self.run_ = JobRun(job_id, pool=True)
        self.local_api.ended_job, self.local_api.ended_why = "", ""

    async def remove_job_dir(self) -> None:
        """What the job left on this node, once its unit is empty (never while a process
        of it may still write there); what cannot be removed is said, and tried again at
        the agent's next start."""
        if await self.node.remove_job_dir(self.job_id) and self.run_ is not None:
            self.run_.run_dir = None  # the next job gets a directory of its own, whatever this one left

    def _end_job(self) -> None:
        run, self.run_ = self.run_, None
        self.worker_logs.forget(run.job_id)
        self.local_api.ended_job, self.local_api.ended_why = run.job_id, run.failure or f"job {run.job_id} is over"
        self.assigned_job, self.launch_ = "", None

    def _joined(self, joined: nodes_pb2.JoinResponse, bundle_path) -> None:
        if self.run_ is not None:  # whoami shows a spare's place now, a member's once launched
            self.run_.joined(joined)
        self.bundle_path = bundle_path
        if self.bundle is None:
            # First contact: the bundle is as trustworthy as the (m)TLS channel it came on.
            self.bundle = TrustBundle.from_proto(joined.trust_bundle)
        else:
            self.bundle = accept_trust_bundle(joined.signed_trust_bundle, self.bundle)
        self.bundle.save(bundle_path)
        os.chmod(bundle_path, 0o644)  # public: the workers verify with it, as any user
        if self.config.jobs_mode and not self.job_id:
            log.info("joined the cluster as node %s", self.config.node_id)
        elif joined.spare:
            log.info("joined job %s as a hot spare (node %s)", self.job_id, self.config.node_id)
        else:
            log.info(
                "joined job %s as node_rank %d (node %s), generation %d",
                self.job_id,
                joined.node_rank,
                self.config.node_id,
                joined.generation,
            )

    def _stop(self) -> None:
        """SIGTERM: the agent stops; the job served hears it on its queue, the pool loop on its."""
        if not self.stopping.is_set():
            self.stopping.set()
            if self.run_ is not None:
                self.run_.post(Stop())
            self.assignments.put_nowait("")

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop)
        if self.config.jobs_mode and not self.config.run_as:  # run_jobs_as_agent = true (config.py)
            log.warning(
                "INSECURE%s: run_jobs_as_agent = true: this agent runs the command of every job the "
                "coordinator gives this node as its own user%s, for whoever may submit jobs (admin or "
                "submitter role), and a job can read the node's credential and keys; set [agent] run_as "
                'to an unprivileged job user (SECURITY.md, "Jobs")',
                " AS ROOT" if os.geteuid() == 0 else "",
                " (root)" if os.geteuid() == 0 else "",
            )
        if os.environ.get(HOLD_REPORTS_ENV):
            log.warning(
                "TEST HOOK %s is set: while %s exists, worker exits are journalled and never sent",
                HOLD_REPORTS_ENV,
                os.environ[HOLD_REPORTS_ENV],
            )
        await self.node.build(self.session.current)
        self.session.connect()
        joined = await self.join()
        self.config.state_dir.mkdir(parents=True, exist_ok=True)
        bundle_path = self.config.state_dir / "trust-bundle.json"
        self._joined(joined, bundle_path)
        self.reporter.heartbeat_interval_s = joined.heartbeat_interval_ms / 1000 or 5.0
        # Exits an earlier run of this agent journalled but never got acknowledged: the
        # coordinator learns them before this node serves anything again.
        await self.reporter.flush()
        if self.config.jobs_mode:
            notify(f"READY=1\nSTATUS=node {self.config.node_id} joined the cluster, idle")
        else:
            notify(f"READY=1\nSTATUS=node_rank {joined.node_rank} of job {self.job_id}")
        heartbeats = asyncio.create_task(self.heartbeat_loop(self.reporter.heartbeat_interval_s))
        await self.local_api.serve(self)
        try:
            if self.config.jobs_mode:
                return await self.serve_jobs(bundle_path)
            outcome = await self.serve_job(self.run_, joined, bundle_path)
            if outcome in (Outcome.OK, Outcome.FAILED):
                log.info("workers finished: %s", "all exited 0" if outcome is Outcome.OK else "failed")
                if self.config.exit_when_done:
                    await self.leave("workers finished" if outcome is Outcome.OK else "workers failed")
                    return 0 if outcome is Outcome.OK else 1
                await self.stopping.wait()
            await self.drain()
            return 0
        finally:
            self._stop()
            heartbeats.cancel()
            self.worker_logs.close()
            self.reporter.close()
            await self.node.close_unit("the agent stops")
            await self.remove_job_dir()
            self.node.release()
            await self.local_api.close()
            await self.session.close()
