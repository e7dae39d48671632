"""Which PENDING jobs start now, and what holds the others: backfill, with Slurm's
backfill scheduler as the anchor. One pass over the queue in submission order:

- A job no set of the joined nodes could hold (accepted with wait_for_nodes) is passed
  over: it holds no node and no reservation until nodes that can hold it join.
- A job that fits on the idle nodes open to it starts: whole nodes, kept close together
  by their locality labels; a job naming its nodes takes exactly those, in its order.
- The first job that does not fit (the head of the queue) gets a reservation: the nodes
  it will start on, and when they are expected free. A busy node is free when its job
  reaches its time limit (allocated + time_limit_s), a clearing node as soon as its last
  job's processes are gone; a node whose job has no time limit, or one that left the
  pool, at a time nobody knows (never, for planning).
- A later job starts ahead of the head only where that cannot delay it: on idle nodes
  outside the reservation, or on reserved ones when its own time limit ends by the
  reserved start (so never while that start is not known). A later job that does not
  fit waits and holds nothing.
- A job past its submitter's running quota (quotas.RunningUse) waits and holds nothing:
  it is not the head, so it holds back no other submitter's job.

One reservation, the head's: when the head starts, the next waiting job is the head, so
no job waits for ever behind later ones, and no waiting job holds idle nodes it does not
need. The plan is made afresh from the state on every pass (a reservation is never
stored): the coordinator ends a job past its time limit, so a reserved start computed
from time limits holds. Pure: ``now`` is passed in."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from meshgate.coordinator.cluster_state.model import Allocation, ClusterNode, Job
from meshgate.coordinator.cluster_state.quotas import RunningUse

if TYPE_CHECKING:
    from meshgate.coordinator.jobs import ClusterState
    from meshgate.coordinator.jobspec import JobSpec

# Labels that say which nodes sit close together, most local first: allocation keeps a
# job inside one group of the first label when it can.
LOCALITY_LABELS = ("switch", "rack")
# What each place of ``locality`` is called: the NVLink domain is discovered (agent/inventory.py),
# never a label an operator writes (a hand-written label repeats across racks: torchcomms#3612).
LOCALITY = ("NVLink domain", *LOCALITY_LABELS)
# When a node running a job without a time limit (or one that left) is expected free.
NEVER = math.inf


@dataclass(frozen=True)
class Reservation:
    """The nodes the head of the queue will start on, and when they are expected free
    (``start``; NEVER: not known), set by ``until`` (e.g. "job 'a' reaches its time limit")."""

    job_id: str
    nodes: frozenset[str]
    start: float
    until: str

    def admits(self, spec: JobSpec, now: float) -> bool:
        """A job of ``spec`` started now on a reserved node gives it back by the reserved
        start. None may while that start is not known: it could come before the job ends."""
        return bool(spec.time_limit_s) and now + spec.time_limit_s <= self.start < NEVER

    def describe(self, now: float) -> str:
        """e.g. "n0, n1, n2 reserved for it from in ~25m, when job 'a' reaches its time limit"."""
        shown = ", ".join(sorted(self.nodes)[:8]) + (", ..." if len(self.nodes) > 8 else "")
        if self.start == NEVER:
            return f"{shown} reserved for it from when {self.until}"
        if self.start <= now:
            return f"{shown} reserved for it, to start as soon as {self.until}"
        return f"{shown} reserved for it from in ~{span(self.start - now)}, when {self.until}"


@dataclass
class Plan:
    """One pass over the queue: the allocations made so far, the idle nodes still open,
    the nodes given in this pass (with when each is expected free, and to which job) and
    the head's reservation once there is a head."""

    cluster: ClusterState
    now: float
    open: dict[str, ClusterNode]
    given: dict[str, tuple[float, str]] = field(default_factory=dict)
    allocations: list[Allocation] = field(default_factory=list)
    reservation: Optional[Reservation] = None
    running: RunningUse = field(init=False)  # the submitters' running jobs, for their running quotas

    def __post_init__(self) -> None:
        self.running = RunningUse(self.cluster)

    def usable(self, spec: JobSpec, reserved_too: bool = False) -> list[ClusterNode]:
        """The open nodes ``spec`` may start on now: with its slots, and outside the
        reservation unless its time limit gives them back in time (``reserved_too``: as
        if nothing were reserved)."""
        r = self.reservation
        anywhere = reserved_too or r is None or r.admits(spec, self.now)
        return [
            n
            for n in self.open.values()
            if n.slots >= spec.slots_per_node and (anywhere or n.node_id not in r.nodes)  # type: ignore[union-attr]
        ]

    def place(self, job: Job) -> Optional[Allocation]:
        """Start ``job`` on open nodes if it fits; else, if no job is the head yet, it is.
        A job its submitter's running quota holds is neither: it waits, holding nothing."""
        spec = job.spec
        if self.running.holds(job):
            return None
        allocation = fit(spec, self.usable(spec))
        if allocation is None:
            if self.reservation is None:
                self.reservation = self.reserve(spec)
            return None
        end = self.now + spec.time_limit_s if spec.time_limit_s else NEVER
        for node_id in allocation.nodes + allocation.spares:
            del self.open[node_id]
            self.given[node_id] = (end, spec.job_id)
        self.allocations.append(allocation)
        self.running.started(job)
        return allocation

    def reserve(self, spec: JobSpec) -> Reservation:
        """The nodes ``spec`` starts on soonest: its named nodes (and the spares free
        soonest), else the nodes with its slots that are free soonest; the start is when
        the last of them is free. (missing_for was checked: the joined nodes can hold it.)"""
        free = {n.node_id: self.free_at(n) for n in self.cluster.nodes.values() if n.slots >= spec.slots_per_node}
        named = [i for i in spec.node_ids if i in free]
        # soonest first; at one time an idle node before one still clearing (sure before likely)
        others = sorted((i for i in free if i not in spec.node_ids), key=lambda i: (free[i][0], i not in self.open, i))
        chosen = named + others[: spec.spares if spec.node_ids else spec.num_nodes + spec.spares]
        last = max(chosen, key=lambda i: (free[i][0], i not in self.open), default="")  # an open node sets nothing
        start, until = free[last] if last else (NEVER, "nodes join")
        return Reservation(spec.job_id, frozenset(chosen), start, until)

    def free_at(self, node: ClusterNode) -> tuple[float, str]:
        """When ``node`` is expected free, and what sets that time."""
        if node.node_id in self.open:
            return self.now, "now"
        if node.node_id in self.given:
            end, job_id = self.given[node.node_id]
        elif node.job_id:
            job_id, job = node.job_id, self.cluster.jobs.get(node.job_id)
            limit = job.spec.time_limit_s if job is not None else 0.0
            # (one past its limit is ended by the next tick: free now, for planning)
            end = max(job.allocated_at + limit, self.now) if job is not None and limit else NEVER
        elif not self.cluster.is_live(node, self.now):
            return NEVER, f"node {node.node_id!r} is back in the pool (it left: drained, or no heartbeat)"
        else:  # clearing: idle once its agent shows its last job's processes gone
            return self.now, f"node {node.node_id!r} has cleared its last job's processes"
        return end, f"job {job_id!r} " + ("reaches its time limit" if end < NEVER else "ends (it has no time limit)")


