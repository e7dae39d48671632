"""Node identity exists once (issue #22, part 1): a declared job's node (a config's [job])
is authenticated by the cluster, as a node of a submitted job is: its first Join spends a
cluster token and the credential it gets is the cluster's, both written to the cluster's
log; the job's engine only places it (node rank by the single-job rules) and keys it with
the cluster's credential hash. The node then serves the declared job in the cluster, so
the allocator never gives it to a submitted job; a restart keeps both. A declared job's
log written before (its own tokens, its own keyed nodes) still admits those nodes.

A real grpc.aio server in front of a ClusterCoordinator whose stores are memory logs kept
across a "restart" (a new coordinator over the same logs), and a clock the test moves; and
a real single-job coordinator process on SQLite, restarted, its two logs read after.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import sqlite3
import time

import grpc
import pytest
import pytest_asyncio

from conftest import start_coordinator
from test_one_shape import JOB as SHAPE_JOB, join_job
from meshgate import admin
from meshgate.attestation import SigningKey, secret_hash
from meshgate.coordinator.cluster import ClusterCoordinator
from meshgate.coordinator.cluster_state.events import ClusterNodeJoined
from meshgate.coordinator.config import LaunchConfig, declared_spec
from meshgate.coordinator.engine import Coordinator
from meshgate.coordinator.jobs import JobSpec, JobState
from meshgate.coordinator.keys import KeyRing
from meshgate.coordinator.rendezvous import NodeKeyed, RendezvousConfig, TokenCreated
from meshgate.coordinator.service import AccessPolicy, CoordinatorSlot, build_server, mark_serving
from meshgate.coordinator.store import MemoryStore, codec
from meshgate.plan import ParallelPlan
from meshgate.v1 import nodes_pb2, nodes_pb2_grpc
from meshgate.v1 import rendezvous_pb2 as pb
from meshgate.v1 import rendezvous_pb2_grpc

JOB = "declared"
CONFIG = RendezvousConfig(job_id=JOB, plan=ParallelPlan(dp_shard=4), slots_per_node=2, join_token="static-dev")
KEYS = {node: SigningKey.generate().public_raw for node in ("n0", "n1", "n2", "old")}


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


class Served:
    """A cluster declaring JOB over ``logs`` (the cluster's and the job's), behind a real
    server; ``restart`` closes it and serves a new one over the same logs."""

    def __init__(self, tmp_path, logs: dict[str, MemoryStore], clock: Clock) -> None:
        self.tmp_path, self.logs, self.clock = tmp_path, logs, clock

    async def start(self) -> None:
        self.cluster = ClusterCoordinator(
            self.logs["cluster"],
            KeyRing(self.tmp_path / "keys"),
            lambda config: self.logs.setdefault(config.job_id, MemoryStore()),
            attestation_ttl_s=600,
            heartbeat_timeout_s=600,
            require_vouch=False,
            clock=self.clock,
            declared=[(declared_spec(CONFIG, LaunchConfig()), CONFIG)],
        )
        await self.cluster.start()
        self.server, health = build_server(CoordinatorSlot(self.cluster), policy=AccessPolicy())
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        await mark_serving(health)
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.nodes = nodes_pb2_grpc.NodesStub(self.channel)
        self.admin = rendezvous_pb2_grpc.AdminStub(self.channel)

    async def stop(self) -> None:
        await self.channel.close()
        await self.server.stop(None)
        self.cluster.close()

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    async def join(self, node_id: str, token: str = "", credential: bytes = b"", job_id: str = JOB):
        return await self.nodes.Join(
            nodes_pb2.JoinRequest(
                job_id=job_id,
                node_id=node_id,
                hostname=node_id,
                slots=2,
                slot_kind="cpu",
                join_token=token,
                node_credential=credential,
                node_public_key=KEYS[node_id],
            )
        )

    async def token(self, node_id: str) -> str:
        return (
            await self.admin.CreateJoinToken(pb.CreateJoinTokenRequest(ttl_s=600, node_id=node_id, job_id=JOB))
        ).token


@pytest_asyncio.fixture
async def served(tmp_path):
    s = Served(tmp_path, {"cluster": MemoryStore()}, Clock())
    await s.start()
    yield s
    await s.stop()


def of_type(store: MemoryStore, kind: type) -> list:
    return [event for event in store.events if isinstance(event, kind)]


async def refused(call, code: grpc.StatusCode, needle: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == code and needle in caught.value.details(), caught.value.details()


@pytest.mark.asyncio
async def test_a_declared_jobs_node_authenticates_once_in_the_cluster(served):
    """The token is minted and spent in the cluster's log; the credential it gets is the
    cluster's; the job's log keys the node with that same hash and no token of its own; the
    engine still places it by the single-job rules (lowest free node rank)."""
    token = await served.token("n0")
    reply = await served.join("n0", token=token)
    assert reply.node_rank == 0 and reply.node_credential
    cluster_log, job_log = served.logs["cluster"], served.logs[JOB]
    [created] = of_type(cluster_log, TokenCreated)
    [joined] = of_type(cluster_log, ClusterNodeJoined)
    assert joined.token_hash == created.token_hash == secret_hash(token) and joined.job_id == JOB
    assert joined.credential_hash == secret_hash(reply.node_credential)
    assert of_type(job_log, TokenCreated) == []
    [keyed] = of_type(job_log, NodeKeyed)
    assert (keyed.credential_hash, keyed.token_hash) == (joined.credential_hash, "")
    node = served.cluster.state.nodes["n0"]
    assert node.job_id == JOB and node.credential_hash == joined.credential_hash

    # The token is single use; a stolen one never replaces the node's credential; a rejoin
    # needs the credential, and a wrong one is refused with nothing written.
    before = (list(cluster_log.events), list(job_log.events))
    await refused(served.join("n1", token=token), grpc.StatusCode.UNAUTHENTICATED, "already used")
    await refused(served.join("n0", token=await served.token("n0")), grpc.StatusCode.PERMISSION_DENIED, "credential")
    await refused(served.join("n0", credential=b"x" * 32), grpc.StatusCode.UNAUTHENTICATED, "not valid")
    assert of_type(cluster_log, ClusterNodeJoined) == before[0][-1:] and job_log.events == before[1]
    rejoined = await served.join("n0", credential=reply.node_credential)
    assert rejoined.node_rank == 0 and not rejoined.node_credential

    # The static dev [job] join_token admits a node and is never spent; the next free node rank.
    second = await served.join("n1", token="static-dev")
    assert second.node_rank == 1 and served.cluster.state.nodes["n1"].job_id == JOB
    assert of_type(cluster_log, ClusterNodeJoined)[-1].token_hash == ""
    # Every node rank is held: a third node is a hot spare, placed by the engine as before.
    spare = await served.join("n2", token=await served.token("n2"))
    assert spare.spare and spare.node_rank == -1 and served.cluster.state.nodes["n2"].job_id == JOB


@pytest.mark.asyncio
async def test_a_declared_jobs_node_is_never_given_to_a_submitted_job_and_a_restart_keeps_both(served):
    """n0 joined the declared job; n2 only the pool. A submitted job of one node gets n2,
    never n0; after a restart n0 still serves the declared job, rejoins with its credential
    at its node rank, and its spent token stays spent."""
    token = await served.token("n0")
    credential = (await served.join("n0", token=token)).node_credential
    pool_token = (await served.admin.CreateJoinToken(pb.CreateJoinTokenRequest(ttl_s=600, node_id="n2"))).token
    pool_credential = (await served.join("n2", token=pool_token, job_id="")).node_credential
    served.cluster.pool.note_units("n2", ())
    served.cluster.pool.note_units("n0", ())
    spec = JobSpec.build(job_id="sub", plan=ParallelPlan(dp_shard=2), command=("true",))
    await served.cluster.submit(spec)
    job = served.cluster.state.jobs["sub"]
    assert job.state is JobState.RUNNING and job.nodes == ("n2",)
    assert served.cluster.state.nodes["n0"].job_id == JOB

    await served.restart()
    assert served.cluster.state.nodes["n0"].job_id == JOB
    assert served.cluster.state.nodes["n2"].job_id == "sub"
    rejoined = await served.join("n0", credential=credential)
    assert rejoined.node_rank == 0
    await refused(served.join("n1", token=token), grpc.StatusCode.UNAUTHENTICATED, "already used")
    # A node serving the submitted job cannot join the declared one with its credential.
    await refused(
        served.join("n2", credential=pool_credential), grpc.StatusCode.FAILED_PRECONDITION, "serves job 'sub'"
    )


@pytest.mark.asyncio
async def test_a_job_log_with_engine_keyed_nodes_and_tokens_still_admits_them(tmp_path):
    """A declared job's log written before this change (or migrated with --migrate-state)
    holds its own TokenCreated and NodeKeyed: at start the cluster takes over the nodes it
    keyed and its unspent tokens, so the old node rejoins with its credential at its node
    rank, and an old unspent token admits its node (once)."""
    clock = Clock()
    job_log = MemoryStore()
    engine = Coordinator(CONFIG, job_log, KeyRing(tmp_path / "old-keys"), attestation_ttl_s=600, clock=clock)
    old_token, _ = await engine.create_join_token(JOB, 600, "old")
    old_credential = (await engine.join(JOB, "old", "old", 2, "cpu", old_token, public_key=KEYS["old"]))[1]
    unspent, _ = await engine.create_join_token(JOB, 600, "n1")
    assert [e.node_id for e in of_type(job_log, NodeKeyed)] == ["old"]

    s = Served(tmp_path, {"cluster": MemoryStore(), JOB: job_log}, clock)
    await s.start()
    try:
        adopted = of_type(s.logs["cluster"], ClusterNodeJoined)
        assert [(e.node_id, e.job_id) for e in adopted] == [("old", JOB)]
        assert [e.token_hash for e in of_type(s.logs["cluster"], TokenCreated)] == [secret_hash(unspent)]
        rejoined = await s.join("old", credential=old_credential)
        assert rejoined.node_rank == 0 and not rejoined.node_credential
        await refused(s.join("old", credential=secrets.token_bytes(32)), grpc.StatusCode.UNAUTHENTICATED, "not valid")
        await refused(s.join("n2", token=old_token), grpc.StatusCode.UNAUTHENTICATED, "not known")
        first = await s.join("n1", token=unspent)
        assert first.node_rank == 1 and first.node_credential
        await s.restart()  # adopted once: a restart adds nothing
        assert (
            of_type(s.logs["cluster"], ClusterNodeJoined) == adopted + of_type(s.logs["cluster"], ClusterNodeJoined)[1:]
        )
        assert len(of_type(s.logs["cluster"], TokenCreated)) == 1
        await refused(s.join("n2", token=unspent), grpc.StatusCode.UNAUTHENTICATED, "already used")
    finally:
        await s.stop()


def test_a_nodes_declared_job_is_kept_in_the_cluster_log_and_an_older_record_reads_as_the_pool():
    """ClusterNodeJoined carries the declared job a node joined through the codec; one
    written before (no job_id) reads as a Join to the pool."""
    joined = ClusterNodeJoined("n0", "n0", 2, "cpu", (), "c", "00" * 32, "", 1.0, JOB)
    assert codec.decode(codec.encode(joined), "test") == joined
    body = json.loads(codec.encode(joined))
    del body["job_id"]
    assert codec.decode(json.dumps(body), "test") == dataclasses.replace(joined, job_id="")


def log_text(path) -> str:
    """Every row of a SQLite log, as text."""
    with sqlite3.connect(path) as db:
        tables = [row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return "\n".join(str(row) for table in tables for row in db.execute(f"SELECT * FROM {table}"))


def test_a_single_job_coordinators_token_is_spent_in_its_cluster_log_and_stays_spent_after_a_restart(tmp_path):
    """A real single-job coordinator on SQLite: `token create` for its job mints a cluster
    token; the node's Join spends it in the cluster's log (the job's log never sees it);
    after a restart the token stays spent and the node rejoins with its credential at its
    node rank."""
    coordinator = start_coordinator(
        tmp_path, ParallelPlan(dp_shard=4), SHAPE_JOB, 2, job={"heartbeat_interval_s": 60, "heartbeat_misses": 5}
    )
    try:
        token = admin.create_join_token(coordinator.address, SHAPE_JOB, node_id="n0", tls=False).token
        joined = join_job(coordinator.address, 0, token=token)
        assert joined.node_rank == 0 and joined.node_credential
        coordinator.restart()
        with pytest.raises(grpc.RpcError) as caught:
            join_job(coordinator.address, 0, token=token)
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED  # n0 holds a credential
        with pytest.raises(grpc.RpcError) as caught:
            join_job(coordinator.address, 1, token=token)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED and "already used" in caught.value.details()
        rejoined = join_job(coordinator.address, 0, credential=joined.node_credential)
        assert rejoined.node_rank == 0 and not rejoined.node_credential
    finally:
        coordinator.stop()
    job_logs = list((tmp_path / "state" / "jobs").rglob("*.sqlite3"))
    cluster_logs = [p for p in (tmp_path / "state").rglob("*.sqlite3") if p not in job_logs]
    assert len(job_logs) == 1 and len(cluster_logs) == 1, (job_logs, cluster_logs)
    cluster_text, job_text = log_text(cluster_logs[0]), log_text(job_logs[0])
    assert secret_hash(token) in cluster_text and secret_hash(token) not in job_text
    assert secret_hash(joined.node_credential) in cluster_text
