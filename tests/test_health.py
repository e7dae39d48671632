"""gRPC health: SERVING only while the coordinator can serve (store healthy, key loaded,
leader under HA); NOT_SERVING, with the failing check named, as soon as it cannot."""

from __future__ import annotations

import grpc
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshgate.coordinator import health
from meshgate.coordinator.engine import Coordinator
from meshgate.coordinator.keys import KeyRing
from meshgate.coordinator.rendezvous import RendezvousConfig
from meshgate.coordinator.service import SERVICE_NAMES, build_server
from meshgate.coordinator.store import MemoryStore
from meshgate import metrics
from meshgate.plan import ParallelPlan

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class FlakyStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.ok = True

    def healthy(self) -> bool:
        return self.ok


@pytest_asyncio.fixture
async def served(tmp_path):
    store = FlakyStore()
    config = RendezvousConfig(job_id="j", plan=ParallelPlan(tp=2), slots_per_node=2)
    coordinator = Coordinator(config, store, KeyRing(tmp_path / "keys", job_id="j"), attestation_ttl_s=60)
    server, health_servicer = build_server(coordinator)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield coordinator, store, health_servicer, health_pb2_grpc.HealthStub(channel)
    await channel.close()
    await server.stop(None)


async def check(stub, service: str = "") -> int:
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return reply.status


async def test_health_follows_the_store(served):
    coordinator, store, health_servicer, stub = served
    assert health.can_serve(coordinator)
    monitor = health.HealthMonitor(coordinator, health_servicer)
    assert await monitor.update() is True
    assert await check(stub) == SERVING
    assert await check(stub, health.STORE_CHECK) == SERVING
    for name in SERVICE_NAMES:
        assert await check(stub, name) == SERVING

    store.ok = False
    assert not health.can_serve(coordinator)
    assert await monitor.update() is False
    assert await check(stub) == NOT_SERVING
    assert await check(stub, health.STORE_CHECK) == NOT_SERVING
    assert await check(stub, health.KEYS_CHECK) == SERVING  # says which part failed
    for name in SERVICE_NAMES:
        assert await check(stub, name) == NOT_SERVING

    store.ok = True
    assert await monitor.update() is True
    assert await check(stub) == SERVING


async def test_a_raising_check_and_a_missing_key_count_as_unhealthy(served):
    coordinator, store, health_servicer, stub = served

    def broken() -> bool:
        raise OSError("disk gone")

    store.healthy = broken
    monitor = health.HealthMonitor(coordinator, health_servicer)
    assert await monitor.update() is False
    assert monitor.results[health.STORE_CHECK] is False
    del store.healthy
    coordinator.keys.active = None
    assert await monitor.update() is False
    assert monitor.results == {
        health.STORE_CHECK: True,
        health.KEYS_CHECK: False,
        health.RESOURCES_CHECK: True,
        health.LEADER_CHECK: True,
    }
    assert await check(stub) == NOT_SERVING


async def test_standby_slot_is_not_serving_and_extra_checks_join(served):
    coordinator, store, health_servicer, stub = served
    from meshgate.coordinator.service import CoordinatorSlot, slot_of

    slot = CoordinatorSlot(None)
    monitor = health.HealthMonitor(slot, health_servicer)
    assert await monitor.update() is False
    assert monitor.results[health.LEADER_CHECK] is False
    slot.coordinator = slot_of(coordinator).coordinator  # elected: its cluster, the engine's job declared
    assert await monitor.update() is True
    monitor.add_check("custom", lambda: False)
    assert await monitor.update() is False
    assert await check(stub, "custom") == NOT_SERVING


async def test_serving_gauge(served):
    coordinator, store, health_servicer, stub = served
    m = metrics.Metrics("coordinator", process_metrics=False)
    with metrics.use(m):
        monitor = health.HealthMonitor(coordinator, health_servicer)
        await monitor.update()
        assert m.value("meshgate_serving") == 1
        assert m.value("meshgate_health_check", {"check": health.STORE_CHECK}) == 1
        assert m.value("meshgate_health_check", {"check": health.LEADER_CHECK}) == 1
        store.ok = False
        await monitor.update()
        assert m.value("meshgate_serving") == 0
        assert m.value("meshgate_health_check", {"check": health.STORE_CHECK}) == 0  # which check: the alerts' input
        assert m.value("meshgate_health_check", {"check": health.KEYS_CHECK}) == 1
