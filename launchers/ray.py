"""RayTrainLauncher: a Ray Train TorchTrainer whose workers sit on meshgate's ranks.

meshgate picks the nodes (its allocator, or the nodes a job already holds) and Ray places the
workers there: each node's agent labels its Ray node (``meshgate.io/node-id``, switch, rack;
launchers/ray_labels.py), and the launcher gives Ray Train one label selector per worker,
worker ``i`` on the node of meshgate rank ``i``. Ray Train numbers its workers by that
bundle order grouped by node, so Ray's world rank is the rank meshgate would have assigned,
and ``topology_policy = "refuse"`` holds::

    def train_loop(config):
        rank = config["meshgate_rank"]                 # == the Ray Train world rank
        coordinate = config["meshgate_coordinate"]     # {"dp_shard": ..., "tp": ...}
        attestation = meshgate.launchers.ray.current_attestation()  # the VerifiedAttestation

    RayTrainLauncher(
        ParallelPlan(dp_shard=4), coordinator="head:7443", nodes=2,
        trust_bundle="/etc/meshgate/trust-bundle.json", train_loop_per_worker=train_loop,
        resources_per_worker={"CPU": 4, "GPU": 1}, use_gpu=True,
    ).fit()

The job: with no ``job_id`` (nor MESHGATE_JOB), ``fit()`` submits a claimed-mode job with no
command for the plan (``nodes``, ``slots_per_node``, ``topology_policy``; the submitter needs
the admin or submitter role), waits until meshgate gives it nodes, runs, and finishes it
(SUCCEEDED, or FAILED with the exception). With a ``job_id`` it attaches to that job (a
claimed-mode job: ``meshgate job submit --mode claimed``) and places the workers on its nodes
once the job holds all of them; a job whose nodes are not known yet (a single-job
coordinator before its agents joined, or one without agents) leaves the placement to Ray.
Without ``plan``, the job's plan written by the node agent is used (``meshgate.current_plan()``).

The network interface. Ray Train's torch backend initializes each worker's process group
before the user's loop runs, and gloo (NCCL likewise) picks its interface then, from the
host name unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME say otherwise: on a host whose name
resolves to 127.0.0.1 (or to no NIC) a job across nodes fails. So the launcher gives the
trainer its ``torch_config`` (default ``TorchConfig()``) with one step added to its backend's
``on_start``: every worker first asks its node's agent (``{"whoami": true}`` on
``MESHGATE_AGENT_SOCKET``, else the shipped agent's socket) for the interface it advertises
and sets both variables to it, where Ray's node environment does not set them already (an
operator's choice is kept), as the agent does for the workers it starts and torchrun's
handler for torchrun's. A worker on a node without an agent leaves them alone. The user's
config object is not changed (a copy of it, of a subclass of its class, is given).

Every worker, before the user's loop runs, asks its node's agent which meshgate node it is on
(``{"whoami": true}`` on ``MESHGATE_AGENT_SOCKET``, the agent's ``[agent] vouch_socket``) and
registers under that node id (never Ray's node id), claiming its Ray Train world rank with the
agent's vouch; it checks that it runs on its rank's node, verifies the signed attestation
against the trust bundle and the plan, cross-checks it against Ray's context (rank, world size,
local rank), waits until the whole world is attested (AwaitWorld), and hands it to the loop.

Keys injected into the loop's config (a user config that uses any ``meshgate_`` key is
refused):

* ``meshgate_attestation``: the SignedAttestation, serialized (bytes);
* ``meshgate_rank``, ``meshgate_world_size``, ``meshgate_local_rank``,
  ``meshgate_node_rank``, ``meshgate_generation`` (ints);
* ``meshgate_coordinate`` (axis -> index) and ``meshgate_plan`` (``ParallelPlan.to_dict()``).

``num_workers`` is always ``plan.world_size``. Every argument is checked (the loop is
callable and takes 0 or 1 argument, the config, ``resources_per_worker`` is str -> a
non-negative number, GPUs agree with ``use_gpu``) before Ray is imported; Ray is only
imported to build the trainer, and without it that raises an ImportError naming the
extra (``meshgate's [ray] extra``, with the packages it brings).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import os
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional

from meshgate.extras import install_hint
from meshgate.launchers.checks import (
    LauncherArgumentError,
    LauncherTypeError,
    ReservedConfigKeyError,
    bounded_repr,
    check_resources,
    check_type,
)
from meshgate.launchers.claimed import ClaimedSettings, ClaimedTopologyError, attest_claimed, claimed_settings, env_or
from meshgate.launchers.ray_labels import NODE_ID_LABEL, node_label_value
from meshgate.plan import ParallelPlan, current_plan

if TYPE_CHECKING:  # pragma: no cover
    from meshgate.attestation import VerifiedAttestation

RAY_EXTRA = install_hint("ray")
RESERVED_PREFIX = "meshgate_"
INJECTED_KEYS: tuple[str, ...] = (
    "meshgate_attestation",
    "meshgate_rank",
    "meshgate_world_size",
    "meshgate_local_rank",
    "meshgate_node_rank",
    "meshgate_generation",
    "meshgate_coordinate",
    "meshgate_plan",
)
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
TOPOLOGY_POLICIES = ("allow", "warn", "refuse")

__all__ = [
    "INJECTED_KEYS",
    "Placement",
    "RAY_EXTRA",
    "RayLauncherArgumentError",
    "RayPlacementError",
    "RayLauncherTypeError",
    "RayTopologyError",
    "RayTrainLauncher",
    "WorkerSettings",
    "attest_worker",
    "current_attestation",
    "injected_config",
    "set_agent_interface",
    "with_agent_interface",
]


# The launchers' shared refusals (meshgate.launchers.checks), by their Ray names.
RayLauncherArgumentError = LauncherArgumentError
RayLauncherTypeError = LauncherTypeError


class RayTopologyError(ClaimedTopologyError):
    """What Ray Train built differs from the attestation, or no attestation is held."""


class RayPlacementError(RayTopologyError):
    """Ray cannot put the workers on the job's meshgate nodes (no Ray node carries their labels)."""


