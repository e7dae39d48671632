"""The pool's nodes: a node's Join to the cluster (a first join spends a token bound to
it, a rejoin shows its credential), join tokens, later calls proving which node calls,
liveness, and each node's place in the pool (PoolState). Pure: ``now`` is passed in."""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Iterable, Mapping

from meshgate.attestation import secret_hash
from meshgate.coordinator.cluster_state.admission import hold
from meshgate.coordinator.cluster_state.events import ClusterEvent, ClusterNodeJoined
from meshgate.coordinator.cluster_state.model import ClusterNode, Job, PoolState
from meshgate.coordinator.rendezvous import (
    MAX_ID_LEN,
    Code,
    JoinAuth,
    Node,
    RendezvousError,
    Token,
    TokenCreated,
    check_id,
    new_token,
    shown,
    spend_token,
)

if TYPE_CHECKING:
    from meshgate.coordinator.jobs import ClusterState

MAX_LABELS, MAX_LABEL_LEN = 16, 63
MAX_LIVE_UNITS = 64  # a heartbeat's live_units: a node holds few job runs at once


def is_live(cluster: ClusterState, node: ClusterNode, now: float) -> bool:
    return now - node.last_seen <= cluster.heartbeat_timeout_s


def silent_for(cluster: ClusterState, last_seen: float, now: float) -> float:
    """How long a node has been silent, once that makes it a suspect: past one heartbeat
    interval and its tolerance (half an interval), before heartbeat_misses make it left
    or lost; 0 while it is heard in time. Views show it (`silent 8s`), nothing decides on it."""
    interval = cluster.heartbeat_interval_s
    suspect_after = interval * 1.5 if interval else cluster.heartbeat_timeout_s / 2
    silent = now - last_seen
    return silent if silent > suspect_after else 0.0


def idle_nodes(cluster: ClusterState, now: float) -> list[ClusterNode]:
    """The nodes a job can be given: no job, their last job's processes gone, heard in
    time, and nothing holding them (a cordon, a quarantine, a failing check: admission.py)."""
    return [
        n for n in cluster.nodes.values() if not n.job_id and n.units_clear and cluster.is_live(n, now) and not hold(n)
    ]


def pool_state(cluster: ClusterState, node: ClusterNode, now: float) -> PoolState:
    if node.job_id:
        return PoolState.SERVING
    if not node.units_clear:
        return PoolState.DRAINING if node.drained_from else PoolState.CLEARING
    if not cluster.is_live(node, now):
        return PoolState.LEFT
    held = hold(node)
    return held[0] if held else PoolState.IDLE


def decide_join(
    cluster: ClusterState,
    node_id: str,
    hostname: str,
    slots: int,
    slot_kind: str,
    labels: Mapping[str, str],
    auth: JoinAuth,
    now: float,
    job_id: str = "",
    static_token: str = "",
) -> tuple[ClusterEvent, ...]:
    """A node joins the cluster: a first Join spends a single-use token bound to it;
    a rejoin shows its credential (a token never replaces a credential). ``job_id``: the
    declared job it joins (it serves that job from now on); ``static_token``: that job's
    static dev [job] join_token, accepted and never spent."""
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
    node = cluster.nodes.get(node_id)
    pairs = tuple(sorted(labels.items()))
    if auth.credential:
        if node is None or not hmac.compare_digest(secret_hash(auth.credential), node.credential_hash):
            raise RendezvousError(Code.UNAUTHENTICATED, f"node_credential is not valid for node_id {node_id!r}")
        if job_id and node.job_id not in ("", job_id):
            raise RendezvousError(
                Code.FAILED_PRECONDITION, f"node_id {node_id!r} serves job {node.job_id!r}, not job {job_id!r}"
            )
        public_key = auth.public_key or node.public_key
        same = (hostname or node_id, slots, slot_kind, labels, public_key, job_id or node.job_id) == (
            node.hostname,
            node.slots,
            node.slot_kind,
            node.labels,
            node.public_key,
            node.job_id,
        )
        if same:
            return ()
        return (
            ClusterNodeJoined(
                node_id,
                hostname or node_id,
                slots,
                slot_kind,
                pairs,
                node.credential_hash,
                public_key.hex(),
                "",
                now,
                job_id,
            ),
        )
    if not auth.token:
        raise RendezvousError(
            Code.UNAUTHENTICATED,
            f"node_id {node_id!r} presented no join_token and no node_credential: give its agent a token "
            f"([agent] join_token_file) from meshgate token create --node-id {node_id}",
        )
    if node is not None:
        raise RendezvousError(
            Code.PERMISSION_DENIED,
            f"node_id {node_id!r} already holds a node credential; a Join for it needs that "
            "credential, not a join_token (its agent keeps it as node.credential in its [agent] state_dir: "
            "restore that file, or join this host under a new node_id)",
        )
    if not auth.public_key:
        raise RendezvousError(Code.INVALID_ARGUMENT, f"node_id {node_id!r}: a first Join needs node_public_key")
    token_hash = spend_token(cluster.tokens, auth.token, node_id, now, static_token)
    return (
        ClusterNodeJoined(
            node_id,
            hostname or node_id,
            slots,
            slot_kind,
            pairs,
            auth.new_credential_hash,
            auth.public_key.hex(),
            token_hash,
            now,
            job_id,
        ),
    )


