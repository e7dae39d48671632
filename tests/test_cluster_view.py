"""The cluster view: `meshgate nodes` (the pool: state, slots, job, last seen, labels) and
`meshgate status` with no job (jobs and nodes by state, the queue with each waiting job's
reason). The read model and the renderers on their own (no sockets), then a real jobs-mode
coordinator with three real agents under mTLS, through the CLI.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import pytest

import meshgate
from meshgate import admin, views
from meshgate.wire import WIRE_VERSION
from meshgate.cli import main as meshgate_main
from meshgate.coordinator.hardware import HardwareBook
from meshgate.client import RendezvousRefused
from meshgate.coordinator import readmodel
from meshgate.coordinator.jobs import ClusterState, JobState
from meshgate.coordinator.rendezvous import Code, RendezvousError
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb
from test_jobs import joined, spec
from test_jobs_cluster import LIGHT, NODES, cluster  # noqa: F401  (the module's real cluster)

# ---- the read model and the renderers (no sockets) -----------------------------------------------


@dataclass
class StateOnly:
    """What readmodel reads of a ClusterCoordinator for the cluster view: its state, its
    clock, the jobs its config declares and their engines (none open here), the versions
    and hardware its nodes' agents sent."""

    state: ClusterState
    now: float = 10.0
    declared: dict = field(default_factory=dict)
    engines: dict = field(default_factory=dict)
    node_versions: dict = field(default_factory=dict)  # each agent's versions (none called here)
    hardware: HardwareBook = field(default_factory=HardwareBook)  # each node's hardware (none sent here)

    def clock(self) -> float:
        return self.now


def four_nodes_two_jobs() -> StateOnly:
    state = ClusterState(heartbeat_timeout_s=15.0)
    for node_id in ("n3", "n0", "n2", "n1"):  # joined out of order: listed by node id
        joined(state, node_id, now=1.0, rack="r1" if node_id < "n2" else "r2")
    state.apply_all(state.decide_submit(spec("run", num_nodes=2), 2.0))
    state.apply_all(state.decide_allocate(2.0))
    state.apply_all(state.decide_submit(spec("big", ParallelPlan(dp_shard=8), num_nodes=4), 3.0))
    state.apply_all(state.decide_submit(spec("small", ParallelPlan(dp_shard=2), num_nodes=1), 4.0))
    state.apply_all(state.decide_allocate(4.0))
    state.leave("n3")
    return StateOnly(state)


def test_nodes_are_listed_in_node_id_order_page_by_page_with_their_pool_state():
    coordinator = four_nodes_two_jobs()
    first = readmodel.node_list(coordinator, pb.ListNodesRequest(page_size=3))
    assert [n.node_id for n in first.nodes] == ["n0", "n1", "n2"] and first.total == 4 and first.next_page_token
    rest = readmodel.node_list(coordinator, pb.ListNodesRequest(page_size=3, page_token=first.next_page_token))
    assert [n.node_id for n in rest.nodes] == ["n3"] and not rest.next_page_token
    by_id = {n.node_id: n for n in list(first.nodes) + list(rest.nodes)}
    run_nodes = set(coordinator.state.jobs["run"].nodes)
    for node_id, node in by_id.items():
        expected = "serving" if node_id in run_nodes else ("left" if node_id == "n3" else "idle")
        assert views.pool_node_dict(node, 10.0)["state"] == expected, node
    shown = views.pool_node_dict(by_id["n0"], 10.0)
    assert shown["slots"] == 2 and shown["slot_kind"] == "cpu" and shown["labels"] == {"rack": "r1"}
    assert shown["last_seen_age_s"] == 9.0  # joined at 1.0, looked at 10.0
    # every node at once with the default page; a page that is exactly the rest has no token
    assert len(readmodel.node_list(coordinator, pb.ListNodesRequest()).nodes) == 4
    assert not readmodel.node_list(coordinator, pb.ListNodesRequest(page_size=4)).next_page_token


@pytest.mark.parametrize(
    "request_, message",
    [
        (pb.ListNodesRequest(page_size=1001), "page_size 1001 is not in [0, 1000]"),
        (pb.ListNodesRequest(page_token="bogus"), "page_token 'bogus' is not a NodeList.next_page_token"),
        (pb.ListNodesRequest(page_token=readmodel.page_token(2)), "is not a NodeList.next_page_token"),
    ],
)
def test_a_bad_page_is_invalid_argument_naming_the_field(request_, message):
    with pytest.raises(RendezvousError) as refused:
        readmodel.node_list(four_nodes_two_jobs(), request_)
    assert refused.value.code is Code.INVALID_ARGUMENT and message in refused.value.message


def test_a_nodes_token_is_not_a_jobs_token_and_the_jobs_token_still_reads():
    token = readmodel.node_list(four_nodes_two_jobs(), pb.ListNodesRequest(page_size=1)).next_page_token
    with pytest.raises(RendezvousError, match="JobList.next_page_token"):
        readmodel.page_start(token)
    assert readmodel.page_start(readmodel.page_token(7)) == 7


