"""The engine's durability invariant, as a property (issue #12), with faults injected at
two seams: signing (the engine's AttestationTemplate.sign) and the store's write.

Definitions, checked over random bursts of concurrent Registers (duplicates in flight
included):
  durable(w)  = the rank that replaying the store's written log gives worker w;
  answered(w) = the ranks of the attestations Register returned for w.
I1  an answer is never ahead of durability: when Register returns rank r for w,
    durable(w) == r already.
I2  no applied-but-unanswered state: whenever the store has not failed and every call
    of a burst has settled, the live state's assignments equal the durable ones (a
    failed signing, before or after a duplicate, left nothing behind).
I3  one rank per worker, one worker per rank, over every answer.
I4  nothing is held that no one was told: with the store healthy, every worker holding
    a rank was answered it (a failed signing for a new worker left no assignment).
After a store failure the coordinator stops (on_store_failure); I1 and I3 still hold for
every answer, and no answer follows the failure.
"""

from __future__ import annotations

import asyncio
import secrets
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshgate.coordinator import engine
from meshgate.coordinator.engine import Coordinator
from meshgate.coordinator.keys import KeyRing
from meshgate.coordinator.rendezvous import (
    Code,
    NodeState,
    RankAssigned,
    RegisterInput,
    RendezvousConfig,
    RendezvousError,
    RendezvousState,
)
from meshgate.coordinator.store import GroupCommitStore, MemoryStore
from meshgate.coordinator.store.codec import decode
from meshgate.plan import ParallelPlan

CONFIG = RendezvousConfig(job_id="p", plan=ParallelPlan(tp=4, dp_shard=2), slots_per_node=4)


class ScriptedStore(GroupCommitStore):
    """Writes to a list; the write after ``fail_from`` calls raises (the store is then done)."""

    def __init__(self, fail_from: int | None) -> None:
        super().__init__()
        self.rows: list[tuple[int, str]] = []
        self.writes = 0
        self.fail_from = fail_from

    def load(self):
        return []

    async def _write(self, rows, then=None):
        await asyncio.sleep(0)  # a real write yields; others queue meanwhile
        self.writes += 1
        if self.fail_from is not None and self.writes > self.fail_from:
            raise OSError("injected: disk gone")
        self.rows.extend(rows)
        if then is not None:
            then()

    def durable_ranks(self) -> dict[str, int]:
        state = RendezvousState(CONFIG)
        state.apply_all(decode(text.split(" ", 2)[2], f"row {seq}") for seq, text in self.rows)
        return {w: a.rank for w, a in state.by_worker.items()}


def request(i: int) -> RegisterInput:
    return RegisterInput(
        job_id="p",
        worker_id=f"n{i // 4}/l{i % 4}",
        nonce=secrets.token_bytes(16),
        node_id=f"n{i // 4}",
        local_rank=i % 4,
        claimed_rank=None,
    )


bursts = st.lists(st.lists(st.tuples(st.integers(0, 7), st.booleans()), min_size=1, max_size=6), min_size=1, max_size=6)


class DelayedCommitStore(ScriptedStore):
    """Commits under load wait first, as SQLiteStore's do (commit_delay_s)."""

    commit_delay_s = 0.001


@pytest.mark.parametrize("store_class", [ScriptedStore, DelayedCommitStore])
@settings(max_examples=80, deadline=None)
@given(bursts=bursts, fail_from=st.one_of(st.none(), st.integers(0, 5)))
def test_answers_never_run_ahead_of_durability(tmp_path_factory, store_class, bursts, fail_from):
    keys = KeyRing(tmp_path_factory.mktemp("keys"), job_id="p")
    real_sign = engine.AttestationTemplate.sign
    failing_nonces: set[bytes] = set()

    def sign(template, **fields):
        if fields["nonce"] in failing_nonces:
            raise RuntimeError("injected: signing failed")
        return real_sign(template, **fields)

    async def run() -> None:
        store = store_class(fail_from)
        stopped: list[BaseException] = []
        coordinator = Coordinator(CONFIG, store, keys, attestation_ttl_s=60, on_store_failure=stopped.append)
        answered: dict[str, set[int]] = {}

        async def one(i: int, fail_sign: bool) -> None:
            r = request(i)
            if fail_sign:
                failing_nonces.add(r.nonce)
            try:
                signed, _secret = await coordinator.register(r)
            except (RuntimeError, RendezvousError):
                return
            rank = engine.attestation_pb2.Attestation.FromString(signed.payload).rank
            assert not stopped, "answered after the store failed"
            assert store.durable_ranks().get(r.worker_id) == rank, "I1: answered before durable"
            answered.setdefault(r.worker_id, set()).add(rank)

        for burst in bursts:
            if stopped:
                break  # the daemon stops here
            await asyncio.gather(*(one(i, f) for i, f in burst))
            if not stopped and store._failed is None:
                live = {w: a.rank for w, a in coordinator.state.by_worker.items()}
                assert live == store.durable_ranks(), "I2: applied but not durable"
                assert set(live) <= set(answered), "I4: a rank is held that no answer carried"
        holders: dict[int, str] = {}
        for worker, ranks in answered.items():
            assert len(ranks) == 1, f"I3: {worker} answered {ranks}"
            rank = next(iter(ranks))
            assert holders.setdefault(rank, worker) == worker, f"I3: rank {rank} held twice"

    with mock.patch.object(engine.AttestationTemplate, "sign", sign):
        asyncio.run(run())


