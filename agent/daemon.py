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
import logging
import os
import secrets
import signal
import socket
import time

import grpc

from meshgate import logs, metrics
from meshgate.agent.config import AgentConfig
from meshgate.agent.decide import HeartbeatAnswer, HeartbeatRefused, Stop
from meshgate.agent.exits import HOLD_REPORTS_ENV, ExitJournal
from meshgate.agent.health import HealthCheck
from meshgate.agent.identity import NodeIdentity
from meshgate.agent.job_runner import JobRunner, Outcome
from meshgate.agent.job_source import DeclaredJob, JobSource, PoolAssignments
from meshgate.agent.liveness import HeartbeatCadence
from meshgate.agent.local_api import LocalApi
from meshgate.agent.node import NodeContext
from meshgate.agent.reporter import Reporter
from meshgate.agent.sdnotify import notify
from meshgate.agent.session import AgentError, CoordinatorSession
from meshgate.agent.slots import node_slots
from meshgate.agent.trust_bundle import TrustBundleKeeper
from meshgate.agent.worker_logs import WorkerLogs
from meshgate.connection import Connection
from meshgate.v1 import nodes_pb2, nodes_pb2_grpc, rendezvous_pb2, rendezvous_pb2_grpc

log = logging.getLogger("meshgate.agent")


