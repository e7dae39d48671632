"""The node's own secrets, kept in the agent's state directory (mode 0600):

- ``node-key.pem``: the Ed25519 key that signs this node's worker vouches; its public
  half is registered at Join.
- ``node.credential``: the secret the coordinator issued at the first Join. Every
  later agent call carries it, and a restarted agent rejoins with it (join tokens are
  single-use).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from meshgate.attestation import SigningKey
from meshgate.secret_files import read_secret

KEY_FILE = "node-key.pem"
CREDENTIAL_FILE = "node.credential"


class NodeIdentity:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        key_path = self.state_dir / KEY_FILE
        if not key_path.exists():
            SigningKey.generate().save(key_path)
        self.key = SigningKey.load(key_path)

    @property
    def public_key(self) -> bytes:
        return self.key.public_raw

    def credential(self) -> Optional[bytes]:
        path = self.state_dir / CREDENTIAL_FILE
        return read_secret(path, "node credential") if path.exists() else None

    def save_credential(self, credential: bytes) -> None:
        """Write with mode 0600 from the first byte, then swap in atomically."""
        path = self.state_dir / CREDENTIAL_FILE
        tmp = path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(credential)
        os.replace(tmp, path)

    def forget_credential(self) -> None:
        (self.state_dir / CREDENTIAL_FILE).unlink(missing_ok=True)
