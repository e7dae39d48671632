"""The Prometheus pack in deploy/prometheus: promtool checks and unit-tests the alert rules,
and a real Prometheus scraping a real coordinator and two agents answers every query of
the Grafana dashboard with data while a job runs, then drops the job's series once it ended,
and fires MeshgateJobFailed when a job fails.

promtool and prometheus are Debian's ``prometheus`` package (.ci/run installs it); without
them these tests skip, saying so.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import REPO, _spawn, _wait_for_address, free_port, start_agent, write_config

PACK = REPO / "deploy" / "prometheus"
ALERTS = PACK / "alerts.yml"
DASHBOARD = PACK / "grafana-dashboard.json"
OPERATING = REPO / "docs" / "operating.md"
LIGHT = [sys.executable, str(REPO / "tests" / "light_worker.py")]
ENDED = "meshgate_job_ended_timestamp_seconds"
_SHIPPED_AGENT = tomllib.loads((REPO / "deploy" / "systemd" / "agent.toml").read_text())["agent"]


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (Debian: apt-get install --no-install-recommends prometheus)")
    return path


def _promtool(*argv: str) -> str:
    result = subprocess.run([_tool("promtool"), *argv], cwd=PACK, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"promtool {' '.join(argv)}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _alerts() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def _targets() -> list[tuple[str, str]]:
    """(panel title, expr) of every query of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


# ---- the rules, with promtool -------------------------------------------------------------


def test_promtool_checks_the_rules_and_the_sample_config():
    assert f"SUCCESS: {len(_alerts())} rules found" in _promtool("check", "rules", "alerts.yml")
    _promtool("check", "config", "prometheus.yml")  # it names alerts.yml: checked again through it


def test_promtool_unit_tests_of_the_rules_pass():
    assert "SUCCESS" in _promtool("test", "rules", "alerts_test.yml")


def test_every_alert_says_what_to_do_and_is_tested_firing_and_quiet():
    """Each alert has a summary and a description naming a remedy, a section of its own in
    docs/operating.md, and unit tests where it fires and where it stays quiet."""
    tests = yaml.safe_load((PACK / "alerts_test.yml").read_text())["tests"]
    cases = [case for test in tests for case in test["alert_rule_test"]]
    operating = OPERATING.read_text()
    names = [rule["alert"] for rule in _alerts()]
    assert len(names) == len(set(names)) == 12
    for rule in _alerts():
        name = rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert rule["annotations"]["summary"] and len(rule["annotations"]["description"]) > 80, name
        assert f"`{name}`" in operating, f"{name} has no entry in docs/operating.md"
        mine = [case for case in cases if case["alertname"] == name]
        assert any(case.get("exp_alerts") for case in mine), f"{name}: no test where it fires"
        assert any(not case.get("exp_alerts") for case in mine), f"{name}: no test where it stays quiet"


def test_the_dashboard_is_grafana_json_whose_queries_name_only_metrics_meshgate_serves():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "meshgate" and dashboard["templating"]["list"][0]["type"] == "datasource"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    from meshgate import metrics

    served = set(re.findall(r"meshgate_\w+", metrics.__doc__))  # its table of every metric
    for title, expr in _targets():
        for name in re.findall(r"\b(meshgate_\w+?)(?:_bucket|_total)?\b", expr):
            assert name in served or f"{name}_total" in served, f"{title!r}: {name} is not a meshgate metric"


# ---- a real Prometheus, a real cluster ----------------------------------------------------


