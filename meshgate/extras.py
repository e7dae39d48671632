"""Optional dependencies, and the one line that says which extra brings them.

meshgate's core (the contract, the coordinator, the agent) needs only grpc, protobuf and
cryptography. Everything else is an extra of the ``meshgate`` distribution, installed
with the wheel (no package index has meshgate yet)::

    pip install 'meshgate-0.2.0-py3-none-any.whl[torch]'      # DeviceMesh, `meshgate demo`
    pip install 'meshgate-0.2.0-py3-none-any.whl[megatron]'   # Megatron-core process groups
    pip install 'meshgate-0.2.0-py3-none-any.whl[ray]'        # RayTrainLauncher (Ray Train)
    pip install 'meshgate-0.2.0-py3-none-any.whl[lightning]'  # LightningFabricLauncher
    pip install 'meshgate-0.2.0-py3-none-any.whl[etcd]'       # the coordinator's etcd store
    pip install 'meshgate-0.2.0-py3-none-any.whl[metrics]'    # Prometheus /metrics
    pip install 'meshgate-0.2.0-py3-none-any.whl[gpu]'        # the agent's GPU inventory (NVML)
    pip install 'meshgate-0.2.0-py3-none-any.whl[all]'        # all of the above

A missing extra's message names the packages it brings, as the installed meshgate pins
them (:func:`install_hint`), then the wheel's form: ``pip install
'prometheus-client<1,>=0.20' (meshgate's [metrics] extra; or, where its wheel is: pip
install 'meshgate-0.2.0-py3-none-any.whl[metrics]')``; the first works without the wheel.

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
    "gpu": "the agent's GPU inventory through NVML (slots, GPU UUIDs, NVLink domains)",
}


def extra_requirements(extra: str) -> list[str]:
    """What ``extra`` brings, as the installed meshgate's metadata pins it
    (``["prometheus-client<1,>=0.20"]``); empty where meshgate's metadata is not found."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        declared = requires("meshgate") or []
    except PackageNotFoundError:
        return []
    marker = f'extra == "{extra}"'
    return [req.split(";")[0].strip() for req in declared if marker in req.replace("'", '"')]


def install_hint(extra: str) -> str:
    """A command that installs ``extra``'s packages wherever meshgate came from: meshgate is
    installed from its wheel (no package index has it yet), so ``pip install 'meshgate[x]'``
    would find nothing; the extra's own requirements, as pinned, always exist
    (``pip install 'prometheus-client<1,>=0.20' (meshgate's [metrics] extra; or, where its
    wheel is: pip install 'meshgate-0.2.0-py3-none-any.whl[metrics]')``). Quoted: shells
    read < and brackets."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; known: {sorted(EXTRAS)}")
    from meshgate import __version__

    wheel = f"pip install 'meshgate-{__version__}-py3-none-any.whl[{extra}]'"
    requirements = extra_requirements(extra)
    if not requirements:  # no metadata (a bare checkout): the wheel's extra
        return f"{wheel} (meshgate's [{extra}] extra, from its wheel)"
    packages = "pip install " + " ".join(f"'{req}'" for req in requirements)
    return f"{packages} (meshgate's [{extra}] extra; or, where its wheel is: {wheel})"


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
