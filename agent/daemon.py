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
import base64
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
from meshgate.agent.decide import (
    Act,
    Action,
    ExitAcknowledged,
    HeartbeatAnswer,
    HeartbeatRefused,
    JobPhase,
    JobView,
    Signal,
    WorkerExited,
    decide,
)
from meshgate.agent.containment import Containment, ContainmentError, ContainmentUnit, open_containment
from meshgate.agent.fanin import serve_fan_in
from meshgate.agent.identity import NodeIdentity
from meshgate.agent.job_user import JobUser, JobUserError
from meshgate.agent.launcher import JobRunDir, Launcher, LauncherError, clear_ambient_capabilities
from meshgate.agent.liveness import HeartbeatCadence
from meshgate.agent.netif import MASTER_ENVS, InterfaceError, MasterReservation, Route, choose
from meshgate.agent.sdnotify import notify
from meshgate.agent.slots import detect_slots
from meshgate.launchers.local import LocalLauncher, WorkerSpec
from meshgate.launchers.ray_labels import ray_node_labels, write_labels_file
from meshgate import logs, metrics
from meshgate.agent.vouch_socket import ExternalExits, LocalNode, Refused, VouchSocket
from meshgate.agent.worker_logs import WorkerLogs
from meshgate.attestation import AttestationError, TrustBundle, accept_trust_bundle, sign_vouch
from meshgate.client import AGENT_SOCKET_ENV, VOUCH_ENV
from meshgate.connection import Connection
from meshgate.plan import PLAN_FILE_ENV, ParallelPlan
from meshgate.v1 import nodes_pb2, nodes_pb2_grpc, rendezvous_pb2, rendezvous_pb2_grpc

log = logging.getLogger("meshgate.agent")

UNIT_KILL_TIMEOUT_S = 30.0
JOB_PATHS_ENV = "MESHGATE_JOB_PATHS"  # how long a killed containment unit may take to empty


