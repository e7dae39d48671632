"""A job ends exactly once, truthfully: the pure decisions about exits and departing nodes
(coordinator/rendezvous.py), the agent's exit journal (agent/exits.py), and the engine's
hold on a failure while a node of the job is overdue. No sockets; clocks passed in."""

from __future__ import annotations

import asyncio
import os
import stat
import time

from meshgate.agent.exits import ExitJournal, PendingExit
from meshgate.coordinator.engine import Coordinator
from meshgate.coordinator.keys import KeyRing
from meshgate.coordinator.rendezvous import (
    AdmittedNode,
    GenerationBumped,
    JobFailed,
    NodeReplaced,
    NodeState,
    NodeStateChanged,
    RegisterInput,
    RendezvousConfig,
    RendezvousState,
    WorkerSucceeded,
)
from meshgate.coordinator.store import MemoryStore
from meshgate.plan import ParallelPlan

JOB = "job-ends"
PLAN = ParallelPlan(dp_shard=4)
TIMEOUT = 30.0  # lost_node_timeout_s


def admitted(spare: bool = False, now: float = 1.0) -> list[AdmittedNode]:
    nodes = [
        AdmittedNode("node-a", 0, "host-a", 2, "cpu", "ha", "00" * 32),
        AdmittedNode("node-b", 1, "host-b", 2, "cpu", "hb", "11" * 32),
    ]
    if spare:
        nodes.append(AdmittedNode("node-s", -1, "host-s", 2, "cpu", "hs", "22" * 32))
    return nodes


def running(spare: bool = False, max_restarts: int = 0) -> RendezvousState:
    """Two agent-managed nodes (and a spare), every rank of generation 0 held."""
    state = RendezvousState(
        RendezvousConfig(
            job_id=JOB, plan=PLAN, slots_per_node=2, lost_node_timeout_s=TIMEOUT, max_restarts=max_restarts
        )
    )
    state.apply_all(state.decide_admit(admitted(spare), 1.0))
    for node in ("node-a", "node-b"):
        for local in (0, 1):
            request = RegisterInput(JOB, f"{node}/{local}", b"n" * 16, node, local, None)
            state.apply_all(state.decide_register(request, 1.0).events)
    assert state.complete
    return state


def exit_of(
    state: RendezvousState,
    node: str,
    local: int,
    code: int,
    generation: int = 0,
    now: float = 5.0,
    stopped: bool = False,
    start_failed: bool = False,
    detail: str = "",
):
    n = state.nodes[node]
    events = state.decide_worker_exit(n, local, code, generation, stopped, now, start_failed, detail)
    events += state.decide_worker_succeeded(n, local, code, generation, stopped, now)
    state.apply_all(events)
    return events


# ---- idempotent exits ----------------------------------------------------------------------


def test_a_resent_exit_decides_nothing_the_second_time():
    state = running(max_restarts=1)
    assert exit_of(state, "node-a", 0, 0) == (WorkerSucceeded("node-a", 0, 0, 5.0),)
    assert exit_of(state, "node-a", 0, 0, now=6.0) == ()  # the resend of a clean exit
    bumped = exit_of(state, "node-b", 1, 1)
    assert [type(e) for e in bumped] == [GenerationBumped]
    assert exit_of(state, "node-b", 1, 1, now=6.0) == ()  # the resend of the failure
    assert (state.generation, state.worker_restarts, state.failed) == (1, 1, "")


def test_every_clean_exit_of_the_last_generation_and_only_then_succeeds():
    state = running()
    for node, local in (("node-a", 0), ("node-a", 1), ("node-b", 0)):
        exit_of(state, node, local, 0)
        assert not state.succeeded
    exit_of(state, "node-b", 1, 143, stopped=True)  # stopped by its agent: not a success
    assert not state.succeeded
    exit_of(state, "node-b", 1, 0)
    assert state.succeeded


# ---- a command that cannot start ----------------------------------------------------------------


def test_a_command_that_cannot_start_fails_the_job_at_once_whatever_the_restart_policy():
    state = running(max_restarts=5)
    why = "cannot start '/no/such' on node 'node-b': No such file or directory"
    events = exit_of(state, "node-b", 0, 127, start_failed=True, detail=why)
    assert events == (JobFailed(f"{why} (on node 'node-b'; a command that cannot start is never retried)", 5.0),)
    assert state.worker_restarts == 0 and state.generation == 0
    assert exit_of(state, "node-b", 1, 127, start_failed=True, detail=why) == ()  # once
    long = running()
    exit_of(long, "node-a", 0, 127, start_failed=True, detail="x" * 5000)
    assert len(long.failed) < 400  # bounded


# ---- drain ---------------------------------------------------------------------------------------


