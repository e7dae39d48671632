"""Which nodes may take a new job, besides being idle: an operator's cordon, the
coordinator's quarantine of a repeat offender, and the node's own health check (issue #30).
Pure: ``now`` is passed in; ``decide_*`` returns events (or raises RendezvousError naming
the field), and the liveness parts (a node's latest check) are noted, never persisted.

A node's hold, in the order it is shown: cordoned (an operator said so; only an operator
lifts it), quarantined (failures attributed to it reached [cluster] quarantine_after within
quarantine_window; an uncordon or a passing check lifts it), unhealthy (its check fails now;
a passing check returns it). A held node keeps the job it serves; pool.idle_nodes never
offers it to another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from meshgate.coordinator.cluster_state.events import (
    ClusterEvent,
    NodeCordoned,
    NodeDrained,
    NodeFailureCounted,
    NodeQuarantined,
    NodeQuarantineLifted,
    NodeUncordoned,
)
from meshgate.coordinator.cluster_state.model import Caller, ClusterNode, JobState, PoolState, UncordonAsked
from meshgate.coordinator.rendezvous import Code, RendezvousError, check_id, shown

if TYPE_CHECKING:
    from meshgate.coordinator.jobs import ClusterState
    from meshgate.v1.nodes_pb2 import NodeHealth

MAX_REASON_LEN = 200  # an operator's cordon reason
MAX_HEALTH_SUMMARY = 512  # a health check's summary, as NodeHealth.summary says


@dataclass(frozen=True)
class QuarantinePolicy:
    """[cluster] quarantine_after (0: never quarantine) and quarantine_window (seconds)."""

    after: int = 3
    window_s: float = 3600.0


def hold(node: ClusterNode) -> Optional[tuple[PoolState, str]]:
    """Why ``node`` may take no new job, the strongest hold first; None when nothing holds it."""
    if node.cordon:
        return PoolState.CORDONED, node.cordon
    if node.quarantine:
        return PoolState.QUARANTINED, node.quarantine
    if node.unhealthy:
        return PoolState.UNHEALTHY, node.unhealthy
    return None


def recent_failures(cluster: ClusterState, node: ClusterNode, now: float) -> list[tuple[float, str]]:
    """The failures attributed to ``node`` within the quarantine window before ``now``."""
    return [(at, why) for at, why in node.failures if now - at <= cluster.quarantine.window_s]


def cordon_text(by: str, reason: str) -> str:
    """How a cordon is kept and shown: who set it and why."""
    return f"by {by or '(anonymous)'}: {reason}"


def known_node(cluster: ClusterState, node_id: str) -> ClusterNode:
    check_id("node_id", node_id)
    node = cluster.nodes.get(node_id)
    if node is None:
        raise RendezvousError(
            Code.NOT_FOUND, f"node_id {node_id!r} has not joined this cluster (meshgate nodes lists them)"
        )
    return node


def decide_cordon(
    cluster: ClusterState, node_id: str, reason: str, caller: Caller, now: float
) -> tuple[ClusterEvent, ...]:
    """An operator's cordon: the node takes no new job. A cordon of a cordoned node with
    another reason replaces the reason (the latest operator's word is shown)."""
    node = known_node(cluster, node_id)
    reason = checked_reason(reason, "cordoned")
    if node.cordon == cordon_text(caller.owner, reason):
        return ()
    return (NodeCordoned(node_id, reason, caller.owner, now),)


def checked_reason(reason: str, what: str) -> str:
    """An operator's reason, stripped: INVALID_ARGUMENT naming it unless one line of text."""
    reason = reason.strip()
    if not reason:
        raise RendezvousError(Code.INVALID_ARGUMENT, f"reason is required: say why the node is {what} (--reason)")
    if len(reason) > MAX_REASON_LEN or "\n" in reason:
        raise RendezvousError(
            Code.INVALID_ARGUMENT,
            f"reason must be one line of at most {MAX_REASON_LEN} characters, got {shown(reason)}",
        )
    return reason


def decide_drain(
    cluster: ClusterState, node_id: str, reason: str, caller: Caller, now: float
) -> tuple[ClusterEvent, ...]:
    """An operator's drain: a cordon, and the node leaves the job it serves (RUNNING), whose
    block goes to a spare or a node of the pool in a new generation. A node serving a job
    its coordinator's config declares is drained by stopping its agent (its Leave), never
    from here: that job has no allocation to take a node out of."""
    node = known_node(cluster, node_id)
    reason = checked_reason(reason, "drained")
    job = cluster.jobs.get(node.job_id) if node.job_id else None
    if job is not None and job.declared:
        raise RendezvousError(
            Code.FAILED_PRECONDITION,
            f"node_id {node_id!r} serves job {node.job_id!r}, which the coordinator's config declares: drain it by "
            "stopping its agent (systemctl stop meshgate-agent; it leaves the job first), or cordon it",
        )
    running = node.job_id if job is not None and job.state is JobState.RUNNING else ""
    if not running and node.cordon == cordon_text(caller.owner, reason):
        return ()
    return (NodeDrained(node_id, running, reason, caller.owner, now),)


def check_not_drained(cluster: ClusterState, node_id: str, job_id: str) -> None:
    """FAILED_PRECONDITION for a Join of a node to the job an operator drained it out of:
    it serves no part of that job again (its agent goes back to the pool)."""
    node = cluster.nodes.get(node_id)
    if node is not None and node.drained_from and node.drained_from == job_id:
        raise RendezvousError(
            Code.FAILED_PRECONDITION,
            f"node_id {node_id!r} was drained out of job {job_id!r} ({node.cordon}): it takes no part in it again",
        )


def decide_uncordon(cluster: ClusterState, node_id: str, caller: Caller, now: float) -> tuple[ClusterEvent, ...]:
    """An operator returns the node: its cordon and quarantine go, its failures are
    forgotten. A failing health check still holds it (unhealthy) until a check passes."""
    node = known_node(cluster, node_id)
    if not (node.cordon or node.quarantine or node.failures):
        return ()
    return (NodeUncordoned(node_id, caller.owner, now),)


def uncordon_waits(node: ClusterNode) -> bool:
    """An uncordon of a node whose agent runs a health check returns it only once a check run
    after the uncordon passes (issue #30): a cordon is a suspicion of the hardware, and the
    check it passed before says nothing of the repair. A node whose agent runs no check (it
    never reported one) returns at once."""
    return node.checked is not None


def note_no_health(cluster: ClusterState, node_id: str) -> None:
    """Its agent reports no check (none configured, or a restart without one): no earlier
    check's failure holds it, and an uncordon no longer waits for one."""
    node = cluster.nodes.get(node_id)
    if node is not None:
        node.unhealthy, node.checked = "", None


def note_uncordon_asked(cluster: ClusterState, node_id: str, caller: Caller, now: float) -> UncordonAsked:
    """The node stays held until a check counted after now passes (decide_returned)."""
    node = known_node(cluster, node_id)
    node.uncordon_asked = UncordonAsked(caller.owner, now, node.checked)
    return node.uncordon_asked


def answers_uncordon(asked: UncordonAsked, seq: int, asked_for: bool, checked: tuple[str, int]) -> bool:
    """Whether a check (NodeHealth ``seq``, ``asked_for``; ``checked``: its (agent instance,
    seq)) answers the uncordon ``asked``: one begun after its agent heard the coordinator ask,
    and not the report already seen when the uncordon was asked (an earlier ask's answer).
    An agent that numbers no checks (seq 0: a release before this) cannot be asked: its next
    passing check is taken, as its release did at once."""
    if seq == 0:
        return True
    return asked_for and checked != asked.after


def decide_returned(
    node: ClusterNode, health: NodeHealth, checked: tuple[str, int], now: float
) -> tuple[ClusterEvent, ...]:
    """An uncordon that waited for a check: the first passing check that answers it returns
    the node, in the name of the operator who asked."""
    asked = node.uncordon_asked
    if asked is None or not health.passed or not answers_uncordon(asked, health.seq, health.asked, checked):
        return ()
    return (NodeUncordoned(node.node_id, asked.by, now),)


def decide_failure(cluster: ClusterState, node_id: str, reason: str, now: float) -> tuple[ClusterEvent, ...]:
    """A failure attributed to ``node_id`` is counted; the one that brings its count within
    the window to quarantine_after quarantines it (naming the failures)."""
    node = cluster.nodes.get(node_id)
    if node is None or not reason:
        return ()
    events: tuple[ClusterEvent, ...] = (NodeFailureCounted(node_id, reason[:MAX_HEALTH_SUMMARY], now),)
    policy = cluster.quarantine
    counted = recent_failures(cluster, node, now) + [(now, reason)]
    if policy.after and not node.quarantine and len(counted) >= policy.after:
        window = f"{policy.window_s:g}s"
        latest = "; ".join(why for _, why in counted[-policy.after :])
        why = f"{len(counted)} failures within {window} (quarantine_after = {policy.after}): {latest}"
        events += (NodeQuarantined(node_id, why[:MAX_HEALTH_SUMMARY], now),)
    return events


def decide_health(
    cluster: ClusterState, node: ClusterNode, passed: bool, summary: str, now: float
) -> tuple[ClusterEvent, ...]:
    """A reported health check: one that starts failing counts as a failure of the node
    (a check failing on every idle heartbeat counts once); one that passes lifts a quarantine."""
    if passed:
        if node.quarantine:
            return (
                NodeQuarantineLifted(node.node_id, f"its health check passed: {summary}"[:MAX_HEALTH_SUMMARY], now),
            )
        return ()
    if node.unhealthy:
        return ()  # still failing: counted when it started
    return decide_failure(cluster, node.node_id, f"health check failed: {summary}", now)


def note_health(cluster: ClusterState, node_id: str, passed: bool, summary: str, checked: tuple[str, int]) -> None:
    """The node's latest check (liveness): it is unhealthy while it fails."""
    node = cluster.nodes.get(node_id)
    if node is not None:
        node.unhealthy = "" if passed else (summary.strip() or "its health check failed")[:MAX_HEALTH_SUMMARY]
        node.checked = checked


# The signals by which a worker's crash may be its node's doing (a memory or CPU fault:
# ECC, a bad DIMM, a flaky core), directly or as a shell's 128 + N. Anything else a worker
# exits with (a Python exception's 1, an abort, the OOM killer's SIGKILL) is its job's own
# failure: counting those would quarantine every node a buggy job touched.
CRASH_SIGNALS = {4: "SIGILL", 7: "SIGBUS", 11: "SIGSEGV"}


def crash_signal(exit_code: int) -> str:
    """ "SIGSEGV" for an exit by one of CRASH_SIGNALS (-11, or a shell's 139), else ""."""
    number = -exit_code if exit_code < 0 else exit_code - 128 if exit_code > 128 else 0
    return CRASH_SIGNALS.get(number, "")


def exit_blames_node(
    node_id: str,
    exit_code: int,
    stopped_by_agent: bool,
    restarts_before: int,
    restarts_after: int,
    failure_before: str,
    failure_after: str,
) -> str:
    """The failure a worker's exit attributes to its node, or "": a crash (CRASH_SIGNALS)
    its agent did not cause that restarted the job (a worker restart) or failed it naming
    that node. An exit after a peer was lost ends nothing of its own (the loss ended the
    generation), so it blames no one; a command that could not start, or that exited with
    a status of its own, is the job's fault."""
    signal = crash_signal(exit_code)
    if not signal or stopped_by_agent:
        return ""
    if restarts_after > restarts_before:
        return f"a worker crashed ({signal}) and restarted its job"
    if failure_after and not failure_before and f"on node {node_id!r} exited" in failure_after:
        return f"a worker crashed ({signal}) and failed its job"
    return ""


__all__ = [
    "MAX_HEALTH_SUMMARY",
    "MAX_REASON_LEN",
    "QuarantinePolicy",
    "check_not_drained",
    "cordon_text",
    "decide_cordon",
    "decide_drain",
    "decide_failure",
    "decide_health",
    "decide_returned",
    "decide_uncordon",
    "exit_blames_node",
    "hold",
    "note_health",
    "note_no_health",
    "note_uncordon_asked",
    "recent_failures",
    "uncordon_waits",
]
