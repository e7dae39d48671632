"""Events <-> JSON. Strict both ways: nothing is unpickled, and an unknown kind or a
field that does not fit is a StoreError naming where it was found."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from meshgate.coordinator import rendezvous
from meshgate.coordinator.store import StoreError

EVENT_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        rendezvous.NodeJoined,
        rendezvous.NodeAdopted,
        rendezvous.NodeStateChanged,
        rendezvous.NodeReplaced,
        rendezvous.NodeKeyed,
        rendezvous.TokenCreated,
        rendezvous.RankAssigned,
        rendezvous.MasterChosen,
        rendezvous.GenerationBumped,
        rendezvous.JobFailed,
    )
}
_FIELD_TYPES = {"str": str, "int": int, "float": (int, float), "bool": bool}


def encode(event: rendezvous.Event) -> str:
    body = dataclasses.asdict(event)
    body["kind"] = type(event).__name__
    return json.dumps(body, separators=(",", ":"), sort_keys=True)


def decode(text: str | bytes, where: str) -> rendezvous.Event:
    try:
        body = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise StoreError(f"{where}: not a JSON event ({exc})") from None
    if not isinstance(body, dict):
        raise StoreError(f"{where}: not a JSON object")
    kind = body.pop("kind", None)
    cls = EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise StoreError(f"{where}: unknown event kind {kind!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise StoreError(f"{where}: {kind} has unknown fields {unknown}")
    values: dict[str, Any] = {}
    for name, field in fields.items():
        if name not in body:
            if field.default is dataclasses.MISSING:
                raise StoreError(f"{where}: {kind} lacks field {name!r}")
            continue
        expected = _FIELD_TYPES.get(field.type if isinstance(field.type, str) else field.type.__name__)
        value = body[name]
        if expected is not None and (not isinstance(value, expected) or (expected is int and isinstance(value, bool))):
            raise StoreError(f"{where}: {kind}.{name} = {value!r} is not {field.type}")
        values[name] = value
    return cls(**values)
