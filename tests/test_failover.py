"""Faults with real agents and workers: a SIGKILLed node is detected within 3 heartbeats,
the generation moves on, old attestations stop verifying, a hot spare takes the whole
rank block and every other rank stays; without a spare the world waits for the node,
then fails the job with a clear status."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import grpc
import pytest

from conftest import REPO
from meshgate.attestation import TrustBundle, WrongGeneration, verify_attestation
from meshgate.plan import ParallelPlan
from meshgate.v1 import attestation_pb2
from meshgate.v1 import rendezvous_pb2 as pb
from meshgate.v1 import rendezvous_pb2_grpc
from test_agent import TOKEN, start_agent, status, wait_for

pytestmark = pytest.mark.slow

PLAN = ParallelPlan(tp=2, dp_shard=2)
BEAT_S, MISSES = 0.3, 3


def results(out) -> dict[str, dict]:
    found = {}
    for path in out.glob("*.json"):
        try:
            found[path.stem] = json.loads(path.read_text())
        except ValueError:  # being rewritten by a relaunched worker
            pass
    return found


def kill_node(agent, out, node_id: str) -> None:
    """SIGKILL the agent and its workers: the node is gone."""
    agent.kill()
    agent.wait()
    for name, result in results(out).items():
        if name.startswith(node_id + "-"):
            try:
                os.kill(result["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass


def world_in_generation(address: str, generation: int):
    view = status(address)
    return view if view.generation == generation and view.registered == PLAN.world_size else None


@pytest.fixture
def cluster(coordinator_factory, tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    agents = []

    def make(job_extra=None):
        job = {"join_token": TOKEN, "heartbeat_interval_s": BEAT_S, "heartbeat_misses": MISSES}
        job.update(job_extra or {})
        return coordinator_factory(
            PLAN,
            slots_per_node=2,
            job=job,
            launch={
                "command": [sys.executable, str(REPO / "tests" / "light_worker.py")],
                "env": {"LIGHT_OUT": str(out), "LIGHT_SLEEP": "120"},
            },
        )

    def agent(address, node_id):
        process = start_agent(tmp_path, address, node_id)
        agents.append(process)
        return process

    yield make, agent, out
    for process in agents:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)


def test_lost_node_bumps_generation_and_a_spare_takes_its_block(cluster):
    make, agent, out = cluster
    coordinator = make()
    a = agent(coordinator.address, "node-a")
    agent(coordinator.address, "node-b")
    wait_for(lambda: world_in_generation(coordinator.address, 0), 60, "generation 0 complete")
    agent(coordinator.address, "node-s")
    wait_for(
        lambda: {n.node_id: n.state for n in status(coordinator.address).nodes}.get("node-s") == pb.NODE_STATE_SPARE,
        30,
        "spare",
    )
    before = {n.node_id: n for n in status(coordinator.address).nodes}
    old = results(out)
    old_ranks = {name: r["rank"] for name, r in old.items()}
    a_block = before["node-a"].node_rank

    killed = time.monotonic()
    kill_node(a, out, "node-a")
    wait_for(lambda: status(coordinator.address).generation == 1, 10, "generation 1")
    detected = time.monotonic() - killed
    assert detected <= BEAT_S * MISSES + 1.5, f"lost node detected after {detected:.2f}s"

    view = wait_for(lambda: world_in_generation(coordinator.address, 1), 60, "generation 1 complete")
    nodes = {n.node_id: n for n in view.nodes}
    assert nodes["node-a"].state == pb.NODE_STATE_REPLACED
    assert nodes["node-s"].state == pb.NODE_STATE_ACTIVE and nodes["node-s"].node_rank == a_block
    assert nodes["node-b"].node_rank == before["node-b"].node_rank
    # every rank of the survivors stayed where it was; the spare holds node-a's ranks
    new = wait_for(
        lambda: (
            (r := results(out))
            and all(r.get(f"{n}-{i}", {}).get("generation") == 1 for n in ("node-b", "node-s") for i in (0, 1))
            and r
        ),
        60,
        "relaunched workers report generation 1",
    )
    for i in (0, 1):
        assert new[f"node-b-{i}"]["rank"] == old_ranks[f"node-b-{i}"]
        assert new[f"node-s-{i}"]["rank"] == old_ranks[f"node-a-{i}"]

    # an attestation of generation 0 no longer verifies for a generation-1 verifier
    bundle = TrustBundle.load(coordinator.trust_bundle_path)
    stale = attestation_pb2.SignedAttestation.FromString(bytes.fromhex(old["node-b-0"]["signed"]))
    with pytest.raises(WrongGeneration):
        verify_attestation(stale, bundle, job_id="test", nonce=bytes.fromhex(old["node-b-0"]["nonce"]), generation=1)
    # and the coordinator refuses to let a generation-0 caller wait on the old world
    with grpc.insecure_channel(coordinator.address) as channel:
        stub = rendezvous_pb2_grpc.RendezvousStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.AwaitWorld(pb.AwaitWorldRequest(job_id="test", generation=0, timeout_ms=1000), timeout=5)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "current generation is 1" in caught.value.details()


def test_without_a_spare_the_world_waits_then_the_job_fails(cluster):
    make, agent, out = cluster
    coordinator = make({"lost_node_timeout_s": 6.0})
    a = agent(coordinator.address, "node-a")
    agent(coordinator.address, "node-b")
    wait_for(lambda: world_in_generation(coordinator.address, 0), 60, "generation 0 complete")
    a_rank = {n.node_id: n.node_rank for n in status(coordinator.address).nodes}["node-a"]

    # node-a dies and comes back in time: it gets its own block back
    kill_node(a, out, "node-a")
    wait_for(lambda: status(coordinator.address).generation == 1, 10, "generation 1")
    assert status(coordinator.address).registered < 4  # node-a's ranks are missing until it rejoins
    a = agent(coordinator.address, "node-a")
    view = wait_for(lambda: world_in_generation(coordinator.address, 1), 60, "generation 1 complete")
    assert {n.node_id: n.node_rank for n in view.nodes}["node-a"] == a_rank

    # it dies again and stays away: after lost_node_timeout_s the job fails, clearly
    kill_node(a, out, "node-a")
    view = wait_for(lambda: (v := status(coordinator.address)).failure and v, 20, "job failure")
    assert "node 'node-a'" in view.failure and "lost_node_timeout_s=6" in view.failure
    with grpc.insecure_channel(coordinator.address) as channel:
        stub = rendezvous_pb2_grpc.RendezvousStub(channel)
        message = pb.RegisterRequest(job_id="test", worker_id="late", nonce=b"n" * 16, node_id="node-b")
        message.assigned.local_rank = 0
        with pytest.raises(grpc.RpcError) as caught:
            stub.Register(message, timeout=5)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "failed" in caught.value.details()
