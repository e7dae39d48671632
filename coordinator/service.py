"""grpc.aio servicers: thin adapters from RPCs to the cluster (coordinator/cluster.py) and
the engine (engine.Coordinator) of the job a call names."""

from __future__ import annotations

import functools
import hmac
import logging
import time
from typing import Awaitable, Callable, Optional, TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from meshgate.coordinator import readmodel
from meshgate.coordinator.cluster import ClusterCoordinator, cluster_of_engine, new_job_id
from meshgate.coordinator.config import LaunchConfig, declared_spec
from meshgate.coordinator.engine import Coordinator
from meshgate.coordinator.hardware import check_hardware, hardware_clash, live_in, shared_with
from meshgate.coordinator.jobs import OPERATOR, Caller, JobSpec
from meshgate.coordinator.jobspec import LaunchMode
from meshgate.coordinator.log_relay import check_exit_tail, log_targets
from meshgate.coordinator.progress import check_samples
from meshgate.coordinator.rendezvous import Code, RegisterInput, RendezvousError, check_id, shown
from meshgate.coordinator.reachability import check_endpoint_reachable
from meshgate.coordinator.resources import exhausted
from meshgate import logs, metrics, wire
from meshgate.attestation import secret_hash
from meshgate.endpoints import LEADER_METADATA_KEY
from meshgate.v1 import nodes_pb2, nodes_pb2_grpc, rendezvous_pb2, rendezvous_pb2_grpc

log = logging.getLogger("meshgate.coordinator")

T = TypeVar("T")
DEFAULT_AWAIT_S = 300.0
DEFAULT_TOKEN_TTL_S = 600
_SECURITY_CODES = (Code.UNAUTHENTICATED, Code.PERMISSION_DENIED)  # refusals logged at WARNING


class CoordinatorSlot:
    """Where the servicers find the cluster they serve (a single-job config's too: its job
    is declared in it). Empty while this process is an HA standby: every call is then
    answered UNAVAILABLE, naming the leader's address (also in the ``meshgate-leader``
    trailing metadata), and clients fail over."""

    def __init__(self, coordinator: ClusterCoordinator | None = None) -> None:
        self.coordinator = coordinator
        self.leader_hint = ""
        # Why the store cannot take writes, while health says so (health.HealthMonitor sets
        # it with coordinator.store); "" when it can. Calls that would write are refused then.
        self.unwritable = ""


class StoreCannotWrite(RendezvousError):
    """A call that would write, while the store cannot take writes: UNAVAILABLE, naming why.
    Nothing of it is recorded or decided; the same call succeeds once health is SERVING."""

    def __init__(self, reason: str) -> None:
        super().__init__(
            Code.UNAVAILABLE,
            f"the coordinator records nothing now (health NOT_SERVING, coordinator.store): {reason}; "
            f"retry once it serves again",
        )

    def __reduce__(self):
        return (RendezvousError, (self.code, self.message))


class _SlotServicer:
    slot: CoordinatorSlot

    @property
    def cluster(self) -> ClusterCoordinator:
        return self.slot.coordinator  # never None here: grpc_errors answers a standby's calls

    def engine(self, job_id: str, running: bool = False) -> Coordinator:
        """The engine of ``job_id``; ``running``: refuse a job that has ended."""
        return self.cluster.engine(job_id, running)


Served = ClusterCoordinator | CoordinatorSlot | Coordinator


def slot_of(served: Served, launch: LaunchConfig = LaunchConfig()) -> CoordinatorSlot:
    """A slot for what a server serves: a cluster, or an engine opened by hand (tests,
    benchmarks), served as the one declared job of a cluster of its own."""
    if isinstance(served, CoordinatorSlot):
        return served
    if isinstance(served, Coordinator):
        served = cluster_of_engine(served, declared_spec(served.config, launch))
    return CoordinatorSlot(served)


