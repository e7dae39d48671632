"""Replacement from the pool (issue #30, coordinator/cluster_state/replacement.py and the
engine's admission of the node given): pure decisions, table-tested. The real-process
test is tests/test_node_replacement_cluster.py."""

from __future__ import annotations

import pytest

from meshgate.coordinator.cluster_state.replacement import Vacancy, choose, nearness
from meshgate.coordinator.cluster_state.timeline import job_timeline
from meshgate.coordinator.jobs import Caller, ClusterNode, ClusterState, JobState, PoolState
from meshgate.coordinator.rendezvous import (
    AdmittedNode,
    Code,
    GenerationBumped,
    NodeReplaced,
    NodeState,
    NodeStateChanged,
    RendezvousError,
    WorkerSucceeded,
)
from meshgate.plan import ParallelPlan
from test_exit_decisions import running
from test_jobs import joined, spec, submit

ALICE = Caller("admin:alice", admin=True)
LOST = {"switch": "s1", "rack": "r1"}
# Named so that node id order is the wrong preference: far < rack < switch.
CANDIDATES = {"a-far": {"switch": "s9", "rack": "r9"}, "b-rack": {"switch": "s2", "rack": "r1"}, "c-switch": LOST}


def node(node_id: str, **labels: str) -> ClusterNode:
    return ClusterNode(node_id, node_id, 2, "cpu", dict(labels), "h", bytes(32), 0.0, 0.0)


@pytest.mark.parametrize(
    "candidates, chosen, why",
    [
        (("a-far", "b-rack", "c-switch"), "c-switch", "same switch s1"),
        (("a-far", "b-rack"), "b-rack", "same rack r1"),
        (("a-far",), "a-far", ""),
        ((), None, ""),
    ],
)
def test_the_nearest_node_is_chosen_same_switch_then_same_rack_then_any(candidates, chosen, why):
    lost = node("n1", **LOST)
    picked = choose(lost, [node(c, **CANDIDATES[c]) for c in candidates])
    assert (picked.node_id if picked else None) == chosen
    if picked is not None:
        assert nearness(lost, picked)[1] == why


def test_an_unlabelled_lost_node_is_near_nothing_and_the_first_by_id_is_chosen():
    assert choose(node("n1"), [node("b", switch=""), node("a", switch="s1")]).node_id == "a"
    assert nearness(node("n1"), node("a", switch="")) == (3, "")


def pool_with_running_job(**candidates: dict) -> ClusterState:
    """Job 'j' runs on n0, n1 (switch s1, rack r1); then the candidates join, idle."""
    state = ClusterState()
    for node_id in ("n0", "n1"):
        joined(state, node_id, **LOST)
    (allocated,) = submit(state, spec("j", num_nodes=2), 1.0)
    assert allocated.nodes == ("n0", "n1")
    for node_id, labels in candidates.items():
        joined(state, node_id, **labels)
    return state


LOST_N1 = [Vacancy("j", "n1", 1, 5.0)]


def test_a_lost_block_is_given_the_nearest_idle_node_and_the_event_replays():
    state = pool_with_running_job(**CANDIDATES)
    (given,) = state.decide_replacements(LOST_N1, 6.0)
    assert (given.job_id, given.node_id, given.lost_id, given.why) == ("j", "c-switch", "n1", "same switch s1")
    for folded in (state, pool_with_running_job(**CANDIDATES)):  # live, and a restarted coordinator's fold
        folded.apply(given)
        job = folded.jobs["j"]
        assert job.replacements == (("c-switch", "n1", 6.0),) and "c-switch" in job.given
        assert folded.nodes["c-switch"].job_id == "j"
        assert [n.node_id for n in folded.idle_nodes(6.0)] == ["a-far", "b-rack"]
        assert folded.check_serves("c-switch", "j") is job
    timeline = job_timeline(state.jobs["j"], None)
    (moment,) = [e for e in timeline if e.node_id == "c-switch"]
    assert moment.detail == "given from the pool to take the block of 'n1' (same switch s1)"
    # the job's end returns the node to the pool with the others
    state.apply_all(state.decide_end("j", JobState.SUCCEEDED, "done", 7.0))
    assert state.nodes["c-switch"].job_id == ""


