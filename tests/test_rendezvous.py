"""The pure rendezvous state machine (coordinator/rendezvous/), without sockets or a clock:
``now`` is a plain float. Plus one engine-level check that replaying the store's events
rebuilds the same assignments (what a restarted coordinator relies on)."""

from __future__ import annotations

import copy
import itertools
import logging
from typing import Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshgate.coordinator.engine import Coordinator
from meshgate.coordinator.keys import KeyRing
from meshgate.coordinator.rendezvous import (
    MAX_ID_LEN,
    Assignment,
    Code,
    GenerationBumped,
    MasterChosen,
    NodeJoined,
    RankAssigned,
    RegisterDecision,
    RegisterInput,
    RendezvousConfig,
    RendezvousError,
    RendezvousState,
    compress_ranks,
)
from meshgate.coordinator.store import MemoryStore
from meshgate.attestation import verify_attestation
from meshgate.plan import ParallelPlan

JOB = "job-1"
NONCE = b"\x07" * 32
PLAN4 = ParallelPlan(tp=2, dp_shard=2)  # world 4; with 2 slots per node: 2 nodes
PLAN8 = ParallelPlan(tp=2, dp_shard=4)  # world 8; with 2 slots per node: 4 nodes
PLAN_CP = ParallelPlan(cp=2, dp_shard=2)  # world 4; cp groups [0, 1] and [2, 3]


# ---- helpers -------------------------------------------------------------------------------


def make_state(plan: ParallelPlan = PLAN4, slots: int = 2, **config) -> RendezvousState:
    return RendezvousState(RendezvousConfig(job_id=JOB, plan=plan, slots_per_node=slots, **config))


def req(
    worker: str,
    node: str = "node-a",
    local_rank: int = 0,
    claimed: Optional[int] = None,
    **fields,
) -> RegisterInput:
    fields.setdefault("job_id", JOB)
    fields.setdefault("nonce", NONCE)
    return RegisterInput(worker_id=worker, node_id=node, local_rank=local_rank, claimed_rank=claimed, **fields)


def register(state: RendezvousState, request: RegisterInput, now: float = 1.0) -> RegisterDecision:
    decision = state.decide_register(request, now)
    state.apply_all(decision.events)
    return decision


def snapshot(state: RendezvousState) -> tuple[dict, str]:
    return copy.deepcopy(vars(state)), repr(state)


def refused(state: RendezvousState, request: RegisterInput, code: Code, *needles: str) -> RendezvousError:
    """decide_register refuses with ``code``, names every needle, and leaves state untouched."""
    before = snapshot(state)
    with pytest.raises(RendezvousError) as caught:
        state.decide_register(request, 99.0)
    error = caught.value
    assert error.code == code, str(error)
    for needle in needles:
        assert needle in error.message, (needle, error.message)
    assert snapshot(state) == before, "a refused decision changed the state"
    return error


def durable(state: RendezvousState) -> dict:
    return {
        "nodes": state.nodes,
        "node_ids_by_rank": state.node_ids_by_rank,
        "by_rank": state.by_rank,
        "by_worker": state.by_worker,
        "master": state.master,
        "generation": state.generation,
        "opened_at": state.opened_at,
    }


def check_invariants(state: RendezvousState) -> None:
    world = state.world_size
    assert len(state.by_rank) == len(state.by_worker)
    for rank, a in state.by_rank.items():
        assert a.rank == rank and 0 <= rank < world
        assert state.by_worker[a.worker_id] == a
    for worker, a in state.by_worker.items():
        assert a.worker_id == worker
        assert state.by_rank[a.rank] == a
    ranks = [a.rank for a in state.by_worker.values()]
    assert len(ranks) == len(set(ranks)), "a rank is held twice"
    assert len(state.node_ids_by_rank) == len(state.nodes)
    for node_rank, node_id in state.node_ids_by_rank.items():
        assert state.nodes[node_id].node_rank == node_rank
    for node in state.nodes.values():
        assert node.registered == sum(a.node_id == node.node_id for a in state.by_worker.values())
        assert node.registered <= state.config.slots_per_node, "a node holds more ranks than its slots"


# ---- config ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"slots_per_node": 3}, "must divide world_size 4"),
        ({"slots_per_node": 0}, "slots_per_node 0"),
        ({"slots_per_node": True}, "slots_per_node must be an integer"),
        ({"slots_per_node": 2, "node_order": ("a", "a")}, "duplicates"),
        ({"slots_per_node": 2, "node_order": ("a", "b", "c")}, "names 3 nodes; the plan needs 2"),
        ({"slots_per_node": 2, "node_order": ("bad id",)}, "node_order"),
        ({"slots_per_node": 2, "topology_policy": "maybe"}, "topology_policy"),
    ],
)
def test_config_refuses_bad_settings(kwargs, needle):
    with pytest.raises((ValueError, RendezvousError)) as caught:
        RendezvousConfig(job_id=JOB, plan=PLAN4, **kwargs)
    assert needle in str(caught.value)


# ---- assigned mode -----------------------------------------------------------------------


def test_assigned_rank_is_node_rank_times_slots_plus_local_rank_in_join_order():
    state = make_state(PLAN8)
    joins = [("n-b", 1), ("n-a", 0), ("n-c", 1), ("n-b", 0), ("n-d", 0), ("n-a", 1)]
    got = {}
    for i, (node, local) in enumerate(joins):
        decision = register(state, req(f"{node}/{local}", node, local), now=float(i))
        assert decision.is_new
        got[(node, local)] = (decision.assignment.node_rank, decision.assignment.rank)
    assert got == {
        ("n-b", 1): (0, 1),
        ("n-a", 0): (1, 2),
        ("n-c", 1): (2, 5),
        ("n-b", 0): (0, 0),
        ("n-d", 0): (3, 6),
        ("n-a", 1): (1, 3),
    }
    assert state.node_ids_by_rank == {0: "n-b", 1: "n-a", 2: "n-c", 3: "n-d"}
    assert state.nodes["n-b"].registered == 2 and state.nodes["n-c"].registered == 1
    assert state.opened_at == 0.0 and state.nodes["n-d"].joined_at == 4.0
    check_invariants(state)


