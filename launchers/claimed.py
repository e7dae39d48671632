"""Claimed mode, once for every launcher whose framework picks the ranks.

Ray Train (launchers/ray.py) and Lightning Fabric (launchers/fabric.py) place their workers
and number them themselves, so their workers *claim* a rank: each sends Register with the
rank its framework gave it, verifies the signed attestation against the trust bundle and
the plan, cross-checks it against what the framework built (rank, world size, local rank,
node), and waits until the whole world is attested (AwaitWorld). Both launchers take the
same settings, checked the same way (``claimed_settings``), and run the same handshake
(``attest_claimed``); only the framework's name and error class differ.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from meshgate.launchers.checks import LauncherArgumentError, LauncherTypeError, bounded_repr
from meshgate.plan import ParallelPlan
from meshgate.worker_credentials import not_for_workers

if TYPE_CHECKING:  # pragma: no cover
    from meshgate.attestation import VerifiedAttestation

# The driver's transport and vouch settings: workers a framework starts on other nodes do not
# inherit its environment. The agent socket path is node-local, the same path on every node.
# The client certificate and key go only where they are a worker's (meshgate/worker_credentials.py):
# never the driver's admin or submitter identity.
TRANSPORT_ENV_KEYS = (
    "MESHGATE_TLS_CA",
    "MESHGATE_TLS_CERT",
    "MESHGATE_TLS_KEY",
    "MESHGATE_TLS_SERVER_NAME",
    "MESHGATE_INSECURE",
    "MESHGATE_AGENT_SOCKET",
)

__all__ = [
    "ClaimedSettings",
    "ClaimedTopologyError",
    "TRANSPORT_ENV_KEYS",
    "attest_claimed",
    "check_placement",
    "claimed_settings",
    "cross_check",
    "env_or",
    "required",
]


class ClaimedTopologyError(RuntimeError):
    """What the framework built differs from the attestation, or no attestation is held."""


@dataclass(frozen=True)
class ClaimedSettings:
    """What every worker needs to register: plain data, pickled into each worker process."""

    plan: ParallelPlan
    coordinator: str
    job_id: str
    trust_bundle_json: str  # shipped as text: the bundle's path may not exist where a worker runs
    await_world: bool
    register_timeout: float
    world_timeout: float
    # MESHGATE_TLS_*, MESHGATE_INSECURE, MESHGATE_AGENT_SOCKET as the launcher saw them.
    transport_env: tuple[tuple[str, str], ...] = ()
    # The node every worker registers as, where the launcher knows it (Fabric: one node per
    # launcher); empty where each worker finds its own (Ray places workers on its nodes).
    node_id: str = ""
    # The meshgate node of each rank, where the launcher placed the workers on meshgate's rank
    # blocks (Ray, by node labels): a worker elsewhere is refused before it registers.
    rank_nodes: tuple[str, ...] = ()

    def export_transport(self) -> None:
        """Give this worker process the launcher's transport settings (its own win)."""
        for key, value in self.transport_env:
            os.environ.setdefault(key, value)


def env_or(value: Any, env: str) -> Any:
    """``value``, else the environment variable ``env`` (empty counts as unset), else None."""
    if value is not None:
        return value
    return os.environ.get(env) or None


def required(value: Any, env: str, name: str) -> Any:
    value = env_or(value, env)
    if value is None:
        raise LauncherArgumentError(f"{name} is not set: pass {name}= or set {env}")
    return value


