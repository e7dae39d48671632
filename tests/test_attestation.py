"""Pure unit tests of meshgate.attestation: signing, each verifier refusal, keys, trust bundles."""

from __future__ import annotations

import hashlib
import json
import os
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from meshgate.attestation import (
    AttestationError,
    AttestationTemplate,
    BadSignature,
    CoordinateMismatch,
    Expired,
    KeyFileError,
    MalformedAttestation,
    SigningKey,
    TrustBundle,
    TrustedKey,
    UnknownKeyId,
    VerifiedAttestation,
    WrongGeneration,
    WrongJob,
    WrongNonce,
    WrongPlanDigest,
    BATCH_CONTEXT,
    build_attestation,
    hardware_field,
    key_id_for,
    sign_attestation,
    verify_attestation,
    with_batch,
)
from meshgate.plan import ParallelPlan
from meshgate.v1 import attestation_pb2

T0 = 1_700_000_000.0  # issued-at of every attestation here
TTL = 600.0
NOW = T0 + 60.0  # inside the validity window
JOB = "llama-70b"
GEN = 3
NONCE = bytes(range(32))
PLAN = ParallelPlan(dp_shard=2, tp=2, pp=2)  # world 8
RANK = 5


@pytest.fixture(scope="module")
def key_a() -> SigningKey:
    return SigningKey.generate()


@pytest.fixture(scope="module")
def key_b() -> SigningKey:
    return SigningKey.generate()


@pytest.fixture
def bundle(key_a) -> TrustBundle:
    return TrustBundle.of(key_a, job_id=JOB)


def attest(rank: int = RANK, plan: ParallelPlan = PLAN, **overrides) -> attestation_pb2.Attestation:
    fields = dict(
        job_id=JOB,
        generation=GEN,
        plan=plan,
        rank=rank,
        local_rank=rank % 4,
        node_rank=rank // 4,
        node_id=f"node-{rank // 4}",
        worker_id=f"w{rank}",
        nonce=NONCE,
        issued_at=T0,
        ttl_s=TTL,
    )
    fields.update(overrides)
    return build_attestation(**fields)


def signed_by(key: SigningKey, **overrides) -> attestation_pb2.SignedAttestation:
    return sign_attestation(attest(**overrides), key)


def resign(signed, key: SigningKey, mutate) -> attestation_pb2.SignedAttestation:
    """Parse the payload, change it, and sign it again properly (a lying coordinator)."""
    message = attestation_pb2.Attestation.FromString(signed.payload)
    mutate(message)
    return sign_attestation(message, key)


def verify(signed, bundle, **expect):
    kwargs = dict(job_id=JOB, nonce=NONCE, generation=GEN, plan=PLAN, now=NOW)
    kwargs.update(expect)
    return verify_attestation(signed, bundle, **kwargs)


# ---- the positive path ---------------------------------------------------------------------


@pytest.mark.parametrize("rank", range(PLAN.world_size))
def test_verifies_and_returns_the_contents(key_a, bundle, rank):
    signed = signed_by(key_a, rank=rank)
    verified = verify(signed, bundle)
    assert isinstance(verified, VerifiedAttestation)
    assert verified.job_id == JOB and verified.generation == GEN
    assert verified.plan == PLAN and verified.plan.digest() == PLAN.digest()
    assert verified.rank == rank and verified.world_size == 8
    assert verified.local_rank == rank % 4 and verified.node_rank == rank // 4
    assert verified.node_id == f"node-{rank // 4}" and verified.worker_id == f"w{rank}"
    assert dict(verified.coordinate) == PLAN.coordinate(rank)
    assert verified.nonce == NONCE
    assert verified.issued_at == T0 and verified.expires_at == T0 + TTL
    assert verified.key_id == key_a.key_id == signed.key_id
    assert verified.signed is signed
    text = verified.describe()
    assert JOB in text and f"rank {rank}/8" in text and key_a.key_id in text
    assert "2023-11-14T22:23:20+00:00" in text  # expires-at, ISO UTC


