"""What the coordinator keeps of an ended job it no longer remembers: 8 bytes.

The cluster keeps the newest ``[cluster] ended_jobs_kept`` ended jobs in memory (their
spec, end and summary: a few KiB each); an older one is forgotten once its own log is
deleted (after the retention, or at once when more ended jobs than that are kept). Of a
forgotten job the cluster keeps only what makes two promises hold without it:

- a job id is never reused: a 64-bit digest of each forgotten id (BLAKE2b, keyed by
  nothing: the ids are not secret), so a submit under a forgotten id is refused. Two ids
  share a digest with probability about n^2 / 2^65 (under 1e-7 after a million jobs); the
  cost of such a collision is one refused submit that asks for another id;
- the counts of jobs by state never go back (`meshgate status`, the jobs gauge): the
  number forgotten in each end state.

Eight bytes per job ever forgotten, in one array: ten million forgotten jobs hold 80 MB
where remembering them would hold tens of GB. Pure; rebuilt by replaying the cluster's
log under the same rule."""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshgate.coordinator.cluster_state.model import Job, JobState

# How many ended jobs the coordinator keeps in memory by default ([cluster] ended_jobs_kept):
# Slurm's MaxJobCount default, and a few tens of MiB of the coordinator's memory.
DEFAULT_ENDED_JOBS_KEPT = 10_000
MAX_ENDED_JOBS_KEPT = 10_000_000


def digest(job_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(job_id.encode(), digest_size=8).digest(), "little")


class ForgottenJobs:
    """The ids (as digests) and end states of the jobs forgotten so far."""

    def __init__(self) -> None:
        self._digests = array("Q")
        self.by_state: Counter[JobState] = Counter()

    def add(self, job: Job) -> None:
        self._digests.append(digest(job.spec.job_id))
        self.by_state[job.state] += 1

    def __contains__(self, job_id: str) -> bool:
        return digest(job_id) in self._digests  # a scan in C: ~1 ms per million forgotten

    def __len__(self) -> int:
        return len(self._digests)

    def __eq__(self, other: object) -> bool:  # a state compared before and after a refused call
        return isinstance(other, ForgottenJobs) and self._digests == other._digests and self.by_state == other.by_state

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"ForgottenJobs({len(self)} ids, {dict(self.by_state)})"


__all__ = ["DEFAULT_ENDED_JOBS_KEPT", "MAX_ENDED_JOBS_KEPT", "ForgottenJobs", "digest"]
