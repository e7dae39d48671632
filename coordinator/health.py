"""The coordinator's health, as the standard gRPC health service reports it.

SERVING only when the coordinator can serve: every check passes. The checks are

- ``coordinator.store``: the cluster's log and every open job log take writes (``Store.healthy()``);
- ``coordinator.keys``: the signing key is loaded;
- ``coordinator.resources``: file descriptors and memory to spare (coordinator/resources.py), and
  every running job's log open: NOT_SERVING before running out breaks a call;
- ``coordinator.leader``: this process holds the cluster (service.CoordinatorSlot), i.e.
  it is the leader, not a standby;

and others join through ``HealthMonitor.add_check``.
Each check is also a health service name of its own, so ``grpc_health_probe
-service coordinator.store`` says which part failed; the overall name ``""`` and every
meshgate service name follow the conjunction.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Iterable

from grpc_health.v1 import health_pb2

from meshgate.coordinator.config import ConfigError
from meshgate.coordinator import readmodel, resources
from meshgate.coordinator.cluster import ClusterCoordinator
from meshgate.coordinator.service import SERVICE_NAMES, CoordinatorSlot, Served, slot_of
from meshgate import logs, metrics

log = logging.getLogger("meshgate.coordinator")

STORE_CHECK = "coordinator.store"
KEYS_CHECK = "coordinator.keys"
LEADER_CHECK = "coordinator.leader"
RESOURCES_CHECK = "coordinator.resources"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

Check = Callable[[], bool]


def _resolve(slot: CoordinatorSlot) -> ClusterCoordinator | None:
    """The cluster a slot holds (None on a standby)."""
    return slot.coordinator


def store_healthy(slot: CoordinatorSlot) -> bool:
    cluster = _resolve(slot)
    if cluster is None:
        return True  # a standby: the leader check speaks for it
    return bool(cluster.store.healthy()) and cluster.job_engines.stores_healthy()  # declared by the Store seam


def store_refusal(slot: CoordinatorSlot) -> str:
    """Why the cluster's log or a job's cannot take writes ("" when they can, or on a standby)."""
    cluster = _resolve(slot)
    if cluster is None:
        return ""
    try:
        return cluster.store.refusal() or cluster.job_engines.store_refusal() or "the store cannot take writes"
    except Exception as exc:  # noqa: BLE001 - as a raising check: it cannot take writes
        return f"the store cannot take writes ({type(exc).__name__}: {str(exc)[:200]})"


def keys_loaded(slot: CoordinatorSlot) -> bool:
    cluster = _resolve(slot)
    if cluster is None:
        return True
    key = cluster.keys.active
    return key is not None and bool(key.key_id)


_short = ""  # what resources_left last found short, so that it logs once per episode


def resources_left(slot: CoordinatorSlot) -> bool:
    """Descriptors and memory to spare, and no running job waiting for its log to open."""
    global _short
    short = resources.descriptors_short() or resources.memory_short()
    if short and not _short:
        log.warning("health: %s", short)
    _short = short
    if short:
        return False
    cluster = _resolve(slot)
    return cluster is None or not cluster.unopened  # a running job's log waits to open


def default_checks(served: Served) -> dict[str, Check]:
    """The checks of what a server serves (service.slot_of: a slot, a cluster, or an engine)."""
    slot = slot_of(served)
    return {
        STORE_CHECK: lambda: store_healthy(slot),
        KEYS_CHECK: lambda: keys_loaded(slot),
        RESOURCES_CHECK: lambda: resources_left(slot),
        LEADER_CHECK: lambda: _resolve(slot) is not None,
    }


def evaluate(checks: dict[str, Check]) -> dict[str, bool]:
    """Run every check; one that raises counts as failed."""
    results = {}
    for name, check in checks.items():
        try:
            results[name] = bool(check())
        except Exception as exc:  # noqa: BLE001 - a failing probe is an unhealthy answer
            log.warning("health check %s raised %s: %s", name, type(exc).__name__, exc)
            results[name] = False
    return results


def can_serve(coordinator: Served) -> bool:
    """True when the coordinator can serve: store open, key loaded, resources to spare,
    and it is the leader."""
    return all(evaluate(default_checks(coordinator)).values())


class HealthMonitor:
    """Keeps a grpc health servicer in step with the checks."""

    def __init__(
        self,
        coordinator: Any,
        health_servicer: Any,
        *,
        service_names: Iterable[str] = SERVICE_NAMES,
        interval_s: float = 1.0,
    ) -> None:
        self.health_servicer = health_servicer
        self.service_names = ("",) + tuple(service_names)
        self.interval_s = interval_s
        self.slot = slot_of(coordinator)
        self.checks: dict[str, Check] = default_checks(self.slot)
        self.results: dict[str, bool] = {}
        self.serving: bool | None = None
        m = metrics.current()
        if m is not None:
            m.gauge(
                "meshgate_serving", "1 when the health service reports SERVING", lambda: 1.0 if self.serving else 0.0
            )
            m.gauge(
                "meshgate_health_check",
                "1 while the health check passes (coordinator.leader: this process leads)",
                lambda: {(name,): float(ok) for name, ok in self.results.items()},
                labels=("check",),
            )

    def add_check(self, name: str, check: Check) -> None:
        self.checks[name] = check

    async def update(self) -> bool:
        """Run the checks once and publish them; returns whether the coordinator serves."""
        results = evaluate(self.checks)
        serving = all(results.values())
        # While the store check fails, calls that would write are refused (service.writes),
        # named by why: an answer never runs ahead of what the store holds.
        self.slot.unwritable = "" if results.get(STORE_CHECK, True) else store_refusal(self.slot)
        for name, ok in results.items():
            if self.results.get(name) != ok:
                await self.health_servicer.set(name, SERVING if ok else NOT_SERVING)
        if serving != self.serving:
            for name in self.service_names:
                await self.health_servicer.set(name, SERVING if serving else NOT_SERVING)
            failed = sorted(name for name, ok in results.items() if not ok)
            if serving:
                log.info("health: SERVING", extra=logs.event_fields(name="health", serving=True))
            elif self.serving is None:  # the first publish, e.g. a standby or one starting up
                log.info(
                    "health: NOT_SERVING yet (waiting on: %s)",
                    ", ".join(failed),
                    extra=logs.event_fields(name="health", serving=False, failed=failed),
                )
            else:
                log.warning(
                    "health: NOT_SERVING (failed: %s)",
                    ", ".join(failed),
                    extra=logs.event_fields(name="health", serving=False, failed=failed),
                )
        self.results, self.serving = results, serving
        return serving

    async def run(self) -> None:
        """Update now, then every ``interval_s`` until cancelled."""
        while True:
            await self.update()
            await asyncio.sleep(self.interval_s)


class Operations:
    """The operator endpoints of one coordinator process: the health checks, and
    /metrics when ``metrics_listen`` is set (its Metrics is installed process-wide)."""

    def __init__(
        self,
        coordinator: Any,
        health_servicer: Any,
        *,
        metrics_listen: str = "",
        interval_s: float = 1.0,
    ) -> None:
        self.metrics: metrics.Metrics | None = None
        self.metrics_server: metrics.MetricsServer | None = None
        slot = slot_of(coordinator)
        if metrics_listen:
            try:
                self.metrics, self.metrics_server = metrics.start(
                    "coordinator", metrics_listen, lambda: readmodel.gauges(_resolve(slot))
                )
            except metrics.MetricsError as exc:
                raise ConfigError(f"[server] {exc}") from exc
        self.monitor = HealthMonitor(slot, health_servicer, interval_s=interval_s)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Publish the health now, then keep it current."""
        await self.monitor.update()
        self._task = asyncio.create_task(self.monitor.run())

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.metrics_server is not None:
            self.metrics_server.close()
            if metrics.current() is self.metrics:
                metrics.install(None)


__all__ = [
    "HealthMonitor",
    "KEYS_CHECK",
    "LEADER_CHECK",
    "RESOURCES_CHECK",
    "Operations",
    "STORE_CHECK",
    "can_serve",
    "evaluate",
]
