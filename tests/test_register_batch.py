"""An agent's RegisterBatch that waits for the world (await_world_ms): the batch that
completes the world, and every batch parked before it, bring the world back; a batch
whose world is not complete in time is answered with its attestations and no world.
Real grpc.aio server over mTLS (the fixtures of test_attacks.py)."""

from __future__ import annotations

import asyncio
import time

from meshgate.v1 import nodes_pb2
from test_attacks import JOB, assigned, join, register_request, vouch  # noqa: F401 - assigned is a fixture


def node_batch(env, node_id: str, await_world_ms: int) -> nodes_pb2.RegisterBatchRequest:
    batch = nodes_pb2.RegisterBatchRequest(job_id=JOB, node_id=node_id, node_credential=env.credentials[node_id],
                                           one_signature=True, await_world_ms=await_world_ms)
    batch.requests.extend(register_request(node_id, i, vouch=vouch(env, node_id, i)) for i in range(2))
    return batch


async def test_batches_parked_until_the_world_is_complete_bring_it_back(assigned):
    env = assigned
    await join(env, "node-a")
    await join(env, "node-b")
    first = asyncio.ensure_future(env.nodes["node-a"].RegisterBatch(node_batch(env, "node-a", 60_000)))
    deadline = time.monotonic() + 10
    while len(env.coordinator.state.by_rank) < 2:  # node-a's ranks are held: its batch is parked
        assert time.monotonic() < deadline and not first.done(), "node-a's batch did not arrive"
        await asyncio.sleep(0.01)
    assert not first.done()  # the world lacks node-b's ranks
    second = await env.nodes["node-b"].RegisterBatch(node_batch(env, "node-b", 60_000))
    first = await asyncio.wait_for(first, 10)
    for reply in (first, second):
        assert all(r.HasField("attestation") for r in reply.results)
        assert (reply.world.job_id, reply.world.generation, reply.world.world_size) == (JOB, 0, 4)
        assert reply.world.plan_digest == env.coordinator.config.plan.digest()
        assert not reply.world.members  # as AwaitWorld answers without include_members


async def test_a_batch_whose_world_is_not_complete_in_time_gets_its_attestations_only(assigned):
    env = assigned
    await join(env, "node-a")
    began = time.monotonic()
    reply = await env.nodes["node-a"].RegisterBatch(node_batch(env, "node-a", 300))
    assert time.monotonic() - began >= 0.3  # it did wait
    assert [r.WhichOneof("result") for r in reply.results] == ["attestation", "attestation"]
    assert not reply.HasField("world")  # the agent asks AwaitWorld, which says what is missing
    # Without a wait the answer is at once, and never carries a world.
    await join(env, "node-b")
    reply = await env.nodes["node-b"].RegisterBatch(node_batch(env, "node-b", 0))
    assert len(env.coordinator.state.by_rank) == 4 and not reply.HasField("world")