def test_a_commit_waits_for_company_only_under_load():
    """commit_delay_s: a lone append is written at once; after a commit that carried more
    than one, the next waits the delay, and appends made meanwhile join it."""

    class Recording(ScriptedStore):
        commit_delay_s = 0.5  # long against the few loop turns below

        def __init__(self) -> None:
            super().__init__(None)
            self.groups: list[int] = []

        async def _write(self, rows, then=None):
            self.groups.append(len(rows))
            await super()._write(rows, then)

    async def run() -> None:
        store = Recording()
        event = RankAssigned(worker_id="n0/l0", rank=0, node_id="n0", local_rank=0, at=0.0)
        began = asyncio.get_running_loop().time()
        await store.append([event])  # alone: written at once
        assert store.groups == [1] and asyncio.get_running_loop().time() - began < 0.4
        await asyncio.gather(store.append([event]), store.append([event]))  # together, no delay yet
        assert store.groups == [1, 2]
        late = store.append([event])  # after a commit with company: this one waits ...
        for _ in range(5):
            await asyncio.sleep(0)
        assert store.groups == [1, 2], "it did not wait"
        joined = store.append([event])  # ... and this one, made meanwhile, joins it
        await asyncio.gather(late, joined)
        assert store.groups == [1, 2, 2]

    asyncio.run(run())


def test_register_on_a_spare_node_is_refused_and_changes_nothing(tmp_path):
    async def run() -> None:
        config = RendezvousConfig(job_id="p", plan=CONFIG.plan, slots_per_node=4, join_token="dev-token")
        coordinator = Coordinator(config, MemoryStore(), KeyRing(tmp_path / "keys", job_id="p"), attestation_ttl_s=60)
        for node in ("n0", "n1", "spare"):  # the plan has two nodes: the third is a spare
            await coordinator.join("p", node, node, 4, "gpu", "dev-token")
        assert coordinator.state.nodes["spare"].state is NodeState.SPARE
        before = dict(coordinator.state.by_rank)
        r = RegisterInput(
            job_id="p",
            worker_id="spare/l0",
            nonce=secrets.token_bytes(16),
            node_id="spare",
            local_rank=0,
            claimed_rank=None,
        )
        try:
            await coordinator.register(r)
        except RendezvousError as exc:
            assert exc.code is Code.FAILED_PRECONDITION and "spare" in str(exc)
        else:
            raise AssertionError("a spare's worker got a rank")
        assert coordinator.state.by_rank == before and "spare/l0" not in coordinator.state.by_worker
        assert len(coordinator.store.events) == len(coordinator.store.load())

    asyncio.run(run())


def test_attestations_follow_key_rotations_and_generation_bumps(tmp_path):
    """The engine serializes an attestation's shared fields once (AttestationTemplate): a
    rotation or a bump must still show in the very next attestation, and each verifies."""
    from dataclasses import replace

    from meshgate.attestation import verify_attestation
    from meshgate.coordinator.rendezvous import GenerationBumped

    async def run() -> None:
        keys = KeyRing(tmp_path / "keys", job_id="p")
        coordinator = Coordinator(CONFIG, MemoryStore(), keys, attestation_ttl_s=60)

        async def registered(r: RegisterInput, generation: int, key_id: str):
            signed, _secret = await coordinator.register(r)
            verified = verify_attestation(
                signed, keys.bundle, job_id="p", nonce=r.nonce, generation=generation, plan=CONFIG.plan
            )
            assert verified.key_id == signed.key_id == key_id
            return verified

        old_key = keys.active.key_id
        await registered(request(0), 0, old_key)
        keys.rotate(retire_after_s=60)  # what the cluster's RotateKey does (ClusterCoordinator.rotate_key)
        assert keys.active.key_id != old_key
        await registered(request(1), 0, keys.active.key_id)
        await coordinator._apply((GenerationBumped(1, "test: worker failed", worker_restart=True),))
        again = await registered(replace(request(0), generation=1), 1, keys.active.key_id)
        assert (again.generation, again.rank) == (1, 0)

    asyncio.run(run())
