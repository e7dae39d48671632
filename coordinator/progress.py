"""A running job's training progress, from what its workers report (``meshgate.report``)
through their agents' heartbeats: the step it is at, how fast it goes, and which node is
slow (a straggler score per node, as NVRx's straggler detection and MegaScale give one).

Liveness, like a node's last seen: kept in memory while the job runs (a restarted
coordinator learns it again at the next heartbeats), dropped when its generation changes
for a node, and kept in the job's summary once it ended. Bounded: one entry per node of
the job, one sample per local rank. Pure: ``now`` is passed in.

A node's step time is what its workers measure of their own steps when they report it
(in a synchronous job every rank advances at the pace of the slowest, so only a rank's own
compute time tells which one holds the others), else the time between its reported steps.
A straggler is the node whose step time is the largest, when it is at least
``STRAGGLER_RATIO`` times the median node's, with two or more nodes reporting."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Iterable, Optional

from meshgate.v1 import nodes_pb2, rendezvous_pb2

STRAGGLER_RATIO = 1.2
MAX_STEP = 1 << 62  # a step above this is refused as a bad report
# How far back a node's rate looks: its report of at least this long ago (so a rate is not
# the noise of two reports a moment apart), the latest such.
RATE_WINDOW_S = 5.0


@dataclass
class NodeProgress:
    """One node's latest reports, and the one its rate is measured from."""

    generation: int
    samples: dict[int, nodes_pb2.RankProgress] = field(default_factory=dict)  # by local rank
    base: tuple[int, float] = (0, 0.0)  # (step, at) its rate is measured from
    rate: float = 0.0  # steps per second between base and the latest
    step: int = 0
    at: float = 0.0

    def note(self, samples: Iterable[nodes_pb2.RankProgress]) -> bool:
        """Take a heartbeat's samples; did the node's step advance?"""
        for sample in samples:
            self.samples[sample.local_rank] = sample
        if not self.samples:
            return False
        step = min(s.step for s in self.samples.values())  # the node is as far as its slowest rank
        at = max(s.at for s in self.samples.values())
        advanced = step > self.step
        if advanced:
            base_step, base_at = self.base
            if base_at and at > base_at and step > base_step:
                self.rate = (step - base_step) / (at - base_at)
            if not base_at or at - base_at >= RATE_WINDOW_S:
                self.base = (step, at)
        self.step, self.at = step, at
        return advanced

    @property
    def step_time_s(self) -> float:
        """Its workers' own (the slowest rank's), else the time between its steps; 0: unknown."""
        own = [s.step_time_s for s in self.samples.values() if s.HasField("step_time_s") and s.step_time_s > 0]
        if own:
            return max(own)
        return 1.0 / self.rate if self.rate > 0 else 0.0


@dataclass
class JobProgress:
    """What a job's nodes reported, by node id, and when its step last advanced."""

    nodes: dict[str, NodeProgress] = field(default_factory=dict)
    last_step_at: float = 0.0  # the coordinator's clock

    def note(self, node_id: str, generation: int, samples: Iterable[nodes_pb2.RankProgress], now: float) -> None:
        """A heartbeat's progress for ``node_id`` in ``generation``: a node's reports of an
        earlier generation are forgotten (its workers began again)."""
        samples = list(samples)
        node = self.nodes.get(node_id)
        if node is None or node.generation != generation:
            if not samples:
                return
            node = self.nodes[node_id] = NodeProgress(generation)
        if node.note(samples):
            self.last_step_at = now

    def straggler(self) -> tuple[str, float]:
        """(node, its step time over the median node's), or ("", 0.0) when none stands out."""
        times = {n: p.step_time_s for n, p in self.nodes.items() if p.step_time_s > 0}
        if len(times) < 2:
            return "", 0.0
        median = statistics.median(times.values())
        slowest = max(sorted(times), key=lambda n: times[n])
        ratio = times[slowest] / median if median > 0 else 0.0
        return (slowest, ratio) if ratio >= STRAGGLER_RATIO else ("", 0.0)

    def message(self, node_order: list[str]) -> Optional[rendezvous_pb2.JobProgress]:
        """The job's progress as Status.progress shows it (``node_order``: its nodes in node
        rank order, for whose loss is shown); None while no node reported."""
        reporting = {n: p for n, p in self.nodes.items() if p.samples}
        if not reporting:
            return None
        steps = [p.step for p in reporting.values()]
        rates = [p.rate for p in reporting.values() if p.rate > 0]
        straggler, ratio = self.straggler()
        reply = rendezvous_pb2.JobProgress(
            step=max(steps),
            slowest_step=min(steps),
            steps_per_s=statistics.median(rates) if rates else 0.0,
            nodes_reporting=len(reporting),
            straggler=straggler,
            straggler_ratio=ratio,
            samples_per_s=sum(
                s.samples_per_s for p in reporting.values() for s in p.samples.values() if s.HasField("samples_per_s")
            ),
        )
        if self.last_step_at:
            reply.last_step_at.FromNanoseconds(int(self.last_step_at * 1e9))
        first = next((reporting[n] for n in node_order if n in reporting), None)
        losses = [] if first is None else [s for _, s in sorted(first.samples.items()) if s.HasField("loss")]
        if losses:
            reply.loss = losses[0].loss
        return reply


class ProgressBoard:
    """Every running job's progress, by job id (the cluster holds one)."""

    def __init__(self) -> None:
        self.jobs: dict[str, JobProgress] = {}

    def note(
        self, job_id: str, node_id: str, generation: int, samples: Iterable[nodes_pb2.RankProgress], now: float
    ) -> None:
        samples = list(samples)
        if samples or job_id in self.jobs:
            self.jobs.setdefault(job_id, JobProgress()).note(node_id, generation, samples, now)

    def message(self, job_id: str, node_order: list[str]) -> Optional[rendezvous_pb2.JobProgress]:
        job = self.jobs.get(job_id)
        return None if job is None else job.message(node_order)

    def node(self, job_id: str, node_id: str) -> Optional[NodeProgress]:
        job = self.jobs.get(job_id)
        return None if job is None else job.nodes.get(node_id)

    def drop(self, job_id: str) -> None:
        self.jobs.pop(job_id, None)


def check_samples(samples: Iterable[nodes_pb2.RankProgress], slots: int) -> Optional[str]:
    """Why a heartbeat's progress is refused (naming the field and value), or None: at most
    one sample per local rank, each of a local rank the node has, a step in range, finite
    numbers that are not negative."""
    seen: set[int] = set()
    for sample in samples:
        if sample.local_rank >= max(slots, 1) or sample.local_rank in seen:
            return f"progress local_rank {sample.local_rank} is not one of this node's {slots} (or is listed twice)"
        seen.add(sample.local_rank)
        if sample.step > MAX_STEP:
            return f"progress step {sample.step} is out of range"
        for name in ("at", "loss", "samples_per_s", "step_time_s"):
            value = getattr(sample, name)
            if value != value or value in (float("inf"), float("-inf")) or (name != "loss" and value < 0):
                return f"progress {name} {value!r} of local_rank {sample.local_rank} is not a finite number >= 0"
    return None


__all__ = ["JobProgress", "NodeProgress", "ProgressBoard", "STRAGGLER_RATIO", "check_samples"]