def test_payload_is_exact_signed_bytes_and_carries_the_key_id(key_a):
    message = attest()
    signed = sign_attestation(message, key_a)
    assert message.key_id == key_a.key_id
    assert signed.payload == message.SerializeToString(deterministic=True)
    key_a.public_key().verify(signed.signature, signed.payload)  # raw Ed25519, no re-encoding
    parsed = attestation_pb2.Attestation.FromString(signed.payload)
    assert parsed.key_id == signed.key_id == key_a.key_id
    assert parsed.plan_digest == PLAN.digest()
    assert dict(parsed.coordinate) == PLAN.coordinate(RANK)
    assert parsed.world_size == PLAN.world_size


def test_signed_attestation_survives_the_wire(key_a, bundle):
    signed = signed_by(key_a)
    again = attestation_pb2.SignedAttestation.FromString(signed.SerializeToString())
    assert verify(again, bundle).rank == RANK


def test_none_skips_a_check_knowingly(key_a, bundle):
    signed = signed_by(key_a, job_id="other", generation=9, nonce=b"x")
    verified = verify_attestation(signed, bundle, job_id=None, nonce=None, generation=None, plan=None, now=NOW)
    assert verified.job_id == "other" and verified.generation == 9 and verified.nonce == b"x"


def test_now_defaults_to_the_clock(key_a, bundle):
    import time

    signed = signed_by(key_a, issued_at=time.time(), ttl_s=60)
    assert verify_attestation(signed, bundle, job_id=JOB, nonce=NONCE).rank == RANK
    old = signed_by(key_a, issued_at=time.time() - 120, ttl_s=60)
    with pytest.raises(Expired):
        verify_attestation(old, bundle, job_id=JOB, nonce=NONCE)


def test_nonce_is_required(key_a, bundle):
    signed = signed_by(key_a)
    with pytest.raises(TypeError, match="nonce="):
        verify_attestation(signed, bundle, job_id=JOB, now=NOW)
    with pytest.raises(TypeError, match="nonce="):
        verify_attestation(signed, bundle, job_id=JOB, generation=GEN, plan=PLAN, now=NOW)


def test_rotation_keeps_old_keys_trusted(key_a, key_b):
    bundle = TrustBundle(
        [TrustedKey(key_a.key_id, key_a.public_key(), T0 + 3600), TrustedKey(key_b.key_id, key_b.public_key(), None)]
    )
    assert verify(signed_by(key_a), bundle).key_id == key_a.key_id
    assert verify(signed_by(key_b), bundle).key_id == key_b.key_id


# ---- one test per refusal ------------------------------------------------------------------


@pytest.mark.parametrize("where", [0, 1, "middle", -1])
def test_tampered_payload(key_a, bundle, where):
    signed = signed_by(key_a)
    payload = bytearray(signed.payload)
    index = len(payload) // 2 if where == "middle" else where
    payload[index] ^= 0x01
    signed.payload = bytes(payload)
    with pytest.raises(BadSignature, match=f"signature does not verify under key {key_a.key_id}"):
        verify(signed, bundle)


def test_tampered_signature(key_a, bundle):
    signed = signed_by(key_a)
    signed.signature = bytes([signed.signature[0] ^ 0x80]) + signed.signature[1:]
    with pytest.raises(BadSignature, match=key_a.key_id):
        verify(signed, bundle)
    signed.signature = b""
    with pytest.raises(BadSignature, match=key_a.key_id):
        verify(signed, bundle)


def test_wrong_key_under_a_trusted_key_id(key_a, key_b, bundle):
    # Signed by B, but the payload and the envelope claim A's key id.
    message = attest()
    message.key_id = key_a.key_id
    payload = message.SerializeToString(deterministic=True)
    signed = attestation_pb2.SignedAttestation(payload=payload, signature=key_b.sign(payload), key_id=key_a.key_id)
    with pytest.raises(BadSignature, match=f"under key {key_a.key_id} .*wrong key"):
        verify(signed, bundle)
    # Re-signed by B the normal way, then the envelope relabelled as A.
    signed = signed_by(key_b)
    signed.key_id = key_a.key_id
    with pytest.raises(BadSignature, match=f"under key {key_a.key_id}"):
        verify(signed, bundle)


