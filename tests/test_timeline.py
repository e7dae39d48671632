"""A job's timeline (`meshgate job show --timeline`): the pure fold from a job's events to its
entries (coordinator/rendezvous/timeline.py), the cluster's moments around them
(coordinator/cluster_state/timeline.py), and the CLI's rendering (meshgate/views.py). No
sockets; the real-process run is tests/test_jobs_cluster.py's timeline test."""

from __future__ import annotations

import time

from meshgate.coordinator.cluster_state.model import Job, JobState
from meshgate.coordinator.cluster_state.timeline import job_timeline
from meshgate.coordinator.jobspec import JobSpec
from meshgate.coordinator.rendezvous import (
    GenerationBumped,
    JobFailed,
    NodeJoined,
    NodeState,
    NodeStateChanged,
    RankAssigned,
    RegisterInput,
    RendezvousConfig,
    RendezvousState,
    WorkerSucceeded,
)
from meshgate.coordinator.rendezvous.timeline import MAX_ENTRIES, MAX_NODES_SHOWN, Entry, Moment
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb
from test_exit_decisions import JOB as EXITS_JOB, _silence, running
from meshgate.views import one_line, progress, render_list, render_timeline, timeline_dict

JOB = "job-tl"


def folded(events, world: int = 4, slots: int = 2) -> list[Entry]:
    """The pure function under test: a job's events, applied in order, to its entries."""
    state = RendezvousState(RendezvousConfig(job_id=JOB, plan=ParallelPlan(dp_shard=world), slots_per_node=slots))
    state.apply_all(events)
    return state.timeline.entries()


def registered(generation_start: float, world: int = 4, slots: int = 2) -> list[RankAssigned]:
    return [
        RankAssigned(f"n{r // slots}/local{r % slots}", r, f"n{r // slots}", r % slots, generation_start + r)
        for r in range(world)
    ]


def test_a_job_that_restarts_once_and_succeeds_reads_in_order_with_one_span_per_generation():
    events = [
        NodeJoined("n0", 0, 1.0, "host-0", 2, "cpu"),
        NodeJoined("n1", 1, 1.0, "host-1", 2, "cpu"),
        *registered(10.0),
        GenerationBumped(1, "worker local_rank 1 (rank 3) on node 'n1' exited 1", worker_restart=True, at=20.0),
        *registered(21.0),
        *(WorkerSucceeded(f"n{r // 2}", r % 2, 1, 30.0 + r) for r in range(4)),
    ]
    entries = folded(events)
    assert [(e.moment, e.at, e.generation) for e in entries] == [
        (Moment.NODE_JOINED, 1.0, 0),
        (Moment.NODE_JOINED, 1.0, 0),
        (Moment.RANKS_REGISTERED, 10.0, 0),
        (Moment.WORLD_FORMED, 13.0, 0),
        (Moment.GENERATION_CHANGED, 20.0, 1),
        (Moment.RANKS_REGISTERED, 21.0, 1),
        (Moment.WORLD_FORMED, 24.0, 1),
        (Moment.WORKERS_EXITED, 30.0, 1),
    ]
    assert entries[0].node_id == "n0" and entries[0].detail == "node_rank 0 on host-0, 2 cpu slots"
    assert (entries[2].until, entries[2].count) == (13.0, 4)
    assert entries[4].detail.startswith("a worker failed: worker local_rank 1 (rank 3) on node 'n1' exited 1")
    assert (entries[7].until, entries[7].count) == (33.0, 4)


