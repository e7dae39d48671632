"""HA on a real etcd: two coordinators, one leads through an etcd lease; SIGKILL the
leader mid-registration and the standby takes over with the state intact, no rank
assigned twice; a garbage key stops a coordinator with the key named."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import REPO, free_port, worker_env
from meshgate.attestation import TrustBundle, verify_attestation
from meshgate.endpoints import Endpoints, leader_hint
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb
from meshgate.v1 import rendezvous_pb2_grpc

pytestmark = pytest.mark.slow

PLAN = ParallelPlan(tp=4, dp_shard=64)  # 256 ranks, 64 nodes of 4
LEASE_TTL_S = 2
# etcd's default election timeout. A restarted etcd extends every lease it restores by about
# two election timeouts before it expires any (so that no lease dies of the restart alone):
# the old leader's key outlives the restart by TTL + 2 x election timeout, and no
# coordinator can lead before it is gone.
ETCD_ELECTION_TIMEOUT_S = 1.0


def serving(address: str) -> bool:
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="meshgate.v1.Rendezvous"), timeout=1
            )
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def wait_until(predicate, timeout: float, what: str, why=lambda: "") -> float:
    """Seconds until ``predicate()``; on timeout an AssertionError naming ``what`` and ``why()``
    (e.g. the processes' logs)."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{why()}")
        time.sleep(0.05)
    return time.monotonic() - started


def request(i: int, job_id: str = "ha") -> pb.RegisterRequest:
    message = pb.RegisterRequest(
        job_id=job_id, worker_id=f"n{i // 4}/local{i % 4}", nonce=secrets.token_bytes(16), node_id=f"n{i // 4}"
    )
    message.assigned.local_rank = i % 4
    return message


async def register_with_failover(spec: str, message, deadline_s: float = 60.0):
    """What meshgate.client does, in asyncio: fail over across the HA list."""
    endpoints = Endpoints(spec)
    loop = asyncio.get_running_loop()
    give_up = loop.time() + deadline_s
    while True:
        try:
            async with grpc.aio.insecure_channel(endpoints.current) as channel:
                return await rendezvous_pb2_grpc.RendezvousStub(channel).Register(message, timeout=5)
        except grpc.aio.AioRpcError as exc:
            if (
                exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                or loop.time() > give_up
            ):
                raise
            endpoints.failed(exc)
            await asyncio.sleep(0.05)


CLUSTER_ROOT = "/meshgate/cluster/"  # leadership.etcd_root of a cluster


def wipe_cluster(etcd_server) -> None:
    """Delete the cluster's keys: each test starts a new cluster on the module's etcd."""
    import aetcd

    async def wipe():
        host, port = etcd_server.endpoint.rsplit(":", 1)
        async with aetcd.Client(host=host, port=int(port)) as client:
            await client.delete_prefix(CLUSTER_ROOT.encode())

    asyncio.run(wipe())


@pytest.fixture(autouse=True)
def new_cluster(etcd_server):
    wipe_cluster(etcd_server)


@pytest.fixture
def ha_pair(coordinator_factory, etcd_server, tmp_path):
    keys = tmp_path / "shared-keys"  # an HA pair signs with one provisioned key

    def start(job_id: str = "ha"):
        return coordinator_factory(
            PLAN,
            job_id=job_id,
            slots_per_node=4,
            server={"listen": f"127.0.0.1:{free_port()}"},
            store={"kind": "etcd", "endpoints": [etcd_server.endpoint], "lease_ttl_s": LEASE_TTL_S},
            keys_dir=keys,
        )

    return start


async def test_standby_takes_over_with_no_rank_lost_or_doubled(ha_pair):
    leader = ha_pair()
    wait_until(lambda: serving(leader.address), 30, "first coordinator leads")
    standby = ha_pair()
    assert not serving(standby.address)

    # the standby refuses, naming the leader, so clients go there
    with grpc.insecure_channel(standby.address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            rendezvous_pb2_grpc.RendezvousStub(channel).Register(request(0), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert leader_hint(caught.value) == leader.address and leader.address in caught.value.details()

    spec = f"{standby.address},{leader.address}"  # the standby first: every client fails over once
    bundle = TrustBundle.load(leader.trust_bundle_path)
    messages = [request(i) for i in range(PLAN.world_size)]
    answered: list[int] = []

    async def one(i):
        reply = await register_with_failover(spec, messages[i])
        answered.append(i)
        return reply

    tasks = [asyncio.ensure_future(one(i)) for i in range(PLAN.world_size)]
    while len(answered) < 80:
        await asyncio.sleep(0.01)
    leader.kill()
    killed_at = time.monotonic()
    before_kill = len(answered)
    takeover = await asyncio.to_thread(wait_until, lambda: serving(standby.address), 6 * LEASE_TTL_S, "standby leads")
    replies = await asyncio.gather(*tasks)
    ranks = [
        verify_attestation(r.attestation, bundle, job_id="ha", nonce=m.nonce).rank for r, m in zip(replies, messages)
    ]
    assert sorted(ranks) == list(range(PLAN.world_size)), "a rank was lost or assigned twice across the failover"
    assert takeover <= 2 * LEASE_TTL_S + 1.5, f"standby took {takeover:.1f}s to lead"
    assert 80 <= before_kill < PLAN.world_size

    # re-registering on the new leader gives every worker the rank it already had
    again = [request(i) for i in range(PLAN.world_size)]
    async with grpc.aio.insecure_channel(standby.address) as channel:
        stub = rendezvous_pb2_grpc.RendezvousStub(channel)
        second = await asyncio.gather(*(stub.Register(m, timeout=30) for m in again))
        status = await rendezvous_pb2_grpc.AdminStub(channel).GetStatus(pb.GetStatusRequest(job_id="ha"))
    assert [
        verify_attestation(r.attestation, bundle, job_id="ha", nonce=m.nonce).rank for r, m in zip(second, again)
    ] == ranks
    assert status.registered == PLAN.world_size
    print(f"failover: leader killed after {before_kill} acks; standby led {time.monotonic() - killed_at:.2f}s later")


async def _rendezvous_across_an_outage(ha_pair, job_id: str, outage) -> float:
    """Two coordinators; 64 Registers answered, the rest in flight when ``outage(leader,
    standby)`` runs. Returns how long after it a coordinator led again, once every answer
    recorded (before, during and after) is checked: no rank lost, doubled or changed, no
    coordinator exited, no traceback in either log."""
    leader = ha_pair(job_id)
    wait_until(lambda: serving(leader.address), 30, "first coordinator leads")
    standby = ha_pair(job_id)
    spec = f"{leader.address},{standby.address}"
    bundle = TrustBundle.load(leader.trust_bundle_path)
    messages = [request(i, job_id) for i in range(PLAN.world_size)]
    answers: dict[int, int] = {}

    async def one(i):
        reply = await register_with_failover(spec, messages[i], deadline_s=90)
        answers[i] = verify_attestation(reply.attestation, bundle, job_id=job_id, nonce=messages[i].nonce).rank

    await asyncio.gather(*(one(i) for i in range(64)))
    rest = [asyncio.ensure_future(one(i)) for i in range(64, PLAN.world_size)]  # in flight at the outage
    await outage(leader, standby)
    back = await asyncio.to_thread(
        wait_until, lambda: serving(leader.address) or serving(standby.address), 40, "a coordinator leads again"
    )
    await asyncio.gather(*rest)
    assert leader.process.poll() is None and standby.process.poll() is None, "a coordinator exited during the outage"
    assert sorted(answers.values()) == list(range(PLAN.world_size)), "a rank was lost or has two holders"
    again = [request(i, job_id) for i in range(PLAN.world_size)]
    replies = await asyncio.gather(*(register_with_failover(spec, m) for m in again))
    after = {
        i: verify_attestation(r.attestation, bundle, job_id=job_id, nonce=m.nonce).rank
        for i, (r, m) in enumerate(zip(replies, again))
    }
    assert after == answers, "an acknowledged rank changed across the outage"
    for coordinator in (leader, standby):
        assert "Traceback" not in coordinator.log(), coordinator.log()[-3000:]
    return back


async def test_both_coordinators_outlive_an_etcd_outage(ha_pair, etcd_server):
    """etcd frozen (SIGSTOP) past the lease in the middle of a rendezvous: the leader steps
    down and the standby loses etcd too; neither process exits or logs a traceback, and
    within 2 lease TTLs of etcd's return one of them leads again. Every answer recorded
    (before, during and after the outage) keeps its rank, and no rank has two holders."""

    async def freeze(leader, standby):
        os.kill(etcd_server.process.pid, signal.SIGSTOP)
        try:
            await asyncio.to_thread(wait_until, lambda: not serving(leader.address), 20, "the leader steps down")
            await asyncio.to_thread(
                wait_until,
                lambda: "etcd unavailable" in standby.log() and "etcd unavailable" in leader.log(),
                30,
                "both coordinators see etcd gone",
            )
            assert leader.process.poll() is None and standby.process.poll() is None
        finally:
            os.kill(etcd_server.process.pid, signal.SIGCONT)

    back = await _rendezvous_across_an_outage(ha_pair, "outage", freeze)
    assert back <= 2 * LEASE_TTL_S, f"a coordinator led again only {back:.1f}s after etcd returned"
    print(
        f"etcd outage: a coordinator led again {back:.1f}s after etcd came back; "
        f"{PLAN.world_size} answers, 0 lost, 0 doubled, 0 changed"
    )


async def test_a_coordinator_leads_again_within_two_ttls_of_etcd_restarting_after_a_10s_stop(ha_pair, etcd_server):
    """etcd stopped outright (SIGTERM) for 10 s in the middle of a rendezvous, then started
    again on the same data: no coordinator exits or logs a traceback, one leads again as soon
    as the old leader's restored lease has run out (TTL + 2 election timeouts after etcd
    serves again, plus one reconnect and lease check), and every recorded answer keeps its rank."""

    async def stop_and_restart(leader, standby):
        await asyncio.to_thread(etcd_server.stop)
        await asyncio.sleep(10)
        assert leader.process.poll() is None and standby.process.poll() is None
        await asyncio.to_thread(etcd_server.start)  # returns once etcd serves requests

    back = await _rendezvous_across_an_outage(ha_pair, "restart", stop_and_restart)
    bound = LEASE_TTL_S + 2 * ETCD_ELECTION_TIMEOUT_S + 1.0
    assert back <= bound, f"a coordinator led again only {back:.1f}s after etcd returned (bound {bound:g}s)"
    print(
        f"etcd stopped 10 s and restarted: a coordinator led again {back:.2f}s after etcd came back; "
        f"{PLAN.world_size} answers, 0 lost, 0 doubled, 0 changed"
    )


def test_garbage_in_etcd_stops_the_coordinator_naming_the_key(etcd_server, tmp_path):
    import aetcd

    async def plant():
        host, port = etcd_server.endpoint.rsplit(":", 1)
        async with aetcd.Client(host=host, port=int(port)) as client:
            # A single-job config is a cluster declaring its job: the cluster's log is read first.
            await client.put(b"/meshgate/cluster/meta", json.dumps({"schema": 2, "job_id": "cluster"}).encode())
            await client.put(b"/meshgate/cluster/events/000000000001", b"\x00 not json")

    asyncio.run(plant())
    config = tmp_path / "bad.toml"
    config.write_text(
        "\n".join(
            [
                "[job]",
                'id = "bad"',
                "slots_per_node = 4",
                "[plan]",
                "tp = 4",
                "[server]",
                f'listen = "127.0.0.1:{free_port()}"',
                "insecure = true",
                "[keys]",
                f'dir = "{tmp_path / "keys"}"',
                "[store]",
                'kind = "etcd"',
                f'endpoints = ["{etcd_server.endpoint}"]',
                "lease_ttl_s = 2",
            ]
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "meshgate.coordinator", "--config", str(config)],
        cwd=REPO,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "/meshgate/cluster/events/000000000001" in result.stderr
