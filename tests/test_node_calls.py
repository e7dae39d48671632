"""Node calls reveal nothing (issue 20, item 7), in the style of test_attacks.py: a real
grpc.aio server over mTLS (dev CA) in front of a jobs-mode ClusterCoordinator, a clock
the test moves, and every refused call checked to leave the cluster's and the job's
state as found.

- A node's credential is checked before its call counts as a sign of life.
- A node naming a job it was not given is PERMISSION_DENIED, worded alike whether or not
  the job exists.
- AwaitWorld answers only a worker of the job (its worker_id and heartbeat secret), an
  agent of a node serving it, or an admin.
"""

from __future__ import annotations

import copy
import secrets
import time

import grpc
import pytest
import pytest_asyncio

from meshgate.attestation import SigningKey
from meshgate.coordinator.cluster import ClusterCoordinator
from meshgate.coordinator.jobs import JobSpec, JobState
from meshgate.coordinator.keys import KeyRing
from meshgate.coordinator.service import AccessPolicy, CoordinatorSlot, build_server, mark_serving
from meshgate.coordinator.store import MemoryStore
from meshgate.plan import ParallelPlan
from meshgate.tls import init_dev_ca, secure_channel, server_credentials
from meshgate.v1 import nodes_pb2, nodes_pb2_grpc
from meshgate.v1 import rendezvous_pb2 as pb
from meshgate.v1 import rendezvous_pb2_grpc

NODES = ("n0", "n1")
TIMEOUT_S = 15.0


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def state_of(cluster: ClusterCoordinator):
    """The cluster's state and every job engine's, credentials and liveness included."""
    engines = {job_id: copy.deepcopy(vars(engine.state)) for job_id, engine in cluster.engines.items()}
    return copy.deepcopy(vars(cluster.state)), engines


@pytest_asyncio.fixture
async def env(tmp_path):
    ca = init_dev_ca(tmp_path / "ca", agent_names=NODES)
    clock = Clock()
    cluster = ClusterCoordinator(
        MemoryStore(),
        KeyRing(tmp_path / "keys"),
        lambda config: MemoryStore(),
        attestation_ttl_s=600,
        heartbeat_timeout_s=TIMEOUT_S,
        require_vouch=False,
        clock=clock,
    )
    server, health = build_server(CoordinatorSlot(cluster), policy=AccessPolicy(secure=True))
    port = server.add_secure_port("127.0.0.1:0", server_credentials(ca.server_tls(require_client_cert=True)))
    await server.start()
    await mark_serving(health)
    address = f"127.0.0.1:{port}"
    channels = []

    def channel(pair):
        made = secure_channel(address, ca.client_tls(pair), aio=True)
        channels.append(made)
        return made

    class Env:
        pass

    e = Env()
    e.cluster, e.clock = cluster, clock
    e.admin = rendezvous_pb2_grpc.AdminStub(channel(ca.admin))
    e.nodes = {n: nodes_pb2_grpc.NodesStub(channel(ca.agent(n))) for n in NODES}
    e.agent_rendezvous = {n: rendezvous_pb2_grpc.RendezvousStub(channel(ca.agent(n))) for n in NODES}
    e.worker = rendezvous_pb2_grpc.RendezvousStub(channel(ca.worker))
    e.admin_rendezvous = rendezvous_pb2_grpc.RendezvousStub(channel(ca.admin))
    e.credentials = {}
    for node_id in NODES:
        token = (await e.admin.CreateJoinToken(pb.CreateJoinTokenRequest(ttl_s=600, node_id=node_id))).token
        reply = await e.nodes[node_id].Join(
            nodes_pb2.JoinRequest(
                node_id=node_id,
                hostname=node_id,
                slots=2,
                slot_kind="cpu",
                join_token=token,
                node_public_key=SigningKey.generate().public_raw,
            )
        )
        e.credentials[node_id] = reply.node_credential
    # job A: one node of two slots, pinned to n0; n1 stays idle
    spec = JobSpec.build(job_id="A", plan=ParallelPlan(dp_shard=2), node_ids=("n0",), command=("true",))
    await cluster.submit(spec)
    assert cluster.state.jobs["A"].state is JobState.RUNNING and cluster.state.jobs["A"].nodes == ("n0",)
    yield e
    for made in channels:
        await made.close()
    await server.stop(None)


async def refused(env, call, code: grpc.StatusCode, *needles: str) -> str:
    before = state_of(env.cluster)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == code, caught.value.details()
    details = caught.value.details() or ""
    for needle in needles:
        assert needle in details, details
    assert state_of(env.cluster) == before, "a refused call changed the cluster's state"
    return details


# ---- the credential comes before a sign of life ---------------------------------------------


async def test_a_heartbeat_with_a_wrong_credential_is_no_sign_of_life(env):
    """Before: a job heartbeat touched the node, then the job's engine checked the
    credential; a node whose agent died stayed live on forged heartbeats."""
    seen = env.cluster.state.nodes["n0"].last_seen
    env.clock.now += TIMEOUT_S + 5  # n0 has been silent past the timeout
    wrong = secrets.token_bytes(32)
    for request in (
        nodes_pb2.NodeHeartbeatRequest(job_id="A", node_id="n0", node_credential=wrong),
        nodes_pb2.NodeHeartbeatRequest(node_id="n0", node_credential=wrong),
        nodes_pb2.RegisterBatchRequest(job_id="A", node_id="n0", node_credential=wrong),
        nodes_pb2.JoinRequest(job_id="A", node_id="n0", slots=2, slot_kind="cpu", node_credential=wrong),
    ):
        method = {
            "NodeHeartbeatRequest": "NodeHeartbeat",
            "RegisterBatchRequest": "RegisterBatch",
            "JoinRequest": "Join",
        }[type(request).__name__]
        await refused(
            env, getattr(env.nodes["n0"], method)(request), grpc.StatusCode.PERMISSION_DENIED, "node_credential"
        )
    assert env.cluster.state.nodes["n0"].last_seen == seen
    assert not env.cluster.state.is_live(env.cluster.state.nodes["n0"], env.clock())
    # the real credential still counts
    await env.nodes["n0"].NodeHeartbeat(
        nodes_pb2.NodeHeartbeatRequest(job_id="A", node_id="n0", node_credential=env.credentials["n0"])
    )
    assert env.cluster.state.nodes["n0"].last_seen == env.clock()