def schedule(cluster: ClusterState, now: float, upto: Optional[Job] = None) -> Plan:
    """The allocation pass over the PENDING jobs, oldest first; with ``upto``: stopped
    just before that job, to say what holds it. A pass stops once no idle node is open
    and the head is known (with no node open, the next job that could start is the head)."""
    plan = Plan(cluster, now, {n.node_id: n for n in cluster.idle_nodes(now)})
    for job in cluster.pending.values():
        if job is upto or (not plan.open and plan.reservation is not None):
            break
        if not cluster.missing_for(job.spec):  # one that can never start holds nothing
            plan.place(job)
    return plan


def fit(spec: JobSpec, usable: list[ClusterNode]) -> Optional[Allocation]:
    """Whole nodes of ``usable`` for ``spec``, or None: its named nodes in its order (and
    the nearest spares), else a group kept close by locality."""
    need = spec.num_nodes + spec.spares
    if spec.node_ids:
        by_id = {n.node_id: n for n in usable}
        if any(i not in by_id for i in spec.node_ids):
            return None
        rest = [n for n in usable if n.node_id not in spec.node_ids]
        spares = closest(rest, [by_id[i] for i in spec.node_ids], spec.spares)
        if len(spares) < spec.spares:
            return None
        return Allocation(spec.job_id, spec.node_ids, tuple(n.node_id for n in spares))
    if len(usable) < need:
        return None
    chosen = local_group(usable, need)
    members, spares = chosen[: spec.num_nodes], chosen[spec.num_nodes :]
    return Allocation(spec.job_id, tuple(n.node_id for n in members), tuple(n.node_id for n in spares))


def span(seconds: float) -> str:
    """A duration as a reason reads it: "40s", "25m", "2h", "1.5h", "3d"."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size or (seconds >= size and seconds % size == 0):
            return f"{round(seconds / size, 1):g}{unit}"
    return f"{seconds:.0f}s"


def locality(node: ClusterNode) -> tuple[str, ...]:
    """Where the node sits, innermost first (LOCALITY): its discovered NVLink domain, then
    its switch and rack labels; "" where unknown."""
    return (node.nvlink_domain, *(node.labels.get(label, "") for label in LOCALITY_LABELS))


def local_group(idle: list[ClusterNode], need: int) -> list[ClusterNode]:
    """``need`` nodes as close together as their localities allow: the smallest NVLink
    domain that holds them all (then switch group, then rack group), else the largest
    groups first. Node-rank order follows (domain, switch, rack, node_id), so neighbours
    in rank sit together."""
    idle = sorted(idle, key=lambda n: (locality(n), n.node_id))
    for depth in range(len(LOCALITY)):
        groups: dict[tuple[str, ...], list[ClusterNode]] = {}
        for node in idle:
            groups.setdefault(locality(node)[depth : depth + 1], []).append(node)
        fitting = [g for key, g in groups.items() if key != ("",) and len(g) >= need]
        if fitting:
            return min(fitting, key=lambda g: (len(g), locality(g[0])))[:need]
    groups = {}
    for node in idle:  # by domain and switch: by switch alone where no domain is known
        groups.setdefault(locality(node)[:2], []).append(node)
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