def test_payload_key_id_differs_from_envelope(key_a, key_b, bundle):
    message = attest()
    message.key_id = key_b.key_id  # the payload names B, yet A signed it
    payload = message.SerializeToString(deterministic=True)
    signed = attestation_pb2.SignedAttestation(payload=payload, signature=key_a.sign(payload), key_id=key_a.key_id)
    with pytest.raises(BadSignature) as info:
        verify(signed, bundle)
    assert key_b.key_id in str(info.value) and key_a.key_id in str(info.value)
    assert "payload key id" in str(info.value)


def test_unknown_key_id(key_a, key_b, bundle):
    signed = signed_by(key_b)
    with pytest.raises(UnknownKeyId) as info:
        verify(signed, bundle)
    assert f"key id {key_b.key_id!r} is not in the trust bundle" in str(info.value)
    assert key_a.key_id in str(info.value)  # says what is known
    with pytest.raises(UnknownKeyId, match=r"known: none"):
        verify(signed, TrustBundle([]))


@pytest.mark.parametrize("now", [T0 + TTL, T0 + TTL + 0.001, T0 + 10 * TTL])
def test_expired(key_a, bundle, now):
    signed = signed_by(key_a)
    with pytest.raises(Expired) as info:
        verify(signed, bundle, now=now)
    assert "attestation expired at 2023-11-14T22:23:20+00:00" in str(info.value)
    assert verify(signed, bundle, now=T0 + TTL - 0.001).rank == RANK  # just inside


def test_key_retired(key_a):
    retired = TrustBundle([TrustedKey(key_a.key_id, key_a.public_key(), NOW - 10)])
    signed = signed_by(key_a)
    with pytest.raises(Expired) as info:
        verify(signed, retired)
    assert f"key {key_a.key_id} was retired at" in str(info.value)
    live = TrustBundle([TrustedKey(key_a.key_id, key_a.public_key(), NOW + 10)])
    assert verify(signed, live).rank == RANK


def test_wrong_job(key_a, bundle):
    signed = signed_by(key_a)
    with pytest.raises(WrongJob, match=f"attestation is for job '{JOB}', expected 'other-job'"):
        verify(signed, bundle, job_id="other-job")


@pytest.mark.parametrize("expected", [GEN - 1, GEN + 1, 0])
def test_wrong_generation(key_a, bundle, expected):
    signed = signed_by(key_a)
    with pytest.raises(WrongGeneration, match=f"attestation is of generation {GEN}, expected {expected}"):
        verify(signed, bundle, generation=expected)


def test_wrong_nonce(key_a, bundle):
    signed = signed_by(key_a)
    mine = b"\xaa" * 32
    with pytest.raises(WrongNonce) as info:
        verify(signed, bundle, nonce=mine)
    message = str(info.value)
    assert NONCE.hex()[:16] in message and mine.hex()[:16] in message
    assert "nonce" in message
    with pytest.raises(WrongNonce):
        verify(signed, bundle, nonce=b"")


def test_wrong_plan_digest_in_the_attestation(key_a, bundle):
    bogus = hashlib.sha256(b"another plan").digest()

    def mutate(message):
        message.plan_digest = bogus

    signed = resign(signed_by(key_a), key_a, mutate)
    with pytest.raises(WrongPlanDigest) as info:
        verify(signed, bundle)
    assert f"plan_digest {bogus.hex()[:16]}..." in str(info.value)
    assert PLAN.digest().hex()[:16] in str(info.value)
    with pytest.raises(WrongPlanDigest):  # even when the caller expects no particular plan
        verify(signed, bundle, plan=None)


def test_attested_plan_differs_from_the_expected_plan(key_a, bundle):
    signed = signed_by(key_a)
    expected = ParallelPlan(dp_shard=2, tp=2, pp=2, order=("cp", "tp", "dp_shard", "dp_replicate", "pp"))
    with pytest.raises(WrongPlanDigest) as info:
        verify(signed, bundle, plan=expected)
    message = str(info.value)
    assert PLAN.describe() in message and expected.describe() in message
    assert PLAN.digest().hex()[:16] in message and expected.digest().hex()[:16] in message


