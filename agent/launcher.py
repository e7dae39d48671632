"""The privileged part of the agent: everything that needs a capability or touches a
path a job can write lives here, as slurmd leaves each job step to slurmstepd.

The agent runs as its own unprivileged user (the shipped unit's ``User=meshgate``) with
exactly CAP_SETUID and CAP_SETGID (to start workers as the job user), CAP_CHOWN (to hand
a job its work directory and its sockets) and CAP_KILL (to signal the job user's
processes). Nothing else in ``agent/`` needs one; SECURITY.md ("The agent's privilege")
argues the choice against a root agent.

A job run's directory, under the agent's state directory::

    jobs/                     the agent's, 0711: the job user may pass through, not list
      <job id, quoted>/       the agent's, 0711: the job can read what is here, never write
        plan.toml             0644, the job's plan (meshgate.current_plan())
        work/                 the job user's (0700, or 0710 with the agent's group so that
                              the agent may chdir into it to start a worker): cwd, HOME, TMPDIR

The rules that keep a planted link, FIFO or swapped directory from reaching anything
outside the job's own files:

* every file the agent writes (the plan) goes into a directory the job cannot write,
  opened relative to a directory fd with ``O_NOFOLLOW | O_EXCL`` and renamed in place;
* the work directory is created, moded and chowned through its own fd before the job
  ever runs (``fchmod`` before ``fchown``: a chmod after the chown would need CAP_FOWNER);
* the agent never opens, reads or removes anything inside ``work/``: its contents are
  removed by a process running as the job user (coreutils ``rm``, which never follows a
  link inside the tree), so no trick can make the removal reach further than the job
  user itself could; the agent then removes the empty directory and its own files
  through directory fds;
* what the job user left in the host's shared temporary directories (/tmp, /var/tmp,
  /dev/shm: shared memory segments, sockets, caches) goes the same way when the job is
  over, as systemd's RemoveIPC= does. Only sound because a job user serves one agent
  (agent/job_user.py refuses a second agent that names the same user).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional
from urllib.parse import quote

from meshgate.agent.job_user import JobUser

if TYPE_CHECKING:
    from meshgate.agent.containment import ContainmentUnit

log = logging.getLogger("meshgate.agent")

PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
PLAN_FILE = "plan.toml"
WORK_DIR = "work"
# The host's shared temporary directories: what a job user left in them goes with its job.
SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")
CLEANUP_TIMEOUT_S = 120.0
# The only environment of the cleanup processes (never the job's, never the agent's).
CLEANUP_ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C"}


class LauncherError(RuntimeError):
    pass


@dataclass(frozen=True)
class JobRunDir:
    """Where one job's files live on this node (see the module docstring)."""

    job_id: str
    root: Path  # the agent's: the job reads, never writes
    work: Optional[Path]  # the job user's; None when jobs run as the agent itself

    @property
    def plan(self) -> Path:
        return self.root / PLAN_FILE


def clear_ambient_capabilities() -> None:
    """A non-root agent holds its capabilities as ambient ones (the unit's
    AmbientCapabilities=), which survive setuid between non-root uids and execve: cleared
    here, the agent keeps them (permitted, effective) while no worker inherits one."""
    if os.geteuid() != 0:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0:
            raise LauncherError(f"cannot clear the ambient capabilities: {os.strerror(ctypes.get_errno())}")


def _open_dir(name: str, parent_fd: int, mode: int, owner: int) -> int:
    """A directory ``name`` in ``parent_fd`` (made with ``mode`` if missing), opened
    without following a link, and refused unless ``owner`` owns it."""
    try:
        os.mkdir(name, mode, dir_fd=parent_fd)
    except FileExistsError:
        pass
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:  # ELOOP (a link) or ENOTDIR (a file): never followed
        raise LauncherError(f"{name!r} is not a directory the agent can trust: {exc.strerror}") from None
    found = os.fstat(fd)
    if found.st_uid != owner:
        os.close(fd)
        raise LauncherError(f"{name!r} belongs to uid {found.st_uid}, not {owner}: refused")
    return fd


