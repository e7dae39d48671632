"""Spawn N local worker processes with the env an attested worker needs (torchrun-like).

Each child gets ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and the ``MESHGATE_*`` settings that
``meshgate.register()`` reads; the rank itself comes from the coordinator, never from here.
If one worker fails, the others are stopped (as torchrun does), so a broken world never
hangs in a collective.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import BinaryIO, Callable, ContextManager, Mapping, Optional, Sequence

from meshgate import grpc_fork

# TCPStore reverse-resolves each client; a dropped DNS answer stalls 5 s. Fail fast instead.
DEFAULT_WORKER_ENV = {"RES_OPTIONS": "timeout:1 attempts:1", "OMP_NUM_THREADS": "1"}


@dataclass(frozen=True)
class WorkerSpec:
    """What to run on this node and the meshgate settings every worker inherits."""

    command: Sequence[str]
    nprocs: int
    coordinator: str
    job_id: str
    node_id: str
    trust_bundle: str
    env: Mapping[str, str] = field(default_factory=dict)
    first_rank: Optional[int] = None  # the assigned rank block, when known
    # 0: each process is one worker (LOCAL_RANK). N: one process for the node, a launcher
    # that starts the node's N workers itself and gives them their LOCAL_RANK.
    per_node_slots: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.nprocs, bool) or not isinstance(self.nprocs, int) or self.nprocs < 1:
            raise ValueError(f"nprocs must be a positive integer, got {self.nprocs!r}")
        if not self.command:
            raise ValueError("command must not be empty")

    def env_for(self, local_rank: int) -> dict[str, str]:
        env = grpc_fork.worker_environ()
        env.update(DEFAULT_WORKER_ENV)
        env.update(
            {
                "MESHGATE_COORDINATOR": self.coordinator,
                "MESHGATE_JOB": self.job_id,
                "MESHGATE_NODE_ID": self.node_id,
                "MESHGATE_TRUST_BUNDLE": self.trust_bundle,
            }
        )
        if not self.per_node_slots:
            env.update({"LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(self.nprocs)})
        workers = self.per_node_slots or self.nprocs
        if self.first_rank is not None:
            env["MESHGATE_RANK_BLOCK"] = f"{self.first_rank}-{self.first_rank + workers - 1}"
        env.update(self.env)
        return env


@dataclass
class WorkerExit:
    local_rank: int
    returncode: int
    pid: int


class LocalLauncher:
    """Start, watch and stop one node's workers."""

    def __init__(
        self,
        spec: WorkerSpec,
        cwd: Optional[str] = None,
        env_for_rank: Optional[Callable[[int], Mapping[str, str]]] = None,
        spawn_options: Optional[Callable[[], dict]] = None,
        spawn_in: Optional[Callable[[], ContextManager]] = None,
        on_start: Optional[Callable[[int], None]] = None,
        output: Optional[Callable[[int], Optional[BinaryIO]]] = None,
    ) -> None:
        self.spec = spec
        self.cwd = cwd
        # The agent's containment and job user (agent/containment.py, agent/job_user.py):
        # extra Popen options per start, the context each start runs in, and each started pid.
        self.spawn_options = spawn_options
        self.spawn_in = spawn_in or contextlib.nullcontext
        self.on_start = on_start
        # Where worker local_rank's stdout and stderr go (the agent's pipe, agent/worker_logs.py):
        # the worker gets the write end; the launcher closes its own copy once the worker started.
        self.output = output
        # Per-process additions minted at each start (the agent's vouch for that worker).
        self.env_for_rank = env_for_rank
        self.processes: list[subprocess.Popen] = []

    def start(self, stdout=None, stderr=None) -> list[subprocess.Popen]:
        for local_rank in range(self.spec.nprocs):
            self.processes.append(self.start_one(local_rank, stdout=stdout, stderr=stderr))
        return self.processes

    def start_one(self, local_rank: int, stdout=None, stderr=None) -> subprocess.Popen:
        env = self.spec.env_for(local_rank)
        if self.env_for_rank is not None:
            env.update(self.env_for_rank(local_rank))
        options = {"cwd": self.cwd, "start_new_session": True}  # a Ctrl-C to the launcher is ours to forward
        if self.spawn_options is not None:
            options.update(self.spawn_options())
        sink = None if self.output is None else self.output(local_rank)
        if sink is not None:
            stdout, stderr = sink, subprocess.STDOUT
        try:
            with self.spawn_in():
                process = subprocess.Popen(list(self.spec.command), env=env, stdout=stdout, stderr=stderr, **options)
        finally:
            if sink is not None:
                sink.close()
        if self.on_start is not None:
            self.on_start(process.pid)
        return process

    def wait(self, timeout: Optional[float] = None, poll_s: float = 0.05) -> list[WorkerExit]:
        """Wait for all workers; on the first failure stop the rest. Returns every exit."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in self.processes]
            if all(c is not None for c in codes):
                break
            if any(c not in (None, 0) for c in codes):
                self.stop()
                break
            if deadline is not None and time.monotonic() > deadline:
                self.stop()
                break
            time.sleep(poll_s)
        return [WorkerExit(i, p.returncode, p.pid) for i, p in enumerate(self.processes)]

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``."""
        for p in self.processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.processes:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def python_command(module: str, *args: str) -> list[str]:
    """``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]
