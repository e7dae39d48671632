"""One job's damage stays with that job (issue #21, item 4), and running out of file
descriptors is told, never UNKNOWN (item 3).

Real coordinator processes in jobs mode; nodes join over the Nodes API with their own
keys (no agents: no job here runs a command). A job log that cannot be trusted fails
that job alone, naming the file, answered DATA_LOSS; its files are left byte-for-byte
as found and every other job serves. ``--reset-state --job ID`` moves one job aside.
Under a lowered RLIMIT_NOFILE (prlimit on the running process) health turns
NOT_SERVING, a job whose log cannot be opened is answered UNAVAILABLE, and once
descriptors are back the same job serves.
"""

from __future__ import annotations

import hashlib
import os
import resource
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from conftest import REPO, worker_env
from meshgate.attestation import TrustBundle
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb
from meshgate.v1 import rendezvous_pb2_grpc
from test_atomic_state import Started, health, join_node, jobs_config, report_idle, serving

pytestmark = pytest.mark.slow


def admin_stub(channel: grpc.Channel) -> rendezvous_pb2_grpc.AdminStub:
    return rendezvous_pb2_grpc.AdminStub(channel)


def submit(channel: grpc.Channel, job_id: str) -> pb.JobInfo:
    spec = pb.JobSpec(
        job_id=job_id, plan=ParallelPlan(dp_shard=2).to_proto(), nodes=1, mode=pb.RANK_MODE_CLAIMED
    )  # external workers
    return admin_stub(channel).SubmitJob(pb.SubmitJobRequest(spec=spec), timeout=30)


def get_job(channel: grpc.Channel, job_id: str) -> pb.JobInfo:
    return admin_stub(channel).GetJob(pb.GetJobRequest(job_id=job_id), timeout=30)


def get_status(channel: grpc.Channel, job_id: str) -> pb.Status:
    return admin_stub(channel).GetStatus(pb.GetStatusRequest(job_id=job_id), timeout=30)


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def job_files(root: Path, job_id: str) -> dict[str, str]:
    paths = sorted((root / "state" / "jobs" / job_id).rglob("*")) + [root / "keys" / "marks" / job_id]
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths if p.is_file()}


def spoil_record_1(root: Path, job_id: str) -> None:
    """An edit SQLite accepts (valid JSON) but the chain sum does not."""
    db = sqlite3.connect(root / "state" / "jobs" / job_id / "state.sqlite3")
    with db:
        db.execute("UPDATE events SET body = body || ' ' WHERE seq = 1")
    db.close()
    for suffix in ("-wal", "-shm"):  # as a clean stop leaves it
        assert not (root / "state" / "jobs" / job_id / f"state.sqlite3{suffix}").exists()


def cluster_with_jobs(root: Path, nodes: int, jobs: list[str], **cluster) -> tuple[Path, Started]:
    root.mkdir()
    config = jobs_config(root, **cluster)
    started = Started(root, config)
    assert started.serving, started.log()
    started.wait_leading()
    for n in range(nodes):
        join_node(started.address, f"n{n}")
    with grpc.insecure_channel(started.address) as channel:
        for job_id in jobs:
            assert submit(channel, job_id).state == pb.RUNNING
    return config, started


def test_a_damaged_job_log_fails_that_job_alone_named_and_untouched_while_every_other_job_serves(tmp_path):
    root = tmp_path / "c"
    config, started = cluster_with_jobs(root, 3, ["victim", "other", "done"])
    with grpc.insecure_channel(started.address) as channel:
        admin_stub(channel).FinishJob(pb.FinishJobRequest(job_id="done", succeeded=True, reason="ok"), timeout=30)
    started.stop()
    assert started.process.returncode == 0, started.log()
    spoil_record_1(root, "victim")
    spoil_record_1(root, "done")
    before = {**job_files(root, "victim"), **job_files(root, "done")}

    with serving(root, config) as started:
        with grpc.insecure_channel(started.address) as channel:
            victim_file = str(root / "state" / "jobs" / "victim" / "state.sqlite3")
            info = get_job(channel, "victim")
            assert info.state == pb.FAILED and victim_file in info.reason and "cannot be trusted" in info.reason, info
            error = refused(lambda: get_status(channel, "victim"))
            assert error.code() == grpc.StatusCode.DATA_LOSS and victim_file in error.details(), error

            # An ended job is read from its summary in the cluster's log: its own (damaged) log
            # is never opened, so its damage costs nothing and is left as found (checked below).
            done = get_job(channel, "done")
            assert done.state == pb.SUCCEEDED and done.reason == "ok" and done.status.job_id == "done", done
            assert get_status(channel, "done").job_id == "done"

            other = get_job(channel, "other")
            assert other.state == pb.RUNNING and other.status.job_id == "other", other
            assert get_status(channel, "other").job_id == "other"
            assert health(started.address) == "SERVING"
            # The failed job's node went back to the pool (its agent shows nothing left): a new job gets it.
            report_idle(started.address, "n0", "n1", "n2")
            assert submit(channel, "next").state == pb.RUNNING
    assert {**job_files(root, "victim"), **job_files(root, "done")} == before, "refused logs must be left as found"
    out = started.log()
    assert "Traceback" not in out and "cannot be trusted" in out, out

    with serving(root, config) as again:  # the job ended FAILED once; the cluster keeps serving
        with grpc.insecure_channel(again.address) as channel:
            assert get_job(channel, "victim").state == pb.FAILED
            assert get_status(channel, "next").job_id == "next"
    assert {**job_files(root, "victim"), **job_files(root, "done")} == before


