"""Creating state atomically: a file is either absent or whole, never half-made.

Every file of a new state (a signing key and its ``active`` pointer, a log, a
high-water mark) is written under a temporary name, fsynced, renamed into place and
its directory fsynced. A crash at any step leaves either the old state (nothing, for a
first start) or the new one; a leftover temporary is never read as state, and the next
creation removes it. What was never created whole was never acknowledged, so a start
after such a crash simply creates it again.

Test-only seam: ``MESHGATE_TEST_CRASH_AT_STEP=N`` makes the process ``os._exit(137)``
right after the Nth file-system step of creating state (each step is counted by
``step()``), so a crash test can stop a first start at every step in turn.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Callable

log = logging.getLogger("meshgate.coordinator")

CRASH_AT_STEP_ENV = "MESHGATE_TEST_CRASH_AT_STEP"
_steps_done = 0


def step(what: str) -> None:
    """One file-system step of creating state is done. Under the test hook, count it
    and die at the chosen one (as kill -9 would: no cleanup, no flush)."""
    global _steps_done
    target = os.environ.get(CRASH_AT_STEP_ENV)
    if not target:
        return
    _steps_done += 1
    if _steps_done == 1:
        log.warning(
            "TEST HOOK %s=%s: the process dies after that state-creation step; never in production",
            CRASH_AT_STEP_ENV,
            target,
        )
    if _steps_done == int(target):
        sys.stderr.write(f"TEST HOOK: crashing after state-creation step {_steps_done}: {what}\n")
        sys.stderr.flush()
        os._exit(137)


def temporary(path: Path) -> Path:
    """Where ``path`` is built before it is renamed into place."""
    return path.with_name(path.name + ".new")


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(built: Path, path: Path) -> None:
    """Rename a fully written and fsynced ``built`` into place, durably."""
    os.replace(built, path)
    step(f"renamed {built.name} to {path.name}")
    fsync_dir(path.parent)
    step(f"fsynced {path.parent}")


def create_file(path: Path, write: Callable[[Path], None]) -> None:
    """Create ``path`` whole or not at all: ``write(tmp)`` creates the temporary (it may
    be called again after a crash: a leftover is removed first), then fsync, rename,
    fsync the directory."""
    tmp = temporary(path)
    tmp.unlink(missing_ok=True)
    write(tmp)
    step(f"wrote {tmp.name}")
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    step(f"fsynced {tmp.name}")
    publish(tmp, path)


def write_new(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Create ``path`` holding ``data`` (mode ``mode``), whole or not at all."""

    def write(tmp: Path) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)

    create_file(path, write)