class Outcome(enum.Enum):
    """How one launch (supervise) or one job (serve_job) ended for this node."""

    OK = "ok"  # its workers exited 0
    FAILED = "failed"  # the job failed or ended
    RELAUNCH = "relaunch"  # a new generation: relaunch every worker
    STOP = "stop"  # SIGTERM


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        # The job this agent serves now: the config's, or (jobs mode) the one the
        # coordinator gave this node; "" while idle in the pool.
        self.job_id = config.job
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
        self.vouch_socket: Optional[VouchSocket] = None
        self.fan_in_server = None
        self.fan_in_path = config.state_dir / "rendezvous.sock"
        self.stopping = asyncio.Event()
        self.launcher: Optional[LocalLauncher] = None
        self.generation = 0
        self.launched_generation = 0  # the generation the running workers were launched into
        self.job_failure = ""
        self.job_failed = asyncio.Event()
        # Jobs mode: set by an idle heartbeat that names the job this node now serves.
        self.assigned = asyncio.Event()
        self.assigned_job = ""
        self.spare = False
        self.relaunch = asyncio.Event()
        self.relaunch_reason = ""
        self.route: Optional[Route] = None  # chosen once, in run()
        # The master port offered at Join; released just before the workers start.
        self.master_reservation: Optional[MasterReservation] = None
        # Worker exits, journalled until the coordinator acknowledges them (agent/exits.py).
        self.reporter = Reporter(ExitJournal(config.state_dir / "exits"), self.session.call, lambda: self.credential)
        # Why this launch's command could not start on this node ("" when it started).
        self.cannot_start = ""
        # Random per process start: a coordinator that sees a new one mid-job ends this
        # node's generation (the earlier instance's workers died with their units).
        self.instance = secrets.token_hex(8)
        self.job_user: Optional[JobUser] = None  # [agent] run_as, resolved in run()
        self.job_user_hold = None  # this agent's exclusive hold on the job user (JobUser.claim)
        # The one privileged part (agent/launcher.py): job directories, uid switch, sockets.
        self.privileged = Launcher(None, config.state_dir)
        self.run_dir: Optional[JobRunDir] = None  # the job's directory on this node, once made
        # The job served now has a command: the agent starts its workers and knows their exits
        # (an "exited" line on the socket is refused for it).
        self.starts_workers = False
        self.containment: Optional[Containment] = None
        self.unit: Optional[ContainmentUnit] = None  # the unit of the workers launched now
        self.lingering: list[ContainmentUnit] = []  # units that did not empty when killed
        # Each worker's output, per job and rank, read through the coordinator (agent/worker_logs.py).
        self.worker_logs = WorkerLogs(config.state_dir / "worker-logs", config.worker_log_bytes, config.worker_log_jobs)
        # The last Join's answer for the job served now, once its workers may start (a spare's
        # at once): whoami tells torchrun's handler its place from it.
        self.joined_reply: Optional[nodes_pb2.JoinResponse] = None
        # The job this node served last, once it is over, and why (whoami says so).
        self.ended_job, self.ended_why = "", ""

    # The stubs fan-in (agent/fanin.py) forwards its workers' calls on.
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
        reservation = self.reserve_master() if self.job_id else None
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
            running = 0 if self.launcher is None else sum(p.poll() is None for p in self.launcher.processes)
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
                if self.config.jobs_mode:
                    self._follow_job(reply)
                else:
                    self._signal(self._answer(reply))
                self.generation = reply.generation
                self.reporter.resend_beside()
            except grpc.aio.AioRpcError as exc:
                metrics.count_agent_heartbeat(exc.code().name)
                log.warning("heartbeat failed: %s: %s", exc.code().name, exc.details())
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self._signal(HeartbeatRefused(exc.details()))
            now = time.monotonic()
            pause = cadence.next_start(started, now, ok) - now
            try:
                await asyncio.wait_for(self.stopping.wait(), timeout=max(pause, 0.0))
            except asyncio.TimeoutError:
                pass

    def _follow_job(self, reply: nodes_pb2.NodeHeartbeatResponse) -> None:
        """Jobs mode: take an assignment while idle, learn the end of the job served."""
        state = rendezvous_pb2.JobState.Name(reply.job_state) if reply.job_state else ""
        if not self.job_id and reply.job_id and state == "RUNNING" and not self.assigned.is_set():
            log.info("assigned to job %s", reply.job_id)
            self.assigned_job = reply.job_id
            self.assigned.set()
        self._signal(self._answer(reply))

    @staticmethod
    def _answer(reply: nodes_pb2.NodeHeartbeatResponse) -> HeartbeatAnswer:
        return HeartbeatAnswer(
            job_id=reply.job_id,
            generation=reply.generation,
            job_state=rendezvous_pb2.JobState.Name(reply.job_state) if reply.job_state else "",
            job_failure=reply.job_failure,
            promoted=reply.node_state == rendezvous_pb2.NODE_STATE_ACTIVE,
            node_rank=reply.node_rank,
        )

    def _view(self) -> JobView:
        phase = JobPhase.FOLLOWING
        if self.job_failed.is_set():
            phase = JobPhase.OVER
        elif self.relaunch.is_set():
            phase = JobPhase.RELAUNCH
        return JobView(
            self.job_id, phase, self.generation, self.launched_generation, self.spare, pool=self.config.jobs_mode
        )

    def _signal(self, signal: Signal) -> tuple[Action, ...]:
        """What the job served makes of a signal (agent/decide.py), applied."""
        actions = decide(self._view(), signal)
        for action in actions:
            if action.act is Act.RELAUNCH:
                self._ask_relaunch(action.reason)
            elif action.act is Act.FAIL_JOB:
                self._job_failed(action.reason)
            elif action.act is Act.END_JOB:
                self._job_ended(action.reason)
        return actions

    def live_units(self) -> list[str]:
        """The jobs whose containment unit on this node may still hold a process: a unit
        not yet seen empty, and in jobs mode the job served now (its workers may start at
        any moment), so the coordinator never gives this node away under them."""
        units = [u for u in self.lingering if not u.is_empty()]
        self.lingering = units
        jobs = {u.job_id for u in units}
        if self.unit is not None and not self.unit.is_empty():
            jobs.add(self.unit.job_id)
        if self.config.jobs_mode and (self.job_id or self.assigned_job):
            jobs.add(self.job_id or self.assigned_job)
        return sorted(jobs)

    def check_vouch_caller(self, pid: int, uid: int) -> Optional[str]:
        """None if the socket's caller may have a vouch now, else why not: while this node
        runs a job's workers, only a process inside their unit, for that job and
        generation; the job user never otherwise."""
        unit = self.unit
        if unit is None:
            if self.job_user is not None and uid == self.job_user.uid:
                return (
                    f"uid {uid} is the job user and this node runs no job's workers now (pid {pid}: "
                    f"{self.containment.describe_pid(pid)}); workers the agent does not start (Ray) run "
                    "as a uid of [agent] vouch_socket_uids"
                )
            return None
        if not unit.holds(pid):
            return (
                f"pid {pid} is not a process of job {unit.job_id!r} generation {unit.generation} "
                f"(its {self.containment.describe_pid(pid)}; the unit is {unit.where})"
            )
        if (unit.job_id, unit.generation) != (self.job_id, self.generation):
            return (
                f"pid {pid} belongs to job {unit.job_id!r} generation {unit.generation}; this node "
                f"serves job {self.job_id!r} generation {self.generation} now"
            )
        return None

    def mint_vouch(self, local_rank: int, rank: Optional[int] = None) -> bytes:
        """A fresh vouch for one worker: this node, this job, this generation, this local
        rank (and, for a claimed-mode worker, the one rank it claims), short-lived; the
        coordinator lets one worker spend it. None once the job is over on this node."""
        if not self.job_id or self.job_failed.is_set():
            last = self.ended_job or self.job_id or "(none)"
            raise Refused(f"this node serves no job now (the last, {last!r}, is over): no vouch")
        vouch = sign_vouch(
            self.identity.key,
            job_id=self.job_id,
            node_id=self.config.node_id,
            generation=self.generation,
            local_rank=local_rank,
            expires_at=time.time() + self.config.vouch_ttl_s,
            rank=rank,
        )
        return vouch.SerializeToString()

    def whoami(self) -> LocalNode:
        """Which meshgate node this is: what Ray and Fabric workers register under, and
        its place in the job served now as the last Join gave it (torchrun's handler)."""
        ended_job, ended = self.ended_job, self.ended_why
        if self.job_id and self.job_failed.is_set():
            ended_job, ended = self.job_id, self.job_failure
        node = LocalNode(self.config.node_id, self.job_id, self.generation, ended_job=ended_job, ended=ended)
        joined = self.joined_reply
        if not self.job_id or joined is None:
            return node
        assignment = joined.assignment
        return dataclasses.replace(
            node,
            joined_generation=joined.generation,
            node_rank=joined.node_rank,
            spare=joined.spare,
            nodes=assignment.world_size // assignment.nprocs if assignment.nprocs else 0,
            slots=assignment.nprocs,
            master_addr=assignment.master_addr,
            master_port=assignment.master_port,
            trust_bundle=str(self.bundle_path),
        )

    async def report_external_exits(self, exits: ExternalExits) -> int:
        """Exits of workers this agent did not start (torchrun's), reported as its own: a
        failure ends the generation for the whole job (the coordinator decides), exit 0
        of every worker makes the job SUCCEEDED. Only for the generation this node was
        given last; an older one's is over already. Returns the generation after it."""
        if self.starts_workers:
            # Its workers are this agent's children: their exits are known here, never taken
            # from the job's own socket (a job could end itself SUCCEEDED while it runs on).
            raise Refused(
                f"job {self.job_id!r}: this agent started its workers and reports their exits itself; "
                "an exited line is only for workers it did not start (torchrun's)"
            )
        if self.job_id and not self.job_failed.is_set() and exits.generation == self.launched_generation:
            log.info(
                "external workers local %s of generation %d exited %d%s",
                list(exits.local_ranks),
                exits.generation,
                exits.exit_code,
                f": {exits.detail}" if exits.detail else "",
            )
            for local_rank in exits.local_ranks:
                await self.report_exit(local_rank, exits.exit_code, detail=exits.detail)
        return self.generation

    def vouch_env(self, local_rank: int) -> dict[str, str]:
        return {VOUCH_ENV: base64.b64encode(self.mint_vouch(local_rank)).decode()}

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

    def choose_route(self) -> Route:
        """The workers' address and interface, once: from the config, else the route to the
        coordinator. Workers get it even behind fan-in, where they dial a Unix socket."""
        try:
            route = choose(
                self.session.current,
                advertise_address=self.config.advertise_address,
                interface=self.config.interface,
            )
        except InterfaceError as exc:
            raise AgentError(f"cannot choose the workers' network: {exc}") from None
        log.info("workers advertise %s on interface %s (%s)", route.address, route.interface, route.source)
        return route

    def reserve_master(self) -> Optional[MasterReservation]:
        """The master this node offers at Join (kept across Join retries, fresh after the
        workers started on the last one); None before a route is chosen."""
        if self.master_reservation is None and self.route is not None:
            try:
                self.master_reservation = MasterReservation.reserve(self.route.address, dict(os.environ))
            except InterfaceError as exc:
                raise AgentError(str(exc)) from None
        return self.master_reservation

    async def await_master(self, joined: nodes_pb2.JoinResponse) -> nodes_pb2.JoinResponse:
        """Workers start with the job's master in their environment: until node rank 0's
        agent has joined, Join again each heartbeat interval (Join is idempotent), for at
        most join_timeout_s; after that they start without it (the log says so)."""
        interval = joined.heartbeat_interval_ms / 1000 or 5.0
        deadline = time.monotonic() + self.config.join_timeout_s
        while not joined.assignment.master_addr:  # workers that an agent does not start need it too
            if self.stopping.is_set() or self.relaunch.is_set() or self.job_failed.is_set():
                break
            if time.monotonic() > deadline:
                log.warning(
                    "no master from node rank 0's agent after %.0fs; workers start without MASTER_ADDR / MASTER_PORT",
                    self.config.join_timeout_s,
                )
                break
            log.info("waiting for node rank 0's agent to join: it hosts the job's master")
            try:
                await asyncio.wait_for(self.stopping.wait(), timeout=interval)
            except asyncio.TimeoutError:
                pass
            try:
                joined = await self.join()
            except AgentError as exc:  # the job ended meanwhile (cancelled): nothing to launch
                self._job_ended(str(exc))
                break
            self._joined(joined, self.bundle_path)
        return joined

    def master_env(self, joined: nodes_pb2.JoinResponse) -> dict[str, str]:
        """MASTER_ADDR / MASTER_PORT from the coordinator's assignment, NODE_RANK and
        WORLD_SIZE as Lightning reads them; a variable the operator set is left alone."""
        assignment = joined.assignment
        wanted = {"NODE_RANK": str(joined.node_rank), "WORLD_SIZE": str(assignment.world_size)}
        if assignment.master_addr:
            wanted.update(zip(MASTER_ENVS, (assignment.master_addr, str(assignment.master_port))))
        return {k: v for k, v in wanted.items() if k not in os.environ}

    def worker_env(self) -> dict[str, str]:
        """Network and transport settings for the workers, and the vouch socket for their
        children. A variable the operator set in the agent's environment is left alone."""
        env = {} if self.route is None else self.route.worker_env(already_set=os.environ)
        if self.config.vouch_socket is not None:
            env[AGENT_SOCKET_ENV] = str(self.config.vouch_socket)
        if self.config.job_paths:  # where training writes: checkpoints, datasets, caches
            env[JOB_PATHS_ENV] = ":".join(map(str, self.config.job_paths))
        tls = self.config.tls
        if tls is None:
            return {**env, "MESHGATE_INSECURE": "1"}
        # Never let an inherited MESHGATE_INSECURE downgrade the workers of a TLS agent.
        env["MESHGATE_INSECURE"] = "0"
        env["MESHGATE_TLS_CA"] = str(tls.ca_file)
        if tls.server_name:
            env["MESHGATE_TLS_SERVER_NAME"] = tls.server_name
        # Fan-in workers dial this agent's socket: they need no key, and the job user could
        # not read the agent's worker key anyway (its resolve would fail on the file).
        if self.config.worker_cert_file and self.config.worker_key_file and not self.config.fan_in:
            env["MESHGATE_TLS_CERT"] = str(self.config.worker_cert_file)
            env["MESHGATE_TLS_KEY"] = str(self.config.worker_key_file)
        return env

    def _ask_relaunch(self, reason: str) -> None:
        if not self.relaunch.is_set():
            log.warning("relaunch: %s", reason)
            self.relaunch_reason = reason
            self.relaunch.set()

    def _job_failed(self, reason: str) -> None:
        if not self.job_failed.is_set():
            if not logs.cancelled(reason):  # a cancel is over at INFO (_job_ended), not failed
                log.error("the job failed: %s", reason)
            self._job_ended(reason)

    def _job_ended(self, reason: str) -> None:
        """The job this agent serves is over (failed, cancelled, or in jobs mode succeeded
        elsewhere): its workers stop and nothing of it is launched again."""
        if not self.job_failed.is_set():
            log.info("the job is over: %s", reason)
            self.job_failure = reason
            self.job_failed.set()

    async def report_exit(
        self, local_rank: int, code: int, stopped_by_agent: bool = False, start_failed: bool = False, detail: str = ""
    ) -> None:
        """Journal one exit, send it, and act on the coordinator's decision: a new
        generation means relaunch every worker; a failed job means stop. An exit the
        coordinator has not acknowledged stays in the journal and is sent again."""
        pending = PendingExit(
            job_id=self.job_id,
            node_id=self.config.node_id,
            generation=self.launched_generation,
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
        self._signal(ExitAcknowledged(reply.generation, reply.job_failure, stopped_by_agent))

    async def _failure_tail(self, local_rank: int) -> str:
        first_rank = self.launcher.spec.first_rank if self.launcher is not None else None
        if first_rank is None:
            return ""
        return await asyncio.to_thread(self.worker_logs.exit_tail, self.job_id, first_rank + local_rank)

    def serves(self, job_id: str) -> bool:
        """This node still runs or follows ``job_id`` (its end not learnt yet), or was just
        given it: the heartbeat answer that assigns a job may carry a reader's follow of it,
        answered before the node has joined (and while the previous job's end still shows)."""
        if job_id == self.job_id:
            return not self.job_failed.is_set()
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

    def launch(self, joined: nodes_pb2.JoinResponse, bundle_path: str) -> None:
        assignment = joined.assignment
        reservation_kept = self.master_reservation
        if self.master_reservation is not None:
            # Free the port for rank 0 to listen on; the next Join reserves a fresh one.
            self.master_reservation.release()
            self.master_reservation = None
        if not assignment.command:
            # Workers something else starts (Ray, Fabric, torchrun) exit into this generation.
            self.launched_generation = self.generation
            # torchrun's handler on node rank 0 hosts its store at the master for the whole
            # run: this node offers the same endpoint at every later Join, nothing bound.
            if reservation_kept is not None:
                self.master_reservation = MasterReservation(reservation_kept.address, reservation_kept.port)
            self.joined_reply = joined  # its place, for torchrun's handler (whoami)
            log.info("the coordinator assigns no command; serving as a node for external workers")
            return
        self.starts_workers = True
        self.launched_generation = self.generation
        self.cannot_start, self.launcher = "", None
        try:
            if self.run_dir is None:
                self.run_dir = self.privileged.job_dir(self.job_id)
            spec = WorkerSpec(
                command=list(assignment.command),
                nprocs=assignment.nprocs,
                coordinator=f"unix:{self.fan_in_path}" if self.fan_in_server else self.config.coordinator,
                job_id=self.job_id,
                node_id=self.config.node_id,
                trust_bundle=bundle_path,
                env={
                    **self.worker_env(),
                    **self.master_env(joined),
                    "MESHGATE_NODE_RANK": str(joined.node_rank),
                    **self.plan_env(assignment),
                    **(self.job_user.env(self.run_dir.work) if self.job_user is not None else {}),
                    **dict(assignment.env),
                },
                first_rank=assignment.first_rank,
            )
            if self.containment is not None:
                self.unit = self.containment.create(self.job_id, self.generation)
            self.launcher = LocalLauncher(
                spec,
                env_for_rank=self.vouch_env,
                spawn_options=self.spawn_options,
                spawn_in=None if self.unit is None else self.unit.spawning,
                on_start=None if self.unit is None else self.unit.started,
                output=lambda local_rank: self.worker_logs.sink_for(
                    self.job_id, self.generation, assignment.first_rank + local_rank
                ),
            )
            self.launcher.start()
        except (OSError, ValueError, subprocess.SubprocessError, ContainmentError, LauncherError, Refused) as exc:
            # Nothing in a job's spec or files may crash the agent: the job fails, the node serves on.
            why = getattr(exc, "strerror", None) or str(exc)
            self.cannot_start = f"cannot start {assignment.command[0][:120]!r} on node {self.config.node_id!r}: {why}"
            log.error("%s", self.cannot_start)
            if self.launcher is not None:
                self.launcher.stop(0)
            self.launcher = None
            return
        log.info(
            "launched %d workers for ranks %d-%d: %s",
            assignment.nprocs,
            assignment.first_rank,
            assignment.first_rank + assignment.nprocs - 1,
            " ".join(assignment.command),
        )

    def plan_env(self, assignment: nodes_pb2.LaunchAssignment) -> dict[str, str]:
        """The job's plan in a file its workers read (meshgate.current_plan()): in the job's
        directory, which the agent writes and the job only reads (agent/launcher.py)."""
        if not assignment.HasField("plan"):
            return {}  # a coordinator from before the plan travelled with the assignment
        try:
            path = self.privileged.write_plan(self.run_dir, ParallelPlan.from_proto(assignment.plan).to_toml())
        except (OSError, LauncherError) as exc:  # the workers' current_plan() then says the variable is unset
            log.error("cannot write the job's plan for its workers to %s: %s", self.run_dir.plan, exc)
            return {}
        return {PLAN_FILE_ENV: str(path)}

    def spawn_options(self) -> dict:
        """Popen options for a worker: into its job run's unit, as the job user."""
        options = {} if self.unit is None else self.unit.spawn_options()
        options.update(self.privileged.popen_options(self.run_dir))
        return options

    async def close_unit(self, why: str) -> None:
        """Kill every process of the current job run and wait until its unit is empty; a
        unit that does not empty stays listed in live_units (the node stays out of the pool)."""
        unit, self.unit = self.unit, None
        if unit is None:
            return
        try:
            killed = await asyncio.to_thread(unit.kill_and_wait, UNIT_KILL_TIMEOUT_S)
        except (ContainmentError, OSError) as exc:
            log.error("%s: %s; this node stays out of the pool while it holds a process", why, exc)
            self.lingering.append(unit)
            return
        log.info(
            "%s: containment unit %s of job %s generation %d is empty (killed pids %s)",
            why,
            unit.where,
            unit.job_id,
            unit.generation,
            killed or "none",
        )

    async def supervise(self, joined: nodes_pb2.JoinResponse) -> Outcome:
        """Watch the workers until something ends this launch: OK (all exited 0), FAILED
        (the job failed), RELAUNCH (a new generation: membership changed or a worker failed
        anywhere) or STOP (SIGTERM).

        A worker that fails is never restarted alone: its peers' world has formed and
        could not take it back. Its exit goes to the coordinator, which ends the
        generation for the whole job (every agent relaunches all its workers) or, with
        the restarts spent, fails the job."""
        if self.launcher is None:  # a spare, or nothing to run: wait for a change
            return await self._await_change()
        reported: dict[int, int] = {}
        while not self.stopping.is_set():
            if self.relaunch.is_set():
                return Outcome.RELAUNCH
            if self.job_failed.is_set():
                await self.stop_workers(f"job over ({self.job_failure})")
                return Outcome.FAILED
            for local_rank, process in enumerate(self.launcher.processes):
                code = process.poll()
                if code is None or reported.get(local_rank) == process.pid:
                    continue
                reported[local_rank] = process.pid
                log.log(
                    logging.INFO if code == 0 else logging.WARNING,
                    "worker local %d (pid %d) exited %d",
                    local_rank,
                    process.pid,
                    code,
                )
                await self.report_exit(local_rank, code)
                codes = tuple(
                    p.returncode if reported.get(i) == p.pid else None for i, p in enumerate(self.launcher.processes)
                )
                for action in decide(self._view(), WorkerExited(local_rank, code, codes)):
                    if action.act is Act.STOP_OTHERS:
                        # Its world is broken: stop the node's other workers now, then follow
                        # the coordinator's decision (already in hand, or by heartbeat).
                        log.error(
                            "worker local %d failed; stopping the others until the coordinator decides", local_rank
                        )
                        await self.stop_workers(action.reason, reported)
                        return await self._await_change()
                    if action.act is Act.ALL_EXITED:
                        return Outcome.OK if action.reason == "ok" else Outcome.FAILED
            try:
                await asyncio.wait_for(self.stopping.wait(), timeout=0.2)
            except asyncio.TimeoutError:
                pass
        return Outcome.STOP

    async def _await_change(self) -> Outcome:
        """With no workers running: wait for a relaunch, the job's failure or SIGTERM."""
        waits = [asyncio.ensure_future(e.wait()) for e in (self.stopping, self.relaunch, self.job_failed)]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        if self.stopping.is_set():
            return Outcome.STOP
        return Outcome.FAILED if self.job_failed.is_set() else Outcome.RELAUNCH

    async def _report_remaining(self, reported: dict[int, int]) -> None:
        """Report the exits of workers this agent stopped: never failures."""
        assert self.launcher is not None
        for local_rank, process in enumerate(self.launcher.processes):
            if reported.get(local_rank) != process.pid and process.returncode is not None:
                reported[local_rank] = process.pid
                await self.report_exit(local_rank, process.returncode, stopped_by_agent=True)

    async def stop_workers(self, why: str, reported: Optional[dict[int, int]] = None) -> None:
        if self.launcher is not None:
            log.info("%s: stopping workers (grace %.0fs)", why, self.config.drain_grace_s)
            await asyncio.to_thread(self.launcher.stop, self.config.drain_grace_s)
            await self._report_remaining({} if reported is None else reported)
            self.launcher = None
        await self.close_unit(why)

    async def drain(self) -> None:
        notify("STOPPING=1")
        # Leave first: the job's generation ends (the coordinator bumps it), so what the
        # stopped workers' peers do next is never blamed on them.
        await self.leave("drained")
        await self.stop_workers("draining")
        await self.remove_job_dir()
        if self.config.jobs_mode and self.job_id:
            self.job_id = ""
            await self.leave("drained")  # and out of the pool

    # ---- main ----------------------------------------------------------------------------

    async def serve_job(self, joined: nodes_pb2.JoinResponse, bundle_path: Path) -> Outcome:
        """Launch and supervise this node's workers of one job, relaunching them into each
        new generation, until the job is over for this node: OK (its workers exited 0),
        FAILED (the job failed or ended) or STOP (SIGTERM)."""
        finished = -1  # the generation whose workers all exited 0 on this node
        while True:
            self.relaunch.clear()
            if joined.generation == finished:
                # Back from being declared lost in a generation this node finished: its
                # workers never run it again (the exits were resent before the Join).
                log.info("generation %d already finished on this node; following job %s", finished, self.job_id)
            elif not joined.spare:
                joined = await self.await_master(joined)
                if self.job_failed.is_set():
                    return Outcome.FAILED  # it ended before its workers started
                self.launch(joined, str(bundle_path))
                if self.cannot_start:
                    for local_rank in range(joined.assignment.nprocs):
                        await self.report_exit(local_rank, 127, start_failed=True, detail=self.cannot_start)
            outcome = await self.supervise(joined)
            if outcome is Outcome.OK and self.config.jobs_mode:
                # This node's workers are done, but the node serves the job until it
                # ends: a failure elsewhere may still restart the whole job.
                log.info("workers exited 0; following job %s until it ends", self.job_id)
                self.launcher, finished = None, self.launched_generation
                outcome = await self._await_change()
                if outcome is Outcome.FAILED:  # the job is over (whatever its end)
                    return Outcome.OK
            if outcome is not Outcome.RELAUNCH:
                if outcome is not Outcome.STOP:
                    self.launcher = None
                return outcome
            await self.stop_workers(self.relaunch_reason)
            await self.reporter.settle()  # what this node's workers did comes before its Join
            try:
                joined = await self.join()
            except AgentError as exc:
                # The job ended while this node was away (a lost node learns it here).
                self._job_ended(str(exc))
                return Outcome.FAILED
            self._joined(joined, bundle_path)

    async def serve_jobs(self, bundle_path: Path) -> int:
        """Jobs mode: idle in the pool until the coordinator gives this node a job, serve
        it, go back to the pool; job after job, until SIGTERM."""
        while not self.stopping.is_set():
            waits = [asyncio.ensure_future(e.wait()) for e in (self.stopping, self.assigned)]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for wait in waits:
                wait.cancel()
            if self.stopping.is_set():
                break
            await self.reporter.settle()  # a pending exit may end the job this node is given
            self._begin_job(self.assigned_job)
            try:
                joined = await self.join()
            except AgentError as exc:
                log.error("job %s: %s; back to the pool", self.job_id, exc)
                self._end_job()
                continue
            self._joined(joined, bundle_path)
            notify(f"STATUS=node_rank {joined.node_rank} of job {self.job_id}")
            outcome = await self.serve_job(joined, bundle_path)
            if outcome is Outcome.STOP:
                break
            await self.close_unit(f"job {self.job_id} is over")
            await self.remove_job_dir()
            log.info(
                "job %s is over for this node (%s); back to the pool",
                self.job_id,
                "workers exited 0" if outcome is Outcome.OK else self.job_failure or outcome.value,
            )
            self._end_job()
            notify(f"STATUS=node {self.config.node_id} idle")
        await self.drain()
        return 0

    def _begin_job(self, job_id: str) -> None:
        self.job_id = job_id
        self.generation = self.launched_generation = 0
        self.job_failure, self.spare = "", False
        self.job_failed.clear()
        self.relaunch.clear()
        self.joined_reply, self.ended_job, self.ended_why = None, "", ""
        self.starts_workers = False

    async def remove_job_dir(self) -> None:
        """What the job left on this node, once its unit is empty (never while a process
        of it may still write there); what cannot be removed is said, and tried again at
        the agent's next start."""
        if self.unit is not None or not self.job_id or any(u.job_id == self.job_id for u in self.lingering):
            return
        try:
            await asyncio.to_thread(self.privileged.remove_job_dir, self.job_id)
        except (LauncherError, OSError) as exc:
            log.error("job %s: its directory is not fully removed: %s", self.job_id, exc)
        self.run_dir = None  # the next job gets a directory of its own, whatever this one left

    def _end_job(self) -> None:
        self.worker_logs.forget(self.job_id)
        self.ended_job, self.ended_why = self.job_id, self.job_failure or f"job {self.job_id} is over"
        self.job_id, self.assigned_job, self.joined_reply = "", "", None
        self.assigned.clear()
        self.launcher = None

    def _joined(self, joined: nodes_pb2.JoinResponse, bundle_path) -> None:
        self.generation = joined.generation
        # whoami shows a spare's place now, a member's once launch() has freed the master port.
        self.joined_reply = joined if self.job_id and joined.spare else None
        self.spare = joined.spare
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

    async def contain(self) -> None:
        """Before the first Join: the job user, the containment, and the units of this
        agent's earlier run killed (its workers must never hold ranks beside new ones)."""
        if self.config.run_as:
            try:
                self.job_user = JobUser.resolve(self.config.run_as)
                clear_ambient_capabilities()
            except (JobUserError, LauncherError) as exc:
                raise AgentError(str(exc)) from None
            self.privileged = Launcher(self.job_user, self.config.state_dir)
            log.info(
                "workers run as %s (uid %d, gid %d) in %s",
                self.job_user.name,
                self.job_user.uid,
                self.job_user.gid,
                self.job_user.workdir(),
            )
        self.containment = open_containment(self.config.node_id, self.config.cgroup_dir, self.config.state_dir)
        try:
            earlier = await asyncio.to_thread(self.containment.kill_earlier_units, UNIT_KILL_TIMEOUT_S)
        except (ContainmentError, OSError) as exc:
            raise AgentError(f"cannot kill the containment units of an earlier run: {exc}") from None
        for name, pids in earlier.items():
            log.warning(
                "killed containment unit %s of this agent's earlier run before joining (pids %s)",
                name,
                pids or "none: it was empty",
            )
        if self.job_user is not None:
            try:  # after the earlier run's units are dead: its jobs held the user
                self.job_user_hold = self.job_user.claim()
            except JobUserError as exc:
                raise AgentError(str(exc)) from None
        self.config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.job_user is not None:
            # The job user may pass through (its trust bundle, plan and sockets are here) but
            # not list it; the node key and credential inside stay 0600, the agent's alone.
            os.chmod(self.config.state_dir, 0o711)
        try:
            left = await asyncio.to_thread(self.privileged.remove_earlier_job_dirs)
        except (LauncherError, OSError) as exc:
            raise AgentError(f"cannot remove the job directories of an earlier run: {exc}") from None
        if left:
            log.warning("removed the directories of jobs %s left by this agent's earlier run", left)
        for path in self.config.job_paths:
            refusal = await asyncio.to_thread(self.privileged.job_user_may_write, path)
            if refusal is not None:
                raise AgentError(f"[agent] job_paths: {refusal}")

    def write_ray_labels(self) -> None:
        """This node's Ray labels (its node id, switch, rack) for `ray start --labels-file`,
        so RayTrainLauncher can place each worker on its meshgate rank's node."""
        if self.config.ray_labels_file is not None:
            labels = ray_node_labels(self.config.node_id, dict(self.config.labels))
            try:
                write_labels_file(self.config.ray_labels_file, labels)
            except OSError as exc:
                raise AgentError(f"cannot write [agent] ray_labels_file {self.config.ray_labels_file}: {exc}") from None
            log.info("Ray labels for this node in %s: %s", self.config.ray_labels_file, labels)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
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
        await self.contain()
        self.write_ray_labels()
        self.route = self.choose_route()
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
        if self.config.vouch_socket is not None:
            allowed = set(self.config.vouch_socket_uids or (os.getuid(),))
            if self.job_user is not None:
                allowed.add(self.job_user.uid)  # and then only from inside its job's unit
            self.vouch_socket = VouchSocket(
                self.config.vouch_socket,
                self.mint_vouch,
                self.whoami,
                allowed_uids=allowed,
                check_caller=self.check_vouch_caller,
                report_exits=self.report_external_exits,
            )
            await self.vouch_socket.start()
            self.privileged.share_socket(self.config.vouch_socket)
        if self.config.fan_in:
            self.fan_in_server, self.fan_in_servicer = await serve_fan_in(self, self.fan_in_path)
            self.privileged.share_socket(self.fan_in_path)
        try:
            if self.config.jobs_mode:
                return await self.serve_jobs(bundle_path)
            outcome = await self.serve_job(joined, bundle_path)
            if outcome in (Outcome.OK, Outcome.FAILED):
                log.info("workers finished: %s", "all exited 0" if outcome is Outcome.OK else "failed")
                if self.config.exit_when_done:
                    await self.leave("workers finished" if outcome is Outcome.OK else "workers failed")
                    return 0 if outcome is Outcome.OK else 1
                await self.stopping.wait()
            await self.drain()
            return 0
        finally:
            self.stopping.set()
            heartbeats.cancel()
            self.worker_logs.close()
            self.reporter.close()
            await self.close_unit("the agent stops")
            await self.remove_job_dir()
            if not self.lingering:
                self.containment.release()
            if self.vouch_socket is not None:
                self.vouch_socket.close()
            if self.fan_in_server is not None:
                await self.fan_in_server.stop(grace=1)
                log.info(
                    "fan-in: forwarded %d registers in %d batches",
                    self.fan_in_servicer.forwarded,
                    self.fan_in_servicer.batches_sent,
                )
            await self.session.close()