def test_first_decision_of_a_new_node_carries_node_joined_then_rank_assigned():
    state = make_state()
    decision = register(state, req("w0", "n-a", 1), now=5.0)
    assert decision.events == (
        NodeJoined("n-a", 0, 5.0),
        RankAssigned("w0", 1, "n-a", 1, 5.0),
    )
    decision = register(state, req("w1", "n-a", 0), now=6.0)
    assert decision.events == (RankAssigned("w1", 0, "n-a", 0, 6.0),)
    assert state.opened_at == 5.0
    assert state.nodes["n-a"].last_seen == 6.0


def test_node_order_pins_node_ranks_and_unpinned_nodes_skip_them():
    state = make_state(PLAN8, node_order=("pin-0", "pin-1"))
    # unpinned nodes arrive first: they take node ranks 2 and 3, never the pinned 0 and 1
    assert register(state, req("x0", "free-x", 0)).assignment.node_rank == 2
    assert register(state, req("y1", "free-y", 1)).assignment == Assignment("y1", 7, "free-y", 3, 1)
    # the pinned nodes join late and still get their pinned ranks
    assert register(state, req("p1", "pin-1", 1)).assignment == Assignment("p1", 3, "pin-1", 1, 1)
    assert register(state, req("p0", "pin-0", 0)).assignment == Assignment("p0", 0, "pin-0", 0, 0)
    assert state.node_ids_by_rank == {0: "pin-0", 1: "pin-1", 2: "free-x", 3: "free-y"}
    check_invariants(state)


def test_a_pinned_node_keeps_its_rank_when_others_joined_in_between():
    state = make_state(PLAN8, node_order=("n-0", "n-1", "n-2", "n-3"))
    for node in ("n-3", "n-1", "n-0", "n-2"):
        register(state, req(f"{node}/0", node, 0))
    assert {n: state.nodes[n].node_rank for n in state.nodes} == {"n-0": 0, "n-1": 1, "n-2": 2, "n-3": 3}
    assert state.by_worker["n-3/0"].rank == 6


def test_a_returning_node_keeps_its_node_rank():
    state = make_state(PLAN8)
    register(state, req("a0", "n-a", 0), now=1.0)
    register(state, req("b0", "n-b", 0), now=2.0)
    # n-a comes back (a new worker on it, much later): same node rank, no new NodeJoined
    decision = register(state, req("a1", "n-a", 1), now=50.0)
    assert decision.assignment.node_rank == 0 and decision.assignment.rank == 1
    assert not any(isinstance(e, NodeJoined) for e in decision.events)
    assert state.nodes["n-a"].joined_at == 1.0 and state.nodes["n-a"].last_seen == 50.0


def test_no_free_node_rank_is_resource_exhausted_naming_the_node():
    state = make_state(PLAN4, node_order=("pinned",))  # 2 nodes, node rank 0 pinned
    register(state, req("x0", "n-x", 0))  # takes node rank 1
    refused(state, req("y0", "n-y", 0), Code.RESOURCE_EXHAUSTED, "'n-y'", "no free node rank", "0=pinned", "1=n-x")
    # the pinned node itself still gets in
    assert register(state, req("p0", "pinned", 0)).assignment.rank == 0


def test_assigned_local_rank_out_of_range_is_invalid_argument():
    state = make_state()
    refused(state, req("w", local_rank=2), Code.INVALID_ARGUMENT, "local_rank 2", "[0, 2)")
    refused(state, req("w", local_rank=-1), Code.INVALID_ARGUMENT, "local_rank -1")


# ---- claimed mode ------------------------------------------------------------------------


def test_claimed_mode_takes_any_rank_in_range():
    state = make_state(PLAN8, topology_policy="allow")
    for i, rank in enumerate([7, 0, 3]):
        a = register(state, req(f"w{rank}", f"n{i}", 0, claimed=rank)).assignment
        assert a.rank == rank and a.node_rank == i
    assert state.missing_ranks() == [1, 2, 4, 5, 6]
    check_invariants(state)


@pytest.mark.parametrize("rank", [4, 100, -1])
def test_claimed_rank_out_of_range_is_invalid_argument(rank):
    state = make_state()
    refused(state, req("w", claimed=rank), Code.INVALID_ARGUMENT, f"rank {rank}", "[0, 4)")


@pytest.mark.parametrize("plan, axis", [(PLAN4, "tp"), (PLAN_CP, "cp")])
def test_topology_refuse_names_the_group_and_both_nodes(plan, axis):
    state = make_state(plan, topology_policy="refuse")
    register(state, req("w0", "node-a", 0, claimed=0))
    error = refused(
        state,
        req("w1", "node-b", 0, claimed=1),
        Code.FAILED_PRECONDITION,
        f"{axis} group [0, 1]",
        "'node-a'",
        "'node-b'",
        "rank 0",
        "rank 1",
    )
    assert "straddle" in error.message
    # the same rank from the same node is fine
    assert register(state, req("w1", "node-a", 1, claimed=1)).warnings == ()


@pytest.mark.parametrize("plan, axis", [(PLAN4, "tp"), (PLAN_CP, "cp")])
def test_topology_warn_succeeds_with_a_warning(plan, axis):
    state = make_state(plan, topology_policy="warn")
    register(state, req("w0", "node-a", 0, claimed=0))
    decision = register(state, req("w1", "node-b", 0, claimed=1))
    assert decision.assignment.rank == 1 and decision.is_new
    assert len(decision.warnings) == 1
    warning = decision.warnings[0]
    for needle in (f"{axis} group [0, 1]", "'node-a'", "'node-b'"):
        assert needle in warning, warning
    # a group that stays on one node gives no warning
    register(state, req("w2", "node-c", 0, claimed=2))
    assert register(state, req("w3", "node-c", 1, claimed=3)).warnings == ()


