"""Prometheus metrics for the coordinator and the agent.

Each process builds one ``Metrics`` with its own ``CollectorRegistry`` (never the
global one, so tests can hold several in one process), installs it, and serves it:

    metrics = Metrics("coordinator")
    install(metrics)
    server = serve("127.0.0.1:9464", metrics)     # GET http://127.0.0.1:9464/metrics

Code anywhere records through the module functions (``observe_rpc``,
``count_attestation_signed``, ``count_nodes_lost``, ``count_verify_failure``, ...).
They do nothing when no ``Metrics`` is installed, so callers never check, and they
never import prometheus_client: importing this module is free. prometheus-client
itself (the ``metrics`` extra) is needed only to build a ``Metrics``.

Gauges that mirror state (registered and expected ranks, generation, nodes by state)
are read at scrape time through ``Metrics.gauge``, so nothing has to keep them in step.

Names (counters get ``_total`` on the wire):

| metric | kind | labels |
|---|---|---|
| meshgate_coordinator_requests_total | counter | method, code |
| meshgate_registers_total | counter | code |
| meshgate_register_latency_seconds | histogram | path (direct: Register; fan-in: an agent's RegisterBatch) |
| meshgate_attestations_signed_total | counter | |
| meshgate_attestation_sign_errors_total | counter | |
| meshgate_heartbeat_misses_total (nodes marked lost) | counter | |
| meshgate_jobs_ended_total | counter | state |
| meshgate_job_ended_timestamp_seconds | gauge | job_id, state (jobs ended in the last 10 minutes only) |
| meshgate_ranks_registered / meshgate_ranks_expected | gauge | job_id (running jobs only) |
| meshgate_generation / meshgate_rendezvous_opened_timestamp_seconds | gauge | job_id (running jobs only) |
| meshgate_job_step / _steps_per_second / _step_age_seconds | gauge | job_id (running jobs that report) |
| meshgate_job_straggler_ratio | gauge | job_id, node (one series per job, while a node stands out) |
| meshgate_nodes / meshgate_jobs | gauge | state |
| meshgate_node_out | gauge | node, state (pool nodes out of service only) |
| meshgate_serving | gauge | |
| meshgate_health_check | gauge | check |
| meshgate_agent_joins_total / meshgate_agent_heartbeats_total | counter | code |
| meshgate_agent_generation / meshgate_agent_workers_running | gauge | |
| meshgate_verify_failures_total | counter | reason |
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import contextlib
import logging
import threading
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

from meshgate.endpoints import join_host_port, split_host_port
from meshgate.extras import MissingExtra, require

log = logging.getLogger("meshgate.metrics")

ROLES = ("coordinator", "agent")
REGISTER_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)

# How long an ended job keeps its meshgate_job_ended_timestamp_seconds series (MeshgateJobFailed
# fires while it is there, naming the job), and at most how many such series a scrape shows
# (the newest): the label set stays bounded by the jobs ending in a window, not by all jobs.
JOB_ENDED_SHOWN_S = 600.0
JOB_ENDED_SHOWN_MAX = 200

# Which path a Register came by: a worker's own Register RPC, or an agent's RegisterBatch
# carrying its node's workers (fan_in = true, the shipped agent.toml).
REGISTER_PATHS = {"Register": "direct", "RegisterBatch": "fan-in"}

# The states a job ends in (JobState.ended; tests/test_metrics.py keeps them in step). Their
# counters exist from the start at 0, so the first failure is an increase() and not a new series.
JOB_END_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")

GaugeValue = Union[float, Mapping[Sequence[str], float]]


class MetricsError(RuntimeError):
    """Metrics cannot be served: the message says why (missing package, bad address)."""


class MetricsUnavailable(MetricsError):
    """prometheus-client is not installed."""


def parse_listen(listen: str) -> tuple[str, int]:
    """``"127.0.0.1:9464"``, ``"[::1]:9464"``, ``":9464"`` (all interfaces) -> (host, port)."""
    host, port = split_host_port(listen, "metrics_listen", listen=True)
    return host or "0.0.0.0", port


class Metrics:
    """One process's metrics, in a dedicated CollectorRegistry."""

    def __init__(self, role: str = "coordinator", *, process_metrics: bool = True) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        try:
            pc = require("prometheus_client", extra="metrics", feature="metrics_listen")
        except MissingExtra as exc:
            raise MetricsUnavailable(str(exc)) from None
        self.role = role
        # No `_created` series next to every counter: they double a scrape for nothing.
        pc.disable_created_metrics()
        self.registry = pc.CollectorRegistry(auto_describe=True)
        self._gauges: dict[str, tuple[str, tuple[str, ...], Callable[[], GaugeValue]]] = {}
        self._gauge_lock = threading.Lock()
        registry = self.registry
        self.verify_failures = pc.Counter(
            "meshgate_verify_failures",
            "Attestations refused by a verifier, by reason",
            ["reason"],
            registry=registry,
        )
        if role == "coordinator":
            self.requests = pc.Counter(
                "meshgate_coordinator_requests",
                "RPCs answered, by method and gRPC status code",
                ["method", "code"],
                registry=registry,
            )
            self.registers = pc.Counter(
                "meshgate_registers",
                "Register RPCs answered, by gRPC status code",
                ["code"],
                registry=registry,
            )
            self.register_latency = pc.Histogram(
                "meshgate_register_latency_seconds",
                "Time to answer a Register RPC (path=direct) or an agent's RegisterBatch (path=fan-in)",
                ["path"],
                buckets=REGISTER_BUCKETS,
                registry=registry,
            )
            for path in REGISTER_PATHS.values():  # from the start at 0, so rate() sees the first ones
                self.register_latency.labels(path)
            self.attestations_signed = pc.Counter(
                "meshgate_attestations_signed",
                "Attestations signed",
                registry=registry,
            )
            self.attestation_sign_errors = pc.Counter(
                "meshgate_attestation_sign_errors",
                "Attestations that could not be signed (the Register was answered with an error)",
                registry=registry,
            )
            self.heartbeat_misses = pc.Counter(
                "meshgate_heartbeat_misses",
                "Nodes marked lost after missing their heartbeats",
                registry=registry,
            )
            self.jobs_ended = pc.Counter(
                "meshgate_jobs_ended",
                "Jobs that ended, by the state they ended in",
                ["state"],
                registry=registry,
            )
            for state in JOB_END_STATES:
                self.jobs_ended.labels(state)
        else:
            self.joins = pc.Counter(
                "meshgate_agent_joins",
                "Join attempts, by gRPC status code",
                ["code"],
                registry=registry,
            )
            self.heartbeats = pc.Counter(
                "meshgate_agent_heartbeats",
                "NodeHeartbeat calls, by gRPC status code",
                ["code"],
                registry=registry,
            )
        registry.register(_GaugeCollector(self))
        if process_metrics:
            pc.ProcessCollector(registry=registry)

    # ---- gauges read at scrape time ------------------------------------------------------

    def gauge(
        self,
        name: str,
        documentation: str,
        read: Callable[[], GaugeValue],
        labels: Sequence[str] = (),
    ) -> None:
        """Expose ``read()`` at every scrape: a number, or {label values: number} when
        ``labels`` are given. A failing ``read`` drops the gauge from that scrape only."""
        with self._gauge_lock:
            self._gauges[name] = (documentation, tuple(labels), read)

    def watch_coordinator(self, view: Callable[[], Optional["CoordinatorGauges"]]) -> None:
        """Gauges from ``view()``, read at every scrape (the coordinator's read model builds
        it; this module does not import the coordinator). None (a standby) drops them from
        that scrape; a job's series (label ``job_id``) are there while the job runs."""

        def read(name: str) -> Any:
            gauges = view()
            if gauges is None:
                raise LookupError(name)  # no sample this scrape
            return getattr(gauges, name)

        def per_job(field: str) -> Callable[[], GaugeValue]:
            return lambda: {(job_id,): getattr(job, field) for job_id, job in read("running").items()}

        for name, field, documentation in (
            ("meshgate_ranks_registered", "ranks_registered", "Ranks registered in the job's current generation"),
            ("meshgate_ranks_expected", "ranks_expected", "Ranks the job's plan needs (world size)"),
            ("meshgate_generation", "generation", "The job's current generation"),
            (
                "meshgate_rendezvous_opened_timestamp_seconds",
                "opened_at",
                "When the job's first node joined (0: not yet)",
            ),
        ):
            self.gauge(name, f"{documentation}; running jobs only", per_job(field), labels=("job_id",))

        def progressed(name: str) -> Callable[[], GaugeValue]:
            return lambda: {(job_id,): getattr(p, name) for job_id, p in read("progress").items()}

        for name, field_name, documentation in (
            ("meshgate_job_step", "step", "The furthest step the job's workers reported (meshgate.report)"),
            ("meshgate_job_steps_per_second", "steps_per_s", "The median node's steps per second"),
            ("meshgate_job_step_age_seconds", "step_age_s", "Seconds since the job's step last advanced"),
        ):
            self.gauge(name, f"{documentation}; running jobs that report only", progressed(field_name), ("job_id",))
        self.gauge(
            "meshgate_job_straggler_ratio",
            "The job's slowest node's step time over the median node's, when it stands out (>= 1.2); "
            "running jobs that report only",
            lambda: {(j, p.straggler): p.straggler_ratio for j, p in read("progress").items() if p.straggler},
            labels=("job_id", "node"),
        )
        self.gauge(
            "meshgate_job_ended_timestamp_seconds",
            "When the job ended, by the state it ended in; jobs ended in the last 10 minutes only",
            lambda: {(job_id, state): at for job_id, (state, at) in read("ended").items()},
            labels=("job_id", "state"),
        )
        self.gauge(
            "meshgate_nodes", "Nodes by state", lambda: {(k,): v for k, v in read("nodes").items()}, labels=("state",)
        )
        self.gauge(
            "meshgate_node_out",
            "1 for each pool node out of service: left (lost or drained), draining, cordoned, quarantined or "
            "unhealthy (the series node alerts name it by; idle and serving nodes have none)",
            lambda: {key: 1.0 for key in read("out")},
            labels=("node", "state"),
        )
        self.gauge(
            "meshgate_node_agent_versions",
            "Nodes by their agent's release and wire contract version (meshgate nodes, AGENT)",
            lambda: dict(read("agent_versions")),
            labels=("release", "wire"),
        )
        self.gauge(
            "meshgate_jobs",
            "Jobs by state",
            lambda: {(k,): v for k, v in read("jobs").items()},
            labels=("state",),
        )

    def watch_agent(self, agent: Any) -> None:
        """Gauges from an meshgate.agent.daemon.Agent (duck-typed)."""
        self.gauge("meshgate_agent_generation", "Generation the agent last saw", lambda: agent.generation)

        def running() -> float:
            return agent.runner.running()  # the workers of the generation launched now

        self.gauge("meshgate_agent_workers_running", "Worker processes running", running)

    def scrape(self) -> str:
        """The text exposition, as GET /metrics answers it."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def value(self, name: str, labels: Optional[Mapping[str, str]] = None) -> Optional[float]:
        """One sample's value (for tests and tools), None if absent."""
        return self.registry.get_sample_value(name, dict(labels or {}))


