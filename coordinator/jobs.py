"""The cluster: nodes that stay joined, and jobs that come and go. Pure.

Convention: a node belongs to the cluster from its first Join (its identity, credential
and vouch key live here, not in any job); a job is immutable once submitted and gets
whole idle nodes, in node-rank order, when it is allocated. What happens inside a job
(ranks, generations, the barrier, exits) is that job's own RendezvousState, fed by its
own event log; this module only decides which job owns which nodes, and when a job ends.

No sockets, no clock (``now`` is passed in), no files. ``decide_*`` returns events (or
raises RendezvousError naming the field); ``apply`` folds one event in. This module holds
JobSpec and ClusterState (the data, bound to its decisions); the decisions live by
concern in cluster_state/: pool.py (the nodes), scheduling.py (submit, allocate),
ends.py (cancel, finish, end, summary, prune), apply.py (a handler per event type);
events.py and model.py hold the events and the data types.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

from meshgate.coordinator.cluster_state import ends, pool, scheduling
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
from meshgate.coordinator.cluster_state.scheduling import (
    DEFAULT_PAGE_SIZE,
    LOCALITY_LABELS,
    MAX_JOB_NODES,
    MAX_PAGE_SIZE,
)
from meshgate.coordinator.rendezvous import (
    Code,
    RankMode,
    RendezvousConfig,
    RendezvousError,
    Token,
    check_id,
    shown,
)
from meshgate.plan import ParallelPlan, PlanError

# The cluster's own log is pinned under this id; no job may take it.
CLUSTER_LOG_ID = "cluster"
# A job id names its log directory and its mark file, so it is one safe path component:
# a DNS-label-like name, never "/", "..", a leading "-" (an option to a command line) or ".".
MAX_JOB_ID_LEN = 63
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# Variables the agent sets for its workers (coordinator, TLS files, vouch socket, insecure
# switch, ...): a job's env may not replace them, or its workers would talk to another
# coordinator, drop TLS or trust another bundle.
RESERVED_ENV_PREFIX = "MESHGATE_"
# How long an ended job's own log is kept ([cluster] retention); its summary stays forever.
DEFAULT_RETENTION_S = 3 * 24 * 3600.0


RESTART_POLICIES = ("never", "on-failure")


def check_job_id(job_id: object, name: str = "job_id") -> str:
    """INVALID_ARGUMENT naming the (bounded) id unless it is a short DNS-label-like name:
    1..63 of [A-Za-z0-9._-], starting with a letter or digit, without "..". Such an id is
    one path component that stays inside the directory it is joined to."""
    if not isinstance(job_id, str) or not job_id:
        raise RendezvousError(Code.INVALID_ARGUMENT, f"{name} must be a non-empty string")
    if len(job_id) > MAX_JOB_ID_LEN or not _JOB_ID_RE.match(job_id) or ".." in job_id:
        raise RendezvousError(
            Code.INVALID_ARGUMENT,
            f"{name} {shown(job_id)} must be 1..{MAX_JOB_ID_LEN} characters of [A-Za-z0-9._-], starting "
            "with a letter or digit, without '..'",
        )
    return job_id


def _check_no_nul(field_name: str, values: Iterable[str]) -> None:
    for value in values:
        if "\0" in value:
            raise RendezvousError(
                Code.INVALID_ARGUMENT, f"{field_name}: {shown(value)} holds a NUL byte; no argument or variable may"
            )


@dataclass(frozen=True)
class JobSpec:
    """Everything a job is; immutable once submitted (a changed plan is a new job)."""

    job_id: str
    plan: ParallelPlan
    slots_per_node: int
    num_nodes: int
    node_ids: tuple[str, ...] = ()  # pinned nodes, in node-rank order (all of them, or none)
    mode: RankMode = RankMode.ASSIGNED
    topology_policy: str = "warn"
    spares: int = 0
    command: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    restart_policy: str = "never"
    max_restarts: int = 0
    lost_node_timeout_s: float = 300.0

    @classmethod
    def build(
        cls,
        *,
        job_id: str,
        plan: ParallelPlan,
        slots_per_node: int = 0,
        num_nodes: int = 0,
        node_ids: Iterable[str] = (),
        mode: str = "assigned",
        topology_policy: str = "warn",
        spares: int = 0,
        command: Iterable[str] = (),
        env: Mapping[str, str] | Iterable[tuple[str, str]] = (),
        restart_policy: str = "never",
        max_restarts: Optional[int] = None,
        lost_node_timeout_s: float = 300.0,
        submitted: bool = True,
    ) -> "JobSpec":
        """Validate a submission; INVALID_ARGUMENT naming the field otherwise. Nodes and
        slots may be given either way round: ``num_nodes`` (or the pinned ``node_ids``)
        derives the slots per node from the world size, and the reverse. ``submitted``
        False: a spec read back from the log, held to the id and content rules of the
        version that accepted it (a job stays readable; its paths are checked on use)."""
        check_job_id(job_id) if submitted else check_id("job_id", job_id)
        if job_id == CLUSTER_LOG_ID:
            raise RendezvousError(Code.INVALID_ARGUMENT, f"job_id {job_id!r} is reserved for the cluster's log")
        node_ids = tuple(node_ids)
        for node_id in node_ids:
            check_id("node_ids", node_id)
        if len(set(node_ids)) != len(node_ids):
            raise RendezvousError(Code.INVALID_ARGUMENT, f"node_ids has duplicates: {list(node_ids)[:16]}")
        for name, value in (("slots_per_node", slots_per_node), ("nodes", num_nodes), ("spares", spares)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise RendezvousError(Code.INVALID_ARGUMENT, f"{name} must be an integer >= 0, got {shown(value)}")
        world = plan.world_size
        if node_ids and num_nodes and num_nodes != len(node_ids):
            raise RendezvousError(
                Code.INVALID_ARGUMENT, f"nodes {num_nodes} differs from the {len(node_ids)} node_ids named"
            )
        num_nodes = num_nodes or len(node_ids)
        if not slots_per_node:
            if num_nodes and world % num_nodes:
                raise RendezvousError(
                    Code.INVALID_ARGUMENT, f"nodes {num_nodes} does not divide the plan's world size {world}"
                )
            slots_per_node = world // num_nodes if num_nodes else world
        if world % slots_per_node:
            raise RendezvousError(
                Code.INVALID_ARGUMENT, f"slots_per_node {slots_per_node} does not divide the plan's world size {world}"
            )
        if num_nodes and num_nodes * slots_per_node != world:
            raise RendezvousError(
                Code.INVALID_ARGUMENT,
                f"nodes {num_nodes} x slots_per_node {slots_per_node} = {num_nodes * slots_per_node}, "
                f"not the plan's world size {world}",
            )
        num_nodes = world // slots_per_node
        if node_ids and len(node_ids) != num_nodes:
            raise RendezvousError(
                Code.INVALID_ARGUMENT, f"node_ids names {len(node_ids)} nodes; the job needs {num_nodes}"
            )
        if mode not in ("assigned", "claimed"):
            raise RendezvousError(Code.INVALID_ARGUMENT, f"mode must be assigned or claimed, got {shown(mode)}")
        if topology_policy not in ("allow", "warn", "refuse"):
            raise RendezvousError(
                Code.INVALID_ARGUMENT, f"topology_policy must be allow, warn or refuse, got {shown(topology_policy)}"
            )
        command = tuple(command)
        if not all(isinstance(c, str) and c for c in command) or len(command) > 256:
            raise RendezvousError(Code.INVALID_ARGUMENT, "command must be at most 256 non-empty strings")
        if mode == "assigned" and not command:
            raise RendezvousError(
                Code.INVALID_ARGUMENT, "command is empty: an assigned-mode job's agents need a command to launch"
            )
        env_items = tuple(sorted(dict(env).items()))
        for key, value in env_items:
            if not isinstance(key, str) or not key or "=" in key or not isinstance(value, str):
                raise RendezvousError(Code.INVALID_ARGUMENT, f"env key {shown(key)} is not a NAME=value string pair")
        if submitted:
            _check_no_nul("command", command)
            _check_no_nul("env", (text for item in env_items for text in item))
            reserved = [key for key, _ in env_items if key.startswith(RESERVED_ENV_PREFIX)]
            if reserved:
                raise RendezvousError(
                    Code.INVALID_ARGUMENT,
                    f"env {shown(reserved[0])}: variables {RESERVED_ENV_PREFIX}* are the agent's (coordinator, "
                    "TLS, trust bundle, vouch socket) and a job may not set them",
                )
        if restart_policy not in RESTART_POLICIES:
            raise RendezvousError(
                Code.INVALID_ARGUMENT, f"restart_policy must be never or on-failure, got {shown(restart_policy)}"
            )
        if max_restarts is None:
            max_restarts = 3 if restart_policy == "on-failure" else 0
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or not 0 <= max_restarts <= 1000:
            raise RendezvousError(Code.INVALID_ARGUMENT, f"max_restarts must be in [0, 1000], got {shown(max_restarts)}")
        if restart_policy == "never":
            max_restarts = 0
        if isinstance(lost_node_timeout_s, bool) or not isinstance(lost_node_timeout_s, (int, float)) or not (
            0 < lost_node_timeout_s <= 7 * 24 * 3600
        ):
            raise RendezvousError(
                Code.INVALID_ARGUMENT, f"lost_node_timeout_s must be in (0, 604800], got {shown(lost_node_timeout_s)}"
            )
        return cls(
            job_id, plan, slots_per_node, num_nodes, node_ids, RankMode(mode), topology_policy, spares,
            command, env_items, restart_policy, max_restarts, float(lost_node_timeout_s),
        )

    def rendezvous_config(self, node_order: tuple[str, ...], require_vouch: bool) -> RendezvousConfig:
        """The job's own rendezvous, over the nodes it was given (in node-rank order)."""
        return RendezvousConfig(
            job_id=self.job_id,
            plan=self.plan,
            slots_per_node=self.slots_per_node,
            node_order=node_order,
            topology_policy=self.topology_policy,  # type: ignore[arg-type]
            lost_node_timeout_s=self.lost_node_timeout_s,
            require_vouch=require_vouch,
            mode=self.mode,
            max_restarts=self.max_restarts,
        )

    def to_json(self) -> str:
        body = {
            "job_id": self.job_id, "plan": self.plan.to_dict(), "slots_per_node": self.slots_per_node,
            "num_nodes": self.num_nodes, "node_ids": list(self.node_ids), "mode": self.mode.value,
            "topology_policy": self.topology_policy, "spares": self.spares, "command": list(self.command),
            "env": dict(self.env), "restart_policy": self.restart_policy, "max_restarts": self.max_restarts,
            "lost_node_timeout_s": self.lost_node_timeout_s,
        }
        return json.dumps(body, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "JobSpec":
        """The inverse of to_json, as strict as a submission (ValueError otherwise)."""
        try:
            body = json.loads(text)
            plan = ParallelPlan.from_mapping(body.pop("plan"))
            return cls.build(plan=plan, submitted=False, **body)
        except (ValueError, TypeError, KeyError, AttributeError, PlanError, RendezvousError) as exc:
            raise ValueError(f"not a job spec: {exc}") from None


# ---- state -----------------------------------------------------------------------------------


@dataclass
class ClusterState:
    heartbeat_timeout_s: float = 15.0
    nodes: dict[str, ClusterNode] = field(default_factory=dict)
    tokens: dict[str, Token] = field(default_factory=dict)
    jobs: dict[str, Job] = field(default_factory=dict)  # in submission order (dicts keep it)
    # Indexes of ``jobs``, so that what runs on every reconcile costs the jobs that can still
    # change, not every job ever served: the PENDING ones in submission order, and the
    # summarized ones whose own log is still kept.
    pending: dict[str, Job] = field(default_factory=dict)
    unpruned: dict[str, Job] = field(default_factory=dict)

    def job(self, job_id: str) -> Job:
        check_id("job_id", job_id)
        job = self.jobs.get(job_id)
        if job is None:
            raise RendezvousError(Code.NOT_FOUND, f"job_id {job_id!r} is not known to this coordinator")
        return job

    # ---- the pool's nodes (cluster_state/pool.py) ---------------------------------------------
    is_live = pool.is_live
    idle_nodes = pool.idle_nodes
    pool_state = pool.pool_state
    decide_join = pool.decide_join
    decide_create_token = pool.decide_create_token
    check_serves = pool.check_serves
    serves_any = pool.serves_any
    decide_node_call = pool.decide_node_call
    leave = pool.leave
    note_units = pool.note_units
    touch = pool.touch

    # ---- jobs and where they run (cluster_state/scheduling.py) ---------------------------------
    decide_submit = scheduling.decide_submit
    check_may_manage = scheduling.check_may_manage
    list_jobs = scheduling.list_jobs
    decide_allocate = scheduling.decide_allocate
    pending_reason = scheduling.pending_reason
    usable_nodes = scheduling.usable_nodes
    missing_for = scheduling.missing_for

    # ---- how jobs end (cluster_state/ends.py) --------------------------------------------------
    decide_cancel = ends.decide_cancel
    decide_finish = ends.decide_finish
    decide_end = ends.decide_end
    decide_summarize = ends.decide_summarize
    decide_prune = ends.decide_prune

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
    "DEFAULT_RETENTION_S",
    "ENV_WITHHELD",
    "Job",
    "JobAllocated",
    "JobEnded",
    "JobLogPruned",
    "JobSpec",
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
