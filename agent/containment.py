"""One containment unit per job run: every process a job's workers start, children and
daemons included, lives in it, and it is killed whole (issue #20).

The seam is small: ``Containment.create(job_id, generation)`` makes a unit; a unit puts
each worker in it before the worker's command runs (``spawning``: the context to call
``subprocess.Popen`` in, and ``spawn_options``: the Popen options it needs), says whether
it still holds a process (``is_empty``), whether a
pid is one of its processes (``holds``, for the vouch socket), and kills every process in
it and waits until none is left (``kill_and_wait``).

Two implementations:

* ``CgroupContainment`` (the one meant): a cgroup v2 directory per unit, under the
  agent's subtree (``[agent] cgroup_dir``, or ``meshgate/<node_id>-<state dir digest>`` under the agent's
  own cgroup: what systemd's ``Delegate=yes`` hands the service). Each worker is born in
  its unit: the agent steps into the unit, starts the worker, and steps back, in one
  synchronous section (a child starts in its parent's cgroup). Not a preexec_fn in the
  child: Python's at-fork callbacks there run gRPC's, which abort a forked child of the
  gRPC agent now and then. ``cgroup.kill``
  (kernel >= 5.14) kills the unit; ``cgroup.events`` says when it is empty. A restarted
  agent finds the units of its earlier run in its subtree and kills them before it joins.
* ``ProcessGroupContainment``: the fallback where no writable cgroup v2 can be had. The
  workers of a unit share one process group and the agent is a child subreaper, so a
  daemon that leaves the group is reparented to the agent and still found. Weaker: a
  process that leaves the group and is not an orphan of the agent escapes, and a
  restarted agent cannot find its earlier run's processes. ``open_containment`` says so
  at start, loudly.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import signal
import time
from pathlib import Path
from typing import ContextManager, Optional, Protocol
from urllib.parse import quote

from meshgate.agent.launcher import Launcher

log = logging.getLogger("meshgate.agent")

PR_SET_CHILD_SUBREAPER = 36
POLL_S = 0.02


class ContainmentError(RuntimeError):
    pass


class ContainmentUnit(Protocol):
    job_id: str
    generation: int
    where: str  # the cgroup path or the process group, for logs

    def spawn_options(self) -> dict: ...

    def spawning(self) -> ContextManager: ...

    def started(self, pid: int) -> None: ...

    def pids(self) -> list[int]: ...

    def is_empty(self) -> bool: ...

    def holds(self, pid: int) -> bool: ...

    def kill_and_wait(self, timeout_s: float) -> list[int]: ...


class Containment(Protocol):
    kind: str

    def create(self, job_id: str, generation: int) -> ContainmentUnit: ...

    def kill_earlier_units(self, timeout_s: float) -> dict[str, list[int]]: ...

    def describe_pid(self, pid: int) -> str: ...

    def release(self) -> None: ...


def unit_name(job_id: str, generation: int) -> str:
    """A directory name for a job run whatever the job id holds (never a path)."""
    return f"job-{quote(job_id, safe='')[:180]}-g{generation}"


def _wait(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


# ---- cgroup v2 ------------------------------------------------------------------------------


def cgroup2_mount(mounts: str = "/proc/self/mounts") -> Optional[Path]:
    with open(mounts, encoding="utf-8") as handle:
        for line in handle:
            fields = line.split()
            if len(fields) > 2 and fields[2] == "cgroup2":
                return Path(fields[1].replace("\\040", " "))
    return None


def own_cgroup(pid: str = "self") -> Optional[str]:
    """This process's cgroup v2 path ("0::/path" in /proc/PID/cgroup), or None."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("0::"):
                    return line[3:].strip()
    except OSError:
        return None
    return None


def _move(pid: int, cgroup: Path) -> None:
    with open(cgroup / "cgroup.procs", "w", encoding="ascii") as handle:
        handle.write(str(pid))


