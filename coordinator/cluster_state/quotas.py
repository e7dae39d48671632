"""Quotas per submitter: how much of the queue, the pool and the coordinator's memory one
submitter's unended jobs (PENDING or RUNNING) may take, so that no submitter holds the
cluster hostage. Two kinds:

- Checked when a job is submitted, over what that submitter has now plus the new job
  (waiting jobs, waiting or running jobs, nodes held or asked for, spec bytes): past one,
  RESOURCE_EXHAUSTED naming the quota, its value and the use.
- Checked when a job would start (``RunningUse``, by the allocation pass): what the
  submitter's RUNNING jobs hold at once (``running_jobs``, ``running_nodes``, as Slurm's
  MaxJobsPerUser and MaxTRESPerUser). A job past one is accepted and waits, holding no
  node and no reservation (it does not hold back other submitters' jobs), and its
  pending reason names the quota; it starts once enough of its submitter's jobs ended.

Every bound counts unended jobs only, because those are what a submit can grow and what
the scheduler and the servicers carry; an ended job is the retention's business. Admins
are exempt unless the config says otherwise (an operator clearing a backlog must not be
refused by the quota meant for users). Pure."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Mapping

from meshgate.coordinator.cluster_state.model import Caller, Job, JobState
from meshgate.coordinator.rendezvous import Code, RendezvousError, shown

if TYPE_CHECKING:
    from meshgate.coordinator.jobs import ClusterState
    from meshgate.coordinator.jobspec import JobSpec


@dataclass(frozen=True)
class Limits:
    """One submitter's quota; 0: no limit. The defaults stop a flood (500 jobs of 60 KB of
    env from one certificate) long before it doubles the coordinator's memory, and leave
    an ordinary user room: 100 jobs waiting, 64 KiB of command and env per job, 16 MiB of
    it over all unended jobs."""

    waiting_jobs: int = 100  # PENDING jobs
    jobs: int = 0  # PENDING or RUNNING jobs (so also the most that run at once)
    nodes: int = 0  # nodes (members and spares) the unended jobs hold or ask for
    spec_bytes_per_job: int = 64 << 10  # command + env of one job, in UTF-8 bytes
    spec_bytes: int = 16 << 20  # command + env over all unended jobs
    running_jobs: int = 0  # RUNNING jobs at once: one more waits (accepted, not refused)
    running_nodes: int = 0  # nodes (members and spares) the RUNNING jobs hold at once: likewise

    @classmethod
    def from_mapping(
        cls, table: Mapping[str, Any], where: str, base: "Limits", also: frozenset = frozenset()
    ) -> "Limits":
        """``base`` with the keys ``table`` sets; ValueError naming ``where`` and the key
        (``also``: keys the table may hold besides, named when an unknown one is refused)."""
        known = {f.name for f in fields(cls)} | also
        table = {k: v for k, v in table.items() if k not in also}
        unknown = sorted(set(table) - known)
        if unknown:
            raise ValueError(f"{where} unknown key(s) {unknown}; known: {sorted(known)}")
        for key, value in table.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where} {key} must be an integer >= 0 (0: no limit), got {value!r}")
        return replace(base, **table)


@dataclass(frozen=True)
class Quotas:
    """The limits every submitter has (``default``), those of named owners (as a job
    records its owner, e.g. "submitter:alice"), and whether admins are held to them."""

    default: Limits = Limits()
    owners: Mapping[str, Limits] = field(default_factory=dict)
    admins_exempt: bool = True

    def of(self, caller: Caller) -> Limits | None:
        """``caller``'s limits; None: exempt."""
        if caller.admin and self.admins_exempt:
            return None
        return self.owners.get(caller.owner, self.default)

    @property
    def bound_running(self) -> bool:
        """Does any submitter's quota bound what its running jobs hold?"""
        return any(q.running_jobs or q.running_nodes for q in (self.default, *self.owners.values()))

    @classmethod
    def from_mapping(cls, table: Mapping[str, Any]) -> "Quotas":
        """[cluster.quota]: the default's keys, ``admins_exempt``, and ``owners.<owner>``
        tables whose keys override the default for that owner. ValueError naming the key."""
        exempt = table.get("admins_exempt", True)
        if not isinstance(exempt, bool):
            raise ValueError(f"[cluster.quota] admins_exempt must be true or false, got {exempt!r}")
        owners = table.get("owners", {})
        if not isinstance(owners, Mapping) or not all(isinstance(v, Mapping) for v in owners.values()):
            raise ValueError(
                '[cluster.quota] owners must hold one table per owner, e.g. [cluster.quota.owners."submitter:alice"]'
            )
        default = Limits.from_mapping(table, "[cluster.quota]", Limits(), frozenset({"admins_exempt", "owners"}))
        return cls(
            default,
            {
                owner: Limits.from_mapping(t, f"[cluster.quota.owners.{owner!r}]", default)
                for owner, t in owners.items()
            },
            exempt,
        )


@dataclass(frozen=True)
class Use:
    """What one submitter's unended jobs take now."""

    waiting_jobs: int = 0
    jobs: int = 0
    nodes: int = 0
    spec_bytes: int = 0

    def plus(self, spec: JobSpec) -> "Use":
        return Use(
            self.waiting_jobs + 1, self.jobs + 1, self.nodes + job_nodes(spec), self.spec_bytes + spec_bytes(spec)
        )


