"""RayTrainLauncher: a Ray Train TorchTrainer whose workers are attested by meshgate.

Ray places the workers and chooses their ranks, so they use meshgate's **claimed mode**:
every worker, before the user's loop runs, sends Register with its Ray Train world rank
(``ray.train.get_context().get_world_rank()``), its local rank and its Ray node id as
``node_id``; it verifies the signed attestation against the trust bundle and the plan,
cross-checks it against Ray's context (rank, world size, local rank), waits until the
whole world is attested (AwaitWorld), and hands it to the loop in its config::

    def train_loop(config):
        rank = config["meshgate_rank"]                 # == the Ray Train world rank
        coordinate = config["meshgate_coordinate"]     # {"dp_shard": ..., "tp": ...}
        attestation = meshgate.launchers.ray.current_attestation()  # the VerifiedAttestation

    RayTrainLauncher(
        ParallelPlan(dp_shard=4), coordinator="head:7443", job_id="llm",
        trust_bundle="/etc/meshgate/trust-bundle.json", train_loop_per_worker=train_loop,
        resources_per_worker={"CPU": 4, "GPU": 1}, use_gpu=True,
    ).fit()

Keys injected into the loop's config (a user config that uses any ``meshgate_`` key is
refused):

* ``meshgate_attestation``: the SignedAttestation, serialized (bytes);
* ``meshgate_rank``, ``meshgate_world_size``, ``meshgate_local_rank``,
  ``meshgate_node_rank``, ``meshgate_generation`` (ints);
* ``meshgate_coordinate`` (axis -> index) and ``meshgate_plan`` (``ParallelPlan.to_dict()``).

The coordinator checks the topology Ray chose: with the job's ``topology_policy`` it warns
about, or refuses, a TP or CP group whose workers landed on different Ray nodes.

``num_workers`` is always ``plan.world_size``. Every argument is checked (the loop is
callable and takes 0 or 1 argument, the config, ``resources_per_worker`` is str -> a
non-negative number, GPUs agree with ``use_gpu``) before Ray is imported; Ray is only
imported to build the trainer, and without it that raises an ImportError naming the
extra (``pip install 'meshgate[ray]'``).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from meshgate.launchers.checks import (
    LauncherArgumentError,
    LauncherTypeError,
    ReservedConfigKeyError,
    bounded_repr,
    check_resources,
    check_type,
)
from meshgate.launchers.claimed import ClaimedSettings, ClaimedTopologyError, attest_claimed, claimed_settings
from meshgate.plan import ParallelPlan

if TYPE_CHECKING:  # pragma: no cover
    from meshgate.attestation import VerifiedAttestation

RAY_EXTRA = "pip install 'meshgate[ray]'"
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

__all__ = [
    "INJECTED_KEYS",
    "RAY_EXTRA",
    "RayLauncherArgumentError",
    "RayLauncherTypeError",
    "RayTopologyError",
    "RayTrainLauncher",
    "WorkerSettings",
    "attest_worker",
    "current_attestation",
    "injected_config",
]


# The launchers' shared refusals (meshgate.launchers.checks), by their Ray names.
RayLauncherArgumentError = LauncherArgumentError
RayLauncherTypeError = LauncherTypeError


class RayTopologyError(ClaimedTopologyError):
    """What Ray Train built differs from the attestation, or no attestation is held."""


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
        plan: ParallelPlan,
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
        **trainer_kwargs: Any,
    ) -> None:
        check_type("plan", plan, ParallelPlan, "a meshgate.plan.ParallelPlan")
        takes_config = check_train_loop(train_loop_per_worker)
        config = check_train_loop_config(train_loop_config)
        resources = check_resources(resources_per_worker, use_gpu)
        if placement_strategy not in PLACEMENT_STRATEGIES:
            raise RayLauncherArgumentError(
                f"placement_strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, got "
                f"{bounded_repr(placement_strategy)}"
            )
        for owned in ("scaling_config", "train_loop_config", "train_loop_per_worker"):
            if owned in trainer_kwargs:
                raise RayLauncherTypeError(f"{owned} is set by RayTrainLauncher; do not pass it")

        settings = claimed_settings(
            plan,
            coordinator=coordinator,
            job_id=job_id,
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
        self._takes_config = takes_config

    @property
    def num_workers(self) -> int:
        return self.plan.world_size

    def worker_loop(self) -> _AttestedLoop:
        """The function each Ray Train worker runs (attest, then the user's loop)."""
        return _AttestedLoop(self.settings, self.train_loop_per_worker, self._takes_config)

    def scaling_config(self) -> Any:
        ScalingConfig, _, _ = _import_ray_train()
        return ScalingConfig(
            num_workers=self.num_workers,
            use_gpu=self.use_gpu,
            resources_per_worker=self.resources_per_worker,
            placement_strategy=self.placement_strategy,
        )

    def trainer(self) -> Any:
        """The TorchTrainer (num_workers = plan.world_size) running the attested loop."""
        _, _, TorchTrainer = _import_ray_train()
        kwargs = dict(self.trainer_kwargs)
        if self.run_config is not None:
            kwargs["run_config"] = self.run_config
        if self.torch_config is not None:
            kwargs["torch_config"] = self.torch_config
        return TorchTrainer(
            self.worker_loop(),
            train_loop_config=dict(self.train_loop_config),
            scaling_config=self.scaling_config(),
            **kwargs,
        )

    def fit(self) -> Any:
        """Run the trainer; returns Ray Train's Result."""
        return self.trainer().fit()
