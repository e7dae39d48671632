"""The owner of the rendezvous state: it applies decisions, hands their events to the
store and answers only once they are durable, signs attestations and runs the barrier.
It knows nothing of gRPC (coordinator/service.py adapts it).

Why there is no lock: decide -> apply -> store.append are synchronous, so on one
event loop each decision sees every earlier one, and the store writes events in the
order they were decided. Only the wait for durability yields; an RPC is never
answered before its events are on disk, and a store failure stops the coordinator
(the disk then holds a prefix of the applied events, with nothing acknowledged past it).

The invariant "every answer waits until what it reports is durable" lives in
``_apply`` alone: a decision with no events of its own (a retried Register, a
duplicate still in flight) may report state that an earlier, not yet durable append
created, so it waits for the latest append (stores write in order, so that covers
every earlier one). And a decision is complete before it is applied: whatever can
fail (signing, building the attestation) runs first, so an exception never leaves
state applied that no one was answered for.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

from meshgate.coordinator.keys import KeyRing
from meshgate.coordinator.rendezvous import (
    AdmittedNode,
    Assignment,
    Code,
    Event,
    GenerationBumped,
    JobFailed,
    JoinAuth,
    Node,
    NodeJoined,
    NodeKeyed,
    NodeState,
    NodeStateChanged,
    RankAssigned,
    RegisterInput,
    RendezvousConfig,
    RendezvousError,
    RendezvousState,
)
from meshgate.coordinator.store import Store, StoreError
from meshgate import logs, metrics
from meshgate.attestation import AttestationTemplate, secret_hash
from meshgate.v1 import attestation_pb2

log = logging.getLogger("meshgate.coordinator")

Clock = Callable[[], float]


@dataclass(frozen=True)
class WorldView:
    job_id: str
    generation: int
    world_size: int
    master: Optional[tuple[str, int]]
    members: tuple[Assignment, ...]


@dataclass(frozen=True)
class BatchAnswer:
    """What register_batch answers: per request, (attestation, heartbeat secret) or the
    refusal; with one signature, ``batch`` is the AttestationBatch every attestation is
    an entry of (sent once; attach it with meshgate.attestation.with_batch)."""

    results: list[tuple[attestation_pb2.SignedAttestation, bytes] | RendezvousError]
    batch: bytes = b""


class Coordinator:
    def __init__(
        self,
        config: RendezvousConfig,
        store: Store,
        keys: KeyRing,
        *,
        attestation_ttl_s: float,
        clock: Clock = time.time,
        heartbeat_timeout_s: float = 15.0,
        on_store_failure: Optional[Callable[[BaseException], None]] = None,
    ) -> None:
        self.config = config
        self.store = store
        self.keys = keys
        self.clock = clock
        self.attestation_ttl_s = attestation_ttl_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.on_store_failure = on_store_failure
        self._tail: Optional["asyncio.Future[None]"] = None  # the latest append's durability
        self.losses: list[NodeStateChanged] = []  # nodes declared lost, not taken yet (take_losses)
        self.signer = Signer(config, keys, attestation_ttl_s)  # this job's attestations and heartbeat secrets
        self.state = RendezvousState(config)
        replay(self.state, store, clock())
        # Set when the current generation's world completes, or when the generation
        # ends (bump, failure): waiters then re-check and learn which.
        self._world_event = asyncio.Event()
        self._update_world_event(None)

    # ---- the one way state changes ---------------------------------------------------------

    def _apply(self, events: tuple[Event, ...]) -> Awaitable[None]:
        """Apply ``events`` now and return the wait for the durability of everything
        applied so far (with no events: of the latest earlier append)."""
        if not events:
            tail = self._tail
            if tail is None or (tail.done() and not tail.cancelled() and tail.exception() is None):
                return _DONE
            return self._durable(tail)
        generation, complete = self.state.generation, self.state.complete
        self.state.apply_all(events)
        durable = self._tail = self.store.append(events)
        self._update_world_event(generation)
        formed = self.state.complete and (not complete or self.state.generation != generation)  # just now
        _log_applied(events, self.state, formed)
        return self._durable(durable)

    async def _durable(self, durable: Awaitable[None]) -> None:
        await await_durable(durable, self.on_store_failure)

    def _update_world_event(self, old_generation: Optional[int]) -> None:
        if old_generation is not None and (self.state.generation != old_generation or self.state.failed):
            self._world_event.set()  # wake the old generation's waiters
            self._world_event = asyncio.Event()
        if self.state.complete or self.state.failed:
            self._world_event.set()

    # ---- nodes ---------------------------------------------------------------------------

    async def join(
        self,
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
    ) -> tuple[Node, bytes]:
        """Returns the node and, when one was issued, its new node credential. (A cluster's
        nodes join through NodePool.join_declared, which authenticates them in the cluster;
        this engine's own tokens serve engines built without one.)"""
        new_credential = secrets.token_bytes(32)
        auth = JoinAuth(token, credential, public_key, secret_hash(new_credential))
        _, events = self.state.decide_join(
            job_id, node_id, hostname, slots, slot_kind, self.clock(), auth, master_offer, agent_instance
        )
        await self.apply_join(node_id, events, agent_instance)
        issued = any(isinstance(e, NodeKeyed) and e.credential_hash == auth.new_credential_hash for e in events)
        return self.state.nodes[node_id], new_credential if issued else b""

    def apply_join(self, node_id: str, events: tuple[Event, ...], agent_instance: str) -> Awaitable[None]:
        """Apply a decided Join now (no await between its decision and this) and return the
        wait for its durability."""
        durable = self._apply(events)
        self.state.note_instance(node_id, agent_instance, joined=True)
        _log_job_events(events)
        return durable

    async def create_join_token(
        self, job_id: str, ttl_s: float, node_id: str, any_node: bool = False
    ) -> tuple[str, float]:
        token = secrets.token_urlsafe(32)
        events = self.state.decide_create_token(job_id, secret_hash(token), ttl_s, node_id, self.clock(), any_node)
        await self._apply(events)
        return token, events[0].expires_at

    def node_heartbeat(
        self, job_id: str, node_id: str, credential: Optional[bytes] = None, agent_instance: str = ""
    ) -> Node:
        """Answers even once the job failed: that is how the agents learn of it."""
        node = self.state.decide_node_call(job_id, node_id, credential, allow_failed=True)
        if not node.state.counted_in:
            raise RendezvousError(
                Code.FAILED_PRECONDITION,
                f"node_id {node_id!r} is {node.state.value}; it must Join again",
            )
        self.state.touch_node(node_id, self.clock())
        self.state.note_instance(node_id, agent_instance, joined=False)
        return node

    async def report_exit(
        self,
        job_id: str,
        node_id: str,
        local_rank: int,
        exit_code: int,
        generation: int,
        stopped_by_agent: bool,
        credential: Optional[bytes] = None,
        start_failed: bool = False,
        detail: str = "",
        log_tail: str = "",
    ) -> tuple[int, str]:
        """Record a worker's exit; a failure ends the generation or fails the job (see
        decide_worker_exit). Returns (current generation, job failure) once durable.
        Idempotent per (generation, node, local rank): an agent resends an exit until it is
        answered; a resend decides nothing new (its generation is over, its success counted)."""
        node = self.state.decide_node_call(job_id, node_id, credential, allow_failed=True)
        line = f"local {local_rank}: " + ("could not start" if start_failed else f"exit {exit_code}")
        if line not in node.exits[-1:]:
            node.exits = (node.exits + [line])[-16:]  # operator view, not persisted state
        log.info("node %s: %s (generation %d)", node_id, line, generation)
        if exit_code != 0 and not (stopped_by_agent or start_failed):
            await hold_for_suspects(self, node_id, generation)
        now = self.clock()
        events = self.state.decide_worker_exit(
            node, local_rank, exit_code, generation, stopped_by_agent, now, start_failed, detail, log_tail
        )
        events += self.state.decide_worker_succeeded(node, local_rank, exit_code, generation, stopped_by_agent, now)
        durable = self._apply(events)
        _log_job_events(events)
        await durable
        return self.state.generation, self.state.failed

    async def admit(self, admitted: list[AdmittedNode]) -> None:
        """The nodes the cluster allocated to this job join its state (jobs mode)."""
        await self._apply(self.state.decide_admit(admitted, self.clock()))

    async def end(self, reason: str) -> None:
        """The job ended from outside (cancelled): nothing more is decided in it, and its
        agents learn it from their next call, as of a failure."""
        durable = self._apply((JobFailed(reason, self.clock()),))
        log.info("job %s: %s", self.config.job_id, reason)  # a cancel: someone's decision, not a failure
        await durable

    async def durable(self) -> None:
        """Wait until everything applied so far is in the log (before closing it)."""
        await self._apply(())

    async def leave(self, job_id: str, node_id: str, reason: str, credential: Optional[bytes] = None) -> None:
        events = self.state.decide_leave(job_id, node_id, reason, self.clock(), credential)
        durable = self._apply(events)
        _log_job_events(events)
        await durable

    async def sweep_lost(self) -> tuple[Event, ...]:
        events = self.state.decide_lost(self.clock(), self.heartbeat_timeout_s)
        durable = self._apply(events)
        lost = [e for e in events if isinstance(e, NodeStateChanged) and e.state is NodeState.LOST]
        metrics.count_nodes_lost(len(lost))
        self.losses += lost
        _log_job_events(events)
        await durable
        return events

    def take_losses(self) -> list[NodeStateChanged]:
        """The nodes declared lost since the last take (by the cluster's sweep, or while a
        failed exit waited on suspects): each is taken once, to be blamed on its node."""
        losses, self.losses = self.losses, []
        return losses

    # ---- workers -------------------------------------------------------------------------

    async def register(self, request: RegisterInput) -> tuple[attestation_pb2.SignedAttestation, bytes]:
        """The attestation and the worker's fresh heartbeat secret."""
        signed, secret, durable = self._register_now(request)
        await durable
        return signed, secret

    async def register_batch(
        self,
        job_id: str,
        node_id: str,
        credential: bytes,
        requests: list[RegisterInput],
        one_signature: bool = False,
        agent_channel: bool = False,
    ) -> BatchAnswer:
        """An agent's fan-in: its node's Registers in one call, one wait for durability.
        The node is authenticated once; each request must be for that node and is then
        checked as a Register is (``agent_channel``, mTLS naming the node: its vouch's
        signature excepted, register.check_vouch). ``one_signature``: one signature
        covers every attestation of the batch."""
        self.state.decide_node_call(job_id, node_id, credential)
        results: list[tuple[attestation_pb2.SignedAttestation | bytes, bytes] | RendezvousError] = []
        durables = []
        for request in requests:
            if request.node_id != node_id:
                results.append(
                    RendezvousError(
                        Code.PERMISSION_DENIED,
                        f"node {node_id!r} cannot forward a Register for node_id {request.node_id!r}",
                    )
                )
                continue
            try:
                # Its own vouch is checked: the agent's channel stands in only for its signature.
                attested, secret, durable = self._register_now(request, not one_signature, agent_channel)
            except RendezvousError as exc:
                results.append(exc)
                continue
            results.append((attested, secret))
            durables.append(durable)
        batch = b""
        payloads = [r[0] for r in results if not isinstance(r, RendezvousError)]
        if one_signature and payloads:
            # Signed after the batch's decisions were applied (each decision needs the one
            # before it). Ed25519 signing cannot fail on a valid key; were it to, each
            # worker keeps its rank and gets the same one when it registers again.
            batch, signed = self.signer.sign_batch(self.state.generation, payloads)
            by_payload = iter(signed)
            results = [r if isinstance(r, RendezvousError) else (next(by_payload), r[1]) for r in results]
        for durable in durables:
            await durable
        return BatchAnswer(results, batch)

    def _register_now(self, request: RegisterInput, sign: bool = True, agent_channel: bool = False):
        """Decide, sign, then apply; return the attestation (with ``sign=False``: its
        payload, for a batch signed once), the worker's fresh heartbeat secret (derived
        from the signing key; nothing stored) and the wait for durability.
        Signing first: if it fails, nothing was applied (Register events never change
        the generation, so the one signed is the one the events leave)."""
        now = self.clock()
        decision = self.state.decide_register(request, now, agent_channel)
        signed, heartbeat_secret = self.signer.sign(decision.assignment, request, self.state.generation, now, sign)
        durable = self._apply(decision.events)
        if not decision.is_new:
            self.state.touch(request.worker_id, now)
        for warning in decision.warnings:
            log.warning("topology: %s", warning)
        return signed, heartbeat_secret, durable

    async def await_world(
        self, job_id: str, generation: int, timeout_s: float, include_members: bool = False
    ) -> WorldView:
        self.state.check_await(job_id, generation)
        event = self._world_event
        if not event.is_set():
            try:
                await asyncio.wait_for(event.wait(), timeout=timeout_s)
            except asyncio.TimeoutError:
                raise RendezvousError(
                    Code.DEADLINE_EXCEEDED,
                    f"world of generation {generation} not complete after {timeout_s:g}s: "
                    + self.state.describe_missing(),
                ) from None
        self.state.check_await(job_id, generation)  # the generation ended while waiting?
        await self._apply(())  # the world it reports is durable, not only applied
        self.state.check_await(job_id, generation)
        members = ()
        if include_members:
            members = tuple(self.state.by_rank[r] for r in range(self.state.world_size))
        return WorldView(
            job_id=job_id,
            generation=self.state.generation,
            world_size=self.state.world_size,
            master=self.state.job_master,
            members=members,
        )

    def heartbeat(self, job_id: str, worker_id: str, generation: int, secret: bytes = b"") -> int:
        valid = self.keys.heartbeat_secrets(job_id, generation, worker_id, now=self.clock()) if secret else ()
        self.state.decide_heartbeat(job_id, worker_id, generation, secret, valid)
        self.state.touch(worker_id, self.clock(), generation)  # its secret proved this generation
        self._update_world_event(None)  # which may complete its world (a log of the release before)
        return self.state.generation


async def hold_for_suspects(engine: Coordinator, node_id: str, generation: int) -> None:
    """A worker failed: if a node of the job died, its peers' collectives broke and this
    failure is that loss seen from a survivor. So the decision waits until every other
    node of the job has heartbeated since (it is alive: the failure is the worker's own),
    or has been declared lost (the generation ended naming it, and this exit belongs to
    the old one): at most the heartbeat tolerance. A loss declared here is blamed on its
    node like any other (Coordinator.take_losses)."""
    state = engine.state
    arrived = engine.clock()
    deadline = arrived + engine.heartbeat_timeout_s * 1.5
    while (
        generation == state.generation
        and not state.failed
        and engine.clock() < deadline
        and state.unheard_since(arrived, but=node_id)
    ):
        await asyncio.sleep(0.05)
        await engine.sweep_lost()


def replay(state: RendezvousState, store: Store, now: float) -> None:
    """Rebuild ``state`` from the store's log. Every node gets a fresh start (a restarted
    coordinator does not declare them lost), and a lost node's stand-in clock restarts."""
    replayed = store.load()
    state.apply_all(replayed)
    for node in state.nodes.values():
        node.last_seen = now
    for node_id in state.lost_since:
        state.lost_since[node_id] = max(state.lost_since[node_id], now - 1.0)
    if replayed:
        log.info(
            "replayed %d events: generation %d, %d/%d ranks",
            len(replayed),
            state.generation,
            state.registered_now,
            state.world_size,
        )


class Signer:
    """One job's attestations, signed with the active key, and its workers' heartbeat
    secrets. The fields every attestation of a generation shares are serialized once
    (AttestationTemplate), rebuilt when the generation or the key changes."""

    def __init__(self, config: RendezvousConfig, keys: KeyRing, attestation_ttl_s: float) -> None:
        self.config = config
        self.keys = keys
        self.attestation_ttl_s = attestation_ttl_s
        self._template: Optional[AttestationTemplate] = None
        # Each worker's hardware claim, serialized (coordinator/hardware.py HardwareBook.claim,
        # set by the cluster that serves this engine); none for a bare engine.
        self.hardware: Callable[[str, int], bytes] = lambda node_id, local_rank: b""

    def template(self, generation: int) -> AttestationTemplate:
        template, key = self._template, self.keys.active
        if template is None or not template.matches(self.config.job_id, generation, self.config.plan, key):
            template = self._template = AttestationTemplate(
                job_id=self.config.job_id, generation=generation, plan=self.config.plan, key=key
            )
        return template

    def sign(self, a: Assignment, request: RegisterInput, generation: int, now: float, sign: bool = True):
        """The attestation of ``a`` (with ``sign=False``: its payload, for a batch signed
        once) and the worker's heartbeat secret (derived from the signing key; nothing stored)."""
        with metrics.sign_errors_counted():
            signed = (self.template(generation).sign if sign else self.template(generation).payload)(
                rank=a.rank,
                local_rank=a.local_rank,
                node_rank=a.node_rank,
                node_id=a.node_id,
                worker_id=a.worker_id,
                nonce=request.nonce,
                issued_at=now,
                ttl_s=self.attestation_ttl_s,
                hardware=self.hardware(a.node_id, a.local_rank),
            )
            heartbeat_secret = self.keys.heartbeat_secret(self.config.job_id, generation, a.worker_id)
        metrics.count_attestation_signed()
        return signed, heartbeat_secret

    def sign_batch(self, generation: int, payloads: list[bytes]):
        """One signature over a batch's payloads: (the signed batch, each entry)."""
        with metrics.sign_errors_counted():
            return self.template(generation).sign_batch(payloads)


async def await_durable(
    durable: Awaitable[None], on_store_failure: Optional[Callable[[BaseException], None]], what: str = "store"
) -> None:
    """Wait for an append to be durable; a store failure stops the coordinator (fail-stop)
    and the caller's RPC is answered UNAVAILABLE."""
    try:
        await durable
    except StoreError as exc:
        log.critical("%s failed; stopping: %s", what, exc)
        if on_store_failure is not None:
            on_store_failure(exc)
        raise RendezvousError(Code.UNAVAILABLE, f"state store failed: {exc}") from None


def _log_applied(events: tuple[Event, ...], state: RendezvousState, formed: bool) -> None:
    """Each applied event, as a line with its fields. Per-rank events, and the nodes a
    worker's Register names (no agent joined them), are too many to log at INFO in a 100k
    world (a line costs about 70 µs here): DEBUG; the world's forming is one INFO line."""
    for event in events:
        per_worker = isinstance(event, RankAssigned) or (isinstance(event, NodeJoined) and not event.hostname)
        level = logging.DEBUG if per_worker else logging.INFO
        if log.isEnabledFor(level):
            log.log(level, "event %s", event, extra=logs.event_fields(event))
    if formed:
        nodes = len({a.node_id for a in state.by_rank.values()})
        log.info(
            "job %s generation %d: world of %d ranks formed on %d nodes",
            state.config.job_id,
            state.generation,
            state.world_size,
            nodes,
        )


def _log_job_events(events: tuple[Event, ...]) -> None:
    """What an operator must see of a decision: a generation that ended, a job that failed."""
    for event in events:
        if isinstance(event, GenerationBumped):
            log.warning("generation %d: %s", event.generation, event.reason)
        elif isinstance(event, JobFailed):
            log.error("job failed: %s", event.reason)
        elif isinstance(event, NodeStateChanged) and event.state.gone:
            log.warning("node %s %s: %s", event.node_id, event.state.value, event.reason)


async def _done() -> None:
    return None


class _Done:
    """An awaitable that is already done (no event, nothing to wait for)."""

    def __await__(self):
        return _done().__await__()


_DONE = _Done()
