"""The high-water mark: a small fsynced witness, kept with the signing keys, of how far
the log had been acknowledged and what its chain head was there.

The log alone cannot tell that it is behind: an older WAL over a newer database, a
restored backup or a truncated file are each a valid, shorter log. The mark can: on
start the log must reach the mark's record and have the mark's chain sum there. The
store advances the mark after every durable write and before anyone is answered.

Format: two fixed slots of ``SLOT`` bytes, written alternately with one pwrite and one
fdatasync each. Each slot carries its own checksum, so a torn write spoils at most the
slot being written, and the other still holds an earlier (lower, never higher) mark.
A new mark is created whole with its first slot written (store/atomic.py): there is
never a mark file without a readable slot.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from meshgate.coordinator.resources import exhausted
from meshgate.coordinator.store import StoreError, StoreResourcesError
from meshgate.coordinator.store.atomic import write_new

SLOT = 512
FILE_NAME = "durable-mark"


class MarkError(StoreError):
    """The mark file exists but no slot of it can be read."""


class LogBehindMarkError(StoreError):
    """The log is shorter than, or differs from, what was acknowledged."""


@dataclass(frozen=True)
class Mark:
    job_id: str
    count: int  # records acknowledged, the pin included
    head: str  # the chain sum of record ``count``


def _slot_sum(job_id: str, count: int, head: str) -> str:
    return hashlib.sha256(f"{job_id}\n{count}\n{head}".encode()).hexdigest()


class DurableMark:
    def __init__(self, path: str | os.PathLike, job_id: str) -> None:
        self.path = Path(path)
        self.job_id = job_id
        self._fd: Optional[int] = None
        self._slot = 0

    def read(self) -> Optional[Mark]:
        """The highest valid mark, or None when there is none (no file, or one that no slot
        was ever written to). Read-only."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exhausted(exc):
                raise StoreResourcesError(f"high-water mark {self.path}: {exc.strerror}") from None
            raise MarkError(f"high-water mark {self.path}: {exc.strerror}") from None
        if not data.strip(b"\0") and len(data) <= 2 * SLOT:
            return None  # torn at creation by an older meshgate: no slot was ever written, it vouches for nothing
        marks = [m for m in (self._parse(data[i * SLOT : (i + 1) * SLOT]) for i in range(2)) if m]
        if not marks:
            raise MarkError(f"high-water mark {self.path}: no readable slot ({len(data)} bytes)")
        return max(marks, key=lambda m: m.count)

    @staticmethod
    def _parse(raw: bytes) -> Optional[Mark]:
        try:
            values = json.loads(raw.rstrip(b" \n\0") or b"null")
            mark = Mark(values["job"], int(values["count"]), values["head"])
            valid = mark.count >= 1 and values["sum"] == _slot_sum(mark.job_id, mark.count, mark.head)
            return mark if valid else None
        except (ValueError, TypeError, KeyError):
            return None

    @staticmethod
    def _slot_bytes(job_id: str, count: int, head: str) -> bytes:
        text = json.dumps({"job": job_id, "count": count, "head": head, "sum": _slot_sum(job_id, count, head)})
        return text.encode().ljust(SLOT - 1) + b"\n"

    def advance(self, count: int, head: str) -> None:
        """Record that ``count`` records, ending in ``head``, are durable. Blocking."""
        raw = self._slot_bytes(self.job_id, count, head)
        if self._fd is None:
            if self.read() is None:  # the first slot is in the file before it has a name
                write_new(self.path, raw + bytes(SLOT))
                self._open_for_write()
                return
            self._open_for_write()
        os.pwrite(self._fd, raw, self._slot * SLOT)
        os.fdatasync(self._fd)
        self._slot ^= 1

    def _open_for_write(self) -> None:
        current = self.read()
        if current is None:
            raise MarkError(f"high-water mark {self.path}: missing")
        self._fd = os.open(self.path, os.O_RDWR)
        data = self.path.read_bytes()  # overwrite the older slot first, keep the newest
        newest = [i for i in range(2) if self._parse(data[i * SLOT : (i + 1) * SLOT]) == current][0]
        self._slot = newest ^ 1

    def check(self, records: int, sums: tuple[str, ...], where: str, missing_ok: bool = False) -> None:
        """Refuse a log (``sums[i]`` = record i+1's chain sum) that does not reach this mark.
        ``missing_ok``: a missing mark is no evidence (etcd: a standby that never led has
        none), so only a mark that is there is checked."""
        mark = self.read()
        if mark is None:
            if records > 1 and not missing_ok:
                raise LogBehindMarkError(
                    f"{where}: holds {records} records but the high-water mark {self.path} is "
                    "missing, so nothing vouches that the log is complete"
                )
            return
        if mark.job_id != self.job_id:
            raise LogBehindMarkError(f"high-water mark {self.path} belongs to job {mark.job_id!r}, not {self.job_id!r}")
        if records < mark.count:
            raise LogBehindMarkError(
                f"{where}: holds {records} records, but {mark.count} were acknowledged "
                f"(high-water mark {self.path}): the log is stale or truncated"
            )
        if sums[mark.count - 1] != mark.head:
            raise LogBehindMarkError(
                f"{where}: record {mark.count} differs from the one acknowledged "
                f"(high-water mark {self.path}): the log was replaced or rewritten"
            )

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