@pytest.mark.parametrize("plan", [PLAN4, PLAN_CP])
def test_topology_allow_is_silent(plan):
    state = make_state(plan, topology_policy="allow")
    register(state, req("w0", "node-a", 0, claimed=0))
    decision = register(state, req("w1", "node-b", 0, claimed=1))
    assert decision.warnings == () and decision.assignment.rank == 1


def test_topology_is_not_checked_in_assigned_mode():
    # node-contiguous ranks: a TP group never straddles with the default order
    state = make_state(PLAN4, topology_policy="refuse")
    for node, local in [("a", 0), ("b", 0), ("a", 1), ("b", 1)]:
        assert register(state, req(f"{node}{local}", node, local)).warnings == ()
    assert state.complete


# ---- claimed mode stays inside the node (issue 20, item 5) -----------------------------------


@pytest.mark.parametrize("policy", ["allow", "warn", "refuse"])
def test_a_claimed_node_holds_at_most_its_slots_worth_of_ranks(policy):
    """The reported attack: one 2-slot node asked for vouches for ranks 0-3 and registered
    all four, even with refuse, because every TP group it held sat on that one node."""
    state = make_state(PLAN4, slots=2, topology_policy=policy)
    register(state, req("a0", "node-a", 0, claimed=0))
    register(state, req("a1", "node-a", 1, claimed=1))
    for rank in (2, 3):
        refused(
            state,
            req(f"a{rank}", "node-a", rank, claimed=rank),
            Code.RESOURCE_EXHAUSTED,
            "node 'node-a'",
            "2 slots",
            "ranks 0-1",
            f"rank {rank}",
            "generation 0",
        )
    # the second node's real workers still get their ranks
    register(state, req("b0", "node-b", 0, claimed=2))
    register(state, req("b1", "node-b", 1, claimed=3))
    assert state.complete
    check_invariants(state)


def test_a_claimed_nodes_slots_are_free_again_in_the_next_generation():
    state = make_state(PLAN4, slots=2, topology_policy="allow")
    register(state, req("a0", "node-a", 0, claimed=0))
    register(state, req("a1", "node-a", 1, claimed=1))
    state.apply(GenerationBumped(1, "a worker failed", worker_restart=True))
    register(state, req("a0", "node-a", 0, claimed=0, generation=1))
    register(state, req("a1", "node-a", 1, claimed=1, generation=1))
    refused(state, req("a2", "node-a", 0, claimed=2, generation=1), Code.RESOURCE_EXHAUSTED, "generation 1")


@pytest.mark.parametrize("plan, axis", [(PLAN4, "tp"), (PLAN_CP, "cp")])
def test_refuse_keeps_a_claimed_nodes_share_of_its_groups(plan, axis):
    """Ranks 0 and 2 fit in a 2-slot node's count but lie in two groups of 2: the groups
    could only stay whole on 4 slots, so with refuse the second claim is refused."""
    state = make_state(plan, slots=2, topology_policy="refuse")
    register(state, req("a0", "node-a", 0, claimed=0))
    error = refused(
        state,
        req("a2", "node-a", 1, claimed=2),
        Code.FAILED_PRECONDITION,
        "node 'node-a'",
        "2 slots",
        f"2 {axis} groups of 2",
        "[0, 1]",
        "[2, 3]",
        "refuse",
    )
    assert "rank 2" in error.message
    assert register(state, req("a1", "node-a", 1, claimed=1)).warnings == ()  # its own group: fine
    check_invariants(state)


def test_warn_and_allow_let_a_claimed_node_split_its_groups_within_its_slots():
    for policy in ("warn", "allow"):
        state = make_state(PLAN4, slots=2, topology_policy=policy)
        register(state, req("a0", "node-a", 0, claimed=0))
        assert register(state, req("a2", "node-a", 1, claimed=2)).assignment.rank == 2


# ---- idempotency and conflicts -----------------------------------------------------------


def test_same_worker_again_gets_the_same_assignment_and_no_events():
    state = make_state()
    first = register(state, req("w0", "node-a", 1), now=1.0)
    before = snapshot(state)
    again = state.decide_register(req("w0", "node-a", 1, nonce=b"\x09" * 16), 2.0)
    assert again.assignment == first.assignment
    assert again.events == () and not again.is_new and again.warnings == ()
    assert snapshot(state) == before


def test_same_worker_again_in_claimed_mode():
    state = make_state(topology_policy="allow")
    first = register(state, req("w0", "node-a", 0, claimed=3))
    again = state.decide_register(req("w0", "node-a", 0, claimed=3), 2.0)
    assert again.assignment == first.assignment and again.events == ()


def test_same_worker_from_another_node_is_already_exists_naming_what_it_holds():
    state = make_state()
    register(state, req("w0", "node-a", 1))
    refused(state, req("w0", "node-b", 1), Code.ALREADY_EXISTS, "'w0'", "rank 1", "'node-a'", "'node-b'")


def test_same_worker_claiming_another_rank_is_already_exists():
    state = make_state(topology_policy="allow")
    register(state, req("w0", "node-a", 0, claimed=2))
    refused(state, req("w0", "node-a", 0, claimed=3), Code.ALREADY_EXISTS, "'w0'", "holds rank 2", "rank 3")


def test_same_worker_with_another_local_rank_is_already_exists():
    state = make_state()
    register(state, req("w0", "node-a", 0))
    refused(state, req("w0", "node-a", 1), Code.ALREADY_EXISTS, "'w0'", "local_rank 0", "local_rank 1")


