"""Signed attestations: Ed25519 (via `cryptography`) over the exact payload bytes.

The one crypto module of meshgate. The coordinator signs; workers, agents and the
offline `meshgate verify` check, in this order:

1. key id and signature against the trust bundle (an attestation from an agent's batch
   carries the batch: one signature covers it, and the payload must be its entry);
2. expiry;
3. job, generation and nonce against what the caller expects;
4. plan digest against the plan;
5. the coordinate recomputed from plan and rank.

Each refusal is its own exception type, so callers and metrics can tell them apart.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Iterable, Mapping

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from meshgate.plan import ParallelPlan, PlanError
from meshgate.v1 import attestation_pb2

# A signature over a batch covers this prefix + the serialized AttestationBatch. Its 0x00
# first byte never starts a serialized Attestation (there is no field number 0), so a
# batch signature cannot pass for a single attestation's, nor the reverse.
BATCH_CONTEXT = b"\x00meshgate.v1.AttestationBatch\x00"

# ---- errors --------------------------------------------------------------------------


class AttestationError(Exception):
    """An attestation that must not be trusted. ``reason`` is a short stable label."""

    reason = "invalid"


class BadSignature(AttestationError):
    reason = "bad_signature"


class UnknownKeyId(AttestationError):
    reason = "unknown_key_id"


class Expired(AttestationError):
    reason = "expired"


class WrongJob(AttestationError):
    reason = "wrong_job"


class WrongGeneration(AttestationError):
    reason = "wrong_generation"


class WrongNonce(AttestationError):
    reason = "wrong_nonce"


class WrongPlanDigest(AttestationError):
    reason = "wrong_plan_digest"


class CoordinateMismatch(AttestationError):
    reason = "coordinate_mismatch"


class MalformedAttestation(AttestationError):
    reason = "malformed"


class KeyFileError(Exception):
    """A key file that is missing, unreadable, malformed or too open."""


# ---- time ------------------------------------------------------------------------------


def _to_seconds(ts) -> float:
    return ts.seconds + ts.nanos / 1e9


def _set_timestamp(ts, seconds: float) -> None:
    # floor (not int()) keeps nanos >= 0 before the epoch; rounding can reach 1e9: carry it.
    whole = math.floor(seconds)
    nanos = int(round((seconds - whole) * 1e9))
    if nanos >= 1_000_000_000:
        whole, nanos = whole + 1, nanos - 1_000_000_000
    ts.seconds = int(whole)
    ts.nanos = nanos


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat(timespec="seconds")


# ---- keys ------------------------------------------------------------------------------


def secret_hash(secret: str | bytes) -> str:
    """What the coordinator keeps of a join token or node credential: its sha256 (hex)."""
    return hashlib.sha256(secret.encode() if isinstance(secret, str) else secret).hexdigest()


_HEARTBEAT_LABEL = b"meshgate heartbeat key v1"


def heartbeat_key(key: "SigningKey") -> bytes:
    """A symmetric key derived from a signing key (Ed25519 signatures are deterministic):
    only a holder of the private key can compute it, and it survives restarts and
    failovers that keep the key, with nothing stored."""
    return hashlib.sha256(key.sign(_HEARTBEAT_LABEL)).digest()


def heartbeat_secret(hb_key: bytes, job_id: str, generation: int, worker_id: str) -> bytes:
    """The secret a worker's heartbeats carry: HMAC-SHA256 over (job, generation,
    worker), handed to that worker with its attestation and to no one else."""
    message = b"\0".join((job_id.encode(), str(generation).encode(), worker_id.encode()))
    return hmac.new(hb_key, message, hashlib.sha256).digest()


def key_id_for(public_raw: bytes) -> str:
    """A key id derived from the public key, so it can never disagree with the key."""
    return "ed25519:" + hashlib.sha256(public_raw).hexdigest()[:16]


def _public_raw(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


class SigningKey:
    """The coordinator's Ed25519 private key with its key id."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self.public_raw = _public_raw(private.public_key())
        self.key_id = key_id_for(self.public_raw)

    @classmethod
    def generate(cls) -> "SigningKey":
        return cls(Ed25519PrivateKey.generate())

    def sign(self, payload: bytes) -> bytes:
        return self._private.sign(payload)

    def public_key(self) -> Ed25519PublicKey:
        return self._private.public_key()

    def save(self, path: str | os.PathLike) -> None:
        """Write PEM (PKCS#8) with mode 0600, created that way (never chmod'ed after)."""
        pem = self._private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(pem)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SigningKey":
        """Load a PEM key; refuse a file readable or writable by group or others."""
        from meshgate.secret_files import SecretFileError, check_private

        path = os.fspath(path)
        try:
            check_private(path, "signing key")
        except SecretFileError as exc:
            raise KeyFileError(str(exc)) from None
        with open(path, "rb") as handle:
            data = handle.read()
        try:
            private = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            raise KeyFileError(f"signing key {path}: not a PEM private key ({exc})") from exc
        if not isinstance(private, Ed25519PrivateKey):
            raise KeyFileError(f"signing key {path}: not an Ed25519 key")
        return cls(private)


