"""The cluster: nodes that stay joined, and jobs that come and go. Pure.

Convention: a node belongs to the cluster from its first Join (its identity, credential
and vouch key live here, not in any job); a job is immutable once submitted and gets
whole idle nodes, in node-rank order, when it is allocated. What happens inside a job
(ranks, generations, the barrier, exits) is that job's own RendezvousState, fed by its
own event log; this module only decides which job owns which nodes, and when a job ends.

No sockets, no clock (``now`` is passed in), no files. ``decide_*`` returns events (or
raises RendezvousError naming the field); ``apply`` folds one event in. This module holds
JobSpec and ClusterState (the data, bound to its decisions); the decisions live by
concern in cluster_state/: pool.py (the nodes), scheduling.py (submit, allocate, why a
job waits), backfill.py (the allocation pass), ends.py (cancel, finish, end, time limits,
summary, prune), apply.py (a handler per event type);
events.py and model.py hold the events and the data types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from meshgate.coordinator.cluster_state import admission, declared, ends, pool, replacement, scheduling
from meshgate.coordinator.cluster_state.admission import QuarantinePolicy
from meshgate.coordinator.cluster_state.forgotten import DEFAULT_ENDED_JOBS_KEPT, ForgottenJobs
from meshgate.coordinator.cluster_state.quotas import Quotas
from meshgate.coordinator.cluster_state.apply import HANDLERS
from meshgate.coordinator.cluster_state.events import (
    CLUSTER_EVENT_TYPES,
    ENV_WITHHELD,
    ClusterEvent,
    ClusterNodeJoined,
    JobAllocated,
    JobEnded,
    JobLogPruned,
    JobSubmitted,
    JobSummarized,
    loggable,
)
from meshgate.coordinator.cluster_state.model import OPERATOR, Allocation, Caller, ClusterNode, Job, JobState, PoolState
from meshgate.coordinator.cluster_state.pool import MAX_LABEL_LEN, MAX_LABELS, MAX_LIVE_UNITS, check_labels
from meshgate.coordinator.cluster_state.ends import one_line
from meshgate.coordinator.cluster_state.backfill import LOCALITY_LABELS
from meshgate.coordinator.cluster_state.scheduling import DEFAULT_PAGE_SIZE, MAX_JOB_NODES, MAX_PAGE_SIZE
from meshgate.coordinator.rendezvous import (
    Code,
    RendezvousError,
    Token,
    check_id,
)
from meshgate.coordinator.jobspec import (  # the spec moved there; its names stay importable from here
    CLUSTER_LOG_ID,
    MAX_JOB_ID_LEN,
    JobSpec,
    check_job_id,
)

# How long an ended job's own log is kept ([cluster] retention); its summary stays forever.
DEFAULT_RETENTION_S = 3 * 24 * 3600.0


# ---- state -----------------------------------------------------------------------------------


@dataclass
class ClusterState:
    heartbeat_timeout_s: float = 15.0
    quotas: Quotas = field(default_factory=Quotas)  # per submitter, checked at submit ([cluster.quota])
    heartbeat_interval_s: float = 0.0  # 0: not known here (a test's state); suspects then at half the timeout
    quarantine: QuarantinePolicy = field(default_factory=QuarantinePolicy)  # [cluster] quarantine_*
    ended_jobs_kept: int = DEFAULT_ENDED_JOBS_KEPT  # [cluster] ended_jobs_kept (cluster_state/forgotten.py)
    nodes: dict[str, ClusterNode] = field(default_factory=dict)
    tokens: dict[str, Token] = field(default_factory=dict)
    jobs: dict[str, Job] = field(default_factory=dict)  # in submission order (dicts keep it)
    # Indexes of ``jobs``, so that what runs on every reconcile costs the jobs that can still
    # change, not every job ever served: the PENDING ones in submission order, and the
    # summarized ones whose own log is still kept, and those whose log was deleted (in the
    # order it was), which are forgotten first when more than ``ended_jobs_kept`` are kept.
    pending: dict[str, Job] = field(default_factory=dict)
    unpruned: dict[str, Job] = field(default_factory=dict)
    pruned: dict[str, Job] = field(default_factory=dict)
    forgotten: ForgottenJobs = field(default_factory=ForgottenJobs)
    submitted: int = 0  # jobs submitted (or declared) so far: the next one's Job.seq

    def job(self, job_id: str) -> Job:
        check_id("job_id", job_id)
        job = self.jobs.get(job_id)
        if job is None and job_id in self.forgotten:
            raise RendezvousError(
                Code.NOT_FOUND,
                f"job_id {job_id!r} ended long ago and was forgotten: this coordinator keeps the newest "
                f"{self.ended_jobs_kept} ended jobs ([cluster] ended_jobs_kept), and keeps their ids taken",
            )
        if job is None:
            raise RendezvousError(Code.NOT_FOUND, f"job_id {job_id!r} is not known to this coordinator")
        return job

    def taken(self, job_id: str) -> bool:
        """Was ``job_id`` ever a job's here (remembered, or forgotten since)?"""
        return job_id in self.jobs or job_id in self.forgotten

    # ---- the pool's nodes (cluster_state/pool.py) ---------------------------------------------
    is_live = pool.is_live
    silent_for = pool.silent_for
    idle_nodes = pool.idle_nodes
    pool_state = pool.pool_state
    decide_join = pool.decide_join
    decide_adopt = pool.decide_adopt
    decide_create_token = pool.decide_create_token
    check_serves = pool.check_serves
    serves_any = pool.serves_any
    decide_node_call = pool.decide_node_call
    leave = pool.leave
    note_units = pool.note_units
    touch = pool.touch

    # ---- which nodes may take a job: cordon, quarantine, health (cluster_state/admission.py) ----
    decide_cordon = admission.decide_cordon
    decide_uncordon = admission.decide_uncordon
    decide_drain = admission.decide_drain
    check_not_drained = admission.check_not_drained
    decide_failure = admission.decide_failure
    decide_health = admission.decide_health
    note_health = admission.note_health
    note_uncordon_asked = admission.note_uncordon_asked
    note_no_health = admission.note_no_health
    recent_failures = admission.recent_failures

    # ---- jobs and where they run (cluster_state/scheduling.py) ---------------------------------
    decide_submit = scheduling.decide_submit
    check_may_manage = scheduling.check_may_manage
    list_jobs = scheduling.list_jobs
    decide_allocate = scheduling.decide_allocate
    pending_reason = scheduling.pending_reason
    missing_for = scheduling.missing_for

    # ---- a running job's waiting block given a node of the pool (cluster_state/replacement.py) ----
    decide_replacements = replacement.decide_replacements
    waiting_reason = replacement.waiting_reason

    # ---- how jobs end (cluster_state/ends.py) --------------------------------------------------
    decide_cancel = ends.decide_cancel
    clearing = ends.clearing
    decide_finish = ends.decide_finish
    decide_end = ends.decide_end
    decide_time_limits = ends.decide_time_limits
    decide_launch_deadlines = ends.decide_launch_deadlines
    decide_summarize = ends.decide_summarize
    decide_prune = ends.decide_prune

    # ---- the job a config declares (cluster_state/declared.py) ---------------------------------
    decide_declare = declared.decide_declare
    undeclared_running = declared.undeclared_running
    check_undeclared = declared.check_undeclared

    # ---- apply (cluster_state/apply.py) --------------------------------------------------------

    def apply(self, event: ClusterEvent) -> None:
        HANDLERS[type(event)](self, event)

    def apply_all(self, events: Iterable[ClusterEvent]) -> None:
        for event in events:
            self.apply(event)


__all__ = [
    "Allocation",
    "CLUSTER_EVENT_TYPES",
    "CLUSTER_LOG_ID",
    "Caller",
    "OPERATOR",
    "check_job_id",
    "loggable",
    "ClusterEvent",
    "ClusterNode",
    "ClusterNodeJoined",
    "ClusterState",
    "DEFAULT_PAGE_SIZE",
    "DEFAULT_ENDED_JOBS_KEPT",
    "DEFAULT_RETENTION_S",
    "ENV_WITHHELD",
    "Job",
    "JobAllocated",
    "JobEnded",
    "JobLogPruned",
    "JobSpec",
    "MAX_JOB_ID_LEN",
    "JobState",
    "JobSubmitted",
    "JobSummarized",
    "LOCALITY_LABELS",
    "MAX_JOB_NODES",
    "MAX_LABELS",
    "MAX_LABEL_LEN",
    "MAX_LIVE_UNITS",
    "MAX_PAGE_SIZE",
    "PoolState",
    "check_labels",
    "one_line",
]
