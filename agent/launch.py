"""One generation's workers on this node: their environment, started, watched, stopped, and
the exits of those a stop ended reported.

Each worker's exit becomes a signal on the job run's queue (agent/decide.py WorkerExited):
a thread per worker blocks in its process's wait() and hands the exit to the event loop.
Threads rather than asyncio's child watchers: the workers are Popen processes started by
launchers/local.py (inside a containment unit, as the job user), not asyncio subprocesses,
and a watcher that reaps them would race Popen's own bookkeeping (its returncode, which
LocalLauncher.stop and the heartbeat's count of running workers read); Popen.wait() from
one thread is the documented way to wait without polling, and costs one parked thread per
local worker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import threading
from typing import Awaitable, Callable, Optional

from meshgate.agent.config import AgentConfig
from meshgate.agent.containment import ContainmentError, ContainmentUnit
from meshgate.agent.decide import Signal, WorkerExited
from meshgate.agent.launcher import JobRunDir, Launcher, LauncherError
from meshgate.agent.netif import MASTER_ENVS, Route
from meshgate.agent.vouch_socket import Refused
from meshgate.client import AGENT_SOCKET_ENV
from meshgate.launchers.local import LocalLauncher, WorkerSpec
from meshgate.plan import PLAN_FILE_ENV, ParallelPlan
from meshgate.v1 import nodes_pb2

log = logging.getLogger("meshgate.agent")

JOB_PATHS_ENV = "MESHGATE_JOB_PATHS"

# What a job's spec or files can make go wrong in starting its workers: the job fails to start
# on this node, never the agent (a vouch refused for the job is one: Refused).
CANNOT_START = (OSError, ValueError, subprocess.SubprocessError, ContainmentError, LauncherError, Refused)

# report(local_rank, exit_code): the exit of a worker a stop ended, as the agent reports it.
ReportStopped = Callable[[int, int], Awaitable[None]]


class Launch:
    def __init__(self, launcher: LocalLauncher) -> None:
        self.launcher = launcher
        self.reported: dict[int, int] = {}  # process index -> the pid whose exit was reported

    def local_ranks(self, index: int) -> range:
        """The local ranks whose exit process ``index``'s exit is: its own, or every slot's
        for a per-node launcher (its workers live and die with it)."""
        slots = self.launcher.spec.per_node_slots
        return range(slots) if slots else range(index, index + 1)

    @classmethod
    def start(
        cls,
        spec: WorkerSpec,
        unit: Optional[ContainmentUnit],
        *,
        env_for_rank: Callable[[int], dict[str, str]],
        spawn_options: Callable[[], dict],
        output: Callable[[int], object],
    ) -> "Launch":
        """Start the workers of ``spec`` inside ``unit``; raises one of CANNOT_START when
        they cannot all start, with those that did stopped."""
        launcher = LocalLauncher(
            spec,
            env_for_rank=env_for_rank,
            spawn_options=spawn_options,
            spawn_in=None if unit is None else unit.spawning,
            on_start=None if unit is None else unit.started,
            output=output,
        )
        try:
            launcher.start()
        except CANNOT_START:
            launcher.stop(0)
            raise
        return cls(launcher)

    async def stop(self, grace_s: float, report: ReportStopped) -> None:
        """Stop every worker (SIGTERM, then SIGKILL after ``grace_s``), then report the exits
        this stop ended and nobody reported yet: never failures, the agent stopped them."""
        await asyncio.to_thread(self.launcher.stop, grace_s)
        for local_rank, process in enumerate(self.processes):
            if self.reported.get(local_rank) != process.pid and process.returncode is not None:
                self.reported[local_rank] = process.pid
                for rank in self.local_ranks(local_rank):
                    await report(rank, process.returncode)

    @property
    def processes(self):
        return self.launcher.processes

    @property
    def first_rank(self) -> Optional[int]:
        return self.launcher.spec.first_rank

    def running(self) -> int:
        return sum(p.poll() is None for p in self.processes)

    def codes(self) -> tuple[Optional[int], ...]:
        """Each worker's exit code as reported (None: not reported yet)."""
        return tuple(p.returncode if self.reported.get(i) == p.pid else None for i, p in enumerate(self.processes))

    def is_new(self, exited: WorkerExited) -> bool:
        """An exit of this launch's worker not yet reported (a stopped launch's exits are
        reported by whoever stopped it)."""
        processes = self.processes
        if not 0 <= exited.local_rank < len(processes) or processes[exited.local_rank].pid != exited.pid:
            return False
        return self.reported.get(exited.local_rank) != exited.pid

    def watch(self, post: Callable[[Signal], None]) -> None:
        loop = asyncio.get_running_loop()
        for local_rank, process in enumerate(self.processes):
            threading.Thread(
                target=_wait, args=(loop, post, local_rank, process), name=f"worker-{local_rank}", daemon=True
            ).start()