class CgroupUnit:
    def __init__(self, path: Path, job_id: str, generation: int, home: Optional[Path] = None) -> None:
        self.path, self.job_id, self.generation = path, job_id, generation
        self.home = home  # the agent's own cgroup, where it steps back to after a spawn
        self.where = str(path)

    def open(self) -> "CgroupUnit":
        self.path.mkdir()
        return self

    def spawn_options(self) -> dict:
        return {"start_new_session": True}

    @contextlib.contextmanager
    def spawning(self):
        """The agent in the unit for one Popen: the child is born inside and never runs
        a single instruction outside it."""
        assert self.home is not None, "a unit found on disk is only ever killed"
        _move(os.getpid(), self.path)
        try:
            yield
        finally:
            _move(os.getpid(), self.home)

    def started(self, pid: int) -> None:
        pass

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def is_empty(self) -> bool:
        try:
            events = (self.path / "cgroup.events").read_text()
        except FileNotFoundError:
            return True
        return "populated 0" in events

    def holds(self, pid: int) -> bool:
        return not self.is_empty() and pid in self.pids()

    def kill_and_wait(self, timeout_s: float) -> list[int]:
        """Kill every process in the unit, wait until it is empty, remove it. Returns
        the pids it held; raises ContainmentError if it is not empty in time."""
        if os.getpid() in self.pids() and self.home is not None:  # never kill the agent itself
            _move(os.getpid(), self.home)
        killed = self.pids()
        if self.path.exists():
            (self.path / "cgroup.kill").write_text("1")
            if not _wait(self.is_empty, timeout_s):
                raise ContainmentError(f"{self.path} still holds {self.pids()} {timeout_s:g}s after cgroup.kill")
            self.path.rmdir()
        return killed


class CgroupContainment:
    kind = "cgroup"

    def __init__(self, subtree: Path, mount: Path, home: Path) -> None:
        self.subtree, self.mount, self.home = subtree, mount, home

    @classmethod
    def open(cls, node_id: str, configured: Optional[Path], state_dir: Path) -> "CgroupContainment":
        mount = cgroup2_mount()
        if mount is None:
            raise ContainmentError("no cgroup2 file system is mounted (/proc/self/mounts)")
        own = own_cgroup()
        if own is None:
            raise ContainmentError("this process is in no cgroup v2 (/proc/self/cgroup has no 0:: line)")
        home = mount / own.lstrip("/")
        # Named for this agent (node id and state directory), so that a restart finds its
        # earlier units and a second agent on the host (another state dir) never kills them.
        subtree = configured if configured is not None else home / "meshgate" / agent_subtree_name(node_id, state_dir)
        try:
            subtree.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ContainmentError(f"cannot create the agent's cgroup subtree {subtree}: {exc.strerror}") from None
        if not (subtree / "cgroup.procs").exists() or not os.access(subtree, os.W_OK):
            raise ContainmentError(f"{subtree} is not a writable cgroup v2 directory")
        if not (subtree / "cgroup.kill").exists():
            raise ContainmentError(f"{subtree} has no cgroup.kill (the kernel is older than 5.14)")
        if not os.access(home / "cgroup.procs", os.W_OK):
            raise ContainmentError(f"the agent's own cgroup {home} is not writable: it cannot start workers in a unit")
        return cls(subtree, mount, home)

    def create(self, job_id: str, generation: int) -> CgroupUnit:
        path = self.subtree / unit_name(job_id, generation)
        if path.exists():  # a unit of this run left behind: never reuse one with processes in it
            CgroupUnit(path, job_id, generation).kill_and_wait(30)
        return CgroupUnit(path, job_id, generation, self.home).open()

    def kill_earlier_units(self, timeout_s: float) -> dict[str, list[int]]:
        """Every unit in this agent's subtree is an earlier run's: kill each, wait, remove."""
        found = {}
        for path in sorted(p for p in self.subtree.iterdir() if p.is_dir()):
            found[path.name] = CgroupUnit(path, "", -1).kill_and_wait(timeout_s)
        return found

    def describe_pid(self, pid: int) -> str:
        return f"cgroup {own_cgroup(str(pid)) or '(gone)'}"

    def release(self) -> None:
        """At a clean stop: the subtree goes if no unit is left in it (a lingering one stays
        for the next start to kill)."""
        try:
            self.subtree.rmdir()
        except OSError:
            pass