class _GaugeCollector:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self):  # auto_describe: nothing to check for clashes at registration
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        with self.metrics._gauge_lock:
            gauges = list(self.metrics._gauges.items())
        for name, (documentation, labels, read) in gauges:
            try:
                value = read()
                family = GaugeMetricFamily(name, documentation, labels=list(labels))
                if labels:
                    for label_values, number in dict(value).items():
                        family.add_metric([str(v) for v in label_values], float(number))
                else:
                    family.add_metric([], float(value))
            except Exception:  # noqa: BLE001 - one broken gauge must not break the scrape
                log.debug("gauge %s failed", name, exc_info=True)
                continue
            yield family


# ---- the process's Metrics --------------------------------------------------------------

_active: Optional[Metrics] = None


def install(metrics: Optional[Metrics]) -> Optional[Metrics]:
    """Make ``metrics`` the process's metrics (None: stop recording); returns the previous."""
    global _active
    previous, _active = _active, metrics
    return previous


def current() -> Optional[Metrics]:
    return _active


@contextlib.contextmanager
def use(metrics: Optional[Metrics]) -> Iterator[Optional[Metrics]]:
    """Install ``metrics`` for the duration of a block (tests)."""
    previous = install(metrics)
    try:
        yield metrics
    finally:
        install(previous)


