"""ParallelPlan: the job's mesh layout, its one axis order, and rank <-> coordinate.

Convention (one for all of meshgate): ``order`` lists the five physical axes
INNERMOST (fastest-varying rank) FIRST, the way Megatron-core spells its order
string. The default ``tp, cp, dp_shard, dp_replicate, pp`` keeps TP groups
contiguous (inside a node), equals Megatron's ``tp-cp-ep-dp-pp`` and TorchTitan's
DeviceMesh ``[pp, dp_replicate, dp_shard, cp, tp]`` (DeviceMesh lists the
outermost dimension first; launchers/mesh.py reverses at that edge).

Everything here is a pure function of the plan: no I/O except ``from_toml``.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import os
import sys
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterable, Mapping, Sequence

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PHYSICAL_AXES: tuple[str, ...] = ("dp_replicate", "dp_shard", "tp", "pp", "cp")
EXPERT_AXES: tuple[str, ...] = ("ep", "etp")
COUNT_FIELDS: tuple[str, ...] = ("microbatches", "gradient_accumulation_steps")
SIZE_FIELDS: tuple[str, ...] = PHYSICAL_AXES + EXPERT_AXES + COUNT_FIELDS

DEFAULT_ORDER: tuple[str, ...] = ("tp", "cp", "dp_shard", "dp_replicate", "pp")
# The order of the seed project: consistent with its own DeviceMesh, wrong for Megatron.
SEED_ORDER: tuple[str, ...] = ("cp", "pp", "tp", "dp_shard", "dp_replicate")

# Flattened groups, listed outermost first for DEFAULT_ORDER (member i of a group has
# flattened index i, counted with the plan's own order: its innermost axis fastest).
FLATTENED_AXES: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
# Expert axes: etp (expert tensor), ep (expert), edp (expert data), pp.
EXPERT_GROUP_AXES: tuple[str, ...] = ("etp", "ep", "edp")
GROUP_AXES: tuple[str, ...] = PHYSICAL_AXES + tuple(FLATTENED_AXES) + EXPERT_GROUP_AXES

MAX_WORLD_SIZE = 1 << 24  # 16M ranks: far beyond any job, well inside uint32.
_UINT32_MAX = (1 << 32) - 1  # every size field is a uint32 on the wire (plan.proto).


class PlanError(ValueError):
    """An invalid plan or an invalid question about a plan. The message names the field."""


def exact_positive_int(name: str, value: Any) -> int:
    """Return ``value`` as an int if it is an exact integer >= 1; refuse bools and floats."""
    if type(value) is int and value >= 1:  # the common case, without the ABC check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise PlanError(f"{name} must be an exact positive integer, got {value!r} ({type(value).__name__})")
    as_int = int(value)
    if as_int < 1:
        raise PlanError(f"{name} must be >= 1, got {as_int}")
    return as_int


def parse_order(order: str | Iterable[str]) -> tuple[str, ...]:
    """Accept ``"tp-cp-dp_shard-dp_replicate-pp"`` or a sequence; innermost first."""
    if isinstance(order, str):
        names = tuple(part.strip() for part in order.split("-") if part.strip())
    else:
        try:
            names = tuple(order)
        except TypeError:
            raise PlanError(f"order must be a string or a sequence of axis names, got {order!r}") from None
    if any(not isinstance(n, str) for n in names):
        raise PlanError(f"order must list axis names, got {names!r}")
    if sorted(names) != sorted(PHYSICAL_AXES):
        raise PlanError(
            f"order must be a permutation of {', '.join(PHYSICAL_AXES)} (innermost first), got {list(names)!r}"
        )
    return names


def compress_ranks(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 3, 8, 10, 11] -> "0-3,8,10-11"."""
    out: list[str] = []
    ordered = sorted(ranks)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def _mixed_radix(sizes: Sequence[int]) -> tuple[int, ...]:
    strides, stride = [], 1
    for size in sizes:
        strides.append(stride)
        stride *= size
    return tuple(strides)