def test_a_generation_that_never_formed_and_a_lost_node_and_a_failure_are_entries():
    events = [
        NodeJoined("n0", 0, 1.0, "host-0", 2, "cpu"),
        NodeJoined("n1", 1, 1.0, "host-1", 2, "cpu"),
        *registered(10.0)[:3],  # rank 3 never came
        NodeStateChanged("n1", NodeState.LOST, 40.0, "no heartbeat for 16s"),
        GenerationBumped(1, "node 'n1' (node_rank 1) lost", at=40.0),
        JobFailed("node 'n1' (ranks 2-3) was lost 300s ago", 340.0),
    ]
    entries = folded(events)
    assert [e.moment for e in entries] == [
        Moment.NODE_JOINED,
        Moment.NODE_JOINED,
        Moment.RANKS_REGISTERED,
        Moment.NODE_CHANGED,
        Moment.GENERATION_CHANGED,
        Moment.JOB_FAILED,
    ]
    partial = entries[2]
    assert (partial.count, partial.until, partial.detail) == (3, 12.0, "the world never formed")
    assert entries[3].node_id == "n1" and entries[3].detail == "lost: no heartbeat for 16s"
    assert entries[5].at == 340.0 and "was lost 300s ago" in entries[5].detail


def test_the_world_formed_after_a_lost_node_counts_the_generations_world_not_its_new_holders():
    """A spare takes a lost node's block. The survivors keep their ranks, but the new
    generation's world counts only its own registrations: it forms once the survivors'
    relaunched workers have registered again too (issue 35: before, it formed, and `job
    show` said registered 4/4, before any of them had started). The span then says 4."""
    state = running(spare=True)
    _silence(state, "node-b", 0.0)
    state.apply_all(state.decide_lost(101.0, 15.0))
    assert state.generation == 1 and state.registered_now == 0 and not state.complete
    for local in (0, 1):
        request = RegisterInput(EXITS_JOB, f"node-s/{local}", b"s" * 16, "node-s", local, None)
        state.apply_all(state.decide_register(request, 102.0).events)
    assert not state.complete and state.missing_ranks() == [0, 1]
    for local in (0, 1):  # the survivor's workers, relaunched into generation 1: same ids, same ranks
        request = RegisterInput(EXITS_JOB, f"node-a/{local}", b"a" * 16, "node-a", local, None)
        decision = state.decide_register(request, 103.0)
        assert decision.assignment.rank == local and decision.is_new  # recorded: it counts from now on
        state.apply_all(decision.events)
    assert state.complete and state.registered_now == 4
    generation_1 = [e for e in state.timeline.entries() if e.generation == 1]
    formed = [e for e in generation_1 if e.moment is Moment.WORLD_FORMED]
    spans = [e for e in generation_1 if e.moment is Moment.RANKS_REGISTERED]
    assert [e.detail for e in formed] == ["4 ranks"] and [e.count for e in spans] == [4], generation_1
    assert formed[0].at == 103.0


def test_a_cancel_closes_the_generation_and_is_no_failure():
    events = [NodeJoined("n0", 0, 1.0, "host-0", 2, "cpu"), *registered(10.0)[:2]]
    entries = folded(events + [JobFailed("job cancelled by 'admin:ops': make room", 20.0)], world=2)
    assert [e.moment for e in entries] == [Moment.NODE_JOINED, Moment.RANKS_REGISTERED, Moment.WORLD_FORMED]


def test_a_bump_from_a_log_written_before_bumps_were_timed_is_dated_by_the_event_before_it():
    events = [NodeJoined("n0", 0, 1.0, "host-0", 2, "cpu"), *registered(10.0)[:2], GenerationBumped(1, "old")]
    assert folded(events)[-1] == Entry(Moment.GENERATION_CHANGED, 11.0, 1, "old")