def test_plan_swapped_with_its_digest_still_bound_to_the_expected_plan(key_a, bundle):
    other = ParallelPlan(dp_shard=4, tp=2)  # same world, self-consistent digest

    def mutate(message):
        message.plan.CopyFrom(other.to_proto())
        message.plan_digest = other.digest()
        message.coordinate.clear()
        message.coordinate.update(other.coordinate(RANK))

    signed = resign(signed_by(key_a), key_a, mutate)
    with pytest.raises(WrongPlanDigest, match="differs from the expected plan"):
        verify(signed, bundle)
    assert verify(signed, bundle, plan=None).plan == other


@pytest.mark.parametrize("axis", ["tp", "pp", "dp_shard", "cp"])
def test_coordinate_mismatch(key_a, bundle, axis):
    true = PLAN.coordinate(RANK)
    lie = (true[axis] + 1) % 2 if PLAN.size(axis) > 1 else 1

    def mutate(message):
        message.coordinate[axis] = lie

    signed = resign(signed_by(key_a), key_a, mutate)
    with pytest.raises(CoordinateMismatch) as info:
        verify(signed, bundle)
    message = str(info.value)
    assert f"rank {RANK}: attested coordinate" in message
    assert f"'{axis}': {lie}" in message and f"'{axis}': {true[axis]}" in message


def test_coordinate_mismatch_extra_or_missing_axis(key_a, bundle):
    signed = resign(signed_by(key_a), key_a, lambda m: m.coordinate.__setitem__("ep", 0))
    with pytest.raises(CoordinateMismatch, match="'ep': 0"):
        verify(signed, bundle)
    signed = resign(signed_by(key_a), key_a, lambda m: m.coordinate.pop("cp"))
    with pytest.raises(CoordinateMismatch, match=f"rank {RANK}"):
        verify(signed, bundle)


def test_coordinate_mismatch_rank_moved(key_a, bundle):
    # The rank is changed but the coordinate kept: the coordinate no longer fits the rank.
    signed = resign(signed_by(key_a), key_a, lambda m: setattr(m, "rank", 4))
    with pytest.raises(CoordinateMismatch, match="rank 4: attested coordinate"):
        verify(signed, bundle)


def test_coordinate_mismatch_world_size_and_rank_range(key_a, bundle):
    signed = resign(signed_by(key_a), key_a, lambda m: setattr(m, "world_size", 16))
    with pytest.raises(CoordinateMismatch, match="world_size 16 differs from the plan's 8"):
        verify(signed, bundle)
    signed = resign(signed_by(key_a), key_a, lambda m: setattr(m, "rank", 8))
    with pytest.raises(CoordinateMismatch, match=r"rank 8 out of range \[0, 8\)"):
        verify(signed, bundle)


def test_malformed_payload(key_a, bundle):
    payload = b"\x0a\x05ab"  # a length-delimited field that is cut short
    signed = attestation_pb2.SignedAttestation(payload=payload, signature=key_a.sign(payload), key_id=key_a.key_id)
    with pytest.raises(MalformedAttestation, match="payload is not an Attestation"):
        verify(signed, bundle)


def test_malformed_attested_plan(key_a, bundle):
    signed = resign(signed_by(key_a), key_a, lambda m: m.plan.ClearField("order"))
    with pytest.raises(MalformedAttestation, match="attested plan is invalid: order"):
        verify(signed, bundle)


def test_each_refusal_is_its_own_type():
    kinds = [
        BadSignature,
        UnknownKeyId,
        Expired,
        WrongJob,
        WrongGeneration,
        WrongNonce,
        WrongPlanDigest,
        CoordinateMismatch,
        MalformedAttestation,
    ]
    assert all(issubclass(k, AttestationError) for k in kinds)
    assert len({k.reason for k in kinds}) == len(kinds)
    for a in kinds:
        for b in kinds:
            assert issubclass(a, b) == (a is b)


# ---- the order of the checks ---------------------------------------------------------------


def test_order_unknown_key_before_everything(key_b, bundle):
    signed = signed_by(key_b, job_id="other")
    signed.payload = signed.payload[:-1] + bytes([signed.payload[-1] ^ 1])
    with pytest.raises(UnknownKeyId):
        verify(signed, bundle, now=T0 + 10 * TTL)