def log_joined(job_id: str, node_id: str, joined: nodes_pb2.JoinResponse) -> None:
    """The line an operator greps for (and the tests wait on): what this Join made the node."""
    if not job_id:
        log.info("joined the cluster as node %s", node_id)
    elif joined.spare:
        log.info("joined job %s as a hot spare (node %s)", job_id, node_id)
    else:
        log.info(
            "joined job %s as node_rank %d (node %s), generation %d",
            job_id,
            joined.node_rank,
            node_id,
            joined.generation,
        )


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
        self.trust = TrustBundleKeeper(config.state_dir / "trust-bundle.json")
        # SIGTERM: an asyncio.Event for the agent's whole lifetime, never reset (a job's own
        # stop is its run's phase, agent/decide.py); every loop and wait of the agent ends on it.
        self.stopping = asyncio.Event()
        # Where the jobs come from: the one place the agent reads its mode (agent/job_source.py).
        self.source: JobSource = PoolAssignments(config) if config.jobs_mode else DeclaredJob(config)
        # Worker exits, journalled until the coordinator acknowledges them (agent/exits.py).
        self.reporter = Reporter(ExitJournal(config.state_dir / "exits"), self.session.call, lambda: self.credential)
        # Random per process start: a coordinator that sees a new one mid-job ends this
        # node's generation (the earlier instance's workers died with their units).
        self.instance = secrets.token_hex(8)
        # Built once in run(): the job user, the privileged part, the containment, the route.
        self.node = NodeContext(config)
        # Each worker's output, per job and rank, read through the coordinator (agent/worker_logs.py).
        self.worker_logs = WorkerLogs(config.state_dir / "worker-logs", config.worker_log_bytes, config.worker_log_jobs)
        # The job served now and its workers (agent/job_runner.py).
        self.runner = JobRunner(config, self.node, self.reporter, self.worker_logs, self.stopping, self.join)
        self.runner.run = self.source.first()
        # What the job's processes ask of this agent (agent/local_api.py): vouches, whoami, exits.
        self.local_api = LocalApi(
            config, self.identity, self.node, lambda: self.runner.run, self.runner.report_exit, self.trust.path
        )
        self.runner.local_api = self.local_api
        self.health = HealthCheck(config.health_check)  # the node's check: on Join and heartbeats

    # What fan-in (agent/fanin.py) reads of the job served now, and the stubs it forwards on.
    @property
    def job_id(self) -> str:
        return self.runner.run.job_id if self.runner.run is not None else ""

    @property
    def generation(self) -> int:
        return self.runner.run.generation if self.runner.run is not None else 0

    @property
    def nodes(self) -> nodes_pb2_grpc.NodesStub:
        return self.session.nodes

    @property
    def rendezvous(self) -> rendezvous_pb2_grpc.RendezvousStub:
        return self.session.rendezvous

    # ---- coordinator calls ---------------------------------------------------------------

    async def join(self) -> nodes_pb2.JoinResponse:
        """Join the job served now (the cluster while idle in the pool) with the node
        credential if this node has one, else spend the join token; take what it answers."""
        run = self.runner.run
        slots, kind = node_slots(self.node.inventory, self.config.slots, self.config.cpu_slots)
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
            health=self.health.report(),
            hardware=self.node.hardware(),
        )
        if not request.node_credential:
            request.join_token = self.config.join_token
        # A job's Join offers the master (node rank 0's is used); the cluster Join has none.
        reservation = self.node.reserve_master() if self.job_id else None
        if reservation is not None:
            request.master_addr, request.master_port = reservation.address, reservation.port
        # A pool job's Join never spends the token (the node joined the cluster with it).
        token = "" if run is not None and run.pool else self.config.join_token
        joined = await self.session.join(request, token, self.config.join_timeout_s, self.stopping)
        if joined.node_credential:
            self.identity.save_credential(joined.node_credential)
        self.credential = self.identity.credential() or b""
        logs.add_secret(self.credential)  # never in a log line, in any spelling
        self._joined(joined)
        return joined

    def _joined(self, joined: nodes_pb2.JoinResponse) -> None:
        if self.runner.run is not None:  # whoami shows a spare's place now, a member's once launched
            self.runner.run.joined(joined)
        self.trust.take(joined)
        log_joined(self.job_id, self.config.node_id, joined)

    # ---- the heartbeats: the agent's one task beside the jobs -------------------------------

    async def heartbeat_loop(self, interval_s: float) -> None:
        """Heartbeats on the cadence of agent/liveness.py: short RPC timeouts and a prompt
        retry, so a blip shorter than (misses - 1) intervals never costs this node."""
        cadence = HeartbeatCadence(interval_s)
        next_refresh = time.monotonic() + self.config.bundle_refresh_s
        send_hardware = False  # the Join carried it; a restarted coordinator asks again
        while not self.stopping.is_set():
            if time.monotonic() >= next_refresh:
                next_refresh = time.monotonic() + self.config.bundle_refresh_s
                await self.trust.refresh(self.session, self.job_id)
            running = self.runner.running()
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
                        health=self.health.report(),
                        progress=self.local_api.progress_report(),
                        hardware=self.node.hardware() if send_hardware else None,
                    ),
                    timeout=cadence.rpc_timeout_s,
                )
                ok = True
                send_hardware = reply.send_hardware  # a coordinator started since this node's Join
                metrics.count_agent_heartbeat("OK")
                for wanted in reply.log_requests:  # readers of this node's workers' output
                    self.worker_logs.answer(wanted, self.push_logs, self.serves)
                if reply.run_health_check:  # an operator's uncordon waits for a check begun now
                    self.health.ask()
                self._follow_job(reply)
                self.reporter.resend_beside()
            except grpc.aio.AioRpcError as exc:
                metrics.count_agent_heartbeat(exc.code().name)
                log.warning("heartbeat failed: %s: %s", exc.code().name, exc.details())
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and self.runner.run is not None:
                    self.runner.run.post(HeartbeatRefused(exc.details()))
            now = time.monotonic()
            pause = cadence.next_start(started, now, ok) - now
            try:
                await asyncio.wait_for(self.stopping.wait(), timeout=max(pause, 0.0))
            except asyncio.TimeoutError:
                pass

    def _follow_job(self, reply: nodes_pb2.NodeHeartbeatResponse) -> None:
        """The answer to the job served, as a signal on its queue; idle, one naming a running job goes to the source."""
        state = rendezvous_pb2.JobState.Name(reply.job_state) if reply.job_state else ""
        run = self.runner.run
        if run is not None:
            run.post(
                HeartbeatAnswer(
                    job_id=reply.job_id,
                    generation=reply.generation,
                    job_state=state,
                    job_failure=reply.job_failure,
                    promoted=reply.node_state == rendezvous_pb2.NODE_STATE_ACTIVE,
                    node_rank=reply.node_rank,
                )
            )
        elif reply.job_id and state == "RUNNING":
            self.source.offer(reply.job_id)

    def live_units(self) -> list[str]:
        """Jobs whose unit on this node may hold a process: a unit not seen empty, and a pool
        job served or given (its workers may start any moment): never given away under them."""
        jobs = self.node.live_unit_jobs()
        run = self.runner.run
        if run is not None and run.pool:
            jobs.add(run.job_id)
        elif run is None and self.source.claimed:
            jobs.add(self.source.claimed)
        return sorted(jobs)

    def serves(self, job_id: str) -> bool:
        """This node runs or follows ``job_id`` (its end not learnt), or was just given it: the
        answer that assigns a job may carry a reader's follow, answered before the node joined."""
        run = self.runner.run
        if run is not None and job_id == run.job_id:
            return not run.over
        return bool(job_id) and job_id == self.source.claimed

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

    # ---- the jobs -------------------------------------------------------------------------

    async def serve_jobs(self, joined: nodes_pb2.JoinResponse) -> int:
        """The one loop over the jobs the source gives (agent/job_source.py): the declared
        job, which the first Join joined, or each job the pool gives this node, joined here."""
        run = self.runner.run
        while True:
            if run is None:
                if self.stopping.is_set():
                    break
                run = await self.source.next_job()
                if run is None or self.stopping.is_set():
                    break
                await self.reporter.settle()  # a pending exit may end the job this node is given
                self.runner.begin(run)
                try:
                    joined = await self.join()
                except AgentError as exc:
                    log.error("job %s: %s; back to the pool", run.job_id, exc)
                    self.runner.end()
                    self.source.claimed, run = "", None
                    continue
                notify(f"STATUS=node_rank {joined.node_rank} of job {run.job_id}")
            outcome = await self.runner.serve(run, joined)
            if outcome is Outcome.STOP:
                break
            await self.node.adopted.job_over(run.ended_as, f"job {run.job_id} is over")  # a hand-started launcher
            code = await self.source.job_over(self, run, outcome)
            if code is not None:
                return code
            run = None
        await self.drain()
        return 0

    async def drain(self) -> None:
        notify("STOPPING=1")
        # Leave first: the job's generation ends (the coordinator bumps it), so what the
        # stopped workers' peers do next is never blamed on them.
        await self.leave("drained")
        await self.runner.stop_workers("draining")
        await self.runner.remove_job_dir()
        run = self.runner.run
        if run is not None and run.pool:
            self.runner.run = None
            await self.leave("drained")  # and out of the pool

    def _stop(self) -> None:
        """SIGTERM: the agent stops; the job served hears it on its queue, the source's wait on its."""
        if not self.stopping.is_set():
            self.stopping.set()
            if self.runner.run is not None:
                self.runner.run.post(Stop())
            self.source.wake()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop)
        self.source.announce()
        if os.environ.get(HOLD_REPORTS_ENV):
            log.warning(
                "TEST HOOK %s is set: while %s exists, worker exits are journalled and never sent",
                HOLD_REPORTS_ENV,
                os.environ[HOLD_REPORTS_ENV],
            )
        await self.node.build(self.session.current)
        await self.health.until_passing(self.stopping, "before the first Join", must_pass=not self.config.jobs_mode)
        self.session.connect()
        joined = await self.join()
        self.reporter.heartbeat_interval_s = joined.heartbeat_interval_ms / 1000 or 5.0
        await self.reporter.flush()  # an earlier run's unacknowledged exits, before anything is served
        notify(f"READY=1\nSTATUS={self.source.ready_status(joined)}")
        heartbeats = asyncio.create_task(self.heartbeat_loop(self.reporter.heartbeat_interval_s))
        checks = asyncio.create_task(self.health.while_idle(self.stopping, lambda: not self.live_units()))
        await self.local_api.serve(self)
        try:
            return await self.serve_jobs(joined)
        finally:
            self._stop()
            heartbeats.cancel(), checks.cancel()
            self.worker_logs.close()
            self.reporter.close()
            await self.node.close_unit("the agent stops")
            self.node.adopted.kill_all("the agent stops")
            await self.runner.remove_job_dir()
            self.node.release()
            await self.local_api.close()
            await self.session.close()
