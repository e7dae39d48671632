"""Mixed clusters keep the one-holder invariant (issue 35, items 2 and 6): a job's engine
(coordinator/engine.py) over a MemoryStore, its nodes admitted as the cluster admits them,
Joins and Registers as the servicers pass them in, a clock the test moves. No sockets:
the decisions are the engine's, and the fault (an agent killed and started again, an
agent of the release before instance ids) is the Join that follows it.

- A node that comes back under a new agent instance ends its generation whatever the
  earlier agent reported: an agent of the release before instances named none.
- A Join that cannot show it is the same agent ends the generation once the node's
  workers hold ranks in it, and never before (an old agent joins again after every
  relaunch: that must not bump the generation again and again).
- After a generation bump the world counts only that generation's registrations.
"""

from __future__ import annotations

import logging

import pytest

from meshgate.attestation import SigningKey, secret_hash
from meshgate.coordinator import readmodel
from meshgate.coordinator.engine import Coordinator
from meshgate.coordinator.keys import KeyRing
from meshgate.coordinator.rendezvous import AdmittedNode, NodeState, RegisterInput, RendezvousConfig
from meshgate.coordinator.store import MemoryStore
from meshgate.plan import ParallelPlan

JOB = "mixed"
CREDENTIAL = {n: bytes([i + 1]) * 32 for i, n in enumerate(("a", "b", "s"))}
KEY = SigningKey.generate()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def engine_of(tmp_path, spare: bool = False, store: MemoryStore | None = None) -> Coordinator:
    """Nodes a (node rank 0) and b (1) of two slots each, and a spare s when asked."""
    config = RendezvousConfig(job_id=JOB, plan=ParallelPlan(dp_shard=4), slots_per_node=2, lost_node_timeout_s=60)
    clock = Clock()
    engine = Coordinator(
        config,
        store if store is not None else MemoryStore(),
        KeyRing(tmp_path / "keys", job_id=JOB),
        attestation_ttl_s=3600,
        heartbeat_timeout_s=15,
        clock=clock,
    )
    engine.clock_ = clock
    if store is None:
        nodes = [("a", 0), ("b", 1)] + ([("s", -1)] if spare else [])
        await engine.admit(
            [
                AdmittedNode(n, r, f"host-{n}", 2, "cpu", secret_hash(CREDENTIAL[n]), KEY.public_raw.hex())
                for n, r in nodes
            ]
        )
    return engine


async def join(engine: Coordinator, node: str, instance: str) -> None:
    engine.clock_.now += 1
    await engine.join(JOB, node, f"host-{node}", 2, "cpu", "", CREDENTIAL[node], KEY.public_raw, None, instance)


async def register(engine: Coordinator, node: str, local: int) -> int:
    engine.clock_.now += 1
    request = RegisterInput(JOB, f"{node}/{local}", bytes([local + 7]) * 16, node, local, None)
    signed, _ = await engine.register(request)
    return engine.state.by_worker[request.worker_id].rank


async def all_registered(engine: Coordinator, nodes=("a", "b")) -> None:
    for node in nodes:
        for local in (0, 1):
            await register(engine, node, local)


# ---- item 2: a node back under another agent ends its generation -----------------------------


@pytest.mark.parametrize(
    "before, after",
    [
        ("", "new-agent"),  # an old agent (no instance) killed -9, a new agent started: the case
        ("", ""),  # an old agent killed and started again: it cannot show it is the same
        ("agent-1", ""),  # a new agent replaced by an old one (a rollback)
        ("agent-1", "agent-2"),  # a new agent killed and started again (as before)
    ],
)
async def test_a_join_that_cannot_show_the_same_agent_while_its_workers_hold_ranks_ends_the_generation(
    tmp_path, before, after
):
    engine = await engine_of(tmp_path)
    await join(engine, "a", before)
    await join(engine, "b", "b-agent")
    await all_registered(engine)
    assert engine.state.complete and engine.state.generation == 0

    await join(engine, "a", after)

    state = engine.state
    assert state.generation == 1, "a rejoin that cannot prove the same agent kept its generation"
    assert state.nodes["a"].state is NodeState.ACTIVE and not state.complete
    # Its ranks are free for the next generation's workers, and only theirs.
    assert [r for r, a in state.by_rank.items() if a.node_id == "a"] == []
    assert state.missing_ranks() == [0, 1, 2, 3]
    # Every (generation, rank) has had one holder: the relaunched worker takes rank 0 in generation 1.
    assert await register(engine, "a", 0) == 0 and state.generation == 1


