"""The memory an ended job keeps is bounded (issue 31, item 5): the coordinator keeps the
newest ``[cluster] ended_jobs_kept`` ended jobs; an older one's own log is deleted (before
the retention if need be) and the job is forgotten, keeping 8 bytes: its id stays taken,
the counts by state never go back, a ListJobs page token stays valid, and a restart
replays to the same jobs kept.

In process: the ClusterCoordinator over a real SQLite cluster log and real SQLite job
logs (the daemon's own openers), so what is measured is what the daemon keeps."""

from __future__ import annotations

import asyncio
import gc
import logging
import tracemalloc
from pathlib import Path

import pytest

from test_job_lifecycle_cost import Clock, claimed, cluster_over, config_for, joined
from meshgate.coordinator import readmodel
from meshgate.coordinator.cluster import ClusterCoordinator
from meshgate.coordinator.config import ConfigError, CoordinatorConfig
from meshgate.coordinator.jobs import DEFAULT_ENDED_JOBS_KEPT, JobState
from meshgate.coordinator.keys import KeyRing
from meshgate.coordinator.leadership import durable_mark, log_pin, store_dir
from meshgate.coordinator.rendezvous import Code, RendezvousError
from meshgate.coordinator.store import open_store
from meshgate.v1 import rendezvous_pb2 as pb


def cluster_log(config: CoordinatorConfig):
    return open_store(
        "sqlite",
        state_dir=store_dir(config),
        job_id=config.log_id,
        pin=log_pin(config),
        mark=durable_mark(config),
    )


def coordinator(config: CoordinatorConfig, clock: Clock) -> ClusterCoordinator:
    """The daemon's coordinator over its SQLite cluster log (its keys' directory made first:
    the log's mark lives there)."""
    KeyRing(config.keys_dir)
    store_dir(config).mkdir(parents=True, exist_ok=True)
    return cluster_over(config, cluster_log(config), clock)


async def run_jobs(cluster: ClusterCoordinator, credential: bytes, first: int, count: int) -> None:
    """``count`` jobs one after another on node n0, each ended by its submitter, with the
    coordinator's housekeeping (prune) after each, as its run() loop does."""
    for i in range(first, first + count):
        await cluster.submit(claimed(f"j{i:05d}", "n0"))
        await cluster.finish(f"j{i:05d}", True, "done")
        cluster.pool.heartbeat("n0", credential, live_units=())
        await cluster.prune()


def job_logs_on_disk(tmp_path: Path) -> set[str]:
    return {p.name for p in (tmp_path / "state" / "jobs").iterdir()}


def test_the_newest_ended_jobs_are_kept_the_rest_forgotten_with_their_ids_taken_counts_and_pages_kept(tmp_path):
    async def scenario():
        config = config_for(tmp_path, retention="1h", ended_jobs_kept=20)
        assert config.ended_jobs_kept == 20
        clock = Clock()
        cluster = coordinator(config, clock)
        await cluster.start()
        credential = await joined(cluster, "n0")
        await run_jobs(cluster, credential, 0, 30)
        # a reader starts paging while j00010.. are still kept
        first = readmodel.job_list(cluster, pb.ListJobsRequest(page_size=7), readmodel.OPERATOR)
        assert [j.spec.job_id for j in first.jobs] == [f"j{i:05d}" for i in range(10, 17)]
        await run_jobs(cluster, credential, 30, 170)

        state = cluster.state
        assert len(state.jobs) == 20 and len(state.forgotten) == 180
        assert list(state.jobs) == [f"j{i:05d}" for i in range(180, 200)]
        # the logs of all but the newest 20 were deleted, long before the retention (1 h)
        assert job_logs_on_disk(tmp_path) == set(state.jobs)
        assert readmodel.job_counts(state)[JobState.SUCCEEDED] == 200  # never goes back
        status = readmodel.cluster_status(cluster)
        assert {c.state: c.count for c in status.jobs}[pb.SUCCEEDED] == 200

        # a forgotten id stays taken, and reading it says why it is not there
        with pytest.raises(RendezvousError) as refused:
            await cluster.submit(claimed("j00003", "n0"))
        assert refused.value.code is Code.ALREADY_EXISTS and "forgotten" in refused.value.message
        with pytest.raises(RendezvousError) as gone:
            state.job("j00003")
        assert gone.value.code is Code.NOT_FOUND and "ended_jobs_kept" in gone.value.message
        with pytest.raises(RendezvousError, match="is not known"):
            state.job("never-submitted")

        # the reader's token still leads on, with no job skipped that is still kept
        rest = readmodel.job_list(
            cluster, pb.ListJobsRequest(page_size=1000, page_token=first.next_page_token), readmodel.OPERATOR
        )
        assert [j.spec.job_id for j in rest.jobs] == [f"j{i:05d}" for i in range(180, 200)]

        cluster.close()

        # a restart replays the log to the same jobs kept and forgotten
        restarted = coordinator(config, clock)
        await restarted.start()
        assert list(restarted.state.jobs) == list(state.jobs) and len(restarted.state.forgotten) == 180
        with pytest.raises(RendezvousError, match="forgotten"):
            await restarted.submit(claimed("j00000", "n0"))
        restarted.close()

        # a restart that keeps more remembers more of the log's jobs (their own logs are gone:
        # the timeline says when, and why)
        more = coordinator(config_for(tmp_path, retention="1h", ended_jobs_kept=100), clock)
        await more.start()
        assert list(more.state.jobs) == [f"j{i:05d}" for i in range(100, 200)]
        timeline = readmodel.timeline(more, more.state.job("j00150"))
        assert "before the retention" in timeline.note and "ended_jobs_kept" in timeline.note
        more.pool.heartbeat("n0", credential, live_units=())  # a restarted coordinator waits for its agent's word
        assert (await more.submit(claimed("fresh", "n0"))).state is JobState.RUNNING
        more.close()

    asyncio.run(scenario())


