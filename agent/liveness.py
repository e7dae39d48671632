"""When the agent sends its next heartbeat, and how long it waits for each (issue #14).

The coordinator declares a node lost when more than ``misses × interval`` passes without a
heartbeat *received* (``interval`` is the one the coordinator hands out at Join). The old loop
waited up to a whole interval for a heartbeat RPC to time out and then slept another interval,
so a link blip of length b could leave b + 2 intervals between received heartbeats: with
interval 1 s and misses 3, a 2.5 s blip was a loss, and even a 2 s one could be.

This cadence bounds that gap by b + 7/8 of an interval:

* beats start every half interval, timed from the *start* of the previous beat, so the last
  beat before any blip is at most half an interval old when it begins;
* each heartbeat RPC waits at most a quarter interval;
* a failed beat is retried an eighth of an interval after it failed, so after the link is
  back the next beat starts within 3/8 of an interval.

The bound: a blip shorter than ``(misses - 1) × interval`` never costs the node (the 1/8
interval left over covers the round trip). A longer outage is declared by the coordinator's
sweep, which runs every half interval, at most half an interval after ``misses × interval``
without a heartbeat received.

Pure: times are plain floats from whatever clock the caller uses.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeartbeatCadence:
    interval_s: float  # the coordinator's heartbeat interval

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"heartbeat interval must be positive, got {self.interval_s!r}")

    @property
    def period_s(self) -> float:
        """Time between the starts of two beats while the coordinator answers."""
        return self.interval_s / 2

    @property
    def rpc_timeout_s(self) -> float:
        """How long one heartbeat RPC may take."""
        return self.interval_s / 4

    @property
    def retry_s(self) -> float:
        """The pause after a failed beat before the next try."""
        return self.interval_s / 8

    def next_start(self, started_at: float, finished_at: float, ok: bool) -> float:
        """When the beat after one that started at ``started_at`` and ended at ``finished_at``
        (``ok``: the coordinator answered) should start."""
        if ok:
            return max(started_at + self.period_s, finished_at)
        return finished_at + self.retry_s