# ---- recording: no-ops without an installed Metrics ---------------------------------------


def observe_rpc(method: str, code: str, seconds: float) -> None:
    """The coordinator answered ``method`` with ``code`` ("OK", "UNAUTHENTICATED", ...)."""
    m = _active
    if m is None or m.role != "coordinator":
        return
    m.requests.labels(method, code).inc()
    path = REGISTER_PATHS.get(method)
    if path is not None:
        if path == "direct":
            m.registers.labels(code).inc()
        m.register_latency.labels(path).observe(seconds)


def count_attestation_signed(n: int = 1) -> None:
    m = _active
    if m is not None and m.role == "coordinator":
        m.attestations_signed.inc(n)


class _SignErrorsCounted:
    """Around signing an attestation: an exception out of it is counted, then raised on.
    A class, not a generator: it wraps every Register, and is about 6x cheaper so."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if kind is not None and issubclass(kind, Exception):
            m = _active
            if m is not None and m.role == "coordinator":
                m.attestation_sign_errors.inc()
        return False


_SIGN_ERRORS_COUNTED = _SignErrorsCounted()


def sign_errors_counted() -> _SignErrorsCounted:
    return _SIGN_ERRORS_COUNTED


def count_job_ended(state: str) -> None:
    """A job ended in ``state`` (a JobState value: "SUCCEEDED", "FAILED", "CANCELLED")."""
    m = _active
    if m is not None and m.role == "coordinator":
        m.jobs_ended.labels(state).inc()


def count_nodes_lost(n: int = 1) -> None:
    """Nodes marked lost after missing heartbeats."""
    m = _active
    if m is not None and m.role == "coordinator" and n:
        m.heartbeat_misses.inc(n)


def count_verify_failure(reason: str) -> None:
    """A verifier refused an attestation; ``reason`` is AttestationError.reason
    ("bad_signature", "expired", "wrong_generation", ...)."""
    m = _active
    if m is not None:
        m.verify_failures.labels(reason or "invalid").inc()


def count_agent_join(code: str) -> None:
    m = _active
    if m is not None and m.role == "agent":
        m.joins.labels(code).inc()


def count_agent_heartbeat(code: str) -> None:
    m = _active
    if m is not None and m.role == "agent":
        m.heartbeats.labels(code).inc()


# ---- serving /metrics ----------------------------------------------------------------------


class MetricsServer:
    """prometheus-client's HTTP server on a daemon thread; ``address`` is HOST:PORT bound."""

    def __init__(self, httpd, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread
        host, port = httpd.server_address[:2]
        self.host, self.port = host, port
        self.address = join_host_port(host, port)
        self.url = f"http://{self.address}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def serve(listen: str, metrics: Metrics) -> MetricsServer:
    """Serve ``metrics`` at http://LISTEN/metrics (port 0: any free port; see .address)."""
    from prometheus_client import start_http_server

    try:
        host, port = parse_listen(listen)
        httpd, thread = start_http_server(port, addr=host, registry=metrics.registry)
    except ValueError as exc:
        raise MetricsError(str(exc)) from None
    except OSError as exc:
        raise MetricsError(f"metrics_listen {listen!r}: cannot bind: {exc.strerror or exc}") from exc
    return MetricsServer(httpd, thread)


@dataclass(frozen=True)
class JobGauges:
    """One running job's rendezvous at one scrape."""

    ranks_registered: float
    ranks_expected: float
    generation: float
    opened_at: float


@dataclass(frozen=True)
class ProgressGauges:
    """What one running job's workers reported (meshgate.report) at one scrape."""

    step: float
    steps_per_s: float
    step_age_s: float  # since its step last advanced
    straggler: str  # "" when no node stands out
    straggler_ratio: float


@dataclass(frozen=True)
class CoordinatorGauges:
    """What a coordinator's gauges show at one scrape: the cluster's jobs by JobState, its
    nodes by state (the pool's PoolState, and a declared job's nodes by NodeState), and the
    rendezvous of each RUNNING job by id (the declared one too), so a job's series leave
    /metrics when it ends and their number stays bounded by the jobs running."""

    nodes: Mapping[str, float]
    jobs: Mapping[str, float]
    running: Mapping[str, JobGauges]
    progress: Mapping[str, ProgressGauges] = dataclasses.field(default_factory=dict)  # running jobs that report
    # Nodes by their agent's (release, wire version), as each last called (meshgate/wire.py).
    agent_versions: Mapping[tuple[str, str], float] = dataclasses.field(default_factory=dict)
    # (node id, state) of each pool node out of service (OUT_OF_SERVICE): what node alerts name
    out: tuple[tuple[str, str], ...] = ()
    # job id -> (the state it ended in, when): the jobs ended in the last JOB_ENDED_SHOWN_S
    ended: Mapping[str, tuple[str, float]] = dataclasses.field(default_factory=dict)


def recently_ended(jobs: Mapping[str, Any], now: float) -> dict[str, tuple[str, float]]:
    """Of ``jobs`` (job id -> a cluster_state Job: state, ended_at), those that ended within
    JOB_ENDED_SHOWN_S of ``now``, the newest JOB_ENDED_SHOWN_MAX of them. Pure."""
    recent = [(job_id, job) for job_id, job in jobs.items() if job.ended_at and now - job.ended_at <= JOB_ENDED_SHOWN_S]
    recent.sort(key=lambda item: item[1].ended_at, reverse=True)
    return {job_id: (job.state.value, job.ended_at) for job_id, job in recent[:JOB_ENDED_SHOWN_MAX]}


def start(role: str, listen: str, subject: Any = None) -> tuple[Metrics, MetricsServer]:
    """Build the process's Metrics for ``role``, watch ``subject`` (for the coordinator a
    callable returning CoordinatorGauges, for the agent the Agent) for its gauges, serve
    it on ``listen`` and install it. Raises MetricsError."""
    m = Metrics(role)
    if subject is not None:
        (m.watch_coordinator if role == "coordinator" else m.watch_agent)(subject)
    server = serve(listen, m)
    install(m)
    log.info("metrics on %s", server.url, extra={"event": "metrics_serving", "url": server.url})
    return m, server


__all__ = [
    "CoordinatorGauges",
    "JOB_END_STATES",
    "JobGauges",
    "ProgressGauges",
    "Metrics",
    "MetricsError",
    "MetricsServer",
    "MetricsUnavailable",
    "count_agent_heartbeat",
    "count_agent_join",
    "count_attestation_signed",
    "count_job_ended",
    "count_nodes_lost",
    "count_verify_failure",
    "current",
    "install",
    "observe_rpc",
    "parse_listen",
    "recently_ended",
    "serve",
    "sign_errors_counted",
    "start",
    "use",
]
