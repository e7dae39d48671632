"""Nodes held out of allocation, on real processes (issue #30): a coordinator with mTLS and
an agent as shipped (tests/shipped.py). The fault is a file the node's health check reads
(deterministic: the check fails exactly while it exists), and a job whose worker exits 1."""

from __future__ import annotations

import grpc
import pytest

import shipped
from meshgate import admin
from meshgate.connection import RendezvousRefused
from meshgate.plan import ParallelPlan
from meshgate.tls import issue_cert
from meshgate.v1 import rendezvous_pb2 as pb
from shipped import ShippedCluster
from test_containment import wait_for

pytestmark = pytest.mark.slow

shipped_host = shipped.shipped_host

CHECK = 'if [ -e "$0" ]; then echo "disk probe failed: $0 exists"; exit 1; fi; echo healthy'


def node(cluster: ShippedCluster, node_id: str = "n0") -> pb.PoolNode:
    (found,) = [n for n in admin.list_nodes(cluster.address, tls=cluster.admin_tls).nodes if n.node_id == node_id]
    return found


def submit(cluster: ShippedCluster, job_id: str, command: list[str], max_restarts: int = 0):
    spec = pb.JobSpec(
        job_id=job_id, plan=ParallelPlan(dp_shard=1).to_proto(), nodes=1, command=command, max_restarts=max_restarts
    )
    spec.restart_policy = pb.RESTART_POLICY_ON_FAILURE
    return admin.submit_job(cluster.address, spec, tls=cluster.admin_tls)


@pytest.fixture(scope="module")
def cluster(shipped_host):
    with ShippedCluster(shipped_host, ("n0",), start=False, tls=True) as running:
        flags = running.root / "flags"
        flags.mkdir()
        flags.chmod(0o777)  # the failing job's worker (the job user) breaks the node by writing here
        yield running


def test_a_failing_check_holds_the_node_until_it_passes_and_a_failed_job_is_followed_by_a_check(cluster):
    flag = cluster.root / "flags" / "broken"
    flag.touch()
    health = {"command": ["/bin/sh", "-c", CHECK, str(flag)], "timeout_s": 10, "interval_s": 0.5}
    cluster.start_agent("n0", extra={"health_check": health})
    shown = node(cluster)
    assert shown.state == pb.POOL_STATE_UNHEALTHY and "disk probe failed" in shown.unhealthy, shown
    submit(cluster, "waits", ["/bin/true"])
    status = admin.get_cluster(cluster.address, tls=cluster.admin_tls)
    assert [h.node_id for h in status.held] == ["n0"] and "disk probe failed" in status.held[0].unhealthy
    for _ in range(3):  # several periodic checks later, still never allocated
        assert cluster.job("waits").state == pb.PENDING
        __import__("time").sleep(0.7)
    flag.unlink()
    assert cluster.wait_ended("waits").state == pb.SUCCEEDED
    # A job whose worker breaks the node and fails: the check after it runs before the node
    # is back in the pool, so the job queued behind it never gets the node while it fails.
    submit(cluster, "breaks", ["/bin/sh", "-c", f"touch {flag}; exit 1"])
    submit(cluster, "next", ["/bin/true"])
    assert cluster.wait_ended("breaks").state == pb.FAILED
    wait_for(lambda: node(cluster).state not in (pb.POOL_STATE_SERVING, pb.POOL_STATE_CLEARING), 30, cluster.logs)
    shown = node(cluster)
    assert "disk probe failed" in shown.unhealthy and cluster.job("next").state == pb.PENDING, shown
    flag.unlink()
    assert cluster.wait_ended("next").state == pb.SUCCEEDED
    assert node(cluster).unhealthy == "" and node(cluster).quarantined == ""


