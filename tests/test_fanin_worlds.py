"""The fan-in's AwaitWorld coalescing, as logic: one upstream call per (job, generation,
include_members), never an earlier job's world for a later job, and no world for a job
this node does not serve. The upstream is a recording stand-in for the agent's channel."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from meshgate.agent.fanin import FanInServicer
from meshgate.v1 import rendezvous_pb2


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code, details):
        raise Aborted(code, details)


class Upstream:
    def __init__(self):
        self.calls = []

    async def AwaitWorld(self, request, timeout=None):
        self.calls.append(request.job_id)
        await asyncio.sleep(0)
        return rendezvous_pb2.World(job_id=request.job_id, generation=request.generation)


def test_a_later_job_at_the_same_generation_gets_its_own_world():
    async def run():
        upstream = Upstream()
        agent = SimpleNamespace(job_id="job-a", rendezvous=upstream)
        fan_in = FanInServicer(agent)
        ask = rendezvous_pb2.AwaitWorldRequest
        worlds = await asyncio.gather(
            *(fan_in.AwaitWorld(ask(job_id="job-a", generation=0), Context()) for _ in range(4))
        )
        assert {w.job_id for w in worlds} == {"job-a"} and upstream.calls == ["job-a"]  # coalesced
        agent.job_id = "job-b"
        world = await fan_in.AwaitWorld(ask(job_id="job-b", generation=0), Context())
        assert world.job_id == "job-b" and upstream.calls == ["job-a", "job-b"]
        with pytest.raises(Aborted) as refused:
            await fan_in.AwaitWorld(ask(job_id="job-a", generation=0), Context())
        assert refused.value.args[0] == grpc.StatusCode.PERMISSION_DENIED and "job-b" in refused.value.args[1]
        assert upstream.calls == ["job-a", "job-b"]

    asyncio.run(run())