def test_the_cluster_counts_jobs_and_nodes_by_state_and_says_why_each_queued_job_waits():
    coordinator = four_nodes_two_jobs()
    reply = readmodel.cluster_status(coordinator)
    jobs = {pb.JobState.Name(c.state): c.count for c in reply.jobs}
    assert jobs == {"PENDING": 2, "RUNNING": 1, "SUCCEEDED": 0, "FAILED": 0, "CANCELLED": 0}
    data = views.cluster_dict(reply, "c:1", 10.0)
    assert data["nodes"] == {
        "idle": 1,
        "serving": 2,
        "clearing": 0,
        "left": 1,
        "cordoned": 0,
        "quarantined": 0,
        "unhealthy": 0,
        "draining": 0,
    }
    assert [q["job_id"] for q in data["queue"]] == ["big", "small"] and data["queue_more"] == 0
    state = coordinator.state
    assert [q["reason"] for q in data["queue"]] == [state.pending_reason(state.jobs[j], 10.0) for j in ("big", "small")]
    assert "needs 4 nodes of 2 slots" in data["queue"][0]["reason"]
    # small fits on the idle node, but big has it reserved, from a time nobody knows
    assert "behind job 'big' (first in line): n0, n1, n2, n3 reserved for it" in data["queue"][1]["reason"]
    assert data["queue"][0]["waiting_s"] == 7.0 and reply.declared_job_id == ""
    text = views.render_cluster(data)
    assert "jobs:   pending 2  running 1  succeeded 0  failed 0  cancelled 0" in text
    assert (
        "nodes:  idle 1  serving 2  clearing 0  left 1  cordoned 0  quarantined 0  unhealthy 0  draining 0  (4 in all"
        in text
    )
    assert "queue (2 pending, oldest first):" in text and "behind job 'big' (first in line)" in text
    # a config that declares one job says which, so `meshgate status` shows that job
    assert readmodel.cluster_status(StateOnly(state, declared={"train": object()})).declared_job_id == "train"


def test_the_queue_shown_is_bounded_and_says_how_many_more_wait():
    state = ClusterState()
    for i in range(readmodel.MAX_QUEUE_SHOWN + 5):
        state.apply_all(state.decide_submit(spec(f"j{i:03d}", num_nodes=1), float(i), wait_for_nodes=True))
    reply = readmodel.cluster_status(StateOnly(state, now=500.0))
    assert len(reply.queue) == readmodel.MAX_QUEUE_SHOWN and reply.queue_more == 5
    assert reply.queue[0].job_id == "j000"  # oldest first
    assert "... and 5 more pending" in views.render_cluster(views.cluster_dict(reply, "c:1", 500.0))
    assert [c.count for c in reply.jobs if c.state == pb.PENDING] == [readmodel.MAX_QUEUE_SHOWN + 5]
    assert JobState.PENDING.value == "PENDING"


def test_the_nodes_table_shows_each_column_and_bounds_itself():
    nodes = [
        views.pool_node_dict(
            pb.PoolNode(
                node_id="n0",
                state=pb.POOL_STATE_SERVING,
                slots=8,
                slot_kind="gpu",
                job_id="A",
                labels={"b": "2", "a": "1"},
            ),
            0.0,
        )
    ]
    text = views.render_nodes(nodes, total=3)
    header, row, more = text.splitlines()
    assert header.split() == ["NODE", "STATE", "SLOTS", "JOB", "LAST", "SEEN", "LABELS", "HELD", "AGENT", "HARDWARE"]
    assert row.split() == ["n0", "serving", "8", "gpu", "A", "-", "a=1,b=2", "-", "-", "-"]
    assert more == "... and 2 more nodes (--limit 0 lists all)"
    assert views.render_nodes([], total=0).startswith("no node has joined the pool")


# ---- a real coordinator and real agents, through the CLI -----------------------------------------


def _connection(running) -> list[str]:
    return running.cli("x")[2:]  # the admin connection flags of `meshgate job x ...`


