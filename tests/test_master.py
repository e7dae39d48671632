"""The job's master from node rank 0's agent (issue #14): pure decisions, their events
through the store's codec, and the agent's port reservation. The end-to-end run (a real
2-node Lightning Fabric started by two agents) is in tests/test_netns.py."""

from __future__ import annotations

import copy
import socket

import pytest

from meshgate.attestation import secret_hash
from meshgate.agent.netif import InterfaceError, MasterReservation
from meshgate.coordinator.rendezvous import (
    Code,
    GenerationBumped,
    JoinAuth,
    MasterChosen,
    MasterOffered,
    NodeState,
    NodeStateChanged,
    RegisterInput,
    RendezvousConfig,
    RendezvousError,
    RendezvousState,
)
from meshgate.coordinator.store.codec import decode, encode
from meshgate.plan import ParallelPlan

JOB = "job-m"


def make_state() -> RendezvousState:
    # Two nodes of one slot, pinned: node-0 holds node rank 0 whatever the join order.
    return RendezvousState(
        RendezvousConfig(
            job_id=JOB,
            plan=ParallelPlan(dp_shard=2),
            slots_per_node=1,
            node_order=("node-0", "node-1"),
            join_token="dev",
        )
    )


def join(state: RendezvousState, node_id: str, offer, now: float = 1.0, credential: bytes = b""):
    auth = (
        JoinAuth(credential=credential) if credential else JoinAuth(token="dev", new_credential_hash=secret_hash(b"c"))
    )
    node, events = state.decide_join(JOB, node_id, node_id, 1, "cpu", now, auth, offer)
    state.apply_all(events)
    return events


def test_node_rank_zero_offer_is_the_job_master_whatever_the_join_order():
    state = make_state()
    join(state, "node-1", ("10.0.0.3", 4001))
    assert state.job_master is None  # node rank 0's agent has not joined: nothing to export yet
    events = join(state, "node-0", ("10.0.0.2", 4000))
    assert MasterOffered("node-0", "10.0.0.2", 4000) in events
    assert state.job_master == ("10.0.0.2", 4000)
    # Rank 0's Register naming another endpoint does not move it: the agents exported this one.
    register = RegisterInput(
        job_id=JOB,
        worker_id="w0",
        nonce=b"n" * 32,
        node_id="node-0",
        local_rank=0,
        claimed_rank=None,
        endpoint_host="10.0.0.2",
        endpoint_port=5555,
    )
    decision = state.decide_register(register, 2.0)
    state.apply_all(decision.events)
    assert MasterChosen("10.0.0.2", 5555) in decision.events
    assert state.job_master == ("10.0.0.2", 4000)


def test_a_rejoin_with_the_same_offer_adds_no_event_and_a_new_one_replaces_it():
    state = make_state()
    join(state, "node-0", ("10.0.0.2", 4000))
    assert not any(isinstance(e, MasterOffered) for e in join(state, "node-0", ("10.0.0.2", 4000), credential=b"c"))
    # A relaunch reserves a fresh port: the new offer is the master of the next launch.
    assert join(state, "node-0", ("10.0.0.2", 4002), credential=b"c") == (MasterOffered("node-0", "10.0.0.2", 4002),)
    assert state.job_master == ("10.0.0.2", 4002)


@pytest.mark.parametrize("worker_restart", [True, False])
def test_a_generation_bump_drops_the_old_offer_until_node_rank_zero_offers_again(worker_restart):
    """The stale master (issue #32): node rank 0's agent hands its port to its workers and
    reserves a fresh one for the next launch. A node that rejoins after a bump before node
    rank 0 has offered again must be told "no master yet" (its agent waits), never the old
    one. Node rank 0's new offer is held back here until node 1 has rejoined."""
    state = make_state()
    join(state, "node-0", ("10.0.0.2", 4000))
    join(state, "node-1", ("10.0.0.3", 4001))
    state.apply(GenerationBumped(1, "worker failed", worker_restart=worker_restart))
    answers = []  # the master every Join of node 1 in generation 1 was told
    join(state, "node-1", ("10.0.0.3", 4001), credential=b"c")
    answers.append(state.job_master)
    events = join(state, "node-0", ("10.0.0.2", 4002), credential=b"c")
    assert MasterOffered("node-0", "10.0.0.2", 4002) in events
    join(state, "node-1", ("10.0.0.3", 4001), credential=b"c")
    answers.append(state.job_master)
    assert answers == [None, ("10.0.0.2", 4002)]
    # A launcher that keeps its store for the whole run offers the same endpoint again: it is
    # recorded again for the new generation, not taken as already known.
    state.apply(GenerationBumped(2, "again", worker_restart=worker_restart))
    assert MasterOffered("node-0", "10.0.0.2", 4002) in join(state, "node-0", ("10.0.0.2", 4002), credential=b"c")
    assert state.job_master == ("10.0.0.2", 4002)


