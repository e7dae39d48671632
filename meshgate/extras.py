"""Optional dependencies, and the one line that says which extra brings them.

meshgate's core (the contract, the coordinator, the agent) needs only grpc, protobuf and
cryptography. Everything else is an extra of the ``meshgate`` distribution::

    pip install 'meshgate[torch]'      # DeviceMesh from an attestation, `meshgate demo`
    pip install 'meshgate[megatron]'   # Megatron-core process groups
    pip install 'meshgate[ray]'        # RayTrainLauncher (Ray Train's TorchTrainer)
    pip install 'meshgate[lightning]'  # LightningFabricLauncher
    pip install 'meshgate[etcd]'       # the coordinator's etcd store (HA pair)
    pip install 'meshgate[metrics]'    # Prometheus /metrics for coordinator and agent
    pip install 'meshgate[all]'        # all of the above

A feature that needs one calls :func:`require` (import it now) or :func:`check` (only
look for it, e.g. before launching processes that would import it). Both raise
:class:`MissingExtra`, an ImportError whose message is one line naming the extra; the
command-line entry points print that line instead of a traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# extra -> what it is for (pyproject.toml's [project.optional-dependencies] holds the pins)
EXTRAS: dict[str, str] = {
    "torch": "DeviceMesh from an attestation and `meshgate demo`",
    "megatron": "Megatron-core process groups from an attestation",
    "ray": "RayTrainLauncher (Ray Train's TorchTrainer)",
    "lightning": "LightningFabricLauncher",
    "etcd": "the coordinator's etcd store",
    "metrics": "Prometheus metrics (metrics_listen)",
}


def install_hint(extra: str) -> str:
    """``pip install 'meshgate[torch]'`` (quoted: shells glob the brackets)."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; known: {sorted(EXTRAS)}")
    return f"pip install 'meshgate[{extra}]'"


class MissingExtra(ImportError):
    """``feature`` needs ``module``, which comes with the extra ``extra``."""

    def __init__(self, feature: str, module: str, extra: str, detail: str = "") -> None:
        self.feature = feature
        self.module = module
        self.extra = extra
        message = f"{feature} needs {module}: {install_hint(extra)}"
        if detail and detail != f"No module named {module!r}":
            message += f" ({detail})"
        super().__init__(message, name=module)


def require(module: str, *, extra: str, feature: str) -> ModuleType:
    """Import ``module`` or raise MissingExtra naming ``extra``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(feature, module, extra, str(exc)) from exc


def check(module: str, *, extra: str, feature: str) -> None:
    """Raise MissingExtra unless ``module`` can be found; imports nothing but its parents."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing, or blocked
        found = False
    if not found:
        raise MissingExtra(feature, module, extra)
