"""LightningFabricLauncher: a Lightning Fabric bound to a meshgate plan (DP / FSDP only).

Fabric chooses its own ranks (``node_rank * devices + local_rank``), so its workers use
meshgate's **claimed mode**: inside every launched process, before any user code runs,
the worker sends Register with ``rank = fabric.global_rank`` and this node's id, verifies
the signed attestation against the trust bundle and the plan, cross-checks it against
what Fabric built (rank, world size, local rank), waits for the whole world to be
attested (AwaitWorld), and keeps it on the fabric (``fabric.attest_topology()``)::

    launcher = LightningFabricLauncher(
        ParallelPlan(dp_shard=8), coordinator="head:7443", job_id="llm",
        trust_bundle="/etc/meshgate/trust-bundle.json", devices=8, num_nodes=1,
        accelerator="cuda",
    )
    fabric = launcher.fabric()          # strategy defaults to "fsdp" (dp_shard > 1)
    fabric.launch(train)                # train(fabric) runs with an attestation held

    def train(fabric):
        attestation = fabric.attest_topology()   # VerifiedAttestation of this rank

What the launcher refuses, before lightning is imported (each error names the numbers):

* a plan with ``tp``, ``pp``, ``cp``, ``ep`` or ``etp`` > 1: Fabric owns data
  parallelism only (build those meshes with ``meshgate.launchers.mesh`` / ``meshgate.launchers.megatron``);
* hybrid sharding (``dp_replicate > 1`` and ``dp_shard > 1``) without an explicit
  ``strategy`` (e.g. ``FSDPStrategy(sharding_strategy="HYBRID_SHARD")``);
* ``devices * num_nodes != plan.world_size``.

``strategy`` defaults to ``"fsdp"`` when ``dp_shard > 1``, else ``"ddp"``; pass any Fabric
strategy (``"ddp_spawn"``, ``"ddp_fork"``, a Strategy object) explicitly.

Multi-node runs started by meshgate agents: node rank 0's agent reserves a port on its
advertised address and offers it at Join; the coordinator's assignment hands that master to
every agent, which exports ``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK`` and
``WORLD_SIZE`` (unless the operator set them) before its workers start, and
``meshgate status`` shows the same master. An agent whose node rank 0 has not joined yet
waits for it (up to ``join_timeout_s``). The agent starts one process per slot with
``LOCAL_RANK`` set, so use ``devices = slots_per_node`` and a strategy whose processes may be
started externally (``"ddp"``, ``"fsdp"``; not ``"ddp_fork"``/``"ddp_spawn"``, which start
their own); the job's ``[job] mode = "claimed"``. The launcher hands these to Fabric
(Lightning's cluster environment):

| argument      | environment          | default                                   |
|---------------|----------------------|-------------------------------------------|
| plan          | MESHGATE_PLAN_FILE   | the job's plan, written by the agent (``meshgate.current_plan()``) |
| coordinator   | MESHGATE_COORDINATOR | required                                  |
| job_id        | MESHGATE_JOB         | required                                  |
| trust_bundle  | MESHGATE_TRUST_BUNDLE| required (a JSON file or a TrustBundle)   |
| node_id       | MESHGATE_NODE_ID     | the agent's (MESHGATE_AGENT_SOCKET), else the hostname |
| node_rank     | MESHGATE_NODE_RANK   | 0 on one node; required when num_nodes > 1|
| master_addr   | MASTER_ADDR          | set by the agent; Fabric's 127.0.0.1 alone |
| master_port   | MASTER_PORT          | set by the agent; a free port alone        |

Lightning is imported only when a Fabric is built; without it that step raises an
ImportError naming the extra (``meshgate's [lightning] extra``, with the packages it brings).
"""

from __future__ import annotations

import inspect
import numbers
import os
import socket
import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional

from meshgate.extras import install_hint
from meshgate.launchers.checks import (
    LauncherArgumentError,
    LauncherTypeError,
    UnsupportedPlanError,
    WorldSizeMismatchError,
    bounded_repr,
    check_type,
)
from meshgate.launchers.claimed import ClaimedSettings, ClaimedTopologyError, attest_claimed, claimed_settings, env_or
from meshgate.plan import ParallelPlan, current_plan

if TYPE_CHECKING:  # pragma: no cover
    from meshgate.attestation import VerifiedAttestation