_CURRENT: Optional["VerifiedAttestation"] = None


def current_attestation() -> "VerifiedAttestation":
    """The verified attestation of this Ray Train worker (inside the train loop)."""
    if _CURRENT is None:
        raise RayTopologyError(
            "no meshgate attestation in this process: it is set in each Ray Train worker "
            "before train_loop_per_worker runs"
        )
    return _CURRENT


# ---- checks (no Ray) -------------------------------------------------------------------------


def _required_params(function: Callable[..., Any]) -> Optional[int]:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    return sum(
        1
        for p in parameters
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    )


def check_train_loop(function: Any) -> bool:
    """Refuse a non-callable loop or one of more than 1 required argument; returns whether
    it takes the config."""
    if not callable(function):
        raise RayLauncherTypeError(
            f"train_loop_per_worker must be callable, got {type(function).__name__} {bounded_repr(function)}"
        )
    required = _required_params(function)
    if required is None:
        return True
    if required > 1:
        raise RayLauncherTypeError(
            f"train_loop_per_worker must take 0 or 1 required argument (the config), "
            f"{bounded_repr(getattr(function, '__name__', function))} takes {required}"
        )
    if required == 1:
        return True
    # 0 required: it takes the config if it can be called with one positional argument.
    try:
        inspect.signature(function).bind({})
        return True
    except TypeError:
        return False