def test_same_worker_with_another_local_rank_in_claimed_mode_is_already_exists():
    # the attestation would otherwise carry a local_rank the worker did not ask for
    state = make_state(topology_policy="allow")
    register(state, req("w0", "node-a", 1, claimed=3))
    refused(state, req("w0", "node-a", 0, claimed=3), Code.ALREADY_EXISTS, "'w0'", "local_rank 1", "local_rank 0")


def test_opened_at_is_the_first_join_even_at_time_zero():
    state = make_state()
    register(state, req("w0", "a", 0), now=0.0)
    register(state, req("w1", "b", 0), now=3.0)
    assert state.opened_at == 0.0


def test_another_identity_for_a_held_rank_is_already_exists_naming_the_holder():
    state = make_state(topology_policy="allow")
    register(state, req("w0", "node-a", 1))
    refused(state, req("w9", "node-a", 1), Code.ALREADY_EXISTS, "rank 1", "'w0'", "'node-a'", "'w9'")
    claimed = make_state(topology_policy="allow")
    register(claimed, req("c2", "node-b", 0, claimed=2))
    refused(claimed, req("c9", "node-c", 0, claimed=2), Code.ALREADY_EXISTS, "rank 2", "'c2'", "'node-b'")


def test_full_world_is_resource_exhausted():
    state = make_state()
    for node, local in itertools.product(("a", "b"), (0, 1)):
        register(state, req(f"{node}{local}", node, local))
    assert state.complete and state.missing_ranks() == []
    refused(state, req("late", "c", 0), Code.RESOURCE_EXHAUSTED, "world is full", "4", "'late'")
    refused(state, req("late", "a", 0, claimed=0), Code.RESOURCE_EXHAUSTED, "'late'")
    # a member asking again still gets its rank
    assert state.decide_register(req("b1", "b", 1), 5.0).assignment.rank == 3


# ---- validation --------------------------------------------------------------------------

LONG_ID = "x" * (MAX_ID_LEN + 1)


@pytest.mark.parametrize("field", ["worker_id", "node_id"])
@pytest.mark.parametrize(
    "value, needles",
    [
        ("", ["non-empty"]),
        (LONG_ID, ["x" * 64 + "...", str(MAX_ID_LEN)]),
        ("has space", ["'has space'"]),
        ("semi;colon", ["'semi;colon'"]),
        ("nul\x00", ["'nul\\x00'"]),
    ],
)
def test_bad_ids_are_invalid_argument_naming_field_and_value(field, value, needles):
    state = make_state()
    register(state, req("first", "node-a", 0))
    kwargs = {"worker": "w", "node": "node-z"}
    kwargs["worker" if field == "worker_id" else "node"] = value
    refused(state, req(**kwargs), Code.INVALID_ARGUMENT, field, *needles)


@pytest.mark.parametrize(
    "value, needles",
    [("", ["non-empty"]), (LONG_ID, ["x" * 64 + "..."]), ("bad job", ["'bad job'"])],
)
def test_bad_job_id_is_invalid_argument(value, needles):
    refused(make_state(), req("w", job_id=value), Code.INVALID_ARGUMENT, "job_id", *needles)


def test_ids_at_the_length_limit_and_with_every_allowed_character_pass():
    state = make_state()
    worker = "A-z.0_9:@/+=" + "w" * (MAX_ID_LEN - 12)
    assert len(worker) == MAX_ID_LEN
    assert register(state, req(worker, "node." + "n" * 200, 0)).assignment.worker_id == worker


def test_wrong_job_is_failed_precondition():
    refused(make_state(), req("w", job_id="other-job"), Code.FAILED_PRECONDITION, "'other-job'", f"'{JOB}'")


@pytest.mark.parametrize("length, ok", [(0, False), (15, False), (16, True), (64, True), (65, False)])
def test_nonce_length_bounds(length, ok):
    state = make_state()
    request = req("w", nonce=b"\x01" * length)
    if ok:
        assert register(state, request).assignment.rank == 0
    else:
        refused(state, request, Code.INVALID_ARGUMENT, "nonce", "16..64", f"got {length}")


@pytest.mark.parametrize("length", [1, 31, 33, 64])
def test_plan_digest_of_the_wrong_length_is_invalid_argument(length):
    refused(
        make_state(),
        req("w", plan_digest=b"\x00" * length),
        Code.INVALID_ARGUMENT,
        "plan_digest",
        f"got {length}",
        "32",
    )


def test_plan_digest_mismatch_is_failed_precondition_and_a_match_or_empty_passes():
    state = make_state()
    wrong = bytes(32)
    refused(
        state,
        req("w", plan_digest=wrong),
        Code.FAILED_PRECONDITION,
        "plan_digest",
        wrong.hex()[:16],
        PLAN4.digest().hex()[:16],
    )
    assert register(state, req("w0", "a", 0, plan_digest=PLAN4.digest())).is_new
    assert register(state, req("w1", "a", 1, plan_digest=b"")).is_new


def test_generation_mismatch_is_failed_precondition():
    state = make_state()
    refused(state, req("w", generation=3), Code.FAILED_PRECONDITION, "generation 3", "current generation 0")
    assert register(state, req("w", generation=0)).is_new
    state.apply(GenerationBumped(1, "node lost"))
    refused(state, req("v", "b", 0, generation=0), Code.FAILED_PRECONDITION, "generation 0", "current generation 1")


@pytest.mark.parametrize(
    "port, ok", [(0, False), (1, True), (65535, True), (65536, False), (70000, False), (-1, False)]
)
def test_endpoint_port_range(port, ok):
    state = make_state()
    request = req("w", endpoint_host="10.0.0.1", endpoint_port=port)
    if ok:
        assert register(state, request).assignment.rank == 0
        assert state.master == ("10.0.0.1", port)
    else:
        refused(state, request, Code.INVALID_ARGUMENT, "endpoint_port", str(port), "[1, 65535]")