LIGHTNING_EXTRA = install_hint("lightning")
# Axes Fabric cannot express: it runs one data-parallel (DDP or FSDP) world.
NON_DATA_AXES: tuple[str, ...] = ("tp", "pp", "cp", "ep", "etp")
# Strategies that replicate the model (no sharding), by Fabric's registry names.
_REPLICATING = ("ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "ddp_find_unused_parameters_true")
_SINGLE_PROCESS = ("dp", "single_device", "single_xla")

__all__ = [
    "FabricTopologyError",
    "LIGHTNING_EXTRA",
    "LightningFabricLauncher",
    "MeshgateFabric",
    "current_attestation",
]


class FabricTopologyError(ClaimedTopologyError):
    """What Fabric built differs from the attestation, or no attestation is held yet."""


# The attestation of this process, once a launched function holds it.
_CURRENT: Optional["VerifiedAttestation"] = None


def current_attestation() -> "VerifiedAttestation":
    """This process's verified attestation (inside a function run by ``fabric.launch``)."""
    if _CURRENT is None:
        raise FabricTopologyError(
            "no meshgate attestation in this process: it is set inside the processes that "
            "fabric.launch() starts, before the launched function runs"
        )
    return _CURRENT


def _as_int(name: str, value: Any, env: str) -> int:
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            raise LauncherArgumentError(f"{name} must be an integer, got {bounded_repr(value)} (from {env})") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise LauncherTypeError(f"{name} must be an integer, got {bounded_repr(value)}")
    return int(value)


def _device_count(devices: Any) -> int:
    if isinstance(devices, (list, tuple)):
        if not devices or any(isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 0 for d in devices):
            raise LauncherArgumentError(f"devices must list device indices (>= 0), got {bounded_repr(devices)}")
        if len(set(devices)) != len(devices):
            raise LauncherArgumentError(f"devices lists a device twice: {bounded_repr(devices)}")
        return len(devices)
    if isinstance(devices, bool) or not isinstance(devices, numbers.Integral) or devices < 1:
        raise LauncherArgumentError(
            f"devices must be an explicit positive count or a list of device indices, got "
            f'{bounded_repr(devices)} ("auto" and -1 are not allowed: the plan fixes the world size)'
        )
    return int(devices)


def check_plan_for_fabric(plan: ParallelPlan) -> None:
    """Refuse a plan that is not pure data parallelism, naming every offending axis."""
    check_type("plan", plan, ParallelPlan, "a meshgate.plan.ParallelPlan")
    offending = [f"{axis}={plan.size(axis)}" for axis in NON_DATA_AXES if plan.size(axis) > 1]
    if offending:
        raise UnsupportedPlanError(
            "LightningFabricLauncher owns data parallelism only (dp_replicate, dp_shard); the "
            f"plan has {', '.join(offending)} > 1. Build tensor/pipeline/context/expert "
            "parallel groups with meshgate.launchers.mesh or meshgate.launchers.megatron instead."
        )


def default_strategy(plan: ParallelPlan) -> str:
    return "fsdp" if plan.dp_shard > 1 else "ddp"


def check_fsdp_device(plan: ParallelPlan, strategy: Any, accelerator: Any) -> None:
    """Lightning refuses FSDP on anything but a GPU, deep inside every worker once the job
    runs; refused here, before a rank is registered, in one line that says what to change.
    (A job's spec names neither its launcher nor its nodes' slot kind, so the coordinator
    cannot refuse it at submit.)"""
    fsdp = (isinstance(strategy, str) and strategy.startswith("fsdp")) or type(strategy).__name__ == "FSDPStrategy"
    if fsdp and str(accelerator).lower() not in ("cuda", "gpu"):
        raise UnsupportedPlanError(
            f"strategy {strategy if isinstance(strategy, str) else 'FSDPStrategy'!r} (dp_shard={plan.dp_shard}) needs "
            f"accelerator='cuda': Lightning runs FSDP on GPUs only, and accelerator is {bounded_repr(accelerator)}. "
            f"On GPU nodes pass accelerator='cuda'; on CPU nodes replicate instead of sharding: a plan with "
            f"dp_replicate={plan.world_size} and dp_shard=1 (strategy 'ddp')"
        )


# ---- the launcher --------------------------------------------------------------------------


class LightningFabricLauncher:
    """Validate a plan for Fabric and build a Fabric whose launch() attests every rank."""

    def __init__(
        self,
        plan: Optional[ParallelPlan] = None,
        *,
        coordinator: Optional[str] = None,
        job_id: Optional[str] = None,
        trust_bundle: Any = None,
        devices: Any = None,
        num_nodes: int = 1,
        accelerator: Any = "cpu",
        strategy: Any = None,
        node_id: Optional[str] = None,
        node_rank: Optional[int] = None,
        master_addr: Optional[str] = None,
        master_port: Optional[int] = None,
        await_world: bool = True,
        register_timeout: float = 30.0,
        world_timeout: float = 300.0,
        **fabric_kwargs: Any,
    ) -> None:
        plan = current_plan() if plan is None else plan  # the job's, as its node agent wrote it
        check_plan_for_fabric(plan)
        if isinstance(num_nodes, bool) or not isinstance(num_nodes, numbers.Integral) or num_nodes < 1:
            raise LauncherArgumentError(f"num_nodes must be an exact positive integer, got {bounded_repr(num_nodes)}")
        num_nodes = int(num_nodes)
        world = plan.world_size
        if devices is None:
            if world % num_nodes:
                raise WorldSizeMismatchError(
                    f"plan world_size {world} is not divisible by num_nodes {num_nodes}; pass devices= explicitly"
                )
            devices = world // num_nodes
        count = _device_count(devices)
        if count * num_nodes != world:
            raise WorldSizeMismatchError(
                f"devices ({count}) * num_nodes ({num_nodes}) = {count * num_nodes} does not "
                f"equal the plan's world_size {world} ({plan.describe()})"
            )
        if plan.dp_replicate > 1 and plan.dp_shard > 1 and strategy is None:
            raise UnsupportedPlanError(
                f"hybrid sharding (dp_replicate={plan.dp_replicate} x dp_shard={plan.dp_shard}) "
                "needs an explicit strategy, e.g. "
                "FSDPStrategy(sharding_strategy='HYBRID_SHARD') with dp_shard ranks per "
                "shard group"
            )
        if strategy is None:
            strategy = default_strategy(plan)
        elif isinstance(strategy, str):
            if strategy in _SINGLE_PROCESS and world > 1:
                raise WorldSizeMismatchError(
                    f"strategy {strategy!r} runs one process; the plan's world_size is {world}"
                )
            if strategy in _REPLICATING and plan.dp_shard > 1:
                warnings.warn(
                    f"strategy {strategy!r} replicates the model, but the plan shards it "
                    f"(dp_shard={plan.dp_shard}); use an FSDP strategy to shard",
                    stacklevel=2,
                )
        check_fsdp_device(plan, strategy, accelerator)
        # Multi-node: the agent hands each node its assignment from the coordinator.
        node_rank = env_or(node_rank, "MESHGATE_NODE_RANK")
        node_rank = 0 if node_rank is None and num_nodes == 1 else node_rank
        if node_rank is None:
            raise LauncherArgumentError(
                f"num_nodes={num_nodes} needs this node's node_rank: pass node_rank= or set "
                "MESHGATE_NODE_RANK (the agent sets it from the coordinator's assignment)"
            )
        node_rank = _as_int("node_rank", node_rank, "MESHGATE_NODE_RANK")
        if not 0 <= node_rank < num_nodes:
            raise LauncherArgumentError(f"node_rank {node_rank} out of range [0, {num_nodes}) (num_nodes)")
        master_addr = env_or(master_addr, "MASTER_ADDR")
        master_port = env_or(master_port, "MASTER_PORT")
        if num_nodes > 1 and (master_addr is None or master_port is None):
            raise LauncherArgumentError(
                f"num_nodes={num_nodes} needs one master address for every node: pass "
                "master_addr= and master_port= or set MASTER_ADDR and MASTER_PORT (a meshgate "
                "agent exports them from node rank 0's agent's offer; this process was not "
                "started by one, or node rank 0's agent never joined)"
            )
        if master_port is not None:
            master_port = _as_int("master_port", master_port, "MASTER_PORT")
            if not 0 < master_port < 65536:
                raise LauncherArgumentError(f"master_port {master_port} out of range [1, 65535]")

        from meshgate.client import agent_node_id

        settings = claimed_settings(
            plan,
            coordinator=coordinator,
            job_id=job_id,
            trust_bundle=trust_bundle,
            await_world=await_world,
            register_timeout=register_timeout,
            world_timeout=world_timeout,
            # The node id the local agent vouches under, asked of its socket, before the hostname.
            node_id=env_or(node_id, "MESHGATE_NODE_ID") or agent_node_id() or socket.gethostname(),
        )

        self.plan = plan
        self.accelerator = accelerator
        self.strategy = strategy
        self.devices = devices
        self.master_addr: Optional[str] = master_addr
        self.master_port: Optional[int] = master_port
        self.fabric_kwargs = dict(fabric_kwargs)
        self.settings = settings
        self.devices_per_node = count
        self._num_nodes = num_nodes
        self._node_rank = node_rank

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @property
    def node_rank(self) -> int:
        return self._node_rank

    def fabric(self) -> "MeshgateFabric":
        """A Fabric bound to this plan; its launch() attests every rank first.

        Sets NODE_RANK (on several nodes, or to override one already set) and MASTER_ADDR /
        MASTER_PORT (when known) in this process's environment: that is where Lightning's
        cluster environment reads them.
        """
        cls = _fabric_class()
        if self.num_nodes > 1 or "NODE_RANK" in os.environ:
            os.environ["NODE_RANK"] = str(self.node_rank)
        if self.master_addr is not None:
            os.environ["MASTER_ADDR"] = str(self.master_addr)
        if self.master_port is not None:
            os.environ["MASTER_PORT"] = str(self.master_port)
        return cls(
            accelerator=self.accelerator,
            strategy=self.strategy,
            devices=self.devices,
            num_nodes=self.num_nodes,
            meshgate_settings=self.settings,
            **self.fabric_kwargs,
        )

    build = fabric

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``self.fabric().launch(function, *args, **kwargs)``."""
        return self.fabric().launch(function, *args, **kwargs)

    def attest_topology(self) -> "VerifiedAttestation":
        """This process's attestation (in a launched process); a clear error before."""
        return current_attestation()


# ---- the Fabric subclass (defined when lightning is first needed) ---------------------------


def _import_fabric() -> type:
    try:
        from lightning.fabric import Fabric
    except ImportError as first:
        try:
            from lightning_fabric import Fabric  # the standalone package
        except ImportError:
            raise ImportError(f"LightningFabricLauncher needs Lightning Fabric: {LIGHTNING_EXTRA} ({first})") from first
    return Fabric


class _AttestedCall:
    """The function handed to Fabric.launch: attest, then run the user's function.

    A module-level class, so spawned processes can unpickle it by reference."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def __call__(self, fabric: "MeshgateFabric", *args: Any, **kwargs: Any) -> Any:
        fabric._meshgate_attest()
        return self.function(fabric, *args, **kwargs)


def _check_user_function(function: Any) -> None:
    if not callable(function):
        raise TypeError(
            f"fabric.launch() needs a callable, got {bounded_repr(function)}; do .launch(fn), not .launch(fn())"
        )
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return
    if not parameters:
        raise TypeError(
            f"fabric.launch({bounded_repr(function)}): the function must take at least one argument, the Fabric object"
        )


def _make_fabric_class(Fabric: type) -> type:
    class MeshgateFabric(Fabric):  # type: ignore[misc, valid-type]
        """A Fabric whose launch() registers each rank (claimed) and verifies it first."""

        def __init__(self, *args: Any, meshgate_settings: ClaimedSettings, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._meshgate = meshgate_settings
            self._meshgate_attestation: Optional["VerifiedAttestation"] = None

        @property
        def meshgate_plan(self) -> ParallelPlan:
            return self._meshgate.plan

        def launch(self, function: Optional[Callable[..., Any]] = None, *args: Any, **kwargs: Any) -> Any:
            if function is None:
                # Script launchers ("ddp"): every process returns here, set up; attest it.
                result = super().launch()
                self._meshgate_attest()
                return result
            _check_user_function(function)
            return super().launch(_AttestedCall(function), *args, **kwargs)

        def _meshgate_attest(self) -> "VerifiedAttestation":
            global _CURRENT
            if self._meshgate_attestation is None:
                self._meshgate_attestation = attest_claimed(
                    self._meshgate,
                    rank=self.global_rank,
                    world_size=self.world_size,
                    local_rank=self.local_rank,
                    node_id=self._meshgate.node_id,
                    framework="Fabric",
                    error=FabricTopologyError,
                )
                _CURRENT = self._meshgate_attestation
            return self._meshgate_attestation

        def attest_topology(self) -> "VerifiedAttestation":
            """This rank's verified attestation, re-checked against Fabric's ranks."""
            attestation = self._meshgate_attestation
            if attestation is None:
                raise FabricTopologyError(
                    "no meshgate attestation yet: call fabric.launch(fn) first; the "
                    "attestation is held inside the launched processes, before fn runs"
                )
            if attestation.rank != self.global_rank or attestation.world_size != self.world_size:
                raise FabricTopologyError(
                    f"Fabric is now rank {self.global_rank}/{self.world_size}; the attestation "
                    f"says {attestation.rank}/{attestation.world_size}"
                )
            return attestation

        @property
        def meshgate_attestation(self) -> "VerifiedAttestation":
            return self.attest_topology()

    MeshgateFabric.__module__ = __name__
    MeshgateFabric.__qualname__ = "MeshgateFabric"
    return MeshgateFabric


_FABRIC_CLASS: Optional[type] = None


def _fabric_class() -> type:
    global _FABRIC_CLASS
    if _FABRIC_CLASS is None:
        _FABRIC_CLASS = _make_fabric_class(_import_fabric())
    return _FABRIC_CLASS


def __getattr__(name: str) -> Any:
    # ``meshgate.launchers.fabric.MeshgateFabric`` resolves (importing lightning) on first use, so
    # pickle finds the class by name in spawned processes.
    if name == "MeshgateFabric":
        return _fabric_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