def test_order_tampered_and_expired_is_bad_signature(key_a, bundle):
    signed = signed_by(key_a)
    signed.payload = bytes([signed.payload[0] ^ 1]) + signed.payload[1:]
    with pytest.raises(BadSignature):
        verify(signed, bundle, now=T0 + 10 * TTL, job_id="other", nonce=b"x")


def test_order_expired_before_job(key_a, bundle):
    signed = signed_by(key_a)
    with pytest.raises(Expired):
        verify(signed, bundle, now=T0 + 10 * TTL, job_id="other-job")


def test_order_retired_key_before_job(key_a):
    retired = TrustBundle([TrustedKey(key_a.key_id, key_a.public_key(), NOW - 1)])
    with pytest.raises(Expired, match="retired"):
        verify(signed_by(key_a), retired, job_id="other-job", generation=GEN + 1)


def test_order_job_generation_nonce(key_a, bundle):
    signed = signed_by(key_a)
    with pytest.raises(WrongJob):
        verify(signed, bundle, job_id="x", generation=GEN + 1, nonce=b"y")
    with pytest.raises(WrongGeneration):
        verify(signed, bundle, generation=GEN + 1, nonce=b"y")


def test_order_nonce_before_plan_digest(key_a, bundle):
    signed = resign(signed_by(key_a), key_a, lambda m: setattr(m, "plan_digest", b"\0" * 32))
    with pytest.raises(WrongNonce):
        verify(signed, bundle, nonce=b"y")
    with pytest.raises(WrongNonce):
        verify(signed_by(key_a), bundle, nonce=b"y", plan=ParallelPlan(tp=8))


def test_order_plan_digest_before_coordinate(key_a, bundle):
    def mutate(message):
        message.plan_digest = b"\0" * 32
        message.coordinate["tp"] = 1 - message.coordinate["tp"]

    signed = resign(signed_by(key_a), key_a, mutate)
    with pytest.raises(WrongPlanDigest):
        verify(signed, bundle)


# ---- trust bundles -------------------------------------------------------------------------


def test_trust_bundle_json_round_trip(key_a, key_b):
    bundle = TrustBundle(
        [TrustedKey(key_a.key_id, key_a.public_key(), T0 + 3600.5), TrustedKey(key_b.key_id, key_b.public_key(), None)],
        job_id=JOB,
    )
    text = bundle.to_json()
    document = json.loads(text)
    assert document["jobId"] == JOB and len(document["keys"]) == 2
    again = TrustBundle.from_json(text)
    assert again.job_id == JOB
    assert set(again.keys) == {key_a.key_id, key_b.key_id}
    assert again.keys[key_a.key_id].not_after == T0 + 3600.5
    assert again.keys[key_b.key_id].not_after is None
    for key in (key_a, key_b):
        raw = again.keys[key.key_id].public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        assert raw == key.public_raw
    assert again.to_json() == text
    assert verify(signed_by(key_b), again).key_id == key_b.key_id


@pytest.mark.parametrize("not_after", [1.9999999999, T0 + 0.9999999999, T0 + 1e-10, T0])
def test_trust_bundle_not_after_survives_json(key_a, not_after):
    bundle = TrustBundle([TrustedKey(key_a.key_id, key_a.public_key(), not_after)])
    message = bundle.to_proto()
    assert 0 <= message.keys[0].not_after.nanos < 1_000_000_000
    again = TrustBundle.from_json(bundle.to_json())
    assert again.keys[key_a.key_id].not_after == pytest.approx(not_after, abs=1e-6)


def test_trust_bundle_save_and_load(tmp_path, key_a):
    path = tmp_path / "trust.json"
    TrustBundle.of(key_a, job_id=JOB).save(path)
    assert not (tmp_path / "trust.json.tmp").exists()
    loaded = TrustBundle.load(path)
    assert loaded.job_id == JOB and set(loaded.keys) == {key_a.key_id}
    assert verify(signed_by(key_a), loaded).rank == RANK
    TrustBundle([]).save(str(path))  # replaces atomically
    assert TrustBundle.load(str(path)).keys == {}