def test_jobs_within_the_count_keep_their_logs_for_the_retention(tmp_path):
    """Under ``ended_jobs_kept`` the retention alone decides: nothing is pruned early."""

    async def scenario():
        config = config_for(tmp_path, retention="1h", ended_jobs_kept=50)
        clock = Clock()
        cluster = coordinator(config, clock)
        await cluster.start()
        credential = await joined(cluster, "n0")
        await run_jobs(cluster, credential, 0, 30)
        assert len(job_logs_on_disk(tmp_path)) == 30 and len(cluster.state.forgotten) == 0
        clock.now += 3601
        await cluster.prune()
        assert job_logs_on_disk(tmp_path) == set() and len(cluster.state.jobs) == 30
        assert "after the retention" in readmodel.timeline(cluster, cluster.state.job("j00000")).note
        cluster.close()

    asyncio.run(scenario())


def test_what_an_ended_job_costs_past_the_count_is_bounded(tmp_path):
    """Past ``ended_jobs_kept``, running another thousand jobs leaves the coordinator's
    Python memory where it was, but for the 8 bytes kept per forgotten id (measured with
    tracemalloc over everything the coordinator allocates, its stores' included)."""

    async def scenario():
        # INFO lines are not the coordinator's memory (they go to its journal), but pytest keeps
        # every record it captures, when an earlier test left a logger at INFO
        logging.disable(logging.INFO)
        try:
            await measured()
        finally:
            logging.disable(logging.NOTSET)

    async def measured():
        tracemalloc.start()  # from the start: what is freed later was traced when made
        config = config_for(tmp_path, retention="3d", ended_jobs_kept=50)
        cluster = coordinator(config, Clock())
        await cluster.start()
        credential = await joined(cluster, "n0")
        await run_jobs(cluster, credential, 0, 150)  # past the count, caches warm
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        await run_jobs(cluster, credential, 150, 300)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert len(cluster.state.jobs) == 50 and len(cluster.state.forgotten) == 400
        # 8 bytes per forgotten id and the noise of a run (dicts and arrays resized, a few
        # KiB); a job remembered costs ~2 KiB (300 of them: 600 KB)
        assert grown < 100 * 300, f"{grown / 300:.0f} bytes per job"
        cluster.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("value", [0, -1, 1.5, "10", True, 10_000_001])
def test_a_bad_ended_jobs_kept_is_refused_naming_it(tmp_path, value):
    with pytest.raises(ConfigError, match="ended_jobs_kept"):
        config_for(tmp_path, ended_jobs_kept=value)


def test_the_default_keeps_ten_thousand(tmp_path):
    assert config_for(tmp_path).ended_jobs_kept == DEFAULT_ENDED_JOBS_KEPT == 10_000