def test_a_big_world_is_summed_up_never_listed():
    """100,000 ranks on 2,000 nodes: one span of registrations, the first 32 nodes one by
    one and one entry counting the rest; the fold keeps O(shown) entries."""
    world, slots = 100_000, 50
    nodes = [NodeJoined(f"n{i}", i, 1.0 + i / 1000, f"h{i}", slots, "gpu") for i in range(world // slots)]
    started = time.perf_counter()
    entries = folded(nodes + registered(100.0, world, slots), world=world, slots=slots)
    elapsed = time.perf_counter() - started
    joins = [e for e in entries if e.moment is Moment.NODE_JOINED]
    assert len(joins) == MAX_NODES_SHOWN + 1
    assert (joins[-1].count, joins[-1].detail) == (world // slots - MAX_NODES_SHOWN, "and 1968 more nodes")
    span = next(e for e in entries if e.moment is Moment.RANKS_REGISTERED)
    assert (span.count, span.at, span.until) == (world, 100.0, 100.0 + world - 1)
    assert len(entries) == MAX_NODES_SHOWN + 3
    assert elapsed < 30, elapsed  # replaying 102k events (the state's own work dominates)


def test_generations_beyond_the_bound_drop_the_earliest_and_count_them():
    events = [NodeJoined("n0", 0, 1.0, "host-0", 2, "cpu")]
    events += [GenerationBumped(g, f"bump {g}", at=float(g)) for g in range(1, MAX_ENTRIES + 11)]
    state = RendezvousState(RendezvousConfig(job_id=JOB, plan=ParallelPlan(dp_shard=2), slots_per_node=2))
    state.apply_all(events)
    assert state.timeline.dropped == 10
    bumps = [e for e in state.timeline.entries() if e.moment is Moment.GENERATION_CHANGED]
    assert len(bumps) == MAX_ENTRIES and bumps[0].detail == "bump 11" and bumps[-1].generation == MAX_ENTRIES + 10


def _job(state: JobState = JobState.SUCCEEDED, **fields) -> Job:
    spec = JobSpec.build(job_id=JOB, plan=ParallelPlan(dp_shard=4), num_nodes=2, command=["true"])
    values = dict(
        submitted_at=0.5,
        state=state,
        reason="every worker of generation 1 exited 0",
        nodes=("n0", "n1"),
        allocated_at=1.0,
        ended_at=35.0,
        owner="submitter:alice",
    )
    values.update(fields)
    return Job(spec, **values)


def test_the_cluster_moments_open_and_close_the_rendezvous_entries():
    nodes = [NodeJoined("n0", 0, 1.0, "host-0", 2, "cpu"), NodeJoined("n1", 1, 1.0, "host-1", 2, "cpu")]
    entries = job_timeline(_job(), folded(nodes + registered(10.0)))
    assert [e.moment for e in entries] == [
        Moment.SUBMITTED,
        Moment.ALLOCATED,
        Moment.NODE_JOINED,  # at the allocation's time, after it
        Moment.NODE_JOINED,
        Moment.RANKS_REGISTERED,
        Moment.WORLD_FORMED,
        Moment.ENDED,
    ]
    assert entries[1].detail == "nodes n0, n1"
    assert entries[-1].detail == "SUCCEEDED: every worker of generation 1 exited 0"
    times = [e.at for e in entries]
    assert times == sorted(times)


def test_a_pruned_job_shows_the_cluster_moments_and_the_pruning():
    entries = job_timeline(_job(log_pruned=True, pruned_at=3600.0), None)
    assert [e.moment for e in entries] == [Moment.SUBMITTED, Moment.ALLOCATED, Moment.ENDED, Moment.LOG_PRUNED]


def test_a_job_cancelled_before_allocation_has_no_allocation():
    entries = job_timeline(
        _job(JobState.CANCELLED, reason="job cancelled by admin:ops", nodes=(), allocated_at=0), None
    )
    assert [e.moment for e in entries] == [Moment.SUBMITTED, Moment.ENDED]
    assert entries[-1].detail == "CANCELLED: job cancelled by admin:ops"


def test_every_moment_has_its_proto_name():
    assert {f"TIMELINE_{m.name}" for m in Moment} == {v.name for v in pb.TimelineMoment.DESCRIPTOR.values if v.number}


def _timeline_message(details: list[str]) -> pb.JobTimeline:
    reply = pb.JobTimeline(job_id=JOB, state=pb.FAILED)
    for i, detail in enumerate(details):
        entry = reply.entries.add(moment=pb.TIMELINE_JOB_FAILED, detail=detail, generation=i)
        entry.at.FromNanoseconds(int((1_700_000_000 + i * 1.5) * 1e9))
    reply.entries[0].until.FromNanoseconds(int(1_700_000_002.25 * 1e9))
    reply.entries[0].count = 7
    return reply


def test_the_rendering_is_one_row_per_entry_even_for_a_multi_line_reason():
    data = timeline_dict(_timeline_message(["first", "Traceback (most recent call last):\n  File x\nValueError: boom"]))
    assert data["entries"][0]["offset_s"] == 0.0 and data["entries"][0]["until_offset_s"] == 2.25
    assert data["entries"][1]["detail"].count("\n") == 2  # --json keeps the full text
    text = render_timeline(data)
    lines = text.splitlines()
    assert lines[0] == f"job {JOB}: FAILED" and len(lines) == 2 + 2  # header row + 2 entries
    assert "+0.000..+2.250" in lines[2] and "job failed (7)" in lines[2]
    assert lines[3].endswith("Traceback (most recent call last): File x ValueError: boom")


def test_job_list_keeps_one_row_per_job_whatever_the_reason_holds():
    ray_error = 'ray.exceptions.RayTaskError(ValueError): \x1b[36mray::train()\x1b[39m\n  File "t.py"\n' + "x" * 300
    jobs = [
        {"job_id": "a", "state": "FAILED", "world_size": 2, "owner": "", "nodes": ["n0"], "reason": ray_error},
        {"job_id": "b", "state": "SUCCEEDED", "world_size": 2, "owner": "", "nodes": ["n1"], "reason": "ok"},
    ]
    lines = render_list(jobs).splitlines()
    assert len(lines) == 3 and lines[2].startswith("b ")
    assert lines[1].endswith("...") and "\x1b" not in lines[1]
    assert one_line("a\r\n\tb  c") == "a b c"
    assert "\n" not in progress(jobs[0]) and progress(jobs[0]).startswith("a: FAILED (ray.exceptions.RayTaskError")


def test_a_running_an_ended_and_a_pruned_job_each_read_their_timeline_from_what_is_kept(tmp_path):
    """In process over real SQLite logs: a running job's timeline from its engine, an ended
    one's replayed from its own log (closed again), a pruned one's from the cluster's log
    with a note of what its summary holds."""
    import asyncio

    from test_job_lifecycle_cost import claimed, cluster_over, config_for, joined

    from meshgate.coordinator import readmodel
    from meshgate.coordinator.rendezvous import RegisterInput
    from meshgate.coordinator.store import MemoryStore

    async def scenario():
        # The real clock: a job's engine dates its events with it (JobEngines passes no clock).
        config = config_for(tmp_path, retention="1h")
        cluster = cluster_over(config, MemoryStore(), time.time)
        await joined(cluster, "n0")
        await cluster.submit(claimed("a", "n0"))
        engine = cluster.engine("a")
        for rank in (1, 0):
            await engine.register(RegisterInput("a", f"n0/rank{rank}", b"n" * 16, "n0", rank, rank))

        def moments(job_id: str) -> list[str]:
            reply = readmodel.timeline(cluster, cluster.job(job_id))
            times = [e.at.ToNanoseconds() for e in reply.entries]
            assert times == sorted(times), reply
            return [pb.TimelineMoment.Name(e.moment).removeprefix("TIMELINE_") for e in reply.entries]

        running = ["SUBMITTED", "ALLOCATED", "NODE_JOINED", "RANKS_REGISTERED", "WORLD_FORMED"]
        assert moments("a") == running
        await cluster.finish("a", True, "done")
        assert cluster.engines == {} and moments("a") == running + ["ENDED"]
        assert cluster.job_engines.stores == {}  # the replayed log was closed again
        span = readmodel.timeline(cluster, cluster.job("a")).entries[3]
        assert span.count == 2 and span.until.ToNanoseconds() >= span.at.ToNanoseconds()
        cluster.clock = lambda: time.time() + 3601  # past the retention
        await cluster.prune()
        pruned = readmodel.timeline(cluster, cluster.job("a"))
        assert moments("a") == ["SUBMITTED", "ALLOCATED", "ENDED", "LOG_PRUNED"]
        assert pruned.note.startswith(
            "its own log was deleted after the retention (shown: the cluster's log; its summary:"
        )
        assert "generation 0, 2/2 ranks registered at the end, nodes n0 active" in pruned.note
        cluster.close()

    asyncio.run(scenario())
