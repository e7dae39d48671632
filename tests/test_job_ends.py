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


def node_states(info: pb.JobInfo) -> dict[str, int]:
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
    wait_for(
        lambda: all("not acknowledged yet" in cluster.agent_log(n) for n in job.nodes),
        30,
        cluster,
        "a first send failed",
    )
    cluster.coordinator = cluster._start()
    info = cluster.wait_ended("down")
    assert info.state == pb.SUCCEEDED and info.status.generation == 0, (info, cluster.logs())
    assert info.reason == "every worker of generation 0 exited 0"
    assert runs(out) == sorted((f"{n}-{i}", 0) for n in job.nodes for i in (0, 1))  # run once
    wait_for(lambda: all(not list(j.glob("*.exit")) for j in journals), 30, cluster, "every exit acknowledged")
    cluster.wait_idle()


def finish_with_exits_held(
    cluster: Cluster, tmp_path: Path, job_id: str, victim: str = "n1"
) -> tuple[Path, Path, Path]:
    """A 2-node job on n0 and ``victim`` whose workers all exit 0: n0's exits reach the
    coordinator, ``victim``'s agent (restarted with the test hook) only journals them.
    Returns the results folder, the hook's file (remove it to let reports go) and the
    victim's journal."""
    out, hold = tmp_path / "out", tmp_path / "hold"
    out.mkdir()
    hold.touch()
    stop_agent(cluster, victim)
    bring_back(cluster, victim, **{HOLD_REPORTS_ENV: str(hold)})
    cluster.submit(
        job_id, ParallelPlan(dp_shard=4), 2, LIGHT, node_ids=["n0", victim], env=light_env(out, LIGHT_SLEEP="1")
    )
    journal = cluster.root / f"{victim}-state" / "exits"
    wait_for(
        lambda: len(list(journal.glob("*.exit"))) == 2 and clean_exits(cluster.job(job_id), "n0") == 2,
        60,
        cluster,
        f"n0's exits reported, {victim}'s journalled",
    )
    return out, hold, journal


def assert_ran_once_and_succeeded(cluster: Cluster, job_id: str, out: Path, nodes: tuple[str, ...]) -> None:
    info = cluster.wait_ended(job_id)
    assert info.state == pb.SUCCEEDED and info.status.generation == 0, (info, cluster.logs())
    assert runs(out) == sorted((f"{n}-{i}", 0) for n in nodes for i in (0, 1))  # one run, generation 0


def test_an_agent_killed_with_its_workers_exits_unsent_resends_them_after_restart_and_the_job_is_not_rerun(
    cluster, tmp_path
):
    """n1's workers exit 0 and its agent journals the exits but is killed (-9) before
    sending them; the coordinator declares n1 lost while n0's clean exits show the
    generation finishing, so nothing is relaunched. The restarted agent resends."""
    out, _, journal = finish_with_exits_held(cluster, tmp_path, "journalled")
    cluster.agents["n1"].kill()
    cluster.agents["n1"].wait()
    wait_for(lambda: node_states(cluster.job("journalled"))["n1"] == pb.NODE_STATE_LOST, 30, cluster, "n1 lost")
    info = cluster.job("journalled")
    assert info.state == pb.RUNNING and info.status.generation == 0, info  # awaited, not relaunched
    assert "node n1 lost" in cluster.coordinator.log()
    bring_back(cluster, "n1")  # no hook: it resends its journal before serving anything
    assert_ran_once_and_succeeded(cluster, "journalled", out, ("n0", "n1"))
    wait_for(lambda: not list(journal.glob("*.exit")), 30, cluster, "every exit acknowledged")
    cluster.wait_idle()


def test_a_node_paused_after_its_workers_exited_0_is_awaited_and_never_reruns_its_finished_generation(
    cluster, tmp_path
):
    """As above, but the agent is paused (SIGSTOP), not killed: declared lost while the
    generation finishes, then resumed. It resends its exits before it rejoins, and never
    launches its workers again for a generation they finished."""
    out, hold, journal = finish_with_exits_held(cluster, tmp_path, "paused-finishing")
    pid = cluster.agents["n1"].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(
            lambda: node_states(cluster.job("paused-finishing"))["n1"] == pb.NODE_STATE_LOST,
            30,
            cluster,
            pb.NODE_STATE_LOST,
        )
        assert cluster.job("paused-finishing").status.generation == 0
        hold.unlink()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert_ran_once_and_succeeded(cluster, "paused-finishing", out, ("n0", "n1"))
    wait_for(lambda: not list(journal.glob("*.exit")), 30, cluster, "every exit acknowledged")
    assert "acknowledged on resend" in cluster.agent_log("n1")
    cluster.wait_idle()
    stop_agent(cluster, "n1")  # without the hook again, for the tests after this one
    bring_back(cluster, "n1")


# ---- every way a node leaves has one outcome -----------------------------------------------------


