"""The coordinator's signing keys on disk: one PEM file per key id, mode 0600, an
``active`` pointer, and the trust bundle (``trust-bundle.json``) that lists every key
still trusted.

Crypto itself lives in meshgate.attestation; this module only decides where keys
live, which one signs, and what the trust bundle says.

Rotation: a new key starts signing at once; the old keys stay in the bundle with
``not_after`` = now + the attestation TTL, so every attestation they signed still
verifies until it expires, and not a moment longer. Each new bundle is endorsed by
every key it still trusts, so holders of the previous bundle can accept it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

from meshgate.attestation import (
    KeyFileError,
    SigningKey,
    TrustBundle,
    TrustedKey,
    heartbeat_key,
    heartbeat_secret,
    sign_trust_bundle,
)
from meshgate.coordinator.store.atomic import create_file, write_new
from meshgate.v1 import attestation_pb2

ACTIVE_FILE = "active"
BUNDLE_FILE = "trust-bundle.json"


class KeyRing:
    """Keys in ``directory``: ``<key_id>.pem`` files, ``active`` and the bundle."""

    def __init__(self, directory: str | os.PathLike, job_id: str = "") -> None:
        self.directory = Path(directory)
        self.job_id = job_id
        self.active = self._load_or_create()
        self.bundle = self._load_bundle()
        self._heartbeat_keys: dict[str, bytes] = {}  # key id -> heartbeat_key(that key)
        # (bundle version, live key ids) -> the bundle signed by them; see signed_bundle.
        self._signed: Optional[tuple[tuple[int, tuple[str, ...]], attestation_pb2.SignedTrustBundle]] = None

    @staticmethod
    def _file_name(key_id: str) -> str:
        return key_id.replace(":", "_") + ".pem"

    def _key_path(self, key_id: str) -> Path:
        return self.directory / self._file_name(key_id)

    def _load_or_create(self) -> SigningKey:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        pointer = self.directory / ACTIVE_FILE
        if pointer.exists():
            key_id = pointer.read_text().strip()
            path = self._key_path(key_id)
            key = SigningKey.load(path)
            if key.key_id != key_id:
                raise KeyFileError(f"{path}: holds key {key.key_id}, but {pointer} names {key_id}")
            return key
        return self._new_active_key()

    def _new_active_key(self) -> SigningKey:
        """The key file, then the ``active`` pointer naming it, each whole or absent
        (store/atomic.py): a crash before the pointer leaves the old state (for a first
        start: no key, and the next start makes one)."""
        key = SigningKey.generate()
        create_file(self._key_path(key.key_id), key.save)
        write_new(self.directory / ACTIVE_FILE, (key.key_id + "\n").encode(), mode=0o644)
        return key

    def _load_bundle(self) -> TrustBundle:
        if self.bundle_path.exists():
            bundle = TrustBundle.load(self.bundle_path)
            if self.active.key_id not in bundle.keys:
                raise KeyFileError(f"{self.bundle_path}: does not list the active key {self.active.key_id}")
            return bundle
        bundle = TrustBundle.of(self.active, job_id=self.job_id, version=1)
        create_file(self.bundle_path, bundle.save)
        return bundle

    @property
    def bundle_path(self) -> Path:
        return self.directory / BUNDLE_FILE

    def write_bundle(self) -> Path:
        self.bundle.save(self.bundle_path)
        return self.bundle_path

    def rotate(self, retire_after_s: float, now: Optional[float] = None) -> TrustBundle:
        """Sign with a new key from now on; keep the old ones for ``retire_after_s``."""
        now = time.time() if now is None else now
        kept = []
        for key in self.bundle.keys.values():
            if key.not_after is not None and key.not_after <= now:
                continue  # fully retired: its last attestation has expired
            not_after = key.not_after if key.not_after is not None else now + retire_after_s
            kept.append(TrustedKey(key.key_id, key.public, min(not_after, now + retire_after_s)))
        self.active = self._new_active_key()
        kept.append(TrustedKey(self.active.key_id, self.active.public_key(), None))
        self.bundle = TrustBundle(kept, job_id=self.job_id, version=self.bundle.version + 1)
        self.write_bundle()
        return self.bundle

    def heartbeat_secret(self, job_id: str, generation: int, worker_id: str) -> bytes:
        """What a worker registering now gets: derived from the active key."""
        return heartbeat_secret(self._heartbeat_key(self.active), job_id, generation, worker_id)

    def heartbeat_secrets(
        self, job_id: str, generation: int, worker_id: str, now: Optional[float] = None
    ) -> list[bytes]:
        """Every secret a live worker may hold: one per still-trusted key whose private
        half is here (a worker registered before a rotation keeps its secret)."""
        now = time.time() if now is None else now
        found = []
        for key_id, trusted in self.bundle.keys.items():
            if trusted.not_after is not None and trusted.not_after <= now:
                continue
            if key_id == self.active.key_id:
                key = self.active
            elif key_id in self._heartbeat_keys or self._key_path(key_id).exists():
                key = None
            else:
                continue
            found.append(heartbeat_secret(self._heartbeat_key(key, key_id), job_id, generation, worker_id))
        return found

    def _heartbeat_key(self, key: Optional[SigningKey], key_id: str = "") -> bytes:
        key_id = key.key_id if key is not None else key_id
        if key_id not in self._heartbeat_keys:
            self._heartbeat_keys[key_id] = heartbeat_key(key or SigningKey.load(self._key_path(key_id)))
        return self._heartbeat_keys[key_id]

    def signed_bundle(self, now: Optional[float] = None) -> attestation_pb2.SignedTrustBundle:
        """The bundle endorsed by each trusted key whose private half is still here.
        Signed once per key set (bundle version and the keys still live), not per call:
        every agent asks for it every minute."""
        now = time.time() if now is None else now
        live = tuple(
            key_id
            for key_id, trusted in self.bundle.keys.items()
            if trusted.not_after is None or trusted.not_after > now
        )
        cached = self._signed
        if cached is not None and cached[0] == (self.bundle.version, live):
            return cached[1]
        signers = []
        for key_id in live:
            path = self._key_path(key_id)
            if path.exists():
                signers.append(self.active if key_id == self.active.key_id else SigningKey.load(path))
        signed = sign_trust_bundle(self.bundle, signers)
        self._signed = ((self.bundle.version, live), signed)
        return signed