@pytest.mark.parametrize(
    "hold",
    ["cordon", "quarantine", "unhealthy", "busy", "clearing", "silent", "small"],
)
def test_a_node_held_busy_or_too_small_is_never_given_and_the_job_says_why_it_waits(hold):
    state = pool_with_running_job(**{"c-switch": LOST})
    candidate = state.nodes["c-switch"]
    if hold == "cordon":
        state.apply_all(state.decide_cordon("c-switch", "bad DIMM", ALICE, 2.0))
    elif hold == "quarantine":
        candidate.quarantine = "3 failures within 3600s"
    elif hold == "unhealthy":
        state.note_health("c-switch", False, "disk probe failed", ("i1", 1))
    elif hold == "busy":
        submit(state, spec("other", plan=ParallelPlan(dp_shard=2), num_nodes=1), 2.0)
        assert candidate.job_id == "other"
    elif hold == "clearing":
        candidate.units_clear = False
    elif hold == "silent":
        candidate.last_seen = -100.0
    elif hold == "small":
        candidate.slots = 1
    assert state.decide_replacements(LOST_N1, 6.0) == ()
    reason = state.waiting_reason(state.jobs["j"], LOST_N1, 60.0, 6.0)
    assert reason.startswith("waiting for a node: node 'n1' (node_rank 1) lost 1s ago; ")
    assert "no idle node of the pool with 2 slots can take it" in reason
    assert "it fails if none comes within lost_node_timeout_s=60 (59s left)" in reason
    shown = {"cordon": "cordoned", "quarantine": "quarantined", "unhealthy": "unhealthy", "clearing": "clearing"}
    if hold in shown:
        assert f"c-switch {shown[hold]}" in reason, reason


def test_a_node_reserved_for_the_head_of_the_queue_is_never_given():
    """'big' needs 4 nodes: the idle c-switch and b-rack are reserved for it (it is first in
    line); giving one to 'j' would delay it."""
    state = pool_with_running_job(**{"b-rack": CANDIDATES["b-rack"], "c-switch": LOST})
    assert submit(state, spec("big", plan=ParallelPlan(dp_shard=8), num_nodes=4), 2.0) == ()
    assert state.decide_replacements(LOST_N1, 6.0) == ()
    reason = state.waiting_reason(state.jobs["j"], LOST_N1, 60.0, 6.0)
    assert "b-rack, c-switch reserved for job 'big' (first in line)" in reason, reason
    state.apply_all(state.decide_cancel("big", "not now", 7.0))
    assert [e.node_id for e in state.decide_replacements(LOST_N1, 8.0)] == ["c-switch"]


def test_two_blocks_get_two_nodes_and_a_job_naming_its_nodes_gets_none():
    state = pool_with_running_job(**CANDIDATES)
    both = [Vacancy("j", "n0", 0, 5.0), Vacancy("j", "n1", 1, 5.0)]
    assert [(e.node_id, e.lost_id) for e in state.decide_replacements(both, 6.0)] == [
        ("c-switch", "n0"),
        ("b-rack", "n1"),
    ]
    state.apply_all(state.decide_end("j", JobState.SUCCEEDED, "done", 7.0))
    state.note_units("n0", ())  # its agent shows the job's processes gone
    submit(state, spec("named", plan=ParallelPlan(dp_shard=2), num_nodes=0, node_ids=("n0",)), 8.0)
    assert state.jobs["named"].state is JobState.RUNNING
    named = [Vacancy("named", "n0", 0, 9.0)]
    assert state.decide_replacements(named, 10.0) == ()
    assert "the job names its nodes (node_ids)" in state.waiting_reason(state.jobs["named"], named, 60.0, 10.0)
    assert state.waiting_reason(state.jobs["named"], [], 60.0, 10.0) == ""


# ---- the job's engine: the node given takes the block ------------------------------------------

GIVEN = AdmittedNode("node-p", -1, "host-p", 2, "cpu", "hp", "33" * 32, replaces="node-b")


def lost_b(state) -> None:
    state.apply_all((NodeStateChanged("node-b", NodeState.LOST, 10.0, "no heartbeat"),))
    state.apply_all((GenerationBumped(1, "node 'node-b' (node_rank 1) lost", at=10.0),))


def test_the_node_given_takes_the_waiting_block_at_once_and_a_replayed_admission_adds_nothing():
    state = running()
    lost_b(state)
    assert [n.node_id for n in state.awaiting_replacement()] == ["node-b"]
    events = state.decide_admit([GIVEN], 11.0)
    assert events[-1] == NodeReplaced("node-p", "node-b", 1, 11.0)
    state.apply_all(events)
    assert state.nodes["node-p"].state is NodeState.ACTIVE and state.nodes["node-p"].node_rank == 1
    assert state.nodes["node-b"].state is NodeState.REPLACED and state.node_ids_by_rank[1] == "node-p"
    assert state.awaiting_replacement() == [] and state.decide_admit([GIVEN], 12.0) == ()
    assert state.nodes["node-a"].node_rank == 0  # every other rank stays where it was


def test_a_block_that_no_longer_waits_takes_the_node_given_as_a_spare():
    state = running()
    lost_b(state)
    state.apply_all((NodeStateChanged("node-b", NodeState.ACTIVE, 10.5, "rejoined"),))
    assert state.awaiting_replacement() == []
    state.apply_all(state.decide_admit([GIVEN], 11.0))
    assert state.nodes["node-p"].state is NodeState.SPARE and state.node_ids_by_rank[1] == "node-b"


