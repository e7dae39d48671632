"""The rendezvous state machine: joins, ranks, generations, the barrier. Pure.

No sockets, no clock (``now`` is passed in), no files. Every change is an Event:
``decide_*`` validates a request against the state and returns the events it would
cause (or raises RendezvousError with a status code and a message naming the field);
``apply`` folds one event into the state. The owner persists the events through the
store before it applies and acknowledges them, and replays them on restart, so a
restarted coordinator rebuilds exactly the state it acknowledged.
"""

from __future__ import annotations

import enum
import hmac
import re
from dataclasses import dataclass, field
from typing import Iterable, Literal, Optional, Union

from meshgate.attestation import VouchRefused, secret_hash, verify_vouch
from meshgate.plan import ParallelPlan, PlanError, compress_ranks


class Code(enum.Enum):
    """gRPC status names, without importing grpc here (the servicer maps them)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    NOT_FOUND = "NOT_FOUND"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    UNAVAILABLE = "UNAVAILABLE"
    DATA_LOSS = "DATA_LOSS"


class RendezvousError(Exception):
    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"

    def __reduce__(self):
        return (type(self), (self.code, self.message))


TopologyPolicy = Literal["allow", "warn", "refuse"]


class RankMode(enum.Enum):
    """Who picks a worker's rank. ASSIGNED: meshgate, from the node's block
    (node_rank * slots_per_node + local_rank); a Register carrying a claim is refused.
    CLAIMED: the framework (Ray, Fabric); the claim must be vouched for by the node's
    agent (the vouch names the rank) and passes the topology policy."""

    ASSIGNED = "assigned"
    CLAIMED = "claimed"


MIN_NONCE, MAX_NONCE = 16, 64
MAX_DETAIL = 300  # how much of an agent's exit detail a job's reason quotes
MAX_ID_LEN = 253
_ID_RE = re.compile(r"^[A-Za-z0-9._:@/+=\-]+$")
_HOST_RE = re.compile(r"^[A-Za-z0-9._:%\-]+$")  # a host name, IPv4 or IPv6 (with a zone)


@dataclass(frozen=True)
class RendezvousConfig:
    job_id: str
    plan: ParallelPlan
    # Assigned mode: rank = node_rank * slots_per_node + local_rank.
    slots_per_node: int
    # Node ids pinned to node ranks 0, 1, ...; other nodes fill the free ranks in join order.
    node_order: tuple[str, ...] = ()
    # Claimed mode: what to do when a TP or CP group spans nodes.
    topology_policy: TopologyPolicy = "warn"
    # Agents' Join must present this token (issue #5 makes tokens single-use and expiring).
    join_token: str = ""
    # Without a spare, how long the world waits for a lost node before the job fails.
    lost_node_timeout_s: float = 300.0
    # Register must carry a vouch signed by the worker's node agent.
    require_vouch: bool = False
    # None accepts both modes, request by request: plaintext development only (the
    # TOML config pins a mode whenever vouches are required).
    mode: Optional[RankMode] = None
    # How many times a worker's failure may restart the whole job into a new generation
    # before the job fails (0: the first failure fails it; [launch] restart_policy "never").
    max_restarts: int = 0

    def __post_init__(self) -> None:
        check_id("job_id", self.job_id)
        world = self.plan.world_size
        if not isinstance(self.slots_per_node, int) or isinstance(self.slots_per_node, bool):
            raise ValueError(f"slots_per_node must be an integer, got {self.slots_per_node!r}")
        if self.slots_per_node < 1 or world % self.slots_per_node:
            raise ValueError(
                f"slots_per_node {self.slots_per_node} must divide world_size {world}"
            )
        if len(set(self.node_order)) != len(self.node_order):
            raise ValueError(f"node_order has duplicates: {list(self.node_order)}")
        if len(self.node_order) > self.num_nodes:
            raise ValueError(
                f"node_order names {len(self.node_order)} nodes; the plan needs {self.num_nodes}"
            )
        for node_id in self.node_order:
            check_id("node_order", node_id)
        if self.topology_policy not in ("allow", "warn", "refuse"):
            raise ValueError(
                f"topology_policy must be allow, warn or refuse, got {self.topology_policy!r}"
            )

    @property
    def num_nodes(self) -> int:
        return self.plan.world_size // self.slots_per_node


SHOWN_PREFIX = 64


def shown(value: object, limit: int = SHOWN_PREFIX) -> str:
    """How an error message echoes caller input: the repr of a bounded prefix, so a
    10 kB id never outgrows a client's metadata limit."""
    text = value if isinstance(value, (str, bytes)) else str(value)
    return repr(text if len(text) <= limit else text[:limit] + ("..." if isinstance(text, str) else b"..."))


def check_master_offer(offer: Optional[tuple[str, int]]) -> None:
    """INVALID_ARGUMENT naming master_addr / master_port unless ``offer`` is None or a
    host (1..253 characters, no spaces) and a port in 1..65535."""
    if offer is None:
        return
    host, port = offer
    if not isinstance(host, str) or not host or len(host) > MAX_ID_LEN or not _HOST_RE.match(host):
        raise RendezvousError(
            Code.INVALID_ARGUMENT,
            f"master_addr {shown(host)} must be an IP address or host name of 1..{MAX_ID_LEN} characters",
        )
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise RendezvousError(Code.INVALID_ARGUMENT, f"master_port {shown(port)} out of range [1, 65535]")


def check_id(name: str, value: str) -> None:
    if not isinstance(value, str) or not value:
        raise RendezvousError(Code.INVALID_ARGUMENT, f"{name} must be a non-empty string")
    if len(value) > MAX_ID_LEN or not _ID_RE.match(value):
        raise RendezvousError(
            Code.INVALID_ARGUMENT,
            f"{name} {shown(value)} must be 1..{MAX_ID_LEN} characters of [A-Za-z0-9._:@/+=-]",
        )


def new_token(token_hash: str, ttl_s: float, node_id: str, now: float, any_node: bool = False) -> "TokenCreated":
    """A join token admits one named node; one for any node only when asked for explicitly."""
    if node_id and any_node:
        raise RendezvousError(Code.INVALID_ARGUMENT, "node_id and any_node exclude each other")
    if node_id:
        check_id("node_id", node_id)
    elif not any_node:
        raise RendezvousError(
            Code.INVALID_ARGUMENT,
            "node_id must name the node the token admits (or set any_node for a token any node may spend)",
        )
    if not 0 < ttl_s <= 7 * 24 * 3600:
        raise RendezvousError(Code.INVALID_ARGUMENT, f"ttl_s {ttl_s:g} out of range (0, 604800]")
    return TokenCreated(token_hash, now + ttl_s, node_id, now)


