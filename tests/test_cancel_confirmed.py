"""A cancel answers CANCELLED only once the job's nodes showed its processes gone
(their agents' heartbeats list no live unit), and says which nodes did not within its
bound, never a silent CANCELLED. Pure: the decision (ClusterState.clearing) and the
waiter (UnitsShown) on a ClusterState, no sockets. With real agents and pids:
tests/test_torchrun.py (a per-node torchrun job cancelled on three shipped agents)."""

from __future__ import annotations

import asyncio
import re

import pytest

from meshgate.attestation import secret_hash
from meshgate.coordinator.cluster_state.ends import Clearing, NotShownGone
from meshgate.coordinator.jobs import ClusterState, JobSpec
from meshgate.coordinator.rendezvous import Code, JoinAuth
from meshgate.coordinator.units_shown import UnitsShown
from meshgate.plan import ParallelPlan

NODES = ("n0", "n1", "n2")


class Clock:
    def __init__(self) -> None:
        self.now = 1.0

    def __call__(self) -> float:
        return self.now


def running(job_id: str = "a", nodes: int = 3) -> ClusterState:
    """A cluster of three heard nodes, ``job_id`` running on ``nodes`` of them."""
    state = ClusterState(heartbeat_timeout_s=15.0)
    for node_id in NODES:
        state.apply_all(state.decide_create_token(secret_hash(f"t-{node_id}"), 600, node_id, 0.0))
        auth = JoinAuth(f"t-{node_id}", public_key=bytes(32), new_credential_hash=secret_hash(b"c"))
        state.apply_all(state.decide_join(node_id, node_id, 2, "cpu", {}, auth, 0.0))
        state.note_units(node_id, [])
    spec = JobSpec.build(job_id=job_id, plan=ParallelPlan(dp_shard=2 * nodes), num_nodes=nodes, command=("x",))
    state.apply_all(state.decide_submit(spec, 1.0))
    state.apply_all(state.decide_allocate(1.0))
    return state


def test_a_cancelled_jobs_nodes_clear_one_by_one_as_their_heartbeats_show_no_live_unit():
    state = running()
    assert state.clearing("a", 1.0) == Clearing(waiting=NODES)  # still serving: nothing shown yet
    state.apply_all(state.decide_cancel("a", "enough", 2.0))
    assert state.clearing("a", 2.0) == Clearing(waiting=NODES)
    state.note_units("n1", ["a"])  # its agent has not stopped the unit yet
    state.note_units("n0", [])
    assert state.clearing("a", 2.0) == Clearing(waiting=("n1", "n2"))
    state.note_units("n1", [])
    state.note_units("n2", [])
    assert state.clearing("a", 2.0).gone


def test_a_silent_node_is_named_apart_and_a_node_serving_another_job_showed_it_gone():
    state = running(nodes=2)
    first, second = state.job("a").nodes
    (third,) = set(NODES) - {first, second}
    state.apply_all(state.decide_cancel("a", "enough", 2.0))
    state.touch(second, 30.0)
    state.touch(third, 30.0)
    # first went silent past the heartbeat timeout (15 s): nothing will be heard of it
    assert state.clearing("a", 30.0) == Clearing(waiting=(second,), silent=(first,))
    state.note_units(second, [])
    assert state.clearing("a", 30.0) == Clearing(silent=(first,))
    # given a job only after it showed "a" gone: it stays shown gone whatever it runs now
    spec = JobSpec.build(job_id="b", plan=ParallelPlan(dp_shard=4), num_nodes=2, command=("x",))
    state.apply_all(state.decide_submit(spec, 30.0))
    state.apply_all(state.decide_allocate(30.0))
    assert set(state.job("b").nodes) == {second, third}
    assert state.clearing("a", 30.0) == Clearing(silent=(first,))


def test_a_pending_job_has_no_node_to_wait_for():
    state = running(nodes=3)
    state.apply_all(
        state.decide_submit(JobSpec.build(job_id="p", plan=ParallelPlan(dp_shard=2), num_nodes=1, command=("x",)), 2.0)
    )
    state.apply_all(state.decide_cancel("p", "", 3.0))
    assert state.clearing("p", 3.0).gone


def test_the_waiter_returns_once_the_last_node_shows_it_and_names_those_left_when_its_time_is_up():
    async def scenario():
        state, clock = running(), Clock()
        shown = UnitsShown(state, clock)
        state.apply_all(state.decide_cancel("a", "enough", 1.0))
        waiting = asyncio.ensure_future(shown.until_gone("a", 30.0))
        for node_id in NODES:
            await asyncio.sleep(0)
            assert not waiting.done(), node_id  # CANCELLED is not answered while a node may run it
            state.note_units(node_id, [])
            shown.noted()
        await asyncio.wait_for(waiting, 5)

        state = running("b")
        shown = UnitsShown(state, clock)
        state.apply_all(state.decide_cancel("b", "", 1.0))
        state.note_units("n2", [])
        with pytest.raises(NotShownGone) as late:
            await shown.until_gone("b", 0.05)
        assert late.value.code is Code.DEADLINE_EXCEEDED and late.value.left == Clearing(waiting=("n0", "n1"))
        message = late.value.message
        assert "job 'b' is CANCELLED, but its processes are not confirmed gone" in message
        assert re.search(
            r"node\(s\) n0, n1 did not show them gone within 0\.[01]s \(each stays out of the pool", message
        )

        clock.now = 100.0  # every node silent: answered at once, not after the bound
        state = running("c")
        shown = UnitsShown(state, clock)
        state.apply_all(state.decide_cancel("c", "", 1.0))
        with pytest.raises(NotShownGone) as silent:
            await asyncio.wait_for(shown.until_gone("c", 3600.0), 1)
        assert "node(s) n0, n1, n2 not heard within the heartbeat timeout" in silent.value.message

    asyncio.run(scenario())
