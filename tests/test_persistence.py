"""Restart without loss (SQLite, the default store): kill -9 mid-rendezvous, restart,
and every worker holds exactly one rank, held by no one else; bad state stops the
coordinator with an error naming the file, and never resets it."""

from __future__ import annotations

import asyncio
import secrets
import sqlite3
import subprocess
import sys

import grpc
import pytest

from conftest import REPO, free_port, worker_env
from meshgate.attestation import TrustBundle, verify_attestation
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb
from meshgate.v1 import rendezvous_pb2_grpc

pytestmark = pytest.mark.slow

PLAN = ParallelPlan(tp=8, dp_shard=125)  # 1,000 ranks, 125 nodes of 8
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}


def worker_request(i: int) -> pb.RegisterRequest:
    message = pb.RegisterRequest(
        job_id="test", worker_id=f"n{i // 8}/local{i % 8}", nonce=secrets.token_bytes(16), node_id=f"n{i // 8}"
    )
    message.assigned.local_rank = i % 8
    return message


async def register_until_answered(address: str, message: pb.RegisterRequest, deadline_s: float = 90.0):
    loop = asyncio.get_running_loop()
    give_up = loop.time() + deadline_s
    while True:
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = rendezvous_pb2_grpc.RendezvousStub(channel)
                return await stub.Register(message, timeout=10)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in RETRYABLE or loop.time() > give_up:
                raise
            await asyncio.sleep(0.05)


def verified_rank(reply, bundle, message) -> int:
    return verify_attestation(reply.attestation, bundle, job_id="test", nonce=message.nonce).rank


async def test_sigkill_mid_rendezvous_loses_and_duplicates_nothing(coordinator_factory):
    coordinator = coordinator_factory(PLAN, slots_per_node=8, server={"listen": f"127.0.0.1:{free_port()}"})
    bundle = TrustBundle.load(coordinator.trust_bundle_path)
    messages = [worker_request(i) for i in range(PLAN.world_size)]
    answered: list[int] = []

    async def one(i: int):
        reply = await register_until_answered(coordinator.address, messages[i])
        answered.append(i)
        return reply

    tasks = [asyncio.ensure_future(one(i)) for i in range(PLAN.world_size)]
    while len(answered) < 300:
        await asyncio.sleep(0.01)
    coordinator.kill()  # SIGKILL, mid-rendezvous: some Registers are in flight
    acknowledged_before_kill = len(answered)
    await asyncio.to_thread(coordinator.restart)
    replies = await asyncio.gather(*tasks)

    ranks = [verified_rank(r, bundle, m) for r, m in zip(replies, messages)]
    assert sorted(ranks) == list(range(PLAN.world_size)), "a rank was lost or held twice"
    for i, rank in enumerate(ranks):  # node-contiguous: a node's 8 workers share one block
        assert rank // 8 == ranks[(i // 8) * 8] // 8 and rank % 8 == i % 8

    # every worker registering again, after the restart, gets the rank it already had
    again = [worker_request(i) for i in range(PLAN.world_size)]
    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        stub = rendezvous_pb2_grpc.RendezvousStub(channel)
        second = await asyncio.gather(*(stub.Register(m, timeout=30) for m in again))
        status = await rendezvous_pb2_grpc.AdminStub(channel).GetStatus(pb.GetStatusRequest(job_id="test"))
    assert [verified_rank(r, bundle, m) for r, m in zip(second, again)] == ranks
    assert status.registered == PLAN.world_size and status.generation == 0
    assert 300 <= acknowledged_before_kill < PLAN.world_size, acknowledged_before_kill


async def test_restart_keeps_rank_coordinate_and_generation(coordinator_factory):
    coordinator = coordinator_factory(PLAN, slots_per_node=8)
    bundle = TrustBundle.load(coordinator.trust_bundle_path)
    first = [worker_request(i) for i in (0, 1, 8, 9, 100)]
    replies = [await register_until_answered(coordinator.address, m) for m in first]
    before = [verify_attestation(r.attestation, bundle, job_id="test", nonce=m.nonce) for r, m in zip(replies, first)]
    coordinator.stop()  # a clean stop this time
    coordinator.restart()
    again = [worker_request(i) for i in (0, 1, 8, 9, 100)]
    replies = [await register_until_answered(coordinator.address, m) for m in again]
    after = [verify_attestation(r.attestation, bundle, job_id="test", nonce=m.nonce) for r, m in zip(replies, again)]
    assert [(a.rank, dict(a.coordinate), a.generation, a.node_rank) for a in after] == [
        (b.rank, dict(b.coordinate), b.generation, b.node_rank) for b in before
    ]


def run_coordinator(config, timeout: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshgate.coordinator", "--config", str(config)],
        cwd=REPO,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_truncated_state_file_stops_with_the_file_named(coordinator_factory):
    coordinator = coordinator_factory(PLAN, slots_per_node=8)
    asyncio.run(register_until_answered(coordinator.address, worker_request(0)))
    coordinator.stop()
    state = coordinator.config_path.parent / "state" / "jobs" / "test" / "state.sqlite3"  # the declared job's log
    data = state.read_bytes()
    state.write_bytes(data[: len(data) // 3])
    for suffix in ("-wal", "-shm"):
        state.with_name(state.name + suffix).unlink(missing_ok=True)
    result = run_coordinator(coordinator.config_path)
    assert result.returncode == 2, result.stderr
    assert str(state) in result.stderr
    assert state.stat().st_size == len(data) // 3, "the coordinator must never reset bad state"


def test_garbage_event_stops_with_the_file_and_event_named(coordinator_factory):
    coordinator = coordinator_factory(PLAN, slots_per_node=8)
    asyncio.run(register_until_answered(coordinator.address, worker_request(0)))
    coordinator.stop()
    state = coordinator.config_path.parent / "state" / "jobs" / "test" / "state.sqlite3"  # the declared job's log
    with sqlite3.connect(state) as db:
        db.execute("UPDATE events SET body = ? WHERE seq = 2", ('{"kind": "RankAssigned", "rank": "zero"}',))
    result = run_coordinator(coordinator.config_path)
    assert result.returncode == 2, result.stderr
    assert str(state) in result.stderr and "record 2" in result.stderr
    with sqlite3.connect(state) as db:
        assert db.execute("SELECT COUNT(*) FROM events").fetchone()[0] == 3  # the pin + 2 events


def test_state_of_another_job_is_refused(coordinator_factory, tmp_path):
    """The cluster holds job 'test', RUNNING, declared by the config: a config that now
    declares another id is refused, naming it (it would otherwise never be served again)."""
    coordinator = coordinator_factory(PLAN, slots_per_node=8)
    coordinator.stop()
    text = coordinator.config_path.read_text().replace('id = "test"', 'id = "other-job"')
    coordinator.config_path.write_text(text)
    result = run_coordinator(coordinator.config_path)
    assert result.returncode == 2
    assert "job 'test', declared by this coordinator's config" in result.stderr
    assert "declares 'other-job'" in result.stderr
    assert not (coordinator.config_path.parent / "state" / "jobs" / "other-job").exists()  # nothing created


def test_a_loose_signing_key_file_stops_the_coordinator(coordinator_factory):
    coordinator = coordinator_factory(PLAN, slots_per_node=8)
    coordinator.stop()
    keys = coordinator.config_path.parent / "keys"
    (key_file,) = keys.glob("*.pem")
    key_file.chmod(0o644)
    result = run_coordinator(coordinator.config_path)
    assert result.returncode == 2
    assert str(key_file) in result.stderr and "0644" in result.stderr
