"""Jobs and where they run: submissions (an id is never reused; a job no joined nodes
could hold is refused unless it waits for nodes), pages of jobs, and allocation: the
oldest PENDING job first, whole idle nodes kept close together by their locality
labels, no preemption, and why a PENDING job still waits. A job that names its nodes
(``node_ids``: a scheduler such as Slurm chose them, or its submitter did) is not
scheduled: it takes exactly those nodes in that order, ahead of the queue, or is refused
naming each node that cannot serve it and why. Pure: ``now`` is passed in."""

from __future__ import annotations

from itertools import islice
from typing import TYPE_CHECKING, Iterator, Optional

from meshgate.coordinator.cluster_state.events import ClusterEvent, JobAllocated, JobSubmitted
from meshgate.coordinator.cluster_state.quotas import check_quota
from meshgate.coordinator.cluster_state.model import OPERATOR, Allocation, Caller, ClusterNode, Job, JobState
from meshgate.coordinator.rendezvous import Code, RendezvousError, shown

if TYPE_CHECKING:
    from meshgate.coordinator.jobs import ClusterState
    from meshgate.coordinator.jobspec import JobSpec

# Labels that say which nodes sit close together, most local first: allocation keeps a
# job inside one group of the first label when it can.
LOCALITY_LABELS = ("switch", "rack")
# ListJobs pages.
DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE = 100, 1000
# No job asks for more nodes than this (members and spares together): beyond it a
# submission is a mistake (2^32-1 spares), not a job waiting for nodes to join.
MAX_JOB_NODES = 1 << 20


def decide_submit(
    cluster: ClusterState, spec: JobSpec, now: float, caller: Caller = OPERATOR, wait_for_nodes: bool = False
) -> tuple[ClusterEvent, ...]:
    """A job id is unique forever: a finished job's id is never reused. The job
    records its submitter: only they (or an admin) may manage it. A job no set of
    the joined nodes could ever hold is refused, naming what is missing, unless the
    submitter says it waits for nodes that have not joined yet (``wait_for_nodes``)."""
    if spec.job_id in cluster.jobs:
        raise RendezvousError(
            Code.ALREADY_EXISTS,
            f"job_id {spec.job_id!r} exists ({cluster.jobs[spec.job_id].state.value}); a job is immutable "
            "and its id is never reused: submit under a new id",
        )
    if spec.num_nodes + spec.spares > MAX_JOB_NODES:
        raise RendezvousError(
            Code.INVALID_ARGUMENT,
            f"nodes {spec.num_nodes} + spares {spec.spares} is more than a job may ask for ({MAX_JOB_NODES})",
        )
    missing = "" if wait_for_nodes else cluster.missing_for(spec)
    if missing:
        raise RendezvousError(
            Code.FAILED_PRECONDITION,
            f"job {spec.job_id!r} {needs(spec)}, but {missing}: it can never run on the nodes that have "
            "joined. Join nodes that can hold it first, or submit with wait_for_nodes (--wait-for-nodes)",
        )
    if spec.node_ids:
        check_named_nodes(cluster, spec, now)
    check_quota(cluster, spec, caller)  # RESOURCE_EXHAUSTED past a quota of the submitter's
    return (JobSubmitted(spec.job_id, spec.to_json(), now, caller.owner),)


def check_named_nodes(cluster: ClusterState, spec: JobSpec, now: float) -> None:
    """A job naming its nodes is never queued behind other jobs: FAILED_PRECONDITION naming
    every named node that cannot serve it now and why (serving another job; named by
    another job still waiting for it; left the pool, drained or silent), and spares it asks
    for that no other free node could be. A node whose last job's processes are still going
    away (clearing) is no refusal: the job starts there once they are gone. (A node that
    never could serve it, not joined or too small, is missing_for's refusal.)"""
    named_by = {i: job.spec.job_id for job in cluster.pending.values() for i in job.spec.node_ids}
    why = []
    for node_id in spec.node_ids:
        node = cluster.nodes.get(node_id)
        if node is None:  # not joined yet, and the submitter said it waits for nodes
            continue
        if node.job_id:
            why.append(f"node {node_id!r} serves job {node.job_id!r}")
        elif node_id in named_by:
            why.append(f"node {node_id!r} is named by job {named_by[node_id]!r}, waiting for it")
        elif not cluster.is_live(node, now):
            why.append(f"node {node_id!r} has left the pool (drained, or no heartbeat within the timeout)")
    free = [
        n
        for n in cluster.nodes.values()
        if not n.job_id
        and n.node_id not in named_by
        and n.node_id not in spec.node_ids
        and n.slots >= spec.slots_per_node
        and cluster.is_live(n, now)
    ]
    if len(free) < spec.spares:
        why.append(f"spares: {len(free)} other node(s) are free for its {spec.spares}")
    if why:
        raise RendezvousError(
            Code.FAILED_PRECONDITION,
            f"job {spec.job_id!r} names its nodes, and cannot have them now: "
            + "; ".join(why[:8])
            + ("; ..." if len(why) > 8 else "")
            + ". A job naming its nodes takes exactly those nodes and never waits in the queue: "
            "name free nodes (meshgate nodes) and submit again",
        )


