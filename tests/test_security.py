"""Attacks on a real coordinator over mTLS on loopback. Each is refused with its
documented status, and the coordinator's state is unchanged afterwards."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import time

import grpc
import pytest
import pytest_asyncio

from meshgate.agent.vouch_socket import LocalNode, VouchSocket
from meshgate.coordinator.engine import Coordinator
from meshgate.coordinator.keys import KeyRing
from meshgate.coordinator.rendezvous import RankMode, RendezvousConfig
from meshgate.coordinator.service import AccessPolicy, build_server, mark_serving
from meshgate.coordinator.store import MemoryStore
from meshgate.attestation import (
    BadSignature,
    Expired,
    SigningKey,
    TrustBundle,
    WrongNonce,
    accept_trust_bundle,
    sign_vouch,
    verify_attestation,
)
from meshgate.plan import ParallelPlan
from meshgate.tls import init_dev_ca, secure_channel, server_credentials
from meshgate.v1 import attestation_pb2, nodes_pb2, nodes_pb2_grpc
from meshgate.v1 import rendezvous_pb2 as pb
from meshgate.v1 import rendezvous_pb2_grpc

PLAN = ParallelPlan(tp=2, dp_shard=2)
JOB = "secure-job"
TTL_S = 3.0  # attestations (and so retired keys) expire quickly here


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest_asyncio.fixture
async def secure(tmp_path):
    ca = init_dev_ca(tmp_path / "ca", agent_names=("node-a", "node-b"))
    other_ca = init_dev_ca(tmp_path / "other-ca")
    clock = Clock()
    keys = KeyRing(tmp_path / "keys", job_id=JOB)
    config = RendezvousConfig(job_id=JOB, plan=PLAN, slots_per_node=2, require_vouch=True, mode=RankMode.ASSIGNED)
    coordinator = Coordinator(config, MemoryStore(), keys, attestation_ttl_s=TTL_S, clock=clock)
    server, health = build_server(coordinator, policy=AccessPolicy(secure=True))
    port = server.add_secure_port("127.0.0.1:0", server_credentials(ca.server_tls(require_client_cert=True)))
    await server.start()
    await mark_serving(health)
    address = f"127.0.0.1:{port}"
    channels = []

    def channel(pair=None, tls=None):
        made = secure_channel(address, tls or ca.client_tls(pair), aio=True)
        channels.append(made)
        return made

    class Env:
        pass

    env = Env()
    env.ca, env.other_ca, env.clock, env.keys, env.address = ca, other_ca, clock, keys, address
    env.coordinator, env.channel = coordinator, channel
    env.admin = rendezvous_pb2_grpc.AdminStub(channel(ca.admin))
    env.nodes = {n: nodes_pb2_grpc.NodesStub(channel(ca.agent(n))) for n in ("node-a", "node-b")}
    env.worker = rendezvous_pb2_grpc.RendezvousStub(channel(ca.worker))
    yield env
    for made in channels:
        await made.close()
    await server.stop(None)


async def status(env) -> pb.Status:
    return await env.admin.GetStatus(pb.GetStatusRequest(job_id=JOB))


async def refused(env, call, code: grpc.StatusCode, *needles: str):
    before = await status(env)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == code, caught.value.details()
    for needle in needles:
        assert needle in (caught.value.details() or ""), caught.value.details()
    assert await status(env) == before, "a refused call changed the coordinator's state"
    return caught.value


async def token(env, node_id: str = "", ttl_s: int = 600) -> str:
    reply = await env.admin.CreateJoinToken(
        pb.CreateJoinTokenRequest(job_id=JOB, ttl_s=ttl_s, node_id=node_id, any_node=not node_id)
    )
    return reply.token


async def join(env, node_id: str, key: SigningKey, join_token: str = "", credential: bytes = b""):
    return await env.nodes[node_id].Join(
        nodes_pb2.JoinRequest(
            job_id=JOB,
            node_id=node_id,
            hostname=node_id,
            slots=2,
            slot_kind="cpu",
            join_token=join_token,
            node_credential=credential,
            node_public_key=key.public_raw,
        )
    )


def register_request(node_id: str, local_rank: int, vouch=None) -> pb.RegisterRequest:
    message = pb.RegisterRequest(
        job_id=JOB, worker_id=f"{node_id}/local{local_rank}", nonce=secrets.token_bytes(32), node_id=node_id
    )
    message.assigned.local_rank = local_rank
    if vouch is not None:
        message.vouch.CopyFrom(vouch)
    return message


def vouch(env, key: SigningKey, node_id: str, local_rank: int, **overrides):
    fields = dict(job_id=JOB, node_id=node_id, generation=0, local_rank=local_rank, expires_at=env.clock.now + 60)
    fields.update(overrides)
    return sign_vouch(key, **fields)


async def test_plaintext_and_foreign_ca_clients_are_refused(secure):
    before = await status(secure)
    plaintext = grpc.aio.insecure_channel(secure.address)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await rendezvous_pb2_grpc.RendezvousStub(plaintext).Register(register_request("node-a", 0), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    await plaintext.close()
    foreign = secure.channel(tls=secure.other_ca.client_tls(secure.other_ca.admin, server_name=None))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await rendezvous_pb2_grpc.AdminStub(foreign).GetStatus(pb.GetStatusRequest(job_id=JOB), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    # a client that trusts our CA but presents another CA's certificate
    mixed = secure.channel(
        tls=type(secure.ca.client_tls())(secure.ca.ca, secure.other_ca.admin.cert, secure.other_ca.admin.key)
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await rendezvous_pb2_grpc.AdminStub(mixed).GetStatus(pb.GetStatusRequest(job_id=JOB), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert await status(secure) == before


async def test_join_tokens_are_single_use_expiring_and_node_bound(secure):
    key_a, key_b = SigningKey.generate(), SigningKey.generate()
    first = await token(secure)
    joined = await join(secure, "node-a", key_a, join_token=first)
    assert joined.node_credential and joined.node_rank == 0
    # reused: refused, nothing changes
    await refused(
        secure, join(secure, "node-b", key_b, join_token=first), grpc.StatusCode.UNAUTHENTICATED, "already used"
    )
    # unknown
    await refused(
        secure, join(secure, "node-b", key_b, join_token="made-up"), grpc.StatusCode.UNAUTHENTICATED, "not known"
    )
    # bound to another node
    bound = await token(secure, node_id="node-a")
    await refused(
        secure, join(secure, "node-b", key_b, join_token=bound), grpc.StatusCode.UNAUTHENTICATED, "admits node 'node-a'"
    )
    # expired
    short = await token(secure, ttl_s=1)
    secure.clock.now += 2
    await refused(secure, join(secure, "node-b", key_b, join_token=short), grpc.StatusCode.UNAUTHENTICATED, "expired")
    # only hashes are kept
    assert first not in repr(secure.coordinator.state.tokens)
    # a node rejoins with its credential, not a token; a wrong credential is refused
    again = await join(secure, "node-a", key_a, credential=joined.node_credential)
    assert again.node_rank == 0 and not again.node_credential
    await refused(
        secure, join(secure, "node-a", key_a, credential=b"x" * 32), grpc.StatusCode.UNAUTHENTICATED, "node_credential"
    )


async def test_no_node_acts_for_another(secure):
    key_a, key_b = SigningKey.generate(), SigningKey.generate()
    a = await join(secure, "node-a", key_a, join_token=await token(secure))
    b = await join(secure, "node-b", key_b, join_token=await token(secure))
    beat = nodes_pb2.NodeHeartbeatRequest(job_id=JOB, node_id="node-b", node_credential=a.node_credential)
    await refused(secure, secure.nodes["node-a"].NodeHeartbeat(beat), grpc.StatusCode.PERMISSION_DENIED, "node-b")
    leave = nodes_pb2.LeaveRequest(job_id=JOB, node_id="node-b", node_credential=a.node_credential)
    await refused(secure, secure.nodes["node-a"].Leave(leave), grpc.StatusCode.PERMISSION_DENIED)
    missing = nodes_pb2.NodeHeartbeatRequest(job_id=JOB, node_id="node-b")
    await refused(secure, secure.nodes["node-b"].NodeHeartbeat(missing), grpc.StatusCode.UNAUTHENTICATED)
    ok = nodes_pb2.NodeHeartbeatRequest(job_id=JOB, node_id="node-b", node_credential=b.node_credential)
    assert (await secure.nodes["node-b"].NodeHeartbeat(ok)).node_state == pb.NODE_STATE_ACTIVE
    # a worker certificate cannot call the Nodes service at all
    worker_nodes = nodes_pb2_grpc.NodesStub(secure.channel(secure.ca.worker))
    await refused(secure, worker_nodes.NodeHeartbeat(ok), grpc.StatusCode.PERMISSION_DENIED, "role agent")


async def test_register_needs_its_own_nodes_vouch(secure):
    key_a, key_b = SigningKey.generate(), SigningKey.generate()
    await join(secure, "node-a", key_a, join_token=await token(secure))
    await join(secure, "node-b", key_b, join_token=await token(secure))
    await refused(
        secure, secure.worker.Register(register_request("node-a", 0)), grpc.StatusCode.PERMISSION_DENIED, "no vouch"
    )
    # node-b's agent vouching for a worker that claims to be on node-a
    stolen = vouch(secure, key_b, "node-a", 0)
    await refused(
        secure,
        secure.worker.Register(register_request("node-a", 0, stolen)),
        grpc.StatusCode.PERMISSION_DENIED,
        "signature",
    )
    for wrong, needle in [
        (vouch(secure, key_a, "node-a", 0, job_id="other-job"), "job_id"),
        (vouch(secure, key_a, "node-a", 0, generation=7), "generation"),
        (vouch(secure, key_a, "node-a", 1), "local_rank"),
        (vouch(secure, key_a, "node-a", 0, expires_at=secure.clock.now - 1), "expired"),
    ]:
        await refused(
            secure,
            secure.worker.Register(register_request("node-a", 0, wrong)),
            grpc.StatusCode.PERMISSION_DENIED,
            needle,
        )
    good = vouch(secure, key_a, "node-a", 0)
    reply = await secure.worker.Register(register_request("node-a", 0, good))
    assert reply.attestation.payload
    # the same vouch spent by another identity is refused
    replay = register_request("node-a", 0, good)
    replay.worker_id = "impostor"
    await refused(secure, secure.worker.Register(replay), grpc.StatusCode.PERMISSION_DENIED, "already used")


async def test_replayed_and_rotated_out_attestations_fail(secure):
    key_a = SigningKey.generate()
    await join(secure, "node-a", key_a, join_token=await token(secure))
    bundle = TrustBundle.load(secure.keys.bundle_path)
    message = register_request("node-a", 0, vouch(secure, key_a, "node-a", 0))
    reply = await secure.worker.Register(message)
    verify_attestation(reply.attestation, bundle, job_id=JOB, nonce=message.nonce, now=secure.clock.now)
    with pytest.raises(WrongNonce):  # someone else's attestation, replayed with another nonce
        verify_attestation(reply.attestation, bundle, job_id=JOB, nonce=secrets.token_bytes(32), now=secure.clock.now)

    # rotate: the new bundle is endorsed by the old key, so holders accept it
    signed = await secure.admin.RotateKey(pb.RotateKeyRequest(job_id=JOB))
    rotated = accept_trust_bundle(signed, bundle, now=secure.clock.now)
    assert len(rotated.keys) == 2 and rotated.version == bundle.version + 1
    # the old attestation still verifies until its expiry...
    verify_attestation(reply.attestation, rotated, job_id=JOB, nonce=message.nonce, now=secure.clock.now + 1)
    # ...and not after it: the old key is retired with it
    with pytest.raises(Expired):
        verify_attestation(
            reply.attestation, rotated, job_id=JOB, nonce=message.nonce, now=secure.clock.now + TTL_S + 1
        )
    fresh = register_request("node-a", 1, vouch(secure, key_a, "node-a", 1))
    new_reply = await secure.worker.Register(fresh)
    assert new_reply.attestation.key_id != reply.attestation.key_id

    # a tampered bundle (an attacker's key slipped in) is refused
    tampered = attestation_pb2.SignedTrustBundle()
    tampered.CopyFrom(signed)
    payload = attestation_pb2.TrustBundle.FromString(tampered.payload)
    payload.keys.add(key_id="ed25519:attacker", ed25519=SigningKey.generate().public_raw)
    tampered.payload = payload.SerializeToString()
    with pytest.raises(BadSignature):
        accept_trust_bundle(tampered, bundle, now=secure.clock.now)


async def test_admin_calls_need_an_admin_credential(secure):
    as_worker = rendezvous_pb2_grpc.AdminStub(secure.channel(secure.ca.worker))
    await refused(
        secure,
        as_worker.CreateJoinToken(pb.CreateJoinTokenRequest(job_id=JOB)),
        grpc.StatusCode.PERMISSION_DENIED,
        "role admin",
    )
    await refused(secure, as_worker.RotateKey(pb.RotateKeyRequest(job_id=JOB)), grpc.StatusCode.PERMISSION_DENIED)
    await refused(secure, as_worker.GetStatus(pb.GetStatusRequest(job_id=JOB)), grpc.StatusCode.PERMISSION_DENIED)
    as_agent = rendezvous_pb2_grpc.AdminStub(secure.channel(secure.ca.agent("node-a")))
    await refused(
        secure, as_agent.CreateJoinToken(pb.CreateJoinTokenRequest(job_id=JOB)), grpc.StatusCode.PERMISSION_DENIED
    )


def test_admin_without_any_credential_is_unauthenticated():
    policy = AccessPolicy(secure=True)

    class NoCertContext:
        def invocation_metadata(self):
            return ()

        def auth_context(self):
            return {}

    from meshgate.coordinator.rendezvous import Code, RendezvousError

    with pytest.raises(RendezvousError) as caught:
        policy.require_admin(NoCertContext())
    assert caught.value.code == Code.UNAUTHENTICATED


@pytest.mark.skipif(os.geteuid() != 0, reason="changing uid needs root")
async def test_vouch_socket_refuses_another_uid():
    import shutil
    import subprocess
    import sys
    import tempfile

    key = SigningKey.generate()
    directory = tempfile.mkdtemp(prefix="meshgate-vouch-", dir="/tmp")  # reachable by any uid
    os.chmod(directory, 0o755)
    path = os.path.join(directory, "vouch.sock")
    minted = []

    def mint(local_rank: int, rank=None) -> bytes:
        minted.append(local_rank)
        return sign_vouch(
            key, job_id=JOB, node_id="n", generation=0, local_rank=local_rank, expires_at=time.time() + 60
        ).SerializeToString()

    server = VouchSocket(path, mint, lambda: LocalNode("n", JOB, 0))  # allows this process's uid (root) only
    await server.start()
    os.chmod(path, 0o666)  # let the stranger reach the socket: SO_PEERCRED must stop it
    asker = (
        "import socket,sys;s=socket.socket(socket.AF_UNIX);s.settimeout(10);s.connect(sys.argv[1]);"
        "s.sendall(b'{\"local_rank\": 1}\\n');sys.stdout.write(s.makefile('rb').readline().decode())"
    )

    def ask(as_uid):
        extra = {"user": as_uid, "group": as_uid} if as_uid is not None else {}
        python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable  # readable by any uid
        done = subprocess.run([python, "-c", asker, path], capture_output=True, text=True, timeout=30, **extra)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout or "{}")

    try:
        stranger = await asyncio.to_thread(ask, 65534)
        assert "uid 65534 is not allowed" in stranger.get("error", ""), stranger
        assert "add 65534 to [agent] vouch_socket_uids" in stranger["error"]
        assert minted == []
        same_user = await asyncio.to_thread(ask, None)
        assert "vouch" in same_user and minted == [1]
    finally:
        server.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_worker_without_tls_settings_refuses_to_connect(tmp_path, monkeypatch):
    """No MESHGATE_TLS_CA and no MESHGATE_INSECURE=1: register() refuses before any
    byte leaves the worker (a listener counts the connections: none)."""
    from meshgate.client import ClientConfigError, register

    bundle = KeyRing(tmp_path / "keys", job_id="j").write_bundle()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    for name in (
        "MESHGATE_TLS_CA",
        "MESHGATE_TLS_CERT",
        "MESHGATE_TLS_KEY",
        "MESHGATE_INSECURE",
        "MESHGATE_VOUCH",
        "MESHGATE_AGENT_SOCKET",
    ):
        monkeypatch.delenv(name, raising=False)
    try:
        with pytest.raises(ClientConfigError, match="MESHGATE_TLS_CA.*MESHGATE_INSECURE=1"):
            register(
                coordinator=f"127.0.0.1:{listener.getsockname()[1]}",
                job_id="j",
                trust_bundle=str(bundle),
                node_id="n0",
                local_rank=0,
                timeout=2,
            )
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    finally:
        listener.close()
