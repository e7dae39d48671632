"""What the servicers and the CLI read: protobuf views of a job's rendezvous and of the
cluster's jobs, built from the state in one place, so no servicer walks internal state."""

from __future__ import annotations

from meshgate.coordinator.cluster import ClusterCoordinator
from meshgate.coordinator.engine import Coordinator
from meshgate.coordinator.jobs import Job, JobSpec, JobState
from meshgate.coordinator.rendezvous import compress_ranks
from meshgate.metrics import CoordinatorGauges
from meshgate.v1 import rendezvous_pb2

NODE_STATES = ("active", "spare", "lost", "left", "replaced")


def _stamp(field, seconds: float) -> None:
    field.FromNanoseconds(int(seconds * 1e9))


def status(engine: Coordinator) -> rendezvous_pb2.Status:
    """One job's rendezvous: generation, ranks held and missing, nodes, exits, failure."""
    state, config = engine.state, engine.config
    reply = rendezvous_pb2.Status(
        job_id=config.job_id,
        generation=state.generation,
        plan=config.plan.to_proto(),
        plan_digest=config.plan.digest(),
        world_size=state.world_size,
        registered=len(state.by_rank),
        missing_ranks=compress_ranks(state.missing_ranks()),
        failure=state.failed,
    )
    if state.opened_at:
        _stamp(reply.opened_at, state.opened_at)
    if state.job_master:
        reply.master_addr, reply.master_port = state.job_master
    for node in sorted(state.nodes.values(), key=lambda n: n.node_rank):
        entry = reply.nodes.add(
            node_id=node.node_id,
            node_rank=node.node_rank,
            state=node.state,
            first_rank=max(node.node_rank, 0) * config.slots_per_node,
            slots=config.slots_per_node,
            registered=node.registered,
            hostname=node.hostname,
            slot_kind=node.slot_kind,
            exits=node.exits,
        )
        _stamp(entry.last_seen, node.last_seen)
    return reply


def spec_message(spec: JobSpec) -> rendezvous_pb2.JobSpec:
    return rendezvous_pb2.JobSpec(
        job_id=spec.job_id,
        plan=spec.plan.to_proto(),
        nodes=spec.num_nodes,
        node_ids=list(spec.node_ids),
        slots_per_node=spec.slots_per_node,
        mode=spec.mode.value,
        topology_policy=spec.topology_policy,
        spares=spec.spares,
        command=list(spec.command),
        env=dict(spec.env),
        restart_policy=spec.restart_policy,
        max_restarts=spec.max_restarts,
        lost_node_timeout_s=spec.lost_node_timeout_s,
    )


def job_info(cluster: ClusterCoordinator, job: Job, with_status: bool = True) -> rendezvous_pb2.JobInfo:
    """A job as `job show` prints it; PENDING says what it waits for."""
    reason = job.reason
    if job.state is JobState.PENDING:
        reason = cluster.state.pending_reason(job, cluster.clock())
    reply = rendezvous_pb2.JobInfo(
        spec=spec_message(job.spec),
        plan_digest=job.spec.plan.digest(),
        state=rendezvous_pb2.JobState.Value(job.state.value),
        reason=reason,
        nodes=list(job.nodes),
        spare_nodes=list(job.spares),
    )
    _stamp(reply.submitted_at, job.submitted_at)
    if job.ended_at:
        _stamp(reply.ended_at, job.ended_at)
    if with_status and job.nodes:
        reply.status.CopyFrom(status(cluster.engine(job.spec.job_id)))
    return reply


def gauges(target: "Coordinator | ClusterCoordinator | None") -> "CoordinatorGauges | None":
    """What /metrics shows: a single-job coordinator's rendezvous, or the cluster's jobs
    and nodes by state; None on a standby."""
    if isinstance(target, ClusterCoordinator):
        state, now = target.state, target.clock()
        jobs = {s.value: 0.0 for s in JobState}
        for job in list(state.jobs.values()):
            jobs[job.state.value] += 1
        nodes = {"idle": float(len(state.idle_nodes(now))),
                 "serving": float(sum(1 for n in list(state.nodes.values()) if n.job_id)),
                 # between jobs, until a heartbeat shows its containment units empty
                 "clearing": float(sum(1 for n in list(state.nodes.values()) if not n.job_id and not n.units_clear))}
        return CoordinatorGauges(nodes=nodes, jobs=jobs)
    if isinstance(target, Coordinator):
        state = target.state
        nodes = {s: 0.0 for s in NODE_STATES}
        for node in list(state.nodes.values()):
            nodes[node.state] = nodes.get(node.state, 0.0) + 1
        return CoordinatorGauges(
            ranks_registered=len(state.by_rank), ranks_expected=state.world_size,
            generation=state.generation, opened_at=state.opened_at, nodes=nodes,
        )
    return None


__all__ = ["gauges", "job_info", "spec_message", "status"]
