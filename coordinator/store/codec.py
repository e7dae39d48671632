"""Events <-> JSON. Strict both ways: nothing is unpickled, and an unknown kind or a
field that does not fit is a StoreError naming where it was found.

A field is written and read by its annotation in the event's dataclass: str, int,
float and bool as themselves, an enum as its value, a tuple as a JSON array (of
arrays, for a tuple of tuples). Records written before enums and tuples were carried
as themselves are still read (LEGACY_FORMS): the chain covers the stored text, so an
old record is only ever decoded differently, never rewritten."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import typing
from typing import Any, Callable

from meshgate import __version__
from meshgate.coordinator import jobs, rendezvous
from meshgate.coordinator.store import StoreError

EVENT_TYPES: dict[str, type] = {cls.__name__: cls for cls in (*rendezvous.EVENT_TYPES, *jobs.CLUSTER_EVENT_TYPES)}

_SCALARS: dict[type, type | tuple[type, ...]] = {str: str, int: int, float: (int, float), bool: bool}


def _comma_joined(text: str) -> tuple[str, ...]:
    return tuple(filter(None, text.split(",")))


def _json_object(text: str) -> tuple[tuple[str, str], ...]:
    body = json.loads(text)
    if not isinstance(body, dict):
        raise ValueError("not a JSON object")
    return tuple(sorted(body.items()))


# (kind, field) -> how the old codec stored it, as text: what that text means now.
LEGACY_FORMS: dict[tuple[str, str], Callable[[str], Any]] = {
    ("JobAllocated", "nodes"): _comma_joined,
    ("JobAllocated", "spares"): _comma_joined,
    ("ClusterNodeJoined", "labels"): _json_object,
}


def _to_json(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [_to_json(item) for item in value]
    return value


def _from_json(value: Any, hint: Any) -> Any:
    """``value`` read as ``hint``; ValueError (or TypeError) when it does not fit."""
    if hint in _SCALARS:
        if not isinstance(value, _SCALARS[hint]) or (hint is not bool and isinstance(value, bool)):
            raise TypeError(f"not {hint.__name__}")
        return value
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        if isinstance(value, (list, dict)):
            raise TypeError(f"not a {hint.__name__}")
        return hint(value)  # ValueError names the value when it is no member
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, list):
            raise TypeError("not a list")
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_from_json(item, args[0]) for item in value)
        if len(value) != len(args):
            raise ValueError(f"not {len(args)} items")
        return tuple(_from_json(item, arg) for item, arg in zip(value, args))
    raise TypeError(f"the codec cannot read a field annotated {hint!r}")


def _readable(hint: Any) -> bool:
    if hint in _SCALARS or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        return True
    return typing.get_origin(hint) is tuple and all(arg is Ellipsis or _readable(arg) for arg in typing.get_args(hint))


def _field_hints(cls: type) -> dict[str, Any]:
    """The annotations the codec reads ``cls`` by; a TypeError at import for one it could not."""
    hints = typing.get_type_hints(cls)
    unreadable = [f.name for f in dataclasses.fields(cls) if not _readable(hints[f.name])]
    if unreadable:
        raise TypeError(f"the codec cannot carry {cls.__name__} fields {unreadable}")
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


_HINTS: dict[type, dict[str, Any]] = {cls: _field_hints(cls) for cls in EVENT_TYPES.values()}


# One encoder for every record (json.dumps with these options builds a new one per call),
# and each kind's field names looked up once: a batch writes one record per worker.
_JSON = json.JSONEncoder(separators=(",", ":"), sort_keys=True)
_NAMES: dict[type, tuple[str, ...]] = {cls: tuple(hints) for cls, hints in _HINTS.items()}


def encode(event: rendezvous.Event) -> str:
    body = {name: _to_json(getattr(event, name)) for name in _NAMES[type(event)]}
    body["kind"] = type(event).__name__
    return _JSON.encode(body)


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
        if not isinstance(kind, str):
            raise StoreError(f"{where}: unknown event kind {kind!r}")
        raise newer_state(where, f"event kind {kind!r} is unknown to this release")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise newer_state(where, f"{kind} has fields {unknown} unknown to this release")
    values: dict[str, Any] = {}
    for name, hint in _HINTS[cls].items():
        if name not in body:
            if fields[name].default is dataclasses.MISSING:
                raise StoreError(f"{where}: {kind} lacks field {name!r}")
            continue
        value = body[name]
        legacy = LEGACY_FORMS.get((kind, name))
        try:
            values[name] = legacy(value) if legacy is not None and isinstance(value, str) else _from_json(value, hint)
        except (TypeError, ValueError) as exc:
            raise StoreError(f"{where}: {kind}.{name} = {value!r} is not {fields[name].type} ({exc})") from None
    return cls(**values)


# ---- the log's records: a hash chain, pinned to one job and plan --------------------------
#
# Each stored record is ``<prev> <sum> <event JSON>``: ``prev`` is the previous record's
# ``sum`` (64 zeros before the first), and ``sum`` = sha256(prev, seq, event JSON). A
# flipped bit, an edited digit, a record missing, moved or replayed from another log
# breaks the chain at the record where it happened. Integrity, not authenticity: anyone
# who can write the file can recompute the chain (the signing keys are what they cannot
# forge). Record 1 is the job's pin: its id and the digest of its plan.

RECORD_SCHEMA = 2
GENESIS = "0" * 64

# What every refusal of a newer release's state says (assembly.py gives no --reset-state
# advice for it, however the refusal was wrapped on its way there).
NEWER_STATE = "written by a newer meshgate release"


class NewerStateError(StoreError):
    """State written by a newer release than this one (a rollback past a change of the state
    format): refused before serving, left as found, and never a reason to reset it (the
    chain verified: it is intact, only newer). The way back is the release that wrote it."""


def newer_state(where: str, what: str) -> NewerStateError:
    return NewerStateError(
        f"{where}: {what}: {NEWER_STATE} than this one (release {__version__}, which reads state schema "
        f"{RECORD_SCHEMA} and the event kinds of its own release and earlier ones); left as found. The way "
        "back: start the release that wrote it again, or restore the state and keys directories copied "
        "before the upgrade (docs/operating.md, Upgrading). Not --reset-state: that sets every job "
        "aside and rotates the signing key"
    )


@dataclasses.dataclass(frozen=True)
class JobPinned:
    """The first record of every log: which job, and which plan, the log is for."""

    job_id: str
    plan_digest: str  # hex sha256 over the plan, slots per node and node order
    plan: str  # the same, readable, for the refusal message


def job_pin(config: rendezvous.RendezvousConfig) -> JobPinned:
    """What pins ``config`` (an edited [plan] or [job] slots/order changes the digest)."""
    shape = {
        "plan": config.plan.to_dict(),
        "slots_per_node": config.slots_per_node,
        "node_order": list(config.node_order),
    }
    text = json.dumps(shape, separators=(",", ":"), sort_keys=True)
    return JobPinned(config.job_id, hashlib.sha256(text.encode()).hexdigest(), text)


def cluster_pin() -> JobPinned:
    """What pins the cluster's own log (jobs mode): its id and schema, no plan."""
    text = "meshgate cluster log, schema 1"
    return JobPinned(jobs.CLUSTER_LOG_ID, hashlib.sha256(text.encode()).hexdigest(), text)


