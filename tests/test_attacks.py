"""Hostile nodes and workers (issue #12, items 6-11) against a real grpc.aio coordinator
over mTLS with the dev CA; real coordinator and agent processes where the attack
involves them. Each attack is refused with its documented status and leaves the
coordinator's state as it found it (the full state, compared before and after)."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import secrets
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from conftest import REPO, start_coordinator, simulated_machine_id, worker_env, write_config
from meshgate.agent.vouch_socket import MAX_REQUEST_BYTES, LocalNode, VouchSocket
from meshgate.attestation import SigningKey, sign_vouch
from meshgate.coordinator.config import ConfigError, CoordinatorConfig
from meshgate.coordinator.engine import Coordinator
from meshgate.coordinator.keys import KeyRing
from meshgate.coordinator.rendezvous import NodeState, RankMode, RendezvousConfig
from meshgate.coordinator.service import AccessPolicy, build_server, mark_serving
from meshgate.coordinator.store import MemoryStore
from meshgate.plan import ParallelPlan
from meshgate.tls import init_dev_ca, peer_identity, secure_channel, server_credentials
from meshgate.v1 import nodes_pb2, nodes_pb2_grpc
from meshgate.v1 import rendezvous_pb2 as pb
from meshgate.v1 import rendezvous_pb2_grpc

JOB = "hostile-job"
PLAN = ParallelPlan(tp=2, dp_shard=2)  # 4 ranks, 2 per node: node-a holds 0-1, node-b 2-3
NODES = ("node-a", "node-b", "node-c")


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def state_of(coordinator: Coordinator):
    """Everything the coordinator holds, credentials and token use included."""
    return copy.deepcopy(vars(coordinator.state)), repr(coordinator.state)


async def serve(tmp_path, mode: RankMode):
    ca = init_dev_ca(tmp_path / "ca", agent_names=NODES)
    clock = Clock()
    keys = KeyRing(tmp_path / "keys", job_id=JOB)
    config = RendezvousConfig(job_id=JOB, plan=PLAN, slots_per_node=2, require_vouch=True, mode=mode)
    coordinator = Coordinator(config, MemoryStore(), keys, attestation_ttl_s=600, clock=clock, heartbeat_timeout_s=6)
    server, health = build_server(coordinator, policy=AccessPolicy(secure=True))
    port = server.add_secure_port("127.0.0.1:0", server_credentials(ca.server_tls(require_client_cert=True)))
    await server.start()
    await mark_serving(health)

    class Env:
        pass

    env = Env()
    env.ca, env.clock, env.coordinator, env.server, env.channels = ca, clock, coordinator, server, []
    env.address = f"127.0.0.1:{port}"

    def channel(pair):
        made = secure_channel(env.address, ca.client_tls(pair), aio=True)
        env.channels.append(made)
        return made

    env.admin = rendezvous_pb2_grpc.AdminStub(channel(ca.admin))
    env.nodes = {n: nodes_pb2_grpc.NodesStub(channel(ca.agent(n))) for n in NODES}
    env.worker = rendezvous_pb2_grpc.RendezvousStub(channel(ca.worker))
    env.node_keys = {n: SigningKey.generate() for n in NODES}
    env.credentials = {}
    return env


async def close(env) -> None:
    for made in env.channels:
        await made.close()
    await env.server.stop(None)


@pytest_asyncio.fixture
async def assigned(tmp_path):
    env = await serve(tmp_path, RankMode.ASSIGNED)
    yield env
    await close(env)


@pytest_asyncio.fixture
async def claimed(tmp_path):
    env = await serve(tmp_path, RankMode.CLAIMED)
    yield env
    await close(env)


async def refused(env, call, code: grpc.StatusCode, *needles: str) -> grpc.aio.AioRpcError:
    before = state_of(env.coordinator)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == code, caught.value.details()
    for needle in needles:
        assert needle in (caught.value.details() or ""), caught.value.details()
    assert state_of(env.coordinator) == before, "a refused call changed the coordinator's state"
    return caught.value


async def token(env, node_id: str = "", any_node: bool = False) -> str:
    request = pb.CreateJoinTokenRequest(job_id=JOB, ttl_s=600, node_id=node_id, any_node=any_node)
    return (await env.admin.CreateJoinToken(request)).token


def join_request(env, node_id: str, join_token: str = "", credential: bytes = b"", key=None):
    key = key or env.node_keys[node_id]
    return nodes_pb2.JoinRequest(
        job_id=JOB,
        node_id=node_id,
        hostname=node_id,
        slots=2,
        slot_kind="cpu",
        join_token=join_token,
        node_credential=credential,
        node_public_key=key.public_raw,
    )


async def join(env, node_id: str):
    reply = await env.nodes[node_id].Join(join_request(env, node_id, await token(env, node_id)))
    env.credentials[node_id] = reply.node_credential
    return reply


def vouch(env, node_id: str, local_rank: int, rank=None, key=None):
    return sign_vouch(
        key or env.node_keys[node_id],
        job_id=JOB,
        node_id=node_id,
        generation=0,
        local_rank=local_rank,
        expires_at=env.clock.now + 60,
        rank=rank,
    )


def register_request(node_id: str, local_rank: int, *, rank=None, vouch=None, worker_id=None):
    message = pb.RegisterRequest(
        job_id=JOB,
        worker_id=worker_id or f"{node_id}/local{local_rank}",
        nonce=secrets.token_bytes(32),
        node_id=node_id,
    )
    if rank is None:
        message.assigned.local_rank = local_rank
    else:
        message.claimed.rank, message.claimed.local_rank = rank, local_rank
    if vouch is not None:
        message.vouch.CopyFrom(vouch)
    return message


# ---- 6. a node takes another node's ranks -----------------------------------------------


async def test_6_assigned_job_refuses_a_claim_into_another_nodes_block(assigned):
    env = assigned
    await join(env, "node-a")
    await join(env, "node-b")
    # a process on node-a, with a vouch node-a's agent really signed, claims rank 3 (node-b's block)
    grab = register_request("node-a", 1, rank=3, vouch=vouch(env, "node-a", 1), worker_id="node-a/thief")
    await refused(
        env,
        env.worker.Register(grab),
        grpc.StatusCode.INVALID_ARGUMENT,
        "mode",
        "assigned",
        "claimed rank 3",
        "resubmit the job with `--mode claimed`",
    )
    # node-b's real worker still gets rank 3: the world is not full
    reply = await env.worker.Register(register_request("node-b", 1, vouch=vouch(env, "node-b", 1)))
    assert reply.attestation.payload and 3 in env.coordinator.state.by_rank
    assert env.coordinator.state.by_rank[3].node_id == "node-b"


async def test_6_claimed_job_vouch_binds_the_claimed_rank(claimed):
    env = claimed
    await join(env, "node-a")
    await join(env, "node-b")
    # node-a's agent vouched for rank 1; the worker claims rank 3 with it
    for wrong, needle in [
        (vouch(env, "node-a", 1, rank=1), "claimed rank 1"),
        (vouch(env, "node-a", 1), "no claimed rank"),  # an assigned-mode vouch names no rank
        (vouch(env, "node-b", 1, rank=3, key=env.node_keys["node-a"]), "node_id"),  # node-a's key, node-b's name
    ]:
        grab = register_request("node-a", 1, rank=3, vouch=wrong, worker_id="node-a/thief")
        await refused(env, env.worker.Register(grab), grpc.StatusCode.PERMISSION_DENIED, needle)
    # an assigned Register in a claimed job is malformed
    await refused(
        env,
        env.worker.Register(register_request("node-a", 0, vouch=vouch(env, "node-a", 0))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "a Register names its rank and local_rank",
    )
    # the vouch that names rank 3 is honoured (the claim is the framework's; the topology policy checks it)
    ok = await env.worker.Register(register_request("node-b", 1, rank=3, vouch=vouch(env, "node-b", 1, rank=3)))
    assert ok.attestation.payload and env.coordinator.state.by_rank[3].node_id == "node-b"


async def test_6_register_batch_checks_every_entry_like_register(claimed):
    env = claimed
    await join(env, "node-a")
    await join(env, "node-b")
    batch = nodes_pb2.RegisterBatchRequest(job_id=JOB, node_id="node-a", node_credential=env.credentials["node-a"])
    batch.requests.append(register_request("node-a", 1, rank=3, worker_id="node-a/novouch"))  # no vouch at all
    batch.requests.append(
        register_request("node-a", 1, rank=3, vouch=vouch(env, "node-a", 1, rank=1), worker_id="node-a/other")
    )
    batch.requests.append(register_request("node-b", 1, rank=3, vouch=vouch(env, "node-b", 1, rank=3)))  # not its node
    before = state_of(env.coordinator)
    reply = await env.nodes["node-a"].RegisterBatch(batch)
    codes = [(r.refusal.code, r.refusal.message) for r in reply.results]
    assert [c for c, _ in codes] == ["PERMISSION_DENIED"] * 3, codes
    assert "no vouch" in codes[0][1] and "set MESHGATE_AGENT_SOCKET" in codes[0][1]
    assert "claimed rank 1" in codes[1][1] and "cannot forward" in codes[2][1]
    assert state_of(env.coordinator) == before
    # an entry with its own proper vouch goes through the batch, with its heartbeat secret
    good = nodes_pb2.RegisterBatchRequest(job_id=JOB, node_id="node-a", node_credential=env.credentials["node-a"])
    good.requests.append(register_request("node-a", 0, rank=0, vouch=vouch(env, "node-a", 0, rank=0)))
    result = (await env.nodes["node-a"].RegisterBatch(good)).results[0]
    assert result.attestation.payload and len(result.heartbeat_secret) == 32


async def test_6_a_batch_signed_once_holds_only_the_entries_that_passed(assigned):
    """one_signature: the answer's batch lists exactly the attested entries, refused ones
    never; each worker verifies the one signature and its own entry, with its own nonce."""
    from meshgate.attestation import TrustBundle, verify_attestation, with_batch
    from meshgate.v1 import attestation_pb2

    env = assigned
    await join(env, "node-a")
    await join(env, "node-b")
    batch = nodes_pb2.RegisterBatchRequest(
        job_id=JOB, node_id="node-a", node_credential=env.credentials["node-a"], one_signature=True
    )
    batch.requests.append(register_request("node-a", 0, vouch=vouch(env, "node-a", 0)))
    batch.requests.append(register_request("node-b", 0, vouch=vouch(env, "node-b", 0)))  # not its node: refused
    batch.requests.append(register_request("node-a", 1, vouch=vouch(env, "node-a", 1)))
    reply = await env.nodes["node-a"].RegisterBatch(batch)
    assert [r.WhichOneof("result") for r in reply.results] == ["attestation", "refusal", "attestation"]
    attested = [r.attestation for r in reply.results if r.HasField("attestation")]
    entries = list(attestation_pb2.AttestationBatch.FromString(reply.batch).entries)
    assert entries == [a.payload for a in attested] and [a.batch_index for a in attested] == [0, 1]
    assert len({a.signature for a in attested}) == 1 and not any(a.batch for a in attested)  # the batch travels once
    bundle = TrustBundle.load(env.coordinator.keys.bundle_path)
    nonces = [batch.requests[0].nonce, batch.requests[2].nonce]
    ranks = [
        verify_attestation(with_batch(a, reply.batch), bundle, job_id=JOB, nonce=n).rank
        for a, n in zip(attested, nonces)
    ]
    assert ranks == [0, 1]


async def test_6_register_batch_in_an_assigned_job_refuses_claims(assigned):
    env = assigned
    await join(env, "node-a")
    await join(env, "node-b")
    batch = nodes_pb2.RegisterBatchRequest(job_id=JOB, node_id="node-a", node_credential=env.credentials["node-a"])
    batch.requests.append(
        register_request("node-a", 1, rank=3, vouch=vouch(env, "node-a", 1), worker_id="node-a/thief")
    )
    before = state_of(env.coordinator)
    reply = await env.nodes["node-a"].RegisterBatch(batch)
    assert reply.results[0].refusal.code == "INVALID_ARGUMENT", reply
    assert state_of(env.coordinator) == before


async def test_6_a_forwarded_vouch_is_held_to_its_binding_and_single_use(assigned):
    """Over its node's agent channel (mTLS certificate naming the node, node credential) a
    vouch's signature is not verified again (SECURITY.md, "Agent vouching"), but everything
    it binds is: a vouch of another node, job, generation or local rank, an expired or
    malformed one, or one another worker spent, is PERMISSION_DENIED, and nothing changes."""
    from meshgate.v1 import attestation_pb2

    env = assigned
    await join(env, "node-a")
    await join(env, "node-b")

    def signed(node_id="node-a", local_rank=0, **changed):
        claims = dict(job_id=JOB, node_id=node_id, generation=0, local_rank=local_rank)
        claims.update(changed)
        expires_at = claims.pop("expires_at", env.clock.now + 60)
        return sign_vouch(env.node_keys[node_id], expires_at=expires_at, **claims)

    garbage = attestation_pb2.WorkerVouch(payload=b"\xff\xff not claims", signature=b"x" * 64)
    wrong = [
        (signed("node-b"), "node_id 'node-b'"),  # node-b's real vouch, forwarded by node-a's agent
        (signed(job_id="other-job"), "job_id 'other-job'"),
        (signed(generation=1), "generation 1"),
        (signed(local_rank=1), "local_rank 1"),
        (signed(expires_at=env.clock.now - 1), "expired"),
        (garbage, "not VouchClaims"),
    ]
    batch = nodes_pb2.RegisterBatchRequest(job_id=JOB, node_id="node-a", node_credential=env.credentials["node-a"])
    for i, (bad, _) in enumerate(wrong):
        batch.requests.append(register_request("node-a", 0, vouch=bad, worker_id=f"node-a/forged{i}"))
    before = state_of(env.coordinator)
    reply = await env.nodes["node-a"].RegisterBatch(batch)
    for result, (_, needle) in zip(reply.results, wrong, strict=True):
        assert result.refusal.code == "PERMISSION_DENIED" and needle in result.refusal.message, result
    assert state_of(env.coordinator) == before

    # node-b's agent cannot forward node-a's worker, even with node-a's real vouch
    theft = nodes_pb2.RegisterBatchRequest(job_id=JOB, node_id="node-b", node_credential=env.credentials["node-b"])
    theft.requests.append(register_request("node-a", 0, vouch=signed()))
    reply = await env.nodes["node-b"].RegisterBatch(theft)
    assert reply.results[0].refusal.code == "PERMISSION_DENIED" and "cannot forward" in reply.results[0].refusal.message
    # nor send node-a's batch on its own connection (its certificate names node-b)
    stolen = nodes_pb2.RegisterBatchRequest(job_id=JOB, node_id="node-a", node_credential=env.credentials["node-a"])
    stolen.requests.append(register_request("node-a", 0, vouch=signed()))
    await refused(env, env.nodes["node-b"].RegisterBatch(stolen), grpc.StatusCode.PERMISSION_DENIED, "node-b")
    assert state_of(env.coordinator) == before

    # a vouch is spent once: the worker it admitted may register again, no one else
    spent = signed()
    good = nodes_pb2.RegisterBatchRequest(job_id=JOB, node_id="node-a", node_credential=env.credentials["node-a"])
    good.requests.append(register_request("node-a", 0, vouch=spent, worker_id="node-a/w0"))
    assert (await env.nodes["node-a"].RegisterBatch(good)).results[0].attestation.payload
    again = nodes_pb2.RegisterBatchRequest(job_id=JOB, node_id="node-a", node_credential=env.credentials["node-a"])
    again.requests.append(register_request("node-a", 0, vouch=spent, worker_id="node-a/w0"))
    again.requests.append(register_request("node-a", 1, vouch=spent, worker_id="node-a/replay"))
    first, replay = (await env.nodes["node-a"].RegisterBatch(again)).results
    assert first.attestation.payload, first  # idempotent: the same worker, the same rank
    assert replay.refusal.code == "PERMISSION_DENIED", replay
    assert "local_rank 0" in replay.refusal.message  # bound to local rank 0 before it is even single use
    replay_same_rank = nodes_pb2.RegisterBatchRequest(
        job_id=JOB, node_id="node-a", node_credential=env.credentials["node-a"]
    )
    replay_same_rank.requests.append(register_request("node-a", 0, vouch=spent, worker_id="node-a/replay"))
    before = state_of(env.coordinator)
    result = (await env.nodes["node-a"].RegisterBatch(replay_same_rank)).results[0]
    assert (
        result.refusal.code == "PERMISSION_DENIED" and "already used by worker_id 'node-a/w0'" in result.refusal.message
    )
    assert state_of(env.coordinator) == before


async def test_6_outside_its_agents_batch_a_vouch_signature_is_verified(assigned):
    """A direct Register (any worker certificate) and a batch the coordinator cannot tie to
    the node's agent certificate (no mTLS policy: agent_channel false) verify every vouch's
    signature: a vouch with node-a's binding but another key is refused."""
    from meshgate.coordinator.service import register_input

    env = assigned
    await join(env, "node-a")
    impostor = vouch(env, "node-a", 0, key=SigningKey.generate())
    await refused(
        env,
        env.worker.Register(register_request("node-a", 0, vouch=impostor)),
        grpc.StatusCode.PERMISSION_DENIED,
        "does not verify under node 'node-a'",
    )
    before = state_of(env.coordinator)
    answer = await env.coordinator.register_batch(
        JOB, "node-a", env.credentials["node-a"], [register_input(register_request("node-a", 0, vouch=impostor))]
    )
    assert "does not verify" in answer.results[0].message
    assert state_of(env.coordinator) == before


