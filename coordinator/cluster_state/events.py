"""The events of the cluster's own log: nodes joining, jobs submitted, allocated,
ended, summarized and pruned. Fields are typed: the codec (store/codec.py) writes and
reads them by their annotations (an enum as its value, a tuple as an array)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Union

from meshgate.coordinator.cluster_state.model import JobState
from meshgate.coordinator.rendezvous import TokenCreated


@dataclass(frozen=True)
class ClusterNodeJoined:
    """A node's first Join to the cluster, or a rejoin that changed what it reports.
    ``labels`` are (key, value) pairs sorted by key; ``token_hash`` the token spent ("" on
    a credential rejoin). ``job_id``: the declared job the node joined (it serves that job
    from now on, so the allocator never gives it to another); "" for a Join to the pool."""

    node_id: str
    hostname: str
    slots: int
    slot_kind: str
    labels: tuple[tuple[str, str], ...]
    credential_hash: str
    public_key: str
    token_hash: str
    at: float
    job_id: str = ""  # "" in logs written before declared jobs' nodes joined the cluster


@dataclass(frozen=True)
class JobSubmitted:
    job_id: str
    spec: str  # JobSpec.to_json: the proto's JSON (or, in logs written before, JobSpec.build's arguments)
    at: float
    owner: str = ""  # Caller.owner of the submitter ("" in logs written before owners were kept)
    # Declared by the coordinator's config ([job] + [plan]), not submitted: RUNNING at once,
    # with open membership (its agents Join it by name; no node is allocated to it). A
    # later one for the same id (a restart whose [launch] changed) replaces its spec.
    declared: bool = False


ENV_WITHHELD = "<withheld>"


def loggable(event: "ClusterEvent") -> "ClusterEvent":
    """The event as the coordinator's log lines show it: a submission's env values are
    withheld (they are often secrets such as API tokens); everything else as it is."""
    if not isinstance(event, JobSubmitted):
        return event
    spec = json.loads(event.spec)
    spec["env"] = {key: ENV_WITHHELD for key in spec.get("env", {})}
    return dataclasses.replace(event, spec=json.dumps(spec, separators=(",", ":"), sort_keys=True))


@dataclass(frozen=True)
class JobAllocated:
    """The job's nodes (in node rank order) and spares: it is RUNNING."""

    job_id: str
    nodes: tuple[str, ...]
    spares: tuple[str, ...]
    at: float


@dataclass(frozen=True)
class JobEnded:
    job_id: str
    state: JobState  # one that ``ended``
    reason: str
    at: float


@dataclass(frozen=True)
class JobSummarized:
    """What an ended job's rendezvous came to, kept in the cluster's log so that reading
    the job never reopens its own log: ``status`` is the base64 of its final
    meshgate.v1.Status (generation, world size, nodes and their states and exits, master,
    failure; a few hundred bytes). Written right after the job's engine stopped deciding."""

    job_id: str
    status: str
    at: float


@dataclass(frozen=True)
class JobLogPruned:
    """An ended job's own log (and its mark) were deleted after ``[cluster] retention``;
    its submission and summary stay in the cluster's log, so its id is never reused."""

    job_id: str
    at: float


@dataclass(frozen=True)
class NodeCordoned:
    """An operator took the node out of allocation (meshgate node cordon); ``by`` is the
    caller's Caller.owner."""

    node_id: str
    reason: str
    by: str
    at: float


@dataclass(frozen=True)
class NodeUncordoned:
    """An operator returned the node: its cordon and quarantine are lifted and its
    counted failures forgotten."""

    node_id: str
    by: str
    at: float


@dataclass(frozen=True)
class NodeDrained:
    """An operator drained the node (meshgate node drain): it is cordoned, and it leaves
    ``job_id``, the job it served ("" none), whose block goes to a spare or a node of the
    pool in a new generation (coordinator/job_nodes.py makes the job's engine say so)."""

    node_id: str
    job_id: str
    reason: str
    by: str
    at: float


@dataclass(frozen=True)
class NodeFailureCounted:
    """A failure attributed to the node (a worker's failed exit that ended its job's
    generation, its loss from a job, its health check failing)."""

    node_id: str
    reason: str
    at: float


@dataclass(frozen=True)
class NodeQuarantined:
    """The node failed [cluster] quarantine_after times within quarantine_window: no job is
    given to it until an operator uncordons it or its health check passes."""

    node_id: str
    reason: str
    at: float


@dataclass(frozen=True)
class NodeQuarantineLifted:
    """A quarantined node's health check passed: its quarantine and counted failures go."""

    node_id: str
    reason: str
    at: float


@dataclass(frozen=True)
class JobReplacementGiven:
    """A running job's block waits for a node (its holder was lost or left, and no spare
    of the job stands by): the idle node ``node_id`` is given to the job to take the
    block of ``lost_id`` (cluster_state/replacement.py chose it, nearest first)."""

    job_id: str
    node_id: str
    lost_id: str
    at: float
    why: str = ""  # how near it is, e.g. "same switch s1"


ClusterEvent = Union[
    ClusterNodeJoined,
    TokenCreated,
    JobSubmitted,
    JobAllocated,
    JobEnded,
    JobSummarized,
    JobLogPruned,
    NodeCordoned,
    NodeUncordoned,
    NodeFailureCounted,
    NodeQuarantined,
    NodeQuarantineLifted,
    JobReplacementGiven,
    NodeDrained,
]


CLUSTER_EVENT_TYPES: tuple[type, ...] = ClusterEvent.__args__  # every kind, for the codec and the apply table
