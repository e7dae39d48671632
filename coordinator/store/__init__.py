"""The persistence seam. The owner applies every state change (an Event of
coordinator.rendezvous) and hands it to ``Store.append`` in the same step, and
answers the RPC only once the returned awaitable says the events are durable. On
start it replays ``load()``. Backends: memory (tests, demo), sqlite (the embedded
default), etcd (HA).
"""

from __future__ import annotations

import abc
import asyncio
from pathlib import Path
from typing import Any, Awaitable, Sequence

from meshgate.coordinator.rendezvous import Event


class StoreError(Exception):
    """The store cannot be read or written; the message names the file or key."""


class Store(abc.ABC):
    @abc.abstractmethod
    def load(self) -> list[Event]:
        """Every event acknowledged so far, in order."""

    @abc.abstractmethod
    def append(self, events: Sequence[Event]) -> Awaitable[None]:
        """Queue ``events`` after every earlier call's; the awaitable resolves once they are
        durable, or raises StoreError. Called synchronously, so order is call order."""

    def healthy(self) -> bool:
        """Can the store take writes now? Health checks report NOT_SERVING when not."""
        return True

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

    def __init__(self) -> None:
        self._next_seq = 1
        self._pending: list[tuple[Sequence[Event], asyncio.Future]] = []
        self._writer: asyncio.Task | None = None
        self._failed: BaseException | None = None

    @abc.abstractmethod
    async def _write(self, numbered: list[tuple[int, Event]]) -> None:
        """Persist these (sequence number, event) pairs durably, all or none."""

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
            batch, self._pending = self._pending, []
            numbered = []
            for events, _ in batch:
                for event in events:
                    numbered.append((self._next_seq, event))
                    self._next_seq += 1
            try:
                await self._write(numbered)
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

    def append(self, events: Sequence[Event]) -> Awaitable[None]:
        self.events.extend(events)
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


def open_store(kind: str, *, state_dir: Path, job_id: str, **options: Any) -> Store:
    if kind == "memory":
        return MemoryStore()
    if kind == "sqlite":
        from meshgate.coordinator.store.sqlite import SQLiteStore

        return SQLiteStore(Path(state_dir) / "state.sqlite3", job_id)
    raise StoreError(f"[store] kind {kind!r} is not known; use memory, sqlite or etcd")
