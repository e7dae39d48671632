"""The unprivileged user a job's processes run as (``[agent] run_as``, issue #20).

Never root and never the agent's own uid: a job must not read the agent's node key,
node credential or TLS key, nor act as the agent. The agent switches to it only in the
worker's child process (subprocess's user/group/extra_groups), so it needs the right to
switch users: root, or CAP_SETUID + CAP_SETGID (see SECURITY.md, "Jobs").
"""

from __future__ import annotations

import ctypes
import os
import pwd
from dataclasses import dataclass
from pathlib import Path
from typing import Optional
from urllib.parse import quote

PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4


class JobUserError(ValueError):
    pass


@dataclass(frozen=True)
class JobUser:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    @classmethod
    def resolve(cls, name: str, agent_uid: int | None = None) -> "JobUser":
        """The user ``name`` as the system knows it; refused if it is root or the agent."""
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise JobUserError(f"[agent] run_as {name[:64]!r}: no such user on this node") from None
        agent_uid = os.geteuid() if agent_uid is None else agent_uid
        if entry.pw_uid == 0:
            raise JobUserError(f"[agent] run_as {name!r} is uid 0: jobs never run as root")
        if entry.pw_uid == agent_uid:
            raise JobUserError(
                f"[agent] run_as {name!r} is the agent's own uid {agent_uid}: a job would read the "
                "agent's node key and credential; name a user of its own"
            )
        groups = tuple(g for g in os.getgrouplist(name, entry.pw_gid) if g != entry.pw_gid)
        return cls(name, entry.pw_uid, entry.pw_gid, groups, entry.pw_dir)

    def workdir(self) -> str:
        """The job's working directory: the user's home when it owns one, else /tmp."""
        try:
            if os.stat(self.home).st_uid == self.uid:
                return self.home
        except OSError:
            pass
        return "/tmp"

    def popen_options(self, workdir: Optional[Path] = None) -> dict:
        """What subprocess.Popen needs to start a process as this user (in ``workdir``)."""
        cwd = str(workdir) if workdir is not None else self.workdir()
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups), "cwd": cwd}

    def make_job_dir(self, root: Path, job_id: str) -> Path:
        """One job's private directory on this node (0700, the job user's): its workers'
        cwd, HOME and TMPDIR. Every job runs as this one user, so whatever a job leaves
        where the next would look first (a module planted in its cwd, which ``python -c``
        puts ahead of the standard library, or in HOME's user site-packages) must die with
        it: the agent removes the directory when the job is over on this node."""
        root.mkdir(mode=0o711, exist_ok=True)
        path = root / quote(job_id, safe="")
        path.mkdir(mode=0o700, exist_ok=True)
        os.chown(path, self.uid, self.gid)
        os.chmod(path, 0o700)
        return path

    @staticmethod
    def keep_capabilities_from_workers() -> None:
        """A non-root agent switches users with ambient CAP_SETUID/CAP_SETGID (the unit's
        AmbientCapabilities=). Ambient capabilities survive setuid between non-root uids
        and execve: cleared here, the agent keeps them (permitted, effective) while no
        worker it starts ever inherits one."""
        if os.geteuid() != 0:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0:
                raise JobUserError(f"cannot clear the ambient capabilities: {os.strerror(ctypes.get_errno())}")

    def env(self, workdir: Optional[Path] = None) -> dict[str, str]:
        home = str(workdir) if workdir is not None else self.workdir()
        private = {"TMPDIR": home} if workdir is not None else {}
        return {"HOME": home, "USER": self.name, "LOGNAME": self.name, **private}
