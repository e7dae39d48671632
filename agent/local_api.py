"""What a job's processes ask of this agent on the node: a vouch, which node this is, whether
a caller may ask at all, the exits of workers the agent did not start (torchrun's). Served on
the vouch socket (agent/vouch_socket.py), and the caller check on the fan-in's front too
(agent/fanin.py, agent/peer_front.py).

It reads the job served now (agent/job_run.py) and the unit of its workers (agent/node.py),
and writes neither: an exit it is told of goes to the job loop's report_exit, like any other.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Awaitable, Callable, Optional

from meshgate.agent.config import AgentConfig
from meshgate.agent.fanin import FanInServer, FanInServicer, serve_fan_in
from meshgate.agent.identity import NodeIdentity
from meshgate.agent.job_run import JobRun
from meshgate.agent.node import NodeContext
from meshgate.agent.vouch_socket import ExternalExits, LocalNode, Refused, VouchSocket
from meshgate.agent_socket import ReportedProgress
from meshgate.v1 import nodes_pb2
from meshgate.attestation import sign_vouch
from meshgate.client import VOUCH_ENV

log = logging.getLogger("meshgate.agent")

# An adopted launcher's exit status is not the agent's to see (not its child): a failure of
# its node's slots, the detail saying so.
LAUNCHER_GONE_EXIT = 1

# report_exit(local_rank, code, detail=...): the job loop's, which journals and sends it.
ReportExit = Callable[..., Awaitable[None]]


class LocalApi:
    def __init__(
        self,
        config: AgentConfig,
        identity: NodeIdentity,
        node: NodeContext,
        current: Callable[[], Optional[JobRun]],
        report_exit: ReportExit,
        bundle_path: Path,
    ) -> None:
        self.config = config
        self.identity = identity
        self.node = node
        self.current = current  # the job served now, None while idle in the pool
        self.report_exit = report_exit
        self.bundle_path = bundle_path
        self.fan_in_path = config.state_dir / "rendezvous.sock"
        self.vouch_socket: Optional[VouchSocket] = None
        self.fan_in_server: Optional[FanInServer] = None
        self.fan_in_servicer: Optional[FanInServicer] = None
        # The job this node served last, once it is over, and why (whoami says so).
        self.ended_job, self.ended_why = "", ""
        # The latest progress of each local rank, for one (job, generation): the heartbeat's.
        self.progress: dict[int, nodes_pb2.RankProgress] = {}
        self.progress_of: tuple[str, int] = ("", 0)

    @property
    def job_id(self) -> str:
        run = self.current()
        return run.job_id if run is not None else ""

    @property
    def generation(self) -> int:
        run = self.current()
        return run.generation if run is not None else 0

    def _over(self) -> bool:
        run = self.current()
        return run is not None and run.over

    # ---- serving -------------------------------------------------------------------------

    async def serve(self, fan_in_peer) -> None:
        """The vouch socket and the fan-in, as the config asks; ``fan_in_peer`` is what the
        fan-in reads of the agent (agent/fanin.py: config, identity, job, stubs)."""
        if self.config.vouch_socket is not None:
            allowed = set(self.config.vouch_socket_uids or (os.getuid(),))
            if self.node.job_user is not None:
                allowed.add(self.node.job_user.uid)  # and then only from inside its job's unit
            self.vouch_socket = VouchSocket(
                self.config.vouch_socket,
                self.mint_vouch,
                self.whoami,
                allowed_uids=allowed,
                check_caller=self.check_vouch_caller,
                report_exits=self.report_external_exits,
                note_progress=self.note_progress,
                master_socket=self.master_socket,
                on_admitted=self.adopt_caller,
            )
            self.node.adopted.on_launcher_gone = self.launcher_gone
            await self.vouch_socket.start()
            self.node.privileged.share_socket(self.config.vouch_socket)
        if self.config.fan_in:
            self.fan_in_server, self.fan_in_servicer = await serve_fan_in(
                fan_in_peer, self.fan_in_path, check_caller=self.check_vouch_caller
            )
            self.node.privileged.share_socket(self.fan_in_path)

    @property
    def coordinator_for_workers(self) -> str:
        """Where this node's workers register: the fan-in's socket when it serves, else the
        coordinator itself."""
        return f"unix:{self.fan_in_path}" if self.fan_in_server else self.config.coordinator

    async def close(self) -> None:
        if self.vouch_socket is not None:
            self.vouch_socket.close()
        if self.fan_in_server is not None:
            await self.fan_in_server.stop(grace=1)
            log.info(
                "fan-in: forwarded %d registers in %d batches",
                self.fan_in_servicer.forwarded,
                self.fan_in_servicer.batches_sent,
            )

    # ---- the answers ---------------------------------------------------------------------

    def check_vouch_caller(self, pid: int, uid: int) -> Optional[str]:
        """None if the socket's caller may have a vouch now, else why not: while this node
        runs a job's workers, only a process inside their unit, for that job and
        generation; the job user never otherwise."""
        unit = self.node.unit
        if unit is None:
            if self.node.job_user is not None and uid == self.node.job_user.uid:
                return (
                    f"uid {uid} is the job user and this node runs no job's workers now (pid {pid}: "
                    f"{self.node.containment.describe_pid(pid)}); workers the agent does not start (Ray) run "
                    "as a uid of [agent] vouch_socket_uids"
                )
            return None
        if not unit.holds(pid):
            return (
                f"pid {pid} is not a process of job {unit.job_id!r} generation {unit.generation} "
                f"(its {self.node.containment.describe_pid(pid)}; the unit is {unit.where})"
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
        if not self.job_id or self._over():
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

    def vouch_env(self, local_rank: int) -> dict[str, str]:
        return {VOUCH_ENV: base64.b64encode(self.mint_vouch(local_rank)).decode()}

    def whoami(self) -> LocalNode:
        """Which meshgate node this is: what Ray and Fabric workers register under, and
        its place in the job served now as the last Join gave it (torchrun's handler)."""
        run = self.current()
        ended_job, ended = self.ended_job, self.ended_why
        if self._over():
            ended_job, ended = self.job_id, run.failure
        route = self.node.route  # the interface its collectives use: gloo/NCCL of workers it does not start
        interface = route.interface if route is not None else ""
        node = LocalNode(
            self.config.node_id, self.job_id, self.generation, ended_job=ended_job, ended=ended, interface=interface
        )
        joined = None if run is None else run.joined_reply
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
            agent_started=run.starts_workers,
        )

    def note_progress(self, reported: ReportedProgress) -> None:
        """A worker's latest step (meshgate.report), stamped with this agent's clock; kept
        for the job and generation served now only (the caller check saw to the caller)."""
        served = (self.job_id, self.generation)
        if not self.job_id or self._over():
            raise Refused("this node serves no job now: no progress to report", quiet=True)
        if served != self.progress_of:
            self.progress, self.progress_of = {}, served
        slots = self.current().slots  # (a job is served: checked above)
        if reported.local_rank >= slots:  # the coordinator would refuse the heartbeat that carried it
            raise Refused(
                f"local_rank {reported.local_rank} is not one of this node's {slots} in job {self.job_id!r}", quiet=True
            )
        sample = nodes_pb2.RankProgress(local_rank=reported.local_rank, step=reported.step, at=time.time())
        for name in ("loss", "samples_per_s", "step_time_s"):
            if getattr(reported, name) is not None:
                setattr(sample, name, getattr(reported, name))
        self.progress[reported.local_rank] = sample

    def progress_report(self) -> list[nodes_pb2.RankProgress]:
        """What the next heartbeat carries: the latest of each rank, for the generation served now."""
        if (self.job_id, self.generation) != self.progress_of:
            return []
        return [self.progress[rank] for rank in sorted(self.progress)]

    def master_socket(self):
        """The job's master's listening socket, for node rank 0's store host alone (the
        caller passed check_vouch_caller: in the job's unit, or an admitted uid)."""
        run = self.current()
        joined = None if run is None else run.joined_reply
        if joined is None or run.over or joined.spare or joined.node_rank != 0:
            raise Refused(
                f"node {self.config.node_id!r} is not node rank 0 of a running job: it hosts no master's store"
            )
        listener = self.node.master_listener()
        if listener is None:
            raise Refused(
                "this agent holds no listening master socket (MASTER_ADDR and MASTER_PORT set by the operator)"
            )
        return listener

    def adopt_caller(self, pid: int, launcher: bool) -> None:
        """An admitted caller while a job with no command is served: a hand-started launcher
        (torchrun's handler says so) or its worker is tracked until the job ends here; any
        other caller (a Ray or Fabric worker) is not."""
        run = self.current()
        if run is not None and not run.over and not run.starts_workers:
            self.node.adopted.adopt(run.job_id, pid, launcher)

    async def launcher_gone(self, pid: int) -> None:
        """An adopted launcher died (its workers were killed with it): the node's slots whose
        exits it had not reported exit now, so the job restarts or fails by its policy."""
        run = self.current()
        if run is None or run.over or run.starts_workers:
            return
        generation = run.launched_generation
        detail = f"its launcher pid {pid} (hand-started) is gone, exit status unseen (not the agent's child)"
        unreported = self.node.adopted.unreported(generation, run.slots)
        if unreported:
            log.warning("job %s: %s: local ranks %s of generation %d exit", run.job_id, detail, unreported, generation)
        for local_rank in unreported:
            await self.report_exit(local_rank, LAUNCHER_GONE_EXIT, detail=detail, run=run)

    async def report_external_exits(self, exits: ExternalExits) -> int:
        """Exits of workers this agent did not start (torchrun's), reported as its own: a
        failure ends the generation for the whole job (the coordinator decides), exit 0
        of every worker makes the job SUCCEEDED. Only for the generation this node was
        given last; an older one's is over already. Returns the generation after it."""
        run = self.current()
        if run is not None and run.starts_workers:
            # Its workers are this agent's children: their exits are known here, never taken
            # from the job's own socket (a job could end itself SUCCEEDED while it runs on).
            raise Refused(
                f"job {self.job_id!r}: this agent started its workers and reports their exits itself; "
                "an exited line is only for workers it did not start (torchrun's)"
            )
        if run is not None and not run.over and exits.generation == run.launched_generation:
            self.node.adopted.note_reported(exits.generation, exits.local_ranks)
            log.info(
                "external workers local %s of generation %d exited %d%s",
                list(exits.local_ranks),
                exits.generation,
                exits.exit_code,
                f": {exits.detail}" if exits.detail else "",
            )
            for local_rank in exits.local_ranks:
                await self.report_exit(local_rank, exits.exit_code, detail=exits.detail, run=run)
        return self.generation
