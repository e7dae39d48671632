"""Upgrades without surprises (issue 35): versions on the wire and the skew policy.

A real grpc.aio coordinator over mTLS (dev CA) in front of a jobs-mode ClusterCoordinator.
This release's clients are meshgate.connection.Connection, as the CLI, the agent and the
workers use it; a peer of another version is a raw stub that sends that version's
metadata (what its release sends), or none (the release before versions). Every refused
call is checked to leave the cluster's state as found.
"""

from __future__ import annotations

import asyncio
import copy

import grpc
import pytest
import pytest_asyncio

from meshgate import wire
from meshgate.attestation import SigningKey
from meshgate.connection import Connection
from meshgate.coordinator import readmodel
from meshgate.coordinator.cluster import ClusterCoordinator
from meshgate.coordinator.jobs import JobSpec
from meshgate.coordinator.keys import KeyRing
from meshgate.coordinator.service import AccessPolicy, CoordinatorSlot, build_server, mark_serving
from meshgate.coordinator.store import MemoryStore
from meshgate.plan import ParallelPlan
from meshgate.tls import init_dev_ca, secure_channel, server_credentials
from meshgate.v1 import nodes_pb2, nodes_pb2_grpc
from meshgate.v1 import rendezvous_pb2 as pb
from meshgate.v1 import rendezvous_pb2_grpc

NODES = ("n0", "n1")
NEWER = (("meshgate-release", "9.0.0"), ("meshgate-wire", str(wire.WIRE_VERSION + 1)))
JOBSPEC_ENUMS = [f.name for f in pb.JobSpec.DESCRIPTOR.fields if f.enum_type is not None]


def versions(release: str, wire_version: str) -> tuple[tuple[str, str], ...]:
    return (("meshgate-release", release), ("meshgate-wire", wire_version))


@pytest_asyncio.fixture
async def env(tmp_path):
    ca = init_dev_ca(tmp_path / "ca", agent_names=NODES)
    cluster = ClusterCoordinator(
        MemoryStore(),
        KeyRing(tmp_path / "keys"),
        lambda config: MemoryStore(),
        attestation_ttl_s=600,
        heartbeat_timeout_s=15,
        require_vouch=False,
    )
    server, health = build_server(CoordinatorSlot(cluster), policy=AccessPolicy(secure=True))
    port = server.add_secure_port("127.0.0.1:0", server_credentials(ca.server_tls(require_client_cert=True)))
    await server.start()
    await mark_serving(health)
    address = f"127.0.0.1:{port}"
    channels = []

    class Env:
        pass

    e = Env()
    e.cluster, e.ca, e.address = cluster, ca, address
    # This release's agent and admin: channels as Connection makes them (the agent's session
    # opens its aio channel so; the CLI's blocking calls go through Connection.call).
    e.agent_connection = {n: Connection(address, ca.client_tls(ca.agent(n))) for n in NODES}
    e.admin_connection = Connection(address, ca.client_tls(ca.admin))
    for made in list(e.agent_connection.values()) + [e.admin_connection]:
        channels.append(made)

    def raw(pair):
        made = secure_channel(address, ca.client_tls(pair), aio=True)
        channels.append(made)
        return made

    e.admin_raw = rendezvous_pb2_grpc.AdminStub(raw(ca.admin))
    e.worker_raw = rendezvous_pb2_grpc.RendezvousStub(raw(ca.worker))
    e.nodes_raw = {n: nodes_pb2_grpc.NodesStub(raw(ca.agent(n))) for n in NODES}
    yield e
    for made in channels:
        if isinstance(made, Connection):
            made.close()
        else:
            await made.close()
    await server.stop(None)


def state_of(cluster: ClusterCoordinator):
    return copy.deepcopy(vars(cluster.state)), dict(cluster.node_versions)


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


async def token(env, node_id: str) -> str:
    return (await env.admin_raw.CreateJoinToken(pb.CreateJoinTokenRequest(ttl_s=600, node_id=node_id))).token


def join_request(node_id: str, join_token: str) -> nodes_pb2.JoinRequest:
    return nodes_pb2.JoinRequest(
        node_id=node_id,
        hostname=node_id,
        slots=2,
        slot_kind="cpu",
        join_token=join_token,
        node_public_key=SigningKey.generate().public_raw,
    )


def list_nodes(env) -> dict[str, pb.PoolNode]:
    reply = env.admin_connection.call(rendezvous_pb2_grpc.AdminStub, "ListNodes", pb.ListNodesRequest(), timeout=10)
    return {n.node_id: n for n in reply.nodes}


# ---- every call carries its versions; the coordinator records each node's ----------------------


