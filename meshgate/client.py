"""What a worker calls: register() for a verified attestation, await_world() for the barrier.

Settings come from arguments, else from the environment:

| argument      | environment                       |
|---------------|-----------------------------------|
| coordinator   | MESHGATE_COORDINATOR (host:port, or a comma-separated HA list) |
| job_id        | MESHGATE_JOB                      |
| trust_bundle  | MESHGATE_TRUST_BUNDLE (JSON file) |
| node_id       | MESHGATE_NODE_ID, else the node agent's answer on MESHGATE_AGENT_SOCKET, else hostname |
| local_rank    | LOCAL_RANK                        |
| rank          | MESHGATE_RANK (claimed mode)      |
| worker_id     | MESHGATE_WORKER_ID                |
| vouch         | MESHGATE_VOUCH (set by the agent), else asked of MESHGATE_AGENT_SOCKET |
| (rank 0: the master address) | MASTER_ADDR + MASTER_PORT (the agent exports node rank 0's reserved master), |
|               | else MESHGATE_ADVERTISE_ADDR (set by the agent), else the route to the coordinator, with a free port |

Transport: MESHGATE_TLS_CA (and MESHGATE_TLS_CERT / MESHGATE_TLS_KEY for mTLS,
MESHGATE_TLS_SERVER_NAME to override the name checked), or MESHGATE_INSECURE=1 for a
plaintext development coordinator; else the client config file's context. With neither, the
client refuses to connect. The coordinator and the transport are settled the one way every
meshgate client settles them (meshgate/connection.py), with failover over an HA list.
"""

from __future__ import annotations

import base64
import os
import secrets
import socket
import time
import dataclasses
from dataclasses import dataclass
from typing import Optional

import grpc

from meshgate.agent_socket import SOCKET_ENV as AGENT_SOCKET_ENV, local_agent_socket
from meshgate.attestation import TrustBundle, VerifiedAttestation, verify_attestation
from meshgate.connection import ClientConfigError, Connection, RendezvousRefused
from meshgate.endpoints import AddressError, Endpoints, host_of, is_loopback_host, tcp_init_method
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2, rendezvous_pb2_grpc


def _setting(value, env: str, name: str, default=None, required: bool = True):
    if value is not None:
        return value
    from_env = os.environ.get(env)
    if from_env:
        return from_env
    if default is not None or not required:
        return default
    raise ClientConfigError(f"{name} is not set: pass {name}= or set {env}")


def _int_setting(value, env: str, name: str) -> Optional[int]:
    raw = _setting(value, env, name, required=False)
    if raw is None:
        return None
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise ClientConfigError(f"{name} must be an integer, got {raw!r} (from {env})") from None


VOUCH_ENV = "MESHGATE_VOUCH"


def vouch_from_env(local_rank: int, rank: Optional[int] = None):
    """The agent's vouch: handed over in MESHGATE_VOUCH by an agent that launched us,
    else asked of the node agent's Unix socket (Ray and Fabric workers; a claimed-mode
    worker asks for a vouch that names its claimed ``rank``)."""
    from meshgate.v1 import attestation_pb2

    socket_path = local_agent_socket()
    encoded = os.environ.get(VOUCH_ENV)
    if encoded:
        try:
            vouch = attestation_pb2.WorkerVouch.FromString(base64.b64decode(encoded))
            claims = attestation_pb2.VouchClaims.FromString(vouch.payload)
        except (ValueError, Exception) as exc:  # noqa: BLE001 - binascii/DecodeError
            raise ClientConfigError(f"{VOUCH_ENV} is not a base64 WorkerVouch ({exc})") from None
        # A framework that picks its own rank (Fabric under an agent) needs a vouch that
        # names that rank; the launch-time vouch names none, so ask the agent for one.
        names_the_claim = rank is None or (claims.HasField("rank") and claims.rank == rank)
        if names_the_claim or not socket_path:
            return vouch
    if socket_path:
        return fetch_vouch(socket_path, local_rank, rank=rank)
    return None