def test_endpoint_host_too_long_is_invalid_argument():
    refused(
        make_state(), req("w", endpoint_host="h" * 256, endpoint_port=1), Code.INVALID_ARGUMENT, "endpoint_host", "256"
    )


# ---- purity -----------------------------------------------------------------------------


def test_a_successful_decide_without_apply_changes_nothing():
    state = make_state(PLAN8, topology_policy="warn")
    register(state, req("w0", "a", 0, claimed=0))
    before = snapshot(state)
    decision = state.decide_register(req("w1", "b", 0, claimed=1, endpoint_host="h", endpoint_port=5), 7.0)
    assert decision.is_new and decision.warnings
    assert snapshot(state) == before
    assigned = make_state(PLAN8)
    before = snapshot(assigned)
    assigned.decide_register(req("w0", "a", 0, endpoint_host="h", endpoint_port=5), 7.0)
    assert snapshot(assigned) == before


def test_refusals_of_every_kind_change_nothing():
    state = make_state(topology_policy="refuse")
    register(state, req("w0", "a", 0, claimed=0, endpoint_host="h", endpoint_port=1))
    bad = [
        (req("w0", "b", 0, claimed=0), Code.ALREADY_EXISTS),
        (req("w9", "b", 0, claimed=0), Code.ALREADY_EXISTS),
        (req("w1", "b", 0, claimed=1), Code.FAILED_PRECONDITION),  # would join node b, then refused
        (req("w1", "b", 0, claimed=9), Code.INVALID_ARGUMENT),
        (req("w1", "b", 0, claimed=1, generation=4), Code.FAILED_PRECONDITION),
    ]
    for request, code in bad:
        refused(state, request, code)
    assert "b" not in state.nodes


def test_heartbeat_and_await_checks_change_nothing():
    state = make_state()
    register(state, req("w0", "a", 0))
    before = snapshot(state)
    state.check_await(JOB, 0)
    state.decide_heartbeat(JOB, "w0", 0, b"s" * 32, [b"s" * 32])
    for call in (
        lambda: state.decide_heartbeat(JOB, "w0", 0),  # no heartbeat secret
        lambda: state.decide_heartbeat(JOB, "w0", 0, b"t" * 32, [b"s" * 32]),  # another worker's
        lambda: state.check_await("x", 0),
        lambda: state.decide_heartbeat(JOB, "nobody", 0),
    ):
        with pytest.raises(RendezvousError):
            call()
    assert snapshot(state) == before


# ---- replay ------------------------------------------------------------------------------


def test_replaying_the_events_of_a_sequence_rebuilds_an_equal_state():
    state = make_state(PLAN8, node_order=("n-pinned",))
    log = []
    requests = [
        req("b1", "n-b", 1, endpoint_host="hb", endpoint_port=2),
        req("a0", "n-a", 0, endpoint_host="ha", endpoint_port=1),
        req("b1", "n-b", 1),  # idempotent: no events
        req("p0", "n-pinned", 0, endpoint_host="hp", endpoint_port=29500),  # rank 0: master
        req("zz", "n-a", 0),  # refused: rank held
        req("b0", "n-b", 0),
        req("c1", "n-c", 1),  # refused: no free node rank
        req("p1", "n-pinned", 1),
        req("p0", "n-pinned", 0, endpoint_host="other", endpoint_port=3),  # master already set
    ]
    for i, request in enumerate(requests):
        try:
            decision = state.decide_register(request, float(10 + i))
        except RendezvousError:
            continue
        log.extend(decision.events)
        state.apply_all(decision.events)
    state.apply(GenerationBumped(1, "test"))
    log.append(GenerationBumped(1, "test"))

    replayed = RendezvousState(state.config)
    replayed.apply_all(log)
    assert durable(replayed) == durable(state)
    assert replayed.worker_seen == state.worker_seen
    assert replayed.master is None  # a new generation: rank 0 names a fresh master address
    assert replayed.generation == 1
    check_invariants(replayed)
    # and the rebuilt state decides the same way
    assert replayed.decide_register(req("a0", "n-a", 0, generation=1), 99.0).assignment == state.by_worker["a0"]
    assert replayed.describe_missing() == state.describe_missing()


# ---- master ------------------------------------------------------------------------------


def test_rank_zero_with_an_endpoint_sets_the_master():
    state = make_state()
    decision = register(state, req("w0", "a", 0, endpoint_host="10.1.2.3", endpoint_port=29500))
    assert MasterChosen("10.1.2.3", 29500) in decision.events
    assert state.master == ("10.1.2.3", 29500)


def test_other_ranks_endpoints_are_ignored():
    state = make_state()
    decision = register(state, req("w1", "a", 1, endpoint_host="10.1.2.3", endpoint_port=29500))
    assert not any(isinstance(e, MasterChosen) for e in decision.events)
    assert state.master is None


def test_rank_zero_without_an_endpoint_sets_no_master_and_a_later_register_can():
    state = make_state()
    decision = register(state, req("w0", "a", 0))
    assert not any(isinstance(e, MasterChosen) for e in decision.events)
    assert state.master is None
    again = register(state, req("w0", "a", 0, endpoint_host="h1", endpoint_port=1234))
    assert again.events == (MasterChosen("h1", 1234),) and not again.is_new
    assert state.master == ("h1", 1234)
    # once set, re-registering does not move it
    third = register(state, req("w0", "a", 0, endpoint_host="h2", endpoint_port=4321))
    assert third.events == ()
    assert state.master == ("h1", 1234)


def test_claimed_rank_zero_sets_the_master_too():
    state = make_state(topology_policy="allow")
    register(state, req("w0", "z", 0, claimed=0, endpoint_host="hz", endpoint_port=7))
    assert state.master == ("hz", 7)


