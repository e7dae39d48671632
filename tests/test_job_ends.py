"""A job ends exactly once, truthfully, whatever fails: real coordinator and agents (mTLS,
vouches required, heartbeats every 0.5 s, lost after 3 misses), faults injected at a seam
(the coordinator killed while workers exit, an agent's exit reports held by its test
hook, SIGTERM / SIGKILL / SIGSTOP of an agent), never a sleep hoping for a window.

The README's failure table names each test here. One cluster for the module; each test
leaves every node idle and every agent running.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from meshgate.agent.exits import HOLD_REPORTS_ENV
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb
from test_jobs_cluster import LIGHT, NODES, Cluster, _alive, _kill_node, _wait_results

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("ends"))
    try:
        wait_for(lambda: all("joined the cluster" in cluster.agent_log(n) for n in NODES), 60, cluster)
        yield cluster
    finally:
        for process in cluster.agents.values():
            try:
                os.kill(process.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        cluster.close()


def wait_for(condition, timeout: float, cluster: Cluster, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}\n{cluster.logs()}"
        time.sleep(0.1)


def stop_agent(cluster: Cluster, node_id: str) -> None:
    """SIGTERM: the agent drains (its workers stop, it leaves the job and the pool)."""
    process = cluster.agents[node_id]
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0, cluster.logs()


def bring_back(cluster: Cluster, node_id: str, **env: str) -> None:
    before = cluster.agent_log(node_id).count("joined the cluster")
    cluster.start_agent(node_id, **env)
    wait_for(lambda: cluster.agent_log(node_id).count("joined the cluster") > before, 60, cluster, f"{node_id} back")


def node_states(info: pb.JobInfo) -> dict[str, str]:
    return {n.node_id: n.state for n in info.status.nodes}


def clean_exits(info: pb.JobInfo, node_id: str) -> int:
    return sum(e.endswith(": exit 0") for n in info.status.nodes if n.node_id == node_id for e in n.exits)


def runs(out: Path) -> list[tuple[str, int]]:
    """Every (worker, generation) that formed a world: LIGHT_KEEP_GENERATIONS keeps one file each."""
    return sorted((p.name.split(".g")[0], int(p.name.split(".g")[1].split(".")[0])) for p in out.glob("*.result"))


def light_env(out: Path, **extra: str) -> dict[str, str]:
    return {"LIGHT_OUT": str(out), "LIGHT_KEEP_GENERATIONS": "1", **extra}


# ---- exits are durable and acknowledged ------------------------------------------------------


def test_exits_reported_while_the_coordinator_is_down_reach_it_after_restart_and_the_job_succeeds_once(
    cluster, tmp_path
):
    out = tmp_path / "out"
    out.mkdir()
    job = cluster.submit("down", ParallelPlan(dp_shard=4), 2, LIGHT, env=light_env(out, LIGHT_SLEEP="2"))
    workers = _wait_results(out, 4, cluster)
    cluster.coordinator.kill()  # kill -9, with every worker about to exit 0
    wait_for(lambda: not any(_alive(w["pid"]) for w in workers), 30, cluster, "workers exited")
    journals = [cluster.root / f"{n}-state" / "exits" for n in job.nodes]
    wait_for(lambda: all(len(list(j.glob("*.exit"))) == 2 for j in journals), 30, cluster, "exits journalled")
    wait_for(lambda: all("not acknowledged yet" in cluster.agent_log(n) for n in job.nodes), 30, cluster,
             "a first send failed")
    cluster.coordinator = cluster._start()
    info = cluster.wait_ended("down")
    assert info.state == pb.SUCCEEDED and info.status.generation == 0, (info, cluster.logs())
    assert info.reason == "every worker of generation 0 exited 0"
    assert runs(out) == sorted((f"{n}-{i}", 0) for n in job.nodes for i in (0, 1))  # run once
    assert all(not list(j.glob("*.exit")) for j in journals)  # every exit acknowledged
    cluster.wait_idle()


def test_an_agent_killed_with_its_workers_exits_unsent_resends_them_after_restart_and_the_job_is_not_rerun(
    cluster, tmp_path
):
    """n1's workers exit 0 and its agent journals the exits but is killed (-9) before
    sending them; the coordinator declares n1 lost while n0's clean exits show the
    generation finishing, so nothing is relaunched. The restarted agent resends."""
    out, hold = tmp_path / "out", tmp_path / "hold"
    out.mkdir()
    hold.touch()
    victim = "n1"
    stop_agent(cluster, victim)
    bring_back(cluster, victim, **{HOLD_REPORTS_ENV: str(hold)})
    cluster.submit("journalled", ParallelPlan(dp_shard=4), 2, LIGHT, node_ids=["n0", victim],
                   env=light_env(out, LIGHT_SLEEP="1"))
    journal = cluster.root / f"{victim}-state" / "exits"
    wait_for(lambda: len(list(journal.glob("*.exit"))) == 2 and clean_exits(cluster.job("journalled"), "n0") == 2,
             60, cluster, "n0's exits reported, n1's journalled")
    cluster.agents[victim].kill()
    cluster.agents[victim].wait()
    wait_for(lambda: node_states(cluster.job("journalled"))[victim] == "lost", 30, cluster, "n1 lost")
    info = cluster.job("journalled")
    assert info.state == pb.RUNNING and info.status.generation == 0, info  # awaited, not relaunched
    assert f"node {victim} lost" in cluster.coordinator.log()
    bring_back(cluster, victim)  # no hook: it resends its journal before serving anything
    info = cluster.wait_ended("journalled")
    assert info.state == pb.SUCCEEDED and info.status.generation == 0, (info, cluster.logs())
    assert runs(out) == sorted((f"{n}-{i}", 0) for n in ("n0", victim) for i in (0, 1))
    assert not list(journal.glob("*.exit"))
    cluster.wait_idle()


def test_a_node_paused_after_its_workers_exited_0_is_awaited_and_never_reruns_its_finished_generation(
    cluster, tmp_path
):
    """As above, but the agent is paused (SIGSTOP), not killed: declared lost while the
    generation finishes, then resumed. It resends its exits before it rejoins, and never
    launches its workers again for a generation they finished."""
    out, hold = tmp_path / "out", tmp_path / "hold"
    out.mkdir()
    hold.touch()
    victim = "n1"
    stop_agent(cluster, victim)
    bring_back(cluster, victim, **{HOLD_REPORTS_ENV: str(hold)})
    cluster.submit("paused-finishing", ParallelPlan(dp_shard=4), 2, LIGHT, node_ids=["n0", victim],
                   env=light_env(out, LIGHT_SLEEP="1"))
    journal = cluster.root / f"{victim}-state" / "exits"
    wait_for(lambda: len(list(journal.glob("*.exit"))) == 2
             and clean_exits(cluster.job("paused-finishing"), "n0") == 2, 60, cluster, "exits")
    pid = cluster.agents[victim].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: node_states(cluster.job("paused-finishing"))[victim] == "lost", 30, cluster, "lost")
        assert cluster.job("paused-finishing").status.generation == 0
        hold.unlink()
    finally:
        os.kill(pid, signal.SIGCONT)
    info = cluster.wait_ended("paused-finishing")
    assert info.state == pb.SUCCEEDED and info.status.generation == 0, (info, cluster.logs())
    assert runs(out) == sorted((f"{n}-{i}", 0) for n in ("n0", victim) for i in (0, 1))
    cluster.wait_idle()
    stop_agent(cluster, victim)  # without the hook again, for the tests after this one
    bring_back(cluster, victim)


# ---- every way a node leaves has one outcome -----------------------------------------------------


@pytest.mark.parametrize("policy", ["never", "on-failure"])
def test_a_drained_node_with_a_spare_is_replaced_and_the_job_succeeds_in_the_next_generation(cluster, tmp_path, policy):
    out = tmp_path / "out"
    out.mkdir()
    job_id = f"drain-spare-{policy}"
    job = cluster.submit(job_id, ParallelPlan(dp_shard=4), 2, LIGHT, spares=1, restart_policy=policy,
                         env=light_env(out, LIGHT_SLEEP="60", LIGHT_LINGER_GENERATION="0"))
    drained, spare = job.nodes[1], job.spare_nodes[0]
    _wait_results(out, 4, cluster)
    stop_agent(cluster, drained)
    info = cluster.wait_ended(job_id)
    assert info.state == pb.SUCCEEDED and info.status.generation == 1, (info, cluster.logs())
    assert info.reason == "every worker of generation 1 exited 0"
    assert node_states(info)[drained] == "replaced" and node_states(info)[spare] == "active"
    assert {w for w, g in runs(out) if g == 1} == {f"{job.nodes[0]}-0", f"{job.nodes[0]}-1", f"{spare}-0", f"{spare}-1"}
    bring_back(cluster, drained)
    cluster.wait_idle()


@pytest.mark.parametrize("policy", ["never", "on-failure"])
def test_a_drained_node_without_a_spare_fails_the_job_after_lost_node_timeout_naming_it(cluster, tmp_path, policy):
    out = tmp_path / "out"
    out.mkdir()
    job_id = f"drain-alone-{policy}"
    job = cluster.submit(job_id, ParallelPlan(dp_shard=4), 2, LIGHT, lost_node_timeout_s=3.0, restart_policy=policy,
                         env=light_env(out, LIGHT_SLEEP="60", LIGHT_LINGER_GENERATION="0"))
    drained = job.nodes[1]
    _wait_results(out, 4, cluster)
    stop_agent(cluster, drained)
    info = cluster.wait_ended(job_id)
    assert info.state == pb.FAILED, (info, cluster.logs())
    assert f"node '{drained}' (ranks 2-3) was drained" in info.reason, info.reason
    assert node_states(info)[drained] == "left" and info.status.generation == 1
    assert info.HasField("ended_at")
    bring_back(cluster, drained)
    cluster.wait_idle()


def test_a_killed_node_is_named_not_the_survivor_whose_collective_broke(cluster, tmp_path):
    """kill -9 of a node (agent and workers); the survivors' workers then exit 1 as a
    broken collective would. The job fails naming the dead node, never the survivor."""
    out, broken = tmp_path / "out", tmp_path / "broken"
    out.mkdir()
    job = cluster.submit("blame", ParallelPlan(dp_shard=4), 2, LIGHT, lost_node_timeout_s=3.0,
                         env=light_env(out, LIGHT_SLEEP="60", LIGHT_LINGER_GENERATION="0",
                                       LIGHT_EXIT_1_WHEN=str(broken)))
    victim, survivor = job.nodes[1], job.nodes[0]
    _kill_node(cluster, victim, _wait_results(out, 4, cluster))
    broken.touch()
    info = cluster.wait_ended("blame")
    assert info.state == pb.FAILED, (info, cluster.logs())
    assert f"node '{victim}' (ranks 2-3) was lost" in info.reason, info.reason
    assert f"node '{survivor}' exited" not in info.reason
    assert node_states(info)[victim] == "lost"
    assert f"node {victim} lost" in cluster.coordinator.log()
    bring_back(cluster, victim)
    cluster.wait_idle()


def test_heartbeat_loss_then_return_ends_the_generation_and_the_job_succeeds_in_the_next(cluster, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    job = cluster.submit("paused", ParallelPlan(dp_shard=4), 2, LIGHT,
                         env=light_env(out, LIGHT_SLEEP="60", LIGHT_LINGER_GENERATION="0"))
    victim = job.nodes[1]
    _wait_results(out, 4, cluster)
    pid = cluster.agents[victim].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: node_states(cluster.job("paused"))[victim] == "lost", 30, cluster, "lost")
        assert cluster.job("paused").status.generation == 1
    finally:
        os.kill(pid, signal.SIGCONT)
    info = cluster.wait_ended("paused")
    assert info.state == pb.SUCCEEDED and info.status.generation == 1, (info, cluster.logs())
    assert node_states(info)[victim] == "active"
    cluster.wait_idle()


def test_heartbeat_loss_for_good_fails_the_job_after_lost_node_timeout_naming_the_node(cluster, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    job = cluster.submit("paused-for-good", ParallelPlan(dp_shard=4), 2, LIGHT, lost_node_timeout_s=3.0,
                         env=light_env(out, LIGHT_SLEEP="60", LIGHT_LINGER_GENERATION="0"))
    victim = job.nodes[1]
    _wait_results(out, 4, cluster)
    pid = cluster.agents[victim].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        info = cluster.wait_ended("paused-for-good")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert info.state == pb.FAILED, (info, cluster.logs())
    assert f"node '{victim}' (ranks 2-3) was lost" in info.reason, info.reason
    # back from its pause, the agent learns the end, stops its workers and serves on
    wait_for(lambda: "job paused-for-good is over for this node" in cluster.agent_log(victim), 60, cluster, "back")
    assert cluster.agents[victim].poll() is None
    cluster.wait_idle()


# ---- a command that cannot start --------------------------------------------------------------


def _command(kind: str, tmp_path: Path) -> tuple[list[str], str]:
    script = tmp_path / "job.sh"
    if kind == "missing":
        return [str(tmp_path / "no-such-command")], "No such file or directory"
    if kind == "bad-interpreter":
        script.write_text("#!/no/such/interpreter\n")
        script.chmod(0o755)
        return [str(script)], "No such file or directory"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o644)
    return [str(script)], "Permission denied"


@pytest.mark.parametrize("kind", ["missing", "bad-interpreter", "not-executable"])
def test_a_command_that_cannot_start_fails_the_job_naming_the_node_and_the_agent_serves_the_next(cluster, tmp_path, kind):
    command, why = _command(kind, tmp_path)
    job = cluster.submit(f"cannot-{kind}", ParallelPlan(dp_shard=2), 1, command, restart_policy="on-failure",
                         max_restarts=3)
    node = job.nodes[0]
    info = cluster.wait_ended(f"cannot-{kind}", timeout=60)
    assert info.state == pb.FAILED, (info, cluster.logs())
    assert f"cannot start {command[0]!r} on node '{node}': {why}" in info.reason, info.reason
    assert "never retried" in info.reason and info.status.generation == 0
    assert cluster.agents[node].poll() is None  # the agent kept running
    out = tmp_path / "out"
    out.mkdir()
    cluster.submit(f"after-{kind}", ParallelPlan(dp_shard=2), 1, LIGHT, node_ids=[node], env={"LIGHT_OUT": str(out)})
    assert cluster.wait_ended(f"after-{kind}").state == pb.SUCCEEDED, cluster.logs()
    cluster.wait_idle()


def test_no_agent_died_of_anything_above(cluster):
    assert all(p.poll() is None for p in cluster.agents.values()), cluster.logs()
