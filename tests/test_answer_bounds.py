"""No servicer can produce an answer the client refuses (issue 31, item 3): a job's answer
(GetJob, GetStatus, its summary in the cluster's log, a row of ListJobs) carries its nodes
only up to a byte budget, and says how many it left out, whatever the job's size. gRPC's
clients refuse an answer over 4 MiB; without the bounds, GetJob of the job below (8,000
nodes with the longest ids and host names allowed) weighed 6.2 MB.

In process: the ClusterCoordinator with real joins and a real job engine."""

from __future__ import annotations

import asyncio

from test_job_lifecycle_cost import Clock, cluster_over, config_for
from meshgate.coordinator import readmodel
from meshgate.coordinator.jobs import JobSpec
from meshgate.coordinator.pages import MAX_NODE_NAMES_BYTES, MAX_STATUS_NODES_BYTES, bound_repeated
from meshgate.coordinator.store import MemoryStore
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb
from meshgate.views import job_dict, render_job

GRPC_DEFAULT_MAX_RECEIVE = 4 << 20
NODES = 8000


def node_id(i: int) -> str:
    return f"{i:06d}-" + "n" * 240  # check_id allows 253 characters


def test_bound_repeated_cuts_the_last_rows_and_shares_one_budget_in_order():
    info = pb.JobInfo(nodes=["a" * 94] * 5, spare_nodes=["b" * 94] * 5)
    assert bound_repeated(info.nodes, info.spare_nodes, budget=450) == 6  # 4 x (94 + 6) fit
    assert (len(info.nodes), len(info.spare_nodes)) == (4, 0)
    info = pb.JobInfo(nodes=["a" * 94] * 2, spare_nodes=["b" * 94] * 5)
    assert bound_repeated(info.nodes, info.spare_nodes, budget=450) == 3
    assert (len(info.nodes), len(info.spare_nodes)) == (2, 2)
    status = pb.Status(nodes=[pb.NodeStatus(node_id="x" * 10)] * 3)
    assert bound_repeated(status.nodes, budget=10**6) == 0 and len(status.nodes) == 3


def test_a_huge_jobs_answers_stay_under_their_budgets_and_say_what_they_left_out(tmp_path):
    async def scenario():
        cluster = cluster_over(config_for(tmp_path), MemoryStore(), Clock())
        for i in range(NODES):
            token, _ = await cluster.pool.create_join_token(600, node_id(i))
            await cluster.pool.join(node_id(i), "h" * 250, 1, "cpu", {}, token, public_key=bytes(32))
        spec = JobSpec.build(job_id="huge", plan=ParallelPlan(dp_shard=NODES), num_nodes=NODES, mode="claimed")
        job = await cluster.submit(spec)
        assert len(job.nodes) == NODES

        info = readmodel.job_info(cluster, job)
        assert info.ByteSize() < GRPC_DEFAULT_MAX_RECEIVE // 2
        names = sum(len(n) + 6 for n in info.nodes)
        assert names <= MAX_NODE_NAMES_BYTES and info.nodes_more == NODES - len(info.nodes) > 0
        assert list(info.nodes) == list(job.nodes[: len(info.nodes)])  # the first ones, in node rank order
        status = info.status
        assert sum(n.ByteSize() + 6 for n in status.nodes) <= MAX_STATUS_NODES_BYTES
        assert status.nodes_more == NODES - len(status.nodes) > 0
        assert status.world_size == NODES  # what is counted is whole; only the rows are cut
        assert readmodel.named_status(cluster, "huge").nodes_more == status.nodes_more
        page = readmodel.job_list(cluster, pb.ListJobsRequest(), readmodel.OPERATOR)
        assert page.ByteSize() < GRPC_DEFAULT_MAX_RECEIVE and page.jobs[0].nodes_more == info.nodes_more

        shown = render_job(job_dict(info, "coordinator"))
        assert f"and {info.nodes_more} more;" in shown
        assert f"... and {status.nodes_more} more nodes the coordinator left out" in shown

        await cluster.cancel("huge", "enough")  # its summary, kept in the cluster's log, is bounded too
        (summary,) = [e for e in cluster.store.events if type(e).__name__ == "JobSummarized"]
        assert len(summary.status) < 2 * MAX_STATUS_NODES_BYTES  # base64 of at most ~1 MiB of nodes
        kept = readmodel.job_info(cluster, cluster.state.job("huge")).status
        assert kept.nodes_more > 0 and len(kept.nodes) + kept.nodes_more == NODES
        cluster.close()

    asyncio.run(scenario())
