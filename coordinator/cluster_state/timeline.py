"""A job's timeline: the cluster's moments of it (submitted, allocated, ended, its own log
pruned: from the cluster's log, kept on the Job) around what its rendezvous came to
(coordinator/rendezvous/timeline.py, folded from the job's own log). Pure."""

from __future__ import annotations

import dataclasses
from meshgate.words import counted

from typing import Optional, Sequence

from meshgate.coordinator.cluster_state.model import Job
from meshgate.coordinator.rendezvous.timeline import Entry, Moment


def cluster_entries(
    job: Job, generation: int = 0, pruned_why: str = "after the retention"
) -> tuple[list[Entry], list[Entry]]:
    """(before, after): the moments that open a job's timeline, and those that close it
    (``generation``: the one its rendezvous ended in; ``pruned_why``: ends.why_pruned)."""
    spec = job.spec
    if job.declared:
        before = [Entry(Moment.SUBMITTED, job.submitted_at, detail="declared by the coordinator's config")]
    else:
        what = f"{spec.plan.describe()}, {counted(spec.num_nodes, 'node')} of {counted(spec.slots_per_node, 'slot')}"
        before = [Entry(Moment.SUBMITTED, job.submitted_at, detail=f"by {job.owner or '(anonymous)'}: {what}")]
    if job.allocated_at:
        spares = f"; spares {', '.join(job.spares)}" if job.spares else ""
        before.append(Entry(Moment.ALLOCATED, job.allocated_at, detail=f"nodes {', '.join(job.nodes)}{spares}"))
    after = []
    if job.state.ended:
        ended = f"{job.state.value}: {job.reason}".rstrip(": ")
        after.append(Entry(Moment.ENDED, job.ended_at, generation, ended))
    if job.log_pruned:
        pruned = f"its own log was deleted {pruned_why}"
        after.append(Entry(Moment.LOG_PRUNED, job.pruned_at, generation, pruned))
    return before, after


def job_timeline(
    job: Job, rendezvous: Optional[Sequence[Entry]], pruned_why: str = "after the retention"
) -> list[Entry]:
    """Every entry of ``job``'s timeline in order: the cluster's opening moments, its
    rendezvous entries (None: its own log is not read, e.g. pruned), the closing ones.
    Sorted by time, stable: a moment of the cluster and one of the rendezvous with one
    time keep that order (allocated before the nodes it admitted)."""
    before, after = cluster_entries(job, max((e.generation for e in rendezvous or ()), default=0), pruned_why)
    entries = sorted(before + list(rendezvous or ()) + after + node_moments(job), key=lambda e: e.at)
    generation = 0  # a cluster moment of a node happened in the generation of the entries before it
    for i, entry in enumerate(entries):
        if entry.generation < 0:
            entries[i] = dataclasses.replace(entry, generation=generation)
        generation = entries[i].generation
    return entries


def node_moments(job: Job) -> list[Entry]:
    """What the cluster did to the nodes serving ``job`` (cordoned, uncordoned, quarantined,
    drained, given from the pool), as node entries; their generation is filled in by place."""
    return [Entry(Moment.NODE_CHANGED, at, -1, what, node_id) for at, node_id, what in job.moments]


__all__ = ["cluster_entries", "job_timeline", "node_moments"]
