"""The embedded default store: an append-only, hash-chained event log in SQLite (WAL).

``synchronous=FULL``: a commit is on disk before the Register it carries is
answered, so kill -9 (or power loss) never takes back an acknowledged rank. The cost
is one fsync per commit (and one for the high-water mark), and commits are grouped:
while one is being written, every event that arrives queues for the next, so a burst
of 1,000 Registers costs a few fsyncs, not 1,000.

Start-up never trusts the files in place. It copies the database and its WAL to a
temporary directory and verifies the copy there: SQLite's own check, the schema and
job, every record's chain sum, the pin (job and plan) and the high-water mark. Only a
state that passes is opened for writing; a refused one is left byte-for-byte as found
(opening it, even read-only, could checkpoint or rewrite its WAL and -shm). A new log
is created whole (``_create``), so a crash while creating it never leaves a file that
would be refused.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from meshgate.coordinator.rendezvous import Event
from meshgate.coordinator.resources import descriptors_free, exhausted
from meshgate.coordinator.store import (
    GroupCommitStore,
    StoreDiskFullError,
    StoreError,
    StoreResourcesError,
)
from meshgate.coordinator.store.atomic import create_file
from meshgate.coordinator.store.codec import (
    GENESIS,
    RECORD_SCHEMA,
    JobPinned,
    OldLogFormatError,
    VerifiedLog,
    encode_record,
    newer_state,
    verify_records,
)
from meshgate.coordinator.store.mark import DurableMark

SCHEMA_VERSION = RECORD_SCHEMA
# Below this much free space the next commit (a WAL frame, the -shm index, the mark) may
# fail: the store reports itself unhealthy before a write has to fail to show it.
MIN_FREE_BYTES = 1 << 20

log = logging.getLogger("meshgate.coordinator")


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged writer may still use in ``directory``'s file system."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def _is_disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(exc, sqlite3.OperationalError) and "full" in str(exc).lower()


def _cannot_open_now(where: str, exc: BaseException) -> StoreResourcesError:
    cause = exc.strerror if isinstance(exc, OSError) else str(exc)
    free = descriptors_free()
    left = "" if free is None else f"; {max(free, 0)} file descriptors left"
    return StoreResourcesError(f"{where}: cannot open it now: {cause}{left}. The state is intact")


START_AGAIN = "Free space there and start again; the job's state is intact"


def disk_full(directory: Path, cause: object, advice: str = START_AGAIN) -> StoreDiskFullError:
    try:
        free = f"{free_bytes(directory)} bytes free"
    except OSError as exc:
        free = f"free space unknown ({exc.strerror})"
    return StoreDiskFullError(
        f"the file system of {directory} is full ({free}; meshgate needs at least "
        f"{MIN_FREE_BYTES >> 20} MiB to write its log): {cause}. {advice}"
    )


class SQLiteStore(GroupCommitStore):
    # A commit costs two fsyncs (WAL, mark), about 110 µs of CPU each on the bench's VM.
    # Without a delay a burst of direct Registers committed in groups of about 3; with
    # 4 ms, groups of about 12, and 18-25% less coordinator CPU per worker (8k workers,
    # 2 and 8 ms measured worse). A lone Register still commits at once.
    commit_delay_s = 0.004

    def __init__(self, path: str | os.PathLike, pin: JobPinned, mark: DurableMark) -> None:
        super().__init__(mark)
        self.path = Path(path)
        self.where = f"state file {self.path}"
        self.pin = pin
        self.job_id = pin.job_id
        self._low_space_logged = False
        verified = self._verify_copy()  # raises before anything is opened for writing
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._check_space()
            if verified is None:
                verified = self._create()
            self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
        except (sqlite3.DatabaseError, OSError) as exc:
            self._release()  # a failed open keeps no descriptor (it may be retried many times)
            if _is_disk_full(exc) or self._space_low():
                raise disk_full(self.path.parent, exc) from None
            if exhausted(exc):
                raise _cannot_open_now(self.where, exc) from None
            if isinstance(exc, OSError):
                raise StoreError(f"{self.where}: {exc.strerror}") from None
            raise StoreError(f"{self.where}: unreadable SQLite database ({exc})") from None
        self._verified: Optional[VerifiedLog] = verified
        self._next_seq = len(verified.sums) + 1
        self._head = verified.head

    # ---- start-up: verify a copy, touch nothing -----------------------------------------

    def _verify_copy(self) -> Optional[VerifiedLog]:
        """The verified log, or None for a fresh start; StoreError for any state that
        cannot be trusted."""
        wal = self.path.with_name(self.path.name + "-wal")
        if not self.path.exists():
            if wal.exists():
                raise StoreError(
                    f"{self.where} is missing, but its write-ahead log {wal} is there: "
                    "the database was deleted or moved"
                )
            mark = self.mark.read()
            if mark is not None:
                raise StoreError(
                    f"{self.where} is missing, but high-water mark {self.mark.path} says "
                    f"{mark.count} records of job {mark.job_id!r} were acknowledged"
                )
            return None
        if self.path.stat().st_size == 0:
            if self.mark.read() is None:
                return self._set_aside_unacknowledged("is empty (0 bytes)")
            raise StoreError(f"{self.where} is empty (0 bytes); it held this job's log")
        try:
            scratch_dir = tempfile.TemporaryDirectory(prefix="meshgate-verify-")
        except OSError as exc:
            if exhausted(exc):
                raise _cannot_open_now(self.where, exc) from None
            raise StoreError(f"{self.where}: no temporary directory to verify a copy in: {exc}") from None
        with scratch_dir as scratch:
            copy = Path(scratch) / "state.sqlite3"
            try:
                shutil.copyfile(self.path, copy)
                if wal.exists():
                    shutil.copyfile(wal, copy.with_name(copy.name + "-wal"))
            except OSError as exc:
                if _is_disk_full(exc):
                    raise disk_full(Path(scratch).parent, f"copying the state to verify it: {exc.strerror}") from None
                if exhausted(exc):
                    raise _cannot_open_now(self.where, exc) from None
                raise StoreError(f"{self.where}: cannot copy it to verify it: {exc}") from None
            try:
                db = sqlite3.connect(copy, isolation_level=None)
                try:
                    schemaless = db.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchone() is None
                    if not (schemaless and self.mark.read() is None):
                        return self._verify(db)
                finally:
                    db.close()
            except sqlite3.DatabaseError as exc:
                if exhausted(exc):
                    raise _cannot_open_now(self.where, exc) from None
                raise StoreError(f"{self.where}: unreadable SQLite database ({exc})") from None
        return self._set_aside_unacknowledged("has no tables")

    def _set_aside_unacknowledged(self, what: str) -> None:
        """A database with nothing in it and no mark was never acknowledged: the remains of
        a creation that a crash cut short before creation was atomic (a 0-byte file and its
        journal, or a header without the schema). Moved aside, kept, for a fresh start."""
        stamp = time.strftime("%Y%m%dT%H%M%S")
        for suffix in ("", "-wal", "-shm", "-journal"):
            path = self.path.with_name(self.path.name + suffix)
            if path.exists():
                path.rename(path.with_name(f"{path.name}.unacknowledged-{stamp}"))
        log.warning(
            "%s %s and no high-water mark vouches for a record (a creation cut short by a crash): "
            "moved aside as %s.unacknowledged-%s; a new log is created",
            self.where,
            what,
            self.path.name,
            stamp,
        )
        return None

    def _verify(self, db: sqlite3.Connection) -> VerifiedLog:
        integrity = db.execute("PRAGMA quick_check").fetchone()[0]
        if integrity != "ok":
            raise StoreError(f"{self.where}: integrity check failed: {integrity}")
        meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
        if meta.get("schema") != str(SCHEMA_VERSION):
            if meta.get("schema") == "1":
                raise OldLogFormatError(
                    f"{self.where}: written by an older meshgate (schema 1, unchained records); "
                    f"this version reads schema {SCHEMA_VERSION} only"
                )
            if str(meta.get("schema")).isdigit() and int(meta["schema"]) > SCHEMA_VERSION:
                raise newer_state(self.where, f"schema {meta['schema']}")
            raise StoreError(f"{self.where}: schema {meta.get('schema')!r}, expected {SCHEMA_VERSION}")
        if meta.get("job_id") != self.job_id:
            raise StoreError(f"{self.where} belongs to job {meta.get('job_id')!r}, not {self.job_id!r}")
        rows = db.execute("SELECT seq, body FROM events ORDER BY seq").fetchall()
        verified = verify_records(rows, self.where, self.pin)
        self.mark.check(len(verified.sums), verified.sums, self.where)
        return verified

    def _create(self) -> VerifiedLog:
        """A new log, whole or not at all: the tables, the meta row and record 1 (the
        job's pin) are built under a temporary name and renamed into place
        (store/atomic.py); the mark comes last. A crash before the rename leaves no log
        (a fresh start again); after it, a log of the pin alone, which needs no mark."""
        text, head = encode_record(1, GENESIS, self.pin)

        def build(tmp: Path) -> None:
            tmp.with_name(tmp.name + "-journal").unlink(missing_ok=True)
            db = sqlite3.connect(tmp, isolation_level=None)
            try:
                db.execute("PRAGMA synchronous=FULL")
                db.execute("BEGIN IMMEDIATE")
                db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
                db.execute("CREATE TABLE events (seq INTEGER PRIMARY KEY, body TEXT NOT NULL)")
                db.executemany(
                    "INSERT INTO meta VALUES (?, ?)", [("schema", str(SCHEMA_VERSION)), ("job_id", self.job_id)]
                )
                db.execute("INSERT INTO events (seq, body) VALUES (1, ?)", (text,))
                db.execute("COMMIT")
            finally:
                db.close()

        create_file(self.path, build)
        self.mark.advance(1, head)
        return VerifiedLog(self.pin, (), (head,))

    def load(self) -> list[Event]:
        events, self._verified = list(self._verified.events), None
        return events

    # ---- writes --------------------------------------------------------------------------

    async def _write(self, rows: list[tuple[int, str]], then: Callable[[], None] | None = None) -> None:
        await asyncio.to_thread(self._commit, rows, then)

    def _commit(self, rows: list[tuple[int, str]], then: Callable[[], None] | None = None) -> None:
        try:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                self.db.executemany("INSERT INTO events (seq, body) VALUES (?, ?)", rows)
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")
        except (sqlite3.OperationalError, OSError) as exc:
            if _is_disk_full(exc) or self._space_low():
                raise disk_full(self.path.parent, exc) from None
            raise
        if then is not None:
            then()

    def _space_low(self) -> bool:
        try:
            return free_bytes(self.path.parent) < MIN_FREE_BYTES
        except OSError:
            return False

    def _check_space(self) -> None:
        if self._space_low():
            raise disk_full(self.path.parent, "too little space to open the log for writing")

    def healthy(self) -> bool:
        """False once a write failed, or while the state directory has less than
        MIN_FREE_BYTES free (the next commit may fail): logged once per episode."""
        if self._failed is not None:
            return False
        if self._space_low():
            if not self._low_space_logged:
                self._low_space_logged = True
                log.error(
                    "%s",
                    disk_full(
                        self.path.parent,
                        "the store cannot take writes",
                        "Health is NOT_SERVING (coordinator.store) until there is space",
                    ),
                )
            return False
        self._low_space_logged = False
        try:
            self.db.execute("SELECT 1").fetchone()
        except sqlite3.Error:
            return False
        return self.path.exists()

    def refusal(self) -> str:
        if self._space_low():
            return str(disk_full(self.path.parent, "the store cannot take writes", "Free space there"))
        return super().refusal()

    def _release(self) -> None:
        db = getattr(self, "db", None)
        if db is not None:
            db.close()
        self.mark.close()

    def close(self) -> None:
        self.db.close()
        self.mark.close()
