"""Jobs and where they run: submissions (an id is never reused; a job no joined nodes
could hold is refused unless it waits for nodes), pages of jobs, allocation (backfill.py:
oldest PENDING job first, whole idle nodes kept close together by their locality labels,
no preemption, a reservation for the head of the queue that later jobs never delay) and
why a PENDING job still waits. A job that names its nodes (``node_ids``: a scheduler such
as Slurm chose them, or its submitter did) takes exactly those nodes in that order, under
the same rules: when they are idle and not reserved for an earlier job, or it waits. It
is refused only naming a node that never could serve it. Pure: ``now`` is passed in."""

from __future__ import annotations

from meshgate.words import counted

from itertools import islice
from typing import TYPE_CHECKING, Iterator, Optional

from meshgate.coordinator.cluster_state.events import ClusterEvent, JobAllocated, JobSubmitted
from meshgate.coordinator.cluster_state.backfill import NEVER, Plan, fit, schedule, span
from meshgate.coordinator.cluster_state.model import OPERATOR, Caller, Job, JobState
from meshgate.coordinator.cluster_state.quotas import check_quota
from meshgate.coordinator.rendezvous import Code, RendezvousError, shown

if TYPE_CHECKING:
    from meshgate.coordinator.jobs import ClusterState
    from meshgate.coordinator.jobspec import JobSpec

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
    if cluster.taken(spec.job_id):
        known = cluster.jobs.get(spec.job_id)
        raise RendezvousError(
            Code.ALREADY_EXISTS,
            f"job_id {spec.job_id!r} exists ({known.state.value if known else 'ended, forgotten since'}); a job "
            "is immutable and its id is never reused: submit under a new id",
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
    check_quota(cluster, spec, caller)  # RESOURCE_EXHAUSTED past a quota of the submitter's
    return (JobSubmitted(spec.job_id, spec.to_json(), now, caller.owner),)


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
    """The jobs of a page, from the ``start``-th submitted (Job.seq: a forgotten job leaves
    a gap, never a shift) in submission order, those in ``state`` and of ``owner`` when
    given, each with its seq; INVALID_ARGUMENT for a page size out of range. The reader
    takes what fits (coordinator/pages.py: in rows and bytes)."""
    if not 0 <= page_size <= MAX_PAGE_SIZE:
        raise RendezvousError(Code.INVALID_ARGUMENT, f"page_size {page_size} is not in [0, {MAX_PAGE_SIZE}]")
    kept = cluster.jobs.values()
    # jobs are forgotten oldest-ended first, so a job's place among those kept is at most
    # its seq: start the scan there, not at the first job
    skip = max(0, min(start - len(cluster.forgotten), len(kept)))
    return (
        (job.seq, job)
        for job in islice(kept, skip, None)
        if job.seq >= start and (state is None or job.state is state) and (not owner or job.owner == owner)
    )


def decide_allocate(cluster: ClusterState, now: float) -> tuple[ClusterEvent, ...]:
    """The PENDING jobs that start now (see backfill.py): oldest first, whole idle nodes,
    no preemption; a later job passes a waiting one only where that cannot delay it."""
    return tuple(JobAllocated(a.job_id, a.nodes, a.spares, now) for a in schedule(cluster, now).allocations)


def pending_reason(cluster: ClusterState, job: Job, now: float, plan: Optional[Plan] = None) -> str:
    """Why a PENDING job waits, e.g. "needs 4 nodes of 8 slots; 3 idle; first in line: n0,
    n1, n2, n3 reserved for it from in ~25m, when job 'a' reaches its time limit", "needs 1
    node of 8 slots; 3 idle; behind job 'big' (first in line): ...", or that
    no set of the joined nodes can hold it (it waits for nodes to join, holding none)."""
    spec = job.spec
    need = needs(spec)
    missing = cluster.missing_for(spec)
    if missing:
        return f"{need}, but {missing}: it waits for nodes that have not joined, and holds no nodes meanwhile"
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
    plan = plan if plan is not None else schedule(cluster, now, upto=job)
    quota = plan.running.holds(job)
    if quota:
        return f"{why}; {quota}: it starts once enough of them end, and holds no node meanwhile"
    return why + held_by(cluster, job, now, plan)


def held_by(cluster: ClusterState, job: Job, now: float, plan: Optional[Plan] = None) -> str:
    """What the queue does to ``job``: it is first in line, with nodes reserved for it; or
    it would start on idle nodes reserved for the job first in line, which its time limit
    (or its lack of one) would delay; or it waits for nodes, some of them reserved for the
    job first in line (so it starts after that one); or nothing (""). ``plan``: the pass
    stopped just before ``job`` (QueueReasons carries one), else one is made; either way
    ``job`` is placed on it, as the pass would."""
    plan = plan if plan is not None else schedule(cluster, now, upto=job)
    head = plan.reservation
    if plan.place(job) is not None:
        return ""  # it starts at the next allocation pass
    if head is None:
        return f"; first in line: {plan.reservation.describe(now)}"  # type: ignore[union-attr]
    if fit(job.spec, plan.usable(job.spec, reserved_too=True)) is None:  # it does not fit either way
        wanted = set(job.spec.node_ids) or {n for n in head.nodes if cluster.nodes[n].slots >= job.spec.slots_per_node}
        shared = sorted(head.nodes & wanted)
        return f"; after job {head.job_id!r} (first in line: {', '.join(shared[:8])} reserved for it)" if shared else ""
    why = f"; behind job {head.job_id!r} (first in line): {head.describe(now)}"
    if now < head.start < NEVER:
        why += f"; a time limit of {span(head.start - now)} or less would start it now"
    elif head.start == NEVER:
        why += ", a time nobody knows: no job may start on them before"
    return why


class QueueReasons:
    """The pending reasons of many PENDING jobs asked in submission order (a page of
    ListJobs, the cluster's queue) from one allocation pass carried from job to job: the
    pass before a job is the pass before the one asked last plus the place of every job
    between (a job that does not fit changes nothing but the first reservation). One pass
    per page, not one per row (a page of 100 waiting jobs on 1,000 nodes held the loop for
    0.38 s). A job asked out of order gets a pass of its own (pending_reason)."""

    def __init__(self, cluster: ClusterState, now: float) -> None:
        self.cluster, self.now = cluster, now
        self.plan = Plan(cluster, now, {n.node_id: n for n in cluster.idle_nodes(now)})
        self.ahead = iter(list(cluster.pending.values()))
        self.passed: set[str] = set()

    def reason(self, job: Job) -> str:
        if job.spec.job_id in self.passed or job.spec.job_id not in self.cluster.pending:
            return pending_reason(self.cluster, job, self.now)
        for other in self.ahead:
            self.passed.add(other.spec.job_id)
            if other is job:
                break
            if not self.cluster.missing_for(other.spec):  # one that can never start holds nothing
                self.plan.place(other)
        return pending_reason(self.cluster, job, self.now, self.plan)


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
                + ", ".join(f"{i} ({counted(cluster.nodes[i].slots, 'slot')})" for i in small[:8])
                + f" have fewer than {counted(slots, 'slot')}"
            )
    enough = sum(1 for n in nodes if n.slots >= slots)
    if enough >= spec.num_nodes + spec.spares:
        return ""
    if enough == len(nodes):
        return f"only {enough} node{'s' * (enough != 1)} {'has' if enough == 1 else 'have'} joined"
    most = max((n.slots for n in nodes), default=0)
    return (
        f"only {enough} of the {len(nodes)} joined node{'s' * (len(nodes) != 1)} "
        f"{'has' if enough == 1 else 'have'} {counted(slots, 'slot')} or more (the most any has is {most})"
    )


def needs(spec: JobSpec) -> str:
    """e.g. "needs 4 nodes of 8 slots (+1 spare)"."""
    need = f"needs {counted(spec.num_nodes, 'node')} of {counted(spec.slots_per_node, 'slot')}"
    if spec.spares:
        need += f" (+{spec.spares} spare{'s' * (spec.spares != 1)})"
    return need
