"""The argument refusals the framework launchers share (Ray Train, Lightning Fabric).

Pure: no framework is imported here, so every refusal happens before Ray or Lightning
is touched. Each refusal reason is its own exception class; all are ValueErrors (the
type refusals are TypeErrors too), and each message names the argument and shows a
bounded repr of the value, so a 10 MB config or a huge object never floods a log.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, Optional

REPR_LIMIT = 80


def bounded_repr(value: Any, limit: int = REPR_LIMIT) -> str:
    """``repr(value)`` cut to ``limit`` characters (marked with ``...`` when cut); a repr
    that raises is named by its type instead."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the refusal
        text = f"<{type(value).__name__} with a failing repr>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class LauncherArgumentError(ValueError):
    """A launcher refused one of its arguments; the message names it."""


class LauncherTypeError(LauncherArgumentError, TypeError):
    """An argument of the wrong type (also a ValueError, like every refusal here)."""


class ResourceAmountError(LauncherArgumentError):
    """A ``resources_per_worker`` amount that is not a finite non-negative number."""


class GpuConflictError(LauncherArgumentError):
    """``use_gpu`` and the GPU amount of ``resources_per_worker`` disagree."""


class ReservedConfigKeyError(LauncherArgumentError):
    """``train_loop_config`` uses a key the launcher injects."""


class WorldSizeMismatchError(LauncherArgumentError):
    """The framework's world (devices x nodes) is not the plan's world."""


class UnsupportedPlanError(LauncherArgumentError, NotImplementedError):
    """The framework cannot express the plan (e.g. Fabric and tensor parallelism).

    Also a NotImplementedError: the seed's launchers raised that for these plans."""


def check_type(name: str, value: Any, expected: type | tuple[type, ...], what: str) -> None:
    """Refuse ``value`` unless it is an instance of ``expected`` (``what`` says it in words)."""
    if not isinstance(value, expected):
        raise LauncherTypeError(f"{name} must be {what}, got {type(value).__name__} {bounded_repr(value)}")


def check_resources(resources: Any, use_gpu: Any) -> Optional[dict[str, float]]:
    """``resources_per_worker``: None, or str -> finite non-negative number; its GPU amount
    agrees with ``use_gpu`` (a bool)."""
    check_type("use_gpu", use_gpu, bool, "a bool")
    if resources is None:
        return None
    if not isinstance(resources, Mapping):
        raise LauncherTypeError(
            f"resources_per_worker must be a dict of resource name -> amount, got "
            f"{type(resources).__name__} {bounded_repr(resources)}"
        )
    out: dict[str, float] = {}
    for name, amount in resources.items():
        if not isinstance(name, str) or not name.strip():
            raise LauncherTypeError(f"resources_per_worker keys must be non-empty strings, got {bounded_repr(name)}")
        if isinstance(amount, bool) or not isinstance(amount, numbers.Real) or not math.isfinite(amount) or amount < 0:
            raise ResourceAmountError(
                f"resources_per_worker[{bounded_repr(name, 40)}] must be a finite non-negative "
                f"number, got {bounded_repr(amount)}"
            )
        out[name] = amount
    gpus = out.get("GPU")
    if gpus is not None and gpus > 0 and not use_gpu:
        raise GpuConflictError(
            f"resources_per_worker asks for GPU={gpus} but use_gpu=False; set use_gpu=True or drop the GPU resource"
        )
    if gpus is not None and gpus == 0 and use_gpu:
        raise GpuConflictError(
            "use_gpu=True but resources_per_worker sets GPU=0; give each worker a GPU amount > 0 or set use_gpu=False"
        )
    return out


__all__ = [
    "GpuConflictError",
    "LauncherArgumentError",
    "LauncherTypeError",
    "ReservedConfigKeyError",
    "ResourceAmountError",
    "UnsupportedPlanError",
    "WorldSizeMismatchError",
    "bounded_repr",
    "check_resources",
    "check_type",
]