def test_a_lost_node_zero_offers_nothing():
    state = make_state()
    join(state, "node-0", ("10.0.0.2", 4000))
    join(state, "node-1", ("10.0.0.3", 4001))
    state.apply(NodeStateChanged("node-0", NodeState.LOST, 5.0, "no heartbeat"))
    assert state.job_master is None  # its agent is gone; it offers again when it rejoins


@pytest.mark.parametrize(
    "offer, field",
    [
        (("", 4000), "master_addr"),
        (("10.0.0.2 ; rm", 4000), "master_addr"),
        (("h" * 300, 4000), "master_addr"),
        (("10.0.0.2", 0), "master_port"),
        (("10.0.0.2", 70000), "master_port"),
    ],
)
def test_a_bad_offer_is_refused_by_name_and_changes_nothing(offer, field):
    state = make_state()
    join(state, "node-1", ("10.0.0.3", 4001))
    before = copy.deepcopy(vars(state))
    with pytest.raises(RendezvousError) as caught:
        state.decide_join(JOB, "node-0", "node-0", 1, "cpu", 2.0, JoinAuth(token="dev"), offer)
    assert caught.value.code == Code.INVALID_ARGUMENT
    assert caught.value.message.startswith(field), caught.value.message
    assert len(caught.value.message) < 200
    assert vars(state) == before


def test_master_offered_round_trips_through_the_store_codec():
    event = MasterOffered("node-0", "fd00::2", 4000)
    assert decode(encode(event), "test") == event


def test_reservation_holds_a_port_until_released():
    reserved = MasterReservation.reserve("127.0.0.1", {})
    assert not reserved.operator_set and 0 < reserved.port < 65536
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", reserved.port))  # held: nothing else takes it
    reserved.release()
    with socket.socket() as rank0:
        rank0.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        rank0.bind(("127.0.0.1", reserved.port))  # free for rank 0 to listen on
        rank0.listen()


def test_reservation_takes_the_operators_master_and_refuses_a_bad_port():
    taken = MasterReservation.reserve("10.9.9.9", {"MASTER_ADDR": "head", "MASTER_PORT": "29500"})
    assert (taken.address, taken.port, taken.operator_set) == ("head", 29500, True)
    with pytest.raises(InterfaceError, match="MASTER_PORT='http'"):
        MasterReservation.reserve("10.9.9.9", {"MASTER_ADDR": "head", "MASTER_PORT": "http"})
    with pytest.raises(InterfaceError, match="cannot reserve a master port on 192.0.2.77"):
        MasterReservation.reserve("192.0.2.77", {})  # an address this host does not hold


def test_workers_offer_the_agents_master_as_their_endpoint(monkeypatch):
    """With MASTER_ADDR/MASTER_PORT exported by the agent, rank 0's Register offers exactly
    that master, so the coordinator's World and Fabric/torch name the same one."""
    from meshgate.client import ClientConfigError, master_endpoint

    monkeypatch.setenv("MASTER_ADDR", "10.77.0.2")
    monkeypatch.setenv("MASTER_PORT", "29511")
    assert master_endpoint("10.77.0.1:7443") == ("10.77.0.2", 29511)
    for bad in ("http", "0", "70000", "-1"):
        monkeypatch.setenv("MASTER_PORT", bad)
        with pytest.raises(ClientConfigError, match="MASTER_PORT"):
            master_endpoint("10.77.0.1:7443")
    monkeypatch.delenv("MASTER_PORT")
    host, port = master_endpoint("127.0.0.1:7443")  # no master exported: a free port of ours
    assert host == "127.0.0.1" and 0 < port < 65536
