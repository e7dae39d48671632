"""How each event changes the cluster's state: one handler per event type, in a table.
``ClusterState.apply`` looks the handler up by the event's type (tests check that every
type in CLUSTER_EVENT_TYPES has one)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from meshgate.coordinator.jobspec import JobSpec
from meshgate.coordinator.cluster_state.admission import cordon_text
from meshgate.coordinator.cluster_state.events import (
    ClusterNodeJoined,
    JobAllocated,
    JobEnded,
    JobLogPruned,
    JobReplacementGiven,
    JobSubmitted,
    JobSummarized,
    NodeCordoned,
    NodeDrained,
    NodeFailureCounted,
    NodeQuarantined,
    NodeQuarantineLifted,
    NodeUncordoned,
)
from meshgate.coordinator.cluster_state.model import ClusterNode, Job, JobState
from meshgate.coordinator.rendezvous import Token, TokenCreated

if TYPE_CHECKING:
    from meshgate.coordinator.jobs import ClusterState


def node_joined(cluster: ClusterState, event: ClusterNodeJoined) -> None:
    known = cluster.nodes.get(event.node_id)
    node = ClusterNode(
        event.node_id,
        event.hostname,
        event.slots,
        event.slot_kind,
        dict(event.labels),
        event.credential_hash,
        bytes.fromhex(event.public_key),
        event.at,
        event.at,
        job_id=event.job_id or (known.job_id if known else ""),
        units_clear=known.units_clear if known else True,
    )
    if known is not None:  # what the cluster and its agent decided of it stays
        node.cordon, node.quarantine, node.failures = known.cordon, known.quarantine, known.failures
        node.unhealthy, node.drained_from = known.unhealthy, known.drained_from
        node.joined_at, node.last_seen = known.joined_at, max(known.last_seen, event.at)
    cluster.nodes[event.node_id] = node
    if event.token_hash:
        cluster.tokens[event.token_hash].used_by = event.node_id


def token_created(cluster: ClusterState, event: TokenCreated) -> None:
    cluster.tokens[event.token_hash] = Token(event.expires_at, event.node_id)


def job_submitted(cluster: ClusterState, event: JobSubmitted) -> None:
    spec = JobSpec.from_json(event.spec)
    if event.declared and event.job_id in cluster.jobs:  # a restart whose [launch] changed
        cluster.jobs[event.job_id].spec = spec
        return
    seq, cluster.submitted = cluster.submitted, cluster.submitted + 1
    if not event.declared:
        cluster.jobs[event.job_id] = cluster.pending[event.job_id] = Job(spec, event.at, owner=event.owner, seq=seq)
    else:
        cluster.jobs[event.job_id] = Job(spec, event.at, JobState.RUNNING, owner=event.owner, declared=True, seq=seq)


def job_allocated(cluster: ClusterState, event: JobAllocated) -> None:
    job = cluster.jobs[event.job_id]
    cluster.pending.pop(event.job_id, None)
    job.state = JobState.RUNNING
    job.nodes, job.spares, job.allocated_at = event.nodes, event.spares, event.at
    for node_id in job.nodes + job.spares:
        cluster.nodes[node_id].job_id = event.job_id


def job_ended(cluster: ClusterState, event: JobEnded) -> None:
    job = cluster.jobs[event.job_id]
    cluster.pending.pop(event.job_id, None)
    job.state, job.reason, job.ended_at = event.state, event.reason, event.at
    for node_id in job.given:
        if cluster.nodes[node_id].job_id == event.job_id:
            # Back to the pool once its agent shows the job's unit empty (note_units).
            cluster.nodes[node_id].job_id, cluster.nodes[node_id].units_clear = "", False


def job_summarized(cluster: ClusterState, event: JobSummarized) -> None:
    job = cluster.unpruned[event.job_id] = cluster.jobs[event.job_id]
    job.summary = event.status


def job_log_pruned(cluster: ClusterState, event: JobLogPruned) -> None:
    """Its log is gone; and the oldest pruned jobs are forgotten while more than
    ``ended_jobs_kept`` ended jobs are kept (a rule of the apply, not an event: replaying
    the log under the same setting forgets the same jobs, and the memory stays bounded
    while the log replays)."""
    job = cluster.pruned[event.job_id] = cluster.jobs[event.job_id]
    cluster.unpruned.pop(event.job_id, None)
    job.log_pruned, job.pruned_at = True, event.at
    while cluster.pruned and len(cluster.unpruned) + len(cluster.pruned) > cluster.ended_jobs_kept:
        oldest = cluster.pruned.pop(next(iter(cluster.pruned)))
        del cluster.jobs[oldest.spec.job_id]
        cluster.forgotten.add(oldest)


def job_replacement_given(cluster: ClusterState, event: JobReplacementGiven) -> None:
    job = cluster.jobs[event.job_id]
    job.replacements += ((event.node_id, event.lost_id, event.at),)
    cluster.nodes[event.node_id].job_id = event.job_id
    near = f" ({event.why})" if event.why else ""
    note_moment(cluster, event.node_id, event.at, f"given from the pool to take the block of {event.lost_id!r}{near}")


# How many failures a node keeps: enough for any quarantine_after an operator sets.
MAX_COUNTED_FAILURES = 64
# How many of the cluster's moments a job's timeline keeps (cordons, quarantines, nodes given).
MAX_MOMENTS = 64


def note_moment(cluster: ClusterState, node_id: str, at: float, what: str) -> None:
    """What the cluster did to ``node_id``, on the timeline of the job it serves (if any)."""
    job = cluster.jobs.get(cluster.nodes[node_id].job_id)
    if job is not None:
        job.moments = (job.moments + ((at, node_id, what),))[-MAX_MOMENTS:]


def node_cordoned(cluster: ClusterState, event: NodeCordoned) -> None:
    cluster.nodes[event.node_id].cordon = cordon_text(event.by, event.reason)
    cluster.nodes[event.node_id].uncordon_asked = None  # cordoned again: the operator's latest word holds
    note_moment(cluster, event.node_id, event.at, f"cordoned {cluster.nodes[event.node_id].cordon}")


def node_drained(cluster: ClusterState, event: NodeDrained) -> None:
    node = cluster.nodes[event.node_id]
    node.cordon, node.uncordon_asked = cordon_text(event.by, event.reason), None
    if event.job_id:
        note_moment(cluster, event.node_id, event.at, f"drained {node.cordon}: its part goes to a replacement")
        node.drained_from = event.job_id
        if node.job_id == event.job_id:  # out of the job; idle (cordoned) once its processes are gone
            node.job_id, node.units_clear = "", False
    else:
        note_moment(cluster, event.node_id, event.at, f"cordoned {node.cordon}")


def node_uncordoned(cluster: ClusterState, event: NodeUncordoned) -> None:
    node = cluster.nodes[event.node_id]
    node.cordon, node.quarantine, node.failures, node.drained_from = "", "", (), ""
    node.uncordon_asked = None
    note_moment(cluster, event.node_id, event.at, f"uncordoned by {event.by or '(anonymous)'}")


def node_failure_counted(cluster: ClusterState, event: NodeFailureCounted) -> None:
    node = cluster.nodes[event.node_id]
    node.failures = (node.failures + ((event.at, event.reason),))[-MAX_COUNTED_FAILURES:]


def node_quarantined(cluster: ClusterState, event: NodeQuarantined) -> None:
    cluster.nodes[event.node_id].quarantine = event.reason
    note_moment(cluster, event.node_id, event.at, f"quarantined: {event.reason}")


def node_quarantine_lifted(cluster: ClusterState, event: NodeQuarantineLifted) -> None:
    node = cluster.nodes[event.node_id]
    node.quarantine, node.failures = "", ()
    note_moment(cluster, event.node_id, event.at, f"quarantine lifted: {event.reason}")


HANDLERS: dict[type, Callable] = {
    ClusterNodeJoined: node_joined,
    TokenCreated: token_created,
    JobSubmitted: job_submitted,
    JobAllocated: job_allocated,
    JobEnded: job_ended,
    JobSummarized: job_summarized,
    JobLogPruned: job_log_pruned,
    NodeCordoned: node_cordoned,
    NodeUncordoned: node_uncordoned,
    NodeFailureCounted: node_failure_counted,
    NodeQuarantined: node_quarantined,
    NodeQuarantineLifted: node_quarantine_lifted,
    JobReplacementGiven: job_replacement_given,
    NodeDrained: node_drained,
}