def grpc_errors(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Turn a RendezvousError into its gRPC status; never let input crash the server."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext) -> T:
        started = time.perf_counter()
        if self.slot.coordinator is None:
            hint = self.slot.leader_hint
            context.set_trailing_metadata(((LEADER_METADATA_KEY, hint),))
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"this coordinator is a standby; the leader is at {hint or 'an unknown address'}",
            )
        try:
            check_versions(request, context, method.__name__)
            reply = await method(self, request, context)
            metrics.observe_rpc(method.__name__, "OK", time.perf_counter() - started)
            return reply
        except RendezvousError as exc:
            metrics.observe_rpc(method.__name__, exc.code.value, time.perf_counter() - started)
            log.log(
                logging.WARNING if exc.code in _SECURITY_CODES else logging.DEBUG,
                "%s refused: %s",
                method.__name__,
                exc,
                extra=logs.event_fields(name="refused", method=method.__name__, code=exc.code.value),
            )
            await context.abort(getattr(grpc.StatusCode, exc.code.value), exc.message)
        except OSError as exc:  # out of descriptors or memory mid-call (e.g. RotateKey's files): say so
            if not exhausted(exc):
                raise
            metrics.observe_rpc(method.__name__, "RESOURCE_EXHAUSTED", time.perf_counter() - started)
            log.error("%s: %s", method.__name__, exc)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the coordinator is out of resources: {exc}")

    return wrapper


class VersionSkew(RendezvousError):
    """A peer outside the skew policy (meshgate/wire.py), or a newer peer's field or enum
    value this coordinator does not know: FAILED_PRECONDITION naming both versions."""

    def __init__(self, message: str) -> None:
        super().__init__(Code.FAILED_PRECONDITION, message)

    def __reduce__(self):
        return (RendezvousError, (self.code, self.message))


def check_versions(request, context: grpc.aio.ServicerContext, method: str) -> None:
    """Every call: the caller's versions against the skew policy, then (from a newer caller)
    nothing in its request this coordinator would drop."""
    peer = wire.peer_version(context.invocation_metadata())
    role = "agent" if method in _NODE_METHODS else "client"
    why = wire.skew_refusal(peer, role=role) or wire.unknown_in(request, peer)
    if why is not None:
        raise VersionSkew(why)


def refuse_hardware_clash(cluster: ClusterCoordinator, request) -> None:
    """Before a Join changes anything: its hardware is well formed, and no GPU of it, nor
    its machine-id, is presented by another live node (coordinator/hardware.py)."""
    if request.HasField("hardware"):
        check_hardware(request.hardware, "JoinRequest.hardware")
        live = live_in(cluster.state, cluster.clock())
        clash = hardware_clash(cluster.hardware, live, request.node_id, request.hardware)
        if clash:
            raise RendezvousError(Code.FAILED_PRECONDITION, clash)


def note_node_hardware(cluster: ClusterCoordinator, request) -> bool:
    """After an authenticated Join or heartbeat whose hardware was checked before anything
    else: the node's hardware, when it sent it (a machine-id or GPU another live node
    presents is logged). Returns whether the coordinator still lacks it (the heartbeat
    answer asks for it)."""
    if request.HasField("hardware"):
        news = cluster.hardware.of.get(request.node_id) != request.hardware  # each Join sends it again
        cluster.hardware.note(request.node_id, request.hardware)
        node = cluster.state.nodes.get(request.node_id)
        if node is not None:  # the innermost locality of placement (cluster_state/backfill.py)
            node.nvlink_domain = request.hardware.nvlink_domain
        shared = shared_with(cluster.hardware, live_in(cluster.state, cluster.clock()), request.node_id)
        if shared and news:
            log.warning("node %s: %s (a cloned image, or a second agent on one host?)", request.node_id, shared)
    return request.node_id not in cluster.hardware.of


def note_node_version(cluster: ClusterCoordinator, request, context) -> None:
    """After an authenticated Join or heartbeat: the versions its agent runs (meshgate nodes)."""
    version = wire.agent_version(context.invocation_metadata(), request.agent_instance)
    cluster.node_versions[request.node_id] = version


_NODE_METHODS = frozenset(nodes_pb2.DESCRIPTOR.services_by_name["Nodes"].methods_by_name)