def decide_adopt(
    cluster: ClusterState, job_id: str, nodes: Iterable[Node], tokens: Mapping[str, Token], now: float
) -> tuple[ClusterEvent, ...]:
    """A declared job's log written before its nodes joined the cluster (or a migrated
    single-job log) keyed them and held their tokens: the cluster takes over the nodes it
    does not know (each serving ``job_id``, with its credential hash and vouch key) and
    the tokens still unspent, so those nodes and tokens get in as before."""
    events: list[ClusterEvent] = [
        ClusterNodeJoined(
            n.node_id,
            n.hostname or n.node_id,
            max(n.slots, 1),
            n.slot_kind or "gpu",
            (),
            n.credential_hash,
            n.public_key.hex(),
            "",
            now,
            job_id,
        )
        for n in nodes
        if n.credential_hash and n.node_id not in cluster.nodes
    ]
    events += [
        TokenCreated(token_hash, token.expires_at, token.node_id, now)
        for token_hash, token in tokens.items()
        if not token.used_by and token_hash not in cluster.tokens
    ]
    return tuple(events)


def decide_create_token(
    cluster: ClusterState, token_hash: str, ttl_s: float, node_id: str, now: float, any_node: bool = False
) -> tuple[ClusterEvent, ...]:
    return (new_token(token_hash, ttl_s, node_id, now, any_node),)


def check_serves(cluster: ClusterState, node_id: str, job_id: str) -> Job:
    """PERMISSION_DENIED unless ``node_id`` was given to ``job_id`` (member or spare) or
    joined it (a declared job's); the same answer whether or not the job exists, so a
    node learns nothing of others."""
    job = cluster.jobs.get(job_id) if isinstance(job_id, str) else None
    if job is None or not serves(cluster, node_id, job):
        raise RendezvousError(Code.PERMISSION_DENIED, f"node_id {shown(node_id)} does not serve job {shown(job_id)}")
    return job


def serves_any(cluster: ClusterState, node_ids: Iterable[str], job_id: str) -> bool:
    """One of ``node_ids`` was given ``job_id`` (an agent certificate may name several)."""
    job = cluster.jobs.get(job_id)
    return job is not None and any(serves(cluster, node_id, job) for node_id in node_ids)


def serves(cluster: ClusterState, node_id: str, job: Job) -> bool:
    node = cluster.nodes.get(node_id)
    return node_id in job.given or (node is not None and node.job_id == job.spec.job_id)


def decide_node_call(cluster: ClusterState, node_id: str, credential: bytes) -> ClusterNode:
    """A later cluster call: the node joined, and the credential is its own."""
    check_id("node_id", node_id)
    node = cluster.nodes.get(node_id)
    if node is None:
        raise RendezvousError(Code.FAILED_PRECONDITION, f"node_id {node_id!r} has not joined; call Join first")
    if not credential:
        raise RendezvousError(Code.UNAUTHENTICATED, f"node_credential missing for node_id {node_id!r}")
    if not hmac.compare_digest(secret_hash(credential), node.credential_hash):
        raise RendezvousError(Code.PERMISSION_DENIED, f"node_credential does not belong to node_id {node_id!r}")
    return node


def leave(cluster: ClusterState, node_id: str) -> None:
    """A draining node is out of the pool until it calls again (liveness, not persisted)."""
    cluster.nodes[node_id].last_seen = float("-inf")


def note_units(cluster: ClusterState, node_id: str, live_units: Iterable[str]) -> None:
    """A heartbeat's live_units (already authenticated): the node may go back to the
    pool only once they are none."""
    live = list(live_units)
    if len(live) > MAX_LIVE_UNITS:
        raise RendezvousError(Code.INVALID_ARGUMENT, f"live_units lists {len(live)} jobs; at most {MAX_LIVE_UNITS}")
    node = cluster.nodes.get(node_id)
    if node is not None:
        node.units_clear = not live


def touch(cluster: ClusterState, node_id: str, now: float) -> None:
    node = cluster.nodes.get(node_id)
    if node is not None:
        node.last_seen = max(node.last_seen, now)


def check_labels(labels: Mapping[str, str]) -> dict[str, str]:
    if len(labels) > MAX_LABELS:
        raise RendezvousError(Code.INVALID_ARGUMENT, f"labels: {len(labels)} given; at most {MAX_LABELS}")
    out = {}
    for key, value in labels.items():
        for what, text in (("key", key), ("value", value)):
            if (
                not isinstance(text, str)
                or not text
                or len(text) > MAX_LABEL_LEN
                or not text.replace("-", "").replace("_", "").replace(".", "").isalnum()
            ):
                raise RendezvousError(
                    Code.INVALID_ARGUMENT,
                    f"labels: {what} {shown(text)} must be 1..{MAX_LABEL_LEN} characters of [A-Za-z0-9._-]",
                )
        out[key] = value
    return out