async def test_each_node_s_versions_are_recorded_from_its_join_and_heartbeats_and_shown(env):
    # n0: this release's agent, through the channel its session opens.
    channel = env.agent_connection["n0"].channel(aio=True)
    try:
        joined = await nodes_pb2_grpc.NodesStub(channel).Join(join_request("n0", await token(env, "n0")))
        # n1: an agent of the release before versions (7736840: it sends none, but names its instance).
        before = join_request("n1", await token(env, "n1"))
        before.agent_instance = "old-agent"
        await env.nodes_raw["n1"].Join(before)
        shown = await asyncio.to_thread(list_nodes, env)
        assert (shown["n0"].agent_release, shown["n0"].agent_wire) == (wire.RELEASE, wire.WIRE_VERSION)
        assert (shown["n1"].agent_release, shown["n1"].agent_wire) == (wire.UNVERSIONED_RELEASE, 0)
        # Upgraded in place: its next heartbeat carries the new versions.
        heartbeat = nodes_pb2.NodeHeartbeatRequest(node_id="n0", node_credential=joined.node_credential)
        await env.nodes_raw["n0"].NodeHeartbeat(heartbeat, metadata=versions("0.3.0", "2"))
        assert env.cluster.node_versions["n0"] == wire.PeerVersion("0.3.0", 2)
    finally:
        await channel.close()
    gauges = readmodel.gauges(env.cluster)
    assert gauges.agent_versions == {("0.3.0", "2"): 1.0, (wire.UNVERSIONED_RELEASE, "0"): 1.0}


def test_meshgate_nodes_shows_each_agent_s_version():
    from meshgate import views

    node = pb.PoolNode(node_id="n0", state=pb.POOL_STATE_IDLE, slots=2, slot_kind="cpu", agent_release="0.2.0")
    node.agent_wire = 1
    silent = pb.PoolNode(node_id="n1", state=pb.POOL_STATE_IDLE, slots=2, slot_kind="cpu")
    table = views.render_nodes([views.pool_node_dict(node, 0.0), views.pool_node_dict(silent, 0.0)], 2)
    header, first, second = table.splitlines()[:3]
    assert header.split()[-2:] == ["AGENT", "HARDWARE"]
    assert first.endswith("0.2.0 (wire 1)  -") and second.endswith("-")


# ---- a node back under another agent, through the servicers ----------------------------------


async def test_an_old_agent_killed_and_a_new_one_started_ends_the_generation_its_workers_held(env):
    """The issue's mixed cluster: an agent of the release before instances (no version, no
    agent_instance) serves a job whose workers registered; it is killed -9 and this release's
    agent starts on the node. Its Join ends the generation: the old workers' ranks are not
    handed to the new ones in the same generation."""
    joined = await env.nodes_raw["n0"].Join(join_request("n0", await token(env, "n0")))
    spec = JobSpec.build(job_id="A", plan=ParallelPlan(dp_shard=2), node_ids=("n0",), command=("true",))
    await env.cluster.submit(spec)
    rejoin = join_request("n0", "")
    rejoin.job_id, rejoin.node_credential = "A", joined.node_credential
    await env.nodes_raw["n0"].Join(rejoin)  # the old agent: no agent_instance, no version
    for local in (0, 1):
        request = pb.RegisterRequest(job_id="A", worker_id=f"n0/local{local}", nonce=b"w" * 32, node_id="n0")
        request.assigned.local_rank = local
        assert (await env.worker_raw.Register(request)).attestation
    engine = env.cluster.engines["A"]
    assert engine.state.generation == 0 and engine.state.complete

    rejoin.agent_instance = "new-agent"  # kill -9; this release's agent starts and joins
    channel = env.agent_connection["n0"].channel(aio=True)
    try:
        reply = await nodes_pb2_grpc.NodesStub(channel).Join(rejoin)
    finally:
        await channel.close()
    assert reply.generation == 1 and engine.state.generation == 1 and not engine.state.complete
    reasons = [e.detail for e in engine.state.timeline.entries()]
    assert any("cannot show it is an agent that named no instance" in r for r in reasons), reasons
    assert env.cluster.node_versions["n0"] == wire.OWN


async def test_job_logs_of_an_agent_before_instances_name_its_version_at_once_and_exit_1(env, capsys):
    """An agent of 91c899c or older (no version, no agent instance in its Join) keeps no
    workers' output and ignores a log request: `meshgate job logs` named it only after the
    pickup wait (20 s here) and exited 0. Now it is named at once, with its version and what
    to upgrade, and the CLI exits 1; its job is served as before."""
    from meshgate.cli import main as meshgate_main

    joined = await env.nodes_raw["n0"].Join(join_request("n0", await token(env, "n0")))
    spec = JobSpec.build(job_id="A", plan=ParallelPlan(dp_shard=2), node_ids=("n0",), command=("true",))
    await env.cluster.submit(spec)
    rejoin = join_request("n0", "")
    rejoin.job_id, rejoin.node_credential = "A", joined.node_credential
    assert (await env.nodes_raw["n0"].Join(rejoin)).node_rank == 0  # no agent_instance, no version
    shown = await asyncio.to_thread(list_nodes, env)
    assert shown["n0"].agent_release == wire.PRE_INSTANCES.release

    admin = env.ca.admin
    argv = ["job", "logs", "A", "--coordinator", env.address, "--ca-file", str(env.ca.ca)]
    argv += ["--cert-file", str(admin.cert), "--key-file", str(admin.key)]
    started = asyncio.get_running_loop().time()
    code = await asyncio.to_thread(meshgate_main, argv)
    took = asyncio.get_running_loop().time() - started
    err = capsys.readouterr().err
    assert code == 1 and took < 5, (code, took, err)
    assert f"node n0's agent is {wire.PRE_INSTANCES.described}, which has no job logs: upgrade its agent" in err
    assert not env.cluster.log_relay.open and not env.cluster.log_relay.waiting  # nothing left asked


