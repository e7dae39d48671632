"""``meshgate.report(step, ...)``: a worker tells its node's agent how far its training got.

    for step, batch in enumerate(loader, start=1):
        loss = train_step(batch)
        meshgate.report(step, loss=float(loss), samples_per_s=rate)

The agent keeps the latest per local rank and carries it on its heartbeat; the coordinator
shows each job's step, its rate and its slowest node (`meshgate job show`, the timeline,
metrics; an alert fires when a running job's step stops advancing). A worker that measures
its own compute time per step (without the time it waits on others) passes
``step_time_s``: in a synchronous job that is what tells which node holds the others.

Cheap enough to call every step: at most one report a second leaves the process (one
report is a line on a local Unix socket; within the second the latest step is held and
sent when it is up, so a run that stops stepping still tells its last), and it never
raises: a training run must not fail because its progress could not be told. It returns
whether the report was sent or held to be sent (False: no agent, a bad value, or the
agent refused it; a warning says why, once). Needs the node's agent (MESHGATE_AGENT_SOCKET, set for the
workers an agent starts); elsewhere it does nothing."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Optional

from meshgate.agent_socket import ReportedProgress
from meshgate.client import AGENT_SOCKET_ENV
from meshgate.v1 import rendezvous_pb2

log = logging.getLogger("meshgate.progress")

MIN_INTERVAL_S = 1.0  # at most one report a second leaves the process
_TIMEOUT_S = 0.5


class _Reporter:
    """At most one report a second: a report within the second is held and sent when the
    second is up, by a daemon thread, unless a later one replaced it (the latest wins, so a
    run that stops stepping still tells its last step)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent_at = 0.0
        self.warned = False
        self.held: Optional[tuple[ReportedProgress, str]] = None
        self.flusher: Optional[threading.Thread] = None

    def report(self, progress: ReportedProgress, socket_path: Optional[str]) -> bool:
        if not socket_path:
            return False
        with self.lock:
            if time.monotonic() - self.sent_at < MIN_INTERVAL_S:
                self.held = (progress, socket_path)
                if self.flusher is None:
                    self.flusher = threading.Thread(target=self._flush, name="meshgate-report", daemon=True)
                    self.flusher.start()
                return True
            self.sent_at, self.held = time.monotonic(), None
        return self._send(progress, socket_path)

    def _flush(self) -> None:
        while True:
            with self.lock:
                wait = self.sent_at + MIN_INTERVAL_S - time.monotonic()
                held = self.held if wait <= 0 else None
                if held is not None:
                    self.sent_at, self.held = time.monotonic(), None
            if held is not None:
                self._send(*held)
            time.sleep(max(wait, MIN_INTERVAL_S / 4))

    def _send(self, progress: ReportedProgress, socket_path: str) -> bool:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(_TIMEOUT_S)
                sock.connect(socket_path)
                sock.sendall(json.dumps(progress.request()).encode() + b"\n")
                answer = json.loads(sock.makefile("rb").readline() or b"{}")
        except (OSError, ValueError) as exc:
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        if "error" in answer:
            if not self.warned:  # once: a training loop calls this every step
                log.warning("meshgate.report: the node agent did not take the progress: %s", answer["error"])
                self.warned = True
            return False
        return True


_REPORTER = _Reporter()


def report(
    step: int,
    *,
    loss: Optional[float] = None,
    samples_per_s: Optional[float] = None,
    step_time_s: Optional[float] = None,
    local_rank: Optional[int] = None,
) -> bool:
    """Tell this node's agent that this worker finished ``step`` (see the module's doc).
    ``local_rank``: default LOCAL_RANK from the environment (0 when unset)."""
    try:
        progress = ReportedProgress(
            local_rank=int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank,
            step=step,
            loss=loss,
            samples_per_s=samples_per_s,
            step_time_s=step_time_s,
        )
        ReportedProgress.parse(progress.request()["progress"], 1 << 16)  # the agent's own check, here first
    except (TypeError, ValueError) as exc:
        if not _REPORTER.warned:
            log.warning("meshgate.report: not reported: %s", exc)
            _REPORTER.warned = True
        return False
    return _REPORTER.report(progress, os.environ.get(AGENT_SOCKET_ENV))


def describe(progress: rendezvous_pb2.JobProgress) -> str:
    """One line, as `job show` and the timeline say it: "step 1200 (slowest node at 1180),
    2.4 steps/s, 512 samples/s, loss 2.31; straggler n2: step time 1.8x the median"."""
    parts = [
        f"step {progress.step}"
        + (f" (slowest node at {progress.slowest_step})" if progress.slowest_step < progress.step else "")
    ]
    if progress.steps_per_s:
        parts.append(f"{progress.steps_per_s:.3g} steps/s")
    if progress.samples_per_s:
        parts.append(f"{progress.samples_per_s:.4g} samples/s")
    if progress.HasField("loss"):
        parts.append(f"loss {progress.loss:.4g}")
    text = ", ".join(parts) + f" ({progress.nodes_reporting} node{'s' * (progress.nodes_reporting != 1)} reporting)"
    if progress.straggler:
        text += f"; straggler {progress.straggler}: step time {progress.straggler_ratio:.2g}x the median node's"
    return text


__all__ = ["MIN_INTERVAL_S", "describe", "report"]
