"""A torch DeviceMesh built from a verified attestation, and cross-checked against it.

The plan lists its axes innermost (fastest-varying rank) first; DeviceMesh lists its
dimensions outermost first. So the mesh's dimensions are the plan's order reversed,
keeping the axes of size > 1 (at least one). With the default plan order that is
TorchTitan's ``[pp, dp_replicate, dp_shard, cp, tp]``. As TorchTitan does, the flattened
``dp`` (dp_replicate x dp_shard), ``dp_shard_cp`` and ``dp_cp`` dimensions are built with
``mesh[...]._flatten(name)``; reach them with ``mesh[names]._flatten(name)`` again (it
returns the existing one) or ``mesh.get_group(name)``.

Before anything is returned, every dimension is cross-checked against the plan:

* this rank's coordinate on the dimension equals the attested one;
* the dimension's process group has exactly the members ``plan.group(axis, rank)``, in
  that order, and one all_gather over the group confirms that those members are there
  (each member contributes its attested rank and its torch rank).

A mismatch raises :class:`MeshMismatchError`, which names the axis, the attested and the
actual coordinate, and both member lists. The same check is available for process groups
made by hand (:func:`verify_process_groups`) and is reused for Megatron-core's groups
(``meshgate.launchers.megatron``).

torch is imported lazily: importing this module needs only meshgate.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from meshgate.endpoints import tcp_init_method
from meshgate.extras import install_hint, require
from meshgate.plan import FLATTENED_AXES, GROUP_AXES, ParallelPlan, PlanError

if TYPE_CHECKING:  # pragma: no cover
    from meshgate.attestation import VerifiedAttestation
    from meshgate.v1.attestation_pb2 import WorkerHardware

TORCH_EXTRA = install_hint("torch")

__all__ = [
    "DeviceMismatchError",
    "MeshMismatchError",
    "check_device",
    "device_mismatch",
    "device_mesh_from",
    "flattened_dims",
    "init_process_group_from",
    "mesh_dims",
    "verify_process_groups",
]


class MeshMismatchError(RuntimeError):
    """What a framework built disagrees with the attestation.

    Raised on the ranks that see the disagreement, before the caller's first collective.
    Attributes: ``axis``, ``rank``, ``attested_coordinate``, ``actual_coordinate``,
    ``attested_members``, ``actual_members``, ``framework``.
    """

    def __init__(
        self,
        axis: str,
        *,
        rank: int,
        attested_coordinate: int | None,
        actual_coordinate: int | None,
        attested_members: Sequence[int],
        actual_members: Sequence[int],
        framework: str = "torch.distributed",
        detail: str = "",
    ) -> None:
        self.axis = axis
        self.rank = rank
        self.attested_coordinate = attested_coordinate
        self.actual_coordinate = actual_coordinate
        self.attested_members = list(attested_members)
        self.actual_members = list(actual_members)
        self.framework = framework
        self.detail = detail
        message = (
            f"rank {rank}: {framework} axis {axis!r} does not match the attestation: "
            f"attested coordinate {attested_coordinate}, actual coordinate {actual_coordinate}; "
            f"attested members {self.attested_members}, actual members {self.actual_members}"
        )
        if detail:
            message += f" ({detail})"
        super().__init__(message)

    def __reduce__(self):
        # Raised in Ray and Fabric workers and pickled back to the driver: rebuild from the
        # keyword arguments (the default cls(*args) would miss the required ones).
        return (
            _rebuild_mesh_mismatch,
            (
                type(self),
                self.axis,
                {
                    "rank": self.rank,
                    "attested_coordinate": self.attested_coordinate,
                    "actual_coordinate": self.actual_coordinate,
                    "attested_members": self.attested_members,
                    "actual_members": self.actual_members,
                    "framework": self.framework,
                    "detail": self.detail,
                },
            ),
        )


def _rebuild_mesh_mismatch(cls, axis, kwargs):
    return cls(axis, **kwargs)


def _import_torch() -> tuple[Any, Any]:
    torch = require("torch", extra="torch", feature="meshgate.launchers.mesh")
    dist = require("torch.distributed", extra="torch", feature="meshgate.launchers.mesh")
    if not dist.is_available():
        raise ImportError(f"this PyTorch build has no torch.distributed: {TORCH_EXTRA}")
    return torch, dist


# ---- the mesh's shape: pure functions of the plan ---------------------------------------


def mesh_dims(plan: ParallelPlan) -> list[tuple[str, int]]:
    """(name, size) of the DeviceMesh dimensions, outermost first.

    The plan's order reversed, keeping the axes of size > 1. A plan of one rank keeps
    ``dp_shard`` (size 1), so the mesh has at least one dimension.
    """
    dims = [(axis, plan.size(axis)) for axis in reversed(plan.order) if plan.size(axis) > 1]
    return dims or [("dp_shard", 1)]


def flattened_dims(plan: ParallelPlan) -> dict[str, tuple[str, ...]]:
    """Flattened dimension name -> the mesh dimensions it flattens (outermost first).

    A flattened axis (``dp``, ``dp_shard_cp``, ``dp_cp``) flattens those of its component
    axes that are mesh dimensions, in mesh order, as ``plan.group`` counts it; it is left
    out when none of them is a mesh dimension (as TorchTitan does).
    """
    names = [name for name, _ in mesh_dims(plan)]
    out: dict[str, tuple[str, ...]] = {}
    for flat, parts in FLATTENED_AXES.items():
        present = sorted((part for part in parts if part in names), key=names.index)
        if present:
            out[flat] = tuple(present)
    return out


# ---- torch.distributed glue ------------------------------------------------------------


def init_process_group_from(
    attestation: "VerifiedAttestation",
    master_addr: str,
    master_port: int,
    backend: str = "gloo",
    timeout_s: float | None = None,
) -> None:
    """``init_process_group`` with exactly the attested rank and world size.

    ``master_addr``/``master_port`` are what ``meshgate.client.await_world`` returns. For
    NCCL the opened GPU must be the attested one (``check_device``) before it starts.
    """
    if "nccl" in backend.lower():
        check_device(attestation)
    _, dist = _import_torch()
    kwargs: dict[str, Any] = {}
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend,
        init_method=tcp_init_method(master_addr, master_port),
        rank=attestation.rank,
        world_size=attestation.world_size,
        **kwargs,
    )


def _device_for(device_type: str) -> Any:
    torch, _ = _import_torch()
    if device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, device_type, None)
    if module is not None and hasattr(module, "current_device"):
        return torch.device(device_type, module.current_device())
    return torch.device(device_type)


def _device_for_group(group: Any) -> Any:
    """CPU for gloo (or mixed gloo) groups, else the current accelerator."""
    torch, dist = _import_torch()
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class DeviceMismatchError(RuntimeError):
    """The GPU this worker opened is not the one its attestation names."""


def _uuid(text: str) -> str:
    """NVML says "GPU-8f3c...", torch's device properties "8f3c...": compared without it."""
    return text.strip().lower().removeprefix("gpu-")