def claimed_settings(
    plan: ParallelPlan,
    *,
    coordinator: Optional[str],
    job_id: Optional[str],
    trust_bundle: Any,
    await_world: Any,
    register_timeout: Any,
    world_timeout: Any,
    node_id: str = "",
) -> ClaimedSettings:
    """Check the handshake's arguments and resolve the coordinator, the job and the trust
    bundle (arguments, then MESHGATE_COORDINATOR, MESHGATE_JOB, MESHGATE_TRUST_BUNDLE)."""
    if not isinstance(await_world, bool):
        raise LauncherTypeError(f"await_world must be a bool, got {bounded_repr(await_world)}")
    for name, value in (("register_timeout", register_timeout), ("world_timeout", world_timeout)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
            raise LauncherArgumentError(f"{name} must be a positive number of seconds, got {bounded_repr(value)}")
    from meshgate.client import load_trust_bundle

    coordinator = required(coordinator, "MESHGATE_COORDINATOR", "coordinator")
    job_id = required(job_id, "MESHGATE_JOB", "job_id")
    held = not_for_workers(os.environ)  # the driver's own credentials stay with it
    bundle = load_trust_bundle(required(trust_bundle, "MESHGATE_TRUST_BUNDLE", "trust_bundle"))
    return ClaimedSettings(
        plan=plan,
        coordinator=str(coordinator),
        job_id=str(job_id),
        trust_bundle_json=bundle.to_json(),
        await_world=await_world,
        register_timeout=float(register_timeout),
        world_timeout=float(world_timeout),
        transport_env=tuple((k, os.environ[k]) for k in TRANSPORT_ENV_KEYS if os.environ.get(k) and k not in held),
        node_id=str(node_id),
    )


def check_placement(
    rank_nodes: tuple[str, ...],
    *,
    rank: int,
    local_rank: int,
    node_id: str,
    framework: str,
    error: type[ClaimedTopologyError] = ClaimedTopologyError,
) -> None:
    """Where the launcher placed the workers on meshgate's rank blocks (``rank_nodes``: the
    node of each rank), a worker must run on its rank's node at its place in the block."""
    if not rank_nodes:
        return
    if not 0 <= rank < len(rank_nodes) or rank_nodes[rank] != node_id:
        wanted = rank_nodes[rank] if 0 <= rank < len(rank_nodes) else "no node"
        raise error(
            f"{framework} put rank {rank} on meshgate node {node_id!r}; the job's rank {rank} belongs to "
            f"{wanted!r}, where the launcher asked {framework} to put it"
        )
    expected = rank - rank_nodes.index(node_id)
    if local_rank != expected:
        raise error(
            f"{framework} gave rank {rank} local rank {local_rank} on node {node_id!r}; in the job's rank "
            f"block there it is local rank {expected}"
        )


def attest_claimed(
    settings: ClaimedSettings,
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    node_id: str,
    framework: str,
    error: type[ClaimedTopologyError] = ClaimedTopologyError,
) -> "VerifiedAttestation":
    """Register the rank ``framework`` gave this worker (claimed), verify and cross-check the
    attestation against what ``framework`` built, then wait for the world. Every mismatch is
    an ``error`` naming both sides."""
    from meshgate.attestation import TrustBundle
    from meshgate.client import await_world, register

    settings.export_transport()
    plan = settings.plan
    if world_size != plan.world_size:
        raise error(f"{framework} runs {world_size} workers; the plan's world_size is {plan.world_size}")
    check_placement(
        settings.rank_nodes, rank=rank, local_rank=local_rank, node_id=node_id, framework=framework, error=error
    )
    attestation = register(
        coordinator=settings.coordinator,
        job_id=settings.job_id,
        trust_bundle=TrustBundle.from_json(settings.trust_bundle_json),
        node_id=node_id,
        local_rank=local_rank,
        rank=rank,
        plan=plan,
        timeout=settings.register_timeout,
    )
    cross_check(attestation, framework, error, rank=rank, world_size=world_size, local_rank=local_rank, node_id=node_id)
    if settings.await_world:
        await_world(
            coordinator=settings.coordinator,
            job_id=settings.job_id,
            generation=attestation.generation,
            timeout=settings.world_timeout,
        )
    return attestation


def cross_check(
    attestation: "VerifiedAttestation",
    framework: str,
    error: type[Exception] = ClaimedTopologyError,
    **actual: Any,
) -> None:
    """Every field of the attestation named in ``actual`` (rank, world_size, local_rank,
    node_id, node_rank) equals what ``framework`` built; else an ``error`` naming both."""
    for name, value in actual.items():
        attested = getattr(attestation, name)
        if attested != value:
            raise error(f"attested {name} {attested!r} differs from {framework}'s {value!r} ({attestation.describe()})")