def check_may_manage(cluster: ClusterState, job_id: str, caller: Caller, action: str) -> Job:
    """PERMISSION_DENIED naming the job and the caller unless the caller owns the job
    or is an admin."""
    job = cluster.job(job_id)
    if not caller.may_manage(job):
        raise RendezvousError(
            Code.PERMISSION_DENIED,
            f"{caller.describe()} may not {action} job {job_id!r}: only its owner "
            f"{shown(job.owner or '(anonymous)')} or an admin may",
        )
    return job


def list_jobs(
    cluster: ClusterState, start: int, page_size: int, state: Optional[JobState] = None, owner: str = ""
) -> Iterator[tuple[int, Job]]:
    """The jobs of a page, from position ``start`` in submission order, those in ``state``
    and of ``owner`` when given, each with its position; INVALID_ARGUMENT for a page size
    out of range. The reader takes what fits (coordinator/pages.py: in rows and bytes)."""
    if not 0 <= page_size <= MAX_PAGE_SIZE:
        raise RendezvousError(Code.INVALID_ARGUMENT, f"page_size {page_size} is not in [0, {MAX_PAGE_SIZE}]")
    return (
        (position, job)
        for position, job in enumerate(islice(cluster.jobs.values(), start, None), start)
        if (state is None or job.state is state) and (not owner or job.owner == owner)
    )


def decide_allocate(cluster: ClusterState, now: float) -> tuple[ClusterEvent, ...]:
    """Oldest PENDING job first, whole idle nodes, no preemption. A job that does not
    fit holds every node it could ever use (see usable_nodes) for itself: a later job
    may pass it only on nodes it could never use, so passing never delays an earlier
    job's start (and a large job is never starved by small ones), while a job that
    waits for 8-slot nodes does not stop a later one from running on idle 2-slot nodes."""
    events: list[ClusterEvent] = []
    held: set[str] = set()  # allocated in this round, or held for an earlier waiting job
    idle = {n.node_id for n in cluster.idle_nodes(now)}
    # A job naming its nodes is not queued: it goes first (its nodes were checked free
    # when it was submitted; it waits only for their last job's processes to go).
    for job in sorted(cluster.pending.values(), key=lambda j: not j.spec.node_ids):
        if not idle - held:
            break
        allocation = fit(cluster, job.spec, now, held)
        if allocation is None:
            held |= cluster.usable_nodes(job.spec)
            continue
        held.update(allocation.nodes + allocation.spares)
        events.append(JobAllocated(job.spec.job_id, allocation.nodes, allocation.spares, now))
    return tuple(events)


def fit(cluster: ClusterState, spec: JobSpec, now: float, taken: set[str]) -> Optional[Allocation]:
    idle = [n for n in cluster.idle_nodes(now) if n.node_id not in taken and n.slots >= spec.slots_per_node]
    need = spec.num_nodes + spec.spares
    if spec.node_ids:
        by_id = {n.node_id: n for n in idle}
        if any(i not in by_id for i in spec.node_ids):
            return None
        rest = [n for n in idle if n.node_id not in spec.node_ids]
        spares = closest(rest, [by_id[i] for i in spec.node_ids], spec.spares)
        if len(spares) < spec.spares:
            return None
        return Allocation(spec.job_id, spec.node_ids, tuple(n.node_id for n in spares))
    if len(idle) < need:
        return None
    chosen = local_group(idle, need)
    members, spares = chosen[: spec.num_nodes], chosen[spec.num_nodes :]
    return Allocation(spec.job_id, tuple(n.node_id for n in members), tuple(n.node_id for n in spares))


def pending_reason(cluster: ClusterState, job: Job, now: float) -> str:
    """Why a PENDING job waits, e.g. "needs 4 nodes of 8 slots; 3 idle", or that no
    set of the joined nodes can hold it, so only nodes that have not joined can help."""
    spec = job.spec
    need = needs(spec)
    missing = cluster.missing_for(spec)
    if missing:
        return f"{need}, but {missing}: it waits for nodes that have not joined"
    fits = [n for n in cluster.idle_nodes(now) if n.slots >= spec.slots_per_node]
    if spec.node_ids:
        busy = [i for i in spec.node_ids if i not in {n.node_id for n in fits}]
        why = f"{need}: named node(s) not idle yet: {', '.join(busy[:8])}" if busy else need
    else:
        why = f"{need}; {len(fits)} idle"
    clearing = [
        n.node_id
        for n in cluster.nodes.values()
        if not n.job_id and not n.units_clear and cluster.is_live(n, now) and n.slots >= spec.slots_per_node
    ]
    if clearing:  # idle once their agents show every process of their last job gone
        why += f"; {len(clearing)} clearing ({', '.join(clearing[:8])})"
    earlier = None if spec.node_ids else held_for_earlier(cluster, job)
    if earlier is not None:
        why += f"; behind job {earlier.spec.job_id!r} (FIFO)"  # which could use the same nodes
    return why