def device_mismatch(attested: "WorkerHardware | None", opened_uuid: str, opened_index: int) -> str | None:
    """Why the opened GPU is not the attested one (pure); None when it is, or when the
    attestation names no GPU (a CPU node, a node the coordinator had not heard)."""
    if attested is None or not attested.gpu_uuid:
        return None
    named = f"{attested.gpu_uuid} (PCI {attested.gpu_pci_bus_id or 'unknown'})"
    if not opened_uuid:
        return f"the attestation names GPU {named}, but this worker has no CUDA device open"
    if _uuid(opened_uuid) != _uuid(attested.gpu_uuid):
        return (
            f"this worker opened cuda:{opened_index} = GPU-{_uuid(opened_uuid)}, its attestation names {named}: "
            "open the attested GPU (torch.cuda.set_device(LOCAL_RANK) with CUDA_DEVICE_ORDER=PCI_BUS_ID, "
            "as the agent sets it) before the first collective"
        )
    return None


def check_device(attestation: "VerifiedAttestation") -> None:
    """Before the first collective: the GPU this worker opened (torch's current device) is
    the one its attestation names, else DeviceMismatchError, which stops the worker. Nothing
    to check for an attestation that names no GPU."""
    hardware = attestation.hardware  # None where the coordinator had not heard the node's
    if hardware is None or not hardware.gpu_uuid:
        return
    torch, _ = _import_torch()
    opened, index = "", -1
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        opened = str(torch.cuda.get_device_properties(index).uuid)
    why = device_mismatch(hardware, opened, index)
    if why is not None:
        raise DeviceMismatchError(f"rank {attestation.rank} (local {attestation.local_rank}): {why}")


