"""The cluster's pure decisions (coordinator/jobs.py): node membership, job specs,
FIFO allocation of whole nodes with locality, job ends, replay. No sockets."""

from __future__ import annotations

import pytest

from meshgate.attestation import secret_hash
from meshgate.coordinator.jobs import (
    ClusterNodeJoined,
    ClusterState,
    JobAllocated,
    JobEnded,
    JobSpec,
    JobState,
    JobSubmitted,
)
from meshgate.coordinator.rendezvous import Code, JoinAuth, RendezvousError, TokenCreated
from meshgate.coordinator.store import codec
from meshgate.plan import ParallelPlan

KEY = bytes(range(32))


def spec(job_id="j", plan=ParallelPlan(dp_shard=4), **kwargs) -> JobSpec:
    kwargs.setdefault("num_nodes", 2)
    kwargs.setdefault("command", ("python", "train.py"))
    return JobSpec.build(job_id=job_id, plan=plan, **kwargs)


def refused(code: Code, *fragments: str):
    class Check:
        def __enter__(self):
            self.raises = pytest.raises(RendezvousError)
            self.info = self.raises.__enter__()
            return self

        def __exit__(self, *exc):
            handled = self.raises.__exit__(*exc)
            error = self.info.value
            assert error.code is code, error
            for fragment in fragments:
                assert fragment in error.message, error.message
            return handled

    return Check()


def joined(state: ClusterState, node_id: str, now: float = 0.0, slots: int = 2, **labels) -> None:
    """A node joins with a token minted for it."""
    token = f"token-{node_id}"
    state.apply_all(state.decide_create_token(secret_hash(token), 600, node_id, now))
    auth = JoinAuth(token=token, public_key=KEY, new_credential_hash=secret_hash(f"cred-{node_id}".encode()))
    state.apply_all(state.decide_join(node_id, node_id, slots, "cpu", labels, auth, now))


def pool(*nodes: tuple, timeout: float = 15.0) -> ClusterState:
    state = ClusterState(heartbeat_timeout_s=timeout)
    for node_id, labels in nodes:
        joined(state, node_id, **labels)
    return state


# ---- job specs ----------------------------------------------------------------------------------


