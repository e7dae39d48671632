"""The node agent's Unix socket, as data both sides share: what the agent answers to
"whoami" (LocalNode) and the exits of workers it did not start that a caller reports
("exited"). The agent serves it (agent/vouch_socket.py); workers and torchrun's handler
(meshgate/client.py, meshgate/torchrun.py) ask it. Plain data: no sockets here."""

from __future__ import annotations

from dataclasses import dataclass


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
