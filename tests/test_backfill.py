"""Backfill (coordinator/cluster_state/backfill.py), pure: the head of the queue gets a
reservation; a later job starts ahead of it only where it cannot delay that reservation
(outside it, or by a time limit that ends before the reserved start); a job that can never
start on the joined nodes holds nothing; a job naming its nodes follows the same rules;
the coordinator ends a job at its time limit. No sockets."""

from __future__ import annotations

import pytest

from meshgate.coordinator.cluster_state.backfill import NEVER, schedule, span
from meshgate.coordinator.jobs import ClusterState, JobEnded, JobState
from meshgate.plan import ParallelPlan
from test_jobs import joined, spec, submit


def three_nodes_one_running(run_limit: float = 100.0) -> ClusterState:
    """n0, n1, n2 (2 slots each): job 'run' on n0 from t=0 (time limit ``run_limit``, 0:
    none), and job 'big' for all three nodes waiting: n0, n1, n2 are reserved for it."""
    state = ClusterState()
    for node_id in ("n0", "n1", "n2"):
        joined(state, node_id)
    submit(state, one("run", time_limit_s=run_limit, node_ids=("n0",)), 0.0)
    assert submit(state, spec("big", plan=ParallelPlan(dp_shard=6), num_nodes=3), 1.0) == ()
    return state


def one(job_id: str, **kwargs):
    """A job for one node of 2 slots."""
    kwargs.setdefault("num_nodes", 0 if kwargs.get("node_ids") else 1)
    return spec(job_id, plan=ParallelPlan(dp_shard=2), **kwargs)


@pytest.mark.parametrize(
    "later, starts, reason",
    [
        # no time limit: it could hold a reserved node past big's start
        (one("nolimit"), False, "behind job 'big' (first in line): n0, n1, n2 reserved for it from in ~90s"),
        (one("fits", time_limit_s=90), True, ""),  # 10 + 90 = 100: back by the reserved start
        (one("long", time_limit_s=91), False, "a time limit of 90s or less would start it now"),
        (spec("two", plan=ParallelPlan(dp_shard=4), num_nodes=2, time_limit_s=60), True, ""),
        (one("named", node_ids=("n2",)), False, "behind job 'big' (first in line)"),
        (one("named-short", node_ids=("n2",), time_limit_s=30), True, ""),
    ],
)
def test_a_later_job_starts_on_reserved_idle_nodes_only_if_its_time_limit_ends_by_the_reserved_start(
    later, starts, reason
):
    state = three_nodes_one_running(run_limit=100.0)
    head = schedule(state, 10.0).reservation
    assert (head.job_id, sorted(head.nodes), head.start) == ("big", ["n0", "n1", "n2"], 100.0)
    assert head.until == "job 'run' reaches its time limit"
    events = submit(state, later, 10.0)
    assert [e.job_id for e in events] == ([later.job_id] if starts else [])
    if not starts:
        assert reason in state.pending_reason(state.jobs[later.job_id], 10.0)
    # whatever started, big's reserved start did not move
    assert schedule(state, 10.0).reservation.start == 100.0


def test_while_the_reserved_start_is_unknown_no_job_starts_on_reserved_nodes():
    state = three_nodes_one_running(run_limit=0)  # run has no time limit: when n0 frees is unknown
    head = schedule(state, 10.0).reservation
    assert head.start == NEVER and head.until == "job 'run' ends (it has no time limit)"
    assert submit(state, one("short", time_limit_s=1), 10.0) == ()
    reason = state.pending_reason(state.jobs["short"], 10.0)
    assert reason.endswith(
        "from when job 'run' ends (it has no time limit), a time nobody knows: no job may start on them before"
    )
    assert state.pending_reason(state.jobs["big"], 10.0) == (
        "needs 3 nodes of 2 slots; 2 idle; first in line: n0, n1, n2 reserved for it from when job 'run' ends "
        "(it has no time limit)"
    )