async def test_the_same_agent_joining_again_keeps_its_generation(tmp_path):
    engine = await engine_of(tmp_path)
    await join(engine, "a", "agent-1")
    await join(engine, "b", "b-agent")
    await all_registered(engine)
    await join(engine, "a", "agent-1")  # a retry of the same agent's Join
    assert engine.state.generation == 0 and engine.state.complete


async def test_an_old_agent_joining_again_after_each_relaunch_never_bumps_again(tmp_path):
    """An agent of the release before instances Joins after every relaunch and while it waits
    for the master: before its workers register there is nothing of the generation to end."""
    engine = await engine_of(tmp_path)
    await join(engine, "a", "")
    await join(engine, "b", "")
    await join(engine, "a", "")  # waiting for the master: no rank held yet
    assert engine.state.generation == 0
    await all_registered(engine)
    await join(engine, "a", "")  # mid-generation: its old workers may run on
    assert engine.state.generation == 1
    for node in ("a", "b"):  # both relaunch and join again into generation 1
        await join(engine, node, "")
    assert engine.state.generation == 1
    await all_registered(engine)
    assert engine.state.complete and engine.state.generation == 1


# ---- item 6: a new generation counts only its own registrations -------------------------------


async def test_after_a_lost_node_the_new_generation_forms_only_once_every_worker_registered_again(tmp_path, caplog):
    engine = await engine_of(tmp_path, spare=True)
    for node in ("a", "b", "s"):
        await join(engine, node, f"{node}-agent")
    await all_registered(engine)
    caplog.set_level(logging.INFO, logger="meshgate.coordinator")
    caplog.clear()

    engine.clock_.now += 30  # b is silent past the timeout; a and the spare heartbeat
    engine.node_heartbeat(JOB, "a", CREDENTIAL["a"], "a-agent")
    engine.node_heartbeat(JOB, "s", CREDENTIAL["s"], "s-agent")
    await engine.sweep_lost()
    state = engine.state
    assert state.generation == 1 and state.nodes["s"].node_rank == 1

    assert not state.complete and readmodel_registered(engine) == 0
    for local in (0, 1):  # the spare's workers take b's block
        assert await register(engine, "s", local) == 2 + local
    assert not state.complete and readmodel_registered(engine) == 2, "the survivors' old ranks were counted"
    formed = [r.getMessage() for r in caplog.records if "formed" in r.getMessage()]
    assert formed == [], formed
    for local in (0, 1):  # the survivor's relaunched workers: same ids, same ranks, recorded again
        assert await register(engine, "a", local) == local
    assert state.complete and readmodel_registered(engine) == 4
    formed = [r.getMessage() for r in caplog.records if "formed" in r.getMessage()]
    assert formed == [f"job {JOB} generation 1: world of 4 ranks formed on 2 nodes"], formed

    # Durable: a coordinator restarted from the log counts the same.
    replayed = MemoryStore()
    replayed.events = engine.store.load()
    again = await engine_of(tmp_path, store=replayed)
    assert again.state.generation == 1 and again.state.complete and again.state.registered_now == 4


def readmodel_registered(engine: Coordinator) -> int:
    """What `job show` says: "registered n/m ranks" (readmodel's Status.registered)."""
    return readmodel.status(engine).registered


async def test_a_log_of_the_release_before_heals_its_count_from_each_survivor_s_heartbeat(tmp_path):
    """The release before recorded nothing when a survivor's worker registered again in a new
    generation. Replayed here, the survivors' ranks count in that generation once each worker
    shows this generation's heartbeat secret (it can only hold it from a Register in it)."""
    engine = await engine_of(tmp_path, spare=True)
    for node in ("a", "b", "s"):
        await join(engine, node, f"{node}-agent")
    await all_registered(engine)
    engine.clock_.now += 30
    engine.node_heartbeat(JOB, "a", CREDENTIAL["a"], "a-agent")
    engine.node_heartbeat(JOB, "s", CREDENTIAL["s"], "s-agent")
    await engine.sweep_lost()
    for local in (0, 1):
        await register(engine, "s", local)
    old_log = MemoryStore()
    old_log.events = list(engine.store.load())  # generation 1 as the release before left it: a's not again
    again = await engine_of(tmp_path, store=old_log)
    assert again.state.generation == 1 and again.state.registered_now == 2
    for local in (0, 1):
        worker = f"a/{local}"
        secret = again.keys.heartbeat_secrets(JOB, 1, worker, now=again.clock())[0]
        assert again.heartbeat(JOB, worker, 1, secret) == 1
    assert again.state.complete and readmodel_registered(again) == 4
    world = await again.await_world(JOB, 1, timeout_s=0.1)
    assert world.world_size == 4
