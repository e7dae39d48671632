"""A running job's own log is opened off the event loop (issue 25): creating it costs
several fsyncs, and while the loop waited for them every other call of every job waited.

In process, real SQLite logs (the daemon's own opener) and a real loop. The seam: an
opener that holds one job's open in its worker thread on a threading.Event, so that each
check runs while that open is surely in flight (no sleeps). Every open is counted, every
store it returned is kept to check that it was closed or is the one served."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path

import pytest

from meshgate.coordinator.cluster import ClusterCoordinator
from meshgate.coordinator.jobs import JobState
from meshgate.coordinator.leadership import job_store_opener
from meshgate.coordinator.rendezvous import Code, RendezvousConfig, RendezvousError
from meshgate.coordinator.store import MemoryStore, Store
from test_job_lifecycle_cost import Clock, claimed, cluster_over, config_for, joined

HOLD_S = 30  # how long a held open waits at most (a failing test, never a passing one)


class HeldOpener:
    """The daemon's opener, counting opens per job; the open of ``held`` waits in its
    worker thread until ``release`` is set."""

    def __init__(self, tmp_path: Path, held: str) -> None:
        self.open_job_store = job_store_opener(config_for(tmp_path))
        self.held = held
        self.entered = threading.Event()
        self.release = threading.Event()
        self.threads: list[str] = []
        self.opened: dict[str, list[Store]] = {}

    def __call__(self, config: RendezvousConfig) -> Store:
        self.threads.append(threading.current_thread().name)
        if config.job_id == self.held:
            self.entered.set()
            assert self.release.wait(HOLD_S), "the held open was never released"
        store = self.open_job_store(config)
        self.opened.setdefault(config.job_id, []).append(store)
        return store

    async def in_flight(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, HOLD_S), "the held open never started"


def cluster_with(tmp_path: Path, opener: HeldOpener, cluster_log: MemoryStore) -> ClusterCoordinator:
    cluster = cluster_over(config_for(tmp_path), cluster_log, Clock())
    cluster.job_engines.open_job_store = opener
    return cluster


def closed(store: Store) -> bool:
    try:
        store.db.execute("SELECT 1")
    except sqlite3.ProgrammingError:  # "Cannot operate on a closed database."
        return True
    return False


def unavailable(call) -> str:
    with pytest.raises(RendezvousError) as caught:
        call()
    assert caught.value.code is Code.UNAVAILABLE, caught.value
    return caught.value.message


def test_the_loop_serves_other_jobs_while_a_log_opens_and_the_job_gets_one_store(tmp_path):
    async def scenario():
        opener = HeldOpener(tmp_path, held="b")
        cluster = cluster_with(tmp_path, opener, MemoryStore())
        first, second = await joined(cluster, "n0"), await joined(cluster, "n1")
        assert (await cluster.submit(claimed("a", "n0"))).state is JobState.RUNNING
        submitted = asyncio.ensure_future(cluster.submit(claimed("b", "n1")))
        await opener.in_flight()  # b's log is being opened in a worker thread, held there

        # (a) the loop serves every other call meanwhile: job a's node, its engine, b's node in the pool
        assert not submitted.done() and cluster.job("b").state is JobState.RUNNING
        assert cluster.pool.heartbeat("n0", first).job_id == "a"
        engine_a = cluster.pool.job_engine("n0", first, "a", running=True)
        assert engine_a is cluster.engines["a"] and engine_a.state.nodes["n0"].node_rank == 0
        assert cluster.pool.heartbeat("n1", second).job_id == "b"  # it learns of b, and Joins...
        # (b) ... and is told to retry, never given a second open of the same file
        told = unavailable(lambda: cluster.pool.job_engine("n1", second, "b", running=True, joining=True))
        assert told == "job 'b': its log is being opened; retry"
        assert unavailable(lambda: cluster.engine("b")) == told
        again = asyncio.ensure_future(cluster._serve_allocated(cluster.job("b")))  # e.g. a retry of the loop
        await asyncio.sleep(0)
        assert not again.done() and "b" not in cluster.engines

        opener.release.set()
        job = await submitted
        await again
        assert job.state is JobState.RUNNING
        assert [len(opener.opened[j]) for j in ("a", "b")] == [1, 1]  # one open per job, ever
        (store,) = opener.opened["b"]
        assert cluster.job_engines.stores["b"] is store and cluster.engines["b"].store is store
        assert not closed(store) and cluster.job_engines.opening == {}
        assert cluster.engine("b").state.nodes["n1"].node_rank == 0  # admitted once open
        assert threading.main_thread().name not in opener.threads  # no open of a running job on the loop
        cluster.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("ending", ["cancel", "finish"])
def test_a_job_that_ends_while_its_log_opens_keeps_no_store_and_no_engine(tmp_path, ending):
    async def scenario():
        opener = HeldOpener(tmp_path, held="c")
        cluster = cluster_with(tmp_path, opener, MemoryStore())
        credential = await joined(cluster, "n0")
        submitted = asyncio.ensure_future(cluster.submit(claimed("c", "n0")))
        await opener.in_flight()
        if ending == "cancel":
            ended = await cluster.cancel("c", "changed my mind")
            assert ended.state is JobState.CANCELLED
        else:
            ended = await cluster.finish("c", False, "given up")
            assert ended.state is JobState.FAILED
        opener.release.set()
        assert (await submitted).state is ended.state
        (store,) = opener.opened["c"]
        assert closed(store)  # opened, found unwanted, closed again
        assert cluster.engines == {} and cluster.job_engines.stores == {} and cluster.job_engines.opening == {}
        with pytest.raises(RendezvousError, match=f"is {ended.state.value}"):
            cluster.engine("c")
        assert cluster.pool.job_engine("n0", credential, "c") is None  # answered from the cluster's log
        assert cluster.unopened == {}
        cluster.close()

    asyncio.run(scenario())


def test_a_call_that_finds_a_running_job_unopened_starts_the_one_open_and_is_told_to_retry(tmp_path):
    """A restarted cluster reopens its running jobs in start(); a call that comes first
    (here: the engine of a job whose open nobody started) starts it, off the loop."""

    async def scenario():
        opener = HeldOpener(tmp_path, held="nobody")
        cluster_log = MemoryStore()
        cluster = cluster_with(tmp_path, opener, cluster_log)
        credential = await joined(cluster, "n0")
        await cluster.submit(claimed("d", "n0"))
        cluster.close()

        opener.held = "d"
        restarted = cluster_with(tmp_path, opener, cluster_log)
        started = asyncio.ensure_future(restarted.start())
        await opener.in_flight()
        assert restarted.state.nodes["n0"].job_id == "d"
        assert unavailable(lambda: restarted.pool.job_engine("n0", credential, "d")).endswith("being opened; retry")
        opener.release.set()
        await started
        assert len(opener.opened["d"]) == 2  # once per process
        assert restarted.engine("d").store is opener.opened["d"][1] and closed(opener.opened["d"][0])
        restarted.close()

        opener.held, opener.entered = "nobody", threading.Event()
        third = cluster_with(tmp_path, opener, cluster_log)  # start() not run: nothing opened yet
        told = unavailable(lambda: third.engine("d"))
        assert told == "job 'd': its log is being opened; retry" and list(third.job_engines.opening) == ["d"]
        assert unavailable(lambda: third.engine("d")) == told  # the same open, not a second one
        engine = await third.job_engines.opening["d"]
        assert third.engine("d") is engine and len(opener.opened["d"]) == 3
        third.close()

    asyncio.run(scenario())


def test_a_damaged_log_found_off_the_loop_is_data_loss_and_fails_the_job_as_before(tmp_path):
    async def scenario():
        opener = HeldOpener(tmp_path, held="nobody")
        cluster_log = MemoryStore()
        cluster = cluster_with(tmp_path, opener, cluster_log)
        await joined(cluster, "n0")
        await cluster.submit(claimed("e", "n0"))
        cluster.close()
        log_file = tmp_path / "state" / "jobs" / "e" / "state.sqlite3"
        log_file.write_bytes(b"not a database" * 100)
        before = log_file.read_bytes()

        restarted = cluster_with(tmp_path, opener, cluster_log)
        await restarted.start()
        job = restarted.job("e")
        assert job.state is JobState.FAILED and str(log_file) in job.reason and "cannot be trusted" in job.reason
        assert "e" not in restarted.engines and restarted.job_engines.opening == {}
        assert log_file.read_bytes() == before  # left as found
        with pytest.raises(RendezvousError) as caught:
            restarted.job_engines.served(restarted.rendezvous_config(job), lambda: True)
        assert caught.value.code is Code.DATA_LOSS and caught.value.message == restarted.job_engines.damaged["e"]
        restarted.close()

    asyncio.run(scenario())


def test_an_open_outlives_a_cancelled_caller_and_a_closed_cluster_closes_what_it_opened_later(tmp_path):
    async def scenario():
        opener = HeldOpener(tmp_path, held="f")
        cluster = cluster_with(tmp_path, opener, MemoryStore())
        await joined(cluster, "n0")
        submitted = asyncio.ensure_future(cluster.submit(claimed("f", "n0")))
        await opener.in_flight()
        opening = cluster.job_engines.opening["f"]
        submitted.cancel()  # the SubmitJob's client went away
        with pytest.raises(asyncio.CancelledError):
            await submitted
        assert not opening.done()
        opener.release.set()
        engine = await opening  # the open went on: its store is served, not stranded
        (store,) = opener.opened["f"]
        assert cluster.engines["f"] is engine and cluster.job_engines.stores["f"] is store and not closed(store)
        cluster.close()
        assert closed(store)

        opener.held, opener.entered, opener.release = "g", threading.Event(), threading.Event()
        restarted = cluster_with(tmp_path, opener, MemoryStore())
        await joined(restarted, "n1")
        submitted = asyncio.ensure_future(restarted.submit(claimed("g", "n1")))
        await opener.in_flight()
        restarted.close()  # the term ends while g's log is being opened
        opener.release.set()
        await submitted
        (store,) = opener.opened["g"]
        assert closed(store) and restarted.engines == {} and restarted.job_engines.opening == {}

    asyncio.run(scenario())
