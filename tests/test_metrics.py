"""Prometheus metrics: dedicated registries, the recording helpers, and a real scrape of
a coordinator's and an agent's /metrics while Registers and heartbeats happen."""

from __future__ import annotations

import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from types import SimpleNamespace

import grpc
import pytest

from conftest import REPO, worker_env, write_config
from meshgate import metrics
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb
from meshgate.v1 import rendezvous_pb2_grpc

PLAN = ParallelPlan(tp=2, dp_shard=2)


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.status == 200
        return response.read().decode()


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in the text exposition."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        metric, _, label_text = key.partition("{")
        if metric != name:
            continue
        have = ",".join(sorted(p for p in label_text.rstrip("}").split(",") if p))
        if have == want:
            return float(value)
    return None


# ---- unit ------------------------------------------------------------------------------------


def test_parse_listen():
    assert metrics.parse_listen("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert metrics.parse_listen(":9464") == ("0.0.0.0", 9464)
    assert metrics.parse_listen("[::1]:0") == ("::1", 0)
    for bad in ("9464", "host:port", "h:70000", 9464):
        with pytest.raises(ValueError):
            metrics.parse_listen(bad)


def test_helpers_are_no_ops_without_metrics():
    with metrics.use(None):
        metrics.observe_rpc("Register", "OK", 0.01)
        metrics.count_attestation_signed()
        metrics.count_nodes_lost(2)
        metrics.count_verify_failure("expired")
        metrics.count_agent_join("OK")


def test_several_registries_in_one_process():
    a, b = metrics.Metrics("coordinator"), metrics.Metrics("coordinator")
    agent = metrics.Metrics("agent", process_metrics=False)
    with metrics.use(a):
        metrics.observe_rpc("Register", "OK", 0.002)
        metrics.observe_rpc("Register", "OK", 0.003)
        metrics.observe_rpc("Register", "ALREADY_EXISTS", 0.001)
        metrics.observe_rpc("Join", "UNAUTHENTICATED", 0.001)
        metrics.count_attestation_signed(2)
        metrics.count_nodes_lost(1)
        metrics.count_nodes_lost(0)
        metrics.count_verify_failure("bad_signature")
        metrics.count_agent_join("OK")  # not an agent: ignored
    with metrics.use(agent):
        metrics.count_agent_join("UNAVAILABLE")
        metrics.count_agent_join("OK")
        metrics.count_agent_heartbeat("OK")
        metrics.count_verify_failure("expired")
        metrics.observe_rpc("Register", "OK", 1.0)  # not a coordinator: ignored
    assert a.value("meshgate_registers_total", {"code": "OK"}) == 2
    assert a.value("meshgate_registers_total", {"code": "ALREADY_EXISTS"}) == 1
    assert a.value("meshgate_register_latency_seconds_count", {"path": "direct"}) == 3
    assert a.value("meshgate_coordinator_requests_total", {"method": "Join", "code": "UNAUTHENTICATED"}) == 1
    assert a.value("meshgate_attestations_signed_total") == 2
    assert a.value("meshgate_heartbeat_misses_total") == 1
    assert a.value("meshgate_verify_failures_total", {"reason": "bad_signature"}) == 1
    assert b.value("meshgate_registers_total", {"code": "OK"}) is None  # untouched
    assert agent.value("meshgate_agent_joins_total", {"code": "OK"}) == 1
    assert agent.value("meshgate_agent_joins_total", {"code": "UNAVAILABLE"}) == 1
    assert agent.value("meshgate_agent_heartbeats_total", {"code": "OK"}) == 1
    assert agent.value("meshgate_verify_failures_total", {"reason": "expired"}) == 1
    assert "process_cpu_seconds_total" in a.scrape()
    assert "meshgate_registers_total" not in agent.scrape()


def test_gauges_read_state_at_scrape_time():
    """Gauges come from the coordinator's read model at every scrape (no probing of its
    internals): the rendezvous of the job a config declares, beside the cluster's jobs."""
    from meshgate.coordinator import readmodel
    from meshgate.coordinator.rendezvous import NodeJoined, RankAssigned

    from meshgate.coordinator.engine import Coordinator
    from meshgate.coordinator.keys import KeyRing
    from meshgate.coordinator.rendezvous import RendezvousConfig
    from meshgate.coordinator.store import MemoryStore
    from meshgate.plan import ParallelPlan
    import tempfile

    with tempfile.TemporaryDirectory() as keys:
        coordinator = Coordinator(
            RendezvousConfig("j", ParallelPlan(dp_shard=4), slots_per_node=2),
            MemoryStore(),
            KeyRing(keys, job_id="j"),
            attestation_ttl_s=60,
        )
    coordinator.state.apply_all(
        [
            NodeJoined("a", 0, 5.0),
            NodeJoined("b", 1, 5.0),
            RankAssigned("w0", 0, "a", 0, 5.0),
            RankAssigned("w1", 1, "a", 1, 5.0),
        ]
    )
    from meshgate.coordinator.cluster import cluster_of_engine
    from meshgate.coordinator.config import LaunchConfig, declared_spec

    target = {"now": cluster_of_engine(coordinator, declared_spec(coordinator.config, LaunchConfig()))}
    m = metrics.Metrics("coordinator", process_metrics=False)
    m.watch_coordinator(lambda: readmodel.gauges(target["now"]))
    assert m.value("meshgate_ranks_registered", {"job_id": "j"}) == 2
    assert m.value("meshgate_ranks_expected", {"job_id": "j"}) == 4
    assert m.value("meshgate_generation", {"job_id": "j"}) == 0
    assert m.value("meshgate_rendezvous_opened_timestamp_seconds", {"job_id": "j"}) == 5.0
    assert m.value("meshgate_nodes", {"state": "active"}) == 2
    assert m.value("meshgate_nodes", {"state": "left"}) == 0
    assert m.value("meshgate_jobs", {"state": "RUNNING"}) == 1  # the declared job, a job of the cluster
    coordinator.state.apply(RankAssigned("w2", 2, "b", 0, 6.0))
    assert m.value("meshgate_ranks_registered", {"job_id": "j"}) == 3
    # A standby holds no coordinator: the gauges are absent, the scrape still works.
    target["now"] = None
    assert m.value("meshgate_generation", {"job_id": "j"}) is None
    assert "meshgate_registers_total" in m.scrape()


def _cluster(tmp_path, nodes=("n0", "n1")):
    """A real ClusterCoordinator (logs in memory) whose pool holds ``nodes``, 2 slots each."""
    from meshgate.attestation import secret_hash
    from meshgate.coordinator.cluster import ClusterCoordinator
    from meshgate.coordinator.keys import KeyRing
    from meshgate.coordinator.rendezvous import JoinAuth
    from meshgate.coordinator.store import MemoryStore

    cluster = ClusterCoordinator(
        MemoryStore(),
        KeyRing(tmp_path / "keys"),
        lambda config: MemoryStore(),
        attestation_ttl_s=60,
        heartbeat_timeout_s=15,
        require_vouch=False,
        clock=lambda: 10.0,
    )
    state = cluster.state
    for node_id in nodes:
        state.apply_all(state.decide_create_token(secret_hash(node_id), 600, node_id, 10.0))
        state.apply_all(
            state.decide_join(
                node_id, node_id, 2, "cpu", {}, JoinAuth(node_id, public_key=bytes(32), new_credential_hash="h"), 10.0
            )
        )
    return cluster


def test_jobs_mode_gauges_count_jobs_and_nodes_by_state(tmp_path):
    from meshgate.coordinator import readmodel
    from meshgate.coordinator.jobs import OPERATOR
    from meshgate.coordinator.jobs import JobSpec

    cluster = _cluster(tmp_path)
    state = cluster.state
    state.apply_all(
        state.decide_submit(JobSpec.build(job_id="a", plan=ParallelPlan(dp_shard=2), num_nodes=1, command=("x",)), 10.0)
    )
    state.apply_all(
        state.decide_submit(
            JobSpec.build(job_id="b", plan=ParallelPlan(dp_shard=8), num_nodes=4, command=("x",)),
            10.0,
            wait_for_nodes=True,
        )
    )
    state.apply_all(state.decide_allocate(10.0))
    m = metrics.Metrics("coordinator", process_metrics=False)
    m.watch_coordinator(lambda: readmodel.gauges(cluster))
    assert m.value("meshgate_jobs", {"state": "RUNNING"}) == 1
    assert m.value("meshgate_jobs", {"state": "PENDING"}) == 1
    assert m.value("meshgate_jobs", {"state": "SUCCEEDED"}) == 0
    assert (m.value("meshgate_nodes", {"state": "idle"}), m.value("meshgate_nodes", {"state": "serving"})) == (1, 1)
    assert m.value("meshgate_ranks_expected", {"job_id": "b"}) is None  # pending: no rendezvous yet
    # only a node out of service has a meshgate_node_out series, naming it (what node alerts fire on)
    assert m.value("meshgate_node_out", {"node": "n0", "state": "serving"}) is None
    idle = next(n for n in state.nodes.values() if not n.job_id).node_id
    state.apply_all(state.decide_cordon(idle, "disk", OPERATOR, 10.0))
    assert m.value("meshgate_node_out", {"node": idle, "state": "cordoned"}) == 1


def test_job_end_states_are_the_ended_job_states():
    from meshgate.coordinator.jobs import JobState

    assert set(metrics.JOB_END_STATES) == {s.value for s in JobState if s.ended}


async def test_a_running_jobs_series_leave_metrics_when_it_ends_and_its_end_is_counted(tmp_path):
    """Per-job series exist for RUNNING jobs only: each ended job drops out at the next
    scrape, so their number is bounded by the jobs running, however many have run."""
    from meshgate.coordinator import readmodel
    from meshgate.coordinator.jobs import JobSpec

    cluster = _cluster(tmp_path, nodes=("n0", "n1", "n2"))
    m = metrics.Metrics("coordinator", process_metrics=False)
    m.watch_coordinator(lambda: readmodel.gauges(cluster))
    # There from the start, so that increase() sees the first failure as 0 -> 1.
    assert m.value("meshgate_jobs_ended_total", {"state": "FAILED"}) == 0
    with metrics.use(m):
        for job_id in ("a", "b"):
            await cluster.submit(
                JobSpec.build(job_id=job_id, plan=ParallelPlan(dp_shard=2), num_nodes=1, command=("x",))
            )
        assert m.value("meshgate_ranks_expected", {"job_id": "a"}) == 2
        assert m.value("meshgate_ranks_registered", {"job_id": "b"}) == 0
        assert m.value("meshgate_generation", {"job_id": "b"}) == 0
        await cluster.cancel("a", "done with it")
        await cluster.engines["b"].end("a worker broke")  # the engine decides the job failed ...
        await cluster.reconcile()  # ... and the cluster ends it, as its loop does
        text = m.scrape()
        for job_id in ("a", "b"):  # their rendezvous series are gone ...
            assert [line for line in text.splitlines() if f'job_id="{job_id}"' in line] == [
                f'meshgate_job_ended_timestamp_seconds{{job_id="{job_id}",state="{state}"}} 10.0'
                for state in ["CANCELLED" if job_id == "a" else "FAILED"]
            ]  # ... but for 10 minutes one series says how each ended, naming it (MeshgateJobFailed)
        assert m.value("meshgate_jobs_ended_total", {"state": "CANCELLED"}) == 1
        assert m.value("meshgate_jobs_ended_total", {"state": "FAILED"}) == 1
        assert m.value("meshgate_jobs_ended_total", {"state": "SUCCEEDED"}) == 0
        # A job running after them: its series, and none of theirs (their nodes are still
        # clearing until their agents report, so it runs on the third).
        await cluster.submit(JobSpec.build(job_id="c", plan=ParallelPlan(dp_shard=2), num_nodes=1, command=("x",)))
        assert re.findall(r'meshgate_ranks_expected\{job_id="([^"]+)"\}', m.scrape()) == ["c"]
    cluster.close()


def test_a_signing_failure_is_counted_and_raised(tmp_path):
    """The signer's key gone bad (its file replaced by one that is no key): the error the
    Register would be answered with is counted as a signing error, and raised on."""
    from meshgate.coordinator.engine import Signer
    from meshgate.coordinator.keys import KeyRing
    from meshgate.coordinator.rendezvous import Assignment, RegisterInput, RendezvousConfig

    keys = KeyRing(tmp_path / "keys", job_id="j")
    signer = Signer(RendezvousConfig("j", ParallelPlan(dp_shard=2), slots_per_node=2), keys, 60)
    m = metrics.Metrics("coordinator", process_metrics=False)
    with metrics.use(m):
        assignment = Assignment("w0", 0, "n0", 0, 0)
        request = RegisterInput("j", "w0", bytes(32), "n0", 0, None)
        signer.sign(assignment, request, 0, 1.0)
        assert (m.value("meshgate_attestations_signed_total"), m.value("meshgate_attestation_sign_errors_total")) == (
            1,
            0,
        )
        keys.active = None  # the key could not be (re)loaded
        with pytest.raises(Exception):
            signer.sign(assignment, request, 0, 1.0)
        with pytest.raises(Exception):
            signer.sign_batch(0, [b"payload"])
    assert m.value("meshgate_attestation_sign_errors_total") == 2
    assert m.value("meshgate_attestations_signed_total") == 1


def test_serve_on_a_free_port():
    m = metrics.Metrics("agent", process_metrics=False)
    # duck-typed as the Agent (its runner counts the launch's live workers: agent/launch.py);
    # the real one is scraped in tests/test_prometheus_pack.py
    agent = SimpleNamespace(generation=2, runner=SimpleNamespace(running=lambda: 1))
    m.watch_agent(agent)
    server = metrics.serve("127.0.0.1:0", m)
    try:
        text = scrape(server.url)
        assert sample(text, "meshgate_agent_generation") == 2
        assert sample(text, "meshgate_agent_workers_running") == 1
    finally:
        server.close()
    with pytest.raises(metrics.MetricsError):
        metrics.serve("not-an-address", m)


# ---- real processes --------------------------------------------------------------------------


def _metrics_url(log_text: str) -> str | None:
    match = re.search(r"metrics on (http://\S+/metrics)", log_text)
    return match.group(1) if match else None


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _register(stub, worker: str, node: str, local: int, job: str = "test"):
    request = pb.RegisterRequest(job_id=job, worker_id=worker, nonce=secrets.token_bytes(32), node_id=node)
    request.assigned.local_rank = local
    return stub.Register(request, timeout=10)


@pytest.mark.slow
def test_coordinator_and_agent_metrics_move(coordinator_factory, tmp_path):
    token = "metrics-test-token"
    running = coordinator_factory(
        PLAN,
        slots_per_node=2,
        job={"join_token": token, "heartbeat_interval_s": 0.2, "heartbeat_misses": 3},
        server={"metrics_listen": "127.0.0.1:0"},
    )
    url = _wait(lambda: _metrics_url(running.log()), 10, "the coordinator's metrics line")
    before = scrape(url)
    assert sample(before, "meshgate_ranks_expected", job_id="test") == 4
    assert sample(before, "meshgate_ranks_registered", job_id="test") == 0
    assert sample(before, "meshgate_generation", job_id="test") == 0
    assert sample(before, "meshgate_registers_total", code="OK") is None
    assert sample(before, "meshgate_serving") == 1

    # An agent (no launch command: it serves the node for external workers) with its own /metrics.
    agent_config = write_config(
        tmp_path / "agent.toml",
        {
            "agent": {
                "coordinator": running.address,
                "job": "test",
                "node_id": "node-a",
                "join_token": token,
                "slots": 2,
                "state_dir": str(tmp_path / "agent-state"),
                "insecure": True,
                "metrics_listen": "127.0.0.1:0",
            }
        },
    )
    agent_log = tmp_path / "agent.log"
    with open(agent_log, "wb") as out:
        agent = subprocess.Popen(
            [sys.executable, "-m", "meshgate.agent", "--config", str(agent_config)],
            cwd=REPO,
            env=worker_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        agent_url = _wait(lambda: _metrics_url(agent_log.read_text()), 15, "the agent's metrics line")
        _wait(
            lambda: (sample(scrape(agent_url), "meshgate_agent_heartbeats_total", code="OK") or 0) >= 2,
            15,
            "agent heartbeats",
        )
        agent_text = scrape(agent_url)
        assert sample(agent_text, "meshgate_agent_joins_total", code="OK") == 1
        assert sample(agent_text, "meshgate_agent_generation") == 0

        with grpc.insecure_channel(running.address) as channel:
            stub = rendezvous_pb2_grpc.RendezvousStub(channel)
            for local in range(2):
                _register(stub, f"node-a/local{local}", "node-a", local)
            _register(stub, "node-b/local0", "node-b", 0)
            with pytest.raises(grpc.RpcError) as refused:
                _register(stub, "x", "node-c", 0, job="other-job")
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND  # a job the cluster does not know

        after = scrape(url)
        assert sample(after, "meshgate_registers_total", code="OK") == 3
        assert sample(after, "meshgate_registers_total", code="NOT_FOUND") == 1
        assert sample(after, "meshgate_register_latency_seconds_count", path="direct") == 4
        assert sample(after, "meshgate_attestations_signed_total") == 3
        assert sample(after, "meshgate_ranks_registered", job_id="test") == 3
        assert sample(after, "meshgate_nodes", state="active") == 2
        assert sample(after, "meshgate_coordinator_requests_total", method="Join", code="OK") == 1
        assert (sample(after, "meshgate_coordinator_requests_total", method="NodeHeartbeat", code="OK") or 0) >= 2

        # Kill the agent without a goodbye: the node misses its heartbeats and is marked lost.
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=10)
        _wait(lambda: sample(scrape(url), "meshgate_heartbeat_misses_total") == 1, 15, "the lost node")
        final = scrape(url)
        assert sample(final, "meshgate_nodes", state="active") == 1
        assert (sample(final, "meshgate_nodes", state="lost") or 0) + (
            sample(final, "meshgate_nodes", state="replaced") or 0
        ) == 1
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()


def test_recently_ended_names_each_job_for_ten_minutes_and_stays_bounded():
    """The series MeshgateJobFailed reads: one per job that ended in the last 10 minutes, by
    id and state (so the alert names the job), none for older ones, at most the newest
    JOB_ENDED_SHOWN_MAX; a running job (ended_at 0) has none."""
    from types import SimpleNamespace as Job

    from meshgate.coordinator.cluster_state.model import JobState

    now = 10_000.0
    jobs = {
        "broken": Job(state=JobState.FAILED, ended_at=now - 30),
        "done": Job(state=JobState.SUCCEEDED, ended_at=now - metrics.JOB_ENDED_SHOWN_S),
        "old": Job(state=JobState.FAILED, ended_at=now - metrics.JOB_ENDED_SHOWN_S - 1),
        "running": Job(state=JobState.RUNNING, ended_at=0.0),
    }
    assert metrics.recently_ended(jobs, now) == {
        "broken": ("FAILED", now - 30),
        "done": ("SUCCEEDED", now - metrics.JOB_ENDED_SHOWN_S),
    }
    many = {f"j{i}": Job(state=JobState.CANCELLED, ended_at=now - i) for i in range(500)}
    shown = metrics.recently_ended(many, now)
    assert len(shown) == metrics.JOB_ENDED_SHOWN_MAX and "j0" in shown and "j499" not in shown
