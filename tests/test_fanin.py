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
    agents = [start_agent(tmp_path, coordinator.address, n, fan_in=True, exit_when_done=True, slots=4) for n in ("node-a", "node-b")]
    assert [a.wait(timeout=120) for a in agents] == [0, 0], (tmp_path / "node-a.log").read_text()[-3000:]
    results = [json.loads(p.read_text()) for p in out.glob("*.json")]
    assert sorted(r["rank"] for r in results) == list(range(8))
    assert all(r["rank"] // 4 == r["node_rank"] for r in results)
    for node in ("node-a", "node-b"):
        log = (tmp_path / f"{node}.log").read_text()
        forwarded, batches = map(int, re.search(r"forwarded (\d+) registers in (\d+) batches", log).groups())
        assert forwarded == 4 and 1 <= batches < forwarded, log[-2000:]


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
        done = subprocess.run([sys.executable, str(REPO / "tests" / "light_worker.py")], env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode != 0
        assert "PERMISSION_DENIED" in done.stderr and "no vouch" in done.stderr
        assert status(coordinator.address).registered == 0
        assert oct(os.stat(socket_path).st_mode & 0o777) == "0o660"
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0