def _ask_agent(socket_path: str, asked: dict, timeout: float) -> dict:
    """One JSON line to the node agent's Unix socket, one JSON line back."""
    import json

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(socket_path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise RendezvousRefused(
                grpc.StatusCode.UNAVAILABLE,
                f"no node agent answers on {socket_path} ({exc.strerror}): check that the agent runs, or set "
                f"{AGENT_SOCKET_ENV} to this node's agent's [agent] vouch_socket (unset: the one of "
                "/etc/meshgate/agent.toml, else /var/lib/meshgate-agent/vouch.sock)",
            ) from None
        except PermissionError:
            raise RendezvousRefused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"uid {os.getuid()} may not open the node agent's socket {socket_path} ({AGENT_SOCKET_ENV}): "
                "the agent makes it mode 0666 and checks each caller's uid itself: is this the socket of "
                "a meshgate agent?",
            ) from None
        sock.sendall(json.dumps(asked).encode() + b"\n")
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    answer = json.loads(reply or b"{}")
    return answer if isinstance(answer, dict) else {}


def agent_node_id(
    socket_path: Optional[str] = None, timeout: float = 10.0, job_id: Optional[str] = None, wait_s: float = 0.0
) -> Optional[str]:
    """The meshgate node id of the local agent (the one it vouches under), asked of its
    socket (``socket_path``, else MESHGATE_AGENT_SOCKET); None when no socket is set.
    Workers a framework placed register under it, not under the framework's node id.
    ``job_id``: the agent must serve that job (its vouches name it); a jobs-mode agent
    learns of its node's new job within a heartbeat, so ask again for up to ``wait_s``."""
    socket_path = socket_path or local_agent_socket()
    if not socket_path:
        return None
    give_up = time.monotonic() + wait_s
    while True:
        answer = _ask_agent(socket_path, {"whoami": True}, timeout)
        serving = answer.get("job_id")
        if job_id is None or serving == job_id or "node_id" not in answer:
            break
        if time.monotonic() >= give_up:
            raise RendezvousRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node agent at {socket_path} (node {str(answer.get('node_id'))[:64]!r}) serves job "
                f"{str(serving)[:64]!r}, not {job_id[:64]!r}: is this node in the job?",
            )
        time.sleep(0.2)
    node_id = answer.get("node_id")
    if not isinstance(node_id, str) or not node_id:
        raise RendezvousRefused(
            grpc.StatusCode.PERMISSION_DENIED,
            f"node agent at {socket_path} did not say which node it is: {str(answer.get('error', 'no answer'))[:200]}",
        )
    return node_id


def agent_interface(socket_path: Optional[str] = None, timeout: float = 10.0) -> Optional[str]:
    """The network interface the local agent advertises (its "whoami" answer: the interface
    that carries the address its workers advertise, agent/netif.py), for workers the agent
    does not start, which set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME from it. None when no
    agent socket is set or found (no agent on this node) or the agent names none; an agent
    that is there but does not answer, or refuses this uid, raises RendezvousRefused."""
    socket_path = socket_path or local_agent_socket()
    if not socket_path:
        return None
    answer = _ask_agent(socket_path, {"whoami": True}, timeout)
    if "node_id" not in answer:
        raise RendezvousRefused(
            grpc.StatusCode.PERMISSION_DENIED,
            f"node agent at {socket_path} did not say which interface it advertises: "
            f"{str(answer.get('error', 'no answer'))[:200]}",
        )
    interface = answer.get("interface")
    return interface if isinstance(interface, str) and interface else None


def fetch_vouch(socket_path: str, local_rank: int, timeout: float = 10.0, rank: Optional[int] = None):
    """Ask the node agent for a vouch over its Unix socket (it checks who we are)."""
    from meshgate.v1 import attestation_pb2

    asked = {"local_rank": local_rank} if rank is None else {"local_rank": local_rank, "rank": rank}
    answer = _ask_agent(socket_path, asked, timeout)
    if "vouch" not in answer:
        raise RendezvousRefused(
            grpc.StatusCode.PERMISSION_DENIED,
            f"the node agent at {socket_path} refused a vouch: {str(answer.get('error', 'no answer'))[:400]}",
        )
    return attestation_pb2.WorkerVouch.FromString(base64.b64decode(answer["vouch"]))


