"""Messages that mislead no one (issue 24, item 6): a wrong-mode Register names what to send
and how to submit the job instead (no literal "{local_rank}"); a claimed job's nodes show
where their ranks landed, not planned blocks; and every refusal that has a remedy names it
(a flag, a config key, a command). Pure decisions and the read model: no sockets. (A
cancel logged at INFO and a job list that stays one row per job: tests/test_job_timeline_cluster.py
and tests/test_timeline.py; Fabric's FSDP on CPU: tests/test_fabric.py.)"""

from __future__ import annotations

import asyncio
import re

import pytest

from meshgate.coordinator import readmodel
from meshgate.coordinator.cluster_state.pool import decide_join as decide_pool_join
from meshgate.coordinator.engine import Coordinator
from meshgate.coordinator.jobs import ClusterState
from meshgate.coordinator.keys import KeyRing
from meshgate.coordinator.rendezvous import (
    AdmittedNode,
    JoinAuth,
    RankMode,
    RegisterInput,
    RendezvousConfig,
    RendezvousError,
    RendezvousState,
    TokenCreated,
)
from meshgate.coordinator.service import AccessPolicy, register_input
from meshgate.coordinator.store import MemoryStore
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb
from meshgate.views import render_status, status_dict

JOB = "msgs"


def refusal(call) -> RendezvousError:
    with pytest.raises(RendezvousError) as refused:
        call()
    return refused.value


def state_of(mode: RankMode, world: int = 4) -> RendezvousState:
    state = RendezvousState(
        RendezvousConfig(job_id=JOB, plan=ParallelPlan(dp_shard=world), slots_per_node=2, mode=mode)
    )
    state.apply_all(
        state.decide_admit(
            [
                AdmittedNode("n0", 0, "h0", 2, "cpu", "c0", "00" * 32),
                AdmittedNode("n1", 1, "h1", 2, "cpu", "c1", "11" * 32),
            ],
            1.0,
        )
    )
    return state


def test_a_claimed_register_in_an_assigned_job_says_what_to_send_and_how_to_submit_instead():
    state = state_of(RankMode.ASSIGNED)
    error = refusal(lambda: state.decide_register(RegisterInput(JOB, "n0/rank3", b"n" * 16, "n0", 1, 3), 2.0))
    assert error.code.value == "INVALID_ARGUMENT"
    assert "{" not in error.message and "}" not in error.message, error.message
    assert "registers with its local_rank alone (RegisterRequest.assigned)" in error.message
    assert "claimed rank 3" in error.message and "meshgate job submit --mode claimed" in error.message


def test_an_assigned_register_in_a_claimed_job_says_what_to_send_and_how_to_submit_instead():
    state = state_of(RankMode.CLAIMED)
    error = refusal(lambda: state.decide_register(RegisterInput(JOB, "n0/local1", b"n" * 16, "n0", 1, None), 2.0))
    assert "{" not in error.message, error.message
    assert "names its rank and local_rank (RegisterRequest.claimed)" in error.message
    assert "local_rank 1 alone" in error.message and "--mode assigned" in error.message


def test_a_register_with_no_mode_names_both_fields_without_braces():
    error = refusal(lambda: register_input(pb.RegisterRequest(job_id=JOB, worker_id="w")))
    assert "{" not in error.message
    assert "RegisterRequest.assigned" in error.message and "RegisterRequest.claimed" in error.message


def test_a_claimed_jobs_nodes_show_where_their_ranks_landed_not_planned_blocks():
    """Ray placed rank 3 on n0 and rank 0 on n1: `meshgate status` / `job show` say so,
    and the missing ranks belong to no node."""

    async def scenario(tmp_path_keys):
        config = RendezvousConfig(job_id=JOB, plan=ParallelPlan(dp_shard=4), slots_per_node=2, mode=RankMode.CLAIMED)
        engine = Coordinator(config, MemoryStore(), KeyRing(tmp_path_keys, job_id=JOB), attestation_ttl_s=60)
        await engine.admit(
            [
                AdmittedNode("n0", 0, "h0", 2, "cpu", "c0", "00" * 32),
                AdmittedNode("n1", 1, "h1", 2, "cpu", "c1", "11" * 32),
            ]
        )
        await engine.register(RegisterInput(JOB, "n0/rank3", b"n" * 16, "n0", 0, 3))
        await engine.register(RegisterInput(JOB, "n1/rank0", b"n" * 16, "n1", 0, 0))
        return readmodel.status(engine)

    import tempfile

    with tempfile.TemporaryDirectory() as keys:
        status = asyncio.run(scenario(keys))
    assert status.mode == pb.RANK_MODE_CLAIMED
    assert [(n.node_id, n.registered_ranks) for n in status.nodes] == [("n0", "3"), ("n1", "0")]
    data = status_dict(status, "here", 0.0)
    assert data["mode"] == "claimed"
    assert [(n["node_id"], n["ranks"]) for n in data["nodes"]] == [("n0", "3"), ("n1", "0")]
    assert data["missing_by_node"] == [
        {"node": "unclaimed (claimed mode)", "node_rank": None, "ranks": "1-2", "count": 2}
    ]
    text = render_status(data)
    assert re.search(r"^n0\s+0\s+h0\s+active\s+cpu\s+3\s+1/2", text, re.M), text
    assert "unclaimed (claimed mode): 1-2" in text and "0-1" not in text