def test_reset_state_of_one_job_moves_only_its_files_aside_and_it_is_never_served_again(tmp_path):
    root = tmp_path / "c"
    config, started = cluster_with_jobs(root, 2, ["a", "b"])
    started.stop()
    b_before = job_files(root, "b")
    a_before = job_files(root, "a")

    bad = subprocess.run(
        [sys.executable, "-m", "meshgate.coordinator", "--config", str(config), "--reset-state", "--job", "../cluster"],
        cwd=REPO,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "not a job id" in bad.stderr, bad.stderr
    assert job_files(root, "a") == a_before and (root / "state" / "cluster").is_dir()

    with serving(root, config, "--reset-state", "--job", "a") as reset:
        with grpc.insecure_channel(reset.address) as channel:
            info = get_job(channel, "a")
            assert info.state == pb.FAILED and "--reset-state --job" in info.reason, info
            assert refused(lambda: get_status(channel, "a")).code() == grpc.StatusCode.DATA_LOSS
            assert get_status(channel, "b").job_id == "b"
    out = reset.log()
    assert "MOVED a ASIDE" in out and "job a: it is not served again" in out, out
    assert job_files(root, "b") == b_before
    assert not (root / "state" / "jobs" / "a").exists()
    moved = {
        p.name.split(".reset-")[0]: p
        for p in [*(root / "state" / "jobs").glob("a.reset-*"), *(root / "keys" / "marks").glob("a.reset-*")]
    }
    assert set(moved) == {"a"} and len(list((root / "keys" / "marks").glob("a.reset-*"))) == 1
    mark_aside = next((root / "keys" / "marks").glob("a.reset-*"))
    assert hashlib.sha256(mark_aside.read_bytes()).hexdigest() == a_before["keys/marks/a"]

    # A reset of the whole cluster: every job and node aside, and a new signing key that the
    # new bundle alone trusts, so job id "a" may be used again without two valid attestations.
    old_key = (root / "keys" / "active").read_text().strip()
    with serving(root, config, "--reset-state") as whole:
        assert list(admin_stub_list(whole.address)) == []
        new_bundle = TrustBundle.load(root / "keys" / "trust-bundle.json")
        assert old_key not in new_bundle.keys and (root / "keys" / "active").read_text().strip() in new_bundle.keys
    assert "NEW signing key" in whole.log(), whole.log()
    assert len(list((root / "keys").glob("active.reset-*"))) == 1
    assert len(list((root / "keys").glob("trust-bundle.json.reset-*"))) == 1
    assert (root / "keys" / (old_key.replace(":", "_") + ".pem")).exists()  # kept, no longer trusted


def admin_stub_list(address: str) -> list[pb.JobInfo]:
    with grpc.insecure_channel(address) as channel:
        return list(admin_stub(channel).ListJobs(pb.ListJobsRequest(), timeout=30).jobs)


def limit_free_descriptors(pid: int, free: int, hard: int) -> None:
    """Set ``pid``'s RLIMIT_NOFILE so that exactly ``free`` descriptor numbers are left
    below it (a new descriptor takes the lowest free number), once its set of open ones
    stopped changing (connections the test closed are closed on the server too)."""

    def numbers() -> set[int]:
        return {int(n) for n in os.listdir(f"/proc/{pid}/fd")}

    deadline = time.monotonic() + 30
    seen = numbers()
    while True:
        time.sleep(0.3)
        now = numbers()
        if now == seen or time.monotonic() > deadline:
            break
        seen = now
    limit, holes = 0, 0
    while limit in now or holes < free:
        holes += limit not in now
        limit += 1
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, hard))


