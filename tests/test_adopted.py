"""agent/adopted.py with real processes (no agent): a launcher that says so is adopted and
its children as its workers, a stranger (a Ray worker) never; a launcher's death is seen
at once (pidfd) and kills its workers; the job's end kills every adopted process. The
whole path through shipped agents and a real torchrun: tests/test_torchrun.py
(test_a_hand_started_torchrun_killed_mid_job_...)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

from meshgate.agent.adopted import Adopted, exited
from meshgate.agent.launcher import Launcher

# A launcher that starts one worker and then waits for it, as torchrun does.
LAUNCHER = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']).wait()"


def spawn(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


async def children(pid: int) -> list[int]:
    for _ in range(200):
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as handle:
                found = [int(p) for p in handle.read().split()]
        except OSError:
            found = []
        if found:
            return found
        await asyncio.sleep(0.02)
    raise AssertionError(f"pid {pid} started no child")


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 :].split()[0] != b"Z"


def test_a_launchers_death_is_seen_at_once_and_kills_its_workers_a_stranger_is_never_adopted():
    async def scenario():
        adopted = Adopted(Launcher(None, "/nonexistent"))
        gone: list[int] = []

        async def on_gone(pid: int) -> None:
            gone.append(pid)

        adopted.on_launcher_gone = on_gone
        launcher, stranger = spawn(LAUNCHER), spawn("import time; time.sleep(600)")
        try:
            (worker,) = await children(launcher.pid)
            adopted.adopt("j", stranger.pid, launcher=False)  # a Ray worker: its exit is its own
            adopted.adopt("j", worker, launcher=False)  # not yet: its launcher is unknown
            assert (adopted.launchers, adopted.workers) == ({}, {}) and not adopted.alive()
            adopted.adopt("j", launcher.pid, launcher=True)
            adopted.adopt("j", worker, launcher=False)
            assert set(adopted.launchers) == {launcher.pid} and set(adopted.workers) == {worker}
            assert adopted.alive()
            launcher.send_signal(signal.SIGKILL)
            launcher.wait()
            for _ in range(200):
                await asyncio.sleep(0.01)
                if gone:
                    break
            assert gone == [launcher.pid]
            assert adopted.workers == {} and adopted.launchers == {}
            for _ in range(200):
                if not running(worker):
                    break
                await asyncio.sleep(0.01)
            assert not running(worker), "the dead launcher's worker lives on"
            assert stranger.poll() is None  # never adopted, never killed
            assert adopted.unreported(0, 2) == [0, 1]
            adopted.note_reported(0, [1])
            assert adopted.unreported(0, 2) == [0]
        finally:
            stranger.kill(), stranger.wait()
            launcher.kill(), launcher.wait()

        # The job's end: every adopted launcher and worker is killed; its death then reports nothing.
        gone.clear()
        launcher = spawn(LAUNCHER)
        (worker,) = await children(launcher.pid)
        adopted.adopt("k", launcher.pid, launcher=True)
        adopted.adopt("k", worker, launcher=False)
        assert sorted(adopted.kill_all("job k is over")) == sorted([launcher.pid, worker])
        launcher.wait()
        await asyncio.sleep(0.1)
        assert gone == [] and not running(worker) and adopted.job_id == ""

    asyncio.run(scenario())


def test_exited_reads_a_pidfd():
    import os

    process = spawn("pass")
    pidfd = os.pidfd_open(process.pid)
    process.wait()
    assert exited(pidfd)
    os.close(pidfd)