def held_for_earlier(cluster: ClusterState, job: Job) -> Optional[Job]:
    """The first earlier PENDING job that could use a node ``job`` could use (so that
    node is held for it), or None."""
    mine = cluster.usable_nodes(job.spec)
    for other in cluster.pending.values():
        if other is job:
            return None
        if mine & cluster.usable_nodes(other.spec):
            return other
    return None


def usable_nodes(cluster: ClusterState, spec: JobSpec) -> set[str]:
    """The joined nodes ``spec`` could ever be given: its pinned nodes (and, for spares,
    any node with enough slots), else every node with enough slots."""
    enough = {n.node_id for n in cluster.nodes.values() if n.slots >= spec.slots_per_node}
    if spec.node_ids:
        return (set(spec.node_ids) & enough) | (enough if spec.spares else set())
    return enough


def missing_for(cluster: ClusterState, spec: JobSpec) -> str:
    """What no set of the joined nodes can give ``spec`` (live or not, busy or idle),
    e.g. "only 1 of the 3 joined nodes has 8 slots or more (the most any has is 4)", "only
    3 nodes have joined", "pinned node(s) n9 have not joined"; "" when some set could."""
    nodes = list(cluster.nodes.values())
    slots = spec.slots_per_node
    if spec.node_ids:
        unknown = [i for i in spec.node_ids if i not in cluster.nodes]
        if unknown:
            return f"pinned node(s) {', '.join(unknown[:8])} have not joined"
        small = [i for i in spec.node_ids if cluster.nodes[i].slots < slots]
        if small:
            return (
                "pinned node(s) "
                + ", ".join(f"{i} ({cluster.nodes[i].slots} slots)" for i in small[:8])
                + f" have fewer than {slots} slots"
            )
    enough = sum(1 for n in nodes if n.slots >= slots)
    if enough >= spec.num_nodes + spec.spares:
        return ""
    if enough == len(nodes):
        return f"only {enough} node{'s' * (enough != 1)} {'has' if enough == 1 else 'have'} joined"
    most = max((n.slots for n in nodes), default=0)
    return (
        f"only {enough} of the {len(nodes)} joined node{'s' * (len(nodes) != 1)} "
        f"{'has' if enough == 1 else 'have'} {slots} slots or more (the most any has is {most})"
    )


def needs(spec: JobSpec) -> str:
    """e.g. "needs 4 nodes of 8 slots (+1 spare)"."""
    need = f"needs {spec.num_nodes} node{'s' * (spec.num_nodes != 1)} of {spec.slots_per_node} slots"
    if spec.spares:
        need += f" (+{spec.spares} spare{'s' * (spec.spares != 1)})"
    return need


def locality(node: ClusterNode) -> tuple[str, ...]:
    return tuple(node.labels.get(label, "") for label in LOCALITY_LABELS)


def local_group(idle: list[ClusterNode], need: int) -> list[ClusterNode]:
    """``need`` nodes as close together as the labels allow: the smallest switch group
    that holds them all (then the smallest rack group), else the largest groups first.
    Node-rank order follows (switch, rack, node_id), so neighbours in rank sit together."""
    idle = sorted(idle, key=lambda n: (locality(n), n.node_id))
    for depth in range(len(LOCALITY_LABELS)):
        groups: dict[tuple[str, ...], list[ClusterNode]] = {}
        for node in idle:
            groups.setdefault(locality(node)[depth : depth + 1], []).append(node)
        fitting = [g for key, g in groups.items() if key != ("",) and len(g) >= need]
        if fitting:
            return min(fitting, key=lambda g: (len(g), locality(g[0])))[:need]
    groups = {}
    for node in idle:
        groups.setdefault(locality(node)[:1], []).append(node)
    ordered = sorted(groups.values(), key=lambda g: (-len(g), locality(g[0])))
    return [n for group in ordered for n in group][:need]


def closest(candidates: list[ClusterNode], members: list[ClusterNode], count: int) -> list[ClusterNode]:
    """Spares for a pinned job: those sharing the most locality labels with its nodes."""
    near = {locality(m) for m in members}

    def distance(node: ClusterNode) -> tuple:
        loc = locality(node)
        shared = max(sum(a == b and a != "" for a, b in zip(loc, other)) for other in near) if near else 0
        return (-shared, node.node_id)

    return sorted(candidates, key=distance)[:count]