def test_a_spec_derives_slots_from_nodes_or_nodes_from_slots():
    plan = ParallelPlan(tp=2, dp_shard=4)
    assert (spec(plan=plan, num_nodes=4).slots_per_node, spec(plan=plan, num_nodes=4).num_nodes) == (2, 4)
    by_slots = JobSpec.build(job_id="j", plan=plan, slots_per_node=4, command=("x",))
    assert (by_slots.num_nodes, by_slots.slots_per_node) == (2, 4)
    pinned = JobSpec.build(job_id="j", plan=plan, node_ids=("a", "b"), command=("x",))
    assert (pinned.num_nodes, pinned.slots_per_node, pinned.node_ids) == (2, 4, ("a", "b"))
    one = JobSpec.build(job_id="j", plan=plan, command=("x",))
    assert (one.num_nodes, one.slots_per_node) == (1, 8)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"num_nodes": 3}, "nodes 3 does not divide"),
        ({"num_nodes": 2, "slots_per_node": 3}, "slots_per_node 3 does not divide"),
        ({"num_nodes": 4, "slots_per_node": 2}, "nodes 4 x slots_per_node 2 = 8"),
        ({"num_nodes": 0, "node_ids": ("a", "a")}, "node_ids has duplicates"),
        ({"num_nodes": 2, "node_ids": ("a",)}, "nodes 2 differs from the 1 node_ids"),
        ({"mode": "free"}, "mode must be assigned or claimed, got 'free'"),
        ({"topology_policy": "maybe"}, "topology_policy must be warn, refuse or allow, got 'maybe'"),
        ({"command": ()}, "command is empty"),
        ({"restart_policy": "always"}, "restart_policy must be never or on-failure, got 'always'"),
        ({"restart_policy": "on-failure", "max_restarts": -1}, "max_restarts must be in [0, 1000], got '-1'"),
        ({"spares": True}, "spares must be an integer >= 0"),
        ({"lost_node_timeout_s": 0}, "lost_node_timeout_s must be in (0, 604800]"),
        ({"time_limit_s": -1}, "time_limit_s must be in [0, 31622400] (0: none), got '-1'"),
        ({"time_limit_s": float("nan")}, "time_limit_s must be in [0, 31622400]"),
        ({"time_limit_s": True}, "time_limit_s must be in [0, 31622400]"),
        ({"env": {"A=B": "c"}}, "env key 'A=B'"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_field(kwargs, field):
    with refused(Code.INVALID_ARGUMENT, field):
        spec(**kwargs)


def test_job_ids_are_checked_and_the_cluster_log_id_is_reserved():
    with refused(Code.INVALID_ARGUMENT, "job_id 'cluster' is reserved"):
        spec(job_id="cluster")
    with refused(Code.INVALID_ARGUMENT, "job_id 'a b' must be"):
        spec(job_id="a b")
    with refused(Code.INVALID_ARGUMENT, "..."):  # a long id is echoed as a bounded prefix
        spec(job_id="x" * 10_000)


def test_a_spec_round_trips_through_its_json_and_never_restarts_with_restart_policy_never():
    original = spec(
        plan=ParallelPlan(tp=2, dp_shard=2, order=("cp", "tp", "dp_shard", "dp_replicate", "pp")),
        env={"B": "2", "A": "1"},
        spares=1,
        mode="claimed",
        restart_policy="on-failure",
    )
    assert original.max_restarts == 3  # the on-failure default
    assert JobSpec.from_json(original.to_json()) == original
    assert spec(restart_policy="never", max_restarts=5).max_restarts == 0
    with pytest.raises(ValueError, match="not a job spec"):
        JobSpec.from_json('{"job_id": "j"}')


# ---- nodes --------------------------------------------------------------------------------------


def test_a_node_joins_once_with_a_token_bound_to_it_then_only_with_its_credential():
    state = ClusterState()
    state.apply_all(state.decide_create_token(secret_hash("t"), 600, "n0", 0.0))
    with refused(Code.UNAUTHENTICATED, "admits node 'n0', not node_id 'n1'"):
        state.decide_join("n1", "", 2, "cpu", {}, JoinAuth("t", public_key=KEY), 1.0)
    with refused(Code.UNAUTHENTICATED, "expired"):
        state.decide_join("n0", "", 2, "cpu", {}, JoinAuth("t", public_key=KEY), 601.0)
    events = state.decide_join(
        "n0",
        "h0",
        2,
        "cpu",
        {"switch": "s1"},
        JoinAuth("t", public_key=KEY, new_credential_hash=secret_hash(b"cred")),
        1.0,
    )
    state.apply_all(events)
    assert state.nodes["n0"].labels == {"switch": "s1"} and state.tokens[secret_hash("t")].used_by == "n0"
    with refused(Code.UNAUTHENTICATED, "already used"):
        state.decide_join("n9", "", 2, "cpu", {}, JoinAuth("t", public_key=KEY), 2.0)
    state.apply_all(state.decide_create_token(secret_hash("t2"), 600, "n0", 2.0))
    with refused(Code.PERMISSION_DENIED, "already holds a node credential"):
        state.decide_join("n0", "", 2, "cpu", {}, JoinAuth("t2", public_key=KEY), 3.0)
    with refused(Code.UNAUTHENTICATED, "node_credential is not valid"):
        state.decide_join("n0", "", 2, "cpu", {}, JoinAuth(credential=b"wrong"), 3.0)
    # a rejoin with the credential that changes nothing writes nothing; new labels are an event
    assert state.decide_join("n0", "h0", 2, "cpu", {"switch": "s1"}, JoinAuth(credential=b"cred"), 4.0) == ()
    (moved,) = state.decide_join("n0", "h0", 2, "cpu", {"switch": "s2"}, JoinAuth(credential=b"cred"), 4.0)
    assert isinstance(moved, ClusterNodeJoined) and moved.token_hash == ""


@pytest.mark.parametrize(
    "labels, fragment",
    [
        ({"switch": "a b"}, "labels: value 'a b'"),
        ({"": "x"}, "labels: key ''"),
        ({f"k{i}": "v" for i in range(17)}, "at most 16"),
    ],
)
def test_bad_labels_are_refused(labels, fragment):
    state = ClusterState()
    state.apply_all(state.decide_create_token(secret_hash("t"), 600, "n0", 0.0))
    with refused(Code.INVALID_ARGUMENT, fragment):
        state.decide_join("n0", "", 2, "cpu", labels, JoinAuth("t", public_key=KEY), 1.0)


def test_a_later_call_needs_the_nodes_own_credential():
    state = pool(("n0", {}))
    assert state.decide_node_call("n0", b"cred-n0").node_id == "n0"
    with refused(Code.PERMISSION_DENIED, "does not belong"):
        state.decide_node_call("n0", b"cred-n1")
    with refused(Code.UNAUTHENTICATED, "missing"):
        state.decide_node_call("n0", b"")
    with refused(Code.FAILED_PRECONDITION, "has not joined"):
        state.decide_node_call("n7", b"x")


# ---- allocation ---------------------------------------------------------------------------------


def submit(state: ClusterState, job: JobSpec, now: float = 1.0, wait_for_nodes: bool = False) -> tuple:
    state.apply_all(state.decide_submit(job, now, wait_for_nodes=wait_for_nodes))
    events = state.decide_allocate(now)
    state.apply_all(events)
    return events


def test_allocation_gives_whole_idle_nodes_fifo_and_returns_them_when_the_job_ends():
    state = pool(("n0", {}), ("n1", {}), ("n2", {}))
    (a,) = submit(state, spec("A", num_nodes=2))
    assert isinstance(a, JobAllocated) and a.nodes == ("n0", "n1")
    assert state.jobs["A"].state is JobState.RUNNING and state.nodes["n0"].job_id == "A"
    assert submit(state, spec("B", num_nodes=2)) == ()
    assert state.pending_reason(state.jobs["B"], 1.0) == (
        "needs 2 nodes of 2 slots; 1 idle; first in line: n0, n2 reserved for it from when job 'A' ends "
        "(it has no time limit)"
    )
    # C fits on the idle node, but that node is reserved for B, and C has no time limit: it
    # could delay B, so it waits (B is never starved)
    assert submit(state, spec("C", plan=ParallelPlan(dp_shard=2), num_nodes=1)) == ()
    assert "; behind job 'B' (first in line): n0, n2 reserved for it" in state.pending_reason(state.jobs["C"], 1.0)
    state.apply_all(state.decide_end("A", JobState.SUCCEEDED, "done", 2.0))
    assert state.nodes["n0"].job_id == "" and state.jobs["A"].ended_at == 2.0
    # Back in the pool only once each agent's heartbeat shows the job's unit empty.
    assert state.decide_allocate(2.0) == ()
    state.note_units("n0", ["A"])
    state.note_units("n1", ["A"])
    assert state.decide_allocate(2.0) == ()  # their units still hold a process: B waits
    state.note_units("n0", [])
    state.note_units("n1", [])
    allocated = state.decide_allocate(2.0)
    assert [(e.job_id, e.nodes) for e in allocated] == [("B", ("n0", "n1")), ("C", ("n2",))]


def test_allocation_keeps_a_job_under_one_switch_when_it_can():
    state = pool(
        ("a0", {"switch": "s1"}),
        ("b0", {"switch": "s2"}),
        ("b1", {"switch": "s2"}),
        ("a1", {"switch": "s1"}),
        ("a2", {"switch": "s1"}),
    )
    (two,) = submit(state, spec("two", num_nodes=2))
    assert two.nodes == ("b0", "b1")  # the smallest switch group that holds the job
    (three,) = submit(state, spec("three", plan=ParallelPlan(dp_shard=6), num_nodes=3))
    assert three.nodes == ("a0", "a1", "a2")


def test_a_job_larger_than_any_switch_takes_the_largest_groups_first_in_switch_order():
    state = pool(("a0", {"switch": "s1"}), ("b0", {"switch": "s2"}), ("b1", {"switch": "s2"}), ("c0", {}))
    (job,) = submit(state, spec("big", plan=ParallelPlan(dp_shard=6), num_nodes=3))
    assert job.nodes[:2] == ("b0", "b1")


def test_named_nodes_keep_their_order_and_wait_only_for_their_last_jobs_processes():
    state = pool(("n0", {}), ("n1", {}), ("n2", {}))
    submit(state, spec("A", plan=ParallelPlan(dp_shard=2), num_nodes=1, node_ids=("n1",)))
    state.apply_all(state.decide_cancel("A", "", 2.0))  # n1 is clearing: A's processes not yet gone
    assert submit(state, spec("named", num_nodes=0, node_ids=("n2", "n1")), 2.0) == ()
    assert "named node(s) not idle yet: n1" in state.pending_reason(state.jobs["named"], 2.0)
    assert "first in line: n1, n2 reserved for it, to start as soon as node 'n1' has cleared" in (
        state.pending_reason(state.jobs["named"], 2.0)
    )
    state.note_units("n1", [])
    (event,) = state.decide_allocate(2.0)
    assert event.nodes == ("n2", "n1")


@pytest.mark.parametrize(
    "time_limit_s, starts",
    [(0, False), (99, True), (100, False)],  # head's nodes are free at 100 (A's limit, from 0)
)
def test_a_job_naming_a_node_reserved_for_the_head_waits_unless_it_ends_in_time(time_limit_s, starts):
    state = pool(("n0", {}), ("n1", {}))
    submit(state, spec("A", plan=ParallelPlan(dp_shard=2), num_nodes=1, time_limit_s=101), 0.0)  # on n0 until 101
    assert submit(state, spec("head", num_nodes=2)) == ()  # n0 and n1 reserved for it from 101
    named = spec("named", plan=ParallelPlan(dp_shard=2), num_nodes=0, node_ids=("n1",), time_limit_s=time_limit_s)
    events = submit(state, named, 2.0)
    assert [(e.job_id, e.nodes) for e in events] == ([("named", ("n1",))] if starts else [])
    if not starts:
        reason = state.pending_reason(state.jobs["named"], 2.0)
        assert "behind job 'head' (first in line): n0, n1 reserved for it from in ~99s" in reason, reason
        assert "a time limit of 99s or less would start it now" in reason, reason


def test_a_job_naming_busy_nodes_is_accepted_and_waits_saying_which_then_starts_on_them():
    state = pool(("n0", {}), ("n1", {}), ("n2", {}), ("n3", {}))
    for node_id in ("n0", "n1", "n2"):  # n3 is silent past the heartbeat timeout
        state.touch(node_id, 20.0)
    submit(state, spec("A", plan=ParallelPlan(dp_shard=2), num_nodes=0, node_ids=("n0",)), 20.0)
    job = spec("named", num_nodes=0, node_ids=("n3", "n0"))
    assert submit(state, job, 20.0) == ()  # accepted: n0 serves A, n3 has left; it waits
    reason = state.pending_reason(state.jobs["named"], 20.0)
    assert reason.startswith("needs 2 nodes of 2 slots: named node(s) not idle yet: n3, n0; first in line"), reason
    # a later job takes no node the named job waits for, and runs on the others
    (later,) = submit(state, spec("later", plan=ParallelPlan(dp_shard=2), num_nodes=1), 20.0)
    assert later.nodes in (("n1",), ("n2",))
    state.apply_all(state.decide_end("A", JobState.SUCCEEDED, "done", 21.0))
    state.note_units("n0", [])
    state.touch("n3", 21.0)  # back in the pool
    (named,) = state.decide_allocate(21.0)
    assert (named.job_id, named.nodes) == ("named", ("n3", "n0"))


def test_a_job_naming_its_nodes_gets_its_spares_from_the_free_nodes_or_waits_for_them():
    state = pool(("n0", {"switch": "a"}), ("n1", {"switch": "b"}), ("n2", {"switch": "a"}), ("n3", {}))
    submit(state, spec("A", plan=ParallelPlan(dp_shard=2), num_nodes=1, node_ids=("n3",)))
    many = spec("many", plan=ParallelPlan(dp_shard=4), node_ids=("n1", "n0"), spares=2)
    assert submit(state, many) == ()  # one other node free for its 2 spares: it waits for n3
    assert "first in line: n0, n1, n2, n3 reserved for it from when job 'A' ends" in (
        state.pending_reason(state.jobs["many"], 1.0)
    )
    state.apply_all(state.decide_cancel("many", "", 1.0))
    (named,) = submit(state, spec("named", plan=ParallelPlan(dp_shard=4), node_ids=("n1", "n0"), spares=1))
    assert (named.nodes, named.spares) == (("n1", "n0"), ("n2",))


def test_spares_are_idle_nodes_taken_with_the_job_nearest_first():
    state = pool(("a0", {"switch": "s1"}), ("a1", {"switch": "s1"}), ("b0", {"switch": "s2"}), ("a2", {"switch": "s1"}))
    (job,) = submit(state, spec("A", num_nodes=2, spares=1))
    assert (job.nodes, job.spares) == (("a0", "a1"), ("a2",))
    assert state.nodes["a2"].job_id == "A"
    state2 = pool(("n0", {}), ("n1", {}))
    assert submit(state2, spec("A", num_nodes=2, spares=1), wait_for_nodes=True) == ()
    assert state2.pending_reason(state2.jobs["A"], 1.0) == (
        "needs 2 nodes of 2 slots (+1 spare), but only 2 nodes have joined: it waits for nodes that have not "
        "joined, and holds no nodes meanwhile"
    )


def test_nodes_that_are_silent_or_too_small_are_not_idle():
    state = pool(("n0", {}), ("n1", {}), timeout=5.0)
    joined(state, "small", slots=1)
    state.touch("n1", 10.0)  # n0 last seen at 0.0: silent for 10 s
    state.touch("small", 10.0)
    assert [n.node_id for n in state.idle_nodes(10.0)] == ["n1", "small"]
    assert submit(state, spec("A", num_nodes=2), now=10.0) == ()
    assert state.pending_reason(state.jobs["A"], 10.0) == (
        "needs 2 nodes of 2 slots; 1 idle; first in line: n0, n1 reserved for it from when node 'n0' is back in "
        "the pool (it left: drained, or no heartbeat)"
    )


def test_a_job_id_is_unique_forever_and_an_ended_job_cannot_be_cancelled():
    state = pool(("n0", {}))
    submit(state, spec("A", plan=ParallelPlan(dp_shard=2), num_nodes=1))
    state.apply_all(state.decide_cancel("A", "no longer needed", 2.0))
    assert (state.jobs["A"].state, state.jobs["A"].reason) == (JobState.CANCELLED, "no longer needed")
    with refused(Code.FAILED_PRECONDITION, "already ended: CANCELLED"):
        state.decide_cancel("A", "", 3.0)
    with refused(Code.ALREADY_EXISTS, "never reused"):
        state.decide_submit(spec("A"), 3.0)
    with refused(Code.NOT_FOUND, "not known"):
        state.decide_cancel("B", "", 3.0)
    # an engine's verdict ends only a RUNNING job, once
    assert state.decide_end("A", JobState.FAILED, "late", 4.0) == ()


def test_a_pending_job_can_be_cancelled_and_never_gets_nodes():
    state = pool(("n0", {}))
    assert submit(state, spec("A", num_nodes=2), wait_for_nodes=True) == ()
    state.apply_all(state.decide_cancel("A", "", 2.0))
    assert state.decide_allocate(3.0) == () and state.jobs["A"].nodes == ()


def recording() -> tuple[ClusterState, list]:
    """A cluster state that keeps every event it applies, in order: its log."""
    log: list = []

    class Recorded(ClusterState):
        def apply(self, event):
            log.append(event)
            super().apply(event)

    return Recorded(), log


def test_replaying_the_cluster_log_through_the_codec_rebuilds_the_same_state():
    state, log = recording()
    for node_id, labels in (("n0", {"switch": "s1"}), ("n1", {}), ("n2", {})):
        joined(state, node_id, **labels)
    submit(state, spec("A", num_nodes=2, spares=1))
    state.apply_all(state.decide_end("A", JobState.FAILED, "worker exited 1", 2.0))
    submit(state, spec("B", num_nodes=2), now=3.0)
    assert {TokenCreated, ClusterNodeJoined, JobSubmitted, JobAllocated, JobEnded} == {type(e) for e in log}
    replayed = ClusterState()
    replayed.apply_all(codec.decode(codec.encode(e), "test") for e in log)
    assert {k: (j.spec, j.state, j.nodes, j.spares, j.reason) for k, j in replayed.jobs.items()} == {
        k: (j.spec, j.state, j.nodes, j.spares, j.reason) for k, j in state.jobs.items()
    }
    assert {n: (v.job_id, v.labels, v.credential_hash) for n, v in replayed.nodes.items()} == {
        n: (v.job_id, v.labels, v.credential_hash) for n, v in state.nodes.items()
    }
    assert replayed.tokens == state.tokens


def test_only_a_running_job_of_external_workers_is_finished_by_word():
    state = pool(("n0", {}), ("n1", {}))
    submit(state, JobSpec.build(job_id="ray", plan=ParallelPlan(dp_shard=2), num_nodes=1, mode="claimed"))
    submit(state, spec("cmd", plan=ParallelPlan(dp_shard=2), num_nodes=1))
    with refused(Code.FAILED_PRECONDITION, "ends from its workers' exits"):
        state.decide_finish("cmd", True, "", 2.0)
    (ended,) = state.decide_finish("ray", False, "", 2.0)
    state.apply(ended)
    assert (state.jobs["ray"].state, state.jobs["ray"].reason) == (JobState.FAILED, "failed, said its submitter")
    with refused(Code.FAILED_PRECONDITION, "is FAILED, not RUNNING"):
        state.decide_finish("ray", True, "", 3.0)
    with refused(Code.INVALID_ARGUMENT, "command is empty"):
        spec("x", command=())  # an assigned-mode job needs a command; a claimed one need not


# ---- jobs that cannot run, and passing a job that waits ------------------------------------------


@pytest.mark.parametrize(
    "job, fragments",
    [
        (
            spec("wide", plan=ParallelPlan(dp_shard=16), num_nodes=2),
            ("needs 2 nodes of 8 slots", "(the most any has is 4)"),
        ),
        (
            spec("many", plan=ParallelPlan(dp_shard=16), num_nodes=8),
            ("needs 8 nodes of 2 slots", "only 4 nodes have joined"),
        ),
        (
            spec("spared", plan=ParallelPlan(dp_shard=8), num_nodes=2, spares=3),
            ("(+3 spares)", "only 1 of the 4 joined node"),
        ),
        (
            spec("pinned", plan=ParallelPlan(dp_shard=2), num_nodes=0, node_ids=("n9",)),
            ("pinned node(s) n9 have not joined",),
        ),
        (
            spec("tiny", plan=ParallelPlan(dp_shard=8), num_nodes=0, node_ids=("s0", "big")),
            ("pinned node(s) s0 (2 slots) have fewer than 4",),
        ),
    ],
)
def test_a_job_no_set_of_joined_nodes_could_hold_is_refused_naming_what_is_missing(job, fragments):
    state = pool(("s0", {}), ("s1", {}), ("s2", {}))
    joined(state, "big", slots=4)
    with refused(
        Code.FAILED_PRECONDITION, "can never run on the nodes that have joined", "--wait-for-nodes", *fragments
    ):
        state.decide_submit(job, 1.0)
    assert state.jobs == {}
    # the submitter may say it waits for nodes to join: accepted PENDING, and it says why waiting is needed
    assert submit(state, job, wait_for_nodes=True) == ()
    reason = state.pending_reason(state.jobs[job.job_id], 1.0)
    assert "waits for nodes that have not joined" in reason and "idle" not in reason, reason
    for fragment in fragments[1:] or fragments:
        assert fragment in reason


def test_absurd_spares_are_refused_even_for_a_job_that_waits():
    state = pool(("n0", {}))
    with refused(Code.INVALID_ARGUMENT, "spares 4294967295", "more than a job may ask for"):
        state.decide_submit(
            spec("A", plan=ParallelPlan(dp_shard=2), num_nodes=1, spares=2**32 - 1), 1.0, wait_for_nodes=True
        )


def test_a_job_waiting_for_8_slot_nodes_does_not_stop_a_later_job_on_idle_2_slot_nodes():
    state = pool(("s0", {}), ("s1", {}))
    joined(state, "big0", slots=8)
    submit(state, spec("hold", plan=ParallelPlan(dp_shard=8), num_nodes=1))  # takes big0
    assert state.nodes["big0"].job_id == "hold"
    assert submit(state, spec("head", plan=ParallelPlan(dp_shard=8), num_nodes=1)) == ()  # waits for big0
    (later,) = submit(state, spec("later", plan=ParallelPlan(dp_shard=4), num_nodes=2))
    assert later.job_id == "later" and later.nodes == ("s0", "s1")  # nodes head could never use
    assert state.pending_reason(state.jobs["head"], 1.0) == (
        "needs 1 node of 8 slots; 0 idle; first in line: big0 reserved for it from when job 'hold' ends "
        "(it has no time limit)"
    )


def test_a_later_job_never_takes_a_node_an_earlier_waiting_job_could_use():
    # head needs 2 nodes of 4 slots; one is idle, one busy. A later 1-node job of 4 slots
    # would fit on the idle one, but that would delay head: it waits. A 2-slot job may use
    # the 2-slot node head can never use.
    state = pool(("s0", {}))
    joined(state, "m0", slots=4)
    joined(state, "m1", slots=4)
    submit(state, spec("hold", plan=ParallelPlan(dp_shard=4), num_nodes=0, node_ids=("m1",)))
    assert submit(state, spec("head", plan=ParallelPlan(dp_shard=8), num_nodes=2)) == ()
    assert submit(state, spec("greedy", plan=ParallelPlan(dp_shard=4), num_nodes=1)) == ()
    assert "behind job 'head' (first in line): m0, m1 reserved for it from when job 'hold' ends" in (
        state.pending_reason(state.jobs["greedy"], 1.0)
    )
    (small,) = submit(state, spec("small", plan=ParallelPlan(dp_shard=2), num_nodes=1))
    assert (small.job_id, small.nodes) == ("small", ("s0",))
    assert "behind" not in state.pending_reason(state.jobs["head"], 1.0)
    state.apply_all(state.decide_end("hold", JobState.SUCCEEDED, "done", 2.0))
    state.note_units("m1", [])  # its agent shows hold's unit empty: m1 is back in the pool
    # head starts first; greedy still waits (head took both 4-slot nodes)
    assert [(e.job_id, e.nodes) for e in state.decide_allocate(2.0)] == [("head", ("m0", "m1"))]


def test_a_job_waiting_for_its_named_nodes_holds_only_those_nodes():
    state = pool(("n0", {}), ("n1", {}), ("n2", {}))
    submit(state, spec("hold", plan=ParallelPlan(dp_shard=2), num_nodes=0, node_ids=("n0",)))
    state.apply_all(state.decide_end("hold", JobState.SUCCEEDED, "done", 1.0))  # n0 clearing
    assert submit(state, spec("named", num_nodes=0, node_ids=("n0", "n1"))) == ()
    # n2 is no use to the named job; n1 is held for it
    (later,) = submit(state, spec("later", plan=ParallelPlan(dp_shard=2), num_nodes=1))
    assert later.nodes == ("n2",)
    assert submit(state, spec("later2", plan=ParallelPlan(dp_shard=2), num_nodes=1)) == ()
    assert state.jobs["later2"].state is JobState.PENDING and state.nodes["n1"].job_id == ""


def test_summaries_and_pruned_logs_replay_through_the_codec_and_an_old_log_loads_without_them():
    state, log = recording()
    joined(state, "n0")
    submit(state, spec("A", plan=ParallelPlan(dp_shard=2), num_nodes=1))
    assert state.decide_summarize("A", "c3RhdHVz", 2.0) == ()  # still running: nothing to summarize
    state.apply_all(state.decide_end("A", JobState.SUCCEEDED, "done", 2.0))
    old_log = list(log)  # what a coordinator from before summaries wrote
    state.apply_all(state.decide_summarize("A", "c3RhdHVz", 3.0))
    assert state.jobs["A"].summary == "c3RhdHVz" and state.decide_summarize("A", "x", 4.0) == ()
    assert state.decide_prune(2.0 + 99, retention_s=100) == ()  # kept for the retention
    state.apply_all(state.decide_prune(2.0 + 100, retention_s=100))
    assert state.decide_prune(1e9, retention_s=100) == ()  # once
    replayed = ClusterState()
    replayed.apply_all(codec.decode(codec.encode(e), "t") for e in log)
    assert (replayed.jobs["A"].summary, replayed.jobs["A"].log_pruned) == ("c3RhdHVz", True)
    assert (replayed.pending, replayed.unpruned) == ({}, {})  # the indexes replay too
    old = ClusterState()
    old.apply_all(codec.decode(codec.encode(e), "t") for e in old_log)
    assert (old.jobs["A"].state, old.jobs["A"].summary) == (JobState.SUCCEEDED, "")
    assert old.decide_prune(1e9, retention_s=1) == ()  # its own log is where it is read from: kept
    with refused(Code.ALREADY_EXISTS, "never reused"):
        replayed.decide_submit(spec("A"), 5.0)


def test_a_cancel_or_finish_reason_is_one_printable_line():
    state = pool(("n0", {}), ("n1", {}))
    submit(state, spec("A", plan=ParallelPlan(dp_shard=2), num_nodes=1))
    forged = "x\nfake99  RUNNING   4  submitter:eve  n0,n1\x00" + "y" * 500
    (ended,) = state.decide_cancel("A", forged, 1.0)
    assert "\n" not in ended.reason and "\x00" not in ended.reason and len(ended.reason) == 200
    assert ended.reason.startswith("x fake99  RUNNING")