def _check_world(attestation: "VerifiedAttestation", framework: str) -> None:
    """torch.distributed must run with the attested rank and world size, on the attested GPU."""
    check_device(attestation)
    _, dist = _import_torch()
    if not dist.is_initialized():
        raise RuntimeError(
            f"{framework}: torch.distributed is not initialized; call "
            "meshgate.launchers.mesh.init_process_group_from(attestation, master_addr, master_port) "
            "(or init_process_group with rank=attestation.rank, "
            "world_size=attestation.world_size) first"
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank != attestation.rank or world != attestation.world_size:
        raise MeshMismatchError(
            "world",
            rank=attestation.rank,
            attested_coordinate=attestation.rank,
            actual_coordinate=rank,
            attested_members=list(range(attestation.world_size)),
            actual_members=list(range(world)),
            framework=framework,
            detail=(
                f"torch.distributed runs as rank {rank} of {world}, the attestation says "
                f"rank {attestation.rank} of {attestation.world_size}"
            ),
        )


@dataclass(frozen=True)
class _GroupCheck:
    axis: str
    group: Any  # a ProcessGroup, or None when the framework has none for this rank
    coordinate: int | None  # this rank's index in the group, as the framework reports it


def _verify_groups(
    attestation: "VerifiedAttestation",
    checks: Sequence[_GroupCheck],
    *,
    framework: str,
    device: Any = None,
) -> None:
    """Check each group against ``plan.group(axis, rank)``; one all_gather per group.

    Every rank runs every all_gather before raising, so that a disagreement seen on one
    rank does not leave its peers waiting; the members of a group see the same gathered
    list, so they all raise together.
    """
    torch, dist = _import_torch()
    plan, rank = attestation.plan, attestation.rank
    errors: list[MeshMismatchError] = []
    for check in checks:
        attested_members = list(plan.group(check.axis, rank))
        # A physical axis's coordinate is the attested one; a flattened or expert axis's
        # is this rank's index in its plan group.
        attested_coordinate = attestation.coordinate.get(check.axis, attested_members.index(rank))
        in_group = check.group is not None and dist.get_rank(check.group) >= 0
        if not in_group:
            errors.append(
                MeshMismatchError(
                    check.axis,
                    rank=rank,
                    attested_coordinate=attested_coordinate,
                    actual_coordinate=check.coordinate,
                    attested_members=attested_members,
                    actual_members=[],
                    framework=framework,
                    detail="this rank is in no process group for the axis",
                )
            )
            continue
        actual_members = list(dist.get_process_group_ranks(check.group))
        target = device if device is not None else _device_for_group(check.group)
        mine = torch.tensor([rank, dist.get_rank()], dtype=torch.int64, device=target)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(check.group))]
        dist.all_gather(gathered, mine, group=check.group)
        members_attested = [int(t[0]) for t in gathered]
        members_torch = [int(t[1]) for t in gathered]
        problems = []
        if members_attested != actual_members:
            problems.append(f"the members' attestations say ranks {members_attested}")
        if members_torch != actual_members:
            problems.append(f"the all_gather reached torch ranks {members_torch}")
        if check.coordinate != attested_coordinate or actual_members != attested_members or problems:
            errors.append(
                MeshMismatchError(
                    check.axis,
                    rank=rank,
                    attested_coordinate=attested_coordinate,
                    actual_coordinate=check.coordinate,
                    attested_members=attested_members,
                    actual_members=actual_members,
                    framework=framework,
                    detail="; ".join(problems),
                )
            )
    if errors:
        first = errors[0]
        if len(errors) > 1:
            others = ", ".join(repr(e.axis) for e in errors[1:])
            first.args = (f"{first.args[0]} [also mismatched: {others}]",)
        raise first