# ---- missing, describe, compress ---------------------------------------------------------


def test_missing_ranks_grouped_by_node():
    state = make_state(PLAN8)
    assert state.missing_ranks() == list(range(8))
    register(state, req("a0", "n-a", 0))
    register(state, req("b1", "n-b", 1))
    assert state.missing_ranks() == [1, 2, 4, 5, 6, 7]
    assert state.missing_by_node() == {
        "n-a": [1],
        "n-b": [2],
        "node_rank 2 (not joined)": [4, 5],
        "node_rank 3 (not joined)": [6, 7],
    }
    text = state.describe_missing()
    assert text.startswith("6 of 8 ranks missing: ")
    for part in (
        "n-a: ranks 1",
        "n-b: ranks 2",
        "node_rank 2 (not joined): ranks 4-5",
        "node_rank 3 (not joined): ranks 6-7",
    ):
        assert part in text, text
    limited = state.describe_missing(limit=2)
    assert "node_rank 3" not in limited and limited.endswith("; and 2 more nodes")


def test_nothing_missing_when_complete():
    state = make_state()
    for node, local in itertools.product("ab", (0, 1)):
        register(state, req(f"{node}{local}", node, local))
    assert state.missing_ranks() == [] and state.missing_by_node() == {}
    assert state.describe_missing() == "0 of 4 ranks missing: "


@pytest.mark.parametrize(
    "ranks, text",
    [
        ([], ""),
        ([5], "5"),
        ([0, 1, 2, 3, 8, 10, 11], "0-3,8,10-11"),
        ([11, 10, 8, 3, 2, 1, 0], "0-3,8,10-11"),
        ([1, 3, 5], "1,3,5"),
        (range(100), "0-99"),
    ],
)
def test_compress_ranks(ranks, text):
    assert compress_ranks(ranks) == text


# ---- await and heartbeat -----------------------------------------------------------------


def test_check_await_codes():
    state = make_state()
    state.check_await(JOB, 0)
    with pytest.raises(RendezvousError) as caught:
        state.check_await("", 0)
    assert caught.value.code == Code.INVALID_ARGUMENT and "job_id" in caught.value.message
    with pytest.raises(RendezvousError) as caught:
        state.check_await("other", 0)
    assert caught.value.code == Code.FAILED_PRECONDITION and "'other'" in caught.value.message
    state.apply(GenerationBumped(2, "lost node"))
    with pytest.raises(RendezvousError) as caught:
        state.check_await(JOB, 1)
    assert caught.value.code == Code.FAILED_PRECONDITION
    assert "generation 1" in caught.value.message and "current generation is 2" in caught.value.message


def test_decide_heartbeat_codes():
    state = make_state()
    register(state, req("w0", "a", 0))
    state.decide_heartbeat(JOB, "w0", 0, b"s" * 32, [b"s" * 32])
    cases = [
        ((JOB, "w0", 0), Code.UNAUTHENTICATED, ["heartbeat_secret missing", "'w0'"]),
        ((JOB, "w0", 0, b"t" * 32, [b"s" * 32]), Code.PERMISSION_DENIED, ["does not belong", "'w0'"]),
        ((JOB + "x", "w0", 0), Code.FAILED_PRECONDITION, ["job_id", f"'{JOB}x'"]),
        ((JOB, "w0", 5), Code.FAILED_PRECONDITION, ["generation 5", "current generation is 0"]),
        ((JOB, "ghost", 0), Code.NOT_FOUND, ["'ghost'"]),
        ((JOB, "bad id", 0), Code.INVALID_ARGUMENT, ["worker_id", "'bad id'"]),
    ]
    for args, code, needles in cases:
        with pytest.raises(RendezvousError) as caught:
            state.decide_heartbeat(*args)
        assert caught.value.code == code, caught.value
        for needle in needles:
            assert needle in caught.value.message, caught.value.message


def test_touch_updates_liveness_only():
    state = make_state()
    register(state, req("w0", "a", 0), now=1.0)
    state.touch("w0", 30.0)
    assert state.worker_seen["w0"] == 30.0 and state.nodes["a"].last_seen == 30.0
    state.touch("stranger", 31.0)  # unknown worker: no node to touch, no crash
    assert state.by_worker.keys() == {"w0"}


# ---- property: random interleavings keep the invariants -----------------------------------

WORKERS = [f"w{i}" for i in range(10)]
NODES = ["n0", "n1", "n2", "n3", "n4"]
PLANS = [
    (ParallelPlan(tp=2, dp_shard=2), 2),
    (ParallelPlan(tp=2, dp_shard=4), 2),
    (ParallelPlan(tp=2, dp_shard=4), 4),
    (ParallelPlan(cp=2, tp=2), 1),
    (ParallelPlan(dp_shard=3), 3),
]