def test_cordon_is_admin_only_shown_and_survives_a_restart_and_repeat_failures_quarantine(cluster):
    cluster.agents["n0"].stop()
    cluster.start_agent("n0")  # no health check: only an uncordon returns a quarantined node
    wait_for(lambda: node(cluster).state == pb.POOL_STATE_IDLE, 30, cluster.logs)
    alice = cluster.ca.client_tls(issue_cert(cluster.root / "tls", "submitter", "alice"))
    with pytest.raises(RendezvousRefused) as refused:
        admin.cordon_node(cluster.address, "n0", "bad DIMM", tls=alice)
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED and "alice" in str(refused.value)
    with pytest.raises(RendezvousRefused) as unknown:
        admin.cordon_node(cluster.address, "ghost", "x", tls=cluster.admin_tls)
    assert unknown.value.code == grpc.StatusCode.NOT_FOUND and "ghost" in str(unknown.value)
    cordoned = admin.cordon_node(cluster.address, "n0", "bad DIMM", tls=cluster.admin_tls)
    assert cordoned.state == pb.POOL_STATE_CORDONED and cordoned.cordoned == "by admin:admin: bad DIMM"
    cluster.coordinator.restart()
    submit(cluster, "held", ["/bin/true"])
    wait_for(lambda: node(cluster).state == pb.POOL_STATE_CORDONED, 30, cluster.logs)
    assert "bad DIMM" in node(cluster).cordoned and cluster.job("held").state == pb.PENDING
    admin.cordon_node(cluster.address, "n0", "", uncordon=True, tls=cluster.admin_tls)
    assert cluster.wait_ended("held").state == pb.SUCCEEDED
    # A job's own failures (exit 3, three times) never count against the node ...
    submit(cluster, "fails", ["/bin/sh", "-c", "exit 3"], max_restarts=2)
    assert cluster.wait_ended("fails").state == pb.FAILED
    assert node(cluster).failures == 0 and not node(cluster).quarantined, node(cluster)
    # ... three crashes (SIGBUS: two restarts, then the failure) within the hour quarantine it.
    submit(cluster, "crashes", ["/bin/sh", "-c", "kill -BUS $$"], max_restarts=2)
    assert cluster.wait_ended("crashes").state == pb.FAILED
    shown = node(cluster)
    assert shown.quarantined and "quarantine_after = 3" in shown.quarantined and shown.failures == 3, shown
    cluster.coordinator.restart()
    submit(cluster, "after", ["/bin/true"])
    wait_for(lambda: node(cluster).state == pb.POOL_STATE_QUARANTINED, 30, cluster.logs)
    assert cluster.job("after").state == pb.PENDING
    admin.cordon_node(cluster.address, "n0", "", uncordon=True, tls=cluster.admin_tls)
    assert cluster.wait_ended("after").state == pb.SUCCEEDED
    # the quarantine is an entry of the timeline of the job whose crashes brought it
    entries = admin.get_job_timeline(cluster.address, "crashes", tls=cluster.admin_tls).entries
    quarantined = [e for e in entries if e.node_id == "n0" and e.detail.startswith("quarantined: 3 failures")]
    assert quarantined and "quarantine_after = 3" in quarantined[0].detail, entries


def test_a_quarantined_node_returns_once_its_health_check_passes_without_an_uncordon(cluster):
    submit(cluster, "crashes-again", ["/bin/sh", "-c", "kill -BUS $$"], max_restarts=2)
    assert cluster.wait_ended("crashes-again").state == pb.FAILED
    wait_for(lambda: node(cluster).state == pb.POOL_STATE_QUARANTINED, 30, cluster.logs)
    submit(cluster, "after-check", ["/bin/true"])
    flag = cluster.root / "flags" / "broken"
    flag.unlink(missing_ok=True)  # the check passes
    cluster.agents["n0"].stop()
    health = {"command": ["/bin/sh", "-c", CHECK, str(flag)], "timeout_s": 10, "interval_s": 0.5}
    cluster.start_agent("n0", extra={"health_check": health})
    assert cluster.wait_ended("after-check").state == pb.SUCCEEDED
    shown = node(cluster)
    assert not shown.quarantined and shown.failures == 0 and not shown.cordoned, shown


def test_an_uncordon_returns_a_checked_node_only_after_a_check_run_since_passes(cluster):
    flag = cluster.root / "flags" / "broken"
    flag.unlink(missing_ok=True)
    cluster.agents["n0"].stop()
    # interval_s of an hour: every check after the first is one the coordinator asked for
    health = {"command": ["/bin/sh", "-c", CHECK, str(flag)], "timeout_s": 10, "interval_s": 3600}
    cluster.start_agent("n0", extra={"health_check": health})
    wait_for(lambda: node(cluster).state == pb.POOL_STATE_IDLE, 30, cluster.logs)
    admin.cordon_node(cluster.address, "n0", "replacing a DIMM", tls=cluster.admin_tls)
    flag.touch()  # the repair did not take: the check the node passed before its cordon says nothing
    asked = admin.cordon_node(cluster.address, "n0", "", uncordon=True, tls=cluster.admin_tls)
    assert asked.state == pb.POOL_STATE_CORDONED and asked.uncordon_asked == "by admin:admin", asked
    submit(cluster, "after-repair", ["/bin/true"])
    wait_for(lambda: "disk probe failed" in node(cluster).unhealthy, 30, cluster.logs)  # asked at once, not in an hour
    shown = node(cluster)
    assert shown.state == pb.POOL_STATE_CORDONED and shown.uncordon_asked, shown
    assert cluster.job("after-repair").state == pb.PENDING
    flag.unlink()  # repaired: the next asked check passes and returns it
    assert cluster.wait_ended("after-repair").state == pb.SUCCEEDED
    shown = node(cluster)
    assert not shown.cordoned and not shown.uncordon_asked and not shown.unhealthy, shown
