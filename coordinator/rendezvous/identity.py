"""Join and node identity: join tokens, an agent's Join (a first join spends a token, a
rejoin shows the node's credential), the nodes the cluster admits, and every later call
proving it comes from the node it names. Pure: ``now`` is passed in."""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Iterable, Optional

from meshgate.attestation import secret_hash
from meshgate.coordinator.rendezvous.errors import (
    MAX_ID_LEN,
    Code,
    RendezvousError,
    check_id,
    check_master_offer,
    shown,
)
from meshgate.coordinator.rendezvous.events import (
    Event,
    MasterOffered,
    NodeAdopted,
    NodeJoined,
    NodeKeyed,
    NodeReplaced,
    NodeStateChanged,
    TokenCreated,
)
from meshgate.coordinator.rendezvous.liveness import awaiting_replacement, decide_restarted, lost_awaiting_replacement
from meshgate.coordinator.rendezvous.model import AdmittedNode, JoinAuth, Node, NodeState, Token
from meshgate.coordinator.rendezvous.register import free_node_rank

if TYPE_CHECKING:
    from meshgate.coordinator.rendezvous.state import RendezvousState


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


_MINT_ANOTHER = ": mint another with meshgate token create --node-id {} and put it in [agent] join_token_file"


def spend_token(tokens: "dict[str, Token]", token_text: str, node_id: str, now: float, static: str = "") -> str:
    """The hash of ``token_text`` if it may admit ``node_id`` now; UNAUTHENTICATED for a
    token that is unknown, used, expired or bound to another node. ``static``: a declared
    job's static dev [job] join_token, accepted and never spent ("" returned)."""
    if static and hmac.compare_digest(token_text.encode(), static.encode()):
        return ""
    token_hash = secret_hash(token_text)
    token = tokens.get(token_hash)
    if token is None:
        raise RendezvousError(
            Code.UNAUTHENTICATED, f"join_token for node_id {node_id!r} is not known{_MINT_ANOTHER.format(node_id)}"
        )
    if token.used_by:
        raise RendezvousError(
            Code.UNAUTHENTICATED,
            f"join_token for node_id {node_id!r} was already used (by node {token.used_by!r})"
            + _MINT_ANOTHER.format(node_id),
        )
    if now >= token.expires_at:
        raise RendezvousError(
            Code.UNAUTHENTICATED,
            f"join_token for node_id {node_id!r} expired {now - token.expires_at:.0f}s ago"
            + _MINT_ANOTHER.format(node_id),
        )
    if token.node_id and token.node_id != node_id:
        raise RendezvousError(
            Code.UNAUTHENTICATED, f"join_token admits node {token.node_id!r}, not node_id {node_id!r}"
        )
    return token_hash


def check_job(state: RendezvousState, job_id: str, allow_failed: bool = False) -> None:
    check_id("job_id", job_id)
    if job_id != state.config.job_id:
        raise RendezvousError(
            Code.FAILED_PRECONDITION,
            f"job_id {job_id!r} is not this coordinator's job {state.config.job_id!r}",
        )
    if state.failed and not allow_failed:
        raise RendezvousError(Code.FAILED_PRECONDITION, f"job {job_id!r} failed: {state.failed}")


