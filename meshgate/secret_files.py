"""Secret files (signing and node keys, node credentials, join and admin tokens): a
daemon uses one only if neither group nor others may read or write it, and refuses any
other with one line naming the file and its mode. The one check, shared by everyone."""

from __future__ import annotations

import os
import stat
from pathlib import Path


class SecretFileError(ValueError):
    """A secret file that is missing, unreadable, or too open. The message is one line."""


class SecretFileTooOpen(SecretFileError):
    pass


def check_private(path: str | os.PathLike, what: str) -> None:
    """SecretFileTooOpen unless ``path`` is mode 0600 or stricter."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError as exc:
        raise SecretFileError(f"{what} {path}: {exc.strerror}") from None
    if mode & 0o077:
        raise SecretFileTooOpen(
            f"{what} {path} has mode {mode:04o}; it must be 0600 or stricter (run: chmod 600 {path})"
        )


def read_secret(path: str | os.PathLike, what: str) -> bytes:
    """The bytes of a secret file, after check_private."""
    check_private(path, what)
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SecretFileError(f"{what} {path}: {exc.strerror}") from None
