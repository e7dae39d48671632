"""The coordinator over real gRPC (grpc.aio on a free loopback port): every refusal gets
its documented status, names the field, and leaves the state as it was."""

from __future__ import annotations

import asyncio
import secrets

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshgate.coordinator.engine import Coordinator
from meshgate.coordinator.keys import KeyRing
from meshgate.coordinator.rendezvous import RendezvousConfig
from meshgate.coordinator.service import build_server, mark_serving
from meshgate.coordinator.store import MemoryStore
from meshgate.attestation import WrongNonce, accept_trust_bundle, verify_attestation
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb
from meshgate.v1 import rendezvous_pb2_grpc

PLAN = ParallelPlan(tp=2, dp_shard=2)
JOB = "job-1"


@pytest_asyncio.fixture
async def served(tmp_path):
    keys = KeyRing(tmp_path / "keys", job_id=JOB)
    config = RendezvousConfig(job_id=JOB, plan=PLAN, slots_per_node=2)
    coordinator = Coordinator(config, MemoryStore(), keys, attestation_ttl_s=3600)
    server, health_servicer = build_server(coordinator)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await mark_serving(health_servicer)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    coordinator.address_for_tests = f"127.0.0.1:{port}"
    yield coordinator, channel, keys.bundle
    await channel.close()
    await server.stop(None)


def request(worker_id: str, node_id: str = "node-a", local_rank: int = 0, **fields) -> pb.RegisterRequest:
    message = pb.RegisterRequest(
        job_id=fields.pop("job_id", JOB),
        worker_id=worker_id,
        nonce=fields.pop("nonce", secrets.token_bytes(32)),
        node_id=node_id,
    )
    claimed = fields.pop("claimed", None)
    if claimed is None:
        message.assigned.local_rank = local_rank
    else:
        message.claimed.rank = claimed
        message.claimed.local_rank = local_rank
    for name, value in fields.items():
        setattr(message, name, value)
    return message


async def status(channel) -> pb.Status:
    return await rendezvous_pb2_grpc.AdminStub(channel).GetStatus(pb.GetStatusRequest(job_id=JOB))


async def expect_refusal(channel, message, code: grpc.StatusCode, *needles: str) -> None:
    before = await status(channel)
    stub = rendezvous_pb2_grpc.RendezvousStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Register(message)
    assert caught.value.code() == code, caught.value.details()
    for needle in needles:
        assert needle in caught.value.details(), caught.value.details()
    after = await status(channel)
    assert after == before, "a refused Register changed the coordinator's state"


async def test_register_returns_a_verifiable_attestation(served):
    coordinator, channel, bundle = served
    stub = rendezvous_pb2_grpc.RendezvousStub(channel)
    message = request("w0", "node-a", 1)
    reply = await stub.Register(message)
    verified = verify_attestation(reply.attestation, bundle, job_id=JOB, nonce=message.nonce, generation=0, plan=PLAN)
    assert (verified.rank, verified.node_rank, verified.local_rank) == (1, 0, 1)
    assert verified.coordinate == PLAN.coordinate(1)
    # the trust bundle served over gRPC is the one on disk
    signed = await stub.GetTrustBundle(pb.GetTrustBundleRequest(job_id=JOB))
    served_bundle = accept_trust_bundle(signed, bundle)  # endorsed by a key we trust
    assert set(served_bundle.keys) == set(bundle.keys)


async def test_register_is_idempotent_and_binds_the_new_nonce(served):
    _, channel, bundle = served
    stub = rendezvous_pb2_grpc.RendezvousStub(channel)
    first = request("w0", "node-b", 1)
    second = request("w0", "node-b", 1)
    a = await stub.Register(first)
    b = await stub.Register(second)
    va = verify_attestation(a.attestation, bundle, job_id=JOB, nonce=first.nonce)
    vb = verify_attestation(b.attestation, bundle, job_id=JOB, nonce=second.nonce)
    assert va.rank == vb.rank == 1
    with pytest.raises(WrongNonce):  # the first attestation does not pass for the second call
        verify_attestation(a.attestation, bundle, job_id=JOB, nonce=second.nonce)
    assert (await status(channel)).registered == 1


