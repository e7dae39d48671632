"""How a job ends and what is kept of it: cancel, a submitter's finish (jobs of external
workers only), the end its rendezvous came to, its time limit, the summary kept in the cluster's log,
and pruning an ended job's own log after the retention. Pure: ``now`` is passed in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from meshgate.coordinator.cluster_state.backfill import span
from meshgate.coordinator.cluster_state.events import ClusterEvent, JobEnded, JobLogPruned, JobSummarized
from meshgate.coordinator.cluster_state.model import Job, JobState
from meshgate.coordinator.rendezvous import Code, RendezvousError

if TYPE_CHECKING:
    from meshgate.coordinator.jobs import ClusterState


def decide_cancel(cluster: ClusterState, job_id: str, reason: str, now: float) -> tuple[ClusterEvent, ...]:
    job = cluster.job(job_id)
    if job.state.ended:
        raise RendezvousError(
            Code.FAILED_PRECONDITION, f"job {job_id!r} already ended: {job.state.value} ({job.reason[:200]})"
        )
    return (JobEnded(job_id, JobState.CANCELLED, one_line(reason or "cancelled"), now),)


@dataclass(frozen=True)
class Clearing:
    """An ended job's nodes whose agents have not yet shown its processes gone (their
    heartbeats' live_units): ``waiting`` are heard in time (their next heartbeat may show
    it), ``silent`` are not (nothing will show it until their agent is heard again)."""

    waiting: tuple[str, ...] = ()
    silent: tuple[str, ...] = ()

    @property
    def gone(self) -> bool:
        return not self.waiting and not self.silent


def clearing(cluster: ClusterState, job_id: str, now: float) -> Clearing:
    """Which of ``job_id``'s nodes may still run a process of it: those serving it, and those
    it left still clearing. A node shows them gone once its agent's heartbeat after the end
    lists no live unit (note_units), or once it serves another job (it was given that one
    only after it had shown them gone). A node given the job and taken away since, still
    clearing, counts too: its last unit may be this job's."""
    job = cluster.job(job_id)
    waiting: list[str] = []
    silent: list[str] = []
    for node_id in dict.fromkeys(job.given):
        node = cluster.nodes.get(node_id)
        serving, cleared = node is not None and node.job_id == job_id, node is None or node.units_clear
        if not serving and (cleared or node.job_id):
            continue
        (waiting if cluster.is_live(node, now) else silent).append(node_id)
    return Clearing(tuple(waiting), tuple(silent))


class NotShownGone(RendezvousError):
    """The answer to a cancel whose nodes did not all show the job's processes gone in time:
    the job is CANCELLED (durably; its nodes stay out of the pool until they show it), but the
    caller must not read the answer as "nothing of it runs"."""

    def __init__(self, job_id: str, left: Clearing, waited_s: float) -> None:
        parts = []
        if left.waiting:
            parts.append(f"{shown_nodes(left.waiting)} did not show them gone within {waited_s:.1f}s")
        if left.silent:
            parts.append(f"{shown_nodes(left.silent)} not heard within the heartbeat timeout")
        super().__init__(
            Code.DEADLINE_EXCEEDED,
            f"job {job_id!r} is CANCELLED, but its processes are not confirmed gone: node(s) "
            f"{'; node(s) '.join(parts)} (each stays out of the pool until its agent shows the job's unit "
            "empty; `meshgate nodes` shows it clearing)",
        )
        self.left = left


def shown_nodes(node_ids: tuple[str, ...], most: int = 16) -> str:
    more = f" and {len(node_ids) - most} more" if len(node_ids) > most else ""
    return ", ".join(node_ids[:most]) + more


def decide_finish(
    cluster: ClusterState, job_id: str, succeeded: bool, reason: str, now: float
) -> tuple[ClusterEvent, ...]:
    """A job of external workers (no command) ends when its submitter says so; one whose
    agents launch a command ends from its workers' exits, never by word."""
    job = cluster.job(job_id)
    if job.state is not JobState.RUNNING:
        raise RendezvousError(
            Code.FAILED_PRECONDITION, f"job {job_id!r} is {job.state.value}, not RUNNING: nothing to finish"
        )
    if job.spec.command:
        raise RendezvousError(
            Code.FAILED_PRECONDITION,
            f"job {job_id!r} runs a command on its nodes: it ends from its workers' exits "
            "(FinishJob is for jobs of external workers, e.g. Ray); cancel it instead",
        )
    state = JobState.SUCCEEDED if succeeded else JobState.FAILED
    text = one_line(reason or ("finished by its submitter" if succeeded else "failed, said its submitter"))
    return (JobEnded(job_id, state, text, now),)


