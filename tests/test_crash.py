"""kill -9 exactly between "decided" and "durable" (issue #12): no answer carries a rank
that a crash can take back.

The store's test hook (MESHGATE_TEST_HOLD_COMMITS) holds every group commit while a
file exists, so the kill lands in the window deterministically: the first Register's
events are applied but not durable, duplicates of it (and a new Register) are decided
and signed (the metrics counter says so), and then the coordinator dies. After the
restart another node registers first. Every answer recorded, before and after, must
agree: one rank per worker, one worker per rank.
"""

from __future__ import annotations

import asyncio
import secrets
import urllib.request

import grpc
import pytest

from conftest import free_port
from meshgate.attestation import TrustBundle, verify_attestation
from meshgate.coordinator.store import HOLD_COMMITS_ENV
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb
from meshgate.v1 import rendezvous_pb2_grpc

pytestmark = pytest.mark.slow

PLAN = ParallelPlan(tp=8, dp_shard=2)  # 16 ranks, 2 nodes of 8


def message(job_id: str, node: int, local: int) -> pb.RegisterRequest:
    m = pb.RegisterRequest(
        job_id=job_id, worker_id=f"n{node}/local{local}", nonce=secrets.token_bytes(16), node_id=f"n{node}"
    )
    m.assigned.local_rank = local
    return m


def signed_count(metrics_port: int) -> float:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).read().decode()
    except OSError:
        return -1.0
    for line in text.splitlines():
        if line.startswith("meshgate_attestations_signed_total "):
            return float(line.split()[1])
    return 0.0


async def wait_for(predicate, what: str, timeout_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout_s
    while not await asyncio.to_thread(predicate):
        if loop.time() > give_up:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def register_once(address: str, m: pb.RegisterRequest):
    async with grpc.aio.insecure_channel(address) as channel:
        return await rendezvous_pb2_grpc.RendezvousStub(channel).Register(m, timeout=60)


async def register_retrying(address: str, m: pb.RegisterRequest, deadline_s: float = 60.0):
    loop = asyncio.get_running_loop()
    give_up = loop.time() + deadline_s
    while True:
        try:
            return await register_once(address, m)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or loop.time() > give_up:
                raise
            await asyncio.sleep(0.1)


def _serving(address: str) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


async def crash_in_the_commit_window(
    coordinator_factory, tmp_path, monkeypatch, job_id: str, store=None, commits_at_start: int = 0
):
    """``commits_at_start``: the commits a first start makes before it serves (they pass)."""
    hold = tmp_path / "hold-commits"
    hold.write_text(str(commits_at_start) if commits_at_start else "")
    monkeypatch.setenv(HOLD_COMMITS_ENV, str(hold))
    metrics_port = free_port()
    coordinator = coordinator_factory(
        PLAN,
        job_id=job_id,
        slots_per_node=8,
        store=store,
        server={"listen": f"127.0.0.1:{free_port()}", "metrics_listen": f"127.0.0.1:{metrics_port}"},
    )
    monkeypatch.delenv(HOLD_COMMITS_ENV)  # the restarted coordinator commits freely
    bundle = TrustBundle.load(coordinator.trust_bundle_path)
    answers: list[tuple[str, int, str]] = []  # (worker_id, rank, when)

    def record(reply, m, when):
        att = verify_attestation(reply.attestation, bundle, job_id=job_id, nonce=m.nonce)
        assert att.worker_id == m.worker_id
        answers.append((m.worker_id, att.rank, when))

    await wait_for(lambda: signed_count(metrics_port) >= 0, "the metrics endpoint")
    first = message(job_id, 0, 0)
    # An etcd coordinator writes its port file as a standby, just before it wins the election.
    await wait_for(lambda: _serving(coordinator.address), "the coordinator to lead")
    in_flight = [(first, asyncio.ensure_future(register_once(coordinator.address, first)))]
    held = hold.with_name(hold.name + ".held")
    await wait_for(held.exists, "the first commit to be held")
    # Duplicates of the held identity (a client retrying), and one more new worker.
    later = [message(job_id, 0, 0) for _ in range(3)] + [message(job_id, 0, 1)]
    in_flight += [(m, asyncio.ensure_future(register_once(coordinator.address, m))) for m in later]
    await wait_for(lambda: signed_count(metrics_port) >= len(in_flight), "every Register to be decided")
    coordinator.kill()  # SIGKILL, with every one of them decided and none durable
    for m, task in in_flight:
        try:
            record(await task, m, "before the kill")
        except grpc.aio.AioRpcError:
            pass  # not answered: nothing was promised
    answered_before_kill = len(answers)

    hold.unlink()
    await asyncio.to_thread(coordinator.restart)
    # Node 1 registers first now: it would take node_rank 0 if node 0's join was lost.
    for node in (1, 0):
        for local in range(8):
            m = message(job_id, node, local)
            record(await register_retrying(coordinator.address, m), m, "after the restart")

    rank_of: dict[str, set[int]] = {}
    holder_of: dict[int, set[str]] = {}
    for worker_id, rank, _ in answers:
        rank_of.setdefault(worker_id, set()).add(rank)
        holder_of.setdefault(rank, set()).add(worker_id)
    changed = {w: r for w, r in rank_of.items() if len(r) > 1}
    duplicated = {r: w for r, w in holder_of.items() if len(w) > 1}
    assert not changed, f"a worker's rank changed across the crash: {changed}; answers {answers}"
    assert not duplicated, f"a rank was given to two workers: {duplicated}; answers {answers}"
    assert sorted(holder_of) == list(range(PLAN.world_size)), "a rank was lost"
    return answered_before_kill, len(answers)


async def test_sqlite_kill_in_commit_window_loses_duplicates_and_changes_no_rank(
    coordinator_factory, tmp_path, monkeypatch
):
    # One commit at start: the cluster's log records the job the config declares.
    before, total = await crash_in_the_commit_window(
        coordinator_factory, tmp_path, monkeypatch, "crash-sqlite", commits_at_start=1
    )
    assert before == 0, "an answer went out before its rank was durable"
    assert total == PLAN.world_size


async def test_etcd_leader_kill_in_commit_window_loses_duplicates_and_changes_no_rank(
    coordinator_factory, tmp_path, monkeypatch, etcd_server
):
    job_id = f"crash-etcd-{secrets.token_hex(4)}"
    store = {"kind": "etcd", "endpoints": [etcd_server.endpoint], "lease_ttl_s": 1}
    before, total = await crash_in_the_commit_window(
        coordinator_factory, tmp_path, monkeypatch, job_id, store, commits_at_start=1
    )
    assert before == 0, "an answer went out before its rank was durable"
    assert total == PLAN.world_size