@dataclass(frozen=True)
class ParallelPlan:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    microbatches: int = 1
    gradient_accumulation_steps: int = 1
    order: tuple[str, ...] = DEFAULT_ORDER

    def __post_init__(self) -> None:
        for name in SIZE_FIELDS:
            value = exact_positive_int(name, getattr(self, name))
            if value > _UINT32_MAX:
                raise PlanError(f"{name} = {value} exceeds the uint32 maximum {_UINT32_MAX}")
            object.__setattr__(self, name, value)
        object.__setattr__(self, "order", parse_order(self.order))
        world = math.prod(getattr(self, a) for a in PHYSICAL_AXES)
        if world > MAX_WORLD_SIZE:
            raise PlanError(f"world_size {world} exceeds the maximum {MAX_WORLD_SIZE}")
        expert_block = self.etp * self.ep * self.pp
        if world % expert_block:
            raise PlanError(
                f"expert layout: world_size {world} is not divisible by etp*ep*pp = "
                f"{self.etp}*{self.ep}*{self.pp} = {expert_block} (Megatron's expert rule)"
            )
        if self.ep > 1 or self.etp > 1:
            positions = sorted(self.order.index(a) for a in ("dp_shard", "dp_replicate"))
            if positions[1] - positions[0] != 1:
                raise PlanError(
                    f"expert parallelism (ep={self.ep}, etp={self.etp}) needs dp_shard and "
                    f"dp_replicate adjacent in order, got {'-'.join(self.order)}"
                )

    # ---- construction ----------------------------------------------------------------

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "ParallelPlan":
        """Build from a dict such as a TOML ``[plan]`` table; unknown keys are refused."""
        if not isinstance(values, Mapping):
            raise PlanError(f"plan must be a table, got {type(values).__name__}")
        unknown = sorted(set(values) - set(SIZE_FIELDS) - {"order"})
        if unknown:
            raise PlanError(f"unknown plan field(s) {', '.join(unknown)}; known: {', '.join(SIZE_FIELDS)}, order")
        return cls(**dict(values))

    @classmethod
    def from_toml(cls, path: "str | os.PathLike[str]") -> "ParallelPlan":
        """Load a TOML file: its ``[plan]`` table, or its top-level keys."""
        path = os.fspath(path)
        with open(path, "rb") as handle:
            data = handle.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PlanError(f"{path}: invalid TOML: not UTF-8 ({exc})") from exc
        try:
            return cls.from_toml_text(text)
        except PlanError as exc:
            raise PlanError(f"{path}: {exc}") from exc

    @classmethod
    def from_toml_text(cls, text: str) -> "ParallelPlan":
        try:
            document = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise PlanError(f"invalid TOML: {exc}") from exc
        return cls.from_mapping(document.get("plan", document))

    @classmethod
    def from_proto(cls, message: Any) -> "ParallelPlan":
        """A plan as meshgate itself writes one (attestations, Status): every field set, a
        missing size refused. A client's plan is read with ``from_wire``."""
        values = {name: getattr(message, name) for name in SIZE_FIELDS}
        return cls(**values, order=tuple(message.order))

    @classmethod
    def from_wire(cls, message: Any) -> "ParallelPlan":
        """A plan as a client submits one (SubmitJob), with a plan file's defaults: an unset
        (0) size means 1 and an empty order the default order. A message with every field
        set is the same plan as ``from_proto`` reads, with the same digest."""
        values: dict[str, Any] = {name: getattr(message, name) for name in SIZE_FIELDS if getattr(message, name)}
        if message.order:
            values["order"] = tuple(message.order)
        return cls(**values)

    def to_proto(self) -> Any:
        """A fresh message (callers may change it)."""
        message = type(self._proto)()
        message.CopyFrom(self._proto)
        return message

    @cached_property
    def _proto(self) -> Any:
        from meshgate.v1 import plan_pb2

        return plan_pb2.ParallelPlan(**{name: getattr(self, name) for name in SIZE_FIELDS}, order=list(self.order))

    def canonical_bytes(self) -> bytes:
        return self._proto.SerializeToString(deterministic=True)  # read only: no copy needed

    def digest(self) -> bytes:
        """sha256 of the canonical protobuf encoding; every attestation carries it."""
        return self._digest

    @cached_property
    def _digest(self) -> bytes:
        return hashlib.sha256(self.canonical_bytes()).digest()

    def to_toml(self) -> str:
        """The plan as a plan file (a ``[plan]`` table) that ``from_toml`` reads back equal."""
        lines = ["[plan]"] + [f"{name} = {getattr(self, name)}" for name in SIZE_FIELDS]
        lines.append("order = [" + ", ".join(f'"{axis}"' for axis in self.order) + "]")
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: getattr(self, name) for name in SIZE_FIELDS}
        out["order"] = list(self.order)
        return out

    # ---- shape -------------------------------------------------------------------------

    @cached_property
    def world_size(self) -> int:
        return math.prod(getattr(self, a) for a in PHYSICAL_AXES)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def edp(self) -> int:
        """Expert data-parallel size: world / (etp * ep * pp)."""
        return self.world_size // (self.etp * self.ep * self.pp)

    def size(self, axis: str) -> int:
        if axis in PHYSICAL_AXES or axis in EXPERT_AXES:
            return getattr(self, axis)
        if axis in FLATTENED_AXES:
            return math.prod(getattr(self, a) for a in FLATTENED_AXES[axis])
        if axis == "edp":
            return self.edp
        raise PlanError(f"unknown axis {axis!r}; known: {', '.join(GROUP_AXES)}")

    @cached_property
    def _strides(self) -> dict[str, int]:
        sizes = [getattr(self, a) for a in self.order]
        return dict(zip(self.order, _mixed_radix(sizes)))

    @cached_property
    def _expert_layout(self) -> tuple[tuple[str, int], ...]:
        """Megatron's expert rank generator: tp->etp, cp folded away, ep just inside dp."""
        layout: list[tuple[str, int]] = []
        for axis in self.order:
            if axis == "tp":
                layout.append(("etp", self.etp))
            elif axis == "pp":
                layout.append(("pp", self.pp))
            elif axis in ("dp_shard", "dp_replicate") and not any(name == "ep" for name, _ in layout):
                layout += [("ep", self.ep), ("edp", self.edp)]
        return tuple(layout)

    def _check_rank(self, rank: Any) -> int:
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
            raise PlanError(f"rank must be an integer, got {rank!r}")
        if not 0 <= int(rank) < self.world_size:
            raise PlanError(f"rank {rank} out of range [0, {self.world_size})")
        return int(rank)

    # ---- rank <-> coordinate -----------------------------------------------------------

    def coordinate(self, rank: int) -> dict[str, int]:
        """Physical axis -> index, for all five physical axes."""
        rank = self._check_rank(rank)
        return {a: (rank // self._strides[a]) % getattr(self, a) for a in PHYSICAL_AXES}

    def rank(self, coordinate: Mapping[str, int]) -> int:
        missing = [a for a in PHYSICAL_AXES if a not in coordinate]
        extra = sorted(set(coordinate) - set(PHYSICAL_AXES))
        if missing or extra:
            raise PlanError(
                f"coordinate needs exactly the axes {', '.join(PHYSICAL_AXES)}; missing {missing}, unknown {extra}"
            )
        total = 0
        for axis in PHYSICAL_AXES:
            index = coordinate[axis]
            if isinstance(index, bool) or not isinstance(index, numbers.Integral):
                raise PlanError(f"coordinate[{axis!r}] must be an integer, got {index!r}")
            if not 0 <= index < getattr(self, axis):
                raise PlanError(f"coordinate[{axis!r}] = {index} out of range [0, {getattr(self, axis)})")
            total += int(index) * self._strides[axis]
        return total

    # ---- groups ------------------------------------------------------------------------

    def group(self, axis: str, rank: int) -> tuple[int, ...]:
        """The ranks that share every coordinate with ``rank`` except ``axis``.

        Member i has index i on the axis (for flattened axes, the flattened index with
        the plan's innermost axis fastest), which is the order DeviceMesh and Megatron use.
        """
        rank = self._check_rank(rank)
        if axis in PHYSICAL_AXES:
            axes: tuple[str, ...] = (axis,)
            strides = [self._strides[axis]]
            sizes = [getattr(self, axis)]
        elif axis in FLATTENED_AXES:
            # Outermost first as this plan's order has them (the order DeviceMesh and
            # Megatron flatten in); for the default order this is FLATTENED_AXES's listing.
            axes = tuple(sorted(FLATTENED_AXES[axis], key=self.order.index, reverse=True))
            strides = [self._strides[a] for a in axes]
            sizes = [getattr(self, a) for a in axes]
        elif axis in EXPERT_GROUP_AXES:
            layout = self._expert_layout
            names = [n for n, _ in layout]
            all_strides = _mixed_radix([s for _, s in layout])
            position = names.index(axis)
            strides = [all_strides[position]]
            sizes = [layout[position][1]]
        else:
            raise PlanError(f"unknown axis {axis!r}; known: {', '.join(GROUP_AXES)}")
        base = rank
        for stride, size in zip(strides, sizes):
            base -= ((rank // stride) % size) * stride
        members = [base]
        # Innermost listed axis varies fastest: expand from the last axis to the first.
        for stride, size in reversed(list(zip(strides, sizes))):
            members = [m + i * stride for m in members for i in range(size)]
        return tuple(sorted(members, key=lambda r: self._flat_index(r, strides, sizes)))

    @staticmethod
    def _flat_index(rank: int, strides: Sequence[int], sizes: Sequence[int]) -> int:
        index = 0
        for stride, size in zip(strides, sizes):
            index = index * size + (rank // stride) % size
        return index

    def groups(self, axis: str) -> list[tuple[int, ...]]:
        """All groups of ``axis``, partitioning the world, ordered by their first member."""
        seen: set[int] = set()
        out: list[tuple[int, ...]] = []
        for rank in range(self.world_size):
            if rank in seen:
                continue
            members = self.group(axis, rank)
            seen.update(members)
            out.append(members)
        return out

    def straddling_groups(self, axis: str, slots_per_node: int) -> list[tuple[int, ...]]:
        """Groups of ``axis`` whose members span more than one node of ``slots_per_node``."""
        slots = exact_positive_int("slots_per_node", slots_per_node)
        return [g for g in self.groups(axis) if len({r // slots for r in g}) > 1]

    def megatron_order(self) -> str:
        """Megatron's order string (innermost first), or PlanError if it cannot say it."""
        positions = sorted(self.order.index(a) for a in ("dp_shard", "dp_replicate"))
        if positions[1] - positions[0] != 1 or self.order.index("dp_shard") > self.order.index("dp_replicate"):
            raise PlanError(
                "Megatron-core models data parallelism as one 'dp' axis (dp_shard inside "
                "dp_replicate); order "
                f"{'-'.join(self.order)} does not keep dp_shard directly inside dp_replicate"
            )
        names: list[str] = []
        for axis in self.order:
            if axis == "dp_shard":
                names += ["ep", "dp"]
            elif axis != "dp_replicate":
                names.append(axis)
        return "-".join(names)

    def describe(self) -> str:
        sizes = ", ".join(f"{a}={getattr(self, a)}" for a in self.order)
        extra = f", ep={self.ep}, etp={self.etp}" if self.ep > 1 or self.etp > 1 else ""
        return f"world {self.world_size}: {sizes} (innermost first){extra}"


# The plan file (``ParallelPlan.to_toml()``) where the node agent writes the plan of the job
# whose workers it starts: one plan per job, never rebuilt by hand in the job's scripts.
PLAN_FILE_ENV = "MESHGATE_PLAN_FILE"


def current_plan() -> ParallelPlan:
    """The plan of the job this process is a worker of, as the node agent wrote it for its
    workers (the file named in MESHGATE_PLAN_FILE). The Fabric and Ray launchers take it when
    given no plan."""
    path = os.environ.get(PLAN_FILE_ENV)
    if not path:
        raise PlanError(
            f"{PLAN_FILE_ENV} is not set: meshgate.current_plan() reads the plan of the job this process "
            "runs in, from the file the node agent writes for the workers it starts; elsewhere pass the "
            "plan (ParallelPlan(...), or ParallelPlan.from_toml(path))"
        )
    try:
        return ParallelPlan.from_toml(path)
    except OSError as exc:
        raise PlanError(f"{path} ({PLAN_FILE_ENV}): {exc.strerror}") from None
    except PlanError as exc:
        raise PlanError(f"{exc} ({PLAN_FILE_ENV})") from None
