"""Replacement from the pool on real processes (issue #30): one mTLS coordinator and four
agents, n0, n1 and n3 on switch s1 and n2 alone on switch s2 (so node id order, n2 before
n3, is the wrong preference). A two-node job without spares runs on n0 and n1; n1's agent
is killed (kill -9, not restarted while the job runs).

One cluster for the module (the tests run in order and each leaves every node idle).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from meshgate import admin
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb
from test_jobs_cluster import LIGHT, Cluster, _wait_results

pytestmark = pytest.mark.slow

NODES = ("n0", "n1", "n2", "n3")
LABELS = {
    "n0": {"switch": "s1", "rack": "r1"},
    "n1": {"switch": "s1", "rack": "r1"},
    "n2": {"switch": "s2", "rack": "r2"},
    "n3": {"switch": "s1", "rack": "r1"},
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("replacement"), nodes=NODES, labels=LABELS)
    try:
        cluster.wait_joined()
        yield cluster
    finally:
        cluster.close()


def submit_pair(cluster: Cluster, job_id: str, out: Path, release: Path) -> pb.JobInfo:
    """Two nodes (n0, n1: the smallest switch group that holds them), no spare; every
    worker keeps a result per generation and heartbeats while it lingers, until ``release``."""
    job = cluster.submit(
        job_id,
        ParallelPlan(dp_shard=4),
        2,
        LIGHT,
        lost_node_timeout_s=60.0,
        env={
            "LIGHT_OUT": str(out),
            "LIGHT_SLEEP": "60",
            "LIGHT_EXIT_0_WHEN": str(release),
            "LIGHT_HEARTBEAT": "0.2",
            "LIGHT_KEEP_GENERATIONS": "1",
        },
    )
    assert (list(job.nodes), list(job.spare_nodes)) == (["n0", "n1"], []), job
    return job


def kill_agent(cluster: Cluster, node_id: str, out: Path) -> list[dict]:
    """kill -9 of the node's agent only: its workers (the orphans) run on and heartbeat."""
    orphans = [r for r in _wait_results(out, 4, cluster) if r["node_id"] == node_id]
    cluster.agents[node_id].kill()
    cluster.agents[node_id].wait()
    return orphans


def wait_generation(cluster: Cluster, out: Path, generation: int, timeout: float = 40) -> list[dict]:
    deadline = time.monotonic() + timeout
    while len(list(out.glob(f"*.g{generation}.result"))) < 4:
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.1)
    return [json.loads(p.read_text()) for p in out.glob(f"*.g{generation}.result")]


def check_one_holder_each(out: Path, final: dict[int, str]) -> None:
    """Every Register answer any worker got (one result per worker and generation):
    each (generation, rank) has exactly one holder, and generation 1's are ``final``."""
    held = [json.loads(p.read_text()) for p in out.glob("*.result")]
    holders = [(r["generation"], r["rank"]) for r in held]
    assert sorted(holders) == sorted(set(holders)) and len(holders) == 8, holders
    assert {r["rank"]: r["node_id"] for r in held if r["generation"] == 1} == final


