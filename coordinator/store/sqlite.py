"""The embedded default store: an append-only event log in SQLite (WAL).

``synchronous=FULL``: a commit is on disk before the Register it carries is
answered, so kill -9 (or power loss) never takes back an acknowledged rank. The cost
is one fsync per commit, and commits are grouped: while one is being written, every
event that arrives queues for the next, so a burst of 1,000 Registers costs a few
fsyncs, not 1,000.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from pathlib import Path

from meshgate.coordinator.rendezvous import Event
from meshgate.coordinator.store import GroupCommitStore, StoreError
from meshgate.coordinator.store.codec import decode, encode

SCHEMA_VERSION = 1


class SQLiteStore(GroupCommitStore):
    def __init__(self, path: str | os.PathLike, job_id: str) -> None:
        super().__init__()
        self.path = Path(path)
        self.where = f"state file {self.path}"
        self.job_id = job_id
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.execute(
                "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"
            )
            self.db.execute(
                "CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY, body TEXT NOT NULL)"
            )
            self._check_meta()
            integrity = self.db.execute("PRAGMA quick_check").fetchone()[0]
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"state file {self.path}: unreadable SQLite database ({exc})") from None
        if integrity != "ok":
            raise StoreError(f"state file {self.path}: integrity check failed: {integrity}")
        self._next_seq = 1 + (self.db.execute("SELECT COALESCE(MAX(seq), 0) FROM events").fetchone()[0])

    def _check_meta(self) -> None:
        rows = dict(self.db.execute("SELECT key, value FROM meta").fetchall())
        if not rows:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.executemany(
                "INSERT INTO meta VALUES (?, ?)",
                [("schema", str(SCHEMA_VERSION)), ("job_id", self.job_id)],
            )
            self.db.execute("COMMIT")
            return
        if rows.get("schema") != str(SCHEMA_VERSION):
            raise StoreError(f"state file {self.path}: schema {rows.get('schema')!r}, expected {SCHEMA_VERSION}")
        if rows.get("job_id") != self.job_id:
            raise StoreError(
                f"state file {self.path} belongs to job {rows.get('job_id')!r}, not {self.job_id!r}"
            )

    def load(self) -> list[Event]:
        try:
            rows = self.db.execute("SELECT seq, body FROM events ORDER BY seq").fetchall()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"state file {self.path}: cannot read events ({exc})") from None
        events = []
        expected = 1
        for seq, body in rows:
            if seq != expected:
                raise StoreError(f"state file {self.path}: event {expected} is missing (next is {seq})")
            events.append(decode(body, f"state file {self.path}, event {seq}"))
            expected += 1
        self._next_seq = expected
        return events

    async def _write(self, numbered: list[tuple[int, Event]]) -> None:
        rows = [(seq, encode(event)) for seq, event in numbered]
        await asyncio.to_thread(self._commit, rows)

    def _commit(self, rows: list[tuple[int, str]]) -> None:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self.db.executemany("INSERT INTO events (seq, body) VALUES (?, ?)", rows)
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def healthy(self) -> bool:
        if self._failed is not None:
            return False
        try:
            self.db.execute("SELECT 1").fetchone()
        except sqlite3.Error:
            return False
        return self.path.exists()

    def close(self) -> None:
        self.db.close()
