"""The cluster: nodes that stay joined, and jobs that come and go. Pure.

Convention: a node belongs to the cluster from its first Join (its identity, credential
and vouch key live here, not in any job); a job is immutable once submitted and gets
whole idle nodes, in node-rank order, when it is allocated. What happens inside a job
(ranks, generations, the barrier, exits) is that job's own RendezvousState, fed by its
own event log; this module only decides which job owns which nodes, and when a job ends.

No sockets, no clock (``now`` is passed in), no files. ``decide_*`` returns events (or
raises RendezvousError naming the field); ``apply`` folds one event in.
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
import json
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Union

from meshgate.attestation import secret_hash
from meshgate.coordinator.rendezvous import (
    MAX_ID_LEN,
    Code,
    JoinAuth,
    RankMode,
    RendezvousConfig,
    RendezvousError,
    Token,
    TokenCreated,
    check_id,
    new_token,
    shown,
    spend_token,
)
from meshgate.plan import ParallelPlan, PlanError

# The cluster's own log is pinned under this id; no job may take it.
CLUSTER_LOG_ID = "cluster"
# Labels that say which nodes sit close together, most local first: allocation keeps a
# job inside one group of the first label when it can.
LOCALITY_LABELS = ("switch", "rack")
MAX_LABELS, MAX_LABEL_LEN = 16, 63
# A job id names its log directory and its mark file, so it is one safe path component:
# a DNS-label-like name, never "/", "..", a leading "-" (an option to a command line) or ".".
MAX_JOB_ID_LEN = 63
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# Variables the agent sets for its workers (coordinator, TLS files, vouch socket, insecure
# switch, ...): a job's env may not replace them, or its workers would talk to another
# coordinator, drop TLS or trust another bundle.
RESERVED_ENV_PREFIX = "MESHGATE_"
# ListJobs pages.
DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE = 100, 1000
# No job asks for more nodes than this (members and spares together): beyond it a
# submission is a mistake (2^32-1 spares), not a job waiting for nodes to join.
MAX_JOB_NODES = 1 << 20
# How long an ended job's own log is kept ([cluster] retention); its summary stays forever.
DEFAULT_RETENTION_S = 3 * 24 * 3600.0
MAX_LIVE_UNITS = 64  # a heartbeat's live_units: a node holds few job runs at once


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
class Caller:
    """Who makes a Jobs call: ``owner`` is how a job records its submitter ("admin:<cert
    name>", "submitter:<cert name>", "admin-token", or "" on an insecure dev coordinator);
    an admin may manage every job."""

    owner: str
    admin: bool

    def may_manage(self, job: "Job") -> bool:
        """Cancel, finish, and read the command and env of ``job``."""
        return self.admin or job.owner == self.owner

    def describe(self) -> str:
        return shown(self.owner or "(anonymous)")


# The coordinator itself (and an insecure dev coordinator, which checks no credential).
OPERATOR = Caller("", admin=True)


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
        declared: bool = False,
    ) -> "JobSpec":
        """Validate a submission; INVALID_ARGUMENT naming the field otherwise. Nodes and
        slots may be given either way round: ``num_nodes`` (or the pinned ``node_ids``)
        derives the slots per node from the world size, and the reverse. ``submitted``
        False: a spec read back from the log, held to the id and content rules of the
        version that accepted it (a job stays readable; its paths are checked on use).
        ``declared``: the job a coordinator config declares ([job] + [plan]), whose
        workers may be started by something other than an agent, so it needs no command."""
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
        if mode == "assigned" and not command and not declared:
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
    def from_json(cls, text: str, declared: bool = False) -> "JobSpec":
        """The inverse of to_json, as strict as a submission (ValueError otherwise)."""
        try:
            body = json.loads(text)
            plan = ParallelPlan.from_mapping(body.pop("plan"))
            return cls.build(plan=plan, submitted=False, declared=declared, **body)
        except (ValueError, TypeError, KeyError, AttributeError, PlanError, RendezvousError) as exc:
            raise ValueError(f"not a job spec: {exc}") from None


# ---- events --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterNodeJoined:
    """A node's first Join to the cluster, or a rejoin that changed what it reports.
    ``labels`` is a JSON object of strings; ``token_hash`` the token spent ("" on a
    credential rejoin)."""

    node_id: str
    hostname: str
    slots: int
    slot_kind: str
    labels: str
    credential_hash: str
    public_key: str
    token_hash: str
    at: float


@dataclass(frozen=True)
class JobSubmitted:
    job_id: str
    spec: str  # JobSpec.to_json
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
    """The job's nodes (comma-joined, node rank order) and spares: it is RUNNING."""

    job_id: str
    nodes: str
    spares: str
    at: float


@dataclass(frozen=True)
class JobEnded:
    job_id: str
    state: str  # a JobState that ``ended``
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


ClusterEvent = Union[
    ClusterNodeJoined, TokenCreated, JobSubmitted, JobAllocated, JobEnded, JobSummarized, JobLogPruned
]


# ---- state -----------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class Allocation:
    job_id: str
    nodes: tuple[str, ...]
    spares: tuple[str, ...]


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

    # ---- derived -------------------------------------------------------------------------

    def is_live(self, node: ClusterNode, now: float) -> bool:
        return now - node.last_seen <= self.heartbeat_timeout_s

    def idle_nodes(self, now: float) -> list[ClusterNode]:
        return [n for n in self.nodes.values() if not n.job_id and n.units_clear and self.is_live(n, now)]

    def job(self, job_id: str) -> Job:
        check_id("job_id", job_id)
        job = self.jobs.get(job_id)
        if job is None:
            raise RendezvousError(Code.NOT_FOUND, f"job_id {job_id!r} is not known to this coordinator")
        return job

    def pending_reason(self, job: Job, now: float) -> str:
        """Why a PENDING job waits, e.g. "needs 4 nodes of 8 slots; 3 idle", or that no
        set of the joined nodes can hold it, so only nodes that have not joined can help."""
        spec = job.spec
        need = _needs(spec)
        missing = self.missing_for(spec)
        if missing:
            return f"{need}, but {missing}: it waits for nodes that have not joined"
        fits = [n for n in self.idle_nodes(now) if n.slots >= spec.slots_per_node]
        if spec.node_ids:
            busy = [i for i in spec.node_ids if i not in {n.node_id for n in fits}]
            why = f"{need}: pinned node(s) not idle: {', '.join(busy[:8])}" if busy else need
        else:
            why = f"{need}; {len(fits)} idle"
        clearing = [n.node_id for n in self.nodes.values()
                    if not n.job_id and not n.units_clear and self.is_live(n, now) and n.slots >= spec.slots_per_node]
        if clearing:  # idle once their agents show every process of their last job gone
            why += f"; {len(clearing)} clearing ({', '.join(clearing[:8])})"
        earlier = self._held_for_earlier(job)
        if earlier is not None:
            why += f"; behind job {earlier.spec.job_id!r} (FIFO)"  # which could use the same nodes
        return why

    def _held_for_earlier(self, job: Job) -> Optional[Job]:
        """The first earlier PENDING job that could use a node ``job`` could use (so that
        node is held for it), or None."""
        mine = self.usable_nodes(job.spec)
        for other in self.pending.values():
            if other is job:
                return None
            if mine & self.usable_nodes(other.spec):
                return other
        return None

    def usable_nodes(self, spec: JobSpec) -> set[str]:
        """The joined nodes ``spec`` could ever be given: its pinned nodes (and, for spares,
        any node with enough slots), else every node with enough slots."""
        enough = {n.node_id for n in self.nodes.values() if n.slots >= spec.slots_per_node}
        if spec.node_ids:
            return (set(spec.node_ids) & enough) | (enough if spec.spares else set())
        return enough

    def missing_for(self, spec: JobSpec) -> str:
        """What no set of the joined nodes can give ``spec`` (live or not, busy or idle),
        e.g. "only 1 of the 3 joined nodes has 8 slots or more (the most any has is 4)", "only
        3 nodes have joined", "pinned node(s) n9 have not joined"; "" when some set could."""
        nodes = list(self.nodes.values())
        slots = spec.slots_per_node
        if spec.node_ids:
            unknown = [i for i in spec.node_ids if i not in self.nodes]
            if unknown:
                return f"pinned node(s) {', '.join(unknown[:8])} have not joined"
            small = [i for i in spec.node_ids if self.nodes[i].slots < slots]
            if small:
                return "pinned node(s) " + ", ".join(
                    f"{i} ({self.nodes[i].slots} slots)" for i in small[:8]) + f" have fewer than {slots} slots"
        enough = sum(1 for n in nodes if n.slots >= slots)
        if enough >= spec.num_nodes + spec.spares:
            return ""
        if enough == len(nodes):
            return f"only {enough} node{'s' * (enough != 1)} {'has' if enough == 1 else 'have'} joined"
        most = max((n.slots for n in nodes), default=0)
        return (f"only {enough} of the {len(nodes)} joined node{'s' * (len(nodes) != 1)} "
                f"{'has' if enough == 1 else 'have'} {slots} slots or more (the most any has is {most})")

    # ---- decisions: nodes --------------------------------------------------------------------

    def decide_join(
        self, node_id: str, hostname: str, slots: int, slot_kind: str, labels: Mapping[str, str],
        auth: JoinAuth, now: float,
    ) -> tuple[ClusterEvent, ...]:
        """A node joins the cluster: a first Join spends a single-use token bound to it;
        a rejoin shows its credential (a token never replaces a credential)."""
        check_id("node_id", node_id)
        if len(hostname) > MAX_ID_LEN:
            raise RendezvousError(Code.INVALID_ARGUMENT, f"hostname is {len(hostname)} characters; at most {MAX_ID_LEN}")
        if slot_kind not in ("gpu", "cpu"):
            raise RendezvousError(Code.INVALID_ARGUMENT, f"slot_kind must be 'gpu' or 'cpu', got {shown(slot_kind)}")
        if not 0 < slots <= 4096:
            raise RendezvousError(Code.INVALID_ARGUMENT, f"slots must be in [1, 4096], got {slots}")
        labels = check_labels(labels)
        if auth.public_key and len(auth.public_key) != 32:
            raise RendezvousError(
                Code.INVALID_ARGUMENT,
                f"node_public_key must be a raw 32-byte Ed25519 key, got {len(auth.public_key)} bytes",
            )
        node = self.nodes.get(node_id)
        labels_text = json.dumps(labels, separators=(",", ":"), sort_keys=True)
        if auth.credential:
            if node is None or not hmac.compare_digest(secret_hash(auth.credential), node.credential_hash):
                raise RendezvousError(Code.UNAUTHENTICATED, f"node_credential is not valid for node_id {node_id!r}")
            public_key = auth.public_key or node.public_key
            same = (hostname or node_id, slots, slot_kind, labels, public_key) == (
                node.hostname, node.slots, node.slot_kind, node.labels, node.public_key
            )
            if same:
                return ()
            return (ClusterNodeJoined(
                node_id, hostname or node_id, slots, slot_kind, labels_text, node.credential_hash,
                public_key.hex(), "", now,
            ),)
        if not auth.token:
            raise RendezvousError(
                Code.UNAUTHENTICATED, f"node_id {node_id!r} presented no join_token and no node_credential"
            )
        if node is not None:
            raise RendezvousError(
                Code.PERMISSION_DENIED,
                f"node_id {node_id!r} already holds a node credential; a Join for it needs that "
                "credential, not a join_token",
            )
        if not auth.public_key:
            raise RendezvousError(Code.INVALID_ARGUMENT, f"node_id {node_id!r}: a first Join needs node_public_key")
        token_hash = spend_token(self.tokens, auth.token, node_id, now)
        return (ClusterNodeJoined(
            node_id, hostname or node_id, slots, slot_kind, labels_text, auth.new_credential_hash,
            auth.public_key.hex(), token_hash, now,
        ),)

    def decide_create_token(
        self, token_hash: str, ttl_s: float, node_id: str, now: float, any_node: bool = False
    ) -> tuple[ClusterEvent, ...]:
        return (new_token(token_hash, ttl_s, node_id, now, any_node),)

    def check_serves(self, node_id: str, job_id: str) -> Job:
        """PERMISSION_DENIED unless ``node_id`` was given to ``job_id`` (member or spare);
        the same answer whether or not the job exists, so a node learns nothing of others."""
        job = self.jobs.get(job_id) if isinstance(job_id, str) else None
        if job is None or node_id not in job.nodes + job.spares:
            raise RendezvousError(
                Code.PERMISSION_DENIED, f"node_id {shown(node_id)} does not serve job {shown(job_id)}"
            )
        return job

    def serves_any(self, node_ids: Iterable[str], job_id: str) -> bool:
        """One of ``node_ids`` was given ``job_id`` (an agent certificate may name several)."""
        job = self.jobs.get(job_id)
        return job is not None and not set(node_ids).isdisjoint(job.nodes + job.spares)

    def decide_node_call(self, node_id: str, credential: bytes) -> ClusterNode:
        """A later cluster call: the node joined, and the credential is its own."""
        check_id("node_id", node_id)
        node = self.nodes.get(node_id)
        if node is None:
            raise RendezvousError(Code.FAILED_PRECONDITION, f"node_id {node_id!r} has not joined; call Join first")
        if not credential:
            raise RendezvousError(Code.UNAUTHENTICATED, f"node_credential missing for node_id {node_id!r}")
        if not hmac.compare_digest(secret_hash(credential), node.credential_hash):
            raise RendezvousError(Code.PERMISSION_DENIED, f"node_credential does not belong to node_id {node_id!r}")
        return node

    def leave(self, node_id: str) -> None:
        """A draining node is out of the pool until it calls again (liveness, not persisted)."""
        self.nodes[node_id].last_seen = float("-inf")

    def note_units(self, node_id: str, live_units: Iterable[str]) -> None:
        """A heartbeat's live_units (already authenticated): the node may go back to the
        pool only once they are none."""
        live = list(live_units)
        if len(live) > MAX_LIVE_UNITS:
            raise RendezvousError(
                Code.INVALID_ARGUMENT, f"live_units lists {len(live)} jobs; at most {MAX_LIVE_UNITS}"
            )
        node = self.nodes.get(node_id)
        if node is not None:
            node.units_clear = not live

    def touch(self, node_id: str, now: float) -> None:
        node = self.nodes.get(node_id)
        if node is not None:
            node.last_seen = max(node.last_seen, now)

    # ---- decisions: jobs ---------------------------------------------------------------------

    def decide_submit(
        self, spec: JobSpec, now: float, caller: Caller = OPERATOR, wait_for_nodes: bool = False
    ) -> tuple[ClusterEvent, ...]:
        """A job id is unique forever: a finished job's id is never reused. The job
        records its submitter: only they (or an admin) may manage it. A job no set of
        the joined nodes could ever hold is refused, naming what is missing, unless the
        submitter says it waits for nodes that have not joined yet (``wait_for_nodes``)."""
        if spec.job_id in self.jobs:
            raise RendezvousError(
                Code.ALREADY_EXISTS,
                f"job_id {spec.job_id!r} exists ({self.jobs[spec.job_id].state.value}); a job is immutable "
                "and its id is never reused: submit under a new id",
            )
        if spec.num_nodes + spec.spares > MAX_JOB_NODES:
            raise RendezvousError(
                Code.INVALID_ARGUMENT,
                f"nodes {spec.num_nodes} + spares {spec.spares} is more than a job may ask for ({MAX_JOB_NODES})",
            )
        missing = "" if wait_for_nodes else self.missing_for(spec)
        if missing:
            raise RendezvousError(
                Code.FAILED_PRECONDITION,
                f"job {spec.job_id!r} {_needs(spec)}, but {missing}: it can never run on the nodes that have "
                "joined. Join nodes that can hold it first, or submit with wait_for_nodes (--wait-for-nodes)",
            )
        return (JobSubmitted(spec.job_id, spec.to_json(), now, caller.owner),)

    def decide_declare(self, spec: JobSpec, now: float) -> tuple[ClusterEvent, ...]:
        """The job a coordinator config declares: written once, RUNNING at once; a restart
        with the same config adds nothing. The same id with another plan or slots is
        refused naming both (a job is immutable: a changed plan is a new job), as is an id
        a submitted job holds. A changed [launch] (command, env, restarts) is recorded."""
        job = self.jobs.get(spec.job_id)
        if job is None:
            return (JobSubmitted(spec.job_id, spec.to_json(), now, declared=True),)
        if not job.declared:
            raise RendezvousError(
                Code.ALREADY_EXISTS,
                f"[job] id {spec.job_id!r} is a job submitted through the Jobs API ({job.state.value}); "
                "the config's job needs an id of its own",
            )
        was, now_is = job.spec, spec
        if (was.plan.digest(), was.slots_per_node) != (now_is.plan.digest(), now_is.slots_per_node):
            raise RendezvousError(
                Code.FAILED_PRECONDITION,
                f"job {spec.job_id!r} was declared with plan digest {was.plan.digest().hex()} and {was.slots_per_node} "
                f"slots per node; this config declares plan digest {now_is.plan.digest().hex()} and "
                f"{now_is.slots_per_node}: a job is immutable, so a changed [plan] is a new job (a new [job] id)",
            )
        if was == now_is:
            return ()
        return (JobSubmitted(spec.job_id, spec.to_json(), now, declared=True),)

    def undeclared_running(self, declared: Iterable[str]) -> list[str]:
        """Declared jobs still RUNNING that the config no longer declares."""
        keep = set(declared)
        return [job.spec.job_id for job in self.jobs.values()
                if job.declared and job.state is JobState.RUNNING and job.spec.job_id not in keep]

    def check_undeclared(self, declared: Iterable[str]) -> None:
        """FAILED_PRECONDITION naming a declared job still RUNNING that the config no longer
        declares (its [job] id changed, or it names none now): only the config that declared
        it holds its join settings, and a changed config must not end a job by surprise."""
        keep = set(declared)
        for job_id in self.undeclared_running(keep)[:1]:
            raise RendezvousError(
                Code.FAILED_PRECONDITION,
                f"job {job_id!r}, declared by this coordinator's config ([job] id), is RUNNING; this config "
                f"declares {', '.join(repr(i) for i in sorted(keep)) or 'no job'}. Serve it with the config that "
                f"declared it until it ends (or `meshgate job cancel {job_id}`; or --reset-state --job {job_id}), "
                "then change the config",
            )

    def check_may_manage(self, job_id: str, caller: Caller, action: str) -> Job:
        """PERMISSION_DENIED naming the job and the caller unless the caller owns the job
        or is an admin."""
        job = self.job(job_id)
        if not caller.may_manage(job):
            raise RendezvousError(
                Code.PERMISSION_DENIED,
                f"{caller.describe()} may not {action} job {job_id!r}: only its owner "
                f"{shown(job.owner or '(anonymous)')} or an admin may",
            )
        return job

    def list_jobs(
        self, start: int, page_size: int, state: Optional[JobState] = None, owner: str = ""
    ) -> tuple[list[Job], int]:
        """One page of jobs in submission order from position ``start``, those in
        ``state`` and of ``owner`` when given; and where the next page starts (-1: none)."""
        if not 0 <= page_size <= MAX_PAGE_SIZE:
            raise RendezvousError(Code.INVALID_ARGUMENT, f"page_size {page_size} is not in [0, {MAX_PAGE_SIZE}]")
        page_size = page_size or DEFAULT_PAGE_SIZE
        page: list[Job] = []
        jobs = list(self.jobs.values())
        for position in range(start, len(jobs)):
            job = jobs[position]
            if (state is None or job.state is state) and (not owner or job.owner == owner):
                if len(page) == page_size:
                    return page, position
                page.append(job)
        return page, -1

    def decide_allocate(self, now: float) -> tuple[ClusterEvent, ...]:
        """Oldest PENDING job first, whole idle nodes, no preemption. A job that does not
        fit holds every node it could ever use (see usable_nodes) for itself: a later job
        may pass it only on nodes it could never use, so passing never delays an earlier
        job's start (and a large job is never starved by small ones), while a job that
        waits for 8-slot nodes does not stop a later one from running on idle 2-slot nodes."""
        events: list[ClusterEvent] = []
        held: set[str] = set()  # allocated in this round, or held for an earlier waiting job
        idle = {n.node_id for n in self.idle_nodes(now)}
        for job in self.pending.values():
            if not idle - held:
                break
            allocation = self._fit(job.spec, now, held)
            if allocation is None:
                held |= self.usable_nodes(job.spec)
                continue
            held.update(allocation.nodes + allocation.spares)
            events.append(JobAllocated(job.spec.job_id, ",".join(allocation.nodes), ",".join(allocation.spares), now))
        return tuple(events)

    def _fit(self, spec: JobSpec, now: float, taken: set[str]) -> Optional[Allocation]:
        idle = [n for n in self.idle_nodes(now) if n.node_id not in taken and n.slots >= spec.slots_per_node]
        need = spec.num_nodes + spec.spares
        if spec.node_ids:
            by_id = {n.node_id: n for n in idle}
            if any(i not in by_id for i in spec.node_ids):
                return None
            rest = [n for n in idle if n.node_id not in spec.node_ids]
            spares = _closest(rest, [by_id[i] for i in spec.node_ids], spec.spares)
            if len(spares) < spec.spares:
                return None
            return Allocation(spec.job_id, spec.node_ids, tuple(n.node_id for n in spares))
        if len(idle) < need:
            return None
        chosen = _local_group(idle, need)
        members, spares = chosen[: spec.num_nodes], chosen[spec.num_nodes:]
        return Allocation(spec.job_id, tuple(n.node_id for n in members), tuple(n.node_id for n in spares))

    def decide_cancel(self, job_id: str, reason: str, now: float) -> tuple[ClusterEvent, ...]:
        job = self.job(job_id)
        if job.state.ended:
            raise RendezvousError(
                Code.FAILED_PRECONDITION, f"job {job_id!r} already ended: {job.state.value} ({job.reason[:200]})"
            )
        return (JobEnded(job_id, JobState.CANCELLED.value, one_line(reason or "cancelled"), now),)

    def decide_finish(self, job_id: str, succeeded: bool, reason: str, now: float) -> tuple[ClusterEvent, ...]:
        """A job of external workers (no command) ends when its submitter says so; one whose
        agents launch a command ends from its workers' exits, never by word."""
        job = self.job(job_id)
        if job.state is not JobState.RUNNING:
            raise RendezvousError(
                Code.FAILED_PRECONDITION, f"job {job_id!r} is {job.state.value}, not RUNNING: nothing to finish"
            )
        if job.spec.command:
            raise RendezvousError(
                Code.FAILED_PRECONDITION,
                f"job {job_id!r} runs a command on its nodes: it ends from its workers' exits "
                "(FinishJob is for jobs of external workers, e.g. Ray); cancel it instead",
            )
        state = JobState.SUCCEEDED if succeeded else JobState.FAILED
        text = one_line(reason or ("finished by its submitter" if succeeded else "failed, said its submitter"))
        return (JobEnded(job_id, state.value, text, now),)

    def decide_end(self, job_id: str, state: JobState, reason: str, now: float) -> tuple[ClusterEvent, ...]:
        job = self.jobs[job_id]
        if job.state is not JobState.RUNNING or not state.ended:
            return ()
        return (JobEnded(job_id, state.value, reason, now),)

    def decide_summarize(self, job_id: str, status: str, now: float) -> tuple[ClusterEvent, ...]:
        """An ended job's final rendezvous, once (its engine is closed after this)."""
        job = self.jobs[job_id]
        if not job.state.ended or job.summary:
            return ()
        return (JobSummarized(job_id, status, now),)

    def decide_prune(self, now: float, retention_s: float, limit: int = 64) -> tuple[ClusterEvent, ...]:
        """Ended jobs whose own log has been kept ``retention_s`` since they ended, and that
        are summarized (a job ended before summaries existed keeps its log: it is read from
        there). At most ``limit`` at a time, in the order they were summarized (which is
        the order they ended: a summary follows its end at once), up to the first one still
        within the retention, so a tick costs the jobs it prunes, not every job kept."""
        events: list[ClusterEvent] = []
        for job in self.unpruned.values():
            if len(events) >= limit or job.ended_at + retention_s > now:
                break
            events.append(JobLogPruned(job.spec.job_id, now))
        return tuple(events)

    # ---- apply ---------------------------------------------------------------------------------

    def apply(self, event: ClusterEvent) -> None:
        if isinstance(event, ClusterNodeJoined):
            known = self.nodes.get(event.node_id)
            node = ClusterNode(
                event.node_id, event.hostname, event.slots, event.slot_kind, json.loads(event.labels),
                event.credential_hash, bytes.fromhex(event.public_key), event.at, event.at,
                job_id=known.job_id if known else "", units_clear=known.units_clear if known else True,
            )
            if known is not None:
                node.joined_at, node.last_seen = known.joined_at, max(known.last_seen, event.at)
            self.nodes[event.node_id] = node
            if event.token_hash:
                self.tokens[event.token_hash].used_by = event.node_id
        elif isinstance(event, TokenCreated):
            self.tokens[event.token_hash] = Token(event.expires_at, event.node_id)
        elif isinstance(event, JobSubmitted) and event.declared:
            spec = JobSpec.from_json(event.spec, declared=True)
            known = self.jobs.get(event.job_id)
            if known is not None:
                known.spec = spec
            else:
                self.jobs[event.job_id] = Job(spec, event.at, JobState.RUNNING, owner=event.owner, declared=True)
        elif isinstance(event, JobSubmitted):
            self.jobs[event.job_id] = self.pending[event.job_id] = Job(
                JobSpec.from_json(event.spec), event.at, owner=event.owner
            )
        elif isinstance(event, JobAllocated):
            job = self.jobs[event.job_id]
            self.pending.pop(event.job_id, None)
            job.state = JobState.RUNNING
            job.nodes = tuple(filter(None, event.nodes.split(",")))
            job.spares = tuple(filter(None, event.spares.split(",")))
            for node_id in job.nodes + job.spares:
                self.nodes[node_id].job_id = event.job_id
        elif isinstance(event, JobEnded):
            job = self.jobs[event.job_id]
            self.pending.pop(event.job_id, None)
            job.state, job.reason, job.ended_at = JobState(event.state), event.reason, event.at
            for node_id in job.nodes + job.spares:
                if self.nodes[node_id].job_id == event.job_id:
                    # Back to the pool once its agent shows the job's unit empty (note_units).
                    self.nodes[node_id].job_id, self.nodes[node_id].units_clear = "", False
        elif isinstance(event, JobSummarized):
            job = self.unpruned[event.job_id] = self.jobs[event.job_id]
            job.summary = event.status
        elif isinstance(event, JobLogPruned):
            self.unpruned.pop(event.job_id, None)
            self.jobs[event.job_id].log_pruned = True
        else:  # pragma: no cover - a programming error, not input
            raise TypeError(f"unknown cluster event {event!r}")

    def apply_all(self, events: Iterable[ClusterEvent]) -> None:
        for event in events:
            self.apply(event)


def _needs(spec: JobSpec) -> str:
    """e.g. "needs 4 nodes of 8 slots (+1 spare)"."""
    need = f"needs {spec.num_nodes} node{'s' * (spec.num_nodes != 1)} of {spec.slots_per_node} slots"
    if spec.spares:
        need += f" (+{spec.spares} spare{'s' * (spec.spares != 1)})"
    return need


def one_line(text: str, limit: int = 200) -> str:
    """A submitter's reason as every view prints it: one line of printable characters (a
    newline or NUL in a cancel reason must not forge a row of `meshgate job list`), bounded."""
    return "".join(c if c.isprintable() else " " for c in text[:limit])


def check_labels(labels: Mapping[str, str]) -> dict[str, str]:
    if len(labels) > MAX_LABELS:
        raise RendezvousError(Code.INVALID_ARGUMENT, f"labels: {len(labels)} given; at most {MAX_LABELS}")
    out = {}
    for key, value in labels.items():
        for what, text in (("key", key), ("value", value)):
            if not isinstance(text, str) or not text or len(text) > MAX_LABEL_LEN or not text.replace(
                "-", "").replace("_", "").replace(".", "").isalnum():
                raise RendezvousError(
                    Code.INVALID_ARGUMENT,
                    f"labels: {what} {shown(text)} must be 1..{MAX_LABEL_LEN} characters of [A-Za-z0-9._-]",
                )
        out[key] = value
    return out


def _locality(node: ClusterNode) -> tuple[str, ...]:
    return tuple(node.labels.get(label, "") for label in LOCALITY_LABELS)


def _local_group(idle: list[ClusterNode], need: int) -> list[ClusterNode]:
    """``need`` nodes as close together as the labels allow: the smallest switch group
    that holds them all (then the smallest rack group), else the largest groups first.
    Node-rank order follows (switch, rack, node_id), so neighbours in rank sit together."""
    idle = sorted(idle, key=lambda n: (_locality(n), n.node_id))
    for depth in range(len(LOCALITY_LABELS)):
        groups: dict[tuple[str, ...], list[ClusterNode]] = {}
        for node in idle:
            groups.setdefault(_locality(node)[depth:depth + 1], []).append(node)
        fitting = [g for key, g in groups.items() if key != ("",) and len(g) >= need]
        if fitting:
            return min(fitting, key=lambda g: (len(g), _locality(g[0])))[:need]
    groups = {}
    for node in idle:
        groups.setdefault(_locality(node)[:1], []).append(node)
    ordered = sorted(groups.values(), key=lambda g: (-len(g), _locality(g[0])))
    return [n for group in ordered for n in group][:need]


def _closest(candidates: list[ClusterNode], members: list[ClusterNode], count: int) -> list[ClusterNode]:
    """Spares for a pinned job: those sharing the most locality labels with its nodes."""
    near = {_locality(m) for m in members}

    def distance(node: ClusterNode) -> tuple:
        loc = _locality(node)
        shared = max(sum(a == b and a != "" for a, b in zip(loc, other)) for other in near) if near else 0
        return (-shared, node.node_id)

    return sorted(candidates, key=distance)[:count]


__all__ = [
    "Allocation",
    "CLUSTER_LOG_ID",
    "Caller",
    "OPERATOR",
    "check_job_id",
    "loggable",
    "ClusterEvent",
    "ClusterNode",
    "ClusterNodeJoined",
    "ClusterState",
    "DEFAULT_RETENTION_S",
    "Job",
    "JobAllocated",
    "JobEnded",
    "JobLogPruned",
    "JobSpec",
    "JobState",
    "JobSubmitted",
    "JobSummarized",
    "MAX_JOB_NODES",
    "check_labels",
]