def decide_end(
    cluster: ClusterState, job_id: str, state: JobState, reason: str, now: float
) -> tuple[ClusterEvent, ...]:
    job = cluster.jobs[job_id]
    if job.state is not JobState.RUNNING or not state.ended:
        return ()
    return (JobEnded(job_id, state, reason, now),)


def decide_time_limits(cluster: ClusterState, now: float) -> tuple[ClusterEvent, ...]:
    """RUNNING jobs that have run their time limit end FAILED, saying so: the scheduler
    plans reservations by time limits, so a job must not outlive its own. (The running
    jobs are those the nodes serve: what a tick costs is the pool, not every job kept.)"""
    events: list[ClusterEvent] = []
    for job_id in dict.fromkeys(n.job_id for n in cluster.nodes.values() if n.job_id):
        job = cluster.jobs[job_id]
        limit = job.spec.time_limit_s
        if job.state is JobState.RUNNING and limit and job.allocated_at + limit <= now:
            events.append(JobEnded(job_id, JobState.FAILED, f"time limit {span(limit)} reached", now))
    return tuple(events)


def decide_launch_deadlines(
    cluster: ClusterState, missing: Mapping[str, tuple[str, ...]], now: float
) -> tuple[ClusterEvent, ...]:
    """RUNNING jobs whose launchers register their workers (JobSpec.launchers_register:
    torchrun, Ray, an sbatch script, nothing meshgate starts; or a per-node job's launcher,
    which the agents start) that have not all come within the job's launch deadline end
    FAILED, naming the nodes that never came, so nobody waits on them for good. ``missing``:
    each such job's nodes whose workers have not all registered
    (RendezvousState.launchers_missing)."""
    events: list[ClusterEvent] = []
    for job_id, absent in missing.items():
        job = cluster.jobs[job_id]
        deadline = job.spec.launch_deadline_s
        if job.state is not JobState.RUNNING or not job.spec.launchers_register or not absent or not deadline:
            continue  # ended, started by its agents, every launcher came, or a job from before deadlines
        if job.allocated_at + deadline <= now:
            shown = ", ".join(absent[:16]) + (f" and {len(absent) - 16} more" if len(absent) > 16 else "")
            fix = (
                "its launcher runs there but registered no worker through meshgate (meshgate job logs)"
                if job.spec.command
                else "start torchrun, Ray or the batch script there"
            )
            reason = (
                f"launch deadline {span(deadline)} reached: no launcher registered all workers of node(s) "
                f"{shown} ({fix}, or raise --launch-deadline)"
            )
            events.append(JobEnded(job_id, JobState.FAILED, reason, now))
    return tuple(events)


def decide_summarize(cluster: ClusterState, job_id: str, status: str, now: float) -> tuple[ClusterEvent, ...]:
    """An ended job's final rendezvous, once (its engine is closed after this)."""
    job = cluster.jobs[job_id]
    if not job.state.ended or job.summary:
        return ()
    return (JobSummarized(job_id, status, now),)


def decide_prune(cluster: ClusterState, now: float, retention_s: float, limit: int = 64) -> tuple[ClusterEvent, ...]:
    """Ended jobs whose own log has been kept ``retention_s`` since they ended, and the
    oldest beyond the newest ``ended_jobs_kept`` whatever their age (a flood of short jobs
    must not hold a log and a summary each for the whole retention); only summarized ones
    (a job ended before summaries existed keeps its log: it is read from there). At most
    ``limit`` at a time, in the order they were summarized (which is the order they ended:
    a summary follows its end at once), up to the first one kept, so a tick costs the
    jobs it prunes, not every job kept."""
    events: list[ClusterEvent] = []
    for job in cluster.unpruned.values():
        over_count = len(cluster.unpruned) - len(events) > cluster.ended_jobs_kept
        if len(events) >= limit or (job.ended_at + retention_s > now and not over_count):
            break
        events.append(JobLogPruned(job.spec.job_id, now))
    return tuple(events)


def why_pruned(job: Job, retention_s: float) -> str:
    """When and why a job's own log was deleted, as its timeline and views say it: after
    the retention, or before it because more ended jobs than the coordinator keeps ended."""
    if job.pruned_at < job.ended_at + retention_s:
        return "before the retention: more ended jobs than [cluster] ended_jobs_kept ended after it"
    return "after the retention"


def one_line(text: str, limit: int = 200) -> str:
    """A submitter's reason as every view prints it: one line of printable characters (a
    newline or NUL in a cancel reason must not forge a row of `meshgate job list`), bounded."""
    return "".join(c if c.isprintable() else " " for c in text[:limit])