@st.composite
def scenarios(draw):
    plan, slots = draw(st.sampled_from(PLANS))
    num_nodes = plan.world_size // slots
    pinned = draw(st.lists(st.sampled_from(NODES), unique=True, max_size=num_nodes))
    claimed_mode = draw(st.booleans())
    policy = draw(st.sampled_from(["allow", "warn", "refuse"]))
    config = RendezvousConfig(
        job_id=JOB, plan=plan, slots_per_node=slots, node_order=tuple(pinned), topology_policy=policy
    )
    steps = draw(
        st.lists(
            st.tuples(
                st.sampled_from(WORKERS),
                st.sampled_from(NODES),
                st.integers(0, slots),  # slots itself is out of range on purpose
                st.integers(-1, plan.world_size),  # claimed rank, sometimes out of range
                st.booleans(),  # with an endpoint
            ),
            max_size=25,
        )
    )
    return config, claimed_mode, steps


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_interleavings_keep_the_invariants(scenario):
    config, claimed_mode, steps = scenario
    state = RendezvousState(config)
    log = []
    slots = config.slots_per_node
    for i, (worker, node, local, claimed, endpoint) in enumerate(steps):
        request = req(
            worker,
            node,
            local,
            claimed if claimed_mode else None,
            endpoint_host="h" if endpoint else "",
            endpoint_port=1000 + i if endpoint else 0,
        )
        before = snapshot(state)
        try:
            decision = state.decide_register(request, float(i))
        except RendezvousError as error:
            assert snapshot(state) == before
            assert error.code in {
                Code.INVALID_ARGUMENT,
                Code.ALREADY_EXISTS,
                Code.RESOURCE_EXHAUSTED,
                Code.FAILED_PRECONDITION,
            }
            if error.code == Code.FAILED_PRECONDITION:
                assert claimed_mode and config.topology_policy == "refuse"
            continue
        assert snapshot(state) == before
        held = state.by_worker.get(worker)
        if held is not None:
            assert decision.assignment == held and not decision.is_new
        else:
            assert decision.is_new
        state.apply_all(decision.events)
        log.extend(decision.events)
        a = decision.assignment
        assert state.by_worker[worker] == a and state.by_rank[a.rank] == a
        if not claimed_mode:
            assert a.rank // slots == a.node_rank and a.rank % slots == a.local_rank
            if node in config.node_order:
                assert a.node_rank == config.node_order.index(node)
        check_invariants(state)
        if state.master is not None:
            assert state.master[0] == "h"

    if not claimed_mode:
        for node_rank, node_id in state.node_ids_by_rank.items():
            assert 0 <= node_rank < config.num_nodes
            if node_id not in config.node_order:
                assert node_rank >= len(config.node_order)
    replayed = RendezvousState(config)
    replayed.apply_all(log)
    assert durable(replayed) == durable(state)
    # every rank is either held or reported missing, exactly once
    assert sorted(state.missing_ranks() + list(state.by_rank)) == list(range(state.world_size))


# ---- engine: register, barrier, restart from the store's events ---------------------------


async def test_engine_registers_awaits_and_replays_from_the_store(tmp_path):
    plan = PLAN4
    config = RendezvousConfig(job_id=JOB, plan=plan, slots_per_node=2)
    keys = KeyRing(tmp_path / "keys", job_id=JOB)
    now = [1000.0]
    store = MemoryStore()
    first = Coordinator(config, store, keys, attestation_ttl_s=3600, clock=lambda: now[0])
    ranks = {}
    for i, (node, local) in enumerate([("n-b", 1), ("n-a", 0), ("n-b", 0), ("n-a", 1)]):
        now[0] += 1
        worker = f"{node}/{local}"
        nonce = bytes([i + 1]) * 32
        extra = {"endpoint_host": "10.0.0.9", "endpoint_port": 29500} if (node, local) == ("n-b", 0) else {}
        signed, _ = await first.register(req(worker, node, local, nonce=nonce, **extra))
        verified = verify_attestation(signed, keys.bundle, job_id=JOB, nonce=nonce, generation=0, plan=plan, now=now[0])
        ranks[worker] = verified.rank
    assert ranks == {"n-b/1": 1, "n-a/0": 2, "n-b/0": 0, "n-a/1": 3}
    world = await first.await_world(JOB, 0, timeout_s=1.0, include_members=True)
    assert world.world_size == 4 and world.master == ("10.0.0.9", 29500)
    assert [m.worker_id for m in world.members] == ["n-b/0", "n-b/1", "n-a/0", "n-a/1"]

    # a restarted coordinator rebuilt from the same events
    restarted_store = MemoryStore()
    restarted_store.events = store.load()
    second = Coordinator(config, restarted_store, keys, attestation_ttl_s=3600, clock=lambda: now[0])
    assert second.state.by_worker == first.state.by_worker
    assert second.state.by_rank == first.state.by_rank
    assert second.state.master == first.state.master
    again = await second.await_world(JOB, 0, timeout_s=0.1, include_members=True)
    assert again.members == world.members
    nonce = b"\x42" * 16
    signed, _ = await second.register(req("n-a/0", "n-a", 0, nonce=nonce))
    verified = verify_attestation(signed, keys.bundle, job_id=JOB, nonce=nonce, generation=0, plan=plan, now=now[0])
    assert verified.rank == 2 and verified.node_rank == 1 and verified.node_id == "n-a"
    assert restarted_store.events == store.events, "an idempotent Register must not append"
    # and a stranger is refused: the replayed world is full
    with pytest.raises(RendezvousError) as caught:
        await second.register(req("stranger", "n-c", 0))
    assert caught.value.code == Code.RESOURCE_EXHAUSTED


async def test_a_world_logs_one_info_line_when_it_forms_not_one_per_worker_or_node(tmp_path, caplog):
    """Each log line costs about 70 µs on the coordinator's loop: the nodes that workers'
    Registers name are DEBUG, like their ranks; the world's forming is one INFO line, again
    for each generation that forms."""
    config = RendezvousConfig(job_id=JOB, plan=PLAN4, slots_per_node=2)
    engine = Coordinator(config, MemoryStore(), KeyRing(tmp_path / "keys", job_id=JOB), attestation_ttl_s=3600)
    caplog.set_level(logging.DEBUG, logger="meshgate.coordinator")
    for i, (node, local) in enumerate([("n-a", 0), ("n-a", 1), ("n-b", 0), ("n-b", 1)]):
        await engine.register(req(f"{node}/{local}", node, local, nonce=bytes([i + 1]) * 32))
    info = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert info == [f"job {JOB} generation 0: world of 4 ranks formed on 2 nodes"], info
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert sum(m.startswith("event NodeJoined(") for m in debug) == 2, debug
    assert sum(m.startswith("event RankAssigned(") for m in debug) == 4, debug
    caplog.clear()
    await engine.register(req("n-a/0", "n-a", 0, nonce=b"\x09" * 32))  # a retry: nothing formed again
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]


