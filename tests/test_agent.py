"""Coordinator + node agents as real processes on loopback: join, launch, supervise, drain."""

from __future__ import annotations

import json
import shutil
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

import conftest
from conftest import REPO
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb
from meshgate.v1 import rendezvous_pb2_grpc

PLAN = ParallelPlan(tp=2, dp_shard=2)
TOKEN = "test-join-token"
pytestmark = pytest.mark.slow


def status(address: str) -> pb.Status:
    with grpc.insecure_channel(address) as channel:
        return rendezvous_pb2_grpc.AdminStub(channel).GetStatus(pb.GetStatusRequest(job_id="test"), timeout=5)


def node_states(address: str) -> dict[str, int]:
    return {n.node_id: n.state for n in status(address).nodes}


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def start_agent(tmp: Path, address: str, node_id: str, env: dict | None = None, **agent) -> subprocess.Popen:
    agent.setdefault("join_token", TOKEN)
    return conftest.start_agent(tmp, address, node_id, env=env, **agent)


@pytest.fixture
def cluster(coordinator_factory, tmp_path):
    out = tmp_path / "results"
    out.mkdir()

    def make(**launch):
        table = {"command": [sys.executable, str(REPO / "tests" / "light_worker.py")]}
        table.update(launch)
        return coordinator_factory(
            PLAN,
            slots_per_node=2,
            job={"join_token": TOKEN, "heartbeat_interval_s": 0.3, "heartbeat_misses": 3},
            launch=table,
        )

    return make, out


