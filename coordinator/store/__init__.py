"""The persistence seam. The owner applies every state change (an Event of
coordinator.rendezvous) and hands it to ``Store.append`` in the same step, and
answers the RPC only once the returned future says the events are durable. On
start it replays ``load()``. Backends: memory (tests, demo), sqlite (the embedded
default), etcd (HA).

Durable stores keep a hash-chained log whose first record pins the job and its plan
(store/codec.py), and a high-water mark beside the signing keys (store/mark.py); a log
that does not verify, or is behind the mark, is refused before anything is served.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from meshgate.coordinator.rendezvous import Event

if TYPE_CHECKING:
    from meshgate.coordinator.store.codec import JobPinned
    from meshgate.coordinator.store.mark import DurableMark

log = logging.getLogger("meshgate.coordinator")

# Test-only: while the file this names exists, every group commit waits before writing
# (and touches "<file>.held" to say so), so a crash test can kill the process exactly
# between "decided" and "durable". A file holding a number N lets N more commits through
# first (each one counts it down), so a test can hold the second commit of a call (a
# submit's allocation after its acceptance). Never set in production; the store says so loudly.
HOLD_COMMITS_ENV = "MESHGATE_TEST_HOLD_COMMITS"
# Test-only: every group commit waits this many milliseconds before writing, as on a slow
# disk, so that more of a crash test's kills land between "decided" and "durable".
COMMIT_DELAY_ENV = "MESHGATE_TEST_COMMIT_DELAY_MS"


class StoreError(Exception):
    """The store cannot be read or written; the message names the file or key."""


class StoreResourcesError(StoreError):
    """The process or machine ran out of something (descriptors, space, memory) while
    opening or writing the store: not a damaged state, and no reason to reset it."""


class StoreDiskFullError(StoreResourcesError):
    """The state directory's file system is full: not a damaged state, and no reason to
    reset it. The message names the directory and its free space."""


class Store(abc.ABC):
    @abc.abstractmethod
    def load(self) -> list[Event]:
        """Every event acknowledged so far, in order."""

    @abc.abstractmethod
    def append(self, events: Sequence[Event]) -> "asyncio.Future[None]":
        """Queue ``events`` after every earlier call's; the future resolves once they (and so
        every earlier call's) are durable, or raises StoreError. Called synchronously, so
        order is call order. A future, so that it can be awaited more than once."""

    def healthy(self) -> bool:
        """Can the store take writes now? Health checks report NOT_SERVING when not."""
        return True

    def refusal(self) -> str:
        """Why the store cannot take writes now, in words for a refused call ("" when it can)."""
        return "" if self.healthy() else "the store cannot take writes (see the coordinator's log)"

    def leadership_lost(self) -> "asyncio.Event | None":
        """Set when this process may no longer write (an HA lease lost); None for a
        store that one process owns outright (memory, SQLite)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        pass

    async def aclose(self) -> None:
        """Release network resources and close; the default is ``close()``."""
        self.close()


