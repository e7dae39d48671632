"""The node pool's calls to the cluster (coordinator/cluster.py): a node joins once and
stays joined, heartbeats while idle, leaves when it drains; and a Nodes call naming a job
reaches that job's engine only from a node that serves it. Decisions are the pure ones of
jobs.ClusterState; this class sequences them through the cluster's log.

Every node is authenticated here, by the cluster, whichever job it joins. A declared job
(a config's [job]) has open membership: a node that joins it serves it from then on, and
its engine only places it (join_job).
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING, Awaitable, Iterable, Mapping, Optional

from meshgate.attestation import secret_hash
from meshgate.coordinator.engine import Coordinator
from meshgate.coordinator.cluster_state.admission import decide_returned, exit_blames_node, uncordon_waits
from meshgate.coordinator.cluster_state.ends import one_line
from meshgate.coordinator.jobs import Caller, ClusterNode
from meshgate.coordinator.rendezvous import JoinAuth, Node, NodeState, check_id
from meshgate.coordinator.rendezvous.events import NodeStateChanged
from meshgate.v1.nodes_pb2 import NodeHealth

if TYPE_CHECKING:
    from meshgate.coordinator.cluster import ClusterCoordinator


async def _nothing_to_wait_for() -> None:
    return None


log = logging.getLogger("meshgate.coordinator")


class NodePool:
    def __init__(self, cluster: "ClusterCoordinator") -> None:
        self.cluster = cluster

    async def join(
        self,
        node_id: str,
        hostname: str,
        slots: int,
        slot_kind: str,
        labels: Mapping[str, str],
        token: str,
        credential: bytes = b"",
        public_key: bytes = b"",
        health: Optional[NodeHealth] = None,
        instance: str = "",
    ) -> tuple[ClusterNode, bytes]:
        """A node joins the cluster (once; later Joins show its credential), with the health
        check its agent ran just before (noted before any job could be given to it). Returns
        the node and, when one was issued, its new node credential."""
        new_credential = secrets.token_bytes(32)
        auth = JoinAuth(token, credential, public_key, secret_hash(new_credential))
        events = self.cluster.state.decide_join(node_id, hostname, slots, slot_kind, labels, auth, self.cluster.clock())
        durable = self.cluster.apply(events)
        self.cluster.state.touch(node_id, self.cluster.clock())
        node = self.cluster.state.nodes[node_id]
        await durable
        await self.note_health(node, health, instance)
        if events and node.job_id in self.cluster.engines:  # a changed vouch key reaches its job too
            await self.cluster.job_nodes.admit(self.cluster.state.jobs[node.job_id])
        await self.cluster.reconcile()
        issued = bool(events) and events[0].token_hash != ""
        return node, new_credential if issued else b""

    async def join_job(
        self,
        engine: Coordinator,
        job_id: str,
        node_id: str,
        hostname: str,
        slots: int,
        slot_kind: str,
        token: str,
        credential: bytes = b"",
        public_key: bytes = b"",
        master_offer: Optional[tuple[str, int]] = None,
        agent_instance: str = "",
        labels: Mapping[str, str] = {},
    ) -> tuple[Node, bytes]:
        """A node's Join to its job: the cluster authenticates it, as any node (a first Join
        spends a cluster token, or the declared job's static dev token; a rejoin shows the
        cluster credential), and a node joining a declared job serves it from now on; then
        the job's engine places it by its rules (a rejoin keeps its place; node_order pins,
        a free node rank, a spare, a stand-in for a lost node). Both are decided before
        either is applied (no await between), so a refused Join changes neither log.
        Returns the node and, when one was issued, its new node credential."""
        engine.state.check_job(job_id)  # a failed or other job is named before the node's credentials
        new_credential = secrets.token_bytes(32)
        auth = JoinAuth(token, credential, public_key, secret_hash(new_credential))
        now = self.cluster.clock()
        joined = self.cluster.state.decide_join(
            node_id, hostname, slots, slot_kind, labels, auth, now, job_id, engine.config.join_token
        )
        self.cluster.state.check_not_drained(node_id, job_id)  # its agent goes back to the pool
        known = self.cluster.state.nodes.get(node_id)
        credential_hash, vouch_key = (
            (joined[0].credential_hash, bytes.fromhex(joined[0].public_key))
            if joined
            else (known.credential_hash, known.public_key)
        )
        admitted = JoinAuth(public_key=vouch_key, new_credential_hash=credential_hash, admitted=True)
        _, placed = engine.state.decide_join(
            job_id, node_id, hostname, slots, slot_kind, now, admitted, master_offer, agent_instance
        )
        durable = self.cluster.apply(joined), engine.apply_join(node_id, placed, agent_instance)
        self.cluster.state.touch(node_id, now)
        for wait in durable:
            await wait
        issued = bool(joined) and joined[0].credential_hash == auth.new_credential_hash
        return engine.state.nodes[node_id], new_credential if issued else b""

    async def adopt(self, engine: Coordinator) -> None:
        """The nodes and unspent tokens a declared job's own log keyed before they joined
        the cluster (cluster_state.pool.decide_adopt)."""
        job_id = engine.config.job_id
        nodes = engine.state.nodes.values()
        await self.cluster.apply(
            self.cluster.state.decide_adopt(job_id, nodes, engine.state.tokens, self.cluster.clock())
        )

    async def create_join_token(self, ttl_s: float, node_id: str, any_node: bool = False) -> tuple[str, float]:
        """A single-use token for a node's first Join, to the pool or to a declared job:
        the cluster spends it either way."""
        token = secrets.token_urlsafe(32)
        now = self.cluster.clock()
        events = self.cluster.state.decide_create_token(secret_hash(token), ttl_s, node_id, now, any_node)
        await self.cluster.apply(events)
        return token, events[0].expires_at

    def heartbeat(self, node_id: str, credential: bytes, live_units: Iterable[str] = ()) -> ClusterNode:
        """An idle node (or one between jobs) keeps itself in the pool; the answer tells
        it which job, if any, it now serves."""
        node = self.cluster.state.decide_node_call(node_id, credential)
        self.note_units(node_id, live_units)
        self.cluster.state.touch(node_id, self.cluster.clock())
        return node

    async def checked_heartbeat(
        self,
        node_id: str,
        credential: bytes,
        live_units: Iterable[str],
        health: Optional[NodeHealth],
        instance: str = "",
    ) -> ClusterNode:
        """An idle heartbeat with the node's health check (None: its agent runs none). The
        check is noted before its units (no await between): a node whose last job's units
        emptied but whose check fails is never idle for an instant."""
        node = self.cluster.state.decide_node_call(node_id, credential)
        durable = self.note_health(node, health, instance)
        node = self.heartbeat(node_id, credential, live_units)
        await durable
        if health is not None and health.passed:
            await self.cluster.reconcile()  # a returned node may take a waiting job now
        return node

    # ---- which nodes may take a job (cluster_state/admission.py) ----------------------------

    def note_health(self, node: ClusterNode, health: Optional[NodeHealth], instance: str) -> Awaitable[None]:
        """A failing check holds the node out of allocation and counts (once) as its
        failure; a passing one returns it, lifts a quarantine, and completes an uncordon
        that waited for it (of agent ``instance``'s checks, one counted after it). Returns the wait for
        the durability of the events it decided, and only those: a heartbeat that decided
        nothing must not wait on someone else's commit (``cluster.apply(())`` waits for
        the latest append, and a held commit then timed every idle heartbeat out)."""
        state, now = self.cluster.state, self.cluster.clock()
        if health is None:  # its agent runs no check (now): no check holds it, none is waited for
            state.note_no_health(node.node_id)
            return _nothing_to_wait_for()
        checked = (instance, health.seq)
        events = state.decide_health(node, health.passed, health.summary, now)
        returned = decide_returned(node, health, checked, now)
        if returned:
            log.warning("node %s uncordoned by %s: its health check passed since", node.node_id, returned[0].by)
        events += returned
        if health.passed and node.unhealthy:
            log.info("node %s: its health check passes again", node.node_id)
        elif not health.passed and not node.unhealthy:
            log.warning("node %s is unhealthy: %s", node.node_id, one_line(health.summary, 300))
        state.note_health(node.node_id, health.passed, health.summary, checked)
        return self.cluster.apply(events) if events else _nothing_to_wait_for()

    async def cordon(self, node_id: str, reason: str, caller: Caller) -> ClusterNode:
        await self.cluster.apply(self.cluster.state.decide_cordon(node_id, reason, caller, self.cluster.clock()))
        log.warning("node %s cordoned by %s: %s", node_id, caller.describe(), reason)
        return self.cluster.state.nodes[node_id]

    async def uncordon(self, node_id: str, caller: Caller) -> ClusterNode:
        """Lifts the node's cordon and quarantine; where its agent runs a health check, only
        once a check run after now passes (the node shows the uncordon asked until then)."""
        state, now = self.cluster.state, self.cluster.clock()
        events = state.decide_uncordon(node_id, caller, now)
        if events and uncordon_waits(state.nodes[node_id]):
            state.note_uncordon_asked(node_id, caller, now)
            log.warning(
                "node %s: uncordon asked by %s; it returns after a passing health check", node_id, caller.describe()
            )
            return state.nodes[node_id]
        await self.cluster.apply(events)
        log.warning("node %s uncordoned by %s", node_id, caller.describe())
        await self.cluster.reconcile()
        return self.cluster.state.nodes[node_id]

    async def blame(self, node_id: str, reason: str) -> None:
        """A failure attributed to ``node_id``; its quarantine_after-th in the window quarantines it."""
        events = self.cluster.state.decide_failure(node_id, reason, self.cluster.clock())
        await self.cluster.apply(events)
        if len(events) > 1:
            log.warning("node %s quarantined: %s", node_id, events[-1].reason)

    async def blame_lost(self, job_id: str, swept: Iterable[object]) -> None:
        """The nodes a job's engine declared lost (Coordinator.take_losses: each once): each
        loss is a failure of that node."""
        for event in swept:
            if isinstance(event, NodeStateChanged) and event.state is NodeState.LOST:
                await self.blame(event.node_id, f"lost from job {job_id} ({event.reason})")

    async def blame_exit(self, engine: Coordinator, request, job_id: str) -> tuple[int, str]:
        """Record a worker's exit in its job's engine (engine.report_exit), and count it
        against its node when it restarted or failed the job (admission.exit_blames_node)."""
        state = engine.state
        restarts, failure = state.worker_restarts, state.failed
        answer = await engine.report_exit(
            job_id,
            request.node_id,
            request.local_rank,
            request.exit_code,
            request.generation,
            request.stopped_by_agent,
            request.node_credential,
            request.start_failed,
            request.detail,
            request.log_tail,
        )
        await self.blame_lost(job_id, engine.take_losses())  # a node found lost while the exit waited on suspects
        stopped = request.stopped_by_agent or request.start_failed
        why = exit_blames_node(
            request.node_id, request.exit_code, stopped, restarts, state.worker_restarts, failure, state.failed
        )
        if why:
            await self.blame(request.node_id, f"{why} {job_id} (local rank {request.local_rank})")
        return answer

    def job_engine(
        self, node_id: str, credential: bytes, job_id: str, running: bool = False, joining: bool = False
    ) -> Optional[Coordinator]:
        """The engine of a job a node names in a Nodes call, in the order that reveals
        nothing and keeps no impostor alive: the node's own credential first, then that
        the job was given to it (PERMISSION_DENIED alike for a job that does not exist),
        and only then does the call count as a sign of the node's life. None for a job
        that ended and whose engine is closed (unless ``running``, which refuses it): the
        caller answers from its summary. ``joining``: a Join, which a declared job (open
        membership) takes from any node; join_job authenticates it in the cluster."""
        check_id("job_id", job_id)  # a malformed id is INVALID_ARGUMENT, whoever asks
        job = self.cluster.state.jobs.get(job_id)
        if joining and job is not None and job.declared:
            return self.cluster.engine(job_id, running)
        self.cluster.state.decide_node_call(node_id, credential)
        self.cluster.state.check_serves(node_id, job_id)
        engine = None if self.cluster.retired(job_id) and not running else self.cluster.engine(job_id, running)
        self.touch(node_id)
        return engine

    def serves_any(self, node_ids: Iterable[str], job_id: str) -> bool:
        """One of ``node_ids`` serves ``job_id``: was given it, or (a declared job) joined it."""
        return self.cluster.state.serves_any(node_ids, job_id)

    def note_units(self, node_id: str, live_units: Iterable[str]) -> None:
        """What a node's authenticated heartbeat says of its containment units."""
        self.cluster.state.note_units(node_id, live_units)
        self.cluster.units_shown.noted()  # a cancel waiting for this node looks again

    def leave(self, node_id: str, credential: bytes) -> None:
        """A draining agent leaves the pool: no job is given to it until it joins again."""
        self.cluster.state.decide_node_call(node_id, credential)
        self.cluster.state.leave(node_id)
        log.info("node %s left the pool", node_id)

    def touch(self, node_id: str) -> None:
        """A node's call to its job's engine is also a sign of life to the cluster, and to
        the job it was given next while it still winds down the last one (that job's lost
        clock started at allocation, before its agent could know of it)."""
        now = self.cluster.clock()
        self.cluster.state.touch(node_id, now)
        node = self.cluster.state.nodes.get(node_id)
        engine = self.cluster.engines.get(node.job_id) if node is not None else None
        if engine is not None and node_id in engine.state.nodes:
            engine.state.touch_node(node_id, now)


__all__ = ["NodePool"]