def test_a_job_that_can_never_start_on_the_joined_nodes_holds_no_node_and_no_reservation():
    # the case: a 4-node job accepted with wait_for_nodes on a 3-node cluster
    state = ClusterState()
    for node_id in ("n0", "n1", "n2"):
        joined(state, node_id)
    assert submit(state, spec("all", plan=ParallelPlan(dp_shard=8), num_nodes=4), 1.0, wait_for_nodes=True) == ()
    assert schedule(state, 1.0).reservation is None
    (small,) = submit(state, one("small"), 1.0)  # no time limit, and nothing delays it
    assert small.job_id == "small"
    assert state.pending_reason(state.jobs["all"], 1.0) == (
        "needs 4 nodes of 2 slots, but only 3 nodes have joined: it waits for nodes that have not joined, "
        "and holds no nodes meanwhile"
    )


def test_the_head_reserves_the_nodes_free_soonest():
    # the other case: a 3-node job with one node busy holds nothing else; here n0 is
    # busy without a limit, n1 until 50, n2 and n3 idle
    state = ClusterState()
    for node_id in ("n0", "n1", "n2", "n3"):
        joined(state, node_id)
    submit(state, one("forever", node_ids=("n0",)), 0.0)
    submit(state, one("until50", node_ids=("n1",), time_limit_s=50), 0.0)
    assert submit(state, spec("big", plan=ParallelPlan(dp_shard=6), num_nodes=3), 1.0) == ()
    head = schedule(state, 1.0).reservation
    assert (sorted(head.nodes), head.start) == (["n1", "n2", "n3"], 50.0)  # not n0: its end is unknown
    assert "first in line: n1, n2, n3 reserved for it from in ~49s, when job 'until50' reaches its time limit" in (
        state.pending_reason(state.jobs["big"], 1.0)
    )


def test_only_the_head_holds_nodes_a_second_waiting_job_holds_none():
    state = ClusterState()
    for node_id in ("n0", "n1", "n2", "n3"):
        joined(state, node_id)
    submit(state, one("until50", node_ids=("n1",), time_limit_s=50), 0.0)
    submit(state, one("forever", node_ids=("n0",)), 0.0)
    # the head names n1 (busy until 50) and n2: those two are reserved, and nothing else
    assert submit(state, spec("head", plan=ParallelPlan(dp_shard=4), node_ids=("n1", "n2")), 1.0) == ()
    assert sorted(schedule(state, 1.0).reservation.nodes) == ["n1", "n2"]
    # mid does not fit (3 nodes; 2 idle): it waits, holding nothing, and no reservation
    assert submit(state, spec("mid", plan=ParallelPlan(dp_shard=6), num_nodes=3), 1.0) == ()
    assert schedule(state, 1.0).reservation.job_id == "head"
    assert state.pending_reason(state.jobs["mid"], 1.0) == (
        "needs 3 nodes of 2 slots; 2 idle; after job 'head' (first in line: n1, n2 reserved for it)"
    )
    # so a later job without a time limit starts on n3, which the head does not need
    (later,) = submit(state, one("later"), 1.0)
    assert later.nodes == ("n3",)


def test_the_head_starts_as_soon_as_its_nodes_are_free_and_backfilled_jobs_never_push_it_back():
    state = three_nodes_one_running(run_limit=100.0)
    starts = []
    # a stream of short jobs, each fitting before the reserved start, on n1 and n2
    for t, name, limit in ((10.0, "b1", 40), (12.0, "b2", 80), (50.0, "b3", 50), (92.0, "b4", 8)):
        state.apply_all(state.decide_time_limits(t))
        for node_id in state.nodes:  # heartbeats: live, and no process left of an ended job
            state.touch(node_id, t)
            state.note_units(node_id, [])
        submit(state, one(name, time_limit_s=limit), t)
        starts.append(schedule(state, t).reservation.start)
    assert starts == [100.0] * 4
    assert submit(state, one("b5", time_limit_s=9), 92.0) == ()  # 92 + 9 > 100
    # at 100: run and every backfilled job reached its limit; their nodes clear; big starts first
    ended = state.decide_time_limits(100.0)
    assert {e.job_id for e in ended} == {"run", "b3", "b4"} and all(e.state is JobState.FAILED for e in ended)
    state.apply_all(ended)
    for node_id in ("n0", "n1", "n2"):
        state.touch(node_id, 100.0)
        state.note_units(node_id, [])
    allocated = state.decide_allocate(100.0)
    assert [(e.job_id, sorted(e.nodes)) for e in allocated] == [("big", ["n0", "n1", "n2"])]


