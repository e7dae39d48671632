"""Replacement from the pool (issue #30): a running job's block whose node was lost or left,
with no spare of the job standing by, is given an idle node of the pool, the nearest to the
node it replaces: the same NVLink domain (as its agent discovered it), else the same
switch, else the same rack, else any. The node must be one a new
job could get (pool.idle_nodes: no job, its last job's processes gone, heard in time, not
cordoned, quarantined or failing its check) and not reserved for the head of the queue
(backfill.py), with the job's slots. Every other rank stays where it was; the loss already
ended the generation, and the node given takes the block in the one that follows it.

A job that names its nodes (``node_ids``: a scheduler such as Slurm chose them) is never
given another: it waits for its own node, as before. Where nothing fits, the job waits (up
to its lost_node_timeout_s) and says why (``waiting_reason``). Pure: ``now`` is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

from meshgate.coordinator.cluster_state.backfill import LOCALITY, locality, schedule
from meshgate.coordinator.cluster_state.events import ClusterEvent, JobReplacementGiven
from meshgate.coordinator.cluster_state.model import ClusterNode, Job, JobState

if TYPE_CHECKING:
    from meshgate.coordinator.jobs import ClusterState


@dataclass(frozen=True)
class Vacancy:
    """A block of a running job that waits for a node: ``lost_id`` held node_rank
    ``node_rank`` until it was lost or left, ``since`` then (its engine's lost_since)."""

    job_id: str
    lost_id: str
    node_rank: int
    since: float
    how: str = "lost"  # its NodeState's value: lost, or left


def nearness(lost: Optional[ClusterNode], node: ClusterNode) -> tuple[int, str]:
    """How close ``node`` sits to ``lost``: (0, "same NVLink domain d/1"), (1, "same switch
    s1"), (2, "same rack r1"), or (len(LOCALITY), "") for none (a node of unknown place is
    near nothing)."""
    if lost is not None:
        for depth, (name, value, other) in enumerate(zip(LOCALITY, locality(lost), locality(node))):
            if value and other == value:
                return depth, f"same {name} {value}"
    return len(LOCALITY), ""


def choose(lost: Optional[ClusterNode], candidates: Iterable[ClusterNode]) -> Optional[ClusterNode]:
    """The candidate nearest ``lost`` (same NVLink domain, then switch, then rack, then
    any), by node id among equals; None when there is none."""
    return min(candidates, key=lambda n: (nearness(lost, n)[0], n.node_id), default=None)


def open_nodes(cluster: ClusterState, now: float) -> dict[str, ClusterNode]:
    """The idle nodes a replacement may take: those a new job could get, less the ones
    reserved for the head of the queue (a replacement must never delay it)."""
    reservation = schedule(cluster, now).reservation
    reserved = reservation.nodes if reservation is not None else frozenset()
    return {n.node_id: n for n in cluster.idle_nodes(now) if n.node_id not in reserved}


def replaceable(job: Optional[Job]) -> bool:
    """A job the pool gives nodes to: running, allocated by the cluster (a declared job's
    nodes join it themselves), not naming its own nodes."""
    return job is not None and job.state is JobState.RUNNING and not job.declared and not job.spec.node_ids


def given_for(job: Job, vacancy: Vacancy) -> str:
    """The node already given for this loss of the block ("" none): one node per loss. (Its
    engine admits it just after the cluster's log holds it; a pass in between, on another
    call, still sees the block waiting and must not give it a second node.)"""
    return next((node for node, lost, at in job.replacements if lost == vacancy.lost_id and at >= vacancy.since), "")


def decide_replacements(cluster: ClusterState, vacancies: Sequence[Vacancy], now: float) -> tuple[ClusterEvent, ...]:
    """A node of the pool for each vacancy that one fits, the nearest first; vacancies in
    the order given (the caller's: jobs in submission order, blocks by node rank)."""
    if not vacancies:
        return ()
    open_ = open_nodes(cluster, now)
    events: list[ClusterEvent] = []
    for vacancy in vacancies:
        job = cluster.jobs.get(vacancy.job_id)
        if not replaceable(job) or given_for(job, vacancy):  # type: ignore[arg-type]
            continue
        lost = cluster.nodes.get(vacancy.lost_id)
        fits = [n for n in open_.values() if n.slots >= job.spec.slots_per_node]  # type: ignore[union-attr]
        chosen = choose(lost, fits)
        if chosen is None:
            continue
        del open_[chosen.node_id]
        why = nearness(lost, chosen)[1]
        events.append(JobReplacementGiven(vacancy.job_id, chosen.node_id, vacancy.lost_id, now, why))
    return tuple(events)


def waiting_reason(cluster: ClusterState, job: Job, vacancies: Sequence[Vacancy], timeout_s: float, now: float) -> str:
    """Why a running job's blocks still wait, e.g. "waiting for a node: node 'n1'
    (node_rank 1) lost 4s ago; no idle node of the pool with 2 slots can take it (n3
    cordoned); n2 reserved for job 'big' (first in line); it fails if none comes within
    lost_node_timeout_s=60 (56s left)"; "" when none waits."""
    vacancies = [v for v in vacancies if not given_for(job, v)]  # taken as soon as its engine admits it
    if not vacancies:
        return ""
    why, parts = why_none_fits(cluster, job, now), []
    for vacancy in vacancies[:4]:
        head = f"node {vacancy.lost_id!r} (node_rank {vacancy.node_rank}) {vacancy.how} {now - vacancy.since:.0f}s ago"
        left = max(timeout_s - (now - vacancy.since), 0.0)
        parts.append(
            f"{head}; {why}; it fails if none comes within lost_node_timeout_s={timeout_s:g} ({left:.0f}s left)"
        )
    more = f"; and {len(vacancies) - 4} more blocks" if len(vacancies) > 4 else ""
    return "waiting for a node: " + "; ".join(parts) + more


def why_none_fits(cluster: ClusterState, job: Job, now: float) -> str:
    """What keeps the pool's nodes from ``job``'s waiting block: the nodes with its slots
    that are not idle, each with its pool state, and the idle ones reserved for the head."""
    if job.spec.node_ids:
        return "the job names its nodes (node_ids): it waits for its own node to come back"
    slots = job.spec.slots_per_node
    if any(n.slots >= slots for n in open_nodes(cluster, now).values()):  # the next pass gives one
        return f"an idle node with {slots} slots is given at the next pass"
    idle = {n.node_id for n in cluster.idle_nodes(now)}
    held = [
        f"{n.node_id} {cluster.pool_state(n, now).value}"
        for n in sorted(cluster.nodes.values(), key=lambda n: n.node_id)
        if not n.job_id and n.slots >= slots and n.node_id not in idle
    ]
    why = f"no idle node of the pool with {slots} slots can take it"
    if held:
        why += f" ({', '.join(held[:8])}{', ...' if len(held) > 8 else ''})"
    reservation = schedule(cluster, now).reservation
    reserved = sorted(idle & reservation.nodes) if reservation is not None else []
    if reserved:
        why += f"; {', '.join(reserved[:8])} reserved for job {reservation.job_id!r} (first in line)"  # type: ignore[union-attr]
    return why


__all__ = ["Vacancy", "choose", "decide_replacements", "nearness", "open_nodes", "replaceable", "waiting_reason"]