# ---- trust bundle ----------------------------------------------------------------------


@dataclass(frozen=True)
class TrustedKey:
    key_id: str
    public: Ed25519PublicKey
    not_after: float | None  # seconds since the epoch; None: no end


class TrustBundle:
    """The public keys a verifier trusts, by key id."""

    def __init__(self, keys: Iterable[TrustedKey], job_id: str = "", version: int = 0) -> None:
        self.job_id = job_id
        self.version = version
        self.keys: dict[str, TrustedKey] = {}
        for key in keys:
            derived = key_id_for(_public_raw(key.public))
            if key.key_id != derived:
                raise BadSignature(f"trust bundle: key id {key.key_id!r} does not match its key ({derived})")
            self.keys[key.key_id] = key

    @classmethod
    def of(cls, *keys: SigningKey, job_id: str = "", version: int = 0) -> "TrustBundle":
        return cls((TrustedKey(k.key_id, k.public_key(), None) for k in keys), job_id=job_id, version=version)

    def to_proto(self) -> attestation_pb2.TrustBundle:
        message = attestation_pb2.TrustBundle(job_id=self.job_id, version=self.version)
        for key in self.keys.values():
            entry = message.keys.add(key_id=key.key_id, ed25519=_public_raw(key.public))
            if key.not_after is not None:
                _set_timestamp(entry.not_after, key.not_after)
        return message

    @classmethod
    def from_proto(cls, message: attestation_pb2.TrustBundle) -> "TrustBundle":
        keys = []
        for entry in message.keys:
            try:
                public = Ed25519PublicKey.from_public_bytes(entry.ed25519)
            except ValueError as exc:
                raise MalformedAttestation(f"trust bundle: key {entry.key_id!r} is not a 32-byte Ed25519 key") from exc
            not_after = _to_seconds(entry.not_after) if entry.HasField("not_after") else None
            keys.append(TrustedKey(entry.key_id, public, not_after))
        return cls(keys, job_id=message.job_id, version=message.version)

    def to_json(self) -> str:
        return json_format.MessageToJson(self.to_proto(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "TrustBundle":
        try:
            message = json_format.Parse(text, attestation_pb2.TrustBundle())
        except json_format.ParseError as exc:
            raise MalformedAttestation(f"trust bundle: not valid JSON for TrustBundle: {exc}")
        return cls.from_proto(message)

    def save(self, path: str | os.PathLike) -> None:
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(self.to_json())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TrustBundle":
        with open(path, encoding="utf-8") as handle:
            return cls.from_json(handle.read())


# ---- sign ------------------------------------------------------------------------------


def sign_attestation(attestation: attestation_pb2.Attestation, key: SigningKey) -> attestation_pb2.SignedAttestation:
    """Stamp the key id into the payload and sign its exact bytes."""
    attestation.key_id = key.key_id
    payload = attestation.SerializeToString(deterministic=True)
    return attestation_pb2.SignedAttestation(payload=payload, signature=key.sign(payload), key_id=key.key_id)


# ---- verify ----------------------------------------------------------------------------


@dataclass(frozen=True)
class VerifiedAttestation:
    """A verified attestation: what a worker builds its mesh from."""

    job_id: str
    generation: int
    plan: ParallelPlan
    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    node_id: str
    worker_id: str
    coordinate: Mapping[str, int]
    nonce: bytes
    issued_at: float
    expires_at: float
    key_id: str
    signed: attestation_pb2.SignedAttestation
    # Not signed, not part of the statement: the secret this worker's heartbeats carry
    # (RegisterResponse.heartbeat_secret), kept here so meshgate.heartbeat(att) has it.
    heartbeat_secret: bytes = field(default=b"", repr=False, compare=False)
    # Signed: the hardware it was placed on (its GPU, its node's machine-id, NVLink domain,
    # rail NICs); None where the coordinator had not heard the node's (a CPU node has one,
    # with no GPU). launchers/mesh.py checks the opened GPU against it.
    hardware: attestation_pb2.WorkerHardware | None = None

    def as_dict(self) -> dict:
        """Plain data (JSON-safe), for logs and for code written against the seed's
        ``WorkerTopologyAttestation.as_dict()``: its keys ``rank``, ``world_size`` and
        ``coordinate`` (every physical axis -> index) come first, then what only a signed
        attestation knows. The nonce and the signature stay out: use ``signed``."""
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "coordinate": dict(self.coordinate),
            "job_id": self.job_id,
            "generation": self.generation,
            "local_rank": self.local_rank,
            "node_rank": self.node_rank,
            "node_id": self.node_id,
            "worker_id": self.worker_id,
            "plan": self.plan.to_dict(),
            "plan_digest": self.plan.digest().hex(),
            "key_id": self.key_id,
            "issued_at": self.issued_at,
            "expires_at": self.expires_at,
            "hardware": (
                json_format.MessageToDict(self.hardware, preserving_proto_field_name=True)
                if self.hardware is not None
                else None
            ),
        }

    def describe(self) -> str:
        coords = " ".join(f"{a}={self.coordinate[a]}" for a in self.plan.order)
        return (
            f"job {self.job_id} gen {self.generation} rank {self.rank}/{self.world_size} "
            f"node {self.node_id}#{self.node_rank} [{coords}] key {self.key_id} "
            f"expires {_iso(self.expires_at)}"
            + (f" gpu {self.hardware.gpu_uuid}" if self.hardware is not None and self.hardware.gpu_uuid else "")
        )


_REQUIRED = object()


def verify_attestation(
    signed: attestation_pb2.SignedAttestation,
    bundle: TrustBundle,
    *,
    job_id: str | None,
    nonce: bytes | None = _REQUIRED,  # type: ignore[assignment]
    generation: int | None = None,
    plan: ParallelPlan | None = None,
    now: float | None = None,
) -> VerifiedAttestation:
    """Verify ``signed`` and return its contents, or raise an AttestationError subclass.

    ``job_id``, ``nonce``, ``generation`` and ``plan`` are what the caller expects; pass
    None to skip one knowingly (the offline debugger does). ``nonce`` has no default:
    a worker must bind its own.
    """
    if nonce is _REQUIRED:
        raise TypeError("verify_attestation() needs nonce= (or nonce=None to skip knowingly)")
    now = time.time() if now is None else now

    # 1. key id and signature (of the payload, or of the batch the payload is an entry of)
    trusted = bundle.keys.get(signed.key_id)
    if trusted is None:
        known = ", ".join(sorted(bundle.keys)) or "none"
        raise UnknownKeyId(f"key id {signed.key_id!r} is not in the trust bundle (known: {known})")
    try:
        trusted.public.verify(signed.signature, BATCH_CONTEXT + signed.batch if signed.batch else signed.payload)
    except InvalidSignature:
        raise BadSignature(
            f"signature does not verify under key {signed.key_id} (tampered payload or wrong key)"
        ) from None
    if signed.batch or signed.batch_index:
        _check_batch_entry(signed)
    attestation = attestation_pb2.Attestation()
    try:
        attestation.ParseFromString(signed.payload)
    except DecodeError as exc:
        raise MalformedAttestation(f"payload is not an Attestation: {exc}") from exc
    if attestation.key_id != signed.key_id:
        raise BadSignature(f"payload key id {attestation.key_id!r} differs from envelope key id {signed.key_id!r}")

    # 2. expiry, of the attestation and of the key that signed it
    expires_at = _to_seconds(attestation.expires_at)
    if now >= expires_at:
        raise Expired(f"attestation expired at {_iso(expires_at)} (now {_iso(now)})")
    if trusted.not_after is not None and now >= trusted.not_after:
        raise Expired(f"key {signed.key_id} was retired at {_iso(trusted.not_after)} (now {_iso(now)})")

    # 3. job, generation, nonce
    if job_id is not None and attestation.job_id != job_id:
        raise WrongJob(f"attestation is for job {attestation.job_id!r}, expected {job_id!r}")
    if generation is not None and attestation.generation != generation:
        raise WrongGeneration(f"attestation is of generation {attestation.generation}, expected {generation}")
    if nonce is not None and attestation.nonce != nonce:
        raise WrongNonce(
            f"attestation carries nonce {attestation.nonce.hex()[:16]}..., not this worker's "
            f"{nonce.hex()[:16]}... (replayed?)"
        )

    # 4. plan digest
    try:
        attested_plan = ParallelPlan.from_proto(attestation.plan)
    except PlanError as exc:
        raise MalformedAttestation(f"attested plan is invalid: {exc}") from exc
    if attestation.plan_digest != attested_plan.digest():
        raise WrongPlanDigest(
            f"plan_digest {attestation.plan_digest.hex()[:16]}... does not match the attested "
            f"plan ({attested_plan.digest().hex()[:16]}...)"
        )
    if plan is not None and plan.digest() != attested_plan.digest():
        raise WrongPlanDigest(
            f"attested plan {attested_plan.describe()} (digest "
            f"{attested_plan.digest().hex()[:16]}...) differs from the expected plan "
            f"{plan.describe()} (digest {plan.digest().hex()[:16]}...)"
        )

    # 5. coordinate
    if attestation.world_size != attested_plan.world_size:
        raise CoordinateMismatch(
            f"world_size {attestation.world_size} differs from the plan's {attested_plan.world_size}"
        )
    if attestation.rank >= attested_plan.world_size:
        raise CoordinateMismatch(f"rank {attestation.rank} out of range [0, {attested_plan.world_size})")
    expected = attested_plan.coordinate(attestation.rank)
    if dict(attestation.coordinate) != expected:
        raise CoordinateMismatch(
            f"rank {attestation.rank}: attested coordinate {dict(sorted(attestation.coordinate.items()))} "
            f"differs from the plan's {dict(sorted(expected.items()))}"
        )

    return VerifiedAttestation(
        job_id=attestation.job_id,
        generation=attestation.generation,
        plan=attested_plan,
        rank=attestation.rank,
        world_size=attestation.world_size,
        local_rank=attestation.local_rank,
        node_rank=attestation.node_rank,
        node_id=attestation.node_id,
        worker_id=attestation.worker_id,
        coordinate=expected,
        nonce=attestation.nonce,
        issued_at=_to_seconds(attestation.issued_at),
        expires_at=expires_at,
        key_id=attestation.key_id,
        signed=signed,
        hardware=attestation.hardware if attestation.HasField("hardware") else None,
    )


def _check_batch_entry(signed: attestation_pb2.SignedAttestation) -> None:
    """Step 1 for a batch signed once: the payload must be the entry it claims to be."""
    if not signed.batch:
        raise MalformedAttestation(f"batch_index {signed.batch_index} without a batch")
    batch = attestation_pb2.AttestationBatch()
    try:
        batch.ParseFromString(signed.batch)
    except DecodeError as exc:
        raise MalformedAttestation(f"batch is not an AttestationBatch: {exc}") from exc
    if signed.batch_index >= len(batch.entries):
        raise MalformedAttestation(
            f"batch_index {signed.batch_index} out of range: the batch has {len(batch.entries)} entries"
        )
    if batch.entries[signed.batch_index] != signed.payload:
        raise BadSignature(f"payload is not entry {signed.batch_index} of the signed batch")


def hardware_field(hardware: attestation_pb2.WorkerHardware | None) -> bytes:
    """Field 32 (WorkerHardware) of an Attestation, serialized; b"" for None."""
    if hardware is None:
        return b""
    return attestation_pb2.Attestation(hardware=hardware).SerializeToString(deterministic=True)


def build_attestation(
    *,
    job_id: str,
    generation: int,
    plan: ParallelPlan,
    rank: int,
    local_rank: int,
    node_rank: int,
    node_id: str,
    worker_id: str,
    nonce: bytes,
    issued_at: float,
    ttl_s: float,
    hardware: attestation_pb2.WorkerHardware | None = None,
) -> attestation_pb2.Attestation:
    """The unsigned Attestation for one worker; the coordinate comes from the plan."""
    message = attestation_pb2.Attestation(
        job_id=job_id,
        generation=generation,
        plan=plan._proto,  # copied into the message; the cached one is never changed
        plan_digest=plan.digest(),
        rank=rank,
        world_size=plan.world_size,
        local_rank=local_rank,
        node_rank=node_rank,
        node_id=node_id,
        worker_id=worker_id,
        coordinate=plan.coordinate(rank),
        nonce=nonce,
    )
    _set_timestamp(message.issued_at, issued_at)
    _set_timestamp(message.expires_at, issued_at + ttl_s)
    if hardware is not None:
        message.hardware.CopyFrom(hardware)
    return message


class AttestationTemplate:
    """Signs the attestations of one (job, generation, plan, key): the fields every worker
    shares (job, generation, plan, plan digest: fields 1-4; key id: field 15) are serialized
    once, and each Register serializes only its own fields (5-14). Protobuf's encoding is a
    concatenation of fields in field-number order, so the payload is byte for byte what
    ``sign_attestation(build_attestation(...))`` signs (tests/test_attestation.py checks
    it over random inputs): verifiers see no difference."""

    def __init__(self, *, job_id: str, generation: int, plan: ParallelPlan, key: SigningKey) -> None:
        self.job_id = job_id
        self.generation = generation
        self.plan = plan
        self.key = key
        self._head = attestation_pb2.Attestation(
            job_id=job_id, generation=generation, plan=plan._proto, plan_digest=plan.digest()
        ).SerializeToString(deterministic=True)
        self._tail = attestation_pb2.Attestation(key_id=key.key_id).SerializeToString(deterministic=True)
        self._world_size = plan.world_size

    def matches(self, job_id: str, generation: int, plan: ParallelPlan, key: SigningKey) -> bool:
        return generation == self.generation and key is self.key and plan is self.plan and job_id == self.job_id

    def payload(
        self,
        *,
        rank: int,
        local_rank: int,
        node_rank: int,
        node_id: str,
        worker_id: str,
        nonce: bytes,
        issued_at: float,
        ttl_s: float,
        hardware: bytes = b"",
    ) -> bytes:
        """One worker's serialized Attestation: the bytes a signature covers. ``hardware``:
        its field 32 already serialized (``hardware_field``), last in field order."""
        own = attestation_pb2.Attestation(
            rank=rank,
            world_size=self._world_size,
            local_rank=local_rank,
            node_rank=node_rank,
            node_id=node_id,
            worker_id=worker_id,
            coordinate=self.plan.coordinate(rank),
            nonce=nonce,
        )
        _set_timestamp(own.issued_at, issued_at)
        _set_timestamp(own.expires_at, issued_at + ttl_s)
        return self._head + own.SerializeToString(deterministic=True) + self._tail + hardware

    def sign(self, **fields) -> attestation_pb2.SignedAttestation:
        """One worker's attestation, signed alone (``fields``: those of ``payload``)."""
        payload = self.payload(**fields)
        return attestation_pb2.SignedAttestation(
            payload=payload, signature=self.key.sign(payload), key_id=self.key.key_id
        )

    def sign_batch(self, payloads: list[bytes]) -> tuple[bytes, list[attestation_pb2.SignedAttestation]]:
        """Many workers' attestations under one signature: the serialized AttestationBatch,
        and per payload its SignedAttestation without the batch bytes (they travel once;
        ``with_batch`` attaches them before a worker verifies)."""
        batch = attestation_pb2.AttestationBatch(entries=payloads).SerializeToString(deterministic=True)
        signature = self.key.sign(BATCH_CONTEXT + batch)
        return batch, [
            attestation_pb2.SignedAttestation(
                payload=payload, signature=signature, key_id=self.key.key_id, batch_index=index
            )
            for index, payload in enumerate(payloads)
        ]


def with_batch(signed: attestation_pb2.SignedAttestation, batch: bytes) -> attestation_pb2.SignedAttestation:
    """A worker's attestation from a batch signed once (RegisterBatchResponse.batch):
    what the agent hands the worker, complete for verify_attestation."""
    whole = attestation_pb2.SignedAttestation()
    whole.CopyFrom(signed)
    if batch:  # a coordinator that signed each attestation alone sends no batch
        whole.batch = batch
    return whole


# ---- signed trust bundles (rotation) --------------------------------------------------


def sign_trust_bundle(bundle: TrustBundle, signers: Iterable[SigningKey]) -> attestation_pb2.SignedTrustBundle:
    """Endorse the bundle's exact bytes with each signer (the keys it keeps trusting)."""
    payload = bundle.to_proto().SerializeToString(deterministic=True)
    signed = attestation_pb2.SignedTrustBundle(payload=payload)
    for key in signers:
        signed.endorsements.add(key_id=key.key_id, signature=key.sign(payload))
    return signed


def accept_trust_bundle(
    signed: attestation_pb2.SignedTrustBundle, current: TrustBundle, *, now: float | None = None
) -> TrustBundle:
    """The next bundle, if a key of ``current`` (still valid) endorses it; else refuse.

    This is how agents and workers refresh after a rotation without trusting the
    channel: the new key is accepted because the old one vouches for it.
    """
    now = time.time() if now is None else now
    endorsed_by = None
    for endorsement in signed.endorsements:
        trusted = current.keys.get(endorsement.key_id)
        if trusted is None or (trusted.not_after is not None and now >= trusted.not_after):
            continue
        try:
            trusted.public.verify(endorsement.signature, signed.payload)
        except InvalidSignature:
            raise BadSignature(
                f"trust bundle endorsement by {endorsement.key_id} does not verify (tampered bundle?)"
            ) from None
        endorsed_by = endorsement.key_id
        break
    if endorsed_by is None:
        named = ", ".join(e.key_id for e in signed.endorsements) or "none"
        raise UnknownKeyId(
            f"trust bundle is not endorsed by any key trusted now (endorsed by: {named}; "
            f"trusted: {', '.join(sorted(current.keys)) or 'none'})"
        )
    message = attestation_pb2.TrustBundle()
    try:
        message.ParseFromString(signed.payload)
    except DecodeError as exc:
        raise MalformedAttestation(f"trust bundle payload is not a TrustBundle: {exc}") from exc
    bundle = TrustBundle.from_proto(message)
    if current.job_id and bundle.job_id != current.job_id:
        raise WrongJob(f"trust bundle is for job {bundle.job_id!r}, expected {current.job_id!r}")
    if bundle.version < current.version:
        raise MalformedAttestation(
            f"trust bundle version {bundle.version} is older than the held version {current.version}"
        )
    return bundle


# ---- worker vouches ------------------------------------------------------------------


class VouchRefused(AttestationError):
    reason = "bad_vouch"


def sign_vouch(
    key: SigningKey,
    *,
    job_id: str,
    node_id: str,
    generation: int,
    local_rank: int,
    expires_at: float,
    vouch_id: bytes | None = None,
    rank: int | None = None,
) -> attestation_pb2.WorkerVouch:
    """The agent's statement that it launched this worker, signed with the node key.
    ``rank``: the one rank a claimed-mode worker may claim with it (None: assigned mode)."""
    claims = attestation_pb2.VouchClaims(
        job_id=job_id,
        node_id=node_id,
        generation=generation,
        local_rank=local_rank,
        vouch_id=vouch_id or os.urandom(16),
        rank=rank,
    )
    _set_timestamp(claims.expires_at, expires_at)
    payload = claims.SerializeToString(deterministic=True)
    return attestation_pb2.WorkerVouch(payload=payload, signature=key.sign(payload))


def verify_vouch(
    vouch: attestation_pb2.WorkerVouch,
    node_public_raw: bytes,
    *,
    job_id: str,
    node_id: str,
    generation: int,
    local_rank: int,
    now: float,
    rank: int | None = None,
) -> attestation_pb2.VouchClaims:
    """Check a vouch against the node key registered at Join and what the Register says.
    ``rank`` is the claimed rank (None: assigned mode); the vouch must name exactly it."""
    if not vouch.payload:
        raise VouchRefused(f"no vouch: node {node_id!r}'s agent must vouch for its workers")
    try:
        Ed25519PublicKey.from_public_bytes(node_public_raw).verify(vouch.signature, vouch.payload)
    except (InvalidSignature, ValueError):
        raise VouchRefused(
            f"vouch signature does not verify under node {node_id!r}'s key (a vouch of another node, or tampered)"
        ) from None
    return vouch_claims(
        vouch, job_id=job_id, node_id=node_id, generation=generation, local_rank=local_rank, now=now, rank=rank
    )


def vouch_claims(
    vouch: attestation_pb2.WorkerVouch,
    *,
    job_id: str,
    node_id: str,
    generation: int,
    local_rank: int,
    now: float,
    rank: int | None = None,
) -> attestation_pb2.VouchClaims:
    """A vouch's claims, held to what the Register says (job, node, generation, local
    rank, claimed rank) and to its expiry; its signature is NOT checked here. Only for a
    vouch whose node already speaks for it otherwise: one its own agent forwards over the
    agent's authenticated channel (SECURITY.md, "Agent vouching"). Else verify_vouch."""
    if not vouch.payload:
        raise VouchRefused(f"no vouch: node {node_id!r}'s agent must vouch for its workers")
    claims = attestation_pb2.VouchClaims()
    try:
        claims.ParseFromString(vouch.payload)
    except DecodeError as exc:
        raise VouchRefused(f"vouch payload is not VouchClaims: {exc}") from exc
    if (claims.job_id, claims.node_id, claims.generation, claims.local_rank) != (
        job_id,
        node_id,
        generation,
        local_rank,
    ):
        expected = {"job_id": job_id, "node_id": node_id, "generation": generation, "local_rank": local_rank}
        name = next(name for name, value in expected.items() if getattr(claims, name) != value)
        raise VouchRefused(f"vouch is for {name} {getattr(claims, name)!r}, but the Register says {expected[name]!r}")
    vouched_rank = claims.rank if claims.HasField("rank") else None
    if vouched_rank != rank:
        what = "no claimed rank (assigned mode)"
        raise VouchRefused(
            f"vouch is for {what if vouched_rank is None else f'claimed rank {vouched_rank}'}, "
            f"but the Register {'claims no rank' if rank is None else f'claims rank {rank}'}"
        )
    if now >= _to_seconds(claims.expires_at):
        raise VouchRefused(f"vouch expired at {_iso(_to_seconds(claims.expires_at))}")
    return claims