def spend_token(tokens: "dict[str, Token]", token_text: str, node_id: str, now: float) -> str:
    """The hash of ``token_text`` if it may admit ``node_id`` now; UNAUTHENTICATED for a
    token that is unknown, used, expired or bound to another node."""
    token_hash = secret_hash(token_text)
    token = tokens.get(token_hash)
    if token is None:
        raise RendezvousError(Code.UNAUTHENTICATED, f"join_token for node_id {node_id!r} is not known")
    if token.used_by:
        raise RendezvousError(
            Code.UNAUTHENTICATED, f"join_token for node_id {node_id!r} was already used (by node {token.used_by!r})"
        )
    if now >= token.expires_at:
        raise RendezvousError(
            Code.UNAUTHENTICATED, f"join_token for node_id {node_id!r} expired {now - token.expires_at:.0f}s ago"
        )
    if token.node_id and token.node_id != node_id:
        raise RendezvousError(Code.UNAUTHENTICATED, f"join_token admits node {token.node_id!r}, not node_id {node_id!r}")
    return token_hash


# ---- events --------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeJoined:
    node_id: str
    node_rank: int
    at: float
    # Set when an agent joined (Nodes.Join); empty when a worker's Register named the node.
    hostname: str = ""
    slots: int = 0
    slot_kind: str = ""


@dataclass(frozen=True)
class NodeAdopted:
    """An agent joins a node that workers' Registers had named before it: the node
    becomes agent-managed (heartbeats, vouches) and keeps its node rank."""

    node_id: str
    hostname: str
    slots: int
    slot_kind: str
    at: float


@dataclass(frozen=True)
class NodeStateChanged:
    node_id: str
    state: str  # "active", "lost", "left"
    at: float
    reason: str = ""


@dataclass(frozen=True)
class RankAssigned:
    worker_id: str
    rank: int
    node_id: str
    local_rank: int
    at: float
    claimed: bool = False
    vouch_id: str = ""


@dataclass(frozen=True)
class NodeReplaced:
    """A spare takes over a lost node's node_rank and so its whole rank block."""

    spare_id: str
    lost_id: str
    node_rank: int
    at: float


@dataclass(frozen=True)
class JobFailed:
    reason: str
    at: float


@dataclass(frozen=True)
class TokenCreated:
    """A join token; only its sha256 is ever stored."""

    token_hash: str
    expires_at: float
    node_id: str  # "" admits any node
    at: float


@dataclass(frozen=True)
class NodeKeyed:
    """A node's credentials: its credential's hash, its vouch-signing public key, and
    the single-use token it spent to get them ("" on a credential rejoin)."""

    node_id: str
    credential_hash: str
    public_key: str  # hex of the raw Ed25519 key
    token_hash: str
    at: float


@dataclass(frozen=True)
class MasterChosen:
    host: str
    port: int


@dataclass(frozen=True)
class MasterOffered:
    """The master a node's agent can host (its advertised address, a port it reserved).
    The one offered by the node holding node rank 0 is the job's master: every agent
    exports it to its workers as MASTER_ADDR / MASTER_PORT before they start."""

    node_id: str
    host: str
    port: int


@dataclass(frozen=True)
class WorkerSucceeded:
    """A worker of the current generation exited 0 (not stopped by its agent). When every
    worker of the generation has, the job succeeded."""

    node_id: str
    local_rank: int
    generation: int
    at: float


@dataclass(frozen=True)
class GenerationBumped:
    generation: int
    reason: str
    # A worker failed inside the generation: every rank is released and every worker of
    # the job relaunches and registers again (same node blocks, so the same ranks); the
    # world re-forms only when all of them are back. Counts against max_restarts.
    worker_restart: bool = False


Event = Union[
    NodeJoined,
    NodeAdopted,
    NodeStateChanged,
    NodeReplaced,
    NodeKeyed,
    TokenCreated,
    RankAssigned,
    MasterChosen,
    MasterOffered,
    GenerationBumped,
    JobFailed,
    WorkerSucceeded,
]


@dataclass(frozen=True)
class AdmittedNode:
    """A cluster node given to this job (jobs.py allocated it; the cluster authenticated
    it): it joins the job's state with its node rank (-1: a spare) and its credentials,
    so the job's own Join, vouch and heartbeat checks work as for any node."""

    node_id: str
    node_rank: int
    hostname: str
    slots: int
    slot_kind: str
    credential_hash: str
    public_key: str  # hex


@dataclass(frozen=True)
class JoinAuth:
    """What an agent presents at Join, and the credential hash it would receive."""

    token: str = ""
    credential: bytes = b""
    public_key: bytes = b""
    new_credential_hash: str = ""


@dataclass
class Token:
    expires_at: float
    node_id: str
    used_by: str = ""
# "spare": joined beyond the plan's need; "replaced": lost, and a spare took its block.
NODE_STATES = ("active", "spare", "lost", "left", "replaced")


# ---- requests and state ----------------------------------------------------------------


@dataclass(frozen=True)
class RegisterInput:
    job_id: str
    worker_id: str
    nonce: bytes
    node_id: str
    local_rank: int
    claimed_rank: Optional[int]  # None: assigned mode
    plan_digest: bytes = b""
    generation: Optional[int] = None
    endpoint_host: str = ""
    endpoint_port: int = 0
    vouch: object = None  # a meshgate.v1 WorkerVouch, or None


@dataclass
class Node:
    node_id: str
    node_rank: int
    joined_at: float
    last_seen: float
    registered: int = 0
    state: str = "active"
    hostname: str = ""
    slots: int = 0
    slot_kind: str = ""
    # Agent-managed nodes heartbeat; nodes only named by Registers are not swept.
    managed: bool = False
    exits: list[str] = field(default_factory=list)
    credential_hash: str = ""
    public_key: bytes = b""
    # The master this node's agent offered at its latest Join (MasterOffered).
    master_offer: Optional[tuple[str, int]] = None
    # The agent process seen last (JoinRequest.agent_instance): liveness, not persisted.
    agent_instance: str = ""