def _ordered_axes(axes: Sequence[str]) -> list[str]:
    """Known axes in one canonical order, so every rank runs the collectives alike."""
    unknown = sorted(set(axes) - set(GROUP_AXES))
    if unknown:
        raise PlanError(f"unknown axis {unknown[0]!r}; known: {', '.join(GROUP_AXES)}")
    return [axis for axis in GROUP_AXES if axis in axes]


def verify_process_groups(
    attestation: "VerifiedAttestation",
    groups_by_axis: Mapping[str, Any],
    *,
    device: Any = None,
    framework: str = "process group",
) -> None:
    """Check hand-made process groups (axis -> ProcessGroup) against the attestation.

    A collective: every rank calls it with the same axes (the dict's order does not
    matter). For each axis the group must have exactly the members
    ``plan.group(axis, rank)`` in that order (torch orders a group by global rank), and
    this rank's group rank must be its attested coordinate. Raises MeshMismatchError.
    """
    axes = _ordered_axes(list(groups_by_axis))
    _check_world(attestation, framework)
    _, dist = _import_torch()
    checks = []
    for axis in axes:
        group = groups_by_axis[axis]
        coordinate = dist.get_rank(group) if group is not None else None
        checks.append(_GroupCheck(axis, group, coordinate if coordinate != -1 else None))
    _verify_groups(attestation, checks, framework=framework, device=device)


# ---- the DeviceMesh --------------------------------------------------------------------


def device_mesh_from(
    attestation: "VerifiedAttestation",
    device_type: str = "cpu",
    *,
    flatten: bool = True,
) -> Any:
    """Build the DeviceMesh of the attested plan with ``init_device_mesh``; cross-check it.

    Dimensions are named after the plan's axes, outermost first (the reverse of
    ``plan.order``), keeping the axes of size > 1: ``mesh.get_coordinate()`` is the
    attested coordinate on those axes. With ``flatten`` (the default), the flattened
    ``dp``/``dp_shard_cp``/``dp_cp`` dimensions of :func:`flattened_dims` are created as
    TorchTitan does, for FSDP/HSDP. torch.distributed must already run with the attested
    rank and world size (see :func:`init_process_group_from`). A collective.

    Raises MeshMismatchError when the mesh disagrees with the attestation.
    """
    _check_world(attestation, "DeviceMesh")
    from torch.distributed.device_mesh import init_device_mesh

    plan = attestation.plan
    dims = mesh_dims(plan)
    names = tuple(name for name, _ in dims)
    mesh = init_device_mesh(device_type, tuple(size for _, size in dims), mesh_dim_names=names)
    flat_meshes = {}
    if flatten:
        for flat, parts in flattened_dims(plan).items():
            flat_meshes[flat] = mesh[parts]._flatten(flat)

    coordinate = mesh.get_coordinate()
    checks: list[_GroupCheck] = []
    for index, name in enumerate(names):
        checks.append(_GroupCheck(name, mesh.get_group(index), None if coordinate is None else coordinate[index]))
    for flat, flat_mesh in flat_meshes.items():
        flat_coordinate = flat_mesh.get_coordinate()
        checks.append(
            _GroupCheck(
                flat,
                flat_mesh.get_group(),
                None if flat_coordinate is None else flat_coordinate[0],
            )
        )
    _verify_groups(attestation, checks, framework="DeviceMesh", device=_device_for(device_type))
    return mesh
