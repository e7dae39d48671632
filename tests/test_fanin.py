"""Agent fan-in with real processes: workers register on their agent's Unix socket, the
agent forwards batches, every worker verifies its own attestation; a worker without the
agent's vouch is refused on the socket and never reaches the coordinator."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from conftest import REPO, worker_env
from meshgate.plan import ParallelPlan
from test_agent import TOKEN, start_agent, status, wait_for

pytestmark = pytest.mark.slow
PLAN = ParallelPlan(tp=4, dp_shard=2)  # 8 ranks: 2 nodes of 4


def test_workers_register_through_their_agent(coordinator_factory, tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    coordinator = coordinator_factory(
        PLAN,
        slots_per_node=4,
        job={"join_token": TOKEN, "require_vouch": True, "heartbeat_interval_s": 0.5},
        launch={"command": [sys.executable, str(REPO / "tests" / "light_worker.py")], "env": {"LIGHT_OUT": str(out)}},
    )
    agents = [
        start_agent(tmp_path, coordinator.address, n, fan_in=True, exit_when_done=True, slots=4)
        for n in ("node-a", "node-b")
    ]
    assert [a.wait(timeout=120) for a in agents] == [0, 0], (tmp_path / "node-a.log").read_text()[-3000:]
    results = [json.loads(p.read_text()) for p in out.glob("*.json")]
    assert sorted(r["rank"] for r in results) == list(range(8))
    assert all(r["rank"] // 4 == r["node_rank"] for r in results)
    for node in ("node-a", "node-b"):
        log = (tmp_path / f"{node}.log").read_text()
        forwarded, batches = map(int, re.search(r"forwarded (\d+) registers in (\d+) batches", log).groups())
        # Workers start a few ms apart, so how they fall into windows varies; the burst
        # test below shows the batching itself.
        assert forwarded == 4 and 1 <= batches <= forwarded, log[-2000:]


def test_a_burst_of_registers_travels_in_few_batches(coordinator_factory, tmp_path):
    import asyncio
    import secrets
    import time

    import grpc

    from meshgate.attestation import SigningKey, TrustBundle, sign_vouch, verify_attestation
    from meshgate.v1 import rendezvous_pb2 as pb
    from meshgate.v1 import rendezvous_pb2_grpc

    plan = ParallelPlan(tp=16, dp_shard=1)
    coordinator = coordinator_factory(plan, slots_per_node=16, job={"join_token": TOKEN, "require_vouch": True})
    agent = start_agent(tmp_path, coordinator.address, "node-a", fan_in=True, slots=16)
    state = tmp_path / "node-a-state"
    try:
        wait_for(lambda: (state / "rendezvous.sock").exists(), 30, "the fan-in socket")
        node_key = SigningKey.load(state / "node-key.pem")  # what the agent signs vouches with
        bundle = TrustBundle.load(coordinator.trust_bundle_path)

        async def burst():
            async with grpc.aio.insecure_channel(f"unix:{state / 'rendezvous.sock'}") as channel:
                stub = rendezvous_pb2_grpc.RendezvousStub(channel)
                requests = []
                for i in range(16):
                    request = pb.RegisterRequest(
                        job_id="test", worker_id=f"w{i}", nonce=secrets.token_bytes(32), node_id="node-a"
                    )
                    request.assigned.local_rank = i
                    request.vouch.CopyFrom(
                        sign_vouch(
                            node_key,
                            job_id="test",
                            node_id="node-a",
                            generation=0,
                            local_rank=i,
                            expires_at=time.time() + 60,
                        )
                    )
                    requests.append(request)
                replies = await asyncio.gather(*(stub.Register(r, timeout=30) for r in requests))
                ranks = [
                    verify_attestation(a.attestation, bundle, job_id="test", nonce=r.nonce).rank
                    for a, r in zip(replies, requests)
                ]
                return ranks, [a.attestation for a in replies]

        ranks, attestations = asyncio.run(burst())
        assert sorted(ranks) == list(range(16))
        # Each batch was signed once: every worker got the batch its entry is in.
        assert all(a.batch for a in attestations)
        signatures = {a.signature for a in attestations}
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0
    log = (tmp_path / "node-a.log").read_text()
    forwarded, batches = map(int, re.search(r"forwarded (\d+) registers in (\d+) batches", log).groups())
    assert forwarded == 16 and batches <= 4, log[-2000:]
    assert len(signatures) == batches, (len(signatures), batches)


def test_fan_in_socket_refuses_a_worker_without_a_vouch(coordinator_factory, tmp_path):
    coordinator = coordinator_factory(
        PLAN, slots_per_node=4, job={"join_token": TOKEN, "require_vouch": True, "heartbeat_interval_s": 0.5}
    )
    agent = start_agent(tmp_path, coordinator.address, "node-a", fan_in=True, slots=4)
    socket_path = tmp_path / "node-a-state" / "rendezvous.sock"
    try:
        wait_for(lambda: socket_path.exists(), 30, "the fan-in socket")
        env = worker_env(
            MESHGATE_COORDINATOR=f"unix:{socket_path}",
            MESHGATE_JOB="test",
            MESHGATE_NODE_ID="node-a",
            MESHGATE_TRUST_BUNDLE=str(coordinator.trust_bundle_path),
            LOCAL_RANK="0",
            LIGHT_OUT=str(tmp_path),
        )
        env.pop("MESHGATE_VOUCH", None)
        env.pop("MESHGATE_AGENT_SOCKET", None)
        done = subprocess.run(
            [sys.executable, str(REPO / "tests" / "light_worker.py")],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode != 0
        assert "PERMISSION_DENIED" in done.stderr and "no vouch" in done.stderr
        assert status(coordinator.address).registered == 0
        assert oct(os.stat(socket_path).st_mode & 0o777) == "0o660"
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0


def test_a_vouch_read_out_of_a_worker_is_no_use_from_outside_its_job(coordinator_factory, tmp_path):
    """The attack: a process on the host that is not of the job run (another job's, say)
    reads a worker's MESHGATE_VOUCH from /proc/PID/environ and registers with it through
    the agent's fan-in socket. The agent refuses the connection itself (SO_PEERCRED: the
    pid is outside the job run's unit), as its vouch socket would, before gRPC sees it."""
    out = tmp_path / "results"
    out.mkdir()
    coordinator = coordinator_factory(
        PLAN,  # two nodes of 4: with node-b never joining, node-a's workers wait in AwaitWorld
        slots_per_node=4,
        job={"join_token": TOKEN, "require_vouch": True, "heartbeat_interval_s": 0.5},
        launch={"command": [sys.executable, str(REPO / "tests" / "light_worker.py")], "env": {"LIGHT_OUT": str(out)}},
    )
    agent = start_agent(tmp_path, coordinator.address, "node-a", fan_in=True, slots=4)
    socket_path = tmp_path / "node-a-state" / "rendezvous.sock"
    try:
        wait_for(lambda: status(coordinator.address).registered == 4, 60, "node-a's 4 workers registered")

        def worker_vouch():
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    environ = dict(
                        entry.split(b"=", 1)
                        for entry in open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                        if b"=" in entry
                    )
                except OSError:
                    continue
                if environ.get(b"LIGHT_OUT") == str(out).encode() and environ.get(b"LOCAL_RANK") == b"0":
                    return environ.get(b"MESHGATE_VOUCH", b"").decode()

        stolen = wait_for(worker_vouch, 10, "local rank 0's vouch in its environment")
        env = worker_env(
            MESHGATE_COORDINATOR=f"unix:{socket_path}",
            MESHGATE_JOB="test",
            MESHGATE_NODE_ID="node-a",
            MESHGATE_TRUST_BUNDLE=str(coordinator.trust_bundle_path),
            MESHGATE_VOUCH=stolen,
            LOCAL_RANK="0",
            LIGHT_OUT=str(tmp_path),
        )
        env.pop("MESHGATE_AGENT_SOCKET", None)
        # register() waits for a channel that is not ready: a refused connection looks like
        # an agent not up yet, retried until the deadline.
        thief = subprocess.Popen(
            [sys.executable, "-c", "from meshgate.client import register; register(timeout=3)"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        _, stderr = thief.communicate(timeout=60)
        assert thief.returncode != 0 and "UNAVAILABLE" in stderr, stderr[-2000:]
        assert status(coordinator.address).registered == 4
        log = (tmp_path / "node-a.log").read_text()
        refusal = next(
            line for line in log.splitlines() if f"fan-in refused to pid {thief.pid} uid {os.getuid()}:" in line
        )
        assert "WARNING" in refusal and "is not a process of job 'test' generation 0" in refusal, refusal
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0