@dataclass(frozen=True)
class Assignment:
    worker_id: str
    rank: int
    node_id: str
    node_rank: int
    local_rank: int


@dataclass(frozen=True)
class RegisterDecision:
    assignment: Assignment
    events: tuple[Event, ...]
    warnings: tuple[str, ...] = ()

    @property
    def is_new(self) -> bool:
        return any(isinstance(e, RankAssigned) for e in self.events)


@dataclass
class RendezvousState:
    config: RendezvousConfig
    opened_at: float = 0.0
    generation: int = 0
    nodes: dict[str, Node] = field(default_factory=dict)
    node_ids_by_rank: dict[int, str] = field(default_factory=dict)
    by_worker: dict[str, Assignment] = field(default_factory=dict)
    by_rank: dict[int, Assignment] = field(default_factory=dict)
    worker_seen: dict[str, float] = field(default_factory=dict)
    master: Optional[tuple[str, int]] = None
    tokens: dict[str, Token] = field(default_factory=dict)
    used_vouches: dict[str, str] = field(default_factory=dict)
    failed: str = ""
    lost_since: dict[str, float] = field(default_factory=dict)
    claimed_seen: bool = False
    # Generations restarted because a worker failed (GenerationBumped.worker_restart).
    worker_restarts: int = 0
    # (node_id, local_rank) of the current generation's workers that exited 0.
    succeeded_workers: set[tuple[str, int]] = field(default_factory=set)
    # No unpinned node rank below this is free. Node ranks are taken, never given back
    # (a spare takes over its lost node's number), so it only grows: kept by apply, so
    # finding a free rank costs O(1), not O(nodes), per join.
    free_node_rank_from: int = 0

    # ---- derived -------------------------------------------------------------------------

    @property
    def plan(self) -> ParallelPlan:
        return self.config.plan

    @property
    def world_size(self) -> int:
        return self.config.plan.world_size

    @property
    def complete(self) -> bool:
        return len(self.by_rank) == self.world_size

    @property
    def succeeded(self) -> bool:
        """Every worker of the current generation exited 0 (never after a failure)."""
        return not self.failed and len(self.succeeded_workers) >= self.world_size

    @property
    def job_master(self) -> Optional[tuple[str, int]]:
        """The master every rank uses: the one node rank 0's agent offered (agents export
        it to their workers before they start), else the endpoint rank 0's Register named."""
        node_id = self.node_ids_by_rank.get(0)
        node = self.nodes.get(node_id) if node_id is not None else None
        if node is not None and node.state == "active" and node.master_offer is not None:
            return node.master_offer
        return self.master

    def missing_ranks(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.by_rank]

    def missing_by_node(self) -> dict[str, list[int]]:
        """Missing ranks grouped by the node expected to hold them (assigned layout)."""
        out: dict[str, list[int]] = {}
        slots = self.config.slots_per_node
        if self.claimed_seen:
            # The framework places claimed ranks; no node is expected to hold a given one.
            missing = self.missing_ranks()
            return {"unclaimed (claimed mode)": missing} if missing else {}
        for rank in self.missing_ranks():
            node_rank = rank // slots
            node_id = self.node_ids_by_rank.get(node_rank)
            label = node_id if node_id else f"node_rank {node_rank} (not joined)"
            out.setdefault(label, []).append(rank)
        return out

    def describe_missing(self, limit: int = 16) -> str:
        groups = self.missing_by_node()
        parts = [f"{node}: ranks {compress_ranks(ranks)}" for node, ranks in groups.items()]
        more = f"; and {len(parts) - limit} more nodes" if len(parts) > limit else ""
        total = sum(len(r) for r in groups.values())
        return f"{total} of {self.world_size} ranks missing: " + "; ".join(parts[:limit]) + more

    # ---- decisions (pure; raise RendezvousError) ---------------------------------------

    def decide_register(self, request: RegisterInput, now: float) -> RegisterDecision:
        self._check_common(request)
        vouch_id = self._check_vouch(request, now)
        existing = self.by_worker.get(request.worker_id)
        if existing is not None:
            return self._decide_again(existing, request)

        if self.complete:
            raise RendezvousError(
                Code.RESOURCE_EXHAUSTED,
                f"world is full: all {self.world_size} ranks of generation {self.generation} "
                f"are held; worker_id {request.worker_id!r} is not one of them",
            )

        events: list[Event] = []
        node = self.nodes.get(request.node_id)
        if node is not None and node.node_rank < 0:
            raise RendezvousError(
                Code.FAILED_PRECONDITION,
                f"node_id {request.node_id!r} is {node.state} and holds no rank block; its "
                "workers register once it has replaced a lost node",
            )
        if node is not None:
            node_rank = node.node_rank
        elif request.claimed_rank is None:
            node_rank = self._free_node_rank(request.node_id)
            events.append(NodeJoined(request.node_id, node_rank, now))
        else:
            node_rank = self._next_claimed_node_rank()
            events.append(NodeJoined(request.node_id, node_rank, now))

        if request.claimed_rank is None:
            rank = node_rank * self.config.slots_per_node + request.local_rank
        else:
            rank = request.claimed_rank
        holder = self.by_rank.get(rank)
        if holder is not None:
            raise RendezvousError(
                Code.ALREADY_EXISTS,
                f"rank {rank} is already held by worker_id {holder.worker_id!r} on node "
                f"{holder.node_id!r}; worker_id {request.worker_id!r} cannot take it",
            )
        warnings: list[str] | tuple[()] = ()
        if request.claimed_rank is not None:
            self._check_node_share(rank, request.node_id, node)
            warnings = self._check_topology(rank, request.node_id)
        assignment = Assignment(request.worker_id, rank, request.node_id, node_rank, request.local_rank)
        events.append(
            RankAssigned(
                request.worker_id,
                rank,
                request.node_id,
                request.local_rank,
                now,
                claimed=request.claimed_rank is not None,
                vouch_id=vouch_id,
            )
        )
        if rank == 0 and request.endpoint_host:
            events.append(MasterChosen(request.endpoint_host, request.endpoint_port))
        return RegisterDecision(assignment, tuple(events), tuple(warnings))

    def _check_vouch(self, request: RegisterInput, now: float) -> str:
        """PERMISSION_DENIED unless the worker's node agent vouched for it, for this job,
        node, generation and local rank, and no other worker spent the vouch."""
        if not self.config.require_vouch:
            return ""
        node = self.nodes.get(request.node_id)
        if node is None or not node.public_key:
            raise RendezvousError(
                Code.PERMISSION_DENIED,
                f"node_id {request.node_id!r} has no joined agent to vouch for worker_id {request.worker_id!r}",
            )
        if request.vouch is None:
            raise RendezvousError(
                Code.PERMISSION_DENIED, f"worker_id {request.worker_id!r} brought no vouch from its node agent"
            )
        try:
            claims = verify_vouch(
                request.vouch,
                node.public_key,
                job_id=request.job_id,
                node_id=request.node_id,
                generation=self.generation,
                local_rank=request.local_rank,
                now=now,
                rank=request.claimed_rank,
            )
        except VouchRefused as exc:
            raise RendezvousError(Code.PERMISSION_DENIED, f"worker_id {request.worker_id!r}: {exc}") from None
        vouch_id = claims.vouch_id.hex()
        spent_by = self.used_vouches.get(vouch_id)
        if spent_by is not None and spent_by != request.worker_id:
            raise RendezvousError(
                Code.PERMISSION_DENIED,
                f"vouch {vouch_id[:12]}... was already used by worker_id {spent_by!r}",
            )
        return vouch_id

    def _decide_again(self, existing: Assignment, request: RegisterInput) -> RegisterDecision:
        """Idempotent Register: same identity, same place, same rank."""
        if existing.node_id != request.node_id:
            raise RendezvousError(
                Code.ALREADY_EXISTS,
                f"worker_id {request.worker_id!r} holds rank {existing.rank} on node "
                f"{existing.node_id!r}; it cannot register again from node {request.node_id!r}",
            )
        asked = request.claimed_rank
        if asked is not None and asked != existing.rank:
            raise RendezvousError(
                Code.ALREADY_EXISTS,
                f"worker_id {request.worker_id!r} holds rank {existing.rank}; it cannot claim "
                f"rank {asked}",
            )
        if request.local_rank != existing.local_rank:
            raise RendezvousError(
                Code.ALREADY_EXISTS,
                f"worker_id {request.worker_id!r} holds local_rank {existing.local_rank}; it "
                f"asked for local_rank {request.local_rank}",
            )
        events: tuple[Event, ...] = ()
        if existing.rank == 0 and request.endpoint_host and self.master is None:
            events = (MasterChosen(request.endpoint_host, request.endpoint_port),)
        return RegisterDecision(existing, events)

    def _check_common(self, request: RegisterInput) -> None:
        check_id("job_id", request.job_id)
        self.check_job(request.job_id)
        check_id("worker_id", request.worker_id)
        check_id("node_id", request.node_id)
        if not MIN_NONCE <= len(request.nonce) <= MAX_NONCE:
            raise RendezvousError(
                Code.INVALID_ARGUMENT,
                f"nonce must be {MIN_NONCE}..{MAX_NONCE} bytes, got {len(request.nonce)}",
            )
        if request.plan_digest:
            if len(request.plan_digest) != 32:
                raise RendezvousError(
                    Code.INVALID_ARGUMENT,
                    f"plan_digest must be 32 bytes (sha256) or empty, got {len(request.plan_digest)}",
                )
            if request.plan_digest != self.plan.digest():
                raise RendezvousError(
                    Code.FAILED_PRECONDITION,
                    f"plan_digest {request.plan_digest.hex()[:16]}... differs from this job's "
                    f"plan {self.plan.digest().hex()[:16]}... ({self.plan.describe()})",
                )
        if request.generation is not None and request.generation != self.generation:
            raise RendezvousError(
                Code.FAILED_PRECONDITION,
                f"generation {request.generation} is not the current generation {self.generation}",
            )
        mode = self.config.mode
        if mode is RankMode.ASSIGNED and request.claimed_rank is not None:
            raise RendezvousError(
                Code.INVALID_ARGUMENT,
                f"mode: job {self.config.job_id!r} assigns ranks (mode = \"assigned\"); a Register "
                f"must not claim one (claimed rank {request.claimed_rank}): use assigned {{local_rank}}",
            )
        if mode is RankMode.CLAIMED and request.claimed_rank is None:
            raise RendezvousError(
                Code.INVALID_ARGUMENT,
                f"mode: job {self.config.job_id!r} takes claimed ranks (mode = \"claimed\"); a Register "
                f"must claim one: use claimed {{rank, local_rank}}",
            )
        if request.claimed_rank is None:
            if not 0 <= request.local_rank < self.config.slots_per_node:
                raise RendezvousError(
                    Code.INVALID_ARGUMENT,
                    f"local_rank {request.local_rank} out of range [0, "
                    f"{self.config.slots_per_node}) (slots_per_node)",
                )
        elif not 0 <= request.claimed_rank < self.world_size:
            raise RendezvousError(
                Code.INVALID_ARGUMENT,
                f"rank {request.claimed_rank} out of range [0, {self.world_size})",
            )
        elif not 0 <= request.local_rank < self.world_size:
            raise RendezvousError(
                Code.INVALID_ARGUMENT,
                f"local_rank {request.local_rank} out of range [0, {self.world_size})",
            )
        if (request.endpoint_host or request.endpoint_port) and not 0 < request.endpoint_port < 65536:
            raise RendezvousError(
                Code.INVALID_ARGUMENT,
                f"endpoint_port {request.endpoint_port} out of range [1, 65535]",
            )
        if len(request.endpoint_host) > 255:
            raise RendezvousError(
                Code.INVALID_ARGUMENT,
                f"endpoint_host is {len(request.endpoint_host)} characters; at most 255",
            )

    def _free_node_rank(self, node_id: str) -> int:
        order = self.config.node_order
        if node_id in order:
            return order.index(node_id)
        for node_rank in range(max(self.free_node_rank_from, len(order)), self.config.num_nodes):
            if node_rank not in self.node_ids_by_rank:
                return node_rank
        held = ", ".join(
            f"{r}={self.node_ids_by_rank.get(r, order[r] if r < len(order) else '?')}"
            for r in range(min(self.config.num_nodes, 16))
        ) + (", ..." if self.config.num_nodes > 16 else "")
        raise RendezvousError(
            Code.RESOURCE_EXHAUSTED,
            f"no free node rank for node_id {node_id!r}: the plan needs "
            f"{self.config.num_nodes} nodes and their ranks are taken or pinned ({held})",
        )

    def _next_claimed_node_rank(self) -> int:
        # Claimed mode: node ranks only label nodes in join order; ranks come from the framework.
        node_rank = max(self.free_node_rank_from, len(self.config.node_order))
        while node_rank in self.node_ids_by_rank:
            node_rank += 1
        return node_rank

    def _check_node_share(self, rank: int, node_id: str, node: Optional[Node]) -> None:
        """Claimed mode stays inside the node: a node holds at most its slots' worth of
        ranks in a generation (RESOURCE_EXHAUSTED), and with topology_policy "refuse" its
        ranks' TP and CP groups must fit in those slots together (FAILED_PRECONDITION):
        a node holding ranks of more groups than it can hold whole would make a group
        straddle nodes once the rest of the world registers."""
        slots = self.config.slots_per_node
        held = node.registered if node is not None else 0
        if held >= slots:
            ranks = sorted(a.rank for a in self.by_rank.values() if a.node_id == node_id)
            raise RendezvousError(
                Code.RESOURCE_EXHAUSTED,
                f"node {node_id!r} has {slots} slots (slots_per_node) and already holds ranks "
                f"{compress_ranks(ranks)} of generation {self.generation}; it cannot claim rank {rank}",
            )
        if self.config.topology_policy != "refuse" or not held:
            return
        ranks = [a.rank for a in self.by_rank.values() if a.node_id == node_id] + [rank]
        for axis in ("tp", "cp"):
            size = self.plan.size(axis)
            if size == 1 or size > slots:  # a group larger than a node straddles anyway: _check_topology says so
                continue
            groups = {tuple(self.plan.group(axis, r)) for r in ranks}
            if len(groups) * size > slots:
                raise RendezvousError(
                    Code.FAILED_PRECONDITION,
                    f"node {node_id!r} has {slots} slots; with rank {rank} it would hold ranks of "
                    f"{len(groups)} {axis} groups of {size} ({', '.join(str(list(g)) for g in sorted(groups))}), "
                    f"which cannot all stay on it: topology_policy refuse",
                )

    def _check_topology(self, rank: int, node_id: str) -> list[str]:
        if self.config.topology_policy == "allow":
            return []
        problems = []
        for axis in ("tp", "cp"):
            if self.plan.size(axis) == 1:
                continue
            members = self.plan.group(axis, rank)
            elsewhere = sorted(
                {(self.by_rank[m].node_id, m) for m in members if m in self.by_rank}
                - {(node_id, m) for m in members}
            )
            if elsewhere:
                where = ", ".join(f"rank {m} on {n!r}" for n, m in elsewhere)
                problems.append(
                    f"{axis} group {list(members)} would straddle nodes: rank {rank} on "
                    f"{node_id!r}, {where}"
                )
        if problems and self.config.topology_policy == "refuse":
            raise RendezvousError(Code.FAILED_PRECONDITION, "; ".join(problems))
        return problems

    def check_job(self, job_id: str, allow_failed: bool = False) -> None:
        check_id("job_id", job_id)
        if job_id != self.config.job_id:
            raise RendezvousError(
                Code.FAILED_PRECONDITION,
                f"job_id {job_id!r} is not this coordinator's job {self.config.job_id!r}",
            )
        if self.failed and not allow_failed:
            raise RendezvousError(Code.FAILED_PRECONDITION, f"job {job_id!r} failed: {self.failed}")

    def decide_join(
        self,
        job_id: str,
        node_id: str,
        hostname: str,
        slots: int,
        slot_kind: str,
        now: float,
        auth: JoinAuth = JoinAuth(),
        master_offer: Optional[tuple[str, int]] = None,
        agent_instance: str = "",
    ) -> tuple[Node | None, tuple[Event, ...]]:
        """An agent joins. Returns the node if it is known (a rejoin keeps its node rank)
        and the events to apply. A first join spends a single-use token (or, in insecure
        dev setups, the static config token); a rejoin shows the node credential.
        ``master_offer`` is the master the agent can host (MasterOffered). A member that
        comes back under a new ``agent_instance`` ends its generation (decide_restarted)."""
        self.check_job(job_id)
        check_id("node_id", node_id)
        check_master_offer(master_offer)
        node, events = self._decide_join(job_id, node_id, hostname, slots, slot_kind, now, auth)
        events += self.decide_restarted(node, agent_instance, now)
        known = node.master_offer if node is not None else None
        if master_offer is not None and master_offer != known:
            events += (MasterOffered(node_id, *master_offer),)
        return node, events

    def decide_restarted(self, node: Optional[Node], agent_instance: str, now: float) -> tuple[Event, ...]:
        """A member whose agent restarted mid-job (a new instance): its workers died with
        their containment unit, so its generation is over, as for a lost node: its ranks
        are released and every worker of the job relaunches into the next generation.
        Never a re-admission into the same generation with the same ranks."""
        if (node is None or self.failed or node.state != "active" or node.node_rank < 0
                or not agent_instance or not node.agent_instance or agent_instance == node.agent_instance):
            return ()
        why = (f"node {node.node_id!r} (node_rank {node.node_rank}) came back under a new agent instance; "
               "its workers died with their containment unit")
        return (
            NodeStateChanged(node.node_id, "lost", now, "its agent restarted"),
            GenerationBumped(self.generation + 1, why),
            NodeStateChanged(node.node_id, "active", now, "rejoined under a new agent instance"),
        )

    def note_instance(self, node_id: str, agent_instance: str, joined: bool) -> None:
        """Liveness, not persisted: the instance a Join brings, or the first one a
        heartbeat shows (after a coordinator restart)."""
        node = self.nodes.get(node_id)
        if node is not None and agent_instance and (joined or not node.agent_instance):
            node.agent_instance = agent_instance

    def _decide_join(
        self, job_id: str, node_id: str, hostname: str, slots: int, slot_kind: str, now: float, auth: JoinAuth
    ) -> tuple[Node | None, tuple[Event, ...]]:
        keyed = self._authenticate_join(node_id, auth, now)
        if len(hostname) > MAX_ID_LEN:
            raise RendezvousError(
                Code.INVALID_ARGUMENT, f"hostname is {len(hostname)} characters; at most {MAX_ID_LEN}"
            )
        if slot_kind not in ("gpu", "cpu"):
            raise RendezvousError(
                Code.INVALID_ARGUMENT, f"slot_kind must be 'gpu' or 'cpu', got {shown(slot_kind)}"
            )
        need = self.config.slots_per_node
        if slots < need:
            raise RendezvousError(
                Code.FAILED_PRECONDITION,
                f"node {node_id!r} reports {slots} {slot_kind} slots; the plan needs "
                f"{need} per node (slots_per_node)",
            )
        node = self.nodes.get(node_id)
        if node is not None and not node.managed:
            keyed = (NodeAdopted(node_id, hostname or node_id, slots, slot_kind, now),) + keyed
        if node is not None:
            if node.state in ("active", "spare"):
                return node, keyed
            if node.state == "replaced":
                # Its block went to a spare; it may serve as a spare itself now.
                return node, keyed + (NodeStateChanged(node_id, "spare", now, "rejoined after replacement"),)
            return node, keyed + (NodeStateChanged(node_id, "active", now, "rejoined"),)
        joined = NodeJoined(node_id, -1, now, hostname or node_id, slots, slot_kind)
        try:
            node_rank = self._free_node_rank(node_id)
        except RendezvousError:
            # Every node rank is held: a hot spare, or straight away the stand-in for a lost node.
            lost = self._lost_awaiting_replacement()
            if lost is None:
                return None, (joined,) + keyed
            return None, (joined,) + keyed + (NodeReplaced(node_id, lost.node_id, lost.node_rank, now),)
        return None, (NodeJoined(node_id, node_rank, now, hostname or node_id, slots, slot_kind),) + keyed

    def _authenticate_join(self, node_id: str, auth: JoinAuth, now: float) -> tuple[Event, ...]:
        """UNAUTHENTICATED for a used, expired, unknown or misdirected token, or a wrong
        credential; nothing changes then. Returns the NodeKeyed event to apply, if any."""
        if auth.public_key and len(auth.public_key) != 32:
            raise RendezvousError(
                Code.INVALID_ARGUMENT,
                f"node_public_key must be a raw 32-byte Ed25519 key, got {len(auth.public_key)} bytes",
            )
        node = self.nodes.get(node_id)
        if auth.credential:
            if node is None or not node.credential_hash or not hmac.compare_digest(
                secret_hash(auth.credential), node.credential_hash
            ):
                raise RendezvousError(
                    Code.UNAUTHENTICATED, f"node_credential is not valid for node_id {node_id!r}"
                )
            if auth.public_key and auth.public_key != node.public_key:
                return (NodeKeyed(node_id, node.credential_hash, auth.public_key.hex(), "", now),)
            return ()
        if not auth.token:
            raise RendezvousError(
                Code.UNAUTHENTICATED, f"node_id {node_id!r} presented no join_token and no node_credential"
            )
        if node is not None and node.credential_hash:
            # A token, however valid, never replaces a node's credential (nor its vouch key).
            raise RendezvousError(
                Code.PERMISSION_DENIED,
                f"node_id {node_id!r} already holds a node credential; a Join for it needs that "
                f"credential, not a join_token",
            )
        static = self.config.join_token
        if static and hmac.compare_digest(auth.token.encode(), static.encode()):
            token_hash = ""  # the static dev token is not spent
        else:
            token_hash = spend_token(self.tokens, auth.token, node_id, now)
        return (NodeKeyed(node_id, auth.new_credential_hash, auth.public_key.hex(), token_hash, now),)

    def decide_create_token(
        self, job_id: str, token_hash: str, ttl_s: float, node_id: str, now: float, any_node: bool = False
    ) -> tuple[Event, ...]:
        """A token admits one named node; one for any node only when asked for explicitly."""
        self.check_job(job_id)
        return (new_token(token_hash, ttl_s, node_id, now, any_node),)

    def _lost_awaiting_replacement(self) -> Optional[Node]:
        lost = [n for n in self.nodes.values() if n.state == "lost" and n.node_rank >= 0]
        return min(lost, key=lambda n: n.node_rank) if lost else None

    def _free_spare(self, taken: set[str]) -> Optional[Node]:
        spares = [n for n in self.nodes.values() if n.state == "spare" and n.node_id not in taken]
        return min(spares, key=lambda n: n.joined_at) if spares else None

    def decide_node_call(
        self, job_id: str, node_id: str, credential: Optional[bytes] = None, allow_failed: bool = False
    ) -> Node:
        """A later agent call: the node must have joined, and (when ``credential`` is
        checked) prove it is that node: no node acts for another. ``allow_failed``: the
        calls that still answer once the job failed (heartbeats learn of the failure,
        exits are still reported)."""
        self.check_job(job_id, allow_failed)
        check_id("node_id", node_id)
        node = self.nodes.get(node_id)
        if node is None or not node.managed:
            raise RendezvousError(
                Code.FAILED_PRECONDITION, f"node_id {node_id!r} has not joined; call Join first"
            )
        if credential is not None and node.credential_hash:
            if not credential:
                raise RendezvousError(Code.UNAUTHENTICATED, f"node_credential missing for node_id {node_id!r}")
            if not hmac.compare_digest(secret_hash(credential), node.credential_hash):
                raise RendezvousError(
                    Code.PERMISSION_DENIED, f"node_credential does not belong to node_id {node_id!r}"
                )
        return node

    def decide_leave(
        self, job_id: str, node_id: str, reason: str, now: float, credential: Optional[bytes] = None
    ) -> tuple[Event, ...]:
        """A node leaves (drain). Its ranks are out of the current generation, which ends
        as for a lost node, unless every one of its workers already exited 0 in it (its
        part is done: nothing to replace or restart)."""
        node = self.decide_node_call(job_id, node_id, credential)
        if node.state == "left":
            return ()
        why = reason[:200] or "drained"
        events: tuple[Event, ...] = (NodeStateChanged(node_id, "left", now, why),)
        if node.state == "active" and node.node_rank >= 0 and not self._finished_its_part(node):
            events += self._end_generation((node,), f"left ({why})", now)
        return events

    def _finished_its_part(self, node: Node) -> bool:
        """Every worker of ``node``'s block exited 0 in the current generation."""
        return all((node.node_id, r) in self.succeeded_workers for r in range(self.config.slots_per_node))

    def _end_generation(self, departed: Iterable[Node], how: str, now: float) -> tuple[Event, ...]:
        """Nodes holding rank blocks are out of the current generation: it ends (the
        generation is bumped); a free spare, if any, takes each block, every other rank
        stays where it was. A block left without a node is awaited up to
        lost_node_timeout_s (decide_lost), then the job fails naming the node."""
        events: list[Event] = []
        taken: set[str] = set()
        reasons = []
        for n in departed:
            reasons.append(f"node {n.node_id!r} (node_rank {n.node_rank}) {how}")
            spare = self._free_spare(taken)
            if spare is not None:
                taken.add(spare.node_id)
                events.append(NodeReplaced(spare.node_id, n.node_id, n.node_rank, now))
                reasons[-1] += f", spare {spare.node_id!r} takes its ranks"
        if reasons:
            events.append(GenerationBumped(self.generation + 1, "; ".join(reasons)))
        return tuple(events)

    def unheard_since(self, since: float, but: str = "") -> list[Node]:
        """Agent-managed nodes holding a block, still counted in, not heard from since
        ``since``: until each has heartbeated again or been declared lost, a failure
        elsewhere may be that node's loss seen from its peers."""
        return [
            n for n in self.nodes.values()
            if n.managed and n.state == "active" and n.node_rank >= 0 and n.node_id != but and n.last_seen < since
        ]

    def decide_lost(self, now: float, timeout_s: float) -> tuple[Event, ...]:
        """Agent-managed nodes silent for longer than ``timeout_s`` are lost. A lost node
        holding a rank block bumps the generation; a spare, if any, takes the block over
        (every other rank stays where it was), unless the generation is finishing (a
        worker of it exited 0): then the node's exits are awaited. A block left without
        a node for longer than ``lost_node_timeout_s`` fails the job naming the node."""
        if self.failed or self.succeeded:
            return ()
        events: list[Event] = []
        departed = []
        for n in sorted(self.nodes.values(), key=lambda n: n.node_rank):
            if not (n.managed and n.state in ("active", "spare") and now - n.last_seen > timeout_s):
                continue
            why = f"no heartbeat for {now - n.last_seen:.1f}s (> {timeout_s:g}s)"
            events.append(NodeStateChanged(n.node_id, "lost", now, why))
            if n.state == "active" and not self._finished_its_part(n):
                departed.append(n)
        # A generation in which a worker already exited 0 is finishing: its training is
        # over, so a lost node is awaited (its agent resends the exits it journalled),
        # never replaced or restarted, which would run a finished job again.
        if departed and not self.succeeded_workers:
            events.extend(self._end_generation(departed, "lost", now))
        for node_id, since in sorted(self.lost_since.items()):
            node = self.nodes[node_id]
            if node.state in ("lost", "left") and now - since > self.config.lost_node_timeout_s:
                first = node.node_rank * self.config.slots_per_node
                how = "lost" if node.state == "lost" else "drained"
                events.append(
                    JobFailed(
                        f"node {node_id!r} (ranks {first}-{first + self.config.slots_per_node - 1}) "
                        f"was {how} {now - since:.0f}s ago and neither came back nor was replaced "
                        f"within lost_node_timeout_s={self.config.lost_node_timeout_s:g}",
                        now,
                    )
                )
                break
        return tuple(events)

    def decide_worker_exit(
        self, node: Node, local_rank: int, exit_code: int, generation: int, stopped_by_agent: bool, now: float,
        start_failed: bool = False, detail: str = "",
    ) -> tuple[Event, ...]:
        """A worker of ``node`` exited. A failure (non-zero, not stopped by its agent, in
        the current generation) ends the generation for the whole job: a lone restart
        could never rejoin a world that already formed. The job restarts into the next
        generation while max_restarts allows, else it fails naming the worker, its node
        and exit code. Anything else is only recorded by the caller."""
        if start_failed and not self.failed and generation == self.generation:
            # The command never ran: every restart would fail the same way.
            what = detail[:MAX_DETAIL] or f"worker local_rank {local_rank} could not start"
            return (JobFailed(f"{what} (on node {node.node_id!r}; a command that cannot start is never retried)", now),)
        if self.failed or exit_code == 0 or stopped_by_agent or generation != self.generation or node.node_rank < 0:
            return ()
        held = [a.rank for a in self.by_rank.values() if a.node_id == node.node_id and a.local_rank == local_rank]
        if held:
            rank = f"rank {held[0]}"
        elif not self.claimed_seen:
            rank = f"rank {node.node_rank * self.config.slots_per_node + local_rank}"
        else:
            rank = "no rank registered"
        who = (
            f"worker local_rank {local_rank} ({rank}) on node {node.node_id!r} exited {exit_code} "
            f"in generation {generation}"
        )
        limit = self.config.max_restarts
        if self.worker_restarts < limit:
            return (
                GenerationBumped(
                    self.generation + 1,
                    f"{who}; restarting every worker of the job (restart {self.worker_restarts + 1}/{limit})",
                    worker_restart=True,
                ),
            )
        why = f"restarts exhausted ({limit}/{limit})" if limit else "max_restarts is 0"
        return (JobFailed(f"{who}; {why}", now),)

    def decide_worker_succeeded(
        self, node: Node, local_rank: int, exit_code: int, generation: int, stopped_by_agent: bool, now: float
    ) -> tuple[Event, ...]:
        """Record a clean exit of the current generation (what makes a job SUCCEEDED)."""
        if (self.failed or exit_code != 0 or stopped_by_agent or generation != self.generation
                or node.node_rank < 0 or (node.node_id, local_rank) in self.succeeded_workers):
            return ()
        return (WorkerSucceeded(node.node_id, local_rank, generation, now),)

    def decide_admit(self, admitted: Iterable[AdmittedNode], now: float) -> tuple[Event, ...]:
        """The job's nodes as the cluster allocated them. Idempotent: a node already
        known (a replay, a restarted coordinator) adds nothing unless its key changed."""
        events: list[Event] = []
        for a in admitted:
            node = self.nodes.get(a.node_id)
            if node is None:
                events.append(NodeJoined(a.node_id, a.node_rank, now, a.hostname, a.slots, a.slot_kind))
            if node is None or node.credential_hash != a.credential_hash or node.public_key.hex() != a.public_key:
                events.append(NodeKeyed(a.node_id, a.credential_hash, a.public_key, "", now))
        return tuple(events)

    def touch_node(self, node_id: str, now: float) -> None:
        self.nodes[node_id].last_seen = now

    def check_await(self, job_id: str, generation: int) -> None:
        self.check_job(job_id)
        if generation != self.generation:
            raise RendezvousError(
                Code.FAILED_PRECONDITION,
                f"generation {generation} is over; the current generation is {self.generation}",
            )

    def decide_heartbeat(
        self, job_id: str, worker_id: str, generation: int, secret: bytes = b"", valid: Iterable[bytes] = ()
    ) -> None:
        """Only the worker itself keeps itself alive: ``secret`` must be one of ``valid``,
        the heartbeat secrets the owner derives for (job, generation, worker) and handed
        to that worker with its attestation."""
        self.check_await(job_id, generation)
        check_id("worker_id", worker_id)
        if worker_id not in self.by_worker:
            raise RendezvousError(
                Code.NOT_FOUND, f"worker_id {worker_id!r} is not registered in this generation"
            )
        if not secret:
            raise RendezvousError(Code.UNAUTHENTICATED, f"heartbeat_secret missing for worker_id {worker_id!r}")
        if not any(hmac.compare_digest(secret, v) for v in valid):
            raise RendezvousError(
                Code.PERMISSION_DENIED, f"heartbeat_secret does not belong to worker_id {worker_id!r}"
            )

    def touch(self, worker_id: str, now: float) -> None:
        """Liveness is not state worth persisting: a restart gives every worker a fresh start."""
        self.worker_seen[worker_id] = now
        assignment = self.by_worker.get(worker_id)
        if assignment is not None:
            self.nodes[assignment.node_id].last_seen = now

    # ---- apply ---------------------------------------------------------------------------

    def apply(self, event: Event) -> None:
        if isinstance(event, NodeJoined):
            self.nodes[event.node_id] = Node(
                event.node_id,
                event.node_rank,
                event.at,
                event.at,
                hostname=event.hostname,
                slots=event.slots,
                slot_kind=event.slot_kind,
                managed=event.slots > 0,
            )
            if event.node_rank < 0:
                self.nodes[event.node_id].state = "spare"
            else:
                self.node_ids_by_rank[event.node_rank] = event.node_id
                self.free_node_rank_from = max(self.free_node_rank_from, len(self.config.node_order))
                while self.free_node_rank_from in self.node_ids_by_rank:
                    self.free_node_rank_from += 1
            if len(self.nodes) == 1:  # the first node opens it (0.0 is a valid injected time)
                self.opened_at = event.at
        elif isinstance(event, NodeAdopted):
            node = self.nodes[event.node_id]
            node.hostname, node.slots, node.slot_kind = event.hostname, event.slots, event.slot_kind
            node.managed, node.last_seen = True, event.at
        elif isinstance(event, NodeStateChanged):
            node = self.nodes[event.node_id]
            node.state = event.state
            # A node gone with its part unfinished is awaited, up to lost_node_timeout_s.
            if event.state in ("lost", "left") and node.node_rank >= 0 and not self._finished_its_part(node):
                self.lost_since[event.node_id] = event.at
            else:
                self.lost_since.pop(event.node_id, None)
            if event.state in ("active", "spare"):
                node.last_seen = event.at
        elif isinstance(event, NodeReplaced):
            spare, lost = self.nodes[event.spare_id], self.nodes[event.lost_id]
            spare.node_rank, spare.state, spare.last_seen = event.node_rank, "active", event.at
            lost.node_rank, lost.state = -1, "replaced"
            self.lost_since.pop(event.lost_id, None)
            self.node_ids_by_rank[event.node_rank] = event.spare_id
            self._release_node(event.lost_id)
        elif isinstance(event, JobFailed):
            self.failed = event.reason
        elif isinstance(event, TokenCreated):
            self.tokens[event.token_hash] = Token(event.expires_at, event.node_id)
        elif isinstance(event, NodeKeyed):
            node = self.nodes[event.node_id]
            node.credential_hash = event.credential_hash
            node.public_key = bytes.fromhex(event.public_key)
            if event.token_hash:
                self.tokens[event.token_hash].used_by = event.node_id
        elif isinstance(event, RankAssigned):
            node = self.nodes[event.node_id]
            assignment = Assignment(
                event.worker_id, event.rank, event.node_id, node.node_rank, event.local_rank
            )
            self.by_worker[event.worker_id] = assignment
            self.by_rank[event.rank] = assignment
            self.worker_seen[event.worker_id] = event.at
            self.claimed_seen = self.claimed_seen or event.claimed
            if event.vouch_id:
                self.used_vouches[event.vouch_id] = event.worker_id
            node.registered += 1
            node.last_seen = max(node.last_seen, event.at)
        elif isinstance(event, WorkerSucceeded):
            self.succeeded_workers.add((event.node_id, event.local_rank))
        elif isinstance(event, MasterChosen):
            self.master = (event.host, event.port)
        elif isinstance(event, MasterOffered):
            self.nodes[event.node_id].master_offer = (event.host, event.port)
        elif isinstance(event, GenerationBumped):
            self.generation = event.generation
            # A new membership epoch: the lost nodes' ranks are free for their stand-ins,
            # every other rank stays; rank 0 names a fresh master address.
            for node in self.nodes.values():
                if event.worker_restart or node.state in ("lost", "replaced"):
                    self._release_node(node.node_id)
            if event.worker_restart:
                self.worker_restarts += 1
            self.succeeded_workers.clear()
            self.master = None
        else:  # pragma: no cover - a programming error, not input
            raise TypeError(f"unknown event {event!r}")

    def _release_node(self, node_id: str) -> None:
        held = [a for a in self.by_worker.values() if a.node_id == node_id]
        for assignment in held:
            del self.by_worker[assignment.worker_id]
            del self.by_rank[assignment.rank]
            self.worker_seen.pop(assignment.worker_id, None)
        self.nodes[node_id].registered = 0

    def apply_all(self, events: Iterable[Event]) -> None:
        for event in events:
            self.apply(event)


__all__ = [
    "AdmittedNode",
    "Assignment",
    "Code",
    "Event",
    "GenerationBumped",
    "MasterChosen",
    "MasterOffered",
    "check_master_offer",
    "JoinAuth",
    "JobFailed",
    "NodeKeyed",
    "TokenCreated",
    "WorkerSucceeded",
    "NodeAdopted",
    "NodeJoined",
    "NodeReplaced",
    "NodeStateChanged",
    "PlanError",
    "RankAssigned",
    "RankMode",
    "RegisterDecision",
    "RegisterInput",
    "RendezvousConfig",
    "RendezvousError",
    "RendezvousState",
    "compress_ranks",
]
