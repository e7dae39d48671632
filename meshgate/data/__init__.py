"""The files that ship with meshgate: example plans, example configs, systemd units.

In the repository they stay where the docs point (``examples/*.toml``,
``deploy/systemd/*``); the wheel carries them as ``meshgate/data/examples/`` and
``meshgate/data/systemd/`` (pyproject.toml maps them), read with importlib.resources.
An editable install of a checkout reads them from the checkout.

    example_plans()            {"plan-4": <file>, "plan-8-tp-pp-hsdp": <file>, ...}
    resolve_plan("plan-4")     an example by name, else the path as given
    template("agent.toml")     the commented example config / unit file's text
"""

from __future__ import annotations

import os
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

EXAMPLES = "examples"
SYSTEMD = "systemd"
# where each kind lives in a source checkout, relative to the repository root
_CHECKOUT_DIRS = {EXAMPLES: Path("examples"), SYSTEMD: Path("deploy") / "systemd"}

COORDINATOR_CONFIG = "coordinator.toml"
AGENT_CONFIG = "agent.toml"
UNITS = ("meshgate-coordinator.service", "meshgate-agent.service")


class DataError(LookupError):
    """A bundled file or example that does not exist; the message lists what does."""


def directory(kind: str) -> Traversable:
    """The folder holding ``kind`` (EXAMPLES or SYSTEMD): in the wheel, else the checkout."""
    if kind not in _CHECKOUT_DIRS:
        raise ValueError(f"kind must be one of {sorted(_CHECKOUT_DIRS)}, got {kind!r}")
    packaged = files(__name__) / kind
    if packaged.is_dir():
        return packaged
    # Editable install: this package is <repo>/meshgate/data, the files are in the checkout.
    checkout = Path(__file__).resolve().parent.parent.parent / _CHECKOUT_DIRS[kind]
    if checkout.is_dir():
        return checkout
    raise DataError(f"meshgate's {kind} files are missing from this installation ({packaged})")


def example_plans() -> dict[str, Traversable]:
    """Example plan name (file name without .toml) -> its file, sorted by name."""
    plans = {
        entry.name[: -len(".toml")]: entry
        for entry in directory(EXAMPLES).iterdir()
        if entry.name.startswith("plan-") and entry.name.endswith(".toml")  # not job-*.toml
    }
    return dict(sorted(plans.items()))


def resolve_plan(spec: "str | os.PathLike[str]") -> tuple[str, str]:
    """A ``--plan`` argument -> (where it came from, its TOML text).

    An existing file wins; otherwise ``spec`` names an example (``plan-4`` or
    ``plan-4.toml``). Raises DataError listing the examples when it is neither.
    """
    path = Path(spec)
    if path.is_file():
        return str(path), path.read_text()
    name = path.name[: -len(".toml")] if path.name.endswith(".toml") else path.name
    plans = example_plans()
    if os.fspath(spec) in (name, f"{name}.toml") and name in plans:
        return f"example {name}", plans[name].read_text()
    raise DataError(f"no plan file {os.fspath(spec)!r} and no example of that name; examples: {', '.join(plans)}")


def load_plan(spec: "str | os.PathLike[str]"):
    """A plan file, or an example plan by name (``plan-8-tp-pp-hsdp``), as a ParallelPlan;
    a PlanError names where the plan came from."""
    from meshgate.plan import ParallelPlan, PlanError

    where, text = resolve_plan(spec)
    try:
        return ParallelPlan.from_toml_text(text)
    except PlanError as exc:
        raise PlanError(f"{where}: {exc}") from None


def template(name: str) -> str:
    """The text of a bundled config (coordinator.toml, agent.toml) or systemd unit."""
    entry = directory(SYSTEMD) / name
    if not entry.is_file():
        known = sorted(e.name for e in directory(SYSTEMD).iterdir() if not e.name.startswith("."))
        raise DataError(f"no bundled file {name!r}; bundled: {', '.join(known)}")
    return entry.read_text()