def _connection(coordinator: Optional[str]) -> Connection:
    """The worker's way to the coordinator: ``coordinator`` (else MESHGATE_COORDINATOR, else the
    client config), with the transport of MESHGATE_TLS_* / MESHGATE_INSECURE (else the config)."""
    return Connection.resolve({"coordinator": coordinator})


def _call(connection: Connection, method: str, request, timeout: float):
    """One Rendezvous call, failing over across an HA list (only idempotent calls come here)."""
    return connection.call(rendezvous_pb2_grpc.RendezvousStub, method, request, timeout=timeout)


ADVERTISE_ENV = "MESHGATE_ADVERTISE_ADDR"


def advertise_host(coordinator: str) -> str:
    """The local address peers reach this worker at (rank 0's is the world's master).

    In order: MESHGATE_ADVERTISE_ADDR (the node agent sets it from the route it chose once;
    MESHGATE_ADVERTISE_HOST is the older name), loopback for a loopback coordinator, else the
    source address of the route to the coordinator (no packet is sent). A loopback address
    for a coordinator reached over the network is refused: no other host could reach it.
    """
    unix = coordinator.startswith("unix:")
    try:
        host = "" if unix else host_of(coordinator, "coordinator")
    except AddressError as exc:
        raise ClientConfigError(str(exc)) from None
    explicit = os.environ.get(ADVERTISE_ENV) or os.environ.get("MESHGATE_ADVERTISE_HOST")
    if explicit:
        if is_loopback_host(explicit) and not unix and not is_loopback_host(host):
            raise ClientConfigError(
                f"{ADVERTISE_ENV}={explicit} is a loopback address, but the coordinator {coordinator} "
                f"is remote: workers on other hosts could not reach it. Set the address of the "
                f"interface that reaches them (the node agent chooses it when it launches workers)"
            )
        return explicit
    if unix:
        # A node agent's socket, dialled by a worker the agent did not launch (it would have
        # set ADVERTISE_ENV): the host name's address is the best guess left.
        return socket.gethostbyname(socket.gethostname())
    if is_loopback_host(host):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def load_trust_bundle(trust_bundle) -> TrustBundle:
    if isinstance(trust_bundle, TrustBundle):
        return trust_bundle
    path = _setting(trust_bundle, "MESHGATE_TRUST_BUNDLE", "trust_bundle")
    return TrustBundle.load(path)