def finish(cluster: Cluster, lost: str, orphans: list[dict], release: Path) -> None:
    release.touch()
    for orphan in orphans:
        try:
            os.kill(orphan["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    cluster.start_agent(lost)  # it comes back, rejoins the cluster with its credential
    cluster.wait_idle()


def test_a_lost_node_without_a_spare_is_replaced_by_an_idle_node_of_its_switch_and_the_job_succeeds(cluster, tmp_path):
    out, release = tmp_path / "out", tmp_path / "release"
    out.mkdir()
    submit_pair(cluster, "pooled", out, release)
    orphans = kill_agent(cluster, "n1", out)
    killed_at = time.monotonic()
    try:
        wait_generation(cluster, out, 1)
        replaced_in = time.monotonic() - killed_at
        info = cluster.job("pooled")
        assert (list(info.nodes), list(info.spare_nodes)) == (["n0", "n3"], []), info  # n3 (s1), not n2 (s2)
        for orphan in orphans:  # still running, and told their generation is over
            os.kill(orphan["pid"], 0)
            beats = out / f"n1-{orphan['local_rank']}.hb"
            deadline = time.monotonic() + 10
            while not beats.exists():
                assert time.monotonic() < deadline, f"{beats} never written: the orphan's heartbeats were answered"
                time.sleep(0.1)
            assert "over" in json.loads(beats.read_text()), beats
        release.touch()
        info = cluster.wait_ended("pooled", timeout=40)
        assert info.state == pb.SUCCEEDED and info.status.generation == 1, (info, cluster.logs())
        assert (list(info.nodes), list(info.spare_nodes)) == (["n0", "n3"], [])
        states = {n.node_id: (n.state, n.node_rank) for n in info.status.nodes}
        assert states["n3"] == (pb.NODE_STATE_ACTIVE, 1) and states["n1"][0] == pb.NODE_STATE_REPLACED, states
        check_one_holder_each(out, {0: "n0", 1: "n0", 2: "n3", 3: "n3"})
        timeline = admin.get_job_timeline(cluster.address, "pooled", tls=cluster.admin_tls)
        given = [e for e in timeline.entries if e.node_id == "n3" and "given from the pool" in e.detail]
        assert given and given[0].detail.endswith("to take the block of 'n1' (same switch s1)"), timeline
        assert given[0].generation == 1
        print(f"agent killed -> generation 1's world on a node of the pool in {replaced_in:.1f} s (0.5 s x 3)")
    finally:
        finish(cluster, "n1", orphans, release)


def test_a_job_waits_saying_why_while_no_healthy_node_fits_and_takes_one_once_it_is_uncordoned(cluster, tmp_path):
    out, release = tmp_path / "out", tmp_path / "release"
    out.mkdir()
    for node_id in ("n2", "n3"):
        admin.cordon_node(cluster.address, node_id, "testing the wait", tls=cluster.admin_tls)
    submit_pair(cluster, "waits", out, release)
    orphans = kill_agent(cluster, "n1", out)
    try:
        deadline = time.monotonic() + 30
        while "waiting for a node" not in (reason := cluster.job("waits").reason):
            assert time.monotonic() < deadline, (reason, cluster.logs())
            time.sleep(0.2)
        assert "node 'n1' (node_rank 1) lost" in reason and "n2 cordoned, n3 cordoned" in reason, reason
        assert "lost_node_timeout_s=60" in reason, reason
        assert not list(out.glob("*.g1.result"))  # nothing took the block
        # the far one is the one left: it takes the block
        admin.cordon_node(cluster.address, "n2", "", uncordon=True, tls=cluster.admin_tls)
        wait_generation(cluster, out, 1)
        assert cluster.job("waits").reason == ""
        release.touch()
        info = cluster.wait_ended("waits", timeout=40)
        assert info.state == pb.SUCCEEDED, (info, cluster.logs())
        check_one_holder_each(out, {0: "n0", 1: "n0", 2: "n2", 3: "n2"})
    finally:
        admin.cordon_node(cluster.address, "n3", "", uncordon=True, tls=cluster.admin_tls)
        finish(cluster, "n1", orphans, release)


def views(cluster: Cluster, job_id: str, node_id: str) -> tuple[str, str]:
    """(`meshgate nodes`' state of the node, `job show`'s pool state of it in the job)."""
    listed = {n.node_id: n for n in admin.list_nodes(cluster.address, tls=cluster.admin_tls).nodes}
    shown = {n.node_id: n for n in cluster.job(job_id).status.nodes}
    return pb.PoolState.Name(listed[node_id].state), pb.PoolState.Name(shown[node_id].pool_state)


def test_drain_is_admin_only_moves_the_block_to_a_node_of_the_pool_and_shows_draining_then_cordoned(
    cluster, tmp_path, capsys
):
    from meshgate.cli import main as meshgate_main
    from meshgate.client import RendezvousRefused

    out, release = tmp_path / "out", tmp_path / "release"
    out.mkdir()
    submit_pair(cluster, "drained", out, release)
    _wait_results(out, 4, cluster)
    worker = cluster.ca.client_tls(cluster.ca.worker)
    with pytest.raises(RendezvousRefused, match="needs role admin") as refused:
        admin.cordon_node(cluster.address, "n1", "not yours", drain=True, tls=worker)
    assert refused.value.code.name == "PERMISSION_DENIED"
    for node_id, reason, code, named in (
        ("n1", " ", "INVALID_ARGUMENT", "reason is required"),
        ("n9", "x", "NOT_FOUND", "'n9'"),
    ):
        with pytest.raises(RendezvousRefused, match=named) as refused:
            admin.cordon_node(cluster.address, node_id, reason, drain=True, tls=cluster.admin_tls)
        assert refused.value.code.name == code
    assert views(cluster, "drained", "n1") == ("POOL_STATE_SERVING", "POOL_STATE_SERVING")  # nothing changed
    # a cordon of a serving node keeps its job (and is on the job's timeline, with the uncordon)
    assert admin.cordon_node(cluster.address, "n0", "checking", tls=cluster.admin_tls).state == pb.POOL_STATE_SERVING
    admin.cordon_node(cluster.address, "n0", "", uncordon=True, tls=cluster.admin_tls)
    n1 = cluster.agents["n1"]
    os.kill(n1.pid, signal.SIGSTOP)  # its part winds down only once its agent hears of the drain
    try:
        connection = ["--coordinator", cluster.address, "--ca-file", str(cluster.ca.ca)]
        connection += ["--cert-file", str(cluster.ca.admin.cert), "--key-file", str(cluster.ca.admin.key)]
        assert meshgate_main(["node", "drain", "n1", "--reason", "bad DIMM", *connection]) == 0
        assert "draining" in capsys.readouterr().out
        assert views(cluster, "drained", "n1") == ("POOL_STATE_DRAINING", "POOL_STATE_DRAINING")
        final = wait_generation(cluster, out, 1)  # n3 (switch s1) took the block while n1 is stopped
        assert sorted((r["rank"], r["node_id"]) for r in final) == [(0, "n0"), (1, "n0"), (2, "n3"), (3, "n3")]
        assert views(cluster, "drained", "n1") == ("POOL_STATE_DRAINING", "POOL_STATE_DRAINING")
    finally:
        os.kill(n1.pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while views(cluster, "drained", "n1") != ("POOL_STATE_CORDONED", "POOL_STATE_CORDONED"):
        assert time.monotonic() < deadline, (views(cluster, "drained", "n1"), cluster.logs())
        time.sleep(0.2)
    assert "job drained is over for this node" in cluster.agent_log("n1") and n1.poll() is None
    release.touch()
    info = cluster.wait_ended("drained", timeout=40)
    assert info.state == pb.SUCCEEDED and info.status.generation == 1, (info, cluster.logs())
    assert (list(info.nodes), list(info.spare_nodes)) == (["n0", "n3"], [])
    check_one_holder_each(out, {0: "n0", 1: "n0", 2: "n3", 3: "n3"})
    timeline = admin.get_job_timeline(cluster.address, "drained", tls=cluster.admin_tls)
    details = [(e.node_id, e.detail) for e in timeline.entries]
    assert ("n1", "drained by admin:admin: bad DIMM: its part goes to a replacement") in details, details
    assert ("n3", "given from the pool to take the block of 'n1' (same switch s1)") in details, details
    assert [d for n, d in details if n == "n0" and "cordon" in d] == [
        "cordoned by admin:admin: checking",
        "uncordoned by admin:admin",
    ], details
    assert pb.PoolState.Name(admin.list_nodes(cluster.address, tls=cluster.admin_tls).nodes[1].state) == (
        "POOL_STATE_CORDONED"
    )
    admin.cordon_node(cluster.address, "n1", "", uncordon=True, tls=cluster.admin_tls)
    cluster.wait_idle()