def test_a_drained_node_ends_the_generation_and_a_spare_takes_its_block():
    state = running(spare=True)
    events = state.decide_leave(JOB, "node-b", "drained", 5.0)
    assert events == (
        NodeStateChanged("node-b", NodeState.LEFT, 5.0, "drained"),
        NodeReplaced("node-s", "node-b", 1, 5.0),
        GenerationBumped(1, "node 'node-b' (node_rank 1) left (drained), spare 'node-s' takes its ranks", at=5.0),
    )
    state.apply_all(events)
    assert state.nodes["node-s"].state is NodeState.ACTIVE and state.nodes["node-b"].state is NodeState.REPLACED
    # the drained workers' exits (143, stopped by the agent) belong to generation 0: nothing
    assert exit_of(state, "node-b", 0, 143, generation=0, stopped=True) == ()
    assert state.decide_lost(5.0 + TIMEOUT + 1, 1e9) == ()  # nothing awaited


def test_a_drained_node_without_a_spare_fails_the_job_after_lost_node_timeout_naming_it():
    state = running()
    events = state.decide_leave(JOB, "node-b", "drained", 5.0)
    assert events[-1] == GenerationBumped(1, "node 'node-b' (node_rank 1) left (drained)", at=5.0)
    state.apply_all(events)
    assert state.decide_lost(5.0 + TIMEOUT - 1, 1e9) == ()
    (failed,) = state.decide_lost(5.0 + TIMEOUT + 1, 1e9)
    assert isinstance(failed, JobFailed)
    assert failed.reason.startswith("node 'node-b' (ranks 2-3) was drained 31s ago"), failed.reason


def test_a_node_that_leaves_after_its_workers_exited_0_ends_nothing():
    state = running()
    exit_of(state, "node-b", 0, 0)
    exit_of(state, "node-b", 1, 0)
    events = state.decide_leave(JOB, "node-b", "drained", 6.0)
    assert events == (NodeStateChanged("node-b", NodeState.LEFT, 6.0, "drained"),)
    state.apply_all(events)
    assert state.decide_lost(6.0 + TIMEOUT + 1, 1e9) == ()
    exit_of(state, "node-a", 0, 0)
    exit_of(state, "node-a", 1, 0)
    assert state.succeeded and state.generation == 0


# ---- lost heartbeats -----------------------------------------------------------------------------


def _silence(state: RendezvousState, node: str, at: float) -> None:
    for n in state.nodes.values():
        n.last_seen = at + 100 if n.node_id != node else at


def test_a_lost_node_mid_generation_ends_it_naming_the_node():
    state = running()
    _silence(state, "node-b", 0.0)
    events = state.decide_lost(101.0, 15.0)
    assert events[0] == NodeStateChanged("node-b", NodeState.LOST, 101.0, "no heartbeat for 101.0s (> 15s)")
    assert events[1] == GenerationBumped(1, "node 'node-b' (node_rank 1) lost", at=101.0)


def test_an_agent_managed_node_is_alive_only_while_its_agent_heartbeats_never_through_its_workers():
    """The workers of an agent killed for good run on and heartbeat for themselves: that
    keeps them alive, not their node; it is lost, and its spare takes the block. A node
    no agent manages is still seen through its workers (nothing else can show it)."""
    state = running(spare=True)
    _silence(state, "node-b", 0.0)
    for at in (20.0, 60.0, 100.0):  # node-b's orphaned workers beat on
        state.touch("node-b/0", at)
        state.touch("node-b/1", at)
    assert state.worker_seen["node-b/0"] == 100.0
    events = state.decide_lost(101.0, 15.0)
    assert events[0] == NodeStateChanged("node-b", NodeState.LOST, 101.0, "no heartbeat for 101.0s (> 15s)")
    assert NodeReplaced("node-s", "node-b", 1, 101.0) in events

    unmanaged = running()
    for node in unmanaged.nodes.values():
        node.managed = False
    _silence(unmanaged, "node-b", 0.0)
    unmanaged.touch("node-b/0", 100.0)
    assert unmanaged.nodes["node-b"].last_seen == 100.0


def test_a_node_lost_while_the_generation_finishes_is_awaited_never_relaunched():
    """Workers of the generation already exited 0: the training is over. The lost node's
    agent resends its journalled exits when it is back, and the job succeeds in
    generation 0; no generation bump, no spare, no relaunch."""
    state = running(spare=True)
    exit_of(state, "node-a", 0, 0)
    exit_of(state, "node-a", 1, 0)
    _silence(state, "node-b", 0.0)
    events = state.decide_lost(101.0, 15.0)
    assert events == (NodeStateChanged("node-b", NodeState.LOST, 101.0, "no heartbeat for 101.0s (> 15s)"),)
    state.apply_all(events)
    exit_of(state, "node-b", 0, 0, now=102.0)  # resent after the agent's restart
    exit_of(state, "node-b", 1, 0, now=102.0)
    assert state.succeeded and state.generation == 0
    assert state.decide_lost(102.0 + TIMEOUT + 1, 15.0) == ()


def test_a_node_lost_while_the_generation_finishes_that_never_reports_fails_the_job_naming_it():
    state = running()
    exit_of(state, "node-a", 0, 0)
    _silence(state, "node-b", 0.0)
    state.apply_all(state.decide_lost(101.0, 15.0))
    (failed,) = state.decide_lost(101.0 + TIMEOUT + 1, 1e9)
    assert "node 'node-b' (ranks 2-3) was lost" in failed.reason