class QuotaExceeded(RendezvousError):
    """A submit past one of its submitter's quotas."""

    def __init__(self, owner: str, quota: str, limit: int, use: str) -> None:
        super().__init__(
            Code.RESOURCE_EXHAUSTED,
            f"quota {quota} = {limit} of {shown(owner or '(anonymous)')} is reached: {use}. Wait for (or cancel) "
            "some of its jobs, or ask the operator for more ([cluster.quota] in coordinator.toml; meshgate status "
            "shows the quotas)",
        )
        self.quota = quota


def spec_bytes(spec: JobSpec) -> int:
    """What a job's command and env weigh (UTF-8 bytes): what a submitter chooses freely,
    and so what quotas bound (the rest of a spec is small and bounded by its own checks)."""
    return sum(len(a.encode()) for a in spec.command) + sum(len(k.encode()) + len(v.encode()) for k, v in spec.env)


def job_nodes(spec: JobSpec) -> int:
    return spec.num_nodes + spec.spares


def unended_of(cluster: ClusterState, owner: str) -> list[Job]:
    """``owner``'s PENDING and RUNNING jobs: the queue, and the jobs the nodes serve (so this
    costs the queue and the pool, not every job the cluster ever served)."""
    serving = {n.job_id for n in cluster.nodes.values() if n.job_id}
    jobs = list(cluster.pending.values()) + [cluster.jobs[i] for i in serving if i in cluster.jobs]
    return [j for j in jobs if j.owner == owner and not j.state.ended]


def use_of(cluster: ClusterState, owner: str) -> Use:
    jobs = unended_of(cluster, owner)
    return Use(
        waiting_jobs=sum(1 for j in jobs if j.state is JobState.PENDING),
        jobs=len(jobs),
        nodes=sum(job_nodes(j.spec) for j in jobs),
        spec_bytes=sum(spec_bytes(j.spec) for j in jobs),
    )


def check_quota(cluster: ClusterState, spec: JobSpec, caller: Caller) -> None:
    """QuotaExceeded naming the first quota ``spec`` would take ``caller`` past."""
    limits = cluster.quotas.of(caller)
    if limits is None:
        return
    owner, size = caller.owner, spec_bytes(spec)
    if limits.spec_bytes_per_job and size > limits.spec_bytes_per_job:
        raise QuotaExceeded(owner, "spec_bytes_per_job", limits.spec_bytes_per_job, f"job {spec.job_id!r} has {size}")
    now = use_of(cluster, owner)
    after = now.plus(spec)
    checks = (
        ("waiting_jobs", limits.waiting_jobs, after.waiting_jobs, f"{now.waiting_jobs} job(s) waiting"),
        ("jobs", limits.jobs, after.jobs, f"{now.jobs} job(s) waiting or running"),
        (
            "nodes",
            limits.nodes,
            after.nodes,
            f"{now.nodes} node(s) held or asked for, and this job asks {job_nodes(spec)}",
        ),
        (
            "spec_bytes",
            limits.spec_bytes,
            after.spec_bytes,
            f"{now.spec_bytes} bytes of command and env held, and this job has {size}",
        ),
    )
    for quota, limit, would_be, use in checks:
        if limit and would_be > limit:
            raise QuotaExceeded(owner, quota, limit, use)


class RunningUse:
    """What each submitter's RUNNING jobs hold, for one allocation pass: counted once from
    the pool (the jobs the nodes serve), then grown by the pass's own allocations; and
    whether a job would take its submitter past a running quota if it started now."""

    def __init__(self, cluster: ClusterState) -> None:
        self.cluster = cluster
        self.by_owner: dict[str, tuple[int, int]] | None = None  # owner -> (jobs, nodes); counted on first use

    def _counted(self) -> dict[str, tuple[int, int]]:
        if self.by_owner is None:
            self.by_owner = {}
            for job_id in {n.job_id for n in self.cluster.nodes.values() if n.job_id}:
                job = self.cluster.jobs.get(job_id)
                if job is not None and job.state is JobState.RUNNING:
                    self.started(job)
        return self.by_owner

    def started(self, job: Job) -> None:
        jobs, nodes = self._counted().get(job.owner, (0, 0))
        self._counted()[job.owner] = (jobs + 1, nodes + job_nodes(job.spec))

    def holds(self, job: Job) -> str:
        """Why ``job`` may not start now for its submitter's running quotas, e.g. "quota
        running_jobs = 2 of 'submitter:alice' is reached: 2 job(s) running"; "" when not."""
        quotas = self.cluster.quotas
        limits = quotas.of(Caller.of_owner(job.owner)) if quotas.bound_running else None
        if limits is None:
            return ""
        jobs, nodes = self._counted().get(job.owner, (0, 0))
        owner = shown(job.owner or "(anonymous)")
        if limits.running_jobs and jobs + 1 > limits.running_jobs:
            return f"quota running_jobs = {limits.running_jobs} of {owner} is reached: {jobs} job(s) running"
        if limits.running_nodes and nodes + job_nodes(job.spec) > limits.running_nodes:
            return (
                f"quota running_nodes = {limits.running_nodes} of {owner} is reached: its running jobs hold "
                f"{nodes} node(s) and this job asks {job_nodes(job.spec)}"
            )
        return ""


__all__ = [
    "Limits",
    "QuotaExceeded",
    "Quotas",
    "RunningUse",
    "Use",
    "check_quota",
    "job_nodes",
    "spec_bytes",
    "use_of",
]
