"""The agent's exit journal: every worker exit is kept on disk until the coordinator
acknowledges it (its ReportExit answer is the acknowledgement).

An exit is written (0600, fsynced, renamed into place, the directory fsynced) before it
is first sent, so neither a coordinator that is down or restarting, nor a channel in its
reconnect backoff, nor the agent's own crash loses it: the agent resends what is pending
on every heartbeat cycle and when it starts again. One file per exit, named by the hash
of (job, generation, node, local rank): the coordinator is idempotent per that key, so a
resend changes nothing the second time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("meshgate.agent")

# Test-only: while the file this names exists, the agent journals exits but sends none
# (as if the coordinator could not be reached), so a test can kill the agent with its
# workers' exits journalled and unsent. Never set in production.
HOLD_REPORTS_ENV = "MESHGATE_TEST_HOLD_EXIT_REPORTS"


def reports_held() -> bool:
    path = os.environ.get(HOLD_REPORTS_ENV)
    return bool(path) and os.path.exists(path)


MAX_DETAIL = 300


@dataclass(frozen=True)
class PendingExit:
    """One worker exit as the agent reports it (never the node credential)."""

    job_id: str
    node_id: str
    generation: int
    local_rank: int
    exit_code: int
    stopped_by_agent: bool = False
    start_failed: bool = False
    detail: str = ""
    log_tail: str = ""  # a failure's last lines of output (agent/worker_logs.py EXIT_TAIL_*)

    @property
    def name(self) -> str:
        key = f"{self.job_id}\0{self.generation}\0{self.node_id}\0{self.local_rank}"
        return hashlib.sha256(key.encode()).hexdigest()[:32] + ".exit"


class ExitJournal:
    """The exits of this node's workers not yet acknowledged, one file each."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def record(self, pending: PendingExit) -> None:
        """Durable before it returns: written under a temporary name, fsynced, renamed."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.directory / pending.name
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, json.dumps(asdict(pending)).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self._sync_directory()

    def pending(self) -> list[PendingExit]:
        """Every exit not yet acknowledged, oldest first. A file that cannot be read (a
        torn write of a crashed agent is never renamed into place) is set aside."""
        if not self.directory.is_dir():
            return []
        out = []
        for path in sorted(self.directory.glob("*.exit"), key=lambda p: p.stat().st_mtime_ns):
            try:
                out.append(PendingExit(**json.loads(path.read_text())))
            except (OSError, ValueError, TypeError) as exc:
                log.error("exit journal: %s is unreadable (%s); setting it aside", path.name, exc)
                path.rename(path.with_suffix(".unreadable"))
        return out

    def holds(self, pending: PendingExit) -> bool:
        return (self.directory / pending.name).exists()

    def acknowledge(self, pending: PendingExit) -> None:
        (self.directory / pending.name).unlink(missing_ok=True)

    def _sync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


__all__ = ["HOLD_REPORTS_ENV", "ExitJournal", "PendingExit", "reports_held"]
