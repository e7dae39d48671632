"""How each event changes a job's rendezvous: one handler per event type, in a table.
``RendezvousState.apply`` looks the handler up by the event's type; an event type
without a handler is a KeyError at once (tests/test_decisions_by_concern.py checks that
every type in EVENT_TYPES has one)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Callable

from meshgate.coordinator.rendezvous.events import (
    GenerationBumped,
    JobFailed,
    MasterChosen,
    MasterOffered,
    NodeAdopted,
    NodeJoined,
    NodeKeyed,
    NodeReplaced,
    NodeStateChanged,
    RankAssigned,
    TokenCreated,
    WorkerSucceeded,
)
from meshgate.coordinator.rendezvous.model import Assignment, Node, NodeState, Token

if TYPE_CHECKING:
    from meshgate.coordinator.rendezvous.state import RendezvousState


def node_joined(state: RendezvousState, event: NodeJoined) -> None:
    state.nodes[event.node_id] = Node(
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
        state.nodes[event.node_id].state = NodeState.SPARE
    else:
        state.node_ids_by_rank[event.node_rank] = event.node_id
        state.free_node_rank_from = max(state.free_node_rank_from, len(state.config.node_order))
        while state.free_node_rank_from in state.node_ids_by_rank:
            state.free_node_rank_from += 1
    if len(state.nodes) == 1:  # the first node opens it (0.0 is a valid injected time)
        state.opened_at = event.at


def node_adopted(state: RendezvousState, event: NodeAdopted) -> None:
    node = state.nodes[event.node_id]
    node.hostname, node.slots, node.slot_kind = event.hostname, event.slots, event.slot_kind
    node.managed, node.last_seen = True, event.at


def node_state_changed(state: RendezvousState, event: NodeStateChanged) -> None:
    node = state.nodes[event.node_id]
    node.state = event.state
    # A node gone with its part unfinished is awaited, up to lost_node_timeout_s.
    if event.state.gone and node.node_rank >= 0 and not state.finished_its_part(node):
        state.lost_since[event.node_id] = event.at
    else:
        state.lost_since.pop(event.node_id, None)
    if event.state.counted_in:
        node.last_seen = event.at


def node_replaced(state: RendezvousState, event: NodeReplaced) -> None:
    spare, lost = state.nodes[event.spare_id], state.nodes[event.lost_id]
    spare.node_rank, spare.state, spare.last_seen = event.node_rank, NodeState.ACTIVE, event.at
    lost.node_rank, lost.state = -1, NodeState.REPLACED
    state.lost_since.pop(event.lost_id, None)
    state.node_ids_by_rank[event.node_rank] = event.spare_id
    release_node(state, event.lost_id)


def job_failed(state: RendezvousState, event: JobFailed) -> None:
    state.failed, state.failed_log_tail = event.reason, event.log_tail


def token_created(state: RendezvousState, event: TokenCreated) -> None:
    state.tokens[event.token_hash] = Token(event.expires_at, event.node_id)


def node_keyed(state: RendezvousState, event: NodeKeyed) -> None:
    node = state.nodes[event.node_id]
    node.credential_hash = event.credential_hash
    node.public_key = bytes.fromhex(event.public_key)
    if event.token_hash:
        state.tokens[event.token_hash].used_by = event.node_id


def rank_assigned(state: RendezvousState, event: RankAssigned) -> None:
    node = state.nodes[event.node_id]
    kept = state.by_worker.get(event.worker_id)
    if kept is not None and kept.rank == event.rank:
        renew(state, kept)  # a survivor's worker registered again in a later generation
    else:
        assignment = Assignment(
            event.worker_id, event.rank, event.node_id, node.node_rank, event.local_rank, state.generation
        )
        state.by_worker[event.worker_id] = assignment
        state.by_rank[event.rank] = assignment
        state.registered_now += 1
        node.registered += 1
    state.worker_seen[event.worker_id] = event.at
    state.claimed_seen = state.claimed_seen or event.claimed
    if event.vouch_id:
        state.used_vouches[event.vouch_id] = event.worker_id
    node.last_seen = max(node.last_seen, event.at)


def renew(state: RendezvousState, kept: Assignment) -> None:
    """A kept rank's worker holds it in the current generation too (it registered again, or
    a heartbeat proved it with this generation's secret): it counts in this world now."""
    if kept.generation != state.generation:
        now = replace(kept, generation=state.generation)
        state.by_worker[kept.worker_id] = state.by_rank[kept.rank] = now
        state.registered_now += 1


def worker_succeeded(state: RendezvousState, event: WorkerSucceeded) -> None:
    state.succeeded_workers.add((event.node_id, event.local_rank))


def master_chosen(state: RendezvousState, event: MasterChosen) -> None:
    state.master = (event.host, event.port)


def master_offered(state: RendezvousState, event: MasterOffered) -> None:
    state.nodes[event.node_id].master_offer = (event.host, event.port)


def generation_bumped(state: RendezvousState, event: GenerationBumped) -> None:
    state.generation = event.generation
    # A new membership epoch: the lost nodes' ranks are free for their stand-ins,
    # every other rank stays; rank 0 names a fresh master address. An agent's master offer
    # is for the launch it joined for: every agent rejoins for the next generation, and
    # node rank 0's agent released its port to its workers and reserves a fresh one, so an
    # old offer kept here would send the other nodes' workers to a port nobody listens on.
    for node in state.nodes.values():
        node.master_offer = None
        if event.worker_restart or node.state in (NodeState.LOST, NodeState.REPLACED):
            release_node(state, node.node_id)
    if event.worker_restart:
        state.worker_restarts += 1
    # The kept ranks of survivors belong to the generation that ended: none counts in the
    # new one's world until its worker registers again (world formed, registered n/m).
    state.registered_now = 0
    state.succeeded_workers.clear()
    state.master = None


def release_node(state: RendezvousState, node_id: str) -> None:
    held = [a for a in state.by_worker.values() if a.node_id == node_id]
    for assignment in held:
        if assignment.generation == state.generation:
            state.registered_now -= 1
        del state.by_worker[assignment.worker_id]
        del state.by_rank[assignment.rank]
        state.worker_seen.pop(assignment.worker_id, None)
    state.nodes[node_id].registered = 0


HANDLERS: dict[type, Callable] = {
    NodeJoined: node_joined,
    NodeAdopted: node_adopted,
    NodeStateChanged: node_state_changed,
    NodeReplaced: node_replaced,
    JobFailed: job_failed,
    TokenCreated: token_created,
    NodeKeyed: node_keyed,
    RankAssigned: rank_assigned,
    WorkerSucceeded: worker_succeeded,
    MasterChosen: master_chosen,
    MasterOffered: master_offered,
    GenerationBumped: generation_bumped,
}