def writes(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """A call that records something (a submit, a cancel, a join, a Register ...): refused
    StoreCannotWrite while the store cannot take writes, before anything is decided, so no
    answer runs ahead of the state. Reads and heartbeats (which write nothing) still answer.
    Under grpc_errors, which turns the refusal into its status."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext) -> T:
        if self.slot.unwritable:
            raise StoreCannotWrite(self.slot.unwritable)
        return await method(self, request, context)

    return wrapper


def answer_within(context: grpc.aio.ServicerContext, wait_s: float) -> float:
    """How long a call may wait for something: ``wait_s``, and answer just before the
    caller's own deadline fires, so that it reads what was waited for, not a bare timeout."""
    remaining = context.time_remaining()
    return wait_s if remaining is None else min(wait_s, max(remaining - 0.2, 0.0))


def register_input(request: rendezvous_pb2.RegisterRequest, peer: str = "") -> RegisterInput:
    check_endpoint_reachable(request.endpoint_host, peer)  # a loopback master for a remote world
    mode = request.WhichOneof("mode")
    if mode is None:
        raise RendezvousError(
            Code.INVALID_ARGUMENT,
            "mode must be set: RegisterRequest.assigned (local_rank; meshgate picks the rank) or "
            "RegisterRequest.claimed (rank and local_rank; the framework picked it)",
        )
    claimed = request.claimed if mode == "claimed" else None
    return RegisterInput(
        job_id=request.job_id,
        worker_id=request.worker_id,
        nonce=request.nonce,
        node_id=request.node_id,
        local_rank=claimed.local_rank if claimed else request.assigned.local_rank,
        claimed_rank=claimed.rank if claimed else None,
        plan_digest=request.plan_digest,
        generation=request.generation if request.HasField("generation") else None,
        endpoint_host=request.endpoint_host,
        endpoint_port=request.endpoint_port,
        vouch=request.vouch if request.HasField("vouch") else None,
    )


def join_args(request: nodes_pb2.JoinRequest, peer: str = "") -> tuple:
    """Coordinator.join's arguments; the master offer is checked like a Register's endpoint."""
    offer = None
    if request.master_addr or request.master_port:
        check_endpoint_reachable(request.master_addr, peer, "master_addr")
        offer = (request.master_addr, request.master_port)
    return (
        request.job_id,
        request.node_id,
        request.hostname,
        request.slots,
        request.slot_kind,
        request.join_token,
        request.node_credential,
        request.node_public_key,
        offer,
    )


class AccessPolicy:
    """Who may call what. Under TLS an mTLS client certificate's role (OU) decides:
    admin for Admin, agent for Nodes. The admin bearer token (``authorization:
    Bearer ...`` metadata) also admits Admin calls. Plaintext dev setups
    (``insecure = true``) check nothing but the node credential."""

    def __init__(self, secure: bool = False, admin_token_hash: str = "") -> None:
        self.secure = secure
        self.admin_token_hash = admin_token_hash

    def _identity(self, context):
        from meshgate.tls import peer_identity

        return peer_identity(context)

    def require_admin(self, context, roles: tuple[str, ...] = ("admin",)) -> Caller:
        """An admin credential (or, for the job calls, one of ``roles``); returns who it
        is, as a job records its owner."""
        if not self.secure and not self.admin_token_hash:
            return OPERATOR
        for key, value in context.invocation_metadata() or ():
            if key == "authorization" and self.admin_token_hash and value.startswith("Bearer "):
                if hmac.compare_digest(secret_hash(value[len("Bearer ") :]), self.admin_token_hash):
                    return Caller("admin-token", admin=True)
                raise RendezvousError(Code.UNAUTHENTICATED, "authorization: the admin token is not valid")
        identity = self._identity(context) if self.secure else None
        if identity is None:
            raise RendezvousError(
                Code.UNAUTHENTICATED,
                "Admin calls need an admin credential (mTLS OU=admin or the admin token): pass --cert-file and "
                "--key-file of an admin certificate (meshgate certs issue DIR --role admin), or --admin-token-file "
                "($MESHGATE_ADMIN_TOKEN_FILE)",
            )
        if identity.role not in roles:
            raise RendezvousError(
                Code.PERMISSION_DENIED,
                f"this call needs role {' or '.join(roles)}; the client certificate {identity.name!r} "
                f"has role {identity.role!r}: use one issued with meshgate certs issue DIR --role {roles[-1]}",
            )
        return Caller(f"{identity.role}:{identity.name}", admin=identity.role == "admin")

    def require_submitter(self, context) -> Caller:
        """Jobs: a job's command runs on every node it gets, so only admins and the
        dedicated submitter role (its own certificate OU) may submit, see or cancel one;
        which jobs they may manage is the job's owner's business (jobs.Caller)."""
        return self.require_admin(context, roles=("admin", "submitter"))

    def require_world_reader(self, context, job_id: str, proof: Callable[[], bool], serves: Callable) -> None:
        """AwaitWorld under mTLS answers a worker of the job (``proof``: its worker_id and
        heartbeat secret), an agent whose certificate names a node serving the job
        (``serves(node_ids)``; its fan-in asks for its workers) or an admin; no one
        else, and alike whether or not the job exists."""
        if not self.secure:
            return
        identity = self._identity(context)
        if identity is None:
            raise RendezvousError(Code.UNAUTHENTICATED, "AwaitWorld needs a client certificate")
        if identity.role == "admin" or proof():
            return
        if identity.role == "agent" and serves((identity.name, *identity.uri_nodes)):
            return
        raise RendezvousError(
            Code.PERMISSION_DENIED,
            f"AwaitWorld of job {shown(job_id)} answers only that job's workers (worker_id and "
            f"heartbeat_secret from their Register) and the agents of its nodes; the client certificate "
            f"{shown(identity.name or '')} (role {identity.role!r}) is neither",
        )

    def require_agent(self, context, node_id: str) -> None:
        """Under mTLS: an agent certificate that names ``node_id`` (its CN, or a SAN URI
        spiffe://<trust-domain>/node/<node_id>); no agent acts as another node."""
        if not self.secure:
            return
        identity = self._identity(context)
        if identity is None:
            raise RendezvousError(
                Code.UNAUTHENTICATED,
                "Nodes calls need an agent client certificate: [agent] cert_file and key_file "
                "(meshgate certs issue DIR --role agent --node-id NODE)",
            )
        if identity.role != "agent":
            raise RendezvousError(
                Code.PERMISSION_DENIED,
                f"Nodes calls need role agent; the client certificate {identity.name!r} has role {identity.role!r}",
            )
        if not identity.names_node(node_id):
            raise RendezvousError(
                Code.PERMISSION_DENIED,
                f"the agent certificate {identity.name!r} does not name node_id {shown(node_id)} "
                f"(CN or SAN URI spiffe://<trust-domain>/node/<node_id>): give the agent one issued for its "
                f"node (meshgate certs issue DIR --role agent --node-id {shown(node_id)[1:-1]})",
            )


class RendezvousServicer(_SlotServicer, rendezvous_pb2_grpc.RendezvousServicer):
    def __init__(self, coordinator: Served, max_await_s: float, policy: AccessPolicy | None = None) -> None:
        self.slot = slot_of(coordinator)
        self.max_await_s = max_await_s
        self.policy = policy or AccessPolicy()

    def check_world_reader(self, request, context) -> None:
        """Who may read ``request.job_id``'s world (AccessPolicy.require_world_reader)."""
        cluster = self.cluster
        check_id("job_id", request.job_id)  # a malformed id is INVALID_ARGUMENT for anyone

        def proof() -> bool:
            return bool(request.worker_id and request.heartbeat_secret) and any(
                hmac.compare_digest(request.heartbeat_secret, valid)
                for valid in cluster.keys.heartbeat_secrets(
                    request.job_id, request.generation, request.worker_id, now=cluster.clock()
                )
            )

        def serves(node_ids) -> bool:
            return cluster.pool.serves_any(node_ids, request.job_id)

        self.policy.require_world_reader(context, request.job_id, proof, serves)

    @grpc_errors
    @writes
    async def Register(self, request, context):
        signed, secret = await self.engine(request.job_id, running=True).register(
            register_input(request, context.peer())
        )
        return rendezvous_pb2.RegisterResponse(attestation=signed, heartbeat_secret=secret)

    @grpc_errors
    async def AwaitWorld(self, request, context):
        timeout_s = request.timeout_ms / 1000 if request.timeout_ms else DEFAULT_AWAIT_S
        timeout_s = answer_within(context, timeout_s)  # with the missing ranks, before the caller's deadline
        self.check_world_reader(request, context)
        engine = self.engine(request.job_id)
        world = await engine.await_world(
            request.job_id,
            request.generation,
            min(timeout_s, self.max_await_s),
            include_members=request.include_members,
        )
        reply = rendezvous_pb2.World(
            job_id=world.job_id,
            generation=world.generation,
            world_size=world.world_size,
            plan_digest=engine.config.plan.digest(),
        )
        if world.master:
            reply.master_addr, reply.master_port = world.master
        for m in world.members:
            reply.members.add(rank=m.rank, node_id=m.node_id, node_rank=m.node_rank, worker_id=m.worker_id)
        return reply

    @grpc_errors
    async def Heartbeat(self, request, context):
        generation = self.engine(request.job_id).heartbeat(
            request.job_id, request.worker_id, request.generation, request.heartbeat_secret
        )
        reply = rendezvous_pb2.HeartbeatResponse(generation=generation)
        reply.server_time.GetCurrentTime()
        return reply

    @grpc_errors
    async def GetTrustBundle(self, request, context):
        return self.cluster.keys.signed_bundle()


class NodesServicer(_SlotServicer, nodes_pb2_grpc.NodesServicer):
    """Agents' calls. A call with no job_id is the node's own, to the cluster (join once,
    heartbeat while idle); a call naming a job goes to that job's engine, and only from a
    node the job was given (or, for a declared job, that joined it)."""

    def __init__(
        self,
        coordinator: Served,
        heartbeat_interval_s: float,
        policy: AccessPolicy | None = None,
    ) -> None:
        self.slot = slot_of(coordinator)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.policy = policy or AccessPolicy()

    def job_engine(self, request, running: bool = False, joining: bool = False) -> Optional[Coordinator]:
        """The engine of the job a node's call names, once the node's credential and its
        part in the job are checked (node_pool.NodePool.job_engine). None: the job
        ended and its engine is closed (answered from its summary)."""
        pool = self.cluster.pool
        return pool.job_engine(request.node_id, request.node_credential, request.job_id, running, joining)

    def node_engine(self, request, joining: bool = False) -> tuple[Coordinator, LaunchConfig]:
        """The engine of a node's running job, and what the node launches for it."""
        engine = self.job_engine(request, running=True, joining=joining)
        assert engine is not None  # running=True: an ended job was refused
        return engine, launch_of(self.cluster.job(request.job_id).spec)

    @grpc_errors
    @writes
    async def Join(self, request, context):
        self.policy.require_agent(context, request.node_id)
        cluster = self.cluster
        refuse_hardware_clash(cluster, request)
        if not request.job_id:
            node, credential = await cluster.pool.join(
                request.node_id,
                request.hostname,
                request.slots,
                request.slot_kind,
                dict(request.labels),
                request.join_token,
                request.node_credential,
                request.node_public_key,
                request.health if request.HasField("health") else None,
                request.agent_instance,
            )
            note_node_version(cluster, request, context)
            note_node_hardware(cluster, request)
            return nodes_pb2.JoinResponse(
                node_rank=-1,
                spare=False,
                node_credential=credential,
                trust_bundle=cluster.keys.bundle.to_proto(),
                signed_trust_bundle=cluster.keys.signed_bundle(),
                heartbeat_interval_ms=int(self.heartbeat_interval_s * 1000),
            )
        engine, launch = self.node_engine(request, joining=True)
        # Node rank 0's offer is the job's master: agents export it to the workers they
        # launch, and with no command torchrun's handler hosts its store there.
        node, credential = await cluster.pool.join_job(
            engine,
            *join_args(request, context.peer()),
            request.agent_instance,
            dict(request.labels),
        )
        note_node_version(cluster, request, context)
        note_node_hardware(cluster, request)
        return self.join_response(engine, launch, node, credential)

    def join_response(
        self, engine: Coordinator, launch: LaunchConfig, node, credential: bytes
    ) -> nodes_pb2.JoinResponse:
        config = engine.config
        reply = nodes_pb2.JoinResponse(
            node_rank=node.node_rank,
            generation=engine.state.generation,
            trust_bundle=engine.keys.bundle.to_proto(),
            signed_trust_bundle=engine.keys.signed_bundle(),
            heartbeat_interval_ms=int(self.heartbeat_interval_s * 1000),
            spare=node.node_rank < 0,
            node_credential=credential,
        )
        if node.node_rank < 0:
            return reply  # a spare gets its assignment when it takes over a block
        reply.assignment.CopyFrom(
            nodes_pb2.LaunchAssignment(
                command=list(launch.command),
                nprocs=config.slots_per_node,
                first_rank=node.node_rank * config.slots_per_node,
                world_size=config.plan.world_size,
                env=dict(launch.env),
                restart_policy=launch.restart_policy,
                max_restarts=launch.max_restarts,
                plan=config.plan.to_proto(),
                per_node=launch.per_node,
            )
        )
        master = engine.state.job_master
        if master is not None:
            reply.assignment.master_addr, reply.assignment.master_port = master
        return reply

    @grpc_errors
    async def NodeHeartbeat(self, request, context):
        self.policy.require_agent(context, request.node_id)
        if request.HasField("hardware"):  # refused before the heartbeat counts: left as found
            check_hardware(request.hardware, "NodeHeartbeatRequest.hardware")
        reply = await self.heartbeat_reply(request)  # the node's credential is checked in there
        note_node_version(self.cluster, request, context)
        reply.send_hardware = note_node_hardware(self.cluster, request)
        reply.log_requests.extend(self.cluster.log_relay.take(request.node_id))
        return reply

    async def heartbeat_reply(self, request) -> nodes_pb2.NodeHeartbeatResponse:
        cluster = self.cluster
        if not request.job_id:
            health = request.health if request.HasField("health") else None
            node = await cluster.pool.checked_heartbeat(
                request.node_id, request.node_credential, request.live_units, health, request.agent_instance
            )
            reply = nodes_pb2.NodeHeartbeatResponse(
                pool_state=readmodel.pool_state_message(cluster.state.pool_state(node, cluster.clock())),
                node_rank=-1,
                run_health_check=node.uncordon_asked is not None,
            )
            if node.job_id:
                reply.job_id = node.job_id
                reply.job_state = rendezvous_pb2.JobState.Value(cluster.state.job(node.job_id).state.value)
            return reply
        engine = self.job_engine(request)  # a node keeps heartbeating the job it ran until it learns the end
        cluster.pool.note_units(request.node_id, request.live_units)  # only now: its credential and job were checked
        if engine is None:  # ended and closed: answered from its summary
            return readmodel.ended_heartbeat(cluster, cluster.job(request.job_id), request.node_id)
        refused = check_samples(request.progress, engine.config.slots_per_node)  # before anything is noted
        if refused:
            raise RendezvousError(Code.INVALID_ARGUMENT, refused)
        node = engine.node_heartbeat(request.job_id, request.node_id, request.node_credential, request.agent_instance)
        state = engine.state
        cluster.progress.note(request.job_id, request.node_id, request.generation, request.progress, cluster.clock())
        return nodes_pb2.NodeHeartbeatResponse(
            generation=state.generation,
            node_state=readmodel.node_state_message(node.state),
            node_rank=node.node_rank,
            job_failure=state.failed,
            job_id=request.job_id,
            job_state=rendezvous_pb2.JobState.Value(cluster.state.job(request.job_id).state.value),
        )

    @grpc_errors
    @writes
    async def ReportExit(self, request, context):
        self.policy.require_agent(context, request.node_id)
        check_exit_tail(request.log_tail)  # before anything is recorded of the exit
        engine = self.job_engine(request)  # exits are recorded until the job's engine closes
        if engine is None:  # ended and closed: nothing to record
            return readmodel.ended_exit(self.cluster, self.cluster.job(request.job_id))
        generation, failure = await self.cluster.pool.blame_exit(engine, request, request.job_id)
        await self.cluster.reconcile()  # the exit may have ended the job
        return nodes_pb2.ReportExitResponse(generation=generation, job_failure=failure)

    @grpc_errors
    @writes
    async def RegisterBatch(self, request, context):
        self.policy.require_agent(context, request.node_id)
        engine, _ = self.node_engine(request)
        inputs, reply = [], nodes_pb2.RegisterBatchResponse()
        slots: list[int | RendezvousError] = []
        peer = context.peer()  # once per batch, not per worker
        for item in request.requests:
            try:
                inputs.append(register_input(item, peer))
                slots.append(len(inputs) - 1)
            except RendezvousError as exc:
                slots.append(exc)
        answer = await engine.register_batch(
            request.job_id, request.node_id, request.node_credential, inputs, request.one_signature, self.policy.secure
        )
        reply.batch = answer.batch
        for slot in slots:
            outcome = slot if isinstance(slot, RendezvousError) else answer.results[slot]
            if isinstance(outcome, RendezvousError):
                reply.results.add().refusal.CopyFrom(
                    nodes_pb2.Refusal(code=outcome.code.value, message=outcome.message)
                )
            else:
                signed, secret = outcome
                reply.results.add(attestation=signed, heartbeat_secret=secret)
        return reply

    @grpc_errors
    @writes
    async def Leave(self, request, context):
        self.policy.require_agent(context, request.node_id)
        if not request.job_id:
            self.cluster.pool.leave(request.node_id, request.node_credential)
            return nodes_pb2.LeaveResponse()
        engine = self.job_engine(request)
        if engine is None:  # ended and closed: nothing to leave
            return nodes_pb2.LeaveResponse()
        await engine.leave(request.job_id, request.node_id, request.reason, request.node_credential)
        return nodes_pb2.LeaveResponse()

    @grpc_errors
    async def PushLogs(self, request, context):
        self.policy.require_agent(context, request.node_id)
        self.cluster.state.decide_node_call(request.node_id, request.node_credential)
        return nodes_pb2.PushLogsResponse(stop=await self.cluster.log_relay.push(request.node_id, request))


def launch_of(spec: JobSpec) -> LaunchConfig:
    per_node = spec.launch is LaunchMode.PER_NODE
    return LaunchConfig(spec.command, spec.env, spec.restart_policy.value, spec.max_restarts, per_node)


class AdminServicer(_SlotServicer, rendezvous_pb2_grpc.AdminServicer):
    def __init__(self, coordinator: Served, policy: AccessPolicy | None = None) -> None:
        self.slot = slot_of(coordinator)
        self.policy = policy or AccessPolicy()

    @grpc_errors
    @writes
    async def CreateJoinToken(self, request, context):
        self.policy.require_admin(context)
        if request.job_id:
            self.cluster.job(request.job_id)  # names a job that exists; the cluster's token admits to any
        token, expires_at = await self.cluster.pool.create_join_token(
            request.ttl_s or DEFAULT_TOKEN_TTL_S, request.node_id, request.any_node
        )
        reply = rendezvous_pb2.JoinToken(token=token, node_id=request.node_id)
        reply.expires_at.FromNanoseconds(int(expires_at * 1e9))
        return reply

    @grpc_errors
    @writes
    async def RotateKey(self, request, context):
        self.policy.require_admin(context)
        return self.cluster.rotate_key()

    @grpc_errors
    async def GetStatus(self, request, context):
        self.policy.require_admin(context)  # an ended job's comes from its summary, never its reopened log
        return readmodel.named_status(self.cluster, request.job_id)

    @grpc_errors
    @writes
    async def SubmitJob(self, request, context):
        caller, cluster = self.policy.require_submitter(context), self.cluster
        spec = JobSpec.from_proto(request.spec, request.spec.job_id or new_job_id(cluster))
        job = await cluster.submit(spec, caller, request.wait_for_nodes)
        return readmodel.job_info(cluster, job, caller=caller)

    @grpc_errors
    async def ListJobs(self, request, context):
        caller, cluster = self.policy.require_submitter(context), self.cluster
        return readmodel.job_list(cluster, request, caller)

    @grpc_errors
    async def GetJob(self, request, context):
        caller, cluster = self.policy.require_submitter(context), self.cluster
        return readmodel.job_info(cluster, cluster.job(request.job_id), caller=caller)

    @grpc_errors
    async def GetJobTimeline(self, request, context):
        caller, job = self.policy.require_submitter(context), self.cluster.job(request.job_id)
        self.cluster.state.check_may_manage(job.spec.job_id, caller, "read the timeline of")  # ranks, hosts
        return readmodel.timeline(self.cluster, job)

    @grpc_errors
    @writes
    async def FinishJob(self, request, context):
        caller, cluster = self.policy.require_submitter(context), self.cluster
        job = await cluster.finish(request.job_id, request.succeeded, request.reason[:200], caller)
        return readmodel.job_info(cluster, job, caller=caller)

    @grpc_errors
    @writes
    async def CancelJob(self, request, context):
        caller, cluster = self.policy.require_submitter(context), self.cluster
        job = await cluster.cancel(request.job_id, request.reason[:200], caller)
        await cluster.units_shown.until_gone(job.spec.job_id, answer_within(context, cluster.units_shown.wait_s))
        return readmodel.job_info(cluster, job, caller=caller)

    @grpc_errors
    async def JobLogs(self, request, context):
        caller, cluster = self.policy.require_submitter(context), self.cluster
        job = cluster.state.check_may_manage(request.job_id, caller, "read the output of")
        status = readmodel.job_status(cluster, job)
        parts, pickup_s = log_targets(job, status, request), cluster.state.heartbeat_timeout_s + 5
        await cluster.log_relay.relay(
            request, parts, context.write, pickup_s, status, caller.owner, cluster.node_versions
        )

    @grpc_errors
    async def ListNodes(self, request, context):
        self.policy.require_admin(context)  # node ids, labels and the jobs they serve: the operator's
        return readmodel.node_list(self.cluster, request)

    @grpc_errors
    @writes
    async def CordonNode(self, request, context):
        caller, cluster = self.policy.require_admin(context), self.cluster
        act = cluster.job_nodes.drain if request.drain else cluster.pool.cordon
        return readmodel.pool_node(cluster, await act(request.node_id, request.reason, caller))

    @grpc_errors
    @writes
    async def UncordonNode(self, request, context):
        caller, cluster = self.policy.require_admin(context), self.cluster
        return readmodel.pool_node(cluster, await cluster.pool.uncordon(request.node_id, caller))

    @grpc_errors
    async def GetCluster(self, request, context):
        self.policy.require_admin(context)
        return readmodel.cluster_status(self.cluster)


class UndecodableRequestFilter(logging.Filter):
    """grpc logs a ~1 kB traceback for every request that does not parse; anyone can
    send those, so each becomes one WARNING line naming the error instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, DecodeError):
            record.msg, record.args = "undecodable request refused: %s", (str(error)[:200],)
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_UNDECODABLE = UndecodableRequestFilter()


SERVICE_NAMES = (
    rendezvous_pb2.DESCRIPTOR.services_by_name["Rendezvous"].full_name,
    rendezvous_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
    nodes_pb2.DESCRIPTOR.services_by_name["Nodes"].full_name,
)


def build_server(
    coordinator: Served,
    *,
    max_await_s: float = 3600.0,
    max_pending_requests: int = 1_000_000,
    launch: LaunchConfig = LaunchConfig(),
    heartbeat_interval_s: float = 5.0,
    policy: AccessPolicy | None = None,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """A grpc.aio server with Rendezvous, Admin, Nodes, health and reflection; ports not
    bound. Pass a CoordinatorSlot to fill in the cluster later (HA standby). ``launch``:
    what the agents of an engine passed by hand launch (its declared job's [launch])."""
    coordinator = slot_of(coordinator, launch)
    logging.getLogger("grpc._cython.cygrpc").addFilter(_UNDECODABLE)  # once: same instance
    server = grpc.aio.server(
        options=[
            # The default of 1000 cancels registration bursts (measured); a world is bigger.
            ("grpc.server.max_pending_requests", max_pending_requests),
            ("grpc.so_reuseport", 0),
        ]
    )
    rendezvous_pb2_grpc.add_RendezvousServicer_to_server(RendezvousServicer(coordinator, max_await_s, policy), server)
    rendezvous_pb2_grpc.add_AdminServicer_to_server(AdminServicer(coordinator, policy), server)
    nodes_pb2_grpc.add_NodesServicer_to_server(NodesServicer(coordinator, heartbeat_interval_s, policy), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        SERVICE_NAMES + (health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    return server, health_servicer


async def mark_serving(health_servicer) -> None:
    for name in ("",) + SERVICE_NAMES:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


async def mark_not_serving(health_servicer) -> None:
    for name in ("",) + SERVICE_NAMES:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


__all__ = [
    "AccessPolicy",
    "AdminServicer",
    "CoordinatorSlot",
    "LEADER_METADATA_KEY",
    "NodesServicer",
    "RendezvousServicer",
    "build_server",
    "mark_not_serving",
    "mark_serving",
]