def test_trust_bundle_refuses_a_key_id_that_does_not_match_its_key(key_a, key_b):
    with pytest.raises(BadSignature) as info:
        TrustBundle([TrustedKey(key_a.key_id, key_b.public_key(), None)])
    assert key_a.key_id in str(info.value) and key_b.key_id in str(info.value)
    with pytest.raises(AttestationError, match="'ed25519:made-up'"):
        TrustBundle([TrustedKey("ed25519:made-up", key_a.public_key(), None)])
    # the same refusal when the bundle comes from JSON
    message = TrustBundle.of(key_a).to_proto()
    message.keys[0].key_id = key_b.key_id
    from google.protobuf import json_format

    with pytest.raises(BadSignature, match=key_b.key_id):
        TrustBundle.from_json(json_format.MessageToJson(message))


def test_trust_bundle_refuses_bad_json_and_bad_keys(key_a):
    with pytest.raises(MalformedAttestation, match="trust bundle: not valid JSON"):
        TrustBundle.from_json("{not json")
    with pytest.raises(MalformedAttestation, match="trust bundle"):
        TrustBundle.from_json('{"keys": [{"nope": 1}]}')
    message = attestation_pb2.TrustBundle()
    message.keys.add(key_id="ed25519:short", ed25519=b"\x01" * 31)
    with pytest.raises(MalformedAttestation, match="'ed25519:short' is not a 32-byte Ed25519 key"):
        TrustBundle.from_proto(message)


def test_key_id_is_derived_from_the_public_key(key_a, key_b):
    assert key_a.key_id == key_id_for(key_a.public_raw)
    assert key_a.key_id.startswith("ed25519:") and len(key_a.key_id) == len("ed25519:") + 16
    assert key_a.key_id != key_b.key_id
    assert len(key_a.public_raw) == 32


# ---- signing key files ---------------------------------------------------------------------


def test_signing_key_save_creates_0600_and_loads(tmp_path, key_a):
    path = tmp_path / "signing.pem"
    old_umask = os.umask(0)  # even a permissive umask must not widen the mode
    try:
        key_a.save(path)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    loaded = SigningKey.load(path)
    assert loaded.key_id == key_a.key_id and loaded.public_raw == key_a.public_raw
    signed = signed_by(loaded)
    assert verify(signed, TrustBundle.of(key_a)).key_id == key_a.key_id


def test_signing_key_save_refuses_an_existing_file(tmp_path, key_a, key_b):
    path = tmp_path / "signing.pem"
    key_a.save(path)
    before = path.read_bytes()
    with pytest.raises(FileExistsError):
        key_b.save(path)
    assert path.read_bytes() == before
    assert SigningKey.load(path).key_id == key_a.key_id


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o666])
def test_signing_key_load_refuses_an_open_mode(tmp_path, key_a, mode):
    path = tmp_path / "signing.pem"
    key_a.save(path)
    os.chmod(path, mode)
    with pytest.raises(KeyFileError) as info:
        SigningKey.load(path)
    message = str(info.value)
    assert str(path) in message and f"mode {mode:04o}" in message
    assert "0600" in message


def test_signing_key_load_accepts_stricter_modes(tmp_path, key_a):
    path = tmp_path / "signing.pem"
    key_a.save(path)
    os.chmod(path, 0o400)
    assert SigningKey.load(path).key_id == key_a.key_id


def test_signing_key_load_refuses_non_pem(tmp_path):
    path = tmp_path / "signing.pem"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(b"this is not a key\n")
    with pytest.raises(KeyFileError, match=f"signing key {path}: not a PEM private key"):
        SigningKey.load(path)


def test_signing_key_load_refuses_a_non_ed25519_key(tmp_path):
    path = tmp_path / "ec.pem"
    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(pem)
    with pytest.raises(KeyFileError, match=f"signing key {path}: not an Ed25519 key"):
        SigningKey.load(path)


def test_signing_key_load_missing_file(tmp_path):
    path = tmp_path / "absent.pem"
    with pytest.raises(KeyFileError, match=f"signing key {path}"):
        SigningKey.load(path)


# ---- the coordinator's template: the same bytes as build + sign --------------------------

