"""Generations and ends: a worker's exit (a failure restarts the whole job into the next
generation while max_restarts allows, else fails it), a clean exit (every worker of the
generation exiting 0 is the job's success), and a node leaving. Pure."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from meshgate.coordinator.rendezvous.events import Event, GenerationBumped, JobFailed, NodeStateChanged, WorkerSucceeded
from meshgate.coordinator.rendezvous.liveness import end_generation
from meshgate.coordinator.rendezvous.model import MAX_DETAIL, MAX_LOG_TAIL, Node, NodeState

if TYPE_CHECKING:
    from meshgate.coordinator.rendezvous.state import RendezvousState


def decide_worker_exit(
    state: RendezvousState,
    node: Node,
    local_rank: int,
    exit_code: int,
    generation: int,
    stopped_by_agent: bool,
    now: float,
    start_failed: bool = False,
    detail: str = "",
    log_tail: str = "",
) -> tuple[Event, ...]:
    """A worker of ``node`` exited. A failure (non-zero, not stopped by its agent, in
    the current generation) ends the generation for the whole job: a lone restart
    could never rejoin a world that already formed. The job restarts into the next
    generation while max_restarts allows, else it fails naming the worker, its node
    and exit code. Anything else is only recorded by the caller."""
    if start_failed and not state.failed and generation == state.generation:
        # The command never ran: every restart would fail the same way.
        what = detail[:MAX_DETAIL] or f"worker local_rank {local_rank} could not start"
        return (JobFailed(f"{what} (on node {node.node_id!r}; a command that cannot start is never retried)", now),)
    if state.failed or exit_code == 0 or stopped_by_agent or generation != state.generation or node.node_rank < 0:
        return ()
    held = [a.rank for a in state.by_rank.values() if a.node_id == node.node_id and a.local_rank == local_rank]
    if held:
        rank = f"rank {held[0]}"
    elif not state.claimed_seen:
        rank = f"rank {node.node_rank * state.config.slots_per_node + local_rank}"
    else:
        rank = "no rank registered"
    who = (
        f"worker local_rank {local_rank} ({rank}) on node {node.node_id!r} exited {exit_code} "
        f"in generation {generation}"
    )
    limit = state.config.max_restarts
    if state.worker_restarts < limit:
        return (
            GenerationBumped(
                state.generation + 1,
                f"{who}; restarting every worker of the job (restart {state.worker_restarts + 1}/{limit})",
                worker_restart=True,
                at=now,
            ),
        )
    why = f"restarts exhausted ({limit}/{limit})" if limit else "max_restarts is 0"
    return (JobFailed(f"{who}; {why}", now, log_tail[-MAX_LOG_TAIL:]),)


def decide_worker_succeeded(
    state: RendezvousState,
    node: Node,
    local_rank: int,
    exit_code: int,
    generation: int,
    stopped_by_agent: bool,
    now: float,
) -> tuple[Event, ...]:
    """Record a clean exit of the current generation (what makes a job SUCCEEDED)."""
    if (
        state.failed
        or exit_code != 0
        or stopped_by_agent
        or generation != state.generation
        or node.node_rank < 0
        or (node.node_id, local_rank) in state.succeeded_workers
    ):
        return ()
    return (WorkerSucceeded(node.node_id, local_rank, generation, now),)


def decide_leave(
    state: RendezvousState, job_id: str, node_id: str, reason: str, now: float, credential: Optional[bytes] = None
) -> tuple[Event, ...]:
    """A node leaves (drain). Its ranks are out of the current generation, which ends
    as for a lost node, unless every one of its workers already exited 0 in it (its
    part is done: nothing to replace or restart)."""
    node = state.decide_node_call(job_id, node_id, credential)
    if node.state is NodeState.LEFT:
        return ()
    why = reason[:200] or "drained"
    events: tuple[Event, ...] = (NodeStateChanged(node_id, NodeState.LEFT, now, why),)
    if node.state is NodeState.ACTIVE and node.node_rank >= 0 and not state.finished_its_part(node):
        events += end_generation(state, (node,), f"left ({why})", now)
    return events