def master_endpoint(coordinator: str) -> tuple[str, int]:
    """The endpoint this worker offers as the world's master (used if it is rank 0).
    MASTER_ADDR/MASTER_PORT when both are set (the agent exports node rank 0's reserved
    master to every worker, so the coordinator's World names the master the frameworks
    use); else the advertised address and a free port on it."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ClientConfigError(f"MASTER_PORT={port[:16]!r} is not a TCP port (1..65535)")
        return addr, int(port)
    host = advertise_host(Endpoints(coordinator).current)
    return host, free_port(host)


# What a launcher tells its workers (torchrun, ft_launcher, dlrover-run, Ray, the agent),
# and the attestation's field each must equal.
LAUNCHER_ENV = (
    ("RANK", "rank"),
    ("LOCAL_RANK", "local_rank"),
    ("WORLD_SIZE", "world_size"),
    ("GROUP_RANK", "node_rank"),
)


class LauncherRankMismatch(RuntimeError):
    """The launcher placed this worker elsewhere than its signed attestation says: the worker
    must stop before its first collective."""


def check_launcher_env(attestation: VerifiedAttestation, environ) -> None:
    """Every variable of LAUNCHER_ENV that the launcher set equals the attestation's field;
    else LauncherRankMismatch naming the variable, both values and the attestation."""
    for name, field in LAUNCHER_ENV:
        value = environ.get(name)
        if value is None:
            continue
        attested = getattr(attestation, field)
        if not value.isdigit() or int(value) != attested:
            raise LauncherRankMismatch(
                f"{name}={value[:32]!r} from this worker's launcher differs from its signed {field} {attested} "
                f"({attestation.describe()}): the worker stops before its first collective"
            )


def register(
    *,
    coordinator: Optional[str] = None,
    job_id: Optional[str] = None,
    trust_bundle=None,
    node_id: Optional[str] = None,
    local_rank: Optional[int] = None,
    rank: Optional[int] = None,
    worker_id: Optional[str] = None,
    plan: Optional[ParallelPlan] = None,
    generation: Optional[int] = None,
    timeout: float = 30.0,
) -> VerifiedAttestation:
    """Register this worker and return its attestation, verified against the trust bundle.

    Assigned mode (``rank`` unset): meshgate picks ``node_rank * slots + local_rank``.
    Claimed mode (``rank`` set): the framework's rank is checked and attested.
    Raises RendezvousRefused with the coordinator's status, or an AttestationError; and
    LauncherRankMismatch when RANK, LOCAL_RANK, WORLD_SIZE or GROUP_RANK, as the launcher
    set them, differ from the attestation (check_launcher_env), whatever the launcher.
    """
    connection = _connection(coordinator)
    job_id = _setting(job_id, "MESHGATE_JOB", "job_id")
    bundle = load_trust_bundle(trust_bundle)
    node_id = (
        _setting(node_id, "MESHGATE_NODE_ID", "node_id", required=False) or agent_node_id() or socket.gethostname()
    )
    local_rank = _int_setting(local_rank, "LOCAL_RANK", "local_rank") or 0
    rank = _int_setting(rank, "MESHGATE_RANK", "rank")
    if worker_id is None:
        worker_id = os.environ.get("MESHGATE_WORKER_ID") or (
            f"{node_id}/local{local_rank}" if rank is None else f"{node_id}/rank{rank}"
        )
    nonce = secrets.token_bytes(32)
    request = rendezvous_pb2.RegisterRequest(job_id=job_id, worker_id=worker_id, nonce=nonce, node_id=node_id)
    if rank is None:
        request.assigned.local_rank = local_rank
    else:
        request.claimed.rank = rank
        request.claimed.local_rank = local_rank
    if plan is not None:
        request.plan_digest = plan.digest()
    if generation is not None:
        request.generation = generation
    vouch = vouch_from_env(local_rank, rank)
    if vouch is not None:
        request.vouch.CopyFrom(vouch)
    request.endpoint_host, request.endpoint_port = master_endpoint(connection.coordinator)
    reply = _call(connection, "Register", request, timeout)
    verified = verify_attestation(
        reply.attestation, bundle, job_id=job_id, nonce=nonce, generation=generation, plan=plan
    )
    verified = dataclasses.replace(verified, heartbeat_secret=reply.heartbeat_secret)
    check_launcher_env(verified, os.environ)
    _REGISTERED[job_id] = verified
    return verified


# The latest registration of this process per job: await_world shows it (its worker_id and
# heartbeat secret) to prove it is one of the job's workers, unless given another.
_REGISTERED: dict[str, VerifiedAttestation] = {}


@dataclass(frozen=True)
class World:
    job_id: str
    generation: int
    world_size: int
    master_addr: str
    master_port: int
    members: tuple[rendezvous_pb2.WorldMember, ...] = ()

    @property
    def init_method(self) -> str:
        return tcp_init_method(self.master_addr, self.master_port)


def await_world(
    *,
    coordinator: Optional[str] = None,
    job_id: Optional[str] = None,
    generation: int = 0,
    timeout: float = 300.0,
    include_members: bool = False,
    attestation: Optional[VerifiedAttestation] = None,
) -> World:
    """Block until every rank of ``generation`` is registered. On timeout, raise
    RendezvousRefused(DEADLINE_EXCEEDED) whose message lists the missing ranks by node.
    Under mTLS the coordinator answers only a worker of the job: ``attestation`` (default:
    this process's latest register() for the job) proves it with its worker_id and
    heartbeat secret."""
    connection = _connection(coordinator)
    job_id = _setting(job_id, "MESHGATE_JOB", "job_id")
    request = rendezvous_pb2.AwaitWorldRequest(
        job_id=job_id,
        generation=generation,
        timeout_ms=int(timeout * 1000),
        include_members=include_members,
    )
    attestation = attestation or _REGISTERED.get(job_id)
    if attestation is not None and attestation.generation == generation and attestation.heartbeat_secret:
        request.worker_id, request.heartbeat_secret = attestation.worker_id, attestation.heartbeat_secret
    reply = _call(connection, "AwaitWorld", request, timeout + 5.0)
    return World(
        job_id=reply.job_id,
        generation=reply.generation,
        world_size=reply.world_size,
        master_addr=reply.master_addr,
        master_port=reply.master_port,
        members=tuple(reply.members),
    )


def fetch_trust_bundle(
    coordinator: str, job_id: str = "", current: Optional[TrustBundle] = None, timeout: float = 10.0
) -> TrustBundle:
    """Fetch the coordinator's bundle. With ``current`` (the bundle you hold), the new one
    is accepted only if a key you trust endorses it: that is how rotation reaches you.
    Without it (bootstrap) the bundle is only as trustworthy as the channel: use mTLS."""
    from meshgate.attestation import accept_trust_bundle
    from meshgate.v1 import attestation_pb2

    request = rendezvous_pb2.GetTrustBundleRequest(job_id=job_id)
    signed = _call(_connection(coordinator), "GetTrustBundle", request, timeout)
    if current is not None:
        return accept_trust_bundle(signed, current)
    return TrustBundle.from_proto(attestation_pb2.TrustBundle.FromString(signed.payload))


class Heartbeat:
    """A worker's liveness, in a daemon thread: Rendezvous.Heartbeat every ``interval``.

    When the coordinator says the worker's generation is over (a node was lost and the
    membership moved on), ``on_generation_over(refusal)`` is called once and the thread
    stops: the worker should leave its process group and register again (an agent that
    launched it restarts it anyway). ``stale`` says whether that happened.
    """

    def __init__(
        self,
        attestation: VerifiedAttestation,
        *,
        coordinator: Optional[str] = None,
        interval: float = 5.0,
        on_generation_over=None,
    ) -> None:
        import threading

        self.attestation = attestation
        # One, so it stays with the leader it found, over one channel: a handshake per worker,
        # not per beat. Closed when the thread ends.
        self.connection = _connection(coordinator)
        self.coordinator = self.connection.coordinator
        self.interval = interval
        self.on_generation_over = on_generation_over
        self.stale = False
        self.beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshgate-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval + 5)

    def _run(self) -> None:
        try:
            self._beat()
        finally:
            self.connection.close()

    def _beat(self) -> None:
        import logging

        log = logging.getLogger("meshgate.client")
        request = rendezvous_pb2.HeartbeatRequest(
            job_id=self.attestation.job_id,
            worker_id=self.attestation.worker_id,
            generation=self.attestation.generation,
            heartbeat_secret=self.attestation.heartbeat_secret,
        )
        while not self._stop.wait(self.interval if self.beats else 0):
            try:
                _call(self.connection, "Heartbeat", request, self.interval)
                self.beats += 1
            except RendezvousRefused as refusal:
                if refusal.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                    self.stale = True
                    log.warning("generation %d is over: %s", self.attestation.generation, refusal.details)
                    if self.on_generation_over is not None:
                        self.on_generation_over(refusal)
                    return
                log.warning("heartbeat failed: %s", refusal)
                self.beats += 1


def heartbeat(attestation: VerifiedAttestation, **kwargs) -> Heartbeat:
    """Start a worker heartbeat (see Heartbeat); ``.stop()`` it on the way out."""
    return Heartbeat(attestation, **kwargs).start()
