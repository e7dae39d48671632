"""Nothing half-made survives a crash (issue #21, item 3).

The state-creation seam (MESHGATE_TEST_CRASH_AT_STEP=N, coordinator/store/atomic.py)
makes a real coordinator os._exit(137) right after the Nth file-system step of creating
state. Each test loops N over every step, starting from the same state each time, until
a start runs past the last step; after every crash a plain start must serve: a first
start (single-job and jobs mode) then registers a rank that verifies, and a job whose
files were being created is allocated and usable. A few unit tests pin the seam's
pieces (the mark is never a file without a readable slot; a leftover temporary is
never read as state).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from conftest import REPO, worker_env, write_config
from meshgate import admin
from meshgate.attestation import SigningKey, TrustBundle, verify_attestation
from meshgate.client import RendezvousRefused
from meshgate.coordinator.store import codec
from meshgate.coordinator.store.atomic import CRASH_AT_STEP_ENV
from meshgate.coordinator.store.mark import SLOT, DurableMark
from meshgate.plan import ParallelPlan
from meshgate.v1 import nodes_pb2, nodes_pb2_grpc
from meshgate.v1 import rendezvous_pb2 as pb
from test_crash import PLAN, message, register_retrying

JOB = "atomic"


# ---- a coordinator process that may be told to die at a step -----------------------------


class Started:
    def __init__(self, root: Path, config: Path, *extra: str, crash_at: int = 0) -> None:
        self.root = root
        self.port_file = root / "addr"
        self.port_file.unlink(missing_ok=True)
        self.log_path = next(
            root / f"log-{crash_at}-{i}" for i in range(1000) if not (root / f"log-{crash_at}-{i}").exists()
        )
        env = worker_env(**({CRASH_AT_STEP_ENV: str(crash_at)} if crash_at else {}))
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "meshgate.coordinator",
                    "--config",
                    str(config),
                    "--port-file",
                    str(self.port_file),
                    "--listen",
                    "127.0.0.1:0",
                    *extra,
                ],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 60
        while self.process.poll() is None and not self.port_file.exists():
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.02)

    @property
    def serving(self) -> bool:
        return self.process.poll() is None and self.port_file.exists()

    @property
    def address(self) -> str:
        return self.port_file.read_text().strip()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_leading(self, timeout: float = 60) -> None:
        """The port file is written once the store opened; calls are served once the
        coordinator is in its slot (health's coordinator.leader check)."""
        deadline = time.monotonic() + timeout
        while health(self.address, "coordinator.leader") != "SERVING":
            assert time.monotonic() < deadline and self.process.poll() is None, self.log()
            time.sleep(0.05)

    def wait_crashed(self) -> None:
        """A start under the hook either serves (it ran past the last step) or dies at it."""
        self.process.wait(timeout=60)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextmanager
def serving(root: Path, config: Path, *extra: str) -> Iterator[Started]:
    """A plain start that must serve; stopped on the way out."""
    started = Started(root, config, *extra)
    try:
        assert started.serving, started.log()
        started.wait_leading()
        yield started
    finally:
        started.stop()


def crash_at_every_step(tmp_path: Path, make_config, after_crash) -> list[str]:
    """For N = 1, 2, ...: a first start in a new directory (``make_config(root)``) dies
    after step N; then ``after_crash(root, started)`` on a plain start, which must serve.
    Returns the steps' names, once a start served past the last one."""
    steps = []
    for n in range(1, 200):
        root = tmp_path / f"step{n}"
        root.mkdir()
        config = make_config(root)
        started = Started(root, config, crash_at=n)
        if started.serving:  # nothing left to crash at
            started.stop()
            return steps
        started.wait_crashed()
        assert started.process.returncode == 137, started.log()
        said = [line for line in started.log().splitlines() if "crashing after state-creation step" in line]
        assert len(said) == 1, started.log()
        steps.append(said[0].split(": ", 2)[-1])
        with serving(root, config) as after:
            assert "Traceback" not in after.log(), after.log()
            after_crash(root, after)
        assert after.process.returncode == 0, after.log()
        shutil.rmtree(root)
    raise AssertionError(f"more than 200 steps: {steps}")


# ---- a first start ---------------------------------------------------------------------


def single_job_config(root: Path) -> Path:
    return write_config(
        root / "coordinator.toml",
        {
            "job": {"id": JOB, "slots_per_node": 8},
            "plan": PLAN.to_dict(),
            "server": {"listen": "127.0.0.1:0", "insecure": True},
            "keys": {"dir": str(root / "keys")},
            "store": {"dir": str(root / "state")},
        },
    )


def jobs_config(root: Path, **cluster) -> Path:
    return write_config(
        root / "coordinator.toml",
        {
            "server": {"listen": "127.0.0.1:0", "insecure": True},
            "keys": {"dir": str(root / "keys")},
            "store": {"dir": str(root / "state")},
            # Nodes joined by the test do not heartbeat: keep them live for the test's length.
            "cluster": {"heartbeat_interval_s": 60, "heartbeat_misses": 5, **cluster},
        },
    )


@pytest.mark.slow
def test_a_single_job_first_start_killed_at_every_step_starts_and_serves_after(tmp_path):
    def serves_a_rank(root: Path, started: Started) -> None:
        bundle = TrustBundle.load(root / "keys" / "trust-bundle.json")
        m = message(JOB, 0, 0)
        reply = asyncio.run(register_retrying(started.address, m))
        assert verify_attestation(reply.attestation, bundle, job_id=JOB, nonce=m.nonce).rank == 0

    steps = crash_at_every_step(tmp_path, single_job_config, serves_a_rank)
    # keys (key file, pointer, bundle), the cluster's log and mark, the declared job's log and
    # mark: each written, fsynced, renamed, dir fsynced
    assert len(steps) == 7 * 4, steps
    for name in (
        "active",
        "trust-bundle.json",
        "state/cluster",
        f"state/jobs/{JOB}",
        "renamed cluster.new",
        f"renamed {JOB}.new",
    ):
        assert any(name in step for step in steps), (name, steps)


@pytest.mark.slow
def test_a_jobs_mode_first_start_killed_at_every_step_starts_and_serves_after(tmp_path):
    def serves_jobs(root: Path, started: Started) -> None:
        assert list(admin.list_jobs(started.address, tls=False).jobs) == []
        assert health(started.address) == "SERVING"

    steps = crash_at_every_step(tmp_path, jobs_config, serves_jobs)
    assert len(steps) == 5 * 4, steps
    assert any("cluster" in step or "state.sqlite3" in step for step in steps), steps


# ---- a job's files ---------------------------------------------------------------------


def health(address: str, service: str = "") -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


# The credentials of the nodes join_node joined, by node id: report_idle speaks for them.
SIMULATED_NODES: dict[str, bytes] = {}


def join_node(address: str, node_id: str, slots: int = 2) -> None:
    token = admin.create_join_token(address, "", node_id=node_id, tls=False).token
    with grpc.insecure_channel(address) as channel:
        joined = nodes_pb2_grpc.NodesStub(channel).Join(
            nodes_pb2.JoinRequest(
                node_id=node_id,
                hostname=node_id,
                slots=slots,
                slot_kind="cpu",
                join_token=token,
                node_public_key=SigningKey.generate().public_raw,
            ),
            timeout=30,
        )
    SIMULATED_NODES[node_id] = joined.node_credential


def report_idle(address: str, *node_ids: str) -> None:
    """What an agent with no job process left says in its heartbeat (no live unit): a
    node goes back to the pool only then, after its job ended and after a restart."""
    with grpc.insecure_channel(address) as channel:
        for node_id in node_ids:
            nodes_pb2_grpc.NodesStub(channel).NodeHeartbeat(
                nodes_pb2.NodeHeartbeatRequest(
                    node_id=node_id,
                    node_credential=SIMULATED_NODES[node_id],
                    live_units=[],
                ),
                timeout=30,
            )


def cancel_as_agents_do(address: str, job_id: str, *node_ids: str) -> pb.JobInfo:
    """Cancel ``job_id`` while its simulated nodes heartbeat as an idle agent does: CancelJob
    answers once their heartbeats show the job's processes gone."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        cancelled = pool.submit(admin.cancel_job, address, job_id, "next step", tls=False)
        while not cancelled.done():
            report_idle(address, *node_ids)
            time.sleep(0.05)
        return cancelled.result()


def submit(address: str, job_id: str) -> pb.JobInfo:
    spec = pb.JobSpec(job_id=job_id, plan=ParallelPlan(dp_shard=2).to_proto(), nodes=1, command=["true"])
    return admin.submit_job(address, spec, tls=False)


def status(address: str, job_id: str) -> pb.Status:
    from meshgate.v1 import rendezvous_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return rendezvous_pb2_grpc.AdminStub(channel).GetStatus(pb.GetStatusRequest(job_id=job_id), timeout=30)


@pytest.mark.slow
def test_creating_a_jobs_files_killed_at_every_step_leaves_it_allocated_and_usable(tmp_path):
    """The allocation is durable before the job's files are made, so after a crash at any
    step of making them the job is RUNNING on its node, and its log opens (created again,
    or the one that was made) and serves its rendezvous status."""
    root = tmp_path / "cluster"
    root.mkdir()
    config = jobs_config(root)
    with serving(root, config) as first:
        join_node(first.address, "n0")
    steps = []
    for n in range(1, 50):
        started = Started(root, config, crash_at=n)
        assert started.serving, started.log()  # an existing state creates nothing at start
        started.wait_leading()
        report_idle(started.address, "n0")
        job_id = f"job{n}"
        try:
            info = submit(started.address, job_id)
            assert info.state == pb.RUNNING  # ran past the last step: nothing left to crash at
            assert status(started.address, job_id).job_id == job_id
            started.stop()
            break
        except RendezvousRefused as exc:
            assert exc.code == grpc.StatusCode.UNAVAILABLE, exc  # the process died under the call
        started.wait_crashed()
        assert started.process.returncode == 137, started.log()
        steps.append([line for line in started.log().splitlines() if "crashing after" in line][0])
        with serving(root, config) as after:
            info = admin.get_job(after.address, job_id, tls=False)
            assert info.state == pb.RUNNING and list(info.nodes) == ["n0"], info
            assert status(after.address, job_id).job_id == job_id  # its log opened and serves
            cancel_as_agents_do(after.address, job_id, "n0")  # gives n0 back
    else:
        raise AssertionError(f"more than 50 steps: {steps}")
    assert len(steps) == 2 * 4, steps  # the log and the mark: written, fsynced, renamed, dir fsynced
    assert (root / "state" / "jobs" / f"job{len(steps) + 1}" / "state.sqlite3").exists()


# ---- the pieces -------------------------------------------------------------------------


def test_a_new_mark_is_whole_with_its_first_slot_or_absent(tmp_path):
    mark = DurableMark(tmp_path / "m", "job")
    assert mark.read() is None
    mark.advance(1, "a" * 64)
    assert mark.read() == codec_mark("job", 1, "a" * 64)
    assert (tmp_path / "m").stat().st_size == 2 * SLOT
    assert not (tmp_path / "m.new").exists()
    mark.advance(2, "b" * 64)
    mark.advance(3, "c" * 64)
    mark.close()
    again = DurableMark(tmp_path / "m", "job")
    again.advance(4, "d" * 64)  # overwrites the older slot, keeps the newest
    assert again.read().count == 4
    again.close()


def codec_mark(job_id: str, count: int, head: str):
    from meshgate.coordinator.store.mark import Mark

    return Mark(job_id, count, head)


def test_a_leftover_temporary_is_never_read_and_the_next_creation_replaces_it(tmp_path):
    """A crash before the rename leaves ``<name>.new``: not state (no log, no mark), and
    a start builds the log again over it."""
    from meshgate.coordinator.store.sqlite import SQLiteStore

    pin = codec.job_pin(_rendezvous_config())
    (tmp_path / "state.sqlite3.new").write_bytes(b"half a database")
    (tmp_path / "state.sqlite3.new-journal").write_bytes(b"a journal")
    store = SQLiteStore(tmp_path / "state.sqlite3", pin, DurableMark(tmp_path / "mark", pin.job_id))
    try:
        assert store.load() == []
        assert not (tmp_path / "state.sqlite3.new").exists()
        assert not (tmp_path / "state.sqlite3.new-journal").exists()
    finally:
        store.close()
    # A log of the pin alone and no mark yet (a crash between the rename and the mark): valid.
    (tmp_path / "mark").unlink()
    store = SQLiteStore(tmp_path / "state.sqlite3", pin, DurableMark(tmp_path / "mark", pin.job_id))
    store.close()


def _rendezvous_config():
    from meshgate.coordinator.rendezvous import RendezvousConfig

    return RendezvousConfig(job_id="unit", plan=ParallelPlan(dp_shard=2), slots_per_node=2)


@pytest.mark.parametrize("remains", ["zero_bytes_and_journal", "header_without_schema"])
def test_the_remains_of_a_creation_cut_short_before_it_was_atomic_start_fresh_unless_a_mark_vouches(tmp_path, remains):
    """What an older meshgate left when killed while SQLite created the log: a 0-byte file
    with a rollback journal, or a database header without the schema. With no mark nothing
    was acknowledged: moved aside (kept) and created anew. With a mark: refused, untouched."""
    import hashlib
    import sqlite3

    from meshgate.coordinator.store import StoreError
    from meshgate.coordinator.store.sqlite import SQLiteStore

    def leave_remains(directory: Path) -> None:
        directory.mkdir()
        db = directory / "state.sqlite3"
        if remains == "zero_bytes_and_journal":
            db.write_bytes(b"")
            (directory / "state.sqlite3-journal").write_bytes(b"\0" * 512)
        else:
            connection = sqlite3.connect(db)
            connection.execute("PRAGMA journal_mode=WAL")  # writes the header, creates no table
            connection.close()
            assert db.stat().st_size > 0

    pin = codec.job_pin(_rendezvous_config())
    fresh = tmp_path / "fresh"
    leave_remains(fresh)
    store = SQLiteStore(fresh / "state.sqlite3", pin, DurableMark(tmp_path / "mark-fresh", pin.job_id))
    try:
        assert store.load() == []
    finally:
        store.close()
    assert list(fresh.glob("state.sqlite3.unacknowledged-*")), list(fresh.iterdir())

    vouched = tmp_path / "vouched"
    leave_remains(vouched)
    mark = DurableMark(tmp_path / "mark-vouched", pin.job_id)
    mark.advance(3, "a" * 64)
    mark.close()
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in vouched.iterdir()}
    with pytest.raises(StoreError, match="state.sqlite3"):
        SQLiteStore(vouched / "state.sqlite3", pin, DurableMark(tmp_path / "mark-vouched", pin.job_id))
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in vouched.iterdir()} == before


def test_a_mark_an_older_version_tore_at_creation_vouches_for_nothing_and_is_replaced(tmp_path):
    """Older versions created a mark as 1024 zero bytes before writing its first slot; a
    crash between left a mark with no slot. It vouches for nothing: a log of the pin alone
    opens (and the mark is made whole), a longer log is refused as unvouched, untouched."""
    from meshgate.coordinator.store import StoreError
    from meshgate.coordinator.store.sqlite import SQLiteStore

    pin = codec.job_pin(_rendezvous_config())
    (tmp_path / "mark").write_bytes(bytes(2 * SLOT))
    assert DurableMark(tmp_path / "mark", pin.job_id).read() is None
    first = SQLiteStore(tmp_path / "a" / "state.sqlite3", pin, DurableMark(tmp_path / "a-mark", pin.job_id))
    first.close()  # a log of the pin alone, acknowledged by a whole mark
    (tmp_path / "a-mark").write_bytes(bytes(2 * SLOT))  # ... whose mark is then torn as before

    async def one_more(path: Path, mark: Path) -> None:
        from meshgate.coordinator.rendezvous import GenerationBumped

        store = SQLiteStore(path, pin, DurableMark(mark, pin.job_id))  # opens: nothing was vouched for
        await store.append([GenerationBumped(1, "x")])
        store.close()

    asyncio.run(one_more(tmp_path / "a" / "state.sqlite3", tmp_path / "a-mark"))
    assert DurableMark(tmp_path / "a-mark", pin.job_id).read().count == 2  # whole again, at the next commit

    async def three_records(path: Path) -> None:
        from meshgate.coordinator.rendezvous import GenerationBumped

        store = SQLiteStore(path, pin, DurableMark(tmp_path / "b-mark", pin.job_id))
        await store.append([GenerationBumped(1, "x"), GenerationBumped(2, "y")])
        store.close()

    asyncio.run(three_records(tmp_path / "b" / "state.sqlite3"))
    (tmp_path / "b-mark").write_bytes(bytes(2 * SLOT))
    before = (tmp_path / "b" / "state.sqlite3").read_bytes()
    with pytest.raises(StoreError, match="nothing vouches"):
        SQLiteStore(tmp_path / "b" / "state.sqlite3", pin, DurableMark(tmp_path / "b-mark", pin.job_id))
    assert (tmp_path / "b" / "state.sqlite3").read_bytes() == before
    assert (tmp_path / "b-mark").read_bytes() == bytes(2 * SLOT)