class GroupCommitStore(Store):
    """Group commit for stores that write slowly (an fsync, a network round trip): while
    one write is in flight, every event that arrives queues for the next, in order. A
    failed write fails its waiters and every later one: the store is then done."""

    where = "store"  # names the file or cluster in errors
    # Under load, wait this long before a commit so that more appends join it (PostgreSQL's
    # commit_delay with commit_siblings): only when the previous commit had company, so a
    # lone append is written at once.
    commit_delay_s = 0.0

    def __init__(self, mark: Optional["DurableMark"] = None) -> None:
        from meshgate.coordinator.store.codec import GENESIS

        self._next_seq = 1
        self._head = GENESIS  # the chain sum of record _next_seq - 1
        self.mark = mark
        self._pending: list[tuple[Sequence[Event], asyncio.Future]] = []
        self._writer: asyncio.Task | None = None
        self._failed: BaseException | None = None
        self._had_company = False  # the latest commit carried more than one append
        held = os.environ.get(HOLD_COMMITS_ENV)
        self._hold = Path(held) if held else None
        if self._hold is not None:
            log.warning(
                "TEST HOOK %s=%s: commits wait while that file exists; never in production", HOLD_COMMITS_ENV, held
            )
        self._test_delay_s = float(os.environ.get(COMMIT_DELAY_ENV) or 0) / 1000
        if self._test_delay_s:
            log.warning(
                "TEST HOOK %s=%s: every commit is slowed; never in production",
                COMMIT_DELAY_ENV,
                os.environ[COMMIT_DELAY_ENV],
            )

    @abc.abstractmethod
    async def _write(self, rows: list[tuple[int, str]], then: Callable[[], None] | None = None) -> None:
        """Persist these (sequence number, record text) rows durably, all or none; then,
        only once they are, run ``then`` (blocking: the high-water mark's advance), in the
        same thread hop where the write itself is one."""

    async def _wait_while_held(self) -> None:
        if self._hold is None or not self._hold.exists():
            return
        try:
            passes = self._hold.read_text().strip()
        except FileNotFoundError:  # removed since: nothing to hold
            return
        if passes.isdigit() and int(passes) > 0:  # let this one through, and count it
            self._hold.write_text(str(int(passes) - 1))
            return
        self._hold.with_name(self._hold.name + ".held").touch()
        while self._hold.exists():
            await asyncio.sleep(0.01)

    def _fail(self, exc: BaseException) -> None:
        if self._failed is None:
            self._failed = exc

    def append(self, events: Sequence[Event]) -> "asyncio.Future[None]":
        future = asyncio.get_running_loop().create_future()
        if self._failed is not None:
            future.set_exception(StoreError(f"{self.where}: store failed earlier: {self._failed}"))
            return future
        self._pending.append((events, future))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.ensure_future(self._write_loop())
        return future

    async def _write_loop(self) -> None:
        while self._pending:
            if self.commit_delay_s and self._had_company:
                await asyncio.sleep(self.commit_delay_s)
            batch, self._pending = self._pending, []
            self._had_company = len(batch) > 1
            from meshgate.coordinator.store.codec import encode_record

            rows = []
            for events, _ in batch:
                for event in events:
                    text, self._head = encode_record(self._next_seq, self._head, event)
                    rows.append((self._next_seq, text))
                    self._next_seq += 1
            try:
                await self._wait_while_held()
                if self._test_delay_s:
                    await asyncio.sleep(self._test_delay_s)
                # The mark advances before anyone is answered.
                mark = self.mark
                await self._write(rows, None if mark is None else partial(mark.advance, self._next_seq - 1, self._head))
            except Exception as exc:  # noqa: BLE001 - every waiter learns why
                self._fail(exc)
                for _, future in batch + self._pending:
                    if not future.done():
                        future.set_exception(StoreError(f"{self.where}: write failed: {exc}"))
                self._pending = []
                return
            for _, future in batch:
                if not future.done():
                    future.set_result(None)


class MemoryStore(Store):
    """Keeps events in memory: a restart forgets everything. For tests and the demo."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def load(self) -> list[Event]:
        return list(self.events)

    def append(self, events: Sequence[Event]) -> "asyncio.Future[None]":
        self.events.extend(events)
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


def open_store(
    kind: str,
    *,
    state_dir: Path,
    job_id: str,
    pin: Optional["JobPinned"] = None,
    mark: Optional["DurableMark"] = None,
    **options: Any,
) -> Store:
    """``pin``: what the log must be for (codec.job_pin of the config); ``mark``: the
    high-water mark the log must reach. Both are required for sqlite."""
    if kind == "memory":
        return MemoryStore()
    if kind == "sqlite":
        from meshgate.coordinator.store.sqlite import SQLiteStore

        if pin is None or mark is None:
            raise StoreError('[store] kind = "sqlite" needs the job\'s pin and a high-water mark')
        return SQLiteStore(Path(state_dir) / "state.sqlite3", pin, mark)
    raise StoreError(f"[store] kind {kind!r} is not known; use memory, sqlite or etcd")
