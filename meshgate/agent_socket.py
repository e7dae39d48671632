"""The node agent's Unix socket, as data both sides share: what the agent answers to
"whoami" (LocalNode), the exits of workers it did not start that a caller reports
("exited"), and a worker's training progress ("progress", meshgate.report). The agent
serves it (agent/vouch_socket.py); workers and torchrun's handler (meshgate/client.py,
meshgate/torchrun.py, meshgate/progress.py) ask it, finding it where a shipped agent
serves it (``find_agent_socket``). Plain data: no sockets here."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

SOCKET_ENV = "MESHGATE_AGENT_SOCKET"
# Where the shipped unit reads the agent's config (deploy/systemd/meshgate-agent.service,
# ExecStart) and keeps its state (StateDirectory=): a process on the node finds the agent's
# socket from them without being told.
AGENT_CONFIG_ENV = "MESHGATE_AGENT_CONFIG"
SHIPPED_AGENT_CONFIG = Path("/etc/meshgate/agent.toml")
SHIPPED_STATE_DIR = Path("/var/lib/meshgate-agent")
SOCKET_NAME = "vouch.sock"  # [agent] vouch_socket's default, in state_dir
# The interface variables gloo and NCCL read: the agent sets them for the workers it starts
# (agent/netif.py) and tells the others in whoami (LocalNode.interface).
IFNAME_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def configured_socket(table: Mapping[str, object], base_dir: Path) -> Optional[Path]:
    """[agent] vouch_socket as the agent reads it from its config ``table`` (relative paths
    to the config's folder; unset: <state_dir>/vouch.sock; "": no socket)."""
    value = table.get("vouch_socket")
    if value is None:
        value = str(Path(str(table.get("state_dir", "state/agent"))) / SOCKET_NAME)
    if not value:
        return None
    path = Path(str(value))
    return path if path.is_absolute() else base_dir / path


def find_agent_socket(env: Mapping[str, str] = os.environ) -> tuple[str, str]:
    """The node agent's socket and where that came from: MESHGATE_AGENT_SOCKET; else the
    [agent] vouch_socket of the agent's config (MESHGATE_AGENT_CONFIG, default the shipped
    /etc/meshgate/agent.toml) when it can be read; else the shipped default,
    /var/lib/meshgate-agent/vouch.sock. A caller that cannot reach it says where it looked."""
    if env.get(SOCKET_ENV):
        return env[SOCKET_ENV], SOCKET_ENV
    config = Path(env.get(AGENT_CONFIG_ENV) or SHIPPED_AGENT_CONFIG)
    try:
        table = tomllib.loads(config.read_text(encoding="utf-8")).get("agent", {})
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        table = None  # no config here, or not readable by this user: the shipped default
    if isinstance(table, dict):
        path = configured_socket(table, config.parent)
        if path is not None:
            return str(path), f"[agent] vouch_socket of {config}"
    return str(SHIPPED_STATE_DIR / SOCKET_NAME), "the shipped agent's default"


def local_agent_socket(env: Mapping[str, str] = os.environ) -> Optional[str]:
    """MESHGATE_AGENT_SOCKET, else the socket find_agent_socket names if one is there: for
    a worker that may run on a node without an agent (None: ask none)."""
    path, source = find_agent_socket(env)
    return path if source == SOCKET_ENV or os.path.exists(path) else None


def bounded_int(request: dict, key: str, limit: int) -> int:
    """``request[key]``: an int in [0, limit), else ValueError naming the key and the (bounded) value."""
    value = request[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
        raise ValueError(f"{key} {str(value)[:32]!r} out of range")
    return value


@dataclass(frozen=True)
class LocalNode:
    """What the agent answers to "whoami": the node it joined as, for which job, and (for
    torchrun's handler) its place in that job as its last Join returned it."""

    node_id: str
    job_id: str
    generation: int
    joined_generation: int = -1  # the generation of the last Join (-1: not joined to the job)
    node_rank: int = -1  # -1: a hot spare, or not joined
    spare: bool = False
    nodes: int = 0  # node ranks in the job (its world in nodes)
    slots: int = 0  # workers per node
    master_addr: str = ""  # node rank 0's offer: "" until node rank 0's agent joined
    master_port: int = 0
    trust_bundle: str = ""  # the trust bundle's path on this node
    # The interface that carries the address this agent advertises (agent/netif.py): what
    # GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name for workers the agent does not start.
    interface: str = ""
    # The agent started this node's launcher (a per-node job): it reports the launcher's
    # exit itself, and a restart is the job's (its restart policy), never the launcher's.
    agent_started: bool = False
    # The job is over: the job it was ("" while one runs) and why.
    ended_job: str = ""
    ended: str = ""


@dataclass(frozen=True)
class ExternalExits:
    """Exits of workers the agent did not start, as the "exited" request names them."""

    generation: int
    local_ranks: tuple[int, ...]
    exit_code: int
    detail: str = ""

    @classmethod
    def parse(cls, request: object, max_local_rank: int) -> "ExternalExits":
        if not isinstance(request, dict):
            raise TypeError("exited must be a JSON object")
        ranks = request.get("local_ranks")
        if not isinstance(ranks, list) or not 0 < len(ranks) <= 1024:
            raise ValueError("local_ranks must be a list of 1 to 1024 local ranks")
        detail = request.get("detail", "")
        if not isinstance(detail, str):
            raise TypeError("detail must be a string")
        return cls(
            generation=bounded_int(request, "generation", 1 << 62),
            local_ranks=tuple(bounded_int({"local_rank": r}, "local_rank", max_local_rank) for r in ranks),
            exit_code=bounded_int({"exit_code": request.get("exit_code")}, "exit_code", 256),
            detail=detail[:200],
        )


def _finite(request: dict, key: str, minimum: float | None) -> float | None:
    """``request[key]`` if given: a finite number (at least ``minimum``), else ValueError naming it."""
    if request.get(key) is None:
        return None
    value = request[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
        raise ValueError(f"{key} {str(value)[:32]!r} is not a finite number")
    if minimum is not None and value < minimum:
        raise ValueError(f"{key} {value!r} is below {minimum}")
    return float(value)


@dataclass(frozen=True)
class ReportedProgress:
    """A worker's training progress, as the "progress" request carries it: its local rank,
    the step it finished, and optionally its loss, its throughput and its own step time."""

    local_rank: int
    step: int
    loss: float | None = None
    samples_per_s: float | None = None
    step_time_s: float | None = None

    def request(self) -> dict:
        return {"progress": {k: v for k, v in self.__dict__.items() if v is not None}}

    @classmethod
    def parse(cls, request: object, max_local_rank: int) -> "ReportedProgress":
        if not isinstance(request, dict):
            raise TypeError("progress must be a JSON object")
        return cls(
            local_rank=bounded_int(request, "local_rank", max_local_rank),
            step=bounded_int(request, "step", 1 << 62),
            loss=_finite(request, "loss", None),
            samples_per_s=_finite(request, "samples_per_s", 0.0),
            step_time_s=_finite(request, "step_time_s", 0.0),
        )
