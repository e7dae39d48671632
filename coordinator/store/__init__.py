"""The persistence seam. The owner writes every state change (an Event of
coordinator.rendezvous) through a Store before it acknowledges it, and replays
``load()`` on start. Issue #6 adds SQLite and etcd behind this same interface.
"""

from __future__ import annotations

import abc
from typing import Sequence

from coordinator.rendezvous import Event


class StoreError(Exception):
    """The store cannot be read or written; the message names the file or key."""


class Store(abc.ABC):
    @abc.abstractmethod
    def load(self) -> list[Event]:
        """Every event acknowledged so far, in order."""

    @abc.abstractmethod
    async def append(self, events: Sequence[Event]) -> None:
        """Persist ``events`` durably, all or none, before the caller acknowledges them."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


class MemoryStore(Store):
    """Keeps events in memory: a restart forgets everything. For tests and the demo."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def load(self) -> list[Event]:
        return list(self.events)

    async def append(self, events: Sequence[Event]) -> None:
        self.events.extend(events)


def open_store(kind: str, **options) -> Store:
    if kind == "memory":
        return MemoryStore()
    raise StoreError(f"store kind {kind!r} is not available; known: memory")