# ---- outside the skew policy: refused, naming both versions and what to upgrade --------------


@pytest.mark.parametrize(
    "sent, needles",
    [
        (versions("9.9.0", str(wire.WIRE_VERSION + 2)), ["release 9.9.0 (wire 3)", "upgrade the coordinator"]),
        (versions("0.0.1", "x"), ["release 0.0.1 (wire -1)", "upgrade this"]),
    ],
)
async def test_a_peer_outside_the_skew_policy_is_refused_naming_both_versions(env, sent, needles):
    own = f"release {wire.RELEASE} (wire {wire.WIRE_VERSION})"
    await refused(
        env,
        env.admin_raw.ListJobs(pb.ListJobsRequest(), metadata=sent),
        grpc.StatusCode.FAILED_PRECONDITION,
        own,
        *needles,
    )
    details = await refused(
        env,
        env.nodes_raw["n0"].Join(join_request("n0", await token(env, "n0")), metadata=sent),
        grpc.StatusCode.FAILED_PRECONDITION,
        own,
        *needles,
    )
    assert "this agent" in details
    assert "n0" not in env.cluster.state.nodes


async def test_inside_the_policy_older_and_newer_peers_are_served(env):
    for sent in ((), versions("0.1.0", "0"), NEWER):
        await env.admin_raw.ListJobs(pb.ListJobsRequest(), metadata=sent)


# ---- inside it: nothing a newer peer sends is dropped ---------------------------------------


def submit_request(**spec_fields) -> pb.SubmitJobRequest:
    request = pb.SubmitJobRequest(wait_for_nodes=True)
    request.spec.plan.dp_shard = 2
    request.spec.nodes = 1
    request.spec.command.append("true")
    for name, value in spec_fields.items():
        setattr(request.spec, name, value)
    return request


@pytest.mark.parametrize("field_name", JOBSPEC_ENUMS)
async def test_a_newer_client_s_jobspec_enum_value_is_refused_naming_the_version_that_lacks_it(env, field_name):
    enum_type = pb.JobSpec.DESCRIPTOR.fields_by_name[field_name].enum_type
    unknown = max(enum_type.values_by_number) + 1  # a value a later release adds
    await refused(
        env,
        env.admin_raw.SubmitJob(submit_request(**{field_name: unknown}), metadata=NEWER),
        grpc.StatusCode.FAILED_PRECONDITION,
        f"SubmitJobRequest.spec.{field_name} is {enum_type.name} value {unknown}",
        f"coordinator's release {wire.RELEASE} (wire {wire.WIRE_VERSION}) does not know",
        "release 9.0.0 (wire 2)",
        "upgrade the coordinator",
    )
    assert not env.cluster.state.jobs


@pytest.mark.parametrize("field_name", JOBSPEC_ENUMS)
async def test_this_release_s_jobspec_enum_values_arrive_as_sent(env, field_name):
    """The other half of "never dropped": every value of every enum field of JobSpec that
    this release's CLI can send is recorded as sent (GetJob reads it back)."""
    enum_type = pb.JobSpec.DESCRIPTOR.fields_by_name[field_name].enum_type
    for number in sorted(enum_type.values_by_number)[1:]:  # UNSPECIFIED is the default
        request = submit_request(**{field_name: number})
        request.spec.job_id = f"{field_name.replace('_', '-')}-{number}"
        if field_name == "mode" and number == pb.RANK_MODE_CLAIMED:
            request.spec.ClearField("command")  # a claimed job's workers are the framework's
        job = await asyncio.to_thread(
            env.admin_connection.call, rendezvous_pb2_grpc.AdminStub, "SubmitJob", request, timeout=10
        )
        assert getattr(job.spec, field_name) == number, (field_name, number, job.spec)


async def test_a_newer_client_s_unknown_field_is_refused_naming_its_number(env):
    request = submit_request()
    request.spec.MergeFromString(bytes([0xA0, 0x06, 0x01]))  # field 100, varint 1: a later release's field
    await refused(
        env,
        env.admin_raw.SubmitJob(request, metadata=NEWER),
        grpc.StatusCode.FAILED_PRECONDITION,
        "SubmitJobRequest.spec carries field number 100",
        "upgrade the coordinator",
    )


async def test_an_older_client_s_retired_field_keeps_its_own_refusal(env):
    """Not skew: the release before versions could not send a retired field; the servicer's
    own check names what the field was (tests/test_job_spelling.py)."""
    request = submit_request()
    request.spec.MergeFromString(bytes([0x32, 0x07]) + b"claimed")  # field 6: the string mode
    await refused(env, env.admin_raw.SubmitJob(request), grpc.StatusCode.INVALID_ARGUMENT, "field 6", "string mode")