def test_two_agents_launch_a_verified_node_contiguous_world(cluster, tmp_path):
    make, out = cluster
    coordinator = make(env={"LIGHT_OUT": str(out)})
    agents = [
        start_agent(tmp_path, coordinator.address, "node-b", exit_when_done=True),
        start_agent(tmp_path, coordinator.address, "node-a", exit_when_done=True),
    ]
    codes = [a.wait(timeout=90) for a in agents]
    assert codes == [0, 0], [(tmp_path / f"{n}.log").read_text() for n in ("node-a", "node-b")]
    results = sorted((json.loads(p.read_text()) for p in out.glob("*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    # ranks are node-contiguous: each node holds one block, and each TP group sits in one node
    blocks = {}
    for r in results:
        blocks.setdefault(r["node_id"], []).append(r["rank"])
        assert r["rank"] == r["node_rank"] * 2 + r["local_rank"]
        assert r["coordinate"] == PLAN.coordinate(r["rank"])
    assert sorted(blocks.values()) == [[0, 1], [2, 3]]
    for group in PLAN.groups("tp"):
        assert len({results[m]["node_id"] for m in group}) == 1
    assert {r["rank_block"] for r in results} == {"0-1", "2-3"}
    first_ranks = {n: min(rs) for n, rs in blocks.items()}

    # rerunning the agents (in the other order) gives the same node ranks
    for p in out.glob("*.json"):
        p.unlink()
    view = status(coordinator.address)
    assert {n.node_id: n.state for n in view.nodes} == {"node-a": pb.NODE_STATE_LEFT, "node-b": pb.NODE_STATE_LEFT}
    again = [
        start_agent(tmp_path, coordinator.address, "node-a"),
        start_agent(tmp_path, coordinator.address, "node-b"),
    ]
    try:
        wait_for(
            lambda: (
                node_states(coordinator.address) == {"node-a": pb.NODE_STATE_ACTIVE, "node-b": pb.NODE_STATE_ACTIVE}
            ),
            30,
            "rejoin",
        )
        after = {n.node_id: n.first_rank for n in status(coordinator.address).nodes}
        assert after == first_ranks
    finally:
        for agent in again:
            agent.send_signal(signal.SIGTERM)
        assert [a.wait(timeout=30) for a in again] == [0, 0]


def test_sigkilled_agent_shows_as_lost(cluster, tmp_path):
    make, out = cluster
    coordinator = make(env={"LIGHT_OUT": str(out), "LIGHT_SLEEP": "60"})
    victim = start_agent(tmp_path, coordinator.address, "node-a")
    survivor = start_agent(tmp_path, coordinator.address, "node-b")
    try:
        wait_for(lambda: status(coordinator.address).registered == 4, 60, "all 4 ranks registered")
        killed_at = time.monotonic()
        victim.kill()
        wait_for(lambda: node_states(coordinator.address).get("node-a") == pb.NODE_STATE_LOST, 10, "node-a lost")
        detected = time.monotonic() - killed_at
        assert detected < 0.3 * 3 + 2.0, detected  # within the 3 missed beats plus a sweep
        assert node_states(coordinator.address)["node-b"] == pb.NODE_STATE_ACTIVE
    finally:
        survivor.send_signal(signal.SIGTERM)
        assert survivor.wait(timeout=30) == 0
        # the SIGKILLed agent's workers are orphans in their own sessions: clean them up
        for p in out.glob("node-a-*.json"):
            pid = json.loads(p.read_text())["pid"]
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_sigterm_drains_workers_and_exits_zero(cluster, tmp_path):
    make, out = cluster
    coordinator = make(env={"LIGHT_OUT": str(out), "LIGHT_SLEEP": "120"})
    agents = [start_agent(tmp_path, coordinator.address, n) for n in ("node-a", "node-b")]
    wait_for(lambda: len(list(out.glob("*.json"))) == 4, 60, "4 workers running")
    pids = [json.loads(p.read_text())["pid"] for p in out.glob("node-a-*.json")]
    agents[0].send_signal(signal.SIGTERM)
    assert agents[0].wait(timeout=30) == 0
    for pid in pids:  # the workers are gone, not orphaned
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    view = {n.node_id: n for n in status(coordinator.address).nodes}
    assert view["node-a"].state == pb.NODE_STATE_LEFT  # a clean leave, not a failure
    assert sorted(view["node-a"].exits) == ["local 0: exit 143", "local 1: exit 143"]
    agents[1].send_signal(signal.SIGTERM)
    assert agents[1].wait(timeout=30) == 0


def _results(out: Path, generation: int) -> dict[int, dict]:
    return {r["rank"]: r for r in (json.loads(p.read_text()) for p in out.glob(f"*.g{generation}.result"))}


def test_a_worker_failure_restarts_the_whole_job_into_the_next_generation(cluster, tmp_path):
    """2 agents x 2 workers; rank 3 exits 1 once the world formed. Not a lone restart
    into a formed world: every worker stops and all 4 relaunch into generation 1, with
    the same ranks on the same nodes, and the world forms again."""
    make, out = cluster
    coordinator = make(
        env={
            "LIGHT_OUT": str(out),
            "LIGHT_KEEP_GENERATIONS": "1",
            "LIGHT_FAIL_RANK": "3",
            "LIGHT_FAIL_MARKER": str(tmp_path / "failed-once"),
            "LIGHT_SLEEP": "120",
            "LIGHT_LINGER_GENERATION": "0",
        },
        restart_policy="on-failure",
        max_restarts=2,
    )
    agents = [start_agent(tmp_path, coordinator.address, n, exit_when_done=True) for n in ("node-a", "node-b")]
    logs = lambda: "\n".join((tmp_path / f"{n}.log").read_text() for n in ("node-a", "node-b")) + coordinator.log()
    assert [a.wait(timeout=120) for a in agents] == [0, 0], logs()
    first, second = _results(out, 0), _results(out, 1)
    assert sorted(first) == sorted(second) == [0, 1, 2, 3], logs()
    for rank in range(4):
        assert second[rank]["generation"] == 1
        assert (second[rank]["node_id"], second[rank]["local_rank"]) == (
            first[rank]["node_id"],
            first[rank]["local_rank"],
        )
        assert second[rank]["pid"] != first[rank]["pid"]  # relaunched, not left running
    view = status(coordinator.address)
    assert view.generation == 1 and not view.failure
    failed_node = first[3]["node_id"]
    exits = {n.node_id: list(n.exits) for n in view.nodes}
    assert "local 1: exit 1" in exits[failed_node]
    # the peers of generation 0 were stopped by their agents (SIGTERM), then exited 0 in generation 1
    assert all(
        line in ("local 0: exit 143", "local 1: exit 143", "local 1: exit 1", "local 0: exit 0", "local 1: exit 0")
        for lines in exits.values()
        for line in lines
    ), exits
    assert (
        f"generation 1: worker local_rank 1 (rank 3) on node {failed_node!r} exited 1 in generation 0; "
        "restarting every worker of the job (restart 1/2)"
    ) in coordinator.log()


def test_a_worker_failing_past_max_restarts_fails_the_job_naming_it(cluster, tmp_path):
    """Rank 3 exits 1 every time: one whole-job restart (max_restarts=1), then the job
    FAILS; status names the exit code and the node and never says "complete"."""
    from meshgate.cli import render_status, status_dict

    make, out = cluster
    coordinator = make(
        env={"LIGHT_OUT": str(out), "LIGHT_KEEP_GENERATIONS": "1", "LIGHT_FAIL_RANK": "3", "LIGHT_SLEEP": "120"},
        restart_policy="on-failure",
        max_restarts=1,
    )
    agents = [start_agent(tmp_path, coordinator.address, n, exit_when_done=True) for n in ("node-a", "node-b")]
    logs = lambda: "\n".join((tmp_path / f"{n}.log").read_text() for n in ("node-a", "node-b")) + coordinator.log()
    assert [a.wait(timeout=120) for a in agents] == [1, 1], logs()
    assert sorted(_results(out, 1)) == [0, 1, 2, 3]  # generation 1 formed, then failed again
    view = status(coordinator.address)
    node = _results(out, 1)[3]["node_id"]
    assert view.generation == 1
    assert view.failure == (
        f"worker local_rank 1 (rank 3) on node {node!r} exited 1 in generation 1; restarts exhausted (1/1)"
    ), view.failure
    data = status_dict(view, coordinator.address, time.time())
    assert data["complete"] is False and data["failure"] == view.failure
    text = render_status(data)
    assert f"JOB FAILED: worker local_rank 1 (rank 3) on node {node!r} exited 1" in text
    assert "complete" not in text
    for pid in (r["pid"] for g in (0, 1) for r in _results(out, g).values()):  # no worker left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_wrong_join_token_is_refused(coordinator_factory, tmp_path):
    coordinator = coordinator_factory(PLAN, slots_per_node=2, job={"join_token": TOKEN})
    agent = start_agent(tmp_path, coordinator.address, "node-x", join_token="wrong")
    assert agent.wait(timeout=30) == 2
    assert "UNAUTHENTICATED" in (tmp_path / "node-x.log").read_text()
    assert status(coordinator.address).nodes == []


def test_ready_is_notified_only_after_join(coordinator_factory, tmp_path):
    coordinator = coordinator_factory(PLAN, slots_per_node=2, job={"join_token": TOKEN})
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(30)
    agent = start_agent(tmp_path, coordinator.address, "node-n", env={"NOTIFY_SOCKET": path})
    try:
        message = sock.recv(4096).decode()
        assert message.startswith("READY=1")
        # by the time READY=1 arrives, the coordinator already lists the node
        assert node_states(coordinator.address) == {"node-n": pb.NODE_STATE_ACTIVE}
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0
        sock.close()


def test_workers_learn_their_node_from_the_agent_socket(coordinator_factory, tmp_path):
    """A worker a framework placed (Ray, Fabric) asks the local agent which node it is on
    and registers under that id, the one the agent vouches under: the vouch it gets names
    the same node, and the coordinator accepts the pair."""
    import tempfile

    from meshgate.attestation import verify_vouch
    from meshgate.client import agent_node_id, fetch_vouch, register

    coordinator = coordinator_factory(
        PLAN,
        slots_per_node=2,
        job={"join_token": TOKEN, "require_vouch": True, "mode": "claimed", "heartbeat_interval_s": 0.3},
    )
    socket_dir = tempfile.mkdtemp(prefix="mgvs", dir="/tmp")  # a short path for the socket
    path = os.path.join(socket_dir, "vouch.sock")
    agent = start_agent(tmp_path, coordinator.address, "meshgate-node-7", vouch_socket=path)
    try:
        wait_for(lambda: os.path.exists(path), 30, "the vouch socket")
        assert agent_node_id(path) == "meshgate-node-7"
        vouch = fetch_vouch(path, local_rank=1, rank=1)
        claims = verify_vouch(
            vouch,
            bytes.fromhex(_node_public_key(tmp_path / "meshgate-node-7-state")),
            job_id="test",
            node_id="meshgate-node-7",
            generation=0,
            local_rank=1,
            now=time.time(),
            rank=1,
        )
        assert claims.vouch_id
        # register() with no node id given asks the agent; the coordinator takes the vouch
        env = {"MESHGATE_AGENT_SOCKET": path, "MESHGATE_COORDINATOR": coordinator.address, "MESHGATE_JOB": "test"}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        os.environ.pop("MESHGATE_NODE_ID", None)
        try:
            attestation = register(trust_bundle=str(coordinator.trust_bundle_path), local_rank=0, rank=0, plan=PLAN)
        finally:
            for k, v in old.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        assert (attestation.node_id, attestation.rank) == ("meshgate-node-7", 0)
        assert {n.node_id: n.registered for n in status(coordinator.address).nodes} == {"meshgate-node-7": 1}
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0
        shutil.rmtree(socket_dir, ignore_errors=True)


def _node_public_key(state_dir: Path) -> str:
    from meshgate.agent.identity import NodeIdentity

    return NodeIdentity(state_dir).public_key.hex()


def test_sigterm_stops_an_agent_that_cannot_reach_its_coordinator_promptly(tmp_path):
    # systemd must not have to escalate to SIGKILL: the join retry ends at SIGTERM, exit 0
    agent = start_agent(tmp_path, "127.0.0.1:1", "node-a", join_timeout_s=600)
    try:
        wait_for(lambda: "not reachable yet" in (tmp_path / "node-a.log").read_text(), 60, "a join retry")
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=15) == 0, (tmp_path / "node-a.log").read_text()[-2000:]
        assert "stopped while trying to reach the coordinator" in (tmp_path / "node-a.log").read_text()
    finally:
        if agent.poll() is None:
            agent.kill()


def test_a_relative_config_path_gives_workers_absolute_paths(tmp_path, monkeypatch):
    """Workers run in their job's directory, not the agent's cwd: every path the agent
    hands them (state dir, sockets, TLS files) is absolute, whatever --config was."""
    from meshgate.agent.config import AgentConfig

    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "agent.toml").write_text(
        '[agent]\ncoordinator = "127.0.0.1:7443"\njob = "j"\ninsecure = true\nstate_dir = "state"\n'
    )
    monkeypatch.chdir(tmp_path)
    config = AgentConfig.load("etc/agent.toml")
    assert config.state_dir == tmp_path / "etc" / "state" and config.state_dir.is_absolute()
    assert config.vouch_socket is not None and config.vouch_socket.is_absolute()
    assert config.vouch_socket.parent == config.state_dir


def test_a_notify_socket_that_went_away_is_said_not_fatal(tmp_path, monkeypatch, caplog):
    """systemd's notify socket gone (a fixture or a manager that closed it): the status line
    is lost and said at WARNING; the agent goes on. A live socket gets the datagram."""
    import socket

    from meshgate.agent.sdnotify import notify

    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    assert notify("STATUS=idle") is False
    assert "systemd notify socket" in caplog.text and "STATUS=idle not sent" in caplog.text
    path = tmp_path / "live.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert notify("READY=1") is True
        assert server.recv(64) == b"READY=1"