def test_a_running_job_ends_failed_at_its_time_limit_and_only_then():
    state = ClusterState()
    for node_id in ("n0", "n1", "n2"):
        joined(state, node_id)
    submit(state, one("limited", time_limit_s=7200), 5.0)
    submit(state, one("free"), 5.0)
    submit(state, spec("waiting", plan=ParallelPlan(dp_shard=4), num_nodes=2, time_limit_s=1), 5.0)
    assert state.decide_time_limits(7204.9) == ()
    assert state.decide_time_limits(7205.0) == (JobEnded("limited", JobState.FAILED, "time limit 2h reached", 7205.0),)
    # the job without a limit runs on; the PENDING one has not started
    assert state.decide_time_limits(1e12) == (JobEnded("limited", JobState.FAILED, "time limit 2h reached", 1e12),)
    state.apply_all(state.decide_time_limits(7205.0))
    assert state.decide_time_limits(1e12) == ()  # once


@pytest.mark.parametrize(
    "seconds, text",
    [
        (40, "40s"),
        (90, "90s"),
        (60, "1m"),
        (120, "2m"),
        (1500, "25m"),
        (5400, "90m"),
        (7200, "2h"),
        (9000, "2.5h"),
        (3 * 86400, "3d"),
    ],
)
def test_a_duration_reads_as_a_person_would_write_it(seconds, text):
    assert span(seconds) == text


@pytest.mark.parametrize("seed", range(40))
def test_one_pass_carried_through_the_queue_gives_every_job_the_reason_its_own_pass_gives(seed):
    """QueueReasons (a ListJobs page, the cluster's queue: one pass for many rows) says of
    every PENDING job exactly what pending_reason's pass of its own says, on random queues:
    nodes of 2 or 4 slots in racks, running jobs with and without time limits, waiting jobs
    large and small, named, time-limited, and some that can never start. Asked out of
    order, a job still gets its own pass's reason."""
    import random

    from meshgate.coordinator.cluster_state.scheduling import QueueReasons

    rng = random.Random(seed)
    state = ClusterState()
    nodes = [f"n{i}" for i in range(rng.randint(2, 9))]
    for node_id in nodes:
        joined(state, node_id, slots=rng.choice((2, 4)), rack=rng.choice(("r1", "r2")))
    at = 0.0
    for j in range(rng.randint(2, 14)):
        at += 1.0
        kind = rng.random()
        limit = rng.choice((0.0, 30.0, 200.0))
        if kind < 0.2:
            job = one(f"named{j}", node_ids=(rng.choice(nodes),), time_limit_s=limit)
        else:
            count = rng.randint(1, len(nodes) + (1 if kind > 0.9 else 0))  # now and then more than joined
            job = spec(f"j{j}", plan=ParallelPlan(dp_shard=2 * count), num_nodes=count, time_limit_s=limit)
        state.apply_all(state.decide_submit(job, at, wait_for_nodes=True))
        if rng.random() < 0.5:
            state.apply_all(state.decide_allocate(at))
    now = at + 5.0
    pending = list(state.pending.values())
    own = [state.pending_reason(job, now) for job in pending]
    carried = QueueReasons(state, now)
    assert [carried.reason(job) for job in pending] == own
    if len(pending) > 1:  # a job already passed: its own pass again
        assert carried.reason(pending[0]) == own[0]
    # a page of some of them (an owner's, a page starting mid-queue): the jobs between are
    # passed over as the allocation pass would place them
    asked = sorted(rng.sample(range(len(pending)), k=rng.randint(1, len(pending))))
    carried = QueueReasons(state, now)
    assert [carried.reason(pending[i]) for i in asked] == [own[i] for i in asked]