# ---- fallback: process group + child subreaper ----------------------------------------------


def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, pgid) of every process, from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()
        if fields[0] != b"Z":
            table[int(entry)] = (int(fields[1]), int(fields[2]))
    return table


class ProcessGroupUnit:
    def __init__(self, job_id: str, generation: int) -> None:
        self.job_id, self.generation = job_id, generation
        self.pgid: Optional[int] = None
        self.known: set[int] = set()
        self.where = "process group (not started)"

    def spawn_options(self) -> dict:
        return {"process_group": 0 if self.pgid is None else self.pgid, "start_new_session": False}

    def spawning(self) -> ContextManager:
        return contextlib.nullcontext()

    def started(self, pid: int) -> None:
        if self.pgid is None:
            self.pgid, self.where = pid, f"process group {pid}"
        self.known.add(pid)

    def pids(self) -> list[int]:
        """The group's processes, their descendants, and orphans reparented to the agent."""
        table = _proc_table()
        me = os.getpid()
        members = {
            p
            for p, (ppid, pgid) in table.items()
            if p != me and (pgid == self.pgid or p in self.known or ppid == me and pgid != os.getpgrp())
        }
        grew = True
        while grew:
            more = {p for p, (ppid, _) in table.items() if ppid in members} - members
            members |= more
            grew = bool(more)
        self.known = (self.known | members) & set(table)
        return sorted(members)

    def is_empty(self) -> bool:
        return not self.pids()

    def holds(self, pid: int) -> bool:
        return pid in self.pids()

    def kill_and_wait(self, timeout_s: float) -> list[int]:
        killed: set[int] = set()

        def gone() -> bool:
            for pid in self.pids():
                killed.add(pid)
                try:
                    Launcher.signal(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return not self.pids()

        if not _wait(gone, timeout_s):
            raise ContainmentError(f"{self.where} still holds {self.pids()} {timeout_s:g}s after SIGKILL")
        for pid in killed:  # reap our own dead children (workers, adopted orphans): no zombies
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        return sorted(killed)


class ProcessGroupContainment:
    kind = "process-group"

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise ContainmentError(f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}")

    def create(self, job_id: str, generation: int) -> ProcessGroupUnit:
        return ProcessGroupUnit(job_id, generation)

    def kill_earlier_units(self, timeout_s: float) -> dict[str, list[int]]:
        return {}  # not findable: said at start

    def describe_pid(self, pid: int) -> str:
        try:
            return f"process group {os.getpgid(pid)}"
        except ProcessLookupError:
            return "process group (gone)"

    def release(self) -> None:
        pass


def agent_subtree_name(node_id: str, state_dir: Path) -> str:
    """e.g. ``n0-3f2a9c1b``: the node id, and a digest of the agent's state directory."""
    digest = hashlib.sha256(str(Path(state_dir).resolve()).encode()).hexdigest()[:8]
    return f"{quote(node_id, safe='')}-{digest}"


def open_containment(node_id: str, configured: Optional[Path], state_dir: Path) -> Containment:
    """cgroup v2 where it can be had; else the fallback, announced in one loud line."""
    try:
        containment = CgroupContainment.open(node_id, configured, state_dir)
    except (ContainmentError, OSError) as exc:
        log.warning(
            "CONTAINMENT FALLBACK: no writable cgroup v2 (%s): a job's processes are held by a "
            "process group with this agent as their subreaper; a process that leaves its group "
            "and is not reparented to the agent escapes, and a restarted agent cannot find the "
            "processes of its earlier run. Run the agent with a delegated cgroup "
            "(systemd Delegate=yes) or set [agent] cgroup_dir",
            exc,
        )
        return ProcessGroupContainment()
    log.info("containment: one cgroup v2 per job run under %s", containment.subtree)
    return containment


__all__ = [
    "CgroupContainment",
    "Containment",
    "ContainmentError",
    "ContainmentUnit",
    "ProcessGroupContainment",
    "open_containment",
    "unit_name",
]