async def test_a_dead_node_is_not_given_a_job_on_forged_heartbeats(env):
    env.clock.now += TIMEOUT_S + 5  # n1's agent died
    await refused(
        env,
        env.nodes["n1"].NodeHeartbeat(
            nodes_pb2.NodeHeartbeatRequest(node_id="n1", node_credential=secrets.token_bytes(32))
        ),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    await env.cluster.submit(JobSpec.build(job_id="B", plan=ParallelPlan(dp_shard=2), num_nodes=1, command=("true",)))
    assert env.cluster.state.jobs["B"].state is JobState.PENDING  # n1 is not live: no node for B


# ---- a job the node was not given -----------------------------------------------------------


def calls_naming(env, job_id: str):
    node, credential = "n1", env.credentials["n1"]
    stub = env.nodes[node]
    return [
        stub.Join(
            nodes_pb2.JoinRequest(job_id=job_id, node_id=node, slots=2, slot_kind="cpu", node_credential=credential)
        ),
        stub.RegisterBatch(nodes_pb2.RegisterBatchRequest(job_id=job_id, node_id=node, node_credential=credential)),
        stub.NodeHeartbeat(nodes_pb2.NodeHeartbeatRequest(job_id=job_id, node_id=node, node_credential=credential)),
        stub.ReportExit(
            nodes_pb2.WorkerExitReport(
                job_id=job_id, node_id=node, node_credential=credential, local_rank=0, exit_code=1
            )
        ),
        stub.Leave(nodes_pb2.LeaveRequest(job_id=job_id, node_id=node, node_credential=credential, reason="x")),
    ]


async def test_a_node_learns_nothing_of_jobs_it_was_not_given(env):
    """Before: a job that exists answered FAILED_PRECONDITION and one that does not
    NOT_FOUND, so a node could list the cluster's jobs."""
    seen = env.cluster.state.nodes["n1"].last_seen
    for existing, missing in zip(calls_naming(env, "A"), calls_naming(env, "Z")):
        a = await refused(env, existing, grpc.StatusCode.PERMISSION_DENIED, "'n1'", "'A'")
        z = await refused(env, missing, grpc.StatusCode.PERMISSION_DENIED, "'n1'", "'Z'")
        assert a.replace("'A'", "'Z'") == z  # the same answer, whether or not the job exists
    assert env.cluster.state.nodes["n1"].last_seen == seen  # none of them counted as life


# ---- AwaitWorld -----------------------------------------------------------------------------


def await_request(job_id: str = "A", **fields) -> pb.AwaitWorldRequest:
    return pb.AwaitWorldRequest(job_id=job_id, generation=0, timeout_ms=2000, **fields)


async def register_both(env) -> dict[str, bytes]:
    out = {}
    for local in (0, 1):
        request = pb.RegisterRequest(
            job_id="A", worker_id=f"n0/local{local}", nonce=secrets.token_bytes(32), node_id="n0"
        )
        request.assigned.local_rank = local
        out[request.worker_id] = (await env.worker.Register(request)).heartbeat_secret
    return out


async def test_await_world_answers_only_a_worker_of_the_job(env):
    hb = await register_both(env)
    # a worker certificate alone reads no job's world, existing or not, alike
    a = await refused(env, env.worker.AwaitWorld(await_request("A")), grpc.StatusCode.PERMISSION_DENIED, "'A'")
    z = await refused(env, env.worker.AwaitWorld(await_request("Z")), grpc.StatusCode.PERMISSION_DENIED, "'Z'")
    assert a.replace("'A'", "'Z'") == z
    for worker_id, secret in (
        ("n0/local0", secrets.token_bytes(32)),  # a guessed secret
        ("n0/local1", hb["n0/local0"]),  # another worker's secret
        ("n0/local0", b""),
    ):
        await refused(
            env,
            env.worker.AwaitWorld(await_request(worker_id=worker_id, heartbeat_secret=secret)),
            grpc.StatusCode.PERMISSION_DENIED,
        )
    # one job's worker secret is no key to another job's world
    await refused(
        env,
        env.worker.AwaitWorld(await_request("Z", worker_id="n0/local0", heartbeat_secret=hb["n0/local0"])),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    # the job's own worker, the agent of its node (the fan-in path) and an admin are answered
    world = await env.worker.AwaitWorld(
        await_request(include_members=True, worker_id="n0/local1", heartbeat_secret=hb["n0/local1"])
    )
    assert world.world_size == 2 and [m.worker_id for m in world.members] == ["n0/local0", "n0/local1"]
    assert (await env.agent_rendezvous["n0"].AwaitWorld(await_request())).world_size == 2
    assert (await env.admin_rendezvous.AwaitWorld(await_request())).world_size == 2
    # the agent of a node that does not serve the job is not
    await refused(env, env.agent_rendezvous["n1"].AwaitWorld(await_request()), grpc.StatusCode.PERMISSION_DENIED, "'A'")


async def test_a_malformed_job_id_is_invalid_argument_before_any_access_check(env):
    details = await refused(env, env.worker.AwaitWorld(await_request("j" * 5000)), grpc.StatusCode.INVALID_ARGUMENT)
    assert len(details) < 300