def chain_sum(prev: str, seq: int, body: str) -> str:
    return hashlib.sha256(f"{prev}\n{seq}\n{body}".encode()).hexdigest()


def encode_record(seq: int, prev: str, item: "rendezvous.Event | JobPinned") -> tuple[str, str]:
    """The stored text of record ``seq`` after ``prev``, and its chain sum."""
    if isinstance(item, JobPinned):
        body = _JSON.encode({**dataclasses.asdict(item), "kind": "JobPinned"})
    else:
        body = encode(item)
    total = chain_sum(prev, seq, body)
    return f"{prev} {total} {body}", total


@dataclasses.dataclass(frozen=True)
class VerifiedLog:
    pin: JobPinned
    events: tuple  # the rendezvous events after the pin, in order
    sums: tuple[str, ...]  # sums[i] is record i+1's chain sum

    @property
    def head(self) -> str:
        return self.sums[-1]


class LogIntegrityError(StoreError):
    """The log's chain does not verify, or it is not this job's or this plan's."""


class OldLogFormatError(StoreError):
    """A log written before records were chained; this version cannot read it safely."""


def verify_records(rows, where: str, expected: JobPinned, name_of=None) -> VerifiedLog:
    """Check every (seq, text) row, in order, against the chain and the pin.
    ``name_of(seq)`` names a record in errors (default: "<where>, record <seq>")."""
    prev, sums, events, pin = GENESIS, [], [], None
    for position, (seq, text) in enumerate(rows, start=1):
        at = name_of(seq) if name_of is not None else f"{where}, record {seq}"
        if seq != position:
            raise LogIntegrityError(f"{where}: record {position} is missing (next is {seq})")
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        if position == 1 and text.startswith("{"):
            raise OldLogFormatError(
                f"{at}: written by an older meshgate (unchained schema 1 records); this version cannot verify it"
            )
        parts = text.split(" ", 2)
        if len(parts) != 3:
            raise LogIntegrityError(f"{at}: not a chained record")
        got_prev, got_sum, body = parts
        if got_prev != prev:
            raise LogIntegrityError(f"{at}: chain broken (its predecessor's hash does not match)")
        if chain_sum(prev, seq, body) != got_sum:
            raise LogIntegrityError(f"{at}: checksum does not match its contents (edited or corrupted)")
        if position == 1:
            pin = _decode_pin(body, at)
            _check_pin(pin, expected, where)
        else:
            events.append(decode(body, at))
        sums.append(got_sum)
        prev = got_sum
    if pin is None:
        raise LogIntegrityError(f"{where}: holds no records, not even the job's pin")
    return VerifiedLog(pin, tuple(events), tuple(sums))


def _decode_pin(body: str, where: str) -> JobPinned:
    try:
        values = json.loads(body)
        if values.pop("kind") != "JobPinned":
            raise ValueError("not a JobPinned record")
        return JobPinned(**values)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise LogIntegrityError(f"{where}: the first record is not the job's pin ({exc})") from None


def _check_pin(pin: JobPinned, expected: JobPinned, where: str) -> None:
    if pin.job_id != expected.job_id:
        raise LogIntegrityError(f"{where} belongs to job {pin.job_id!r}, not {expected.job_id!r}")
    if pin.plan_digest != expected.plan_digest:
        raise LogIntegrityError(
            f"{where}: job {pin.job_id!r} was pinned to plan {pin.plan_digest[:16]} "
            f"({pin.plan}); the config now gives plan {expected.plan_digest[:16]} ({expected.plan}). "
            "A changed plan is a new job: give it a new [job] id"
        )
