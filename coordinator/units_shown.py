"""Waiting for an ended job's nodes to show its processes gone, so that a cancel answers
CANCELLED only once nothing of the job runs (or says which nodes did not show it in time).

What a node shows is its agent's heartbeat's live_units (cluster_state/pool.note_units);
which nodes may still run the job is the pure ``ClusterState.clearing``. This only wakes
the waiters on each heartbeat noted and bounds their wait."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Callable

from meshgate.coordinator.cluster_state.ends import NotShownGone

if TYPE_CHECKING:
    from meshgate.coordinator.jobs import ClusterState


CANCEL_STOP_S = 30.0  # an agent's stop of a unit: its drain grace (10 s by default) and the kill's wait


class UnitsShown:
    def __init__(self, state: ClusterState, clock: Callable[[], float]) -> None:
        self.state, self.clock = state, clock
        self._noted = asyncio.Event()

    @property
    def wait_s(self) -> float:
        """How long a cancel waits for its nodes: each learns of the end on its next heartbeat,
        stops the job's unit (SIGTERM, its drain grace, SIGKILL) and shows it empty on the one
        after: twice the heartbeat timeout, and CANCEL_STOP_S for the stop."""
        return 2 * self.state.heartbeat_timeout_s + CANCEL_STOP_S

    def noted(self) -> None:
        """A node's heartbeat was noted: every waiter looks again."""
        noted, self._noted = self._noted, asyncio.Event()
        noted.set()

    async def until_gone(self, job_id: str, within_s: float) -> None:
        """Returns once every node of ``job_id`` showed its processes gone; NotShownGone
        naming the nodes that did not within ``within_s`` (at once when only silent nodes
        are left: nothing will be heard of them meanwhile)."""
        started = time.monotonic()
        while True:
            left = self.state.clearing(job_id, self.clock())
            remaining = within_s - (time.monotonic() - started)
            if left.gone:
                return
            if not left.waiting or remaining <= 0:
                raise NotShownGone(job_id, left, time.monotonic() - started)
            try:
                await asyncio.wait_for(self._noted.wait(), remaining)
            except asyncio.TimeoutError:
                pass


__all__ = ["UnitsShown"]
