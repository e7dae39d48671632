"""The shipped configs (deploy/systemd/*.toml, what `meshgate init` writes) agree with the
Prometheus pack and the deployment guide (issue #34):

- the timeouts that decide a job's fate are in them, commented or set, at the value the
  daemon takes when the key is left out (a default nobody can see is a surprise later);
- each daemon serves /metrics on the port deploy/prometheus/prometheus.yml scrapes it on,
  an agent on every interface (the pack scrapes it from the Prometheus host);
- docs/deploying.md installs every extra the shipped configs need.

tests/test_deploying_guide.py then starts both configs, as `meshgate init` writes them, in a
fresh venv holding exactly what the guide installs, and the real-Prometheus pack test
scrapes agents started from the shipped agent.toml's settings.
"""

from __future__ import annotations

import re
import tomllib

import pytest
import yaml

from conftest import REPO, write_config
from meshgate.metrics import parse_listen

SHIPPED = REPO / "deploy" / "systemd"
PACK = REPO / "deploy" / "prometheus"
GUIDE = REPO / "docs" / "deploying.md"

# [table] key -> the config attribute it sets: the timeouts that decide what happens to a job.
DECISIVE = {
    "coordinator.toml": {
        ("cluster", "heartbeat_interval_s"): "heartbeat_interval_s",
        ("cluster", "heartbeat_misses"): "heartbeat_misses",
        ("cluster", "attestation_ttl_s"): "attestation_ttl_s",
        ("cluster", "max_await_s"): "max_await_s",
    },
    "agent.toml": {
        ("agent", "join_timeout_s"): "join_timeout_s",
        ("agent", "drain_grace_s"): "drain_grace_s",
        ("agent", "vouch_ttl_s"): "vouch_ttl_s",
        ("agent", "bundle_refresh_s"): "bundle_refresh_s",
    },
}


def _defaults(name: str, tmp_path):
    """The config the daemon loads from the least it needs: every other key at its default."""
    if name == "coordinator.toml":
        from meshgate.coordinator.config import CoordinatorConfig

        table = {"server": {"listen": "127.0.0.1:0", "insecure": True}, "keys": {"dir": str(tmp_path / "k")}}
        return CoordinatorConfig.load(write_config(tmp_path / name, table))
    from meshgate.agent.config import AgentConfig

    table = {"agent": {"coordinator": "x:1", "join_token": "t", "insecure": True, "run_jobs_as_agent": True}}
    return AgentConfig.load(write_config(tmp_path / name, table))


def _shown(text: str, table: str, key: str) -> float:
    """The value of ``key = VALUE`` (live or commented out) in ``[table]`` of a shipped config."""
    section = re.search(rf"^\[{table}\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    assert section, f"no [{table}]"
    found = re.search(rf"^#?\s*{key}\s*=\s*([0-9.]+)", section.group(1), re.M)
    assert found, f"[{table}] {key} is not in the shipped config, commented or set"
    return float(found.group(1))


@pytest.mark.parametrize("name", sorted(DECISIVE))
def test_the_decisive_timeouts_are_shown_at_their_defaults(name, tmp_path):
    text = (SHIPPED / name).read_text()
    defaults = _defaults(name, tmp_path)
    for (table, key), attribute in DECISIVE[name].items():
        if re.search(rf"^{key}\s*=", text, re.M):  # set: a choice of its own, shown
            _shown(text, table, key)
            continue
        assert _shown(text, table, key) == float(getattr(defaults, attribute)), f"[{table}] {key}"
    assert "lost_node_timeout_s" in text and "300" in text  # the job's own, and its default


def _pack_ports() -> dict[str, set[int]]:
    config = yaml.safe_load((PACK / "prometheus.yml").read_text())
    return {
        job["job_name"]: {int(t.rsplit(":", 1)[1]) for sc in job["static_configs"] for t in sc["targets"]}
        for job in config["scrape_configs"]
    }


def test_each_daemon_serves_metrics_where_the_pack_scrapes_it():
    ports = _pack_ports()
    coordinator = tomllib.loads((SHIPPED / "coordinator.toml").read_text())["server"]["metrics_listen"]
    agent = tomllib.loads((SHIPPED / "agent.toml").read_text())["agent"]["metrics_listen"]
    assert ports["meshgate-coordinator"] == {parse_listen(coordinator)[1]}
    assert ports["meshgate-agent"] == {parse_listen(agent)[1]}
    # scraped from the Prometheus host, not only from the node itself
    assert parse_listen(agent)[0] == "0.0.0.0"


def _needed_extras(name: str) -> set[str]:
    config = tomllib.loads((SHIPPED / name).read_text())
    needed = set()
    for table in config.values():
        if isinstance(table, dict) and table.get("metrics_listen"):
            needed.add("metrics")
        if isinstance(table, dict) and table.get("kind") == "etcd":
            needed.add("etcd")
    return needed


def test_the_guide_installs_every_extra_the_shipped_configs_need():
    (install,) = re.findall(r"pip install \S*'(\S+\.whl)\[([a-z,]+)\]'", GUIDE.read_text())
    installed = set(install[1].split(","))
    for name in ("coordinator.toml", "agent.toml"):
        assert _needed_extras(name) <= installed, (name, _needed_extras(name), installed)
    assert _needed_extras("agent.toml") == {"metrics"}