def decide_join(
    state: RendezvousState,
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
    check_job(state, job_id)
    check_id("node_id", node_id)
    check_master_offer(master_offer)
    node, events = join_events(state, job_id, node_id, hostname, slots, slot_kind, now, auth)
    events += decide_restarted(state, node, agent_instance, now)
    known = node.master_offer if node is not None else None
    if master_offer is not None and master_offer != known:
        events += (MasterOffered(node_id, *master_offer),)
    return node, events


def join_events(
    state: RendezvousState,
    job_id: str,
    node_id: str,
    hostname: str,
    slots: int,
    slot_kind: str,
    now: float,
    auth: JoinAuth,
) -> tuple[Node | None, tuple[Event, ...]]:
    """decide_join without its instance and master checks: authenticate, then place the
    node (a rejoin keeps its place; a new one takes a free node rank, else waits as a
    spare or stands in for a lost node at once)."""
    keyed = authenticate_join(state, node_id, auth, now)
    if len(hostname) > MAX_ID_LEN:
        raise RendezvousError(Code.INVALID_ARGUMENT, f"hostname is {len(hostname)} characters; at most {MAX_ID_LEN}")
    if slot_kind not in ("gpu", "cpu"):
        raise RendezvousError(Code.INVALID_ARGUMENT, f"slot_kind must be 'gpu' or 'cpu', got {shown(slot_kind)}")
    need = state.config.slots_per_node
    if slots < need:
        raise RendezvousError(
            Code.FAILED_PRECONDITION,
            f"node {node_id!r} reports {slots} {slot_kind} slots; the plan needs {need} per node (slots_per_node): "
            f"join a node with [agent] slots >= {need}, or give the job fewer slots per node (--slots-per-node)",
        )
    node = state.nodes.get(node_id)
    if node is not None and not node.managed:
        keyed = (NodeAdopted(node_id, hostname or node_id, slots, slot_kind, now),) + keyed
    if node is not None:
        if node.state.counted_in:
            return node, keyed
        if node.state is NodeState.REPLACED:
            # Its block went to a spare; it may serve as a spare itself now.
            return node, keyed + (NodeStateChanged(node_id, NodeState.SPARE, now, "rejoined after replacement"),)
        return node, keyed + (NodeStateChanged(node_id, NodeState.ACTIVE, now, "rejoined"),)
    joined = NodeJoined(node_id, -1, now, hostname or node_id, slots, slot_kind)
    try:
        node_rank = free_node_rank(state, node_id)
    except RendezvousError:
        # Every node rank is held: a hot spare, or straight away the stand-in for a lost node.
        lost = lost_awaiting_replacement(state)
        if lost is None:
            return None, (joined,) + keyed
        return None, (joined,) + keyed + (NodeReplaced(node_id, lost.node_id, lost.node_rank, now),)
    return None, (NodeJoined(node_id, node_rank, now, hostname or node_id, slots, slot_kind),) + keyed


def authenticate_join(state: RendezvousState, node_id: str, auth: JoinAuth, now: float) -> tuple[Event, ...]:
    """UNAUTHENTICATED for a used, expired, unknown or misdirected token, or a wrong
    credential; nothing changes then. Returns the NodeKeyed event to apply, if any. A node
    the cluster admitted is keyed with the cluster's credential hash and vouch key; the token
    and credential checks below remain for engines without a cluster (tests, benchmarks)."""
    if auth.admitted:
        return keyed(state, node_id, auth.new_credential_hash, auth.public_key.hex(), now)
    if auth.public_key and len(auth.public_key) != 32:
        raise RendezvousError(
            Code.INVALID_ARGUMENT,
            f"node_public_key must be a raw 32-byte Ed25519 key, got {len(auth.public_key)} bytes",
        )
    node = state.nodes.get(node_id)
    if auth.credential:
        if (
            node is None
            or not node.credential_hash
            or not hmac.compare_digest(secret_hash(auth.credential), node.credential_hash)
        ):
            raise RendezvousError(Code.UNAUTHENTICATED, f"node_credential is not valid for node_id {node_id!r}")
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
    token_hash = spend_token(state.tokens, auth.token, node_id, now, state.config.join_token)
    return (NodeKeyed(node_id, auth.new_credential_hash, auth.public_key.hex(), token_hash, now),)


def decide_create_token(
    state: RendezvousState, job_id: str, token_hash: str, ttl_s: float, node_id: str, now: float, any_node: bool = False
) -> tuple[Event, ...]:
    """A token admits one named node; one for any node only when asked for explicitly."""
    check_job(state, job_id)
    return (new_token(token_hash, ttl_s, node_id, now, any_node),)


def decide_admit(state: RendezvousState, admitted: Iterable[AdmittedNode], now: float) -> tuple[Event, ...]:
    """The job's nodes as the cluster allocated them, and the nodes it gave the job from
    the pool (``replaces``: each takes the block it was given for, if that still waits).
    Idempotent: a node already known (a replay, a restarted coordinator) adds nothing
    unless its key changed."""
    events: list[Event] = []
    waiting = {n.node_id: n for n in awaiting_replacement(state, spares_too=True)}
    for a in admitted:
        node = state.nodes.get(a.node_id)
        if node is None:
            events.append(NodeJoined(a.node_id, a.node_rank, now, a.hostname, a.slots, a.slot_kind))
        events.extend(keyed(state, a.node_id, a.credential_hash, a.public_key, now))
        lost = waiting.pop(a.replaces, None) if node is None and a.node_rank < 0 else None
        if lost is not None:  # given from the pool for this block: it takes it now
            events.append(NodeReplaced(a.node_id, lost.node_id, lost.node_rank, now))
    return tuple(events)


def keyed(state: RendezvousState, node_id: str, credential_hash: str, public_key: str, now: float) -> tuple[Event, ...]:
    """NodeKeyed for a node the cluster authenticated, unless the job knows it so keyed."""
    node = state.nodes.get(node_id)
    if node is not None and node.credential_hash == credential_hash and node.public_key.hex() == public_key:
        return ()
    return (NodeKeyed(node_id, credential_hash, public_key, "", now),)


def decide_node_call(
    state: RendezvousState, job_id: str, node_id: str, credential: Optional[bytes] = None, allow_failed: bool = False
) -> Node:
    """A later agent call: the node must have joined, and (when ``credential`` is
    checked) prove it is that node: no node acts for another. ``allow_failed``: the
    calls that still answer once the job failed (heartbeats learn of the failure,
    exits are still reported)."""
    check_job(state, job_id, allow_failed)
    check_id("node_id", node_id)
    node = state.nodes.get(node_id)
    if node is None or not node.managed:
        raise RendezvousError(Code.FAILED_PRECONDITION, f"node_id {node_id!r} has not joined; call Join first")
    if credential is not None and node.credential_hash:
        if not credential:
            raise RendezvousError(Code.UNAUTHENTICATED, f"node_credential missing for node_id {node_id!r}")
        if not hmac.compare_digest(secret_hash(credential), node.credential_hash):
            raise RendezvousError(Code.PERMISSION_DENIED, f"node_credential does not belong to node_id {node_id!r}")
    return node


def note_instance(state: RendezvousState, node_id: str, agent_instance: str, joined: bool) -> None:
    """Liveness, not persisted: the instance a Join brings, or the first one a
    heartbeat shows (after a coordinator restart)."""
    node = state.nodes.get(node_id)
    if node is not None and agent_instance and (joined or not node.agent_instance):
        node.agent_instance = agent_instance


def touch_node(state: RendezvousState, node_id: str, now: float) -> None:
    state.nodes[node_id].last_seen = now