def test_no_block_waits_for_the_pool_while_a_spare_stands_by_or_the_generation_is_finishing():
    spared = running(spare=True)
    spared.apply_all((NodeStateChanged("node-b", NodeState.LOST, 10.0, "no heartbeat"),))
    assert spared.awaiting_replacement() == [] and spared.awaiting_replacement(spares_too=True) != []
    finishing = running()
    finishing.apply_all((WorkerSucceeded("node-a", 0, 0, 9.0),))
    finishing.apply_all((NodeStateChanged("node-b", NodeState.LOST, 10.0, "no heartbeat"),))
    assert finishing.awaiting_replacement() == []  # its exits are awaited, never run again elsewhere


# ---- drain: a cordon, and out of the job it serves ----------------------------------------------


def test_a_drained_node_leaves_its_running_job_is_draining_then_cordoned_and_never_rejoins_it():
    state = pool_with_running_job(**{"c-switch": LOST})
    events = state.decide_drain("n1", " bad DIMM ", ALICE, 3.0)
    assert [(e.node_id, e.job_id, e.reason) for e in events] == [("n1", "j", "bad DIMM")]
    replayed = pool_with_running_job(**{"c-switch": LOST})  # a restarted coordinator folds the same log
    for folded in (state, replayed):
        folded.apply_all(events)
        n1 = folded.nodes["n1"]
        assert (n1.job_id, n1.drained_from, n1.cordon) == ("", "j", "by admin:alice: bad DIMM")
        assert folded.pool_state(n1, 3.0) is PoolState.DRAINING
        assert folded.check_serves("n1", "j")  # it still reports its workers' exits and hears the end
        with pytest.raises(RendezvousError, match="drained out of job 'j'") as refused:
            folded.check_not_drained("n1", "j")
        assert refused.value.code is Code.FAILED_PRECONDITION
    state.note_units("n1", ())  # its agent shows its workers gone
    assert (
        state.pool_state(state.nodes["n1"], 4.0) is PoolState.CORDONED
        and state.idle_nodes(4.0)[0].node_id == "c-switch"
    )
    (moment,) = [e for e in job_timeline(state.jobs["j"], None) if e.node_id == "n1"]
    assert moment.detail == "drained by admin:alice: bad DIMM: its part goes to a replacement"
    state.apply_all(state.decide_uncordon("n1", ALICE, 5.0))
    assert state.nodes["n1"].drained_from == "" and state.pool_state(state.nodes["n1"], 5.0) is PoolState.IDLE


@pytest.mark.parametrize(
    "node_id, reason, code, named",
    [
        ("ghost", "x", Code.NOT_FOUND, "'ghost'"),
        ("n1", "   ", Code.INVALID_ARGUMENT, "reason is required: say why the node is drained"),
        ("n1", "x" * 201, Code.INVALID_ARGUMENT, "at most 200"),
        ("bad id!", "x", Code.INVALID_ARGUMENT, "node_id"),
    ],
)
def test_a_drain_refuses_bad_input_naming_it_and_changes_nothing(node_id, reason, code, named):
    state = pool_with_running_job()
    with pytest.raises(RendezvousError) as refused:
        state.decide_drain(node_id, reason, ALICE, 3.0)
    assert refused.value.code is code and named in refused.value.message
    assert state.nodes["n1"].job_id == "j" and not state.nodes["n1"].cordon


def test_an_idle_node_drained_is_cordoned_and_a_declared_jobs_node_is_drained_by_its_agent():
    state = pool_with_running_job(**{"c-switch": LOST})
    (idle,) = state.decide_drain("c-switch", "bad fan", ALICE, 3.0)
    assert idle.job_id == ""
    state.apply(idle)
    assert state.pool_state(state.nodes["c-switch"], 3.0) is PoolState.CORDONED
    assert state.decide_drain("c-switch", "bad fan", ALICE, 4.0) == ()  # the same word again: nothing to log
    state.jobs["j"].declared = True
    with pytest.raises(RendezvousError, match="stopping its agent") as refused:
        state.decide_drain("n1", "x", ALICE, 5.0)
    assert refused.value.code is Code.FAILED_PRECONDITION


