"""Progress and stragglers (issue 34, item 6): workers report their step with
``meshgate.report``; their agents carry it on their heartbeats; `job show`, the timeline
and metrics show each job's step, its rate and the slowest node; a job whose step stops
advancing has a growing step age (the MeshgateJobStalled alert's series, named by job).

Real processes: an mTLS coordinator and two agents started as their shipped unit starts
them (tests/shipped.py), workers as each node's job user. Pure: the straggler, the rates
and the bounds of coordinator/progress.py, and the agent socket's checks."""

from __future__ import annotations

import re
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

import shipped
from conftest import REPO
from meshgate import views
from meshgate.agent_socket import ReportedProgress
from meshgate.coordinator.progress import JobProgress, check_samples
from meshgate.v1 import nodes_pb2
from meshgate.v1 import rendezvous_pb2 as pb
from shipped import ShippedCluster

shipped_host = shipped.shipped_host  # the fixture: users, interpreter, delegated cgroup

WORKER = str(REPO / "tests" / "workers" / "progress_worker.py")


# ---- pure --------------------------------------------------------------------------------------


def sample(local_rank: int, step: int, at: float, **extra) -> nodes_pb2.RankProgress:
    return nodes_pb2.RankProgress(local_rank=local_rank, step=step, at=at, **extra)


def test_a_nodes_rate_its_step_time_and_the_straggler_by_the_workers_own_step_times():
    job = JobProgress()
    for beat in range(1, 8):
        at = 100.0 + beat
        job.note("fast-a", 0, [sample(0, 10 * beat, at, step_time_s=0.1)], now=at)
        job.note("fast-b", 0, [sample(0, 10 * beat, at, step_time_s=0.11)], now=at)
        job.note("slow", 0, [sample(0, 10 * beat, at, step_time_s=0.2), sample(1, 10 * beat, at)], now=at)
    message = job.message(["fast-a", "fast-b", "slow"])
    assert (message.step, message.slowest_step, message.nodes_reporting) == (70, 70, 3)
    assert message.steps_per_s == pytest.approx(10.0)  # every node advances together (a synchronous job)
    assert (message.straggler, round(message.straggler_ratio, 2)) == ("slow", round(0.2 / 0.11, 2))
    assert message.last_step_at.ToSeconds() == 107


def test_without_own_step_times_the_straggler_is_the_node_whose_steps_come_slowest():
    job = JobProgress()
    for beat in range(0, 12):
        at = 10.0 + beat
        job.note("a", 0, [sample(0, 4 * beat, at)], now=at)
        job.note("b", 0, [sample(0, 4 * beat, at)], now=at)
        job.note("c", 0, [sample(0, beat, at)], now=at)  # a quarter of the pace
    message = job.message(["a", "b", "c"])
    assert (message.step, message.slowest_step) == (44, 11)
    assert message.straggler == "c" and message.straggler_ratio == pytest.approx(4.0)


def test_no_straggler_among_equals_or_alone_and_a_new_generation_starts_afresh():
    job = JobProgress()
    for beat in range(1, 5):
        job.note("a", 0, [sample(0, beat, float(beat), step_time_s=1.0)], now=beat)
        job.note("b", 0, [sample(0, beat, float(beat), step_time_s=1.1)], now=beat)
    assert job.message(["a", "b"]).straggler == ""  # 1.1x is within the median's 1.2x
    job.note("a", 1, [sample(0, 1, 9.0)], now=9)  # its workers began again in generation 1
    assert job.nodes["a"].step == 1 and job.nodes["a"].generation == 1
    alone = JobProgress()
    alone.note("a", 0, [sample(0, 5, 1.0, step_time_s=9.0)], now=1)
    assert alone.message(["a"]).straggler == ""


