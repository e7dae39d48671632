"""The seed's call shapes (Mixle's ``training_launchers``) over meshgate's launchers.

Code written against the seed keeps its calls and changes its import::

    from meshgate.launchers.compat import LightningFabricLauncher, RayTrainLauncher

    result = RayTrainLauncher().launch(train_loop, plan=plan, train_loop_config={"lr": 0.1},
                                       use_gpu=True, resources_per_worker={"GPU": 1})
    fabric = LightningFabricLauncher().create(plan=plan, accelerator="cuda", devices=8)

Both are thin: they check the seed's arguments the seed's way (through the same checks
as ``meshgate.launchers.ray`` / ``meshgate.launchers.fabric``, before Ray or Lightning is
imported) and build the native launcher, whose workers register in claimed mode and
hold a signed, verified attestation before user code runs. What they need that the seed
did not (the coordinator, the job, the trust bundle) comes from the constructor or from
``MESHGATE_COORDINATOR``, ``MESHGATE_JOB`` and ``MESHGATE_TRUST_BUNDLE``; transport
settings from ``MESHGATE_TLS_*`` / ``MESHGATE_INSECURE`` as for every meshgate client.

Defaults that differ from the seed (docs/migrating-from-training-launchers.md says why):
``use_gpu`` is False (the seed: True), ``accelerator`` is ``"cpu"`` (the seed: ``"auto"``),
``devices`` defaults to ``plan.world_size // num_nodes`` (the seed's ``"auto"``, which is
still accepted on one node, meant the same there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from meshgate.launchers.checks import LauncherArgumentError, bounded_repr, check_type
from meshgate.plan import ParallelPlan

__all__ = ["LightningFabricLauncher", "RayTrainLauncher"]


@dataclass(frozen=True)
class _Settings:
    """Where the coordinator is: given here, else read from MESHGATE_* by the launcher."""

    coordinator: Optional[str]
    job_id: Optional[str]
    trust_bundle: Any

    def as_kwargs(self) -> dict[str, Any]:
        return {
            "coordinator": self.coordinator,
            "job_id": self.job_id,
            "trust_bundle": self.trust_bundle,
        }


class _SeedLauncher:
    """The seed's constructor, the same for both launchers: where the coordinator is."""

    def __init__(
        self,
        *,
        coordinator: Optional[str] = None,
        job_id: Optional[str] = None,
        trust_bundle: Any = None,
    ) -> None:
        self._settings = _Settings(coordinator, job_id, trust_bundle)


class RayTrainLauncher(_SeedLauncher):
    """``RayTrainLauncher().launch(train_loop, *, plan, ...)``, as in the seed."""

    def launcher(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        plan: ParallelPlan,
        train_loop_config: Optional[Mapping[str, Any]] = None,
        use_gpu: bool = False,
        resources_per_worker: Optional[Mapping[str, float]] = None,
        run_config: Any = None,
    ):
        """The checked native launcher (``meshgate.launchers.ray.RayTrainLauncher``) that
        ``launch`` runs; every argument refusal happens here, before Ray is imported."""
        from meshgate.launchers import ray as native

        # The seed checked the loop first; so do we, then the plan.
        native.check_train_loop(train_loop_per_worker)
        check_type("plan", plan, ParallelPlan, "a meshgate.plan.ParallelPlan")
        return native.RayTrainLauncher(
            plan,
            train_loop_per_worker=train_loop_per_worker,
            train_loop_config=train_loop_config,
            use_gpu=use_gpu,
            resources_per_worker=resources_per_worker,
            run_config=run_config,
            **self._settings.as_kwargs(),
        )

    def launch(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        plan: ParallelPlan,
        train_loop_config: Optional[Mapping[str, Any]] = None,
        use_gpu: bool = False,
        resources_per_worker: Optional[Mapping[str, float]] = None,
        run_config: Any = None,
    ) -> Any:
        """Run ``plan.world_size`` attested Ray Train workers; returns Ray Train's Result."""
        return self.launcher(
            train_loop_per_worker,
            plan=plan,
            train_loop_config=train_loop_config,
            use_gpu=use_gpu,
            resources_per_worker=resources_per_worker,
            run_config=run_config,
        ).fit()


class LightningFabricLauncher(_SeedLauncher):
    """``LightningFabricLauncher().create(*, plan, ...)``, as in the seed: a Fabric for
    pure DDP / FSDP plans whose ``launch()`` attests every rank first."""

    def launcher(
        self,
        *,
        plan: ParallelPlan,
        accelerator: Any = "cpu",
        devices: Any = None,
        num_nodes: int = 1,
        precision: Any = "32-true",
        strategy: Any = None,
        **fabric_kwargs: Any,
    ):
        """The checked native launcher (``meshgate.launchers.fabric.LightningFabricLauncher``)
        that ``create`` builds its Fabric from; every refusal happens here, before
        Lightning is imported."""
        from meshgate.launchers import fabric as native

        native.check_plan_for_fabric(plan)
        if isinstance(devices, str):
            if devices != "auto":
                raise LauncherArgumentError(
                    f"devices must be 'auto', an exact positive count or a list of device "
                    f"indices, got {bounded_repr(devices)}"
                )
            # The seed's "auto" meant plan.world_size on one node, not Lightning's
            # "every visible device"; on several nodes it wanted an explicit count.
            if num_nodes != 1:
                raise LauncherArgumentError(
                    f"devices='auto' with num_nodes={bounded_repr(num_nodes)}: a multi-node "
                    "launch needs an explicit per-node device count (or devices=None: "
                    "plan.world_size // num_nodes)"
                )
            devices = None
        return native.LightningFabricLauncher(
            plan,
            accelerator=accelerator,
            devices=devices,
            num_nodes=num_nodes,
            strategy=strategy,
            precision=precision,
            **self._settings.as_kwargs(),
            **fabric_kwargs,
        )

    def create(
        self,
        *,
        plan: ParallelPlan,
        accelerator: Any = "cpu",
        devices: Any = None,
        num_nodes: int = 1,
        precision: Any = "32-true",
        strategy: Any = None,
        **fabric_kwargs: Any,
    ) -> Any:
        """A ``MeshgateFabric``: call ``fabric.launch(fn)``; inside ``fn``,
        ``fabric.attest_topology()`` is the rank's verified attestation."""
        return self.launcher(
            plan=plan,
            accelerator=accelerator,
            devices=devices,
            num_nodes=num_nodes,
            precision=precision,
            strategy=strategy,
            **fabric_kwargs,
        ).fabric()
