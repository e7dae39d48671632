"""The coordinator's signing key on disk: one PEM file per key id, mode 0600.

Crypto itself lives in meshgate.attestation; this module only decides where keys
live, which one signs, and what the trust bundle file says.
"""

from __future__ import annotations

import os
from pathlib import Path

from meshgate.attestation import KeyFileError, SigningKey, TrustBundle

ACTIVE_FILE = "active"
BUNDLE_FILE = "trust-bundle.json"


class KeyRing:
    """Keys in ``directory``: ``<key_id>.pem`` files and an ``active`` pointer."""

    def __init__(self, directory: str | os.PathLike, job_id: str = "") -> None:
        self.directory = Path(directory)
        self.job_id = job_id
        self.active = self._load_or_create()
        self.bundle = TrustBundle.of(self.active, job_id=job_id)

    @staticmethod
    def _file_name(key_id: str) -> str:
        return key_id.replace(":", "_") + ".pem"

    def _load_or_create(self) -> SigningKey:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        pointer = self.directory / ACTIVE_FILE
        if pointer.exists():
            key_id = pointer.read_text().strip()
            path = self.directory / self._file_name(key_id)
            key = SigningKey.load(path)
            if key.key_id != key_id:
                raise KeyFileError(
                    f"{path}: holds key {key.key_id}, but {pointer} names {key_id}"
                )
            return key
        key = SigningKey.generate()
        key.save(self.directory / self._file_name(key.key_id))
        tmp = pointer.with_suffix(".tmp")
        tmp.write_text(key.key_id + "\n")
        os.replace(tmp, pointer)
        return key

    @property
    def bundle_path(self) -> Path:
        return self.directory / BUNDLE_FILE

    def write_bundle(self) -> Path:
        self.bundle.save(self.bundle_path)
        return self.bundle_path
