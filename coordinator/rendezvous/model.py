"""What a job's rendezvous is made of: its config, its nodes and their states, the
requests it decides on and the assignments it hands out. Data only."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal, Optional

from meshgate.coordinator.rendezvous.errors import check_id
from meshgate.plan import ParallelPlan

TopologyPolicy = Literal["allow", "warn", "refuse"]


class RankMode(enum.Enum):
    """Who picks a worker's rank. ASSIGNED: meshgate, from the node's block
    (node_rank * slots_per_node + local_rank); a Register carrying a claim is refused.
    CLAIMED: the framework (Ray, Fabric); the claim must be vouched for by the node's
    agent (the vouch names the rank) and passes the topology policy."""

    ASSIGNED = "assigned"
    CLAIMED = "claimed"


class NodeState(enum.Enum):
    """A node of a job's rendezvous. ACTIVE holds a rank block; SPARE joined beyond the
    plan's need and waits to take a lost node's block; LOST stopped heartbeating; LEFT
    drained; REPLACED was lost or left and a spare took its block. The values are what
    logs, metrics labels and the event log spell."""

    ACTIVE = "active"
    SPARE = "spare"
    LOST = "lost"
    LEFT = "left"
    REPLACED = "replaced"

    @property
    def counted_in(self) -> bool:
        """Heartbeating and expected to: an ACTIVE member or a SPARE."""
        return self in (NodeState.ACTIVE, NodeState.SPARE)

    @property
    def gone(self) -> bool:
        """Out of the world without a stand-in yet: LOST or LEFT."""
        return self in (NodeState.LOST, NodeState.LEFT)


MIN_NONCE, MAX_NONCE = 16, 64
MAX_DETAIL = 300  # how much of an agent's exit detail a job's reason quotes
MAX_LOG_TAIL = 4096  # how much of a failed worker's output its exit report may carry


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
            raise ValueError(f"slots_per_node {self.slots_per_node} must divide world_size {world}")
        if len(set(self.node_order)) != len(self.node_order):
            raise ValueError(f"node_order has duplicates: {list(self.node_order)}")
        if len(self.node_order) > self.num_nodes:
            raise ValueError(f"node_order names {len(self.node_order)} nodes; the plan needs {self.num_nodes}")
        for node_id in self.node_order:
            check_id("node_order", node_id)
        if self.topology_policy not in ("allow", "warn", "refuse"):
            raise ValueError(f"topology_policy must be allow, warn or refuse, got {self.topology_policy!r}")

    @property
    def num_nodes(self) -> int:
        return self.plan.world_size // self.slots_per_node


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
    # Given from the pool for a block: the node that held it (lost or left). It joins as a
    # spare and takes that block at once, while the block still waits ("" for allocation's).
    replaces: str = ""


@dataclass(frozen=True)
class JoinAuth:
    """What an agent presents at Join, and the credential hash it would receive. ``admitted``:
    the cluster already authenticated the node (NodePool.join_declared); ``new_credential_hash``
    and ``public_key`` are then its cluster credential's hash and vouch key, and the job only
    places it."""

    token: str = ""
    credential: bytes = b""
    public_key: bytes = b""
    new_credential_hash: str = ""
    admitted: bool = False


@dataclass
class Token:
    expires_at: float
    node_id: str
    used_by: str = ""


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
    state: NodeState = NodeState.ACTIVE
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
    # The generation its worker last registered in. A survivor's rank is kept across a
    # generation bump for the same worker, but it counts in the new generation's world
    # only once that worker has registered again (RendezvousState.registered_now).
    generation: int = 0