# ---- 7. a stolen, unused join token takes over an active node ------------------------------


async def test_7_a_token_never_replaces_a_nodes_credential(assigned):
    env = assigned
    await join(env, "node-a")
    bound = await token(env, "node-a")  # unused, and even bound to node-a
    anyone = await token(env, any_node=True)
    attacker_key = SigningKey.generate()
    for stolen in (bound, anyone):
        await refused(
            env,
            env.nodes["node-a"].Join(join_request(env, "node-a", stolen, key=attacker_key)),
            grpc.StatusCode.PERMISSION_DENIED,
            "already holds a node credential",
        )
    # the real agent still rejoins with its credential; its key is its own
    await env.nodes["node-a"].Join(join_request(env, "node-a", credential=env.credentials["node-a"]))
    assert env.coordinator.state.nodes["node-a"].public_key == env.node_keys["node-a"].public_raw
    # and the stolen tokens were not spent: node-b can still use the any-node one
    await env.nodes["node-b"].Join(join_request(env, "node-b", anyone))


async def test_7_tokens_are_bound_to_a_node_unless_any_node_is_asked_for(assigned):
    env = assigned
    await refused(
        env,
        env.admin.CreateJoinToken(pb.CreateJoinTokenRequest(job_id=JOB)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "node_id must name the node",
    )
    await refused(
        env,
        env.admin.CreateJoinToken(pb.CreateJoinTokenRequest(job_id=JOB, node_id="node-a", any_node=True)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "exclude each other",
    )


def agent_process(tmp: Path, address: str, node_id: str, ca, **extra) -> subprocess.Popen:
    table = {
        "coordinator": address,
        "job": JOB,
        "node_id": node_id,
        "slots": 2,
        "state_dir": str(tmp / f"{node_id}-state"),
        "machine_id_file": simulated_machine_id(tmp, node_id),
        "drain_grace_s": 2,
        "ca_file": str(ca.ca),
        "cert_file": str(ca.agent(node_id).cert),
        "key_file": str(ca.agent(node_id).key),
    }
    table.update(extra)
    config = write_config(tmp / f"{node_id}.toml", {"agent": table})
    env = worker_env()
    env.pop("MESHGATE_INSECURE", None)
    return subprocess.Popen(
        [sys.executable, "-m", "meshgate.agent", "--config", str(config)],
        cwd=REPO,
        env=env,
        stdout=open(tmp / f"{node_id}.log", "ab"),
        stderr=subprocess.STDOUT,
    )


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_7_stolen_token_cannot_take_over_a_running_agents_node(tmp_path):
    """A real coordinator process and a real agent for node-a. An attacker holding an
    unused any-node token tries to Join as node-a, with node-c's agent certificate and
    with node-a's own: both refused; the real agent keeps heartbeating, its state as it was."""
    from meshgate.admin import create_join_token

    def get_status(address, job_id, tls):
        with secure_channel(address, tls) as channel:
            return rendezvous_pb2_grpc.AdminStub(channel).GetStatus(pb.GetStatusRequest(job_id=job_id), timeout=10)

    ca = init_dev_ca(tmp_path / "ca", agent_names=NODES)
    coordinator = start_coordinator(
        tmp_path / "coordinator",
        PLAN,
        JOB,
        2,
        job={"heartbeat_interval_s": 0.3},
        server={
            "insecure": False,
            "ca_file": str(ca.ca),
            "cert_file": str(ca.server.cert),
            "key_file": str(ca.server.key),
        },
    )
    admin = ca.client_tls(ca.admin)
    agent = None
    try:
        node_token = create_join_token(coordinator.address, JOB, node_id="node-a", tls=admin).token
        agent = agent_process(tmp_path, coordinator.address, "node-a", ca, join_token=node_token)
        wait_until(lambda: "joined job" in (tmp_path / "node-a.log").read_text(), 30, "node-a joins")
        stolen = create_join_token(coordinator.address, JOB, any_node=True, tls=admin).token

        def snapshot():
            status = get_status(coordinator.address, JOB, tls=admin)
            return [(n.node_id, n.node_rank, n.state) for n in status.nodes], status.generation

        before = snapshot()
        attempts = []
        for cert_of in ("node-c", "node-a"):
            with secure_channel(coordinator.address, ca.client_tls(ca.agent(cert_of))) as channel:
                with pytest.raises(grpc.RpcError) as caught:
                    nodes_pb2_grpc.NodesStub(channel).Join(
                        nodes_pb2.JoinRequest(
                            job_id=JOB,
                            node_id="node-a",
                            hostname="evil",
                            slots=2,
                            slot_kind="cpu",
                            join_token=stolen,
                            node_public_key=SigningKey.generate().public_raw,
                        ),
                        timeout=10,
                    )
                attempts.append((caught.value.code(), caught.value.details()))
        assert (
            attempts[0][0] == grpc.StatusCode.PERMISSION_DENIED and "does not name node_id 'node-a'" in attempts[0][1]
        )
        assert (
            attempts[1][0] == grpc.StatusCode.PERMISSION_DENIED and "already holds a node credential" in attempts[1][1]
        )
        assert snapshot() == before
        # the real agent is not locked out: its heartbeats keep landing after the attack
        seen = get_status(coordinator.address, JOB, tls=admin).nodes[0].last_seen.ToNanoseconds()
        wait_until(
            lambda: get_status(coordinator.address, JOB, tls=admin).nodes[0].last_seen.ToNanoseconds() > seen,
            10,
            "node-a's next heartbeat",
        )
        assert agent.poll() is None and "heartbeat failed" not in (tmp_path / "node-a.log").read_text()
        log = coordinator.log()
        assert "Join refused: PERMISSION_DENIED" in log and "already holds a node credential" in log  # audit lines
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=30)
        coordinator.stop()


# ---- 8, 9. TLS without client certificates; the static join token under TLS ---------------


def tls_server(ca, **extra) -> dict:
    table = {
        "listen": "127.0.0.1:0",
        "ca_file": str(ca.ca),
        "cert_file": str(ca.server.cert),
        "key_file": str(ca.server.key),
    }
    table.update(extra)
    return table


def config_document(ca, tmp_path, server: dict, job: dict | None = None) -> dict:
    return {
        "job": {"id": JOB, "slots_per_node": 2, **(job or {})},
        "plan": PLAN.to_dict(),
        "server": server,
        "keys": {"dir": str(tmp_path / "keys")},
    }


def run_coordinator(tmp_path: Path, document: dict) -> subprocess.CompletedProcess:
    config = write_config(tmp_path / "refused.toml", document)
    return subprocess.run(
        [sys.executable, "-m", "meshgate.coordinator", "--config", str(config)],
        cwd=REPO,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def one_line_refusal(done: subprocess.CompletedProcess, *needles: str) -> str:
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_8_tls_without_client_certificates_needs_insecure_true(tmp_path):
    ca = init_dev_ca(tmp_path / "ca")
    document = config_document(ca, tmp_path, tls_server(ca, require_client_cert=False))
    with pytest.raises(ConfigError, match="require_client_cert = false"):
        CoordinatorConfig.from_mapping(document)
    one_line_refusal(run_coordinator(tmp_path, document), "require_client_cert = false", "insecure = true")
    # said out loud, it runs and warns
    loud = config_document(ca, tmp_path, tls_server(ca, require_client_cert=False, insecure=True))
    config = CoordinatorConfig.from_mapping(loud)
    assert config.tls is not None and not config.tls.require_client_cert


def test_8_said_insecure_tls_without_client_certs_logs_a_loud_warning(tmp_path):
    ca = init_dev_ca(tmp_path / "ca")
    running = start_coordinator(
        tmp_path / "coordinator",
        PLAN,
        JOB,
        2,
        server={
            "insecure": True,
            "ca_file": str(ca.ca),
            "cert_file": str(ca.server.cert),
            "key_file": str(ca.server.key),
            "require_client_cert": False,
        },
    )
    try:
        assert "INSECURE" in running.log() and "WITHOUT client certificates" in running.log()
    finally:
        running.stop()


async def test_8_mtls_refuses_an_anonymous_tls_client(assigned):
    """Under mTLS (the only TLS mode that starts without insecure = true) a client with
    no certificate never reaches a servicer."""
    env = assigned
    anonymous = secure_channel(env.address, env.ca.client_tls(None), aio=True)
    env.channels.append(anonymous)
    for call in (
        rendezvous_pb2_grpc.AdminStub(anonymous).GetStatus(pb.GetStatusRequest(job_id=JOB), timeout=5),
        rendezvous_pb2_grpc.AdminStub(anonymous).CreateJoinToken(
            pb.CreateJoinTokenRequest(job_id=JOB, any_node=True), timeout=5
        ),
        rendezvous_pb2_grpc.AdminStub(anonymous).RotateKey(pb.RotateKeyRequest(job_id=JOB), timeout=5),
        nodes_pb2_grpc.NodesStub(anonymous).Join(join_request(env, "node-a", "x"), timeout=5),
    ):
        await refused(env, call, grpc.StatusCode.UNAVAILABLE)


def test_9_static_join_token_is_refused_whenever_tls_is_on(tmp_path):
    ca = init_dev_ca(tmp_path / "ca")
    for server in (tls_server(ca), tls_server(ca, require_client_cert=False, insecure=True)):
        document = config_document(ca, tmp_path, server, job={"join_token": "static-dev-token"})
        with pytest.raises(ConfigError, match=r"\[job\] join_token"):
            CoordinatorConfig.from_mapping(document)
    line = one_line_refusal(run_coordinator(tmp_path, document), "[job] join_token")
    assert "static-dev-token" not in line
    # plaintext development setups keep it
    plain = config_document(ca, tmp_path, {"insecure": True}, job={"join_token": "static-dev-token"})
    assert CoordinatorConfig.from_mapping(plain).rendezvous.join_token == "static-dev-token"


# ---- 10. someone else keeps a dead node alive ------------------------------------------------


async def test_10_heartbeats_are_bound_to_the_worker(assigned):
    env = assigned
    await join(env, "node-a")
    await join(env, "node-b")
    await join(env, "node-c")  # a hot spare
    secrets_by_worker = {}
    for node in ("node-a", "node-b"):
        for local in (0, 1):
            reply = await env.worker.Register(register_request(node, local, vouch=vouch(env, node, local)))
            secrets_by_worker[f"{node}/local{local}"] = reply.heartbeat_secret
    # the attacker (one of the job's workers, node-a/local0) reads node-b's worker ids from AwaitWorld
    world = await env.worker.AwaitWorld(
        pb.AwaitWorldRequest(
            job_id=JOB,
            generation=0,
            include_members=True,
            worker_id="node-a/local0",
            heartbeat_secret=secrets_by_worker["node-a/local0"],
        )
    )
    victims = [m.worker_id for m in world.members if m.node_id == "node-b"]
    assert victims == ["node-b/local0", "node-b/local1"]
    # node-b dies; the attacker's fake heartbeats are refused and touch nothing
    env.clock.now += 4
    for victim in victims:
        beat = pb.HeartbeatRequest(job_id=JOB, worker_id=victim, generation=0)
        await refused(env, env.worker.Heartbeat(beat), grpc.StatusCode.UNAUTHENTICATED, "heartbeat_secret missing")
        beat.heartbeat_secret = secrets_by_worker["node-a/local0"]  # another worker's secret
        await refused(env, env.worker.Heartbeat(beat), grpc.StatusCode.PERMISSION_DENIED, "does not belong")
        beat.heartbeat_secret = secrets.token_bytes(32)
        await refused(env, env.worker.Heartbeat(beat), grpc.StatusCode.PERMISSION_DENIED, "does not belong")
    # node-a's own worker and agent stay alive
    await env.worker.Heartbeat(
        pb.HeartbeatRequest(
            job_id=JOB, worker_id="node-a/local0", generation=0, heartbeat_secret=secrets_by_worker["node-a/local0"]
        )
    )
    for node in ("node-a", "node-c"):
        await env.nodes[node].NodeHeartbeat(
            nodes_pb2.NodeHeartbeatRequest(job_id=JOB, node_id=node, node_credential=env.credentials[node])
        )
    env.clock.now += 4  # node-b silent for 8 s > 6 s
    await env.coordinator.sweep_lost()
    state = env.coordinator.state
    assert state.nodes["node-b"].state is NodeState.REPLACED and state.nodes["node-c"].node_rank == 1
    assert state.generation == 1


# ---- 11. the smaller ones --------------------------------------------------------------------


async def test_11_an_agent_certificate_joins_only_as_its_own_node(assigned):
    env = assigned
    node_b_token = await token(env, "node-b")
    await refused(
        env,
        env.nodes["node-c"].Join(join_request(env, "node-b", node_b_token)),
        grpc.StatusCode.PERMISSION_DENIED,
        "'node-c' does not name node_id 'node-b'",
    )
    # every Nodes call is bound the same way, not only Join
    await join(env, "node-b")
    await refused(
        env,
        env.nodes["node-c"].NodeHeartbeat(
            nodes_pb2.NodeHeartbeatRequest(job_id=JOB, node_id="node-b", node_credential=env.credentials["node-b"])
        ),
        grpc.StatusCode.PERMISSION_DENIED,
        "does not name node_id 'node-b'",
    )


def test_11_dev_agent_certificates_name_their_node_in_a_san_uri(tmp_path):
    from cryptography import x509

    ca = init_dev_ca(tmp_path / "ca", agent_names=("node-a",))
    cert = x509.load_pem_x509_certificate(ca.agent("node-a").cert.read_bytes())
    uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.UniformResourceIdentifier
    )
    assert uris == ["spiffe://meshgate/node/node-a"]

    class Context:
        def auth_context(self):
            return {"transport_security_type": [b"ssl"], "x509_pem_cert": [ca.agent("node-a").cert.read_bytes()]}

    identity = peer_identity(Context())
    assert identity.names_node("node-a") and not identity.names_node("node-b")
    assert identity.uri_nodes == ("node-a",)


@pytest.mark.parametrize("what", ["node.credential", "node-key.pem", "join_token_file"])
def test_11_agent_refuses_a_too_open_secret_file_in_one_line(tmp_path, what):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    SigningKey.generate().save(state / "node-key.pem")
    token_file = tmp_path / "join.token"
    token_file.write_text("tok\n")
    token_file.chmod(0o600)
    target = {
        "node.credential": state / "node.credential",
        "node-key.pem": state / "node-key.pem",
        "join_token_file": token_file,
    }[what]
    if what == "node.credential":
        target.write_bytes(b"c" * 32)
    target.chmod(0o644)
    config = write_config(
        tmp_path / "agent.toml",
        {
            "agent": {
                "coordinator": "127.0.0.1:1",
                "job": JOB,
                "node_id": "node-a",
                "slots": 2,
                "insecure": True,
                "state_dir": str(state),
                "join_token_file": str(token_file),
                "join_timeout_s": 1,
            }
        },
    )
    done = subprocess.run(
        [sys.executable, "-m", "meshgate.agent", "--config", str(config)],
        cwd=REPO,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(errors) == 1 and str(target) in errors[0] and "mode 0644" in errors[0], done.stderr


def test_11_coordinator_refuses_a_too_open_admin_token_file_in_one_line(tmp_path):
    token_file = tmp_path / "admin.token"
    token_file.write_text("admin-secret\n")
    token_file.chmod(0o644)
    document = {
        "job": {"id": JOB, "slots_per_node": 2},
        "plan": PLAN.to_dict(),
        "server": {"insecure": True, "admin_token_file": str(token_file)},
        "keys": {"dir": str(tmp_path / "keys")},
    }
    line = one_line_refusal(run_coordinator(tmp_path, document), str(token_file), "mode 0644", "admin_token_file")
    assert "admin-secret" not in line


async def test_11_vouch_socket_answers_an_over_long_request(tmp_path):
    minted = []

    def mint(local_rank, rank=None):
        minted.append((local_rank, rank))
        return b"v"

    server = VouchSocket(tmp_path / "vouch.sock", mint, lambda: LocalNode("node-a", JOB, 0))
    await server.start()
    try:

        async def ask(line: bytes) -> dict:
            reader, writer = await asyncio.open_unix_connection(str(tmp_path / "vouch.sock"))
            writer.write(line)
            await writer.drain()
            answer = await asyncio.wait_for(reader.readline(), timeout=10)
            writer.close()
            return json.loads(answer)

        for line in (b"x" * (70 * 1024) + b"\n", b'{"local_rank": 0, "pad": "' + b"y" * MAX_REQUEST_BYTES + b'"}\n'):
            answer = await ask(line)
            assert "longer than" in answer["error"], answer
        assert minted == []
        assert "vouch" in await ask(b'{"local_rank": 1, "rank": 7}\n') and minted == [(1, 7)]
    finally:
        server.close()


async def test_11_errors_echo_a_bounded_prefix_of_the_input(assigned):
    env = assigned
    huge = "j" * 10_000
    calls = [
        env.worker.Register(
            pb.RegisterRequest(
                job_id=huge, worker_id="w", nonce=b"n" * 32, node_id="node-a", assigned=pb.AssignedRank(local_rank=0)
            )
        ),
        env.worker.AwaitWorld(pb.AwaitWorldRequest(job_id=huge, generation=0, timeout_ms=10)),
        env.worker.Heartbeat(pb.HeartbeatRequest(job_id=huge, worker_id="w", generation=0)),
        env.admin.CreateJoinToken(pb.CreateJoinTokenRequest(job_id=huge, node_id="node-a")),
        env.nodes["node-a"].Join(
            nodes_pb2.JoinRequest(job_id=huge, node_id="node-a", slots=2, slot_kind="cpu", join_token="t")
        ),
        env.nodes["node-a"].Join(
            nodes_pb2.JoinRequest(
                job_id=JOB, node_id="node-a", slots=2, slot_kind="k" * 10_000, join_token=await token(env, "node-a")
            )
        ),
    ]
    for call in calls:
        error = await refused(env, call, grpc.StatusCode.INVALID_ARGUMENT)
        assert len(error.details()) < 300, len(error.details())


def test_11_the_signed_trust_bundle_is_cached_until_the_key_set_changes(tmp_path):
    keys = KeyRing(tmp_path / "keys", job_id=JOB)
    for _ in range(20):
        keys.rotate(retire_after_s=3600)
    first = keys.signed_bundle()
    assert len(first.endorsements) == 21
    assert keys.signed_bundle() is first  # not signed again
    keys.rotate(retire_after_s=3600)
    fresh = keys.signed_bundle()
    assert fresh is not first and len(fresh.endorsements) == 22
    # a key that retires changes the set too
    later = keys.signed_bundle(now=time.time() + 7200)
    assert len(later.endorsements) == 1


async def test_11_an_undecodable_request_logs_one_line(assigned, caplog):
    env = assigned
    channel = secure_channel(env.address, env.ca.client_tls(env.ca.worker), aio=True)
    env.channels.append(channel)
    raw = channel.unary_unary(
        "/meshgate.v1.Rendezvous/Register", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    before = state_of(env.coordinator)
    with caplog.at_level(logging.INFO, logger="grpc._cython.cygrpc"):
        with pytest.raises(grpc.aio.AioRpcError):
            await raw(b"\xff\xff\xff\xff not protobuf")
    records = [r for r in caplog.records if r.name == "grpc._cython.cygrpc"]
    assert len(records) == 1 and records[0].exc_info is None and records[0].levelname == "WARNING"
    assert "undecodable request" in records[0].getMessage() and "Traceback" not in caplog.text
    assert state_of(env.coordinator) == before
