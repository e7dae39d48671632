"""The reported claimed-mode attack on real processes (issue 20, item 5): a process on a
2-slot node asks its agent's vouch socket for vouches for ranks 0-3 (the socket vouches
for any rank its allowed caller asks for) and registers each. The coordinator holds the
node to its slots: ranks 2 and 3 are RESOURCE_EXHAUSTED naming the node, its slots and
the ranks it holds, and stay free for the second node's workers. The pure rules are in
test_rendezvous.py ("claimed mode stays inside the node")."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time

import grpc
import pytest

from conftest import start_agent
from meshgate.client import RendezvousRefused, fetch_vouch, register
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb
from meshgate.v1 import rendezvous_pb2_grpc

PLAN = ParallelPlan(tp=2, dp_shard=2)  # world 4, two nodes of 2 slots
TOKEN = "claimed-cap-token"
NODE = "cap-node-a"
pytestmark = pytest.mark.slow


def held(address: str) -> dict[str, int]:
    with grpc.insecure_channel(address) as channel:
        status = rendezvous_pb2_grpc.AdminStub(channel).GetStatus(pb.GetStatusRequest(job_id="test"), timeout=5)
    return {n.node_id: n.registered for n in status.nodes}


def test_one_node_cannot_claim_more_ranks_than_its_slots_through_its_vouch_socket(coordinator_factory, tmp_path):
    coordinator = coordinator_factory(
        PLAN,
        slots_per_node=2,
        job={"join_token": TOKEN, "require_vouch": True, "mode": "claimed", "topology_policy": "refuse"},
    )
    socket_dir = tempfile.mkdtemp(prefix="mgcap", dir="/tmp")  # a short path for the socket
    path = os.path.join(socket_dir, "vouch.sock")
    agent = start_agent(tmp_path, coordinator.address, NODE, join_token=TOKEN, vouch_socket=path)
    env = {"MESHGATE_AGENT_SOCKET": path, "MESHGATE_COORDINATOR": coordinator.address, "MESHGATE_JOB": "test"}
    saved = {k: os.environ.get(k) for k in (*env, "MESHGATE_NODE_ID", "MESHGATE_VOUCH")}
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(path):
            assert agent.poll() is None and time.monotonic() < deadline, (tmp_path / f"{NODE}.log").read_text()
            time.sleep(0.05)
        os.environ.update(env)
        os.environ.pop("MESHGATE_NODE_ID", None)
        answers = {}
        for rank in range(4):
            local_rank = rank % 2
            assert fetch_vouch(path, local_rank=local_rank, rank=rank).payload  # the socket vouches for any rank
            try:  # register() asks the socket for a vouch naming its claimed rank
                attestation = register(
                    trust_bundle=str(coordinator.trust_bundle_path),
                    local_rank=local_rank,
                    rank=rank,
                    plan=PLAN,
                    worker_id=f"greedy/rank{rank}",
                )
                answers[rank] = ("OK", attestation.node_id)
            except RendezvousRefused as refused:
                answers[rank] = (refused.code.name, refused.details)
        assert answers[0] == ("OK", NODE) and answers[1] == ("OK", NODE), answers
        for rank in (2, 3):
            code, details = answers[rank]
            assert code == "RESOURCE_EXHAUSTED", answers
            assert f"node {NODE!r} has 2 slots" in details and "ranks 0-1" in details, details
        assert held(coordinator.address) == {NODE: 2}
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0
        shutil.rmtree(socket_dir, ignore_errors=True)
