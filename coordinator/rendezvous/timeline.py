"""What happened to one job's rendezvous, in order, folded from its events as they are
applied (live, and on replay): nodes joined, ranks registered (one span per generation,
never one line per rank), the world formed, generations changed, nodes lost or left,
workers exited 0, the job failed. `meshgate job show --timeline` shows it after the
cluster's own moments (coordinator/cluster_state/timeline.py). Pure; bounded in memory
(O(nodes shown + entries kept), whatever the world size)."""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from meshgate.logs import cancelled
from meshgate.coordinator.rendezvous.events import (
    Event,
    GenerationBumped,
    JobFailed,
    NodeAdopted,
    NodeJoined,
    NodeReplaced,
    NodeStateChanged,
    RankAssigned,
    WorkerSucceeded,
)

MAX_NODES_SHOWN = 32  # node joins listed one by one; the rest are counted in one entry
MAX_ENTRIES = 256  # the other rendezvous entries kept; the earliest beyond are dropped and counted


class Moment(enum.Enum):
    """What an entry of a job's timeline says happened; the proto's TimelineMoment
    (TIMELINE_<NAME>) spells the same names."""

    SUBMITTED = "submitted"
    ALLOCATED = "allocated"
    NODE_JOINED = "node joined"
    RANKS_REGISTERED = "ranks registered"
    WORLD_FORMED = "world formed"
    GENERATION_CHANGED = "generation changed"
    NODE_CHANGED = "node changed"
    WORKERS_EXITED = "workers exited 0"
    JOB_FAILED = "job failed"
    ENDED = "ended"
    LOG_PRUNED = "log pruned"
    PROGRESS = "progress"


@dataclass(frozen=True)
class Entry:
    """One line of a timeline. ``until``: the end of a span (ranks registered, workers
    exited: the first at ``at``, the last at ``until``); ``count``: how many it sums up."""

    moment: Moment
    at: float
    generation: int = 0
    detail: str = ""
    node_id: str = ""
    until: float = 0.0
    count: int = 0


@dataclass
class _Span:
    first: float
    last: float
    count: int = 0

    def entry(self, moment: Moment, generation: int, detail: str) -> Entry:
        return Entry(moment, self.first, generation, detail, until=self.last, count=self.count)


@dataclass
class Timeline:
    """The fold: ``add`` each event after the state applied it (``complete``: the state's
    world is complete now). ``entries()`` is what it came to so far, in time order. Data
    (compared by value), like the state it is part of."""

    generation: int = 0
    kept: deque[Entry] = field(default_factory=lambda: deque(maxlen=MAX_ENTRIES))
    dropped: int = 0
    nodes: list[Entry] = field(default_factory=list)  # the first MAX_NODES_SHOWN node joins
    more_nodes: Optional[_Span] = None  # the joins beyond them
    registering: Optional[_Span] = None  # the current generation's registrations
    formed: bool = False  # the current generation's world formed
    succeeding: Optional[_Span] = None  # the current generation's clean exits
    last_at: float = 0.0  # the latest time an event carried (dates an untimed bump of an old log)
    world_size: int = 0  # the state's, as of the event being added

    def add(self, event: Event, complete: bool, world_size: int = 0) -> None:
        at = getattr(event, "at", 0.0) or self.last_at
        self.world_size = world_size
        self.last_at = max(self.last_at, at)
        handler = _HANDLERS.get(type(event))
        if handler is not None:
            handler(self, event, at, complete)

    def _keep(self, entry: Entry) -> None:
        if len(self.kept) == self.kept.maxlen:
            self.dropped += 1
        self.kept.append(entry)

    def _node_joined(self, node_id: str, at: float, detail: str) -> None:
        if len(self.nodes) < MAX_NODES_SHOWN:
            self.nodes.append(Entry(Moment.NODE_JOINED, at, self.generation, detail, node_id))
        elif self.more_nodes is None:
            self.more_nodes = _Span(at, at, 1)
        else:
            self.more_nodes.last, self.more_nodes.count = at, self.more_nodes.count + 1

    def _close_generation(self) -> None:
        """The generation ended (bump, failure): its open spans become entries."""
        for entry in self._open_spans():
            self._keep(entry)
        self.registering = self.succeeding = None

    def _open_spans(self) -> list[Entry]:
        out = []
        if self.registering is not None and not self.formed:
            out.append(self.registering.entry(Moment.RANKS_REGISTERED, self.generation, "the world never formed"))
        if self.succeeding is not None:
            out.append(self.succeeding.entry(Moment.WORKERS_EXITED, self.generation, "exit 0"))
        return out

    def entries(self) -> list[Entry]:
        """Every entry so far (the open spans of the current generation too), by time;
        entries of one time keep the order they happened in."""
        shown = list(self.nodes)
        if self.more_nodes is not None:
            span = self.more_nodes
            shown.append(
                Entry(
                    Moment.NODE_JOINED, span.first, 0, f"and {span.count} more nodes", until=span.last, count=span.count
                )
            )
        shown += list(self.kept) + self._open_spans()
        return sorted(shown, key=lambda e: e.at)


