"""Liveness and spares: nodes that stop heartbeating are lost, a lost or departed node's
block goes to a free spare (every other rank stays where it was), a member whose agent
restarted ends its generation, and a block left without a node too long fails the job.
Pure: ``now`` is passed in."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional

from meshgate.coordinator.rendezvous.events import Event, GenerationBumped, JobFailed, NodeReplaced, NodeStateChanged
from meshgate.coordinator.rendezvous.model import Node, NodeState

if TYPE_CHECKING:
    from meshgate.coordinator.rendezvous.state import RendezvousState


def decide_lost(state: RendezvousState, now: float, timeout_s: float) -> tuple[Event, ...]:
    """Agent-managed nodes silent for longer than ``timeout_s`` are lost. A lost node
    holding a rank block bumps the generation; a spare, if any, takes the block over
    (every other rank stays where it was), unless the generation is finishing (a
    worker of it exited 0): then the node's exits are awaited. A block left without
    a node for longer than ``lost_node_timeout_s`` fails the job naming the node."""
    if state.failed or state.succeeded:
        return ()
    events: list[Event] = []
    departed = []
    for n in sorted(state.nodes.values(), key=lambda n: n.node_rank):
        if not (n.managed and n.state.counted_in and now - n.last_seen > timeout_s):
            continue
        why = f"no heartbeat for {now - n.last_seen:.1f}s (> {timeout_s:g}s)"
        events.append(NodeStateChanged(n.node_id, NodeState.LOST, now, why))
        if n.state is NodeState.ACTIVE and not state.finished_its_part(n):
            departed.append(n)
    # A generation in which a worker already exited 0 is finishing: its training is
    # over, so a lost node is awaited (its agent resends the exits it journalled),
    # never replaced or restarted, which would run a finished job again.
    if departed and not state.succeeded_workers:
        events.extend(end_generation(state, departed, "lost", now))
    for node_id, since in sorted(state.lost_since.items()):
        node = state.nodes[node_id]
        if node.state.gone and now - since > state.config.lost_node_timeout_s:
            first = node.node_rank * state.config.slots_per_node
            how = "lost" if node.state is NodeState.LOST else "drained"
            events.append(
                JobFailed(
                    f"node {node_id!r} (ranks {first}-{first + state.config.slots_per_node - 1}) "
                    f"was {how} {now - since:.0f}s ago and neither came back nor was replaced "
                    f"within lost_node_timeout_s={state.config.lost_node_timeout_s:g}",
                    now,
                )
            )
            break
    return tuple(events)


def unheard_since(state: RendezvousState, since: float, but: str = "") -> list[Node]:
    """Agent-managed nodes holding a block, still counted in, not heard from since
    ``since``: until each has heartbeated again or been declared lost, a failure
    elsewhere may be that node's loss seen from its peers."""
    return [
        n
        for n in state.nodes.values()
        if n.managed and n.state is NodeState.ACTIVE and n.node_rank >= 0 and n.node_id != but and n.last_seen < since
    ]


def decide_restarted(
    state: RendezvousState, node: Optional[Node], agent_instance: str, now: float
) -> tuple[Event, ...]:
    """A member whose agent restarted mid-job (a new instance): its workers died with
    their containment unit, so its generation is over, as for a lost node: its ranks
    are released and every worker of the job relaunches into the next generation.
    Never a re-admission into the same generation with the same ranks.

    Only a Join naming the instance the coordinator knows proves the same agent. One that
    cannot prove it (either side names none: an agent of the release before instances, a
    coordinator that restarted since) ends the generation too once the node's workers hold
    ranks in it: an earlier agent's workers may still run (an old agent's were never in a
    unit). Before they hold any (an agent joining again after a relaunch, or while it
    waits for the master) there is nothing of this generation to end."""
    if node is None or state.failed or node.state is not NodeState.ACTIVE or node.node_rank < 0:
        return ()
    if agent_instance and agent_instance == node.agent_instance:
        return ()
    if agent_instance and node.agent_instance:
        why = "came back under a new agent instance; its workers died with their containment unit"
    elif holds_ranks_now(state, node):
        known = f"agent instance {node.agent_instance!r}" if node.agent_instance else "an agent that named no instance"
        why = (
            f"joined again while its workers hold ranks of generation {state.generation}, and its agent "
            f"(instance {agent_instance or 'not named'}) cannot show it is {known}: an earlier agent's "
            "workers may still run"
        )
    else:
        return ()
    why = f"node {node.node_id!r} (node_rank {node.node_rank}) {why}"
    return (
        NodeStateChanged(node.node_id, NodeState.LOST, now, "its agent restarted"),
        GenerationBumped(state.generation + 1, why, at=now),
        NodeStateChanged(node.node_id, NodeState.ACTIVE, now, "rejoined under a new agent instance"),
    )


def holds_ranks_now(state: RendezvousState, node: Node) -> bool:
    """Some worker of ``node`` holds a rank in the current generation (a survivor's rank
    kept from an earlier one does not count). Assigned mode looks at its block only."""
    if not node.registered:
        return False
    if state.claimed_seen:
        held = state.by_rank.values()
    else:
        first = node.node_rank * state.config.slots_per_node
        held = (state.by_rank.get(r) for r in range(first, first + state.config.slots_per_node))
    return any(a is not None and a.node_id == node.node_id and a.generation == state.generation for a in held)


def end_generation(state: RendezvousState, departed: Iterable[Node], how: str, now: float) -> tuple[Event, ...]:
    """Nodes holding rank blocks are out of the current generation: it ends (the
    generation is bumped); a free spare, if any, takes each block, every other rank
    stays where it was. A block left without a node is awaited up to
    lost_node_timeout_s (decide_lost), then the job fails naming the node."""
    events: list[Event] = []
    taken: set[str] = set()
    reasons = []
    for n in departed:
        reasons.append(f"node {n.node_id!r} (node_rank {n.node_rank}) {how}")
        spare = free_spare(state, taken)
        if spare is not None:
            taken.add(spare.node_id)
            events.append(NodeReplaced(spare.node_id, n.node_id, n.node_rank, now))
            reasons[-1] += f", spare {spare.node_id!r} takes its ranks"
    if reasons:
        events.append(GenerationBumped(state.generation + 1, "; ".join(reasons), at=now))
    return tuple(events)


def awaiting_replacement(state: RendezvousState, spares_too: bool = False) -> list[Node]:
    """The blocks a node from the pool may take, by node rank: those whose node was lost or
    left and that no spare took. None while the job failed or is finishing (a worker of
    the generation exited 0: its lost node is awaited, never replaced, which would run a
    finished job again), nor while a free spare stands by (``spares_too``: even then)."""
    if state.failed or state.succeeded_workers or (not spares_too and free_spare(state, set()) is not None):
        return []
    waiting = [state.nodes[node_id] for node_id in state.lost_since]
    return sorted((n for n in waiting if n.state.gone and n.node_rank >= 0), key=lambda n: n.node_rank)


def lost_awaiting_replacement(state: RendezvousState) -> Optional[Node]:
    lost = [n for n in state.nodes.values() if n.state is NodeState.LOST and n.node_rank >= 0]
    return min(lost, key=lambda n: n.node_rank) if lost else None


def free_spare(state: RendezvousState, taken: set[str]) -> Optional[Node]:
    spares = [n for n in state.nodes.values() if n.state is NodeState.SPARE and n.node_id not in taken]
    return min(spares, key=lambda n: n.joined_at) if spares else None