def _nodes_json(running, capsys) -> dict:
    assert meshgate_main(["nodes", "--json", *_connection(running)]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_nodes_and_the_cluster_status_from_a_real_cluster(cluster, tmp_path, capsys):  # noqa: F811 (the fixture imported above)
    capsys.readouterr()
    listed = _nodes_json(cluster, capsys)
    assert listed["total"] == 3 and [n["node_id"] for n in listed["nodes"]] == list(NODES)
    assert {n["node_id"]: n["state"] for n in listed["nodes"]} == dict.fromkeys(NODES, "idle")
    assert {n["node_id"]: n["labels"] for n in listed["nodes"]} == {
        "n0": {"switch": "s1"},
        "n1": {"switch": "s1"},
        "n2": {"switch": "s2"},
    }
    assert all((n["slots"], n["slot_kind"], n["job_id"]) == (2, "cpu", None) for n in listed["nodes"])
    assert all(0 <= n["last_seen_age_s"] < 30 for n in listed["nodes"])

    # one job holds every node, a second waits for one: serving, and a reason in the queue
    out = tmp_path / "out"
    out.mkdir()
    cluster.submit("hold", ParallelPlan(dp_shard=6), 3, LIGHT, env={"LIGHT_OUT": str(out), "LIGHT_SLEEP": "120"})
    cluster.submit("waits", ParallelPlan(dp_shard=2), 1, LIGHT, env={"LIGHT_OUT": str(out)})
    try:
        listed = _nodes_json(cluster, capsys)
        assert {n["node_id"]: (n["state"], n["job_id"]) for n in listed["nodes"]} == dict.fromkeys(
            NODES, ("serving", "hold")
        )
        assert meshgate_main(["nodes", "--limit", "2", *_connection(cluster)]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert [line.split()[:2] for line in lines[1:3]] == [["n0", "serving"], ["n1", "serving"]]
        assert lines[1].split()[4] == "hold" and "switch=s1  -  " in lines[1]
        # the agents' versions, then their hardware (each simulated host its own machine-id)
        assert f"  {meshgate.__version__} (wire {WIRE_VERSION})  0 GPU, " in lines[1], lines[1]
        assert lines[1].rstrip().endswith(" NIC") and "shared" not in lines[1], lines[1]
        assert lines[3] == "... and 1 more nodes (--limit 0 lists all)"

        reason = cluster.job("waits").reason
        assert "needs 1 node of 2 slots; 0 idle" in reason
        assert meshgate_main(["status", *_connection(cluster)]) == 0
        text = capsys.readouterr().out
        assert "jobs:   pending 1  running 1" in text and "serving 3" in text and "(3 in all" in text
        assert "queue (1 pending, oldest first):" in text and reason in text
        assert meshgate_main(["status", "--json", *_connection(cluster)]) == 0
        data = json.loads(capsys.readouterr().out)
        assert (data["jobs"]["PENDING"], data["jobs"]["RUNNING"]) == (1, 1)
        assert data["nodes"] == {
            "idle": 0,
            "serving": 3,
            "clearing": 0,
            "left": 0,
            "cordoned": 0,
            "quarantined": 0,
            "unhealthy": 0,
            "draining": 0,
        }
        assert [(q["job_id"], q["reason"]) for q in data["queue"]] == [("waits", reason)]
        # GetStatus with no job on a config that declares none says where to look
        with pytest.raises(RendezvousRefused) as refused:
            admin.get_status(cluster.address, "", tls=cluster.admin_tls)
        assert refused.value.code.name == "INVALID_ARGUMENT" and "declares no job" in refused.value.details
        assert "meshgate status --job ID" in refused.value.details
        # --job still shows that job's rendezvous
        assert meshgate_main(["status", "--job", "hold", *_connection(cluster)]) == 0
        assert "job hold  generation" in capsys.readouterr().out

        # a refused page names the field and its (bounded) value, and changes nothing
        for kwargs, message in (
            ({"page_token": "x" * 500}, "page_token 'xxxx"),
            ({"page_size": 5000}, "page_size 5000 is not in [0, 1000]"),
        ):
            with pytest.raises(RendezvousRefused) as refused:
                admin.list_nodes(cluster.address, tls=cluster.admin_tls, **kwargs)
            assert refused.value.code.name == "INVALID_ARGUMENT" and message in refused.value.details
            assert len(refused.value.details) < 400
        page = admin.list_nodes(cluster.address, tls=cluster.admin_tls, page_size=2)
        rest = admin.list_nodes(cluster.address, tls=cluster.admin_tls, page_token=page.next_page_token)
        assert [n.node_id for n in list(page.nodes) + list(rest.nodes)] == list(NODES) and not rest.next_page_token

        # operator information: an agent's certificate is refused both views
        agent_tls = cluster.ca.client_tls(cluster.ca.agent("n0"))
        for call in (admin.list_nodes, admin.get_cluster):
            with pytest.raises(RendezvousRefused) as refused:
                call(cluster.address, tls=agent_tls)
            assert refused.value.code.name == "PERMISSION_DENIED", refused.value
    finally:
        for job_id in ("waits", "hold"):
            try:
                admin.cancel_job(cluster.address, job_id, "test over", tls=cluster.admin_tls)
            except RendezvousRefused:
                pass  # it ended already
    cluster.wait_idle(timeout=60)
    deadline = time.monotonic() + 30
    while {n["state"] for n in _nodes_json(cluster, capsys)["nodes"]} != {"idle"}:
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.2)
    assert meshgate_main(["status", "--json", *_connection(cluster)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["jobs"]["CANCELLED"] == 2 and data["queue"] == [] and data["nodes"]["idle"] == 3