def test_a_block_gets_one_node_per_loss_though_a_second_pass_sees_it_waiting_before_its_engine_admits_it():
    """Two calls reconcile at once: the first gave c-switch (its event is in the cluster's
    log; the engine admits the node only after that is durable). The second still sees the
    block waiting and gives nothing: b-rack stays idle (a real drain test caught it as a
    spare of the job). A later loss of the same block is a new vacancy."""
    state = pool_with_running_job(**CANDIDATES)
    state.apply_all(state.decide_replacements(LOST_N1, 6.0))
    assert state.decide_replacements(LOST_N1, 6.5) == ()
    assert state.waiting_reason(state.jobs["j"], LOST_N1, 60.0, 6.5) == ""
    assert [e.node_id for e in state.decide_replacements([Vacancy("j", "n1", 1, 9.0)], 9.5)] == ["b-rack"]


# ---- through a coordinator restart: the cluster's log holds it, the engine had not heard ------------


async def restartable(tmp_path):
    """A jobs-mode coordinator over stores that outlive it (memory), nodes n0, n1 (switch s1)
    and n2 (switch s2) joined, and job 'j' (one node) running on n2, alone on its switch.
    Returns (coordinator, its clock, a restart over the same stores)."""
    from meshgate.attestation import SigningKey
    from meshgate.coordinator.cluster import ClusterCoordinator
    from meshgate.coordinator.jobs import JobSpec
    from meshgate.coordinator.keys import KeyRing
    from meshgate.coordinator.store import MemoryStore
    from test_node_calls import Clock

    cluster_store, job_stores, clock = MemoryStore(), {}, Clock()

    def start() -> ClusterCoordinator:
        return ClusterCoordinator(
            cluster_store,
            KeyRing(tmp_path / "keys"),
            lambda config: job_stores.setdefault(config.job_id, MemoryStore()),
            attestation_ttl_s=600,
            heartbeat_timeout_s=15.0,
            require_vouch=False,
            clock=clock,
        )

    coordinator = start()
    for node_id, switch in (("n0", "s1"), ("n1", "s1"), ("n2", "s2")):
        token, _ = await coordinator.pool.create_join_token(600, node_id)
        key = SigningKey.generate().public_raw
        await coordinator.pool.join(node_id, node_id, 2, "cpu", {"switch": switch}, token, public_key=key)
    await coordinator.submit(JobSpec.build(job_id="j", plan=ParallelPlan(dp_shard=2), num_nodes=1, command=("x",)))
    assert coordinator.state.jobs["j"].nodes == ("n2",)

    async def restart() -> ClusterCoordinator:
        coordinator.close()
        restarted = start()
        await restarted.start()
        return restarted

    return coordinator, clock, restart


async def test_a_node_given_before_a_crash_takes_its_block_when_the_restarted_coordinator_admits_it(tmp_path):
    coordinator, clock, restart = await restartable(tmp_path)
    clock.now += 20.0  # n2 silent past the timeout; n0 and n1 heartbeat the pool
    for node_id in ("n0", "n1"):
        coordinator.state.touch(node_id, clock.now)
    await coordinator.engines["j"].sweep_lost()
    (vacancy,) = coordinator.job_nodes.vacancies()
    # the crash's seam: the cluster's log holds the node given; its engine never heard
    await coordinator.apply(coordinator.state.decide_replacements([vacancy], clock.now))
    assert "n0" not in coordinator.engines["j"].state.nodes
    restarted = await restart()
    engine = restarted.engines["j"].state
    assert engine.node_ids_by_rank[0] == "n0" and engine.nodes["n0"].state is NodeState.ACTIVE
    assert engine.nodes["n2"].state is NodeState.REPLACED and restarted.state.nodes["n0"].job_id == "j"
    assert restarted.job_nodes.vacancies() == [] and restarted.job_nodes.waiting_reason(restarted.state.jobs["j"]) == ""


async def test_a_drain_the_engine_had_not_heard_of_before_a_crash_ends_the_generation_after_the_restart(tmp_path):
    coordinator, clock, restart = await restartable(tmp_path)
    # the crash's seam: the cluster's log holds the drain; the job's engine never heard
    await coordinator.apply(coordinator.state.decide_drain("n2", "bad DIMM", ALICE, clock.now))
    assert coordinator.engines["j"].state.nodes["n2"].state is NodeState.ACTIVE
    restarted = await restart()
    engine = restarted.engines["j"].state
    assert engine.nodes["n2"].state is NodeState.LEFT and engine.generation == 1
    assert restarted.state.pool_state(restarted.state.nodes["n2"], clock.now) is PoolState.DRAINING
    # no node is idle until its agent's heartbeat shows it clear after the restart: the job says why it waits
    reason = restarted.job_nodes.waiting_reason(restarted.state.jobs["j"])
    assert "node 'n2' (node_rank 0) left 0s ago" in reason and "n0 clearing, n1 clearing" in reason, reason
    for node_id in ("n0", "n1"):
        restarted.pool.note_units(node_id, ())
    await restarted.reconcile()
    assert restarted.engines["j"].state.node_ids_by_rank[0] == "n0"  # the first by id: none shares n2's switch
