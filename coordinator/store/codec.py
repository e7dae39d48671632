"""Events <-> JSON. Strict both ways: nothing is unpickled, and an unknown kind or a
field that does not fit is a StoreError naming where it was found."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from meshgate.coordinator import jobs, rendezvous
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
        rendezvous.MasterOffered,
        rendezvous.GenerationBumped,
        rendezvous.JobFailed,
        rendezvous.WorkerSucceeded,
        # the cluster's own log (coordinator/jobs.py)
        jobs.ClusterNodeJoined,
        jobs.JobSubmitted,
        jobs.JobAllocated,
        jobs.JobEnded,
        jobs.JobSummarized,
        jobs.JobLogPruned,
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
        body = json.dumps({**dataclasses.asdict(item), "kind": "JobPinned"}, separators=(",", ":"), sort_keys=True)
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
                f"{at}: written by an older meshgate (unchained schema 1 records); "
                "this version cannot verify it"
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