_plans = st.builds(
    ParallelPlan,
    dp_replicate=st.integers(1, 3),
    dp_shard=st.integers(1, 300),
    tp=st.integers(1, 8),
    pp=st.integers(1, 3),
    cp=st.integers(1, 2),
)
_text = st.text(max_size=40)
_u32 = st.integers(0, 2**32 - 1)


@settings(max_examples=400, deadline=None)
@given(
    plan=_plans,
    job_id=_text,
    generation=st.integers(0, 2**64 - 1),
    rank_at=st.floats(0, 1, exclude_max=True),
    local_rank=_u32,
    node_rank=_u32,
    node_id=_text,
    worker_id=_text,
    nonce=st.binary(max_size=80),
    issued_at=st.one_of(st.floats(-1e10, 1e10, allow_nan=False), st.integers(-(10**9), 10**10).map(float)),
    ttl_s=st.one_of(st.just(0.0), st.floats(0, 1e7, allow_nan=False)),
    hardware=st.one_of(
        st.none(),
        st.builds(
            attestation_pb2.WorkerHardware,
            machine_id=_text,
            gpu_uuid=_text,
            gpu_pci_bus_id=_text,
            nvlink_domain=_text,
            rail_nics=st.lists(_text, max_size=3),
        ),
    ),
)
def test_template_signs_the_exact_bytes_build_and_sign_produce(
    key_a,
    plan,
    job_id,
    generation,
    rank_at,
    local_rank,
    node_rank,
    node_id,
    worker_id,
    nonce,
    issued_at,
    ttl_s,
    hardware,
):
    # Verifiers check a signature over exact bytes: the cached prefix + per-worker fields
    # must serialize to what build_attestation + sign_attestation produce, byte for byte.
    rank = min(int(rank_at * plan.world_size), plan.world_size - 1)  # rank 0 (the omitted default) included
    fields = dict(
        rank=rank,
        local_rank=local_rank,
        node_rank=node_rank,
        node_id=node_id,
        worker_id=worker_id,
        nonce=nonce,
        issued_at=issued_at,
        ttl_s=ttl_s,
    )
    # The hardware claim (field 32) is appended after the shared tail (key_id, field 15).
    built = build_attestation(job_id=job_id, generation=generation, plan=plan, hardware=hardware, **fields)
    expected = sign_attestation(built, key_a)
    template = AttestationTemplate(job_id=job_id, generation=generation, plan=plan, key=key_a)
    got = template.sign(hardware=hardware_field(hardware), **fields)
    assert got.payload == expected.payload
    assert got.signature == expected.signature and got.key_id == expected.key_id == key_a.key_id
    assert got.SerializeToString(deterministic=True) == expected.SerializeToString(deterministic=True)


def test_template_attestation_verifies_and_refuses_a_rank_outside_the_plan(key_a, bundle):
    template = AttestationTemplate(job_id=JOB, generation=GEN, plan=PLAN, key=key_a)
    fields = dict(local_rank=1, node_rank=1, node_id="node-1", worker_id="w5", nonce=NONCE, issued_at=T0, ttl_s=TTL)
    verified = verify(template.sign(rank=RANK, **fields), bundle)
    assert (verified.rank, verified.coordinate) == (RANK, PLAN.coordinate(RANK))
    assert template.matches(JOB, GEN, PLAN, key_a)
    assert not template.matches(JOB, GEN + 1, PLAN, key_a)
    assert not template.matches(JOB, GEN, PLAN, SigningKey.generate())
    with pytest.raises(Exception, match="out of range"):
        template.sign(rank=PLAN.world_size, **fields)


# ---- one signature per batch (RegisterBatch with one_signature) ----------------------


def node_batch(key, ranks=(4, 5, 6, 7)):
    """A node's batch signed once: per rank its own nonce, and what its worker receives."""
    template = AttestationTemplate(job_id=JOB, generation=GEN, plan=PLAN, key=key)
    nonces = {r: bytes([r]) * 32 for r in ranks}
    payloads = [
        template.payload(
            rank=r,
            local_rank=r % 4,
            node_rank=r // 4,
            node_id="node-1",
            worker_id=f"w{r}",
            nonce=nonces[r],
            issued_at=T0,
            ttl_s=TTL,
        )
        for r in ranks
    ]
    batch, signed = template.sign_batch(payloads)
    return template, nonces, batch, [with_batch(s, batch) for s in signed]