def test_an_assigned_jobs_nodes_still_show_their_blocks():
    status = pb.Status(job_id=JOB, world_size=4, missing_ranks="2-3")
    status.nodes.add(node_id="n0", node_rank=0, first_rank=0, slots=2, registered=2)
    status.nodes.add(node_id="n1", node_rank=1, first_rank=2, slots=2)
    data = status_dict(status, "here", 0.0)
    assert data["mode"] == "assigned" and [n["ranks"] for n in data["nodes"]] == ["0-1", "2-3"]
    assert data["missing_by_node"][0]["node"] == "n1"


class _Context:
    """What AccessPolicy reads of a call: its metadata."""

    def invocation_metadata(self):
        return ()


# A representative set of refusals that have a remedy: each names the flag, key or command.
REMEDIES = [
    (
        "Admin call without an admin credential",
        lambda: AccessPolicy(admin_token_hash="x" * 64).require_admin(_Context()),
        ["--cert-file", "meshgate certs issue DIR --role admin", "--admin-token-file"],
    ),
    (
        "an agent's first Join without a token",
        lambda: decide_pool_join(ClusterState(15.0), "n9", "h", 2, "cpu", {}, JoinAuth("", b"", bytes(32), "h"), 1.0),
        ["[agent] join_token_file", "meshgate token create --node-id n9"],
    ),
    (
        "an expired join token",
        lambda: _expired_token_join(),
        ["meshgate token create --node-id n9", "[agent] join_token_file"],
    ),
    (
        "a node with too few slots",
        lambda: RendezvousState(
            RendezvousConfig(job_id=JOB, plan=ParallelPlan(dp_shard=8), slots_per_node=4)
        ).decide_join(JOB, "n0", "h", 2, "cpu", 1.0, JoinAuth("", b"", bytes(32), "h", admitted=True)),
        ["[agent] slots >= 4", "--slots-per-node"],
    ),
    (
        "a Register for another generation",
        lambda: state_of(RankMode.ASSIGNED).decide_register(
            RegisterInput(JOB, "n0/local0", b"n" * 16, "n0", 0, None, generation=5), 2.0
        ),
        ["register again with generation 0"],
    ),
    (
        "a claimed Register in an assigned job",
        lambda: state_of(RankMode.ASSIGNED).decide_register(RegisterInput(JOB, "w", b"n" * 16, "n0", 0, 1), 2.0),
        ["meshgate job submit --mode claimed"],
    ),
]


def _expired_token_join():
    cluster = ClusterState(15.0)
    from meshgate.attestation import secret_hash

    cluster.apply(TokenCreated(secret_hash("tok"), 5.0, "n9", 0.0))
    return decide_pool_join(cluster, "n9", "h", 2, "cpu", {}, JoinAuth("tok", b"", bytes(32), "h"), 10.0)


@pytest.mark.parametrize("what, call, remedies", REMEDIES, ids=[r[0] for r in REMEDIES])
def test_a_refusal_with_a_remedy_names_it(what, call, remedies):
    message = refusal(call).message
    for remedy in remedies:
        assert remedy in message, (what, message)
    assert "\n" not in message


def test_an_agent_config_without_a_coordinator_shows_how_to_write_one():
    from meshgate.agent.config import AgentConfig, AgentConfigError

    with pytest.raises(AgentConfigError) as refused:
        AgentConfig.from_mapping({"node_id": "n0"})
    assert 'coordinator = "head:7443"' in str(refused.value)