async def test_engine_await_world_times_out_naming_the_missing(tmp_path):
    config = RendezvousConfig(job_id=JOB, plan=PLAN4, slots_per_node=2)
    coordinator = Coordinator(
        config, MemoryStore(), KeyRing(tmp_path / "keys", job_id=JOB), attestation_ttl_s=60, clock=lambda: 5.0
    )
    await coordinator.register(req("a0", "n-a", 0))
    with pytest.raises(RendezvousError) as caught:
        await coordinator.await_world(JOB, 0, timeout_s=0.01)
    assert caught.value.code == Code.DEADLINE_EXCEEDED
    assert "3 of 4 ranks missing" in caught.value.message
    assert "n-a: ranks 1" in caught.value.message and "node_rank 1 (not joined): ranks 2-3" in caught.value.message


def test_an_agent_adopts_a_node_that_registers_named_first():
    """Workers may register before their agent joins; the join then makes the node
    agent-managed (heartbeats accepted, swept when silent) and keeps its node rank."""
    from meshgate.coordinator.rendezvous import JoinAuth, NodeAdopted

    state = RendezvousState(
        RendezvousConfig(job_id="job-1", plan=ParallelPlan(tp=2, dp_shard=2), slots_per_node=2, join_token="t")
    )
    decision = state.decide_register(RegisterInput("job-1", "w0", b"n" * 16, "node-x", 0, None), 1.0)
    state.apply_all(decision.events)
    assert not state.nodes["node-x"].managed
    node, events = state.decide_join(
        "job-1", "node-x", "host-x", 2, "cpu", 2.0, JoinAuth(token="t", new_credential_hash="h")
    )
    assert any(isinstance(e, NodeAdopted) for e in events)
    state.apply_all(events)
    adopted = state.decide_node_call("job-1", "node-x")
    assert adopted.managed and adopted.node_rank == 0 and adopted.hostname == "host-x"
    assert state.decide_lost(2.0 + 100, 15.0)  # and a silent agent-managed node is swept


# ---- worker failures end the generation for the whole job ---------------------------------------


def _formed_world(**config) -> RendezvousState:
    state = make_state(PLAN4, slots=2, **config)
    for node in ("node-a", "node-b"):
        for local in (0, 1):
            register(state, req(f"{node}/{local}", node, local, endpoint_host="10.0.0.1", endpoint_port=29500))
    assert state.complete
    return state


def test_a_worker_failure_bumps_the_generation_and_releases_every_rank():
    from meshgate.coordinator.rendezvous import GenerationBumped

    state = _formed_world(max_restarts=2)
    node_b = state.nodes["node-b"]
    events = state.decide_worker_exit(node_b, 1, 1, 0, False, 5.0)
    assert events == (
        GenerationBumped(
            1,
            "worker local_rank 1 (rank 3) on node 'node-b' exited 1 in generation 0; "
            "restarting every worker of the job (restart 1/2)",
            worker_restart=True,
            at=5.0,
        ),
    )
    state.apply_all(events)
    assert (state.generation, state.worker_restarts, state.complete, state.master) == (1, 1, False, None)
    # every worker registers again, into the same rank
    for node in ("node-a", "node-b"):
        for local in (0, 1):
            again = register(state, req(f"{node}/{local}", node, local, generation=1), now=6.0)
            assert again.assignment.rank == state.nodes[node].node_rank * 2 + local
    assert state.complete
    # exits of the old generation, 0 exits and stops by the agent decide nothing
    assert state.decide_worker_exit(node_b, 0, 143, 0, False, 7.0) == ()
    assert state.decide_worker_exit(node_b, 0, 0, 1, False, 7.0) == ()
    assert state.decide_worker_exit(node_b, 0, 143, 1, True, 7.0) == ()


def test_a_worker_failure_with_restarts_spent_fails_the_job():
    from meshgate.coordinator.rendezvous import JobFailed

    never = _formed_world()  # max_restarts=0: restart_policy "never"
    events = never.decide_worker_exit(never.nodes["node-a"], 0, 7, 0, False, 5.0)
    assert events == (
        JobFailed("worker local_rank 0 (rank 0) on node 'node-a' exited 7 in generation 0; max_restarts is 0", 5.0),
    )
    never.apply_all(events)
    with pytest.raises(RendezvousError) as refused:
        never.check_job(JOB)
    assert "exited 7" in str(refused.value)

    once = _formed_world(max_restarts=1)
    once.apply_all(once.decide_worker_exit(once.nodes["node-b"], 1, 1, 0, False, 5.0))
    failed = once.decide_worker_exit(once.nodes["node-b"], 1, 1, 1, False, 6.0)
    assert failed == (
        JobFailed(
            "worker local_rank 1 (rank 3) on node 'node-b' exited 1 in generation 1; restarts exhausted (1/1)", 6.0
        ),
    )


def test_worker_restarts_replay_from_the_events():
    from meshgate.coordinator.store import codec

    state = _formed_world(max_restarts=3)
    events = state.decide_worker_exit(state.nodes["node-a"], 1, 2, 0, False, 5.0)
    decoded = tuple(codec.decode(codec.encode(e), "test") for e in events)
    assert decoded == events
    replayed = _formed_world(max_restarts=3)
    replayed.apply_all(decoded)
    assert (replayed.generation, replayed.worker_restarts, len(replayed.by_rank)) == (1, 1, 0)


def test_a_claim_in_an_assigned_job_says_to_resubmit_with_mode_claimed():
    from meshgate.coordinator.rendezvous.model import RankMode

    state = make_state(mode=RankMode.ASSIGNED)
    refused(state, req("ray-worker", claimed=1), Code.INVALID_ARGUMENT, "claimed rank 1", "`--mode claimed`")
