"""Views that tell the truth while a node fails (issue #30, item 6): a real grpc.aio server
over mTLS in front of a jobs-mode ClusterCoordinator (test_node_calls.py's), a clock the
test moves, and the CLI's renderings of what the Admin calls answer. A node silent past one
heartbeat interval and its tolerance is a suspect in `job show`, `meshgate nodes` and the
timeline before it is lost; once lost, `meshgate nodes` says so as `job show` does."""

from __future__ import annotations

import time

from meshgate.v1 import nodes_pb2
from meshgate.v1 import rendezvous_pb2 as pb
from meshgate.views import (
    node_dict,
    pool_node_dict,
    render_nodes,
    render_timeline,
    timeline_dict,
)
from test_node_calls import TIMEOUT_S, env  # noqa: F401  (env: the fixture)

SUSPECT_AFTER = TIMEOUT_S / 2  # no heartbeat interval given to this cluster: half the timeout


async def views(env):  # noqa: F811  the fixture's name, imported above
    job = await env.admin.GetJob(pb.GetJobRequest(job_id="A"))
    nodes = await env.admin.ListNodes(pb.ListNodesRequest())
    timeline = await env.admin.GetJobTimeline(pb.GetJobTimelineRequest(job_id="A"))
    now = time.time()
    in_job = {n.node_id: node_dict(n, now) for n in job.status.nodes}
    pool = {n.node_id: pool_node_dict(n, now) for n in nodes.nodes}
    return in_job, pool, nodes, timeline


async def test_a_silent_node_is_a_suspect_in_every_view_then_lost_in_every_view(env):  # noqa: F811  the fixture
    credential = env.credentials["n0"]
    await env.nodes["n0"].Join(
        nodes_pb2.JoinRequest(
            job_id="A", node_id="n0", hostname="n0", slots=2, slot_kind="cpu", node_credential=credential
        )
    )
    await env.nodes["n0"].NodeHeartbeat(
        nodes_pb2.NodeHeartbeatRequest(job_id="A", node_id="n0", node_credential=credential)
    )
    env.clock.now += 1.0  # heard in time
    in_job, pool, _, timeline = await views(env)
    assert in_job["n0"]["state"] == "active" and in_job["n0"]["silent_s"] is None, in_job
    assert (pool["n0"]["state"], pool["n0"]["job_node_state"], pool["n0"]["silent_s"]) == ("serving", "active", None)
    assert "silent" not in render_timeline(timeline_dict(timeline))

    env.clock.now += SUSPECT_AFTER  # silent 1 + 7.5 s: a suspect, not lost yet
    assert await env.cluster.engine("A").sweep_lost() == ()
    in_job, pool, nodes, timeline = await views(env)
    assert in_job["n0"]["state"] == "active" and in_job["n0"]["silent_s"] == SUSPECT_AFTER + 1.0, in_job
    assert pool["n0"]["silent_s"] == SUSPECT_AFTER + 1.0 and pool["n0"]["job_node_state"] == "active", pool
    assert "serving, silent 8s" in render_nodes(list(pool.values()), nodes.total)
    shown = render_timeline(timeline_dict(timeline))
    assert "silent 8s (suspect" in shown and "n0" in shown, shown

    env.clock.now += TIMEOUT_S  # past heartbeat_misses: lost
    lost = await env.cluster.engine("A").sweep_lost()
    assert lost, "n0 was not declared lost"
    in_job, pool, nodes, timeline = await views(env)
    assert in_job["n0"]["state"] == "lost" and in_job["n0"]["silent_s"] is None, in_job
    assert pool["n0"]["job_node_state"] == "lost", pool  # `meshgate nodes` and `job show` agree
    assert "serving: lost" in render_nodes(list(pool.values()), nodes.total)