def test_unheard_nodes_are_those_holding_a_block_silent_since_then_other_than_the_reporter():
    state = running(spare=True)
    for n in state.nodes.values():
        n.last_seen = 10.0
    state.nodes["node-b"].last_seen = 5.0
    state.nodes["node-s"].last_seen = 0.0  # a silent spare holds no rank: never blamed
    assert [n.node_id for n in state.unheard_since(8.0)] == ["node-b"]
    assert state.unheard_since(8.0, but="node-b") == []
    assert state.unheard_since(5.0) == []


async def formed_engine(keys: "os.PathLike[str]") -> Coordinator:
    """A job's engine (heartbeat tolerance 0.6 s) with both nodes admitted and every rank held."""
    config = RendezvousConfig(job_id=JOB, plan=PLAN, slots_per_node=2, lost_node_timeout_s=TIMEOUT)
    engine = Coordinator(
        config, MemoryStore(), KeyRing(keys, job_id=JOB), attestation_ttl_s=60, heartbeat_timeout_s=0.6
    )
    await engine.admit(admitted())
    for node in ("node-a", "node-b"):
        for local in (0, 1):
            await engine.register(RegisterInput(JOB, f"{node}/{local}", b"n" * 16, node, local, None))
    return engine


async def test_a_survivors_failure_while_a_node_is_silent_is_blamed_on_the_silent_node(tmp_path):
    """The survivor's collective broke because node-b died: the engine holds the exit
    until every other node is heard from, up to the heartbeat tolerance; node-b is
    declared lost and the generation ends naming it; the survivor's exit belongs to the
    generation that ended."""
    engine = await formed_engine(tmp_path / "keys")
    engine.state.nodes["node-a"].last_seen = time.time()  # node-b last heard at admit, then silent
    started = time.monotonic()
    generation, failure = await engine.report_exit(JOB, "node-a", 0, 1, 0, False)
    assert failure == "" and generation == 1, failure  # not "node-a exited 1; max_restarts is 0"
    assert engine.state.nodes["node-b"].state is NodeState.LOST
    assert time.monotonic() - started < 2.0


async def test_a_failure_while_every_node_is_heard_from_is_the_workers_own(tmp_path):
    engine = await formed_engine(tmp_path / "keys")

    async def node_b_heartbeats():
        await asyncio.sleep(0.1)
        engine.node_heartbeat(JOB, "node-b")

    heard = asyncio.ensure_future(node_b_heartbeats())
    generation, failure = await engine.report_exit(JOB, "node-a", 0, 1, 0, False)
    await heard
    assert "on node 'node-a' exited 1" in failure and engine.state.nodes["node-b"].state is NodeState.ACTIVE


# ---- the agent's exit journal ---------------------------------------------------------------------


def test_the_journal_keeps_each_exit_until_acknowledged_and_survives_a_restart(tmp_path):
    journal = ExitJournal(tmp_path / "exits")
    first = PendingExit(JOB, "node-a", 0, 0, 0)
    second = PendingExit(JOB, "node-a", 0, 1, 1, detail="x")
    journal.record(first)
    journal.record(second)
    journal.record(first)  # the same exit again: one entry
    files = list((tmp_path / "exits").iterdir())
    assert len(files) == 2 and all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in files)
    assert stat.S_IMODE(os.stat(tmp_path / "exits").st_mode) == 0o700
    again = ExitJournal(tmp_path / "exits")  # a restarted agent
    assert set(again.pending()) == {first, second}
    again.acknowledge(first)
    assert again.pending() == [second] and not again.holds(first) and again.holds(second)


def test_an_unreadable_journal_entry_is_set_aside_not_fatal(tmp_path):
    journal = ExitJournal(tmp_path / "exits")
    journal.record(PendingExit(JOB, "node-a", 0, 0, 0))
    (tmp_path / "exits" / "torn.exit").write_text("{not json")
    assert journal.pending() == [PendingExit(JOB, "node-a", 0, 0, 0)]
    assert (tmp_path / "exits" / "torn.unreadable").exists()


# ---- an ended job's clock stops ----------------------------------------------------------------


def test_an_ended_jobs_status_clock_stops_at_its_end():
    from meshgate.cli import render_status, status_dict
    from meshgate.v1 import rendezvous_pb2

    status = rendezvous_pb2.Status(job_id=JOB, plan=PLAN.to_proto(), world_size=4)
    status.opened_at.FromSeconds(1000)
    running_now = status_dict(status, "head:7443", 1100.0)
    assert running_now["open_for_s"] == 100.0 and running_now["ended_at"] is None
    status.ended_at.FromSeconds(1060)
    later, much_later = status_dict(status, "head:7443", 1100.0), status_dict(status, "head:7443", 99999.0)
    assert later["open_for_s"] == much_later["open_for_s"] == 60.0
    assert "job ended at" in render_status(much_later) and "open for" not in render_status(much_later)