def test_out_of_descriptors_health_is_not_serving_answers_are_unavailable_and_the_job_serves_after(tmp_path):
    """The running coordinator's RLIMIT_NOFILE is lowered to leave it one descriptor:
    health turns NOT_SERVING at once; a job submitted then is recorded and allocated, but
    its log cannot be opened: every answer is OK, UNAVAILABLE or RESOURCE_EXHAUSTED (never
    UNKNOWN), the job says why. With the limit back, the loop opens its log and health
    is SERVING again; a kill -9 and a restart serve it too."""
    root = tmp_path / "c"
    config, started = cluster_with_jobs(root, 1, [], heartbeat_interval_s=1, heartbeat_misses=300)
    pid = started.process.pid
    channel = grpc.insecure_channel(started.address)  # one connection: accepting another needs a descriptor
    try:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        checks = health_pb2_grpc.HealthStub(channel)

        def health_of(service: str = "") -> str:
            reply = checks.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

        assert health_of() == "SERVING"
        original = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        limit_free_descriptors(pid, 1, original[1])
        try:
            deadline = time.monotonic() + 30
            while health_of("coordinator.resources") != "NOT_SERVING":  # before anything broke
                assert time.monotonic() < deadline, started.log()
                time.sleep(0.1)
            assert health_of() == "NOT_SERVING"

            answers = []
            try:
                info = submit(channel, "starved")  # recorded and allocated; its log needs 4 descriptors
                answers.append("OK")
                assert info.state == pb.RUNNING, info
            except grpc.RpcError as exc:
                answers.append(exc.code().name)
            assert "job starved: its log cannot be opened now" in started.log(), started.log()
            info = get_job(channel, "starved")
            assert info.state == pb.RUNNING, info
            try:
                status = get_status(channel, "starved")
                answers.append("OK")
                # A descriptor came free (a connection closed) and the loop opened it meanwhile.
                assert status.job_id == "starved" and "its log is open again" in started.log()
            except grpc.RpcError as exc:
                answers.append(exc.code().name)
                assert "cannot be opened now" in info.reason, info  # the job says why
                assert "starved" in exc.details() and "open" in exc.details(), exc.details()
            assert health_of() == "NOT_SERVING"
            # Not one descriptor left: a call that must create files (a new signing key) is
            # told so, and the key in use stays the one that was active.
            active = (root / "keys" / "active").read_text()
            limit_free_descriptors(pid, 0, original[1])
            try:
                admin_stub(channel).RotateKey(pb.RotateKeyRequest(), timeout=30)
                answers.append("OK")  # only if a descriptor came free meanwhile
            except grpc.RpcError as exc:
                answers.append(exc.code().name)
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "out of resources" in exc.details()
                assert (root / "keys" / "active").read_text() == active
            assert set(answers) <= {"OK", "UNAVAILABLE", "RESOURCE_EXHAUSTED"}, answers
            assert answers.count("OK") < len(answers), answers  # running out was told at least once
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, original)
        deadline = time.monotonic() + 30
        while health_of() != "SERVING":  # the loop opened the job's log
            assert time.monotonic() < deadline, started.log()
            time.sleep(0.2)
        assert get_status(channel, "starved").job_id == "starved"
        assert "its log is open again" in started.log()

        # Memory: an address-space limit 16 MiB above what the process maps turns health
        # NOT_SERVING before an allocation has to fail; lifted, SERVING again.
        original_as = resource.prlimit(pid, resource.RLIMIT_AS)
        mapped = int(Path(f"/proc/{pid}/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.prlimit(pid, resource.RLIMIT_AS, (mapped + (16 << 20), original_as[1]))
        try:
            deadline = time.monotonic() + 30
            while health_of("coordinator.resources") != "NOT_SERVING":
                assert time.monotonic() < deadline, started.log()
                time.sleep(0.1)
        finally:
            resource.prlimit(pid, resource.RLIMIT_AS, original_as)
        deadline = time.monotonic() + 30
        while health_of() != "SERVING":
            assert time.monotonic() < deadline, started.log()
            time.sleep(0.1)
        assert "MiB of memory left" in started.log()
    finally:
        channel.close()
    started.process.kill()
    started.process.wait()
    with serving(root, config) as again:
        with grpc.insecure_channel(again.address) as channel:
            assert get_job(channel, "starved").state == pb.RUNNING
            assert get_status(channel, "starved").job_id == "starved"
    assert "Traceback" not in started.log() + again.log()


def test_a_damaged_cluster_log_is_refused_and_nothing_is_written_not_even_its_wal(tmp_path):
    """Killed with a job running (the cluster's WAL and -shm in place), then a bit of the
    cluster's WAL flipped: the start is refused (exit 2, naming the file), and every file
    of the state and keys, the WAL and -shm included, is byte-for-byte as found."""
    root = tmp_path / "c"
    config, started = cluster_with_jobs(root, 1, ["running"])
    started.process.kill()
    started.process.wait()
    wal = root / "state" / "cluster" / "state.sqlite3-wal"
    assert wal.exists() and (root / "state" / "cluster" / "state.sqlite3-shm").exists()
    data = bytearray(wal.read_bytes())
    data[len(data) - 100] ^= 0x04  # inside the last frame's page
    wal.write_bytes(bytes(data))

    def everything() -> dict[str, str]:
        files = [p for d in ("state", "keys") for p in sorted((root / d).rglob("*")) if p.is_file()]
        return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}

    before = everything()
    result = subprocess.run(
        [sys.executable, "-m", "meshgate.coordinator", "--config", str(config)],
        cwd=REPO,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert str(root / "state" / "cluster" / "state.sqlite3") in result.stderr and "Traceback" not in result.stderr
    assert everything() == before
