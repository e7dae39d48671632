"""What the cluster's state is made of: job and pool states, callers, nodes, jobs and
allocations. Data only."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshgate.coordinator.rendezvous import shown

if TYPE_CHECKING:
    from meshgate.coordinator.jobspec import JobSpec


class JobState(enum.Enum):
    """PENDING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED (PENDING -> CANCELLED too)."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def ended(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


class PoolState(enum.Enum):
    """A node of the cluster's pool. IDLE: heartbeating, no job, its last job's processes
    gone (allocation gives only these); SERVING: given to a job, as a member or a spare;
    CLEARING: its job ended, and it is IDLE once its agent's heartbeat shows that job's
    processes gone; LEFT: drained, or silent past the heartbeat timeout, until it calls
    again. CORDONED, QUARANTINED, UNHEALTHY: what would be IDLE but is held out of
    allocation (cluster_state/admission.py); a held node that serves a job stays SERVING.
    DRAINING: what would be CLEARING, for a node an operator drained out of its job.
    So the states partition the pool and ``idle`` counts exactly the nodes a job can get.
    The values are what metrics labels spell."""

    IDLE = "idle"
    SERVING = "serving"
    CLEARING = "clearing"
    LEFT = "left"
    CORDONED = "cordoned"
    QUARANTINED = "quarantined"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"  # drained out of its job, its workers still stopping; then CORDONED


@dataclass(frozen=True)
class Caller:
    """Who makes a Jobs call: ``owner`` is how a job records its submitter ("admin:<cert
    name>", "submitter:<cert name>", "admin-token", or "" on an insecure dev coordinator);
    an admin may manage every job."""

    owner: str
    admin: bool

    @classmethod
    def of_owner(cls, owner: str) -> "Caller":
        """The submitter a job records, with its role: an owner's spelling carries it (the
        servicers build it so), so the scheduler holds a job to its submitter's quotas
        without the call that submitted it."""
        return cls(owner, admin=owner in ("", "admin-token") or owner.startswith("admin:"))

    def may_manage(self, job: "Job") -> bool:
        """Cancel, finish, and read the command and env of ``job``."""
        return self.admin or job.owner == self.owner

    def describe(self) -> str:
        return shown(self.owner or "(anonymous)")


# The coordinator itself (and an insecure dev coordinator, which checks no credential).
OPERATOR = Caller("", admin=True)


@dataclass(frozen=True)
class UncordonAsked:
    """An uncordon asked by ``by`` at ``at`` that returns the node at its first passing
    health check counted after ``after`` (the node's ``checked`` when it was asked)."""

    by: str
    at: float
    after: tuple[str, int] | None


@dataclass
class ClusterNode:
    node_id: str
    hostname: str
    slots: int
    slot_kind: str
    labels: dict[str, str]
    credential_hash: str
    public_key: bytes
    joined_at: float
    last_seen: float  # liveness: not persisted (a restarted coordinator gives every node a fresh start)
    job_id: str = ""  # the job this node serves (as a member or a spare); "" when idle
    # Liveness, not persisted: its agent's latest heartbeat listed no job whose containment
    # unit still holds a process, and came after its last job ended. A node is idle only then.
    units_clear: bool = True
    # Persisted (cluster_state/admission.py): an operator's cordon ("" none), the
    # coordinator's quarantine ("" none), and the failures attributed to the node since it
    # was last released, as (at, why), the newest last.
    cordon: str = ""
    quarantine: str = ""
    failures: tuple[tuple[float, str], ...] = ()
    # Persisted: the job an operator drained this node out of (NodeDrained; "" none): it
    # serves no part of that job again. Cleared by an uncordon.
    drained_from: str = ""
    # Liveness, not persisted: its health check's failing summary ("" passing, or no check;
    # its agent reports it again on its next heartbeat after a restart).
    unhealthy: str = ""
    # Liveness: the latest check its agent reported, as (agent instance, NodeHealth.seq);
    # None while it reported none (its agent runs no check).
    checked: tuple[str, int] | None = None
    # Liveness: an operator's uncordon waiting for a passing check run after it
    # (admission.note_uncordon_asked). Lost with a coordinator restart: the node then stays
    # held, as the log says, and the operator asks again (failing closed).
    uncordon_asked: UncordonAsked | None = None
    # Liveness, not persisted: the NVLink domain its agent reported with its hardware
    # (coordinator/hardware.py; "" unknown), the innermost locality (backfill.locality).
    nvlink_domain: str = ""


@dataclass
class Job:
    spec: JobSpec
    submitted_at: float
    state: JobState = JobState.PENDING
    reason: str = ""
    nodes: tuple[str, ...] = ()
    spares: tuple[str, ...] = ()
    ended_at: float = 0.0
    owner: str = ""
    summary: str = ""  # JobSummarized.status once the job ended and its engine was closed
    log_pruned: bool = False
    declared: bool = False  # JobSubmitted.declared: the config's job, served while the config declares it
    allocated_at: float = 0.0  # JobAllocated.at (its timeline's; 0 until allocated)
    pruned_at: float = 0.0  # JobLogPruned.at
    # Idle nodes given to it while it ran, each to take a lost node's block, as (node, lost
    # node, when) (JobReplacementGiven): they serve it, and go back to the pool when it ends.
    replacements: tuple[tuple[str, str, float], ...] = ()
    # What the cluster did to the nodes serving it (a cordon, a quarantine, a node given),
    # as (at, node, what), for its timeline; the newest MAX_MOMENTS.
    moments: tuple[tuple[float, str, str], ...] = ()

    @property
    def given(self) -> tuple[str, ...]:
        """Every node the cluster gave it: members, spares, and replacements."""
        return self.nodes + self.spares + tuple(node_id for node_id, _, _ in self.replacements)

    seq: int = 0  # its place in submission order, from 0 (a ListJobs page token names it)


@dataclass(frozen=True)
class Allocation:
    job_id: str
    nodes: tuple[str, ...]
    spares: tuple[str, ...]
