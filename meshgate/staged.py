"""``[future]``: config keys staged for a later release (docs/operating.md, "Upgrading").

A config written for the next release can be put in place while this one still runs: its
new keys go under ``[future.<section>]`` (``[future.agent]`` in agent.toml, ``[future.cluster]``
or ``[future.server]`` ... in coordinator.toml). A release applies the staged keys it knows
as if they were in ``[<section>]`` (and says to move them there), and warns of the ones it
does not know, never refusing them: they are for a later release. A key both in
``[<section>]`` and staged is refused: which one counts would depend on the release.

Agents of every earlier release read only ``[agent]`` and so ignore ``[future.agent]``;
coordinators before this release refuse any section they do not know, ``[future]`` too."""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, MutableMapping

from meshgate import __version__

FUTURE = "future"

log = logging.getLogger("meshgate")


def staged(
    document: Mapping[str, Any],
    section: str,
    known: Callable[[str], bool],
    error: Callable[[str], Exception],
    warn: Callable[[str], None] = log.warning,
) -> dict[str, Any]:
    """``[section]`` of ``document`` with the keys of ``[future.section]`` this release
    knows (``known(key)``) merged in; each staged key said in one line (``warn``)."""
    table = _mapping(document.get(section, {}), f"[{section}]", error)
    future = _mapping(document.get(FUTURE, {}), f"[{FUTURE}]", error)
    merged: MutableMapping[str, Any] = dict(table)
    for key, value in _mapping(future.get(section, {}), f"[{FUTURE}.{section}]", error).items():
        if not known(key):
            warn(f"[{FUTURE}.{section}] {key}: not a key of release {__version__}; kept for a later release, ignored")
        elif key in table:
            raise error(f"[{FUTURE}.{section}] {key} is set in [{section}] too: keep one")
        else:
            merged[key] = value
            warn(f"[{FUTURE}.{section}] {key}: release {__version__} knows it and applies it; move it into [{section}]")
    return dict(merged)


def unstaged(document: Mapping[str, Any], sections: set[str], warn: Callable[[str], None] = log.warning) -> None:
    """Warn of the ``[future.X]`` tables whose X is not among the ``sections`` this release
    stages keys for."""
    future = document.get(FUTURE, {})
    for name in sorted(set(future) - sections) if isinstance(future, Mapping) else ():
        warn(f"[{FUTURE}.{name}]: release {__version__} stages no keys for it; kept for a later release, ignored")


def _mapping(value: Any, where: str, error: Callable[[str], Exception]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise error(f"{where} must be a table, got {type(value).__name__}")
    return value


__all__ = ["FUTURE", "staged", "unstaged"]
