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

from coordinator.rendezvous import Event


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

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


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
        from coordinator.store.sqlite import SQLiteStore

        return SQLiteStore(Path(state_dir) / "state.sqlite3", job_id)
    raise StoreError(f"[store] kind {kind!r} is not known; use memory, sqlite or etcd")
