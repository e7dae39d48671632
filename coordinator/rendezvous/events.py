"""The events of a job's rendezvous: every change to its state is one of these, logged
before it is applied (coordinator/store), so a replay rebuilds the state exactly.
Fields are typed: the codec (store/codec.py) writes and reads them by their annotations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from meshgate.coordinator.rendezvous.model import NodeState


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
    state: NodeState
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
    # The last lines of output of the worker whose exit failed the job (its agent's report).
    log_tail: str = ""


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
    at: float = 0.0  # 0 in logs written before bumps were timed (a job's timeline then dates it by its neighbours)


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


EVENT_TYPES: tuple[type, ...] = Event.__args__  # every kind, for the codec and the apply table
