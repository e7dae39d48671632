"""The unprivileged user a job's processes run as (``[agent] run_as``, issue #20).

Never root and never the agent's own uid: a job must not read the agent's node key,
node credential or TLS key, nor act as the agent. The agent switches to it only in the
worker's child process (agent/launcher.py, the agent's one privileged part).
"""

from __future__ import annotations

import os
import pwd
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


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

    def claim(self) -> socket.socket:
        """This agent's exclusive hold on the job user, for as long as it runs: a second
        agent on this host (this network namespace) that names the same user is refused.
        Its jobs would share a uid with this agent's, and could read each other's
        environment, ptrace and signal each other, and plant files where the other looks
        (SECURITY.md, "Jobs do not see each other"). An abstract socket: no file to
        leave behind or to redirect, released by the kernel when the agent dies."""
        held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        name = f"\0meshgate-job-user-{self.uid}"
        try:
            held.bind(name)
            held.listen(1)
        except OSError:
            held.close()
            raise JobUserError(
                f"[agent] run_as {self.name!r} (uid {self.uid}) is already the job user of {_holder(name)} on "
                "this host: two agents must never share a job user (their jobs could read and signal each "
                "other); give each agent a job user of its own"
            ) from None
        return held

    def env(self, workdir: Optional[Path] = None) -> dict[str, str]:
        home = str(workdir) if workdir is not None else self.workdir()
        private = {"TMPDIR": home} if workdir is not None else {}
        return {"HOME": home, "USER": self.name, "LOGNAME": self.name, **private}


def _holder(name: str) -> str:
    """Who holds an abstract socket's name (its listener's pid and uid), for the refusal."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1)
            probe.connect(name)
            pid, uid, _ = struct.unpack("3i", probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return f"pid {pid} (uid {uid}: another agent?)"
    except OSError:
        return "another process"
