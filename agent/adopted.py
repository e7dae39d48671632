"""Launchers the agent did not start (a hand-started torchrun), adopted when they first
reach its socket: the caller's pid from SO_PEERCRED, once the vouch socket's caller check
admitted it, held by a pidfd (never a bare pid: a pid reused after an exit is never
signalled), so that the launcher's death is seen at once and the job's end kills it and
its workers (whose pids are learnt the same way when they ask for their vouches).

Tracked, not moved: the shipped agent is not root, and cgroup v2 lets a process be moved
only by one that may write the cgroup.procs of the common ancestor of both cgroups (the
launcher's is the user's session, outside the agent's delegated subtree), so a hand-started
launcher stays in its own cgroup. What the agent has is CAP_KILL (deploy/systemd), used by
the privileged module (agent/launcher.py, ``signal_pidfd``) to kill what it tracks here.
A worker that never reaches the socket is not known here (torchrun's workers all ask for
a vouch before their first collective, meshgate.torchrun)."""

from __future__ import annotations

import asyncio
import logging
import os
import select
import signal
from typing import Awaitable, Callable, Optional

from meshgate.agent.launcher import Launcher
from meshgate.agent.vouch_socket import descends_from

log = logging.getLogger("meshgate.agent")

# How long a hand-started launcher may take to exit on its own once its job is over, before
# it is killed: after a SUCCEEDED job torchrun returns 0 within about a second of its last
# worker's exit; after a cancel or a failure its workers are killed at once and torchrun
# learns from its handler that the job is over, says so and exits non-zero.
SUCCEEDED_EXIT_GRACE_S = 15.0
ENDED_EXIT_GRACE_S = 5.0


def exited(pidfd: int) -> bool:
    """A pidfd is readable once its process has exited."""
    return bool(select.select([pidfd], [], [], 0)[0])


class Adopted:
    def __init__(self, privileged: Launcher) -> None:
        self.privileged = privileged
        self.job_id = ""
        self.launchers: dict[int, int] = {}  # pid -> pidfd: callers not descended from another adopted launcher
        self.workers: dict[int, int] = {}  # pid -> pidfd: callers descended from an adopted launcher
        self.reported: dict[int, set[int]] = {}  # generation -> local ranks whose exits a launcher reported
        # Called with a launcher's pid once it is gone (the agent reports its node's exits).
        self.on_launcher_gone: Optional[Callable[[int], Awaitable[None]]] = None

    def adopt(self, job_id: str, pid: int, launcher: bool) -> None:
        """A caller of the socket, admitted for ``job_id`` (which has no command): adopted
        as a launcher when it says it is one (torchrun's handler), as a worker when it
        descends from an adopted launcher; any other caller (a Ray worker, whose exit is
        its own business) is not adopted."""
        if job_id != self.job_id:
            self.forget()
            self.job_id = job_id
        if pid in self.launchers or pid in self.workers:
            return
        worker = bool(self.launchers) and descends_from(pid, self.launchers)
        if not (launcher or worker):
            return
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:  # gone between its call and now: nothing to track
            log.info("job %s: caller pid %d not adopted: %s", job_id, pid, exc)
            return
        if worker:
            self.workers[pid] = pidfd
            return
        self.launchers[pid] = pidfd
        asyncio.get_running_loop().add_reader(pidfd, self._launcher_exited, pid)
        log.info("job %s: adopted the launcher pid %d (hand-started): its death ends its node's part", job_id, pid)

    def note_reported(self, generation: int, local_ranks) -> None:
        self.reported.setdefault(generation, set()).update(local_ranks)

    def unreported(self, generation: int, slots: int) -> list[int]:
        return [rank for rank in range(slots) if rank not in self.reported.get(generation, ())]

    def alive(self) -> bool:
        return any(not exited(fd) for fd in (*self.launchers.values(), *self.workers.values()))

    def _launcher_exited(self, pid: int) -> None:
        pidfd = self.launchers.pop(pid)
        asyncio.get_running_loop().remove_reader(pidfd)
        os.close(pidfd)
        self.kill_workers(f"their launcher pid {pid} is gone")
        if self.on_launcher_gone is not None:
            asyncio.ensure_future(self.on_launcher_gone(pid))

    def kill_workers(self, why: str) -> list[int]:
        """SIGKILL every adopted worker still running (by its pidfd); returns their pids."""
        killed = []
        for pid, pidfd in self.workers.items():
            if not exited(pidfd):
                self.privileged.signal_pidfd(pidfd, signal.SIGKILL)
                killed.append(pid)
            os.close(pidfd)
        self.workers = {}
        if killed:
            log.info("job %s: killed adopted workers %s: %s", self.job_id, killed, why)
        return killed

    async def job_over(self, ended_as: str, why: str) -> list[int]:
        """The job is over here; ``ended_as``: its end state as the coordinator answered
        ("" where not told). Its launchers are left to exit on their own for a grace, then
        ``kill_all`` ends a survivor: killing at once turned every successful hand-started
        run's exit into -9, and a cancelled one's into a kill before torchrun could say
        why it stops. Unless it SUCCEEDED, the workers are killed first: the work stops now."""
        succeeded = ended_as == "SUCCEEDED"
        if not succeeded:
            self.kill_workers(why)
        await self.let_exit(SUCCEEDED_EXIT_GRACE_S if succeeded else ENDED_EXIT_GRACE_S)
        return self.kill_all(why)

    async def let_exit(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for every adopted launcher to exit; an exit is seen by its
        pidfd's reader (``_launcher_exited``), which drops it here."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while any(not exited(fd) for fd in self.launchers.values()) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0)  # the readers of launchers that exited just now run first

    def kill_all(self, why: str) -> list[int]:
        """The job is over here (its end, a cancel, the agent's stop): every adopted launcher
        and worker is killed."""
        killed = []
        for pid, pidfd in self.launchers.items():
            if not exited(pidfd):
                self.privileged.signal_pidfd(pidfd, signal.SIGKILL)
                killed.append(pid)
        killed += self.kill_workers(why)
        if killed:
            log.info("job %s: killed adopted processes %s: %s", self.job_id, killed, why)
        self.forget()
        return killed

    def forget(self) -> None:
        for pidfd in self.launchers.values():
            asyncio.get_running_loop().remove_reader(pidfd)
            os.close(pidfd)
        for pidfd in self.workers.values():
            os.close(pidfd)
        self.launchers, self.workers, self.reported, self.job_id = {}, {}, {}, ""


__all__ = ["Adopted"]