def _node_joined(t: Timeline, event: NodeJoined, at: float, complete: bool) -> None:
    where = f"node_rank {event.node_rank}" if event.node_rank >= 0 else "a spare"
    host = f" on {event.hostname}" if event.hostname and event.hostname != event.node_id else ""
    kind = f"{event.slot_kind} " if event.slot_kind else ""
    slots = f", {event.slots} {kind}slot{'s' * (event.slots != 1)}" if event.slots else ""
    how = "" if event.hostname else " (named by a worker's Register)"
    t._node_joined(event.node_id, at, f"{where}{host}{slots}{how}")


def _node_adopted(t: Timeline, event: NodeAdopted, at: float, complete: bool) -> None:
    t._node_joined(event.node_id, at, "its agent joined (its workers had registered first)")


def _rank_assigned(t: Timeline, event: RankAssigned, at: float, complete: bool) -> None:
    span = t.registering
    if span is None:
        span = t.registering = _Span(at, at)
    span.last, span.count = at, span.count + 1
    if complete and not t.formed:
        t.formed = True
        t._keep(span.entry(Moment.RANKS_REGISTERED, t.generation, ""))
        # The world's size, not the span's: after a lost node, only the new holders
        # register anew (the survivors keep their ranks), and "2 ranks" for a 4-rank world
        # read as half a world.
        t._keep(Entry(Moment.WORLD_FORMED, at, t.generation, f"{t.world_size or span.count} ranks"))


def _generation_bumped(t: Timeline, event: GenerationBumped, at: float, complete: bool) -> None:
    t._close_generation()
    t.generation, t.formed = event.generation, False
    why = "a worker failed: " if event.worker_restart else ""
    t._keep(Entry(Moment.GENERATION_CHANGED, at, event.generation, why + event.reason))


def _node_state_changed(t: Timeline, event: NodeStateChanged, at: float, complete: bool) -> None:
    because = f": {event.reason}" if event.reason else ""
    t._keep(Entry(Moment.NODE_CHANGED, at, t.generation, f"{event.state.value}{because}", event.node_id))


def _node_replaced(t: Timeline, event: NodeReplaced, at: float, complete: bool) -> None:
    detail = f"spare takes node_rank {event.node_rank} of {event.lost_id!r}"
    t._keep(Entry(Moment.NODE_CHANGED, at, t.generation, detail, event.spare_id))


def _job_failed(t: Timeline, event: JobFailed, at: float, complete: bool) -> None:
    t._close_generation()
    if not cancelled(event.reason):  # a cancel is no failure: the job's end (ENDED, CANCELLED) says who and why
        t._keep(Entry(Moment.JOB_FAILED, at, t.generation, event.reason))


def _worker_succeeded(t: Timeline, event: WorkerSucceeded, at: float, complete: bool) -> None:
    if event.generation != t.generation:
        return
    span = t.succeeding
    if span is None:
        span = t.succeeding = _Span(at, at)
    span.last, span.count = at, span.count + 1


_HANDLERS: dict[type, Callable[[Timeline, Event, float, bool], None]] = {
    NodeJoined: _node_joined,
    NodeAdopted: _node_adopted,
    RankAssigned: _rank_assigned,
    GenerationBumped: _generation_bumped,
    NodeStateChanged: _node_state_changed,
    NodeReplaced: _node_replaced,
    JobFailed: _job_failed,
    WorkerSucceeded: _worker_succeeded,
}  # the rest (keys, tokens, masters) say nothing a timeline shows


__all__ = ["MAX_ENTRIES", "MAX_NODES_SHOWN", "Entry", "Moment", "Timeline"]
