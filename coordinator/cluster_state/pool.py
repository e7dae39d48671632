"""The pool's nodes: a node's Join to the cluster (a first join spends a token bound to
it, a rejoin shows its credential), join tokens, later calls proving which node calls,
liveness, and each node's place in the pool (PoolState). Pure: ``now`` is passed in."""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Iterable, Mapping

from meshgate.attestation import secret_hash
from meshgate.coordinator.cluster_state.events import ClusterEvent, ClusterNodeJoined
from meshgate.coordinator.cluster_state.model import ClusterNode, Job, PoolState
from meshgate.coordinator.rendezvous import (
    MAX_ID_LEN,
    Code,
    JoinAuth,
    RendezvousError,
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


def idle_nodes(cluster: ClusterState, now: float) -> list[ClusterNode]:
    return [n for n in cluster.nodes.values() if not n.job_id and n.units_clear and cluster.is_live(n, now)]


def pool_state(cluster: ClusterState, node: ClusterNode, now: float) -> PoolState:
    if node.job_id:
        return PoolState.SERVING
    if not node.units_clear:
        return PoolState.CLEARING
    return PoolState.IDLE if cluster.is_live(node, now) else PoolState.LEFT


def decide_join(
    cluster: ClusterState,
    node_id: str,
    hostname: str,
    slots: int,
    slot_kind: str,
    labels: Mapping[str, str],
    auth: JoinAuth,
    now: float,
) -> tuple[ClusterEvent, ...]:
    """A node joins the cluster: a first Join spends a single-use token bound to it;
    a rejoin shows its credential (a token never replaces a credential)."""
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
        public_key = auth.public_key or node.public_key
        same = (hostname or node_id, slots, slot_kind, labels, public_key) == (
            node.hostname,
            node.slots,
            node.slot_kind,
            node.labels,
            node.public_key,
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
            ),
        )
    if not auth.token:
        raise RendezvousError(
            Code.UNAUTHENTICATED, f"node_id {node_id!r} presented no join_token and no node_credential"
        )
    if node is not None:
        raise RendezvousError(
            Code.PERMISSION_DENIED,
            f"node_id {node_id!r} already holds a node credential; a Join for it needs that "
            "credential, not a join_token",
        )
    if not auth.public_key:
        raise RendezvousError(Code.INVALID_ARGUMENT, f"node_id {node_id!r}: a first Join needs node_public_key")
    token_hash = spend_token(cluster.tokens, auth.token, node_id, now)
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
        ),
    )


def decide_create_token(
    cluster: ClusterState, token_hash: str, ttl_s: float, node_id: str, now: float, any_node: bool = False
) -> tuple[ClusterEvent, ...]:
    return (new_token(token_hash, ttl_s, node_id, now, any_node),)


def check_serves(cluster: ClusterState, node_id: str, job_id: str) -> Job:
    """PERMISSION_DENIED unless ``node_id`` was given to ``job_id`` (member or spare);
    the same answer whether or not the job exists, so a node learns nothing of others."""
    job = cluster.jobs.get(job_id) if isinstance(job_id, str) else None
    if job is None or node_id not in job.nodes + job.spares:
        raise RendezvousError(Code.PERMISSION_DENIED, f"node_id {shown(node_id)} does not serve job {shown(job_id)}")
    return job


def serves_any(cluster: ClusterState, node_ids: Iterable[str], job_id: str) -> bool:
    """One of ``node_ids`` was given ``job_id`` (an agent certificate may name several)."""
    job = cluster.jobs.get(job_id)
    return job is not None and not set(node_ids).isdisjoint(job.nodes + job.spares)


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