def check_train_loop_config(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        raise RayLauncherTypeError(
            f"train_loop_config must be a dict, got {type(config).__name__} {bounded_repr(config)}"
        )
    non_str = [k for k in config if not isinstance(k, str)]
    if non_str:
        raise RayLauncherTypeError(f"train_loop_config keys must be strings, got {bounded_repr(non_str)}")
    reserved = sorted(k for k in config if k.startswith(RESERVED_PREFIX))
    if reserved:
        names = ", ".join(bounded_repr(k, 40) for k in reserved[:8])
        names += ", ..." if len(reserved) > 8 else ""
        raise ReservedConfigKeyError(
            f"train_loop_config uses the reserved key(s) {names}: keys starting "
            f"with {RESERVED_PREFIX!r} are injected by the launcher ({', '.join(INJECTED_KEYS)})"
        )
    return dict(config)


# ---- worker side ----------------------------------------------------------------------------


# Ray ships these settings to every worker: the claimed-mode settings every such launcher takes.
WorkerSettings = ClaimedSettings


def attest_worker(
    settings: WorkerSettings, *, rank: int, world_size: int, local_rank: int, node_id: str
) -> "VerifiedAttestation":
    """Register (claimed), verify and cross-check one worker against Ray Train's context; wait for the world."""
    return attest_claimed(
        settings,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        node_id=node_id,
        framework="Ray Train",
        error=RayTopologyError,
    )


def worker_node_id(settings: WorkerSettings, ray_node_id: Callable[[], str]) -> str:
    """The meshgate node this worker runs on: the local agent's answer on its socket (the
    node id it vouches under). Ray's own node id only where no agent runs (no vouches)."""
    from meshgate.client import agent_node_id
    from meshgate.worker_credentials import drop_for_workers

    # A Ray worker is never its driver: what it inherited of the driver's credentials (a
    # local cluster's workers inherit its environment) goes before anything registers.
    drop_for_workers(os.environ)
    settings.export_transport()
    # The agent must serve this job (its vouches name it): in jobs mode it may take a
    # heartbeat to learn that its node was given to the job.
    return agent_node_id(job_id=settings.job_id, wait_s=settings.register_timeout) or ray_node_id()


def injected_config(attestation: "VerifiedAttestation") -> dict[str, Any]:
    return {
        "meshgate_attestation": attestation.signed.SerializeToString(),
        "meshgate_rank": attestation.rank,
        "meshgate_world_size": attestation.world_size,
        "meshgate_local_rank": attestation.local_rank,
        "meshgate_node_rank": attestation.node_rank,
        "meshgate_generation": attestation.generation,
        "meshgate_coordinate": dict(attestation.coordinate),
        "meshgate_plan": attestation.plan.to_dict(),
    }


class _AttestedLoop:
    """What each Ray Train worker runs: attest, then the user's loop with the keys."""

    def __init__(self, settings: WorkerSettings, loop: Callable[..., Any], takes_config: bool) -> None:
        self.settings = settings
        self.loop = loop
        self.takes_config = takes_config
        self.__name__ = getattr(loop, "__name__", type(loop).__name__)

    def __call__(self, config: dict) -> Any:  # required: Ray passes the config only then
        global _CURRENT
        import ray
        import ray.train

        context = ray.train.get_context()
        attestation = attest_worker(
            self.settings,
            rank=context.get_world_rank(),
            world_size=context.get_world_size(),
            local_rank=context.get_local_rank(),
            node_id=worker_node_id(self.settings, lambda: ray.get_runtime_context().get_node_id()),
        )
        _CURRENT = attestation
        config = dict(config or {})
        config.update(injected_config(attestation))
        return self.loop(config) if self.takes_config else self.loop()


# ---- the collectives' interface, set before Ray Train initializes the process group -----------


def set_agent_interface() -> dict[str, str]:
    """In a Ray Train worker, before its process group is initialized: GLOO_SOCKET_IFNAME and
    NCCL_SOCKET_IFNAME of the interface its node's agent advertises, each only where unset
    (or empty, as the agent and torchrun's handler read them): an operator who chose one in
    Ray's node environment chose for this node. Returns what it set. No agent on the node
    (no socket set or found): nothing, gloo and NCCL choose as they would have."""
    from meshgate.agent_socket import IFNAME_ENVS
    from meshgate.client import RendezvousRefused, agent_interface

    unset = [name for name in IFNAME_ENVS if not os.environ.get(name)]
    if not unset:
        return {}
    try:
        interface = agent_interface()
    except RendezvousRefused as exc:
        # The agent is there but does not answer this worker: fail now, before gloo picks
        # the host name's interface and a job across nodes hangs in init_process_group.
        raise RayTopologyError(
            f"cannot ask the node's meshgate agent which network interface the workers use "
            f"(GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, or set them in Ray's node environment): {exc}"
        ) from None
    if not interface:
        return {}
    for name in unset:
        os.environ[name] = interface
    return {name: interface for name in unset}


_BACKEND_CLASSES: dict[type, type] = {}
_CONFIG_CLASSES: dict[type, type] = {}


def _agent_interface_backend(base: type) -> type:
    """``base`` (the config's Ray Train Backend class), whose on_start first runs
    set_agent_interface on every worker: Ray Train's torch backend initializes the process
    group in on_start (through the worker group, on every worker), before the user's loop, so
    the loop is too late. Everything else, class attributes included, is ``base``'s."""
    cls = _BACKEND_CLASSES.get(base)
    if cls is None:

        def on_start(self: Any, worker_group: Any, backend_config: Any) -> None:
            worker_group.execute(set_agent_interface)
            super(cls, self).on_start(worker_group, backend_config)

        def body(namespace: dict[str, Any]) -> None:
            namespace.update(on_start=on_start, __module__=__name__)

        # types.new_class: Ray's Backend has a metaclass of its own (a singleton per class).
        cls = _BACKEND_CLASSES[base] = types.new_class(f"AgentInterface{base.__name__}", (base,), exec_body=body)
    return cls


class _AgentInterface:
    """Mixed into the class of the trainer's TorchConfig: its backend sets the interface first."""

    @property
    def backend_cls(self) -> type:
        return _agent_interface_backend(super().backend_cls)  # type: ignore[misc]


def with_agent_interface(config: Any) -> Any:
    """A copy of ``config`` (a ray.train.torch.TorchConfig, or a subclass: its fields and its
    backend are kept) whose backend runs set_agent_interface on every worker before it
    initializes the process group. ``config`` itself is not changed (TorchTrainer writes its
    backend into the config it is given)."""
    if isinstance(config, _AgentInterface):
        return config
    base = type(config)
    cls = _CONFIG_CLASSES.get(base)
    if cls is None:
        # Made here, not importable by name: Ray pickles it by value (cloudpickle).
        cls = _CONFIG_CLASSES[base] = type(
            f"AgentInterface{base.__name__}", (_AgentInterface, base), {"__module__": __name__}
        )
    wrapped = copy.copy(config)
    wrapped.__class__ = cls
    return wrapped


# ---- placement: the job's nodes, one Ray label selector per worker ---------------------------


@dataclass(frozen=True)
class Placement:
    """The job the workers register in, and the meshgate node of each rank in world-rank
    order (empty: the job's nodes are not all known, so Ray places the workers)."""

    job_id: str
    rank_nodes: tuple[str, ...] = ()

    def label_selectors(self) -> Optional[list[dict[str, str]]]:
        """Ray Train's ``label_selector``: worker ``i`` on the node of rank ``i``."""
        return [{NODE_ID_LABEL: node_label_value(node)} for node in self.rank_nodes] or None


def job_placement(settings: WorkerSettings, job_id: str) -> Placement:
    """Where the job's ranks are: its nodes in node-rank order, each holding a block of
    ``world_size / len(nodes)`` consecutive ranks, once the job holds all of them."""
    import grpc

    from meshgate import admin
    from meshgate.connection import RendezvousRefused, connect
    from meshgate.v1 import rendezvous_pb2 as pb

    try:
        info = admin.get_job(connect(settings.coordinator, admin=True), job_id)
    except RendezvousRefused as exc:
        denied = exc.code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
        who = " (the admin or submitter role reads it: MESHGATE_TLS_CERT / MESHGATE_TLS_KEY, or MESHGATE_ADMIN_TOKEN)"
        raise RayPlacementError(
            f"cannot read job {job_id!r}'s nodes to place Ray's workers on them{who if denied else ''}: {exc}"
        ) from None
    if info.state != pb.RUNNING:
        raise RayPlacementError(
            f"job {job_id!r} is {pb.JobState.Name(info.state)}" + (f": {info.reason[:300]}" if info.reason else "")
        )
    world = settings.plan.world_size
    nodes = tuple(info.nodes)
    slots = info.spec.slots_per_node or (world // len(nodes) if nodes else 0)
    if not nodes or len(nodes) * slots != world:
        return Placement(job_id)
    return Placement(job_id, tuple(node for node in nodes for _ in range(slots)))


def check_ray_nodes(placement: Placement) -> None:
    """Refuse, before Ray waits for ever, a placement on a node no live Ray node is labelled as."""
    import ray

    if not placement.rank_nodes:
        return
    if not ray.is_initialized():
        ray.init()
    labelled = {(node.get("Labels") or {}).get(NODE_ID_LABEL) for node in ray.nodes() if node.get("Alive")}
    missing = sorted({node for node in placement.rank_nodes if node_label_value(node) not in labelled})
    if missing:
        raise RayPlacementError(
            f"job {placement.job_id!r} runs on meshgate node(s) {', '.join(map(repr, missing))}, but no live "
            f"Ray node is labelled {NODE_ID_LABEL}=<node>: start Ray on each node with the labels its agent "
            "wrote (`ray start --address=HEAD:PORT --labels-file=<the agent's [agent] ray_labels_file, "
            "default <state_dir>/ray-labels.yaml>`)"
        )


# ---- the launcher ---------------------------------------------------------------------------


def _import_ray_train() -> tuple[Any, Any, Any]:
    try:
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer
    except ImportError as exc:
        raise ImportError(f"RayTrainLauncher needs Ray Train (and torch): {RAY_EXTRA} ({exc})") from exc
    return ScalingConfig, RunConfig, TorchTrainer


class RayTrainLauncher:
    """Check the arguments (without Ray), then build and run an attested TorchTrainer."""

    def __init__(
        self,
        plan: Optional[ParallelPlan] = None,
        *,
        train_loop_per_worker: Callable[..., Any],
        coordinator: Optional[str] = None,
        job_id: Optional[str] = None,
        trust_bundle: Any = None,
        train_loop_config: Optional[Mapping[str, Any]] = None,
        resources_per_worker: Optional[Mapping[str, float]] = None,
        use_gpu: bool = False,
        placement_strategy: str = "PACK",
        run_config: Any = None,
        torch_config: Any = None,
        await_world: bool = True,
        register_timeout: float = 30.0,
        world_timeout: float = 300.0,
        nodes: int = 0,
        slots_per_node: int = 0,
        topology_policy: str = "refuse",
        start_timeout: float = 300.0,
        **trainer_kwargs: Any,
    ) -> None:
        plan = current_plan() if plan is None else plan
        check_type("plan", plan, ParallelPlan, "a meshgate.plan.ParallelPlan")
        takes_config = check_train_loop(train_loop_per_worker)
        config = check_train_loop_config(train_loop_config)
        resources = check_resources(resources_per_worker, use_gpu)
        if placement_strategy not in PLACEMENT_STRATEGIES:
            raise RayLauncherArgumentError(
                f"placement_strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, got "
                f"{bounded_repr(placement_strategy)}"
            )
        for name, count in (("nodes", nodes), ("slots_per_node", slots_per_node)):
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise RayLauncherArgumentError(f"{name} must be an integer >= 0, got {bounded_repr(count)}")
        if isinstance(start_timeout, bool) or not isinstance(start_timeout, (int, float)) or not start_timeout > 0:
            raise RayLauncherArgumentError(
                f"start_timeout must be a positive number of seconds, got {bounded_repr(start_timeout)}"
            )
        if topology_policy not in TOPOLOGY_POLICIES:
            raise RayLauncherArgumentError(
                f"topology_policy must be one of {', '.join(TOPOLOGY_POLICIES)}, got {bounded_repr(topology_policy)}"
            )
        for owned in ("scaling_config", "train_loop_config", "train_loop_per_worker"):
            if owned in trainer_kwargs:
                raise RayLauncherTypeError(f"{owned} is set by RayTrainLauncher; do not pass it")

        settings = claimed_settings(
            plan,
            coordinator=coordinator,
            job_id=env_or(job_id, "MESHGATE_JOB") or "",  # "": fit() submits the job
            trust_bundle=trust_bundle,
            await_world=await_world,
            register_timeout=register_timeout,
            world_timeout=world_timeout,
        )

        self.plan = plan
        self.train_loop_per_worker = train_loop_per_worker
        self.train_loop_config = config
        self.resources_per_worker = resources
        self.use_gpu = use_gpu
        self.placement_strategy = placement_strategy
        self.run_config = run_config
        self.torch_config = torch_config
        self.trainer_kwargs = dict(trainer_kwargs)
        self.settings = settings
        self.nodes = nodes
        self.slots_per_node = slots_per_node
        self.topology_policy = topology_policy
        self.start_timeout = start_timeout
        self._takes_config = takes_config

    @property
    def num_workers(self) -> int:
        return self.plan.world_size

    def worker_loop(self, placement: Optional[Placement] = None) -> _AttestedLoop:
        """The function each Ray Train worker runs (attest, then the user's loop)."""
        placement = placement or Placement(self.settings.job_id)
        settings = dataclasses.replace(self.settings, job_id=placement.job_id, rank_nodes=placement.rank_nodes)
        return _AttestedLoop(settings, self.train_loop_per_worker, self._takes_config)

    def scaling_config(self, placement: Optional[Placement] = None) -> Any:
        ScalingConfig, _, _ = _import_ray_train()
        selectors = placement.label_selectors() if placement is not None else None
        return ScalingConfig(
            num_workers=self.num_workers,
            use_gpu=self.use_gpu,
            resources_per_worker=self.resources_per_worker,
            placement_strategy=self.placement_strategy,
            **({"label_selector": selectors} if selectors else {}),
        )

    def trainer(self, placement: Optional[Placement] = None) -> Any:
        """The TorchTrainer (num_workers = plan.world_size) running the attested loop, its
        workers on ``placement``'s nodes (None: the given job, placed by Ray)."""
        _, _, TorchTrainer = _import_ray_train()
        from ray.train.torch import TorchConfig

        kwargs = dict(self.trainer_kwargs)
        if self.run_config is not None:
            kwargs["run_config"] = self.run_config
        torch_config = TorchConfig() if self.torch_config is None else self.torch_config
        check_type("torch_config", torch_config, TorchConfig, "a ray.train.torch.TorchConfig")
        # The workers' interface before the process group is made (with_agent_interface).
        kwargs["torch_config"] = with_agent_interface(torch_config)
        return TorchTrainer(
            self.worker_loop(placement),
            train_loop_config=dict(self.train_loop_config),
            scaling_config=self.scaling_config(placement),
            **kwargs,
        )

    @contextlib.contextmanager
    def job(self) -> Iterator[Placement]:
        """The job's placement: the given job's, or (no job given) that of a claimed-mode job
        submitted for the plan, finished when the block ends (SUCCEEDED, or FAILED)."""
        if self.settings.job_id:
            yield job_placement(self.settings, self.settings.job_id)
            return
        from meshgate.launchers.jobs import claimed_job

        with claimed_job(
            self.plan,
            coordinator=self.settings.coordinator,
            nodes=self.nodes,
            slots_per_node=self.slots_per_node,
            topology_policy=self.topology_policy,
            start_timeout=self.start_timeout,
        ) as job_id:
            yield job_placement(self.settings, job_id)

    def fit(self) -> Any:
        """Run the trainer on the job's nodes; returns Ray Train's Result."""
        _import_ray_train()  # without Ray, say so before any job is read or submitted
        with self.job() as placement:
            check_ray_nodes(placement)
            return self.trainer(placement).fit()
