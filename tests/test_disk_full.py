"""A full disk under a real coordinator process (issue #14).

The SQLite state lives on a small tmpfs made for the test and filled to the brim. Health
must go NOT_SERVING naming coordinator.store before any write has to fail, and every call
that would write is then refused UNAVAILABLE naming the full file system (issue #31); a
write decided before the disk filled (its commit held by the store's test hook) that then
fails stops the coordinator with a disk-full message; a start on the full disk says
the disk is full (the directory and its free space), not "unreadable SQLite database", and
does not suggest --reset-state; once space is freed the same state serves again.
Skipped, with the reason, where mounting a tmpfs is not permitted.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import _spawn, _wait_for_address, start_coordinator
from meshgate.coordinator.store import HOLD_COMMITS_ENV
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2, rendezvous_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@contextmanager
def small_filesystem(path: Path, size: str = "8m"):
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "meshgate-test", str(path)],
        capture_output=True,
        text=True,
        timeout=10,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {(mounted.stderr or mounted.stdout).strip()[:200]}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=10)


def fill(directory: Path) -> Path:
    """Write a file until the file system refuses even one more byte."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (1 << 16, 1 << 12, 1):
            while True:
                try:
                    os.write(fd, b"\0" * chunk)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
    finally:
        os.close(fd)
    stats = os.statvfs(directory)
    assert stats.f_bavail == 0, stats
    return filler


def health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return (
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
        )


def until(predicate, what: str, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)
    return value


def full_named(state, log: str) -> bool:
    """The log names a log directory under ``state`` (the cluster's, or the declared job's) as
    full, with its free space (below the 1 MiB a log needs: what is left depends on which of the
    two logs is opened first)."""
    return bool(
        re.search(
            rf"the file system of {re.escape(str(state))}/(cluster|jobs/full) is full "
            r"\((\d+) bytes free; meshgate needs at least 1 MiB",
            log,
        )
    )


def create_token(channel: grpc.Channel, node_id: str):
    return rendezvous_pb2_grpc.AdminStub(channel).CreateJoinToken.future(
        rendezvous_pb2.CreateJoinTokenRequest(job_id="full", node_id=node_id), timeout=30
    )


@pytest.mark.slow
def test_a_full_disk_is_not_serving_and_reported_as_full(tmp_path, monkeypatch):
    hold = tmp_path / "hold"  # while it exists, the coordinator's commits wait (a test hook)
    monkeypatch.setenv(HOLD_COMMITS_ENV, str(hold))
    with small_filesystem(tmp_path / "state") as state:
        coordinator = start_coordinator(
            tmp_path / "run", ParallelPlan(dp_shard=2), job_id="full", store={"kind": "sqlite", "dir": str(state)}
        )
        channel = grpc.insecure_channel(coordinator.address)
        try:
            assert health(coordinator.address, "coordinator.store") == SERVING
            assert health(coordinator.address, "") == SERVING
            # A write decided while there was space, whose commit waits until the disk is full.
            hold.touch()
            decided = create_token(channel, "n1")
            until(hold.with_name("hold.held").exists, "the commit held")
            filler = fill(state)

            # Before any write has to fail: the store says it cannot take one.
            until(lambda: health(coordinator.address, "coordinator.store") == NOT_SERVING, "store NOT_SERVING")
            assert health(coordinator.address, "") == NOT_SERVING
            log = until(lambda: "health: NOT_SERVING" in coordinator.log() and coordinator.log(), "the log line")
            assert "health: NOT_SERVING (failed: coordinator.store)" in log, log
            assert full_named(state, log), log

            # A write asked for now is refused before anything is decided; the coordinator stays.
            with pytest.raises(grpc.RpcError) as refused:
                create_token(channel, "n2").result()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
            assert full_named(state, refused.value.details()), refused.value.details()
            assert coordinator.process.poll() is None

            # The one decided before fails as a full disk, and stops the coordinator (its memory
            # is ahead of the log).
            hold.unlink()
            with pytest.raises(grpc.RpcError) as failed:
                decided.result()
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
            assert "is full" in failed.value.details(), failed.value.details()
            assert coordinator.process.wait(timeout=30) == 2
            assert "stopped after a store failure" in coordinator.log()

            # A start on the full disk: a full disk, named, with its free space; not "unreadable".
            before = coordinator.log_path.stat().st_size
            port_file = tmp_path / "run" / "coordinator.addr"
            port_file.unlink(missing_ok=True)
            coordinator.process = _spawn(coordinator.config_path, port_file, coordinator.log_path)
            assert coordinator.process.wait(timeout=30) == 2
            start_log = coordinator.log_path.read_text(errors="replace")[before:]
            assert full_named(state, start_log), start_log
            assert "unreadable" not in start_log and "--reset-state" not in start_log, start_log
            assert "Traceback" not in start_log, start_log

            # Space freed: the same state serves again.
            filler.unlink()
            coordinator.process = _spawn(coordinator.config_path, port_file, coordinator.log_path)
            coordinator.address = _wait_for_address(coordinator.process, port_file, coordinator.log_path, 30)
            until(lambda: health(coordinator.address, "coordinator.store") == SERVING, "store SERVING again")
        finally:
            channel.close()
            coordinator.stop()