def _wait(loop: asyncio.AbstractEventLoop, post, local_rank: int, process) -> None:
    code = process.wait()
    try:
        loop.call_soon_threadsafe(post, WorkerExited(local_rank, code, (), pid=process.pid))
    except RuntimeError:  # the loop is closed: the agent is gone
        pass


# ---- the workers' environment ------------------------------------------------------------------


def master_env(joined: nodes_pb2.JoinResponse) -> dict[str, str]:
    """MASTER_ADDR / MASTER_PORT from the coordinator's assignment, NODE_RANK and
    WORLD_SIZE as Lightning reads them; a variable the operator set is left alone."""
    assignment = joined.assignment
    wanted = {"NODE_RANK": str(joined.node_rank), "WORLD_SIZE": str(assignment.world_size)}
    if assignment.master_addr:
        wanted.update(zip(MASTER_ENVS, (assignment.master_addr, str(assignment.master_port))))
    return {k: v for k, v in wanted.items() if k not in os.environ}


def per_node_env(joined: nodes_pb2.JoinResponse) -> dict[str, str]:
    """What a per-node launcher reads (torchrun's, ft_launcher's, dlrover-run's names): its
    node's place in meshgate's topology order, the job's nodes and this node's slots. The
    master is master_env's."""
    assignment = joined.assignment
    node_rank = str(joined.node_rank)
    return {
        "NODE_RANK": node_rank,
        "GROUP_RANK": node_rank,
        "NNODES": str(assignment.world_size // assignment.nprocs),
        "NPROC_PER_NODE": str(assignment.nprocs),
    }


def worker_env(config: AgentConfig, route: Optional[Route]) -> dict[str, str]:
    """Network and transport settings for the workers, and the vouch socket for their
    children. A variable the operator set in the agent's environment is left alone."""
    env = {} if route is None else route.worker_env(already_set=os.environ)
    if config.vouch_socket is not None:
        env[AGENT_SOCKET_ENV] = str(config.vouch_socket)
    if config.job_paths:  # where training writes: checkpoints, datasets, caches
        env[JOB_PATHS_ENV] = ":".join(map(str, config.job_paths))
    # CUDA numbers GPUs fastest first unless told otherwise; in PCI bus order cuda:i is NVML's
    # GPU i, the one local rank i's attestation names (agent/inventory.py, launchers/mesh.py).
    env.setdefault("CUDA_DEVICE_ORDER", os.environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID"))
    tls = config.tls
    if tls is None:
        return {**env, "MESHGATE_INSECURE": "1"}
    # Never let an inherited MESHGATE_INSECURE downgrade the workers of a TLS agent.
    env["MESHGATE_INSECURE"] = "0"
    env["MESHGATE_TLS_CA"] = str(tls.ca_file)
    if tls.server_name:
        env["MESHGATE_TLS_SERVER_NAME"] = tls.server_name
    # Fan-in workers dial this agent's socket: they need no key, and the job user could
    # not read the agent's worker key anyway (its resolve would fail on the file).
    if config.worker_cert_file and config.worker_key_file and not config.fan_in:
        env["MESHGATE_TLS_CERT"] = str(config.worker_cert_file)
        env["MESHGATE_TLS_KEY"] = str(config.worker_key_file)
    return env


def plan_env(privileged: Launcher, run_dir: JobRunDir, assignment: nodes_pb2.LaunchAssignment) -> dict[str, str]:
    """The job's plan in a file its workers read (meshgate.current_plan()): in the job's
    directory, which the agent writes and the job only reads (agent/launcher.py)."""
    if not assignment.HasField("plan"):
        return {}  # a coordinator from before the plan travelled with the assignment
    try:
        path = privileged.write_plan(run_dir, ParallelPlan.from_proto(assignment.plan).to_toml())
    except (OSError, LauncherError) as exc:  # the workers' current_plan() then says the variable is unset
        log.error("cannot write the job's plan for its workers to %s: %s", run_dir.plan, exc)
        return {}
    return {PLAN_FILE_ENV: str(path)}
