"""The job a coordinator config declares ([job] + [plan]): written to the cluster's log once,
RUNNING at once, with open membership (its agents Join it by name; no node is allocated to
it). A restart with the same config adds nothing; a changed config never ends a running
declared job by surprise. Pure."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from meshgate.coordinator.cluster_state.events import ClusterEvent, JobSubmitted
from meshgate.coordinator.cluster_state.model import JobState
from meshgate.coordinator.rendezvous import Code, RendezvousError

if TYPE_CHECKING:
    from meshgate.coordinator.jobs import ClusterState
    from meshgate.coordinator.jobspec import JobSpec


def decide_declare(cluster: ClusterState, spec: JobSpec, now: float) -> tuple[ClusterEvent, ...]:
    """Written once; a restart with the same config adds nothing. The same id with another
    plan or slots is refused naming both (a job is immutable: a changed plan is a new job),
    as is an id a submitted job holds. A changed [launch] (command, env, restarts) is recorded."""
    job = cluster.jobs.get(spec.job_id)
    if job is None:
        return (JobSubmitted(spec.job_id, spec.to_json(), now, declared=True),)
    if not job.declared:
        raise RendezvousError(
            Code.ALREADY_EXISTS,
            f"[job] id {spec.job_id!r} is a job submitted through the Jobs API ({job.state.value}); "
            "the config's job needs an id of its own",
        )
    was = job.spec
    if (was.plan.digest(), was.slots_per_node) != (spec.plan.digest(), spec.slots_per_node):
        raise RendezvousError(
            Code.FAILED_PRECONDITION,
            f"job {spec.job_id!r} was declared with plan digest {was.plan.digest().hex()} and {was.slots_per_node} "
            f"slots per node; this config declares plan digest {spec.plan.digest().hex()} and "
            f"{spec.slots_per_node}: a job is immutable, so a changed [plan] is a new job (a new [job] id)",
        )
    if was == spec:
        return ()
    return (JobSubmitted(spec.job_id, spec.to_json(), now, declared=True),)


def undeclared_running(cluster: ClusterState, declared: Iterable[str]) -> list[str]:
    """Declared jobs still RUNNING that the config no longer declares."""
    keep = set(declared)
    return [
        job.spec.job_id
        for job in cluster.jobs.values()
        if job.declared and job.state is JobState.RUNNING and job.spec.job_id not in keep
    ]


def check_undeclared(cluster: ClusterState, declared: Iterable[str]) -> None:
    """FAILED_PRECONDITION naming a declared job still RUNNING that the config no longer
    declares (its [job] id changed, or it names none now): only the config that declared
    it holds its join settings, and a changed config must not end a job by surprise."""
    keep = set(declared)
    for job_id in undeclared_running(cluster, keep)[:1]:
        raise RendezvousError(
            Code.FAILED_PRECONDITION,
            f"job {job_id!r}, declared by this coordinator's config ([job] id), is RUNNING; this config "
            f"declares {', '.join(repr(i) for i in sorted(keep)) or 'no job'}. Serve it with the config that "
            f"declared it until it ends (or `meshgate job cancel {job_id}`; or --reset-state --job {job_id}), "
            "then change the config",
        )