def leave_free(directory: Path, free: int) -> Path:
    """Write a file until about ``free`` bytes are left (under the 1 MiB a log needs, so the
    store reports it cannot take writes, yet a write would still succeed)."""
    filler = directory / "filler"
    with open(filler, "wb") as handle:
        handle.write(b"\0" * max(os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize - free, 0))
    return filler


def submit(address: str, job_id: str):
    """SubmitJob (a job that waits for nodes: none joined); the reply, or the refusal."""
    spec = rendezvous_pb2.JobSpec(
        job_id=job_id, plan=ParallelPlan(dp_shard=2).to_proto(), nodes=1, mode=rendezvous_pb2.RANK_MODE_CLAIMED
    )  # external workers: no command
    with grpc.insecure_channel(address) as channel:
        try:
            return rendezvous_pb2_grpc.AdminStub(channel).SubmitJob(
                rendezvous_pb2.SubmitJobRequest(spec=spec, wait_for_nodes=True), timeout=10
            )
        except grpc.RpcError as exc:
            return exc


def known(address: str, job_id: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            rendezvous_pb2_grpc.AdminStub(channel).GetJob(rendezvous_pb2.GetJobRequest(job_id=job_id), timeout=10)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND, exc
            return False
    return True


@pytest.mark.slow
def test_no_write_is_acknowledged_while_the_store_cannot_take_it(tmp_path):
    """620 KB left: health NOT_SERVING (coordinator.store), and every SubmitJob is refused
    UNAVAILABLE naming the full file system, with nothing recorded and the coordinator up
    (before, all seven were acknowledged). Space back: health SERVING, the same submit is
    accepted, and it outlives a restart."""
    with small_filesystem(tmp_path / "state") as state:
        coordinator = start_coordinator(
            tmp_path / "run", ParallelPlan(dp_shard=2), job_id="low", store={"kind": "sqlite", "dir": str(state)}
        )
        try:
            assert isinstance(submit(coordinator.address, "before"), rendezvous_pb2.JobInfo)
            filler = leave_free(state, 620 << 10)
            until(lambda: health(coordinator.address, "coordinator.store") == NOT_SERVING, "store NOT_SERVING")

            answers = [submit(coordinator.address, f"low-{n}") for n in range(7)]
            for answer in answers:
                assert isinstance(answer, grpc.RpcError), f"acknowledged while NOT_SERVING: {answer}"
                assert answer.code() == grpc.StatusCode.UNAVAILABLE, answer
                assert "coordinator.store" in answer.details() and full_named(state, answer.details()), answer
            with grpc.insecure_channel(coordinator.address) as channel:  # an operator's cordon writes too
                with pytest.raises(grpc.RpcError) as cordon:
                    rendezvous_pb2_grpc.AdminStub(channel).CordonNode(
                        rendezvous_pb2.CordonNodeRequest(node_id="n0", reason="bad DIMM"), timeout=10
                    )
            assert cordon.value.code() == grpc.StatusCode.UNAVAILABLE and "coordinator.store" in cordon.value.details()
            assert coordinator.process.poll() is None  # refused, not stopped: nothing failed
            assert known(coordinator.address, "before")
            assert not any(known(coordinator.address, f"low-{n}") for n in range(7))

            filler.unlink()
            until(lambda: health(coordinator.address, "coordinator.store") == SERVING, "store SERVING again")
            assert isinstance(submit(coordinator.address, "low-0"), rendezvous_pb2.JobInfo)
            coordinator.restart()
            assert known(coordinator.address, "before") and known(coordinator.address, "low-0")
            assert not known(coordinator.address, "low-1")
        finally:
            coordinator.stop()