async def test_node_ranks_are_join_order_and_ranks_node_contiguous(served):
    _, channel, bundle = served
    stub = rendezvous_pb2_grpc.RendezvousStub(channel)
    ranks = {}
    for node, local in [("node-x", 0), ("node-y", 1), ("node-x", 1), ("node-y", 0)]:
        message = request(f"{node}/{local}", node, local)
        reply = await stub.Register(message)
        ranks[(node, local)] = verify_attestation(reply.attestation, bundle, job_id=JOB, nonce=message.nonce).rank
    assert ranks == {("node-x", 0): 0, ("node-x", 1): 1, ("node-y", 0): 2, ("node-y", 1): 3}
    # with the default order each TP group sits inside one node
    for group in PLAN.groups("tp"):
        assert len({r // 2 for r in group}) == 1


@pytest.mark.parametrize(
    "fields, code, needles",
    [
        ({"job_id": ""}, grpc.StatusCode.INVALID_ARGUMENT, ["job_id"]),
        ({"job_id": "other-job"}, grpc.StatusCode.NOT_FOUND, ["job_id", "other-job"]),  # unknown to the cluster
        ({"nonce": b"short"}, grpc.StatusCode.INVALID_ARGUMENT, ["nonce", "5"]),
        ({"claimed": 4}, grpc.StatusCode.INVALID_ARGUMENT, ["rank 4", "[0, 4)"]),
        ({"local_rank": 2}, grpc.StatusCode.INVALID_ARGUMENT, ["local_rank 2"]),
        ({"plan_digest": b"\x00" * 32}, grpc.StatusCode.FAILED_PRECONDITION, ["plan_digest"]),
        ({"plan_digest": b"\x00" * 7}, grpc.StatusCode.INVALID_ARGUMENT, ["plan_digest", "32"]),
        ({"generation": 3}, grpc.StatusCode.FAILED_PRECONDITION, ["generation 3", "0"]),
        ({"endpoint_host": "h", "endpoint_port": 70000}, grpc.StatusCode.INVALID_ARGUMENT, ["endpoint_port", "70000"]),
    ],
)
async def test_bad_input_is_refused_and_changes_nothing(served, fields, code, needles):
    _, channel, _ = served
    stub = rendezvous_pb2_grpc.RendezvousStub(channel)
    await stub.Register(request("w-first", "node-a", 0))
    local_rank = fields.pop("local_rank", 1)
    await expect_refusal(channel, request("w-bad", "node-a", local_rank, **fields), code, *needles)


async def test_bad_identifiers_and_missing_mode(served):
    _, channel, _ = served
    await expect_refusal(channel, request("", "node-a"), grpc.StatusCode.INVALID_ARGUMENT, "worker_id")
    await expect_refusal(channel, request("w", "bad node!"), grpc.StatusCode.INVALID_ARGUMENT, "node_id", "bad node!")
    no_mode = pb.RegisterRequest(job_id=JOB, worker_id="w", nonce=secrets.token_bytes(16), node_id="n")
    await expect_refusal(channel, no_mode, grpc.StatusCode.INVALID_ARGUMENT, "mode")


async def test_negative_rank_cannot_even_be_encoded():
    # uint32 on the wire: a negative rank is refused by protobuf before it leaves the client.
    with pytest.raises(ValueError):
        pb.ClaimedRank(rank=-1)


async def test_duplicate_rank_from_another_identity(served):
    _, channel, _ = served
    stub = rendezvous_pb2_grpc.RendezvousStub(channel)
    await stub.Register(request("owner", "node-a", 0, claimed=2))
    await expect_refusal(
        channel, request("intruder", "node-b", 0, claimed=2), grpc.StatusCode.ALREADY_EXISTS, "rank 2", "owner"
    )
    # the same identity asking for another rank is refused too, naming what it holds
    await expect_refusal(
        channel, request("owner", "node-a", 0, claimed=3), grpc.StatusCode.ALREADY_EXISTS, "holds rank 2"
    )


async def test_full_world_is_resource_exhausted(served):
    _, channel, _ = served
    stub = rendezvous_pb2_grpc.RendezvousStub(channel)
    for rank in range(4):
        await stub.Register(request(f"w{rank}", f"node-{rank // 2}", rank % 2))
    assert (await status(channel)).registered == 4
    await expect_refusal(channel, request("late", "node-0", 0), grpc.StatusCode.RESOURCE_EXHAUSTED, "full", "late")
    # an assigned-mode node that does not fit is refused the same way
    await expect_refusal(channel, request("n3", "node-3", 0), grpc.StatusCode.RESOURCE_EXHAUSTED, "full")


async def test_await_world_names_missing_ranks_by_node(served):
    _, channel, _ = served
    stub = rendezvous_pb2_grpc.RendezvousStub(channel)
    await stub.Register(request("a0", "node-a", 0))
    await stub.Register(request("a1", "node-a", 1))
    await stub.Register(request("b1", "node-b", 1))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.AwaitWorld(pb.AwaitWorldRequest(job_id=JOB, generation=0, timeout_ms=300))
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "1 of 4 ranks missing" in caught.value.details()
    assert "node-b: ranks 2" in caught.value.details()
    waiter = asyncio.ensure_future(
        stub.AwaitWorld(pb.AwaitWorldRequest(job_id=JOB, generation=0, timeout_ms=10_000, include_members=True))
    )
    await asyncio.sleep(0.1)
    assert not waiter.done()
    await stub.Register(request("b0", "node-b", 0, endpoint_host="10.1.2.3", endpoint_port=29500))
    world = await waiter
    assert world.world_size == 4
    assert [m.rank for m in world.members] == [0, 1, 2, 3]
    assert [m.node_id for m in world.members] == ["node-a", "node-a", "node-b", "node-b"]


async def test_await_world_hands_out_rank0_endpoint(served):
    _, channel, _ = served
    stub = rendezvous_pb2_grpc.RendezvousStub(channel)
    for rank in range(4):
        await stub.Register(
            request(
                f"w{rank}", f"node-{rank // 2}", rank % 2, endpoint_host=f"10.0.0.{rank}", endpoint_port=29500 + rank
            )
        )
    world = await stub.AwaitWorld(pb.AwaitWorldRequest(job_id=JOB, generation=0, timeout_ms=1000))
    assert (world.master_addr, world.master_port) == ("10.0.0.0", 29500)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.AwaitWorld(pb.AwaitWorldRequest(job_id=JOB, generation=1, timeout_ms=1000))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "generation 1" in caught.value.details()


async def test_heartbeat_and_health(served):
    _, channel, _ = served
    stub = rendezvous_pb2_grpc.RendezvousStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Heartbeat(pb.HeartbeatRequest(job_id=JOB, worker_id="ghost", generation=0))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    registered = await stub.Register(request("w0", "node-a", 0))
    reply = await stub.Heartbeat(
        pb.HeartbeatRequest(job_id=JOB, worker_id="w0", generation=0, heartbeat_secret=registered.heartbeat_secret)
    )
    assert reply.generation == 0 and reply.server_time.seconds > 0
    health = health_pb2_grpc.HealthStub(channel)
    answer = await health.Check(health_pb2.HealthCheckRequest(service="meshgate.v1.Rendezvous"))
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


async def test_concurrent_burst_gets_each_rank_once(served):
    _, channel, bundle = served
    stub = rendezvous_pb2_grpc.RendezvousStub(channel)
    # 4 real workers and 20 impostors for the same slots, all at once
    messages = [request(f"w{i}", f"node-{i % 2}", (i // 2) % 2) for i in range(24)]
    replies = await asyncio.gather(*(stub.Register(m) for m in messages), return_exceptions=True)
    won = [(m, r) for m, r in zip(messages, replies) if not isinstance(r, Exception)]
    lost = [r for r in replies if isinstance(r, Exception)]
    ranks = sorted(verify_attestation(r.attestation, bundle, job_id=JOB, nonce=m.nonce).rank for m, r in won)
    assert ranks == [0, 1, 2, 3]
    assert {e.code() for e in lost} <= {grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED}


async def test_worker_heartbeat_keeps_the_node_seen_and_learns_when_its_generation_ends(served, tmp_path):
    import dataclasses
    import threading

    from meshgate.coordinator.rendezvous import GenerationBumped
    from meshgate.client import heartbeat

    coordinator, channel, bundle = served
    address = coordinator.address_for_tests
    stub = rendezvous_pb2_grpc.RendezvousStub(channel)
    message = request("w0", "node-a", 0)
    reply = await stub.Register(message)
    att = verify_attestation(reply.attestation, bundle, job_id=JOB, nonce=message.nonce)
    att = dataclasses.replace(att, heartbeat_secret=reply.heartbeat_secret)  # as meshgate.register() does
    before = coordinator.state.nodes["node-a"].last_seen
    ended = threading.Event()
    beat = heartbeat(att, coordinator=address, interval=0.1, on_generation_over=lambda r: ended.set())
    try:
        for _ in range(100):
            await asyncio.sleep(0.05)
            if beat.beats >= 3:
                break
        assert beat.beats >= 3 and coordinator.state.nodes["node-a"].last_seen > before
        coordinator.state.apply(GenerationBumped(1, "test: membership moved on"))
        for _ in range(100):
            await asyncio.sleep(0.05)
            if ended.is_set():
                break
        assert ended.is_set() and beat.stale
    finally:
        beat.stop()