class Launcher:
    """The one holder of the agent's capabilities: makes, hands over and removes job
    directories, writes a job's plan, starts workers (and node rank 0's store host) as the
    job user, signals them."""

    def __init__(self, job_user: Optional[JobUser], state_dir: Path) -> None:
        self.job_user = job_user
        self.jobs_root = Path(state_dir) / "jobs"
        self.uid, self.gid = os.geteuid(), os.getegid()
        self.rm = shutil.which("rm", path=CLEANUP_ENV["PATH"]) or "/bin/rm"
        self.find = shutil.which("find", path=CLEANUP_ENV["PATH"]) or "/usr/bin/find"

    # ---- job directories ------------------------------------------------------------------

    def _root_fd(self) -> int:
        state_fd = os.open(self.jobs_root.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fd = _open_dir(self.jobs_root.name, state_fd, 0o711, self.uid)
            os.fchmod(fd, 0o711)  # the job user passes through to its own directory
            return fd
        finally:
            os.close(state_fd)

    def job_dir(self, job_id: str) -> JobRunDir:
        """The job's directory on this node, made on first use (idempotent for the next
        generation of the same job). Raises LauncherError or OSError: the job cannot start."""
        name = quote(job_id, safe="")[:200]
        root_fd = self._root_fd()
        try:
            run_fd = _open_dir(name, root_fd, 0o711, self.uid)
        finally:
            os.close(root_fd)
        try:
            os.fchmod(run_fd, 0o711)
            work = self._work_dir(run_fd) if self.job_user is not None else None
        finally:
            os.close(run_fd)
        root = self.jobs_root / name
        return JobRunDir(job_id, root, None if work is None else root / work)

    def _work_dir(self, run_fd: int) -> str:
        user = self.job_user
        assert user is not None
        try:
            os.mkdir(WORK_DIR, 0o700, dir_fd=run_fd)
            made = True
        except FileExistsError:
            made = False
        fd = os.open(WORK_DIR, DIR_FLAGS, dir_fd=run_fd)
        try:
            if made:
                # While the agent still owns it: the mode first (after the chown it would
                # take CAP_FOWNER), then the owner. A root agent needs no group to enter it.
                group = user.gid if self.uid == 0 else self.gid
                os.fchmod(fd, 0o700 if self.uid == 0 else 0o710)
                os.fchown(fd, user.uid, group)
            elif os.fstat(fd).st_uid != user.uid:
                raise LauncherError(f"{WORK_DIR!r} of this job is not the job user's: refused")
        finally:
            os.close(fd)
        return WORK_DIR

    def write_plan(self, run: JobRunDir, text: str) -> Path:
        """The plan in the job's directory, where the job can read it and never plant
        anything: a fresh name (O_EXCL, O_NOFOLLOW), renamed over the last one."""
        run_fd = os.open(run.root, DIR_FLAGS)
        partial = f".{PLAN_FILE}.{secrets.token_hex(6)}"
        try:
            fd = os.open(
                partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=run_fd
            )
            try:
                os.write(fd, text.encode())
                os.fchmod(fd, 0o644)  # every worker reads it, as the job user
            finally:
                os.close(fd)
            os.replace(partial, PLAN_FILE, src_dir_fd=run_fd, dst_dir_fd=run_fd)
        except OSError:
            try:
                os.unlink(partial, dir_fd=run_fd)
            except OSError:
                pass
            raise
        finally:
            os.close(run_fd)
        return run.plan

    def remove_job_dir(self, job_id: str) -> None:
        """Everything of the job's directory, once its containment unit is empty; what
        the job user left in the shared temporary directories too. Raises LauncherError
        naming what is left (the next start of the agent tries again)."""
        name = quote(job_id, safe="")[:200]
        try:
            root_fd = self._root_fd()
        except FileNotFoundError:
            return
        try:
            self._remove_run(name, root_fd)
        finally:
            os.close(root_fd)

    def _remove_run(self, name: str, root_fd: int) -> None:
        try:
            run_fd = os.open(name, DIR_FLAGS, dir_fd=root_fd)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise LauncherError(f"{self.jobs_root / name}: {exc.strerror}") from None
        try:
            if self.job_user is not None:
                self._clean_shared_tmp()
            entries = os.listdir(run_fd)
            if WORK_DIR in entries and self.job_user is not None:
                self._empty_as_job_user(self.jobs_root / name / WORK_DIR)
            elif WORK_DIR in entries:  # jobs ran as the agent itself: its own files (rmtree never follows a link)
                shutil.rmtree(self.jobs_root / name / WORK_DIR)
                entries.remove(WORK_DIR)
            for entry in entries:
                kind = os.stat(entry, dir_fd=run_fd, follow_symlinks=False).st_mode
                if stat.S_ISDIR(kind):
                    os.rmdir(entry, dir_fd=run_fd)  # work/, emptied by the job user: never recursive here
                else:
                    os.unlink(entry, dir_fd=run_fd)
        except OSError as exc:
            raise LauncherError(
                f"cannot remove {self.jobs_root / name}: {exc.strerror} ({exc.filename or ''})"
            ) from None
        finally:
            os.close(run_fd)
        os.rmdir(name, dir_fd=root_fd)  # last: its absence says everything of the job is gone

    def _as_job_user(self, argv: list[str], cwd: str) -> subprocess.CompletedProcess:
        user = self.job_user
        assert user is not None
        return subprocess.run(
            argv,
            cwd=cwd,
            env=CLEANUP_ENV,
            user=user.uid,
            group=user.gid,
            extra_groups=[],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=CLEANUP_TIMEOUT_S,
            start_new_session=True,
        )

    def _empty_as_job_user(self, work: Path) -> None:
        """``work/``'s contents, removed with the job user's own rights, from inside it (it
        may not remove ``work`` itself: the agent's directory holds it, and does that next)."""
        done = self._as_job_user(
            [
                self.find,
                ".",
                "-mindepth",
                "1",
                "-maxdepth",
                "1",
                "-exec",
                self.rm,
                "-rf",
                "--one-file-system",
                "--",
                "{}",
                "+",
            ],
            str(work),
        )
        if done.returncode != 0:
            log.warning("emptying %s as the job user: %s", work, done.stderr.strip()[-300:])

    def _clean_shared_tmp(self) -> None:
        user = self.job_user
        assert user is not None
        places = [p for p in SHARED_TMP if os.path.isdir(p)]
        argv = [self.find, *places, "-xdev", "-mindepth", "1", "-maxdepth", "1", "-user", str(user.uid)]
        done = self._as_job_user([*argv, "-exec", self.rm, "-rf", "--one-file-system", "--", "{}", "+"], "/")
        if done.returncode != 0:
            log.warning(
                "removing what job user %s left in %s: %s", user.name, ", ".join(places), done.stderr.strip()[-300:]
            )

    def remove_earlier_job_dirs(self) -> list[str]:
        """At start, once the earlier run's units are dead: every job directory it left."""
        try:
            root_fd = self._root_fd()
        except FileNotFoundError:
            return []
        try:
            names = sorted(os.listdir(root_fd))
            for name in names:
                self._remove_run(name, root_fd)
        finally:
            os.close(root_fd)
        return names

    # ---- processes ------------------------------------------------------------------------

    def popen_options(self, run: Optional[JobRunDir]) -> dict:
        """What subprocess.Popen needs to start a worker as the job user, in the job's work
        directory (the agent's own uid and working directory when it has no job user)."""
        if self.job_user is None:
            return {}
        user = self.job_user
        cwd = str(run.work) if run is not None and run.work is not None else user.workdir()
        return {"user": user.uid, "group": user.gid, "extra_groups": list(user.groups), "cwd": cwd}

    def start_store_host(self, listener_fd: int, unit: Optional["ContainmentUnit"], env: dict) -> subprocess.Popen:
        """Node rank 0's store host of a per-slot job's generation (meshgate/store_host.py,
        agent/store_activation.py): the agent's own interpreter and a fixed argv, as the job
        user, born inside the generation's containment unit (killed with its workers), in
        "/" (nothing a job can write), with the master's listening socket inherited as
        ``listener_fd`` and no other descriptor of the agent's. Its output comes back on a
        pipe (stdout, stderr merged)."""
        options = {} if unit is None else unit.spawn_options()
        if self.job_user is not None:
            user = self.job_user
            options.update(user=user.uid, group=user.gid, extra_groups=list(user.groups))
        with contextlib.nullcontext() if unit is None else unit.spawning():
            process = subprocess.Popen(
                [sys.executable, "-m", "meshgate.store_host", "--fd", str(listener_fd)],
                cwd="/",
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(listener_fd,),
                **options,
            )
        if unit is not None:
            unit.started(process.pid)
        return process

    def job_user_may_write(self, path: Path) -> Optional[str]:
        """None if the job user can create files in directory ``path`` (asked of the kernel,
        as that user: modes, groups and ACLs all count), else why not."""
        if self.job_user is None:
            return (
                None if os.access(path, os.W_OK | os.X_OK) and path.is_dir() else f"{path} is not a writable directory"
            )
        done = self._as_job_user(["/usr/bin/test", "-d", str(path), "-a", "-w", str(path), "-a", "-x", str(path)], "/")
        if done.returncode == 0:
            return None
        try:
            found = os.stat(path)
            what = f"owner uid {found.st_uid}, gid {found.st_gid}, mode {stat.S_IMODE(found.st_mode):o}"
        except OSError as exc:
            what = exc.strerror
        return f"{path} is not a directory job user {self.job_user.name} may write ({what})"

    def share_socket(self, path: Path) -> None:
        """A Unix socket the job's workers dial: group-owned by the job user's group (0660)."""
        if self.job_user is not None:
            os.chown(path, -1, self.job_user.gid, follow_symlinks=False)

    @staticmethod
    def signal_pidfd(pidfd: int, sig: int = signal.SIGKILL) -> None:
        """A signal to an adopted process (agent/adopted.py: a hand-started launcher or its
        worker, another uid: CAP_KILL), by its pidfd, so a reused pid is never hit."""
        try:
            signal.pidfd_send_signal(pidfd, sig)
        except ProcessLookupError:
            pass  # it exited meanwhile

    @staticmethod
    def signal(pid: int, sig: int = signal.SIGKILL) -> None:
        """A signal to a job's process (another uid: CAP_KILL)."""
        os.kill(pid, sig)


__all__ = ["JobRunDir", "Launcher", "LauncherError", "clear_ambient_capabilities"]