def test_bad_progress_from_an_agent_is_named_and_from_a_worker_refused_at_the_socket():
    assert check_samples([sample(0, 1, 1.0), sample(1, 2, 1.0)], slots=2) is None
    assert "local_rank 2 is not one of this node's 2" in check_samples([sample(2, 1, 1.0)], slots=2)
    assert "listed twice" in check_samples([sample(0, 1, 1.0), sample(0, 2, 1.0)], slots=2)
    assert "step_time_s -1.0" in check_samples([sample(0, 1, 1.0, step_time_s=-1.0)], slots=2)
    assert "loss nan" in check_samples([sample(0, 1, 1.0, loss=float("nan"))], slots=2)
    assert check_samples([sample(0, 1, 1.0, loss=-3.5)], slots=2) is None  # a loss may be negative
    parse = ReportedProgress.parse
    assert parse({"local_rank": 1, "step": 7, "loss": 2}, 8) == ReportedProgress(1, 7, loss=2.0)
    for bad, message in [
        ({"local_rank": 9, "step": 1}, "local_rank '9' out of range"),
        ({"local_rank": 0, "step": -1}, "step '-1'"),
        ({"local_rank": 0, "step": 1, "samples_per_s": -2}, "samples_per_s -2 is below 0"),
        ({"local_rank": 0, "step": 1, "loss": "low"}, "loss 'low' is not a finite number"),
        ({"local_rank": 0, "step": True}, "step 'True'"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse(bad, 8)


def test_report_does_nothing_without_an_agent_and_never_raises(monkeypatch):
    from meshgate import progress

    monkeypatch.delenv("MESHGATE_AGENT_SOCKET", raising=False)
    assert progress.report(1) is False
    monkeypatch.setenv("MESHGATE_AGENT_SOCKET", "/nonexistent/agent.sock")
    progress._REPORTER.sent_at = 0.0
    assert progress.report(2, loss=1.0) is False  # no agent there: logged once, not raised
    assert progress.report(-5) is False  # a bad step: not sent


# ---- real processes ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(shipped_host):
    with ShippedCluster(shipped_host, ("n0", "n1"), tls=True) as running:
        yield running


def scratch(cluster: ShippedCluster) -> Path:
    path = Path(tempfile.mkdtemp(prefix="progress-", dir=cluster.root))
    path.chmod(0o1777)  # the job users create nothing here, but read the release file
    return path


def metrics(cluster: ShippedCluster) -> str:
    with urllib.request.urlopen(cluster.metrics_url, timeout=5) as response:
        return response.read().decode()


def poll(what, until, timeout: float = 60.0, logs=None):
    deadline = time.monotonic() + timeout
    while True:
        value = what()
        if until(value):
            return value
        assert time.monotonic() < deadline, f"timed out; last: {str(value)[-1500:]}\n{logs() if logs else ''}"
        time.sleep(0.25)


@pytest.mark.slow
def test_a_jobs_steps_rate_and_slow_node_show_in_job_show_the_timeline_and_metrics(cluster, shipped_host):
    here = scratch(cluster)
    env = {
        "PROGRESS_STEP_S": "0.05",
        "PROGRESS_SLOW_S": "0.15",
        "PROGRESS_SLOW_RANK": "1",
        "PROGRESS_UNTIL": str(here / "release"),
    }
    cluster.submit("steps", [shipped_host.python, WORKER], env=env, nodes=2)
    info = poll(
        lambda: cluster.job("steps"),
        lambda i: i.status.progress.nodes_reporting == 2 and i.status.progress.steps_per_s > 0,
        logs=cluster.logs,
    )
    slow_node = next(n.node_id for n in info.status.nodes if n.first_rank == 1)
    progress = info.status.progress
    # its step time over the median node's: 0.15 / median(0.05, 0.15)
    assert progress.straggler == slow_node and progress.straggler_ratio == pytest.approx(1.5, rel=0.01)
    assert progress.step >= progress.slowest_step > 0 and progress.steps_per_s > 0
    assert progress.HasField("loss") and progress.samples_per_s > 0
    by_node = {n.node_id: n for n in info.status.nodes}
    assert by_node[slow_node].step_time_s == pytest.approx(0.15) and all(n.step > 0 for n in info.status.nodes)

    shown = views.render_job(views.job_dict(info, cluster.address))
    assert f"progress: step {progress.step}" in shown and f"straggler {slow_node}: step time 1.5x" in shown
    assert "STEP" in shown and "STEP TIME" in shown
    scraped = metrics(cluster)
    assert re.search(r'meshgate_job_step\{job_id="steps"\} \d+', scraped)
    assert f'meshgate_job_straggler_ratio{{job_id="steps",node="{slow_node}"}}' in scraped
    assert re.search(r'meshgate_job_step_age_seconds\{job_id="steps"\} [0-9.e-]+', scraped)
    from meshgate import admin

    timeline = admin.get_job_timeline(cluster.address, "steps", tls=cluster.admin_tls)
    assert any(e.moment == pb.TIMELINE_PROGRESS and f"straggler {slow_node}" in e.detail for e in timeline.entries)

    (here / "release").touch()
    ended = cluster.wait_ended("steps")
    assert ended.state == pb.SUCCEEDED, cluster.logs()
    assert ended.status.progress.step >= progress.step  # the last progress is kept in its summary
    assert 'meshgate_job_step{job_id="steps"}' not in metrics(cluster)  # an ended job's series go


@pytest.mark.slow
def test_a_job_whose_step_stops_advancing_shows_a_growing_step_age_named_by_its_id(cluster, shipped_host):
    here = scratch(cluster)
    env = {"PROGRESS_STEP_S": "0.05", "PROGRESS_SLOW_S": "0.05", "PROGRESS_STALL_AFTER": "10"}
    cluster.submit("stuck", [shipped_host.python, WORKER], env={**env, "PROGRESS_UNTIL": str(here / "go")}, nodes=2)

    def age() -> float:
        found = re.search(r'meshgate_job_step_age_seconds\{job_id="stuck"\} ([0-9.e+-]+)', metrics(cluster))
        return float(found.group(1)) if found else -1.0

    poll(age, lambda a: a >= 0)
    info = poll(lambda: cluster.job("stuck"), lambda i: i.status.progress.step == 10)
    assert poll(age, lambda a: a > 3.0, timeout=30) > 3.0  # the step stays at 10 while time passes
    assert cluster.job("stuck").status.progress.step == 10 == info.status.progress.step
    (here / "go").touch()
    assert cluster.wait_ended("stuck").state == pb.SUCCEEDED