def test_each_worker_verifies_its_own_entry_of_a_batch_signed_once(key_a, bundle):
    template, nonces, batch, received = node_batch(key_a)
    assert len({s.signature for s in received}) == 1  # one signature for the node
    for r, signed in zip(nonces, received):
        got = verify(signed, bundle, nonce=nonces[r])
        assert (got.rank, got.worker_id, got.coordinate) == (r, f"w{r}", PLAN.coordinate(r))
        # The entry is byte for byte what the worker's attestation signed alone would carry.
        alone = template.sign(
            rank=r,
            local_rank=r % 4,
            node_rank=r // 4,
            node_id="node-1",
            worker_id=f"w{r}",
            nonce=nonces[r],
            issued_at=T0,
            ttl_s=TTL,
        )
        assert signed.payload == alone.payload
        # Another worker's nonce: its entry is not yours.
        with pytest.raises(WrongNonce):
            verify(signed, bundle, nonce=nonces[r ^ 1])


def test_a_batch_entry_cannot_be_swapped_forged_or_confused_with_a_single_signature(key_a, key_b, bundle):
    _, nonces, batch, received = node_batch(key_a)
    first, second = received[0], received[1]

    def changed(signed, **fields):
        copy = attestation_pb2.SignedAttestation()
        copy.CopyFrom(signed)
        for name, value in fields.items():
            setattr(copy, name, value)
        return copy

    # Your nonce's entry under another index, or another entry under yours: not in the batch there.
    with pytest.raises(BadSignature, match="not entry 0"):
        verify(changed(first, payload=second.payload), bundle, nonce=nonces[5])
    # A payload of the attacker's own making, claimed to be in the batch.
    forged = attest(rank=4, nonce=nonces[4], worker_id="evil").SerializeToString()
    with pytest.raises(BadSignature):
        verify(changed(first, payload=forged), bundle, nonce=nonces[4])
    # A batch with one byte changed, or one with an entry added.
    tampered = bytearray(batch)
    tampered[-1] ^= 1
    with pytest.raises(BadSignature):
        verify(changed(first, batch=bytes(tampered)), bundle, nonce=nonces[4])
    grown = batch + attestation_pb2.AttestationBatch(entries=[forged]).SerializeToString()
    with pytest.raises(BadSignature):
        verify(changed(first, batch=grown, batch_index=4, payload=forged), bundle, nonce=nonces[4])
    # The batch signature without its batch is not a signature of the payload alone ...
    with pytest.raises(BadSignature):
        verify(changed(first, batch=b"", batch_index=0), bundle, nonce=nonces[4])
    # ... and a single attestation's signature does not pass for a batch's (the context prefix).
    single = signed_by(key_a, rank=4, nonce=nonces[4])
    as_batch = attestation_pb2.AttestationBatch(entries=[single.payload]).SerializeToString()
    with pytest.raises(BadSignature):
        verify(changed(single, batch=as_batch, batch_index=0), bundle, nonce=nonces[4])
    assert BATCH_CONTEXT[0] == 0  # no serialized Attestation starts with field number 0
    # An index past the end, an index without a batch, a batch that does not parse.
    with pytest.raises(MalformedAttestation, match="out of range"):
        verify(changed(first, batch_index=9), bundle, nonce=nonces[4])
    with pytest.raises(MalformedAttestation, match="without a batch"):
        verify(changed(single, batch_index=2), bundle, nonce=nonces[4])
    # A batch signed by a key the bundle does not trust.
    _, _, _, other = node_batch(key_b)
    with pytest.raises(UnknownKeyId):
        verify(other[0], bundle, nonce=nonces[4])


def test_with_batch_leaves_a_single_signature_as_it_is(key_a, bundle):
    single = signed_by(key_a)
    assert with_batch(single, b"") == single  # a coordinator that signs each one sends no batch
    assert verify(with_batch(single, b""), bundle).rank == RANK