def fault_mid_job(
    cluster: Cluster, tmp_path: Path, job_id: str, fault, env=None, **spec
) -> tuple[pb.JobInfo, Path, str]:
    """A 2-node job whose workers linger in generation 0; once its world formed,
    ``fault(node, workers)`` strikes its second node. Returns the job, its results, that node.
    Without spares the job names its nodes (n0, n1, as allocation would give them): such a
    job waits for its own node, never one of the pool (cluster_state/replacement.py), which
    is what these tests are about (tests/test_node_replacement_cluster.py has the pool's)."""
    out = tmp_path / "out"
    out.mkdir()
    if not spec.get("spares"):
        spec["node_ids"] = ["n0", "n1"]
    job = cluster.submit(
        job_id,
        ParallelPlan(dp_shard=4),
        0 if spec.get("node_ids") else 2,
        LIGHT,
        env=light_env(out, LIGHT_SLEEP="60", LIGHT_LINGER_GENERATION="0", **(env or {})),
        **spec,
    )
    fault(job.nodes[1], _wait_results(out, 4, cluster))
    return job, out, job.nodes[1]


def drain(cluster: Cluster):
    return lambda node, workers: stop_agent(cluster, node)


def pause(cluster: Cluster):
    return lambda node, workers: os.kill(cluster.agents[node].pid, signal.SIGSTOP)


@pytest.mark.parametrize("policy", ["never", "on-failure"])
def test_a_drained_node_with_a_spare_is_replaced_and_the_job_succeeds_in_the_next_generation(cluster, tmp_path, policy):
    job_id = f"drain-spare-{policy}"
    job, out, drained = fault_mid_job(cluster, tmp_path, job_id, drain(cluster), spares=1, restart_policy=policy)
    spare = job.spare_nodes[0]
    info = cluster.wait_ended(job_id)
    assert info.state == pb.SUCCEEDED and info.status.generation == 1, (info, cluster.logs())
    assert info.reason == "every worker of generation 1 exited 0"
    assert node_states(info)[drained] == pb.NODE_STATE_REPLACED and node_states(info)[spare] == pb.NODE_STATE_ACTIVE
    assert {w for w, g in runs(out) if g == 1} == {f"{job.nodes[0]}-0", f"{job.nodes[0]}-1", f"{spare}-0", f"{spare}-1"}
    bring_back(cluster, drained)
    cluster.wait_idle()


@pytest.mark.parametrize("policy", ["never", "on-failure"])
def test_a_drained_node_without_a_spare_fails_the_job_after_lost_node_timeout_naming_it(cluster, tmp_path, policy):
    job_id = f"drain-alone-{policy}"
    _, _, drained = fault_mid_job(
        cluster, tmp_path, job_id, drain(cluster), lost_node_timeout_s=3.0, restart_policy=policy
    )
    info = cluster.wait_ended(job_id)
    assert info.state == pb.FAILED, (info, cluster.logs())
    assert f"node '{drained}' (ranks 2-3) was drained" in info.reason, info.reason
    assert node_states(info)[drained] == pb.NODE_STATE_LEFT and info.status.generation == 1
    assert info.HasField("ended_at")
    bring_back(cluster, drained)
    cluster.wait_idle()


def test_a_killed_node_is_named_not_the_survivor_whose_collective_broke(cluster, tmp_path):
    """kill -9 of a node (agent and workers); the survivors' workers then exit 1 as a
    broken collective would. The job fails naming the dead node, never the survivor."""
    broken = tmp_path / "broken"
    job, _, victim = fault_mid_job(
        cluster,
        tmp_path,
        "blame",
        lambda node, workers: _kill_node(cluster, node, workers),
        env={"LIGHT_EXIT_1_WHEN": str(broken)},
        lost_node_timeout_s=3.0,
    )
    survivor = job.nodes[0]
    broken.touch()
    info = cluster.wait_ended("blame")
    assert info.state == pb.FAILED, (info, cluster.logs())
    assert f"node '{victim}' (ranks 2-3) was lost" in info.reason, info.reason
    assert f"node '{survivor}' exited" not in info.reason
    assert node_states(info)[victim] == pb.NODE_STATE_LOST
    assert f"node {victim} lost" in cluster.coordinator.log()
    bring_back(cluster, victim)
    cluster.wait_idle()


def test_heartbeat_loss_then_return_ends_the_generation_and_the_job_succeeds_in_the_next(cluster, tmp_path):
    _, _, victim = fault_mid_job(cluster, tmp_path, "paused", pause(cluster))
    pid = cluster.agents[victim].pid
    try:
        wait_for(
            lambda: node_states(cluster.job("paused"))[victim] == pb.NODE_STATE_LOST, 30, cluster, pb.NODE_STATE_LOST
        )
        assert cluster.job("paused").status.generation == 1
    finally:
        os.kill(pid, signal.SIGCONT)
    info = cluster.wait_ended("paused")
    assert info.state == pb.SUCCEEDED and info.status.generation == 1, (info, cluster.logs())
    assert node_states(info)[victim] == pb.NODE_STATE_ACTIVE
    cluster.wait_idle()


def test_heartbeat_loss_for_good_fails_the_job_after_lost_node_timeout_naming_the_node(cluster, tmp_path):
    _, _, victim = fault_mid_job(cluster, tmp_path, "paused-for-good", pause(cluster), lost_node_timeout_s=3.0)
    pid = cluster.agents[victim].pid
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
def test_a_command_that_cannot_start_fails_the_job_naming_the_node_and_the_agent_serves_the_next(
    cluster, tmp_path, kind
):
    command, why = _command(kind, tmp_path)
    job = cluster.submit(
        f"cannot-{kind}", ParallelPlan(dp_shard=2), 1, command, restart_policy="on-failure", max_restarts=3
    )
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