class Prometheus:
    """A Prometheus process of our own (never the system service) in a temp dir."""

    def __init__(self, root: Path, coordinator: str, agents: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        shutil.copy(ALERTS, root / "alerts.yml")
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": ["alerts.yml"],
            "scrape_configs": [
                {"job_name": "meshgate-coordinator", "static_configs": [{"targets": [coordinator]}]},
                {"job_name": "meshgate-agent", "static_configs": [{"targets": agents}]},
            ],
        }
        (root / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log_path = root / "prometheus.log"
        self.started = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [
                    _tool("prometheus"),
                    f"--config.file={root / 'prometheus.yml'}",
                    f"--storage.tsdb.path={root / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                cwd=root,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def api(self, path: str, **params: str):
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as response:
            reply = json.loads(response.read())
        assert reply["status"] == "success", reply
        return reply["data"]

    def query(self, expr: str) -> list:
        return self.api("query", query=expr)["result"]

    def wait(self, what: str, predicate, timeout: float = 90):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"prometheus exited:\n{self.log_path.read_text()[-3000:]}"
            try:
                value = predicate()
            except OSError:  # not listening yet
                value = None
            if value:
                return value
            time.sleep(0.25)
        raise AssertionError(
            f"prometheus: timed out after {timeout}s waiting for {what}\n{self.log_path.read_text()[-3000:]}"
        )

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def _wait(what: str, predicate, timeout: float = 90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.mark.slow
def test_every_dashboard_query_returns_data_from_a_real_prometheus_scraping_a_real_cluster(tmp_path):
    from meshgate import admin
    from meshgate.job_cli import spec_message
    from meshgate.plan import ParallelPlan
    from meshgate.v1 import rendezvous_pb2 as pb

    _tool("prometheus")
    coordinator_metrics = f"127.0.0.1:{free_port()}"
    config = write_config(
        tmp_path / "coordinator.toml",
        {
            "server": {"listen": "127.0.0.1:0", "insecure": True, "metrics_listen": coordinator_metrics},
            "keys": {"dir": str(tmp_path / "keys")},
            "store": {"dir": str(tmp_path / "state")},
            # Ten misses (5 s) before a node is lost: a loaded CI host must not fire MeshgateNodeLost.
            "cluster": {"heartbeat_interval_s": 0.5, "heartbeat_misses": 10},
        },
    )
    coordinator = _spawn(config, tmp_path / "coordinator.addr", tmp_path / "coordinator.log")
    agents: list[subprocess.Popen] = []
    prometheus = None
    try:
        address = _wait_for_address(coordinator, tmp_path / "coordinator.addr", tmp_path / "coordinator.log", 30)
        agent_metrics = []
        for node_id in ("n0", "n1"):
            token = admin.create_join_token(address, "", node_id=node_id, tls=False).token
            agent_metrics.append(f"127.0.0.1:{free_port()}")
            agents.append(  # fan_in as shipped: workers' Registers reach the coordinator in batches
                start_agent(
                    tmp_path,
                    address,
                    node_id,
                    job="",
                    join_token=token,
                    metrics_listen=agent_metrics[-1],
                    fan_in=_SHIPPED_AGENT["fan_in"],
                )
            )
        prometheus = Prometheus(tmp_path, coordinator_metrics, agent_metrics)

        def every_target_up():
            targets = prometheus.api("targets")["activeTargets"]
            return len(targets) == 3 and all(t["health"] == "up" for t in targets)

        prometheus.wait("every target up", every_target_up)

        # A job that holds its world until told to finish, so its series are there to query.
        out, finish = tmp_path / "out", tmp_path / "finish"
        out.mkdir()
        env = {"LIGHT_OUT": str(out), "LIGHT_SLEEP": "300", "LIGHT_EXIT_0_WHEN": str(finish)}
        spec = spec_message({"id": "held", "plan": ParallelPlan(dp_shard=4), "nodes": 2, "command": LIGHT, "env": env})
        admin.submit_job(address, spec, tls=False)
        _wait("the job's four ranks", lambda: len(list(out.glob("*.json"))) == 4)
        prometheus.wait(
            "the formed world, scraped", lambda: prometheus.query('meshgate_ranks_registered{job_id="held"} == 4')
        )
        prometheus.wait(
            "the workers, scraped",
            lambda: prometheus.query('sum(meshgate_agent_workers_running{job="meshgate-agent"}) == 4'),
        )

        # The dashboard's variables as Grafana sets them: $job_id "All" is its allValue, and
        # $__rate_interval a window over everything this Prometheus has scraped.
        assert "held" in prometheus.api("label/job_id/values", **{"match[]": "meshgate_ranks_registered"})
        window = f"{int(time.monotonic() - prometheus.started) + 10}s"
        empty = []
        for title, expr in _targets():
            query = expr.replace("$__rate_interval", window).replace("$job_id", ".*")
            result = prometheus.query(query)
            if not result:
                empty.append(f"{title}: {query}")
        assert not empty, "dashboard queries with no data:\n" + "\n".join(empty)
        # The Register latency panel shows the path the shipped agents take (issue #34: NaN before).
        assert _SHIPPED_AGENT["fan_in"] is True
        assert prometheus.query('sum(meshgate_register_latency_seconds_count{path="fan-in"}) > 0')

        # The rules load and evaluate against the real series; none fires on a healthy cluster.
        def rules_evaluated():
            rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
            return len(rules) == len(_alerts()) and all(r["health"] == "ok" for r in rules) and rules

        rules = prometheus.wait("the rules evaluated", rules_evaluated)
        assert [r["name"] for r in rules if r["state"] == "firing"] == []

        # The job ends: its series leave the coordinator's /metrics and Prometheus (stale at
        # the next scrape), and its end is counted.
        finish.touch()
        deadline = time.monotonic() + 120
        while admin.get_job(address, "held", tls=False).state != pb.SUCCEEDED:
            assert time.monotonic() < deadline, (tmp_path / "coordinator.log").read_text()[-3000:]
            time.sleep(0.2)

        # Its rendezvous series go; one series says for 10 minutes how it ended, by its id.
        def held_series() -> list[str]:
            text = _scrape(f"http://{coordinator_metrics}/metrics")
            return [line.split("{")[0] for line in text.splitlines() if 'job_id="held"' in line]

        _wait("the ended job's series gone from /metrics", lambda: held_series() == [ENDED])
        prometheus.wait(
            "the ended job's series gone", lambda: not prometheus.query(f'{{job_id="held", __name__!="{ENDED}"}}')
        )
        assert prometheus.query(f'{ENDED}{{job_id="held", state="SUCCEEDED"}}')
        prometheus.wait(
            "the end counted", lambda: prometheus.query('meshgate_jobs_ended_total{state="SUCCEEDED"} == 1')
        )

        # A job that fails (rank 0 exits 1 once the world formed): MeshgateJobFailed fires on
        # the real series, its counter having been 0 before, as the rule needs.
        failing = {"LIGHT_OUT": str(out), "LIGHT_FAIL_RANK": "0"}
        spec = spec_message(
            {"id": "broken", "plan": ParallelPlan(dp_shard=2), "nodes": 1, "command": LIGHT, "env": failing}
        )
        admin.submit_job(address, spec, tls=False)

        def job_failed_firing():
            alerts = prometheus.api("alerts")["alerts"]
            return [a for a in alerts if a["labels"]["alertname"] == "MeshgateJobFailed" and a["state"] == "firing"]

        (alert,) = prometheus.wait("MeshgateJobFailed firing", job_failed_firing, timeout=120)
        assert alert["labels"]["instance"] == coordinator_metrics and alert["labels"]["job_id"] == "broken"
        assert alert["annotations"]["summary"] == "meshgate job broken failed"
        assert admin.get_job(address, "broken", tls=False).state == pb.FAILED
    finally:
        if prometheus is not None:
            prometheus.close()
        for agent in agents:
            agent.terminate()
        for agent in agents:
            try:
                agent.wait(timeout=20)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
        if coordinator.poll() is None:
            coordinator.terminate()
            try:
                coordinator.wait(timeout=20)
            except subprocess.TimeoutExpired:
                coordinator.kill()
                coordinator.wait()
