"""`meshgate job show --timeline` on real processes: a coordinator (mTLS, vouches) and three
agents run a job whose rank 3 fails once, so the whole job restarts into generation 1 and
then succeeds; its timeline reads, in order and with non-decreasing times: submitted,
allocated, both nodes, generation 0's registrations and world, the restart naming the
worker, generation 1's registrations and world, the clean exits, the end. Only its owner or
an admin may read it. The timeline's pure parts: tests/test_timeline.py."""

from __future__ import annotations

import json
import time

import pytest

from meshgate import admin
from meshgate.cli import main as meshgate_main
from meshgate.client import RendezvousRefused
from meshgate.plan import ParallelPlan
from meshgate.tls import issue_cert
from meshgate.v1 import rendezvous_pb2 as pb
import test_jobs_cluster
from test_jobs_cluster import LIGHT, NODES, _alive

pytestmark = pytest.mark.slow

cluster = test_jobs_cluster.cluster  # its module-scoped fixture: a cluster of our own for this module


def test_a_job_that_restarts_once_then_succeeds_shows_its_timeline_in_order(cluster, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    cluster.submit(
        "flaky",
        ParallelPlan(dp_shard=4),
        2,
        LIGHT,
        restart_policy="on-failure",
        max_restarts=1,
        env={"LIGHT_OUT": str(out), "LIGHT_FAIL_RANK": "3", "LIGHT_FAIL_MARKER": str(tmp_path / "failed-once")},
    )
    info = cluster.wait_ended("flaky")
    assert info.state == pb.SUCCEEDED and info.status.generation == 1, (info, cluster.logs())

    capsys.readouterr()
    assert meshgate_main(cluster.cli("show", "flaky", "--timeline", "--json")) == 0
    data = json.loads(capsys.readouterr().out)
    entries = data["entries"]
    assert (data["job_id"], data["state"], data["note"], data["entries_dropped"]) == ("flaky", "SUCCEEDED", "", 0)
    # generation 0's workers that finished before rank 3 failed exited 0 (a span of < 4), or
    # were stopped by their agent when the generation ended (no entry): it depends on timing
    early = [e for e in entries if (e["moment"], e["generation"]) == ("workers_exited", 0)]
    assert all(e["count"] < 4 for e in early), early
    entries = [e for e in entries if e not in early]
    assert [(e["moment"], e["generation"]) for e in entries] == [
        ("submitted", 0),
        ("allocated", 0),
        ("node_joined", 0),
        ("node_joined", 0),
        ("ranks_registered", 0),
        ("world_formed", 0),
        ("generation_changed", 1),
        ("ranks_registered", 1),
        ("world_formed", 1),
        ("workers_exited", 1),
        ("ended", 1),
    ], entries
    offsets = [e["offset_s"] for e in entries]
    assert offsets == sorted(offsets) and offsets[0] == 0.0, offsets
    assert {e["node_id"] for e in entries if e["moment"] == "node_joined"} == set(info.nodes)
    assert [e["count"] for e in entries if e["moment"] in ("ranks_registered", "workers_exited")] == [4, 4, 4]
    restart = entries[6]["detail"]
    assert "worker local_rank 1 (rank 3)" in restart and "exited 1 in generation 0" in restart, restart
    assert entries[-1]["detail"] == "SUCCEEDED: every worker of generation 1 exited 0"
    assert entries[1]["detail"] == f"nodes {', '.join(info.nodes)}"

    assert meshgate_main(cluster.cli("show", "flaky", "--timeline")) == 0
    text = capsys.readouterr().out
    print(text)  # the closing note pastes it (pytest -s)
    lines = text.splitlines()
    assert lines[0] == "job flaky: SUCCEEDED" and lines[1].split() == [
        "TIME",
        "(UTC)",
        "SINCE",
        "(s)",
        "GEN",
        "WHAT",
        "NODE",
        "DETAIL",
    ]
    assert len(lines) == 2 + len(entries) + len(early)  # one row per entry
    assert "ranks registered (4)" in lines[6] and "world formed" in lines[7]
    cluster.wait_idle()


def test_only_its_owner_or_an_admin_reads_a_jobs_timeline(cluster, tmp_path):
    alice = cluster.ca.client_tls(issue_cert(cluster.root / "tls", "submitter", "alice"))
    bob = cluster.ca.client_tls(issue_cert(cluster.root / "tls", "submitter", "bob"))
    spec = pb.JobSpec(
        job_id="alices",
        plan=ParallelPlan(dp_shard=2).to_proto(),
        nodes=1,
        command=LIGHT,
        env={"LIGHT_OUT": str(tmp_path)},
    )
    admin.submit_job(cluster.address, spec, tls=alice)
    assert cluster.wait_ended("alices").state == pb.SUCCEEDED, cluster.logs()
    own = admin.get_job_timeline(cluster.address, "alices", tls=alice)
    assert pb.TimelineMoment.Name(own.entries[-1].moment) == "TIMELINE_ENDED"
    assert admin.get_job_timeline(cluster.address, "alices", tls=cluster.admin_tls) == own
    with pytest.raises(RendezvousRefused, match="may not read the timeline of job 'alices'") as refused:
        admin.get_job_timeline(cluster.address, "alices", tls=bob)
    assert refused.value.code.name == "PERMISSION_DENIED"
    with pytest.raises(RendezvousRefused, match="not known") as unknown:
        admin.get_job_timeline(cluster.address, "nope", tls=cluster.admin_tls)
    assert unknown.value.code.name == "NOT_FOUND"
    cluster.wait_idle()


def test_a_cancel_is_logged_as_someones_decision_and_ends_the_timeline(cluster, tmp_path, capsys):
    """Coordinator and agents log a cancel at INFO naming who cancelled it and why, never
    an ERROR "job failed"; its timeline ends CANCELLED with no failure entry."""
    out = tmp_path / "out"
    out.mkdir()
    job = cluster.submit("long", ParallelPlan(dp_shard=2), 1, LIGHT, env={"LIGHT_OUT": str(out), "LIGHT_SLEEP": "120"})
    deadline = time.monotonic() + 60
    while len(list(out.glob("*.json"))) < 2:
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.1)
    pids = [json.loads(p.read_text())["pid"] for p in out.glob("*.json")]
    node = job.nodes[0]
    marks = {n: len(cluster.agent_log(n)) for n in NODES} | {"coordinator": len(cluster.coordinator.log())}
    assert meshgate_main(cluster.cli("cancel", "long", "--reason", "make room")) == 0
    assert meshgate_main(cluster.cli("wait", "long")) == 3
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) or "stopping workers" not in cluster.agent_log(node)[marks[node] :]:
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.1)
    said = {n: cluster.agent_log(n)[marks[n] :] for n in NODES}
    said["coordinator"] = cluster.coordinator.log()[marks["coordinator"] :]
    who = "job cancelled by 'admin:admin': make room"
    assert f"INFO meshgate.coordinator: job long: {who}" in said["coordinator"], said["coordinator"]
    assert f"INFO meshgate.agent: the job is over: job long CANCELLED: {who}" in said[node], said[node]
    for name, text in said.items():
        errors = [line for line in text.splitlines() if " ERROR " in line]
        assert not errors, (name, errors)
    capsys.readouterr()
    assert meshgate_main(cluster.cli("show", "long", "--timeline", "--json")) == 0
    entries = json.loads(capsys.readouterr().out)["entries"]
    assert [e["moment"] for e in entries][-2:] == ["world_formed", "ended"], entries
    assert entries[-1]["detail"] == "CANCELLED: make room"
    cluster.wait_idle()
