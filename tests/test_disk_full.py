"""A full disk under a real coordinator process (issue #14).

The SQLite state lives on a small tmpfs made for the test and filled to the brim. Health
must go NOT_SERVING naming coordinator.store before any write has to fail; a write that
then fails stops the coordinator with a disk-full message; a start on the full disk says
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


@pytest.mark.slow
def test_a_full_disk_is_not_serving_and_reported_as_full(tmp_path):
    with small_filesystem(tmp_path / "state") as state:
        coordinator = start_coordinator(
            tmp_path / "run", ParallelPlan(dp_shard=2), job_id="full", store={"kind": "sqlite", "dir": str(state)}
        )
        try:
            assert health(coordinator.address, "coordinator.store") == SERVING
            assert health(coordinator.address, "") == SERVING
            filler = fill(state)

            # Before any write has to fail: the store says it cannot take one.
            until(lambda: health(coordinator.address, "coordinator.store") == NOT_SERVING, "store NOT_SERVING")
            assert health(coordinator.address, "") == NOT_SERVING
            log = until(lambda: "health: NOT_SERVING" in coordinator.log() and coordinator.log(), "the log line")
            assert "health: NOT_SERVING (failed: coordinator.store)" in log, log
            assert full_named(state, log), log

            # A write now fails as a full disk, and stops the coordinator (its memory is ahead of the log).
            with grpc.insecure_channel(coordinator.address) as channel, pytest.raises(grpc.RpcError) as failed:
                rendezvous_pb2_grpc.AdminStub(channel).CreateJoinToken(
                    rendezvous_pb2.CreateJoinTokenRequest(job_id="full", node_id="n1"), timeout=10
                )
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
            coordinator.stop()
