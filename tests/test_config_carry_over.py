"""Configs that carry over (issue 35, item 5): the shipped agent.toml and coordinator.toml
of earlier releases, read from their commits (git show), load in this release; a config
staged for a later release ([future.<section>], meshgate/staged.py) is warned of, not
refused; a default that changed says so at start.

The earlier releases: 7736840, the release before this one (the last landed before
versions went on the wire), and dddf737, the release the upgrade test of issue 35 ran as
"current" (before cordon, quarantine and quotas). Their files' absolute paths (systemd's
credentials and state directories) are re-rooted under the test's directory, where the
files they name are made (real dev-CA certificates and keys).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO
from meshgate.agent.config import AgentConfig, AgentConfigError
from meshgate.coordinator.config import QUARANTINE_DEFAULT_CHANGED, ConfigError, CoordinatorConfig
from meshgate.tls import init_dev_ca

EARLIER = ("7736840", "dddf737")
ROOTS = ("/run/credentials/", "/var/lib/", "/etc/meshgate/")


def shipped_at(commit: str, name: str) -> str:
    done = subprocess.run(
        ["git", "show", f"{commit}:deploy/systemd/{name}"], cwd=REPO, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"this checkout has no commit {commit} (a shallow clone): {done.stderr.strip()}")
    return done.stdout


def placed(text: str, where: Path) -> Path:
    """``text`` as a config file under ``where``, its absolute paths re-rooted there and
    every file it names made: TLS files from a dev CA, the join token, directories."""
    for root in ROOTS:
        text = text.replace(root, f"{where}/root{root}")
    ca = init_dev_ca(where / "ca", agent_names=("node-0",))
    pems = {
        "ca.pem": ca.ca,
        "agent.pem": ca.agent("node-0").cert,
        "agent.key": ca.agent("node-0").key,
        "worker.pem": ca.worker.cert,
        "worker.key": ca.worker.key,
        "coordinator.pem": ca.server.cert,
        "coordinator.key": ca.server.key,
    }
    for line in text.splitlines():
        key, _, value = line.partition("=")
        value = value.strip().strip('"')
        if line.startswith("#") or not value or not key.strip().endswith(("_file", "dir")):
            continue
        path = Path(value) if Path(value).is_absolute() else where / value
        if key.strip().endswith("dir"):
            path.mkdir(parents=True, exist_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        source = pems.get(path.name)
        if source is not None:
            shutil.copy(source, path)
        else:
            path.write_text("a-join-token-of-the-node\n")
        path.chmod(0o600)
    config = where / "config.toml"
    config.write_text(text)
    return config


@pytest.mark.parametrize("commit", EARLIER)
def test_an_earlier_release_s_shipped_agent_toml_starts_this_release(tmp_path, commit):
    config = AgentConfig.load(placed(shipped_at(commit, "agent.toml"), tmp_path))
    assert config.jobs_mode and config.run_as == "meshgate-job" and config.fan_in
    assert config.coordinator == "head-a:7443,head-b:7443"


@pytest.mark.parametrize("commit", EARLIER)
def test_an_earlier_release_s_shipped_coordinator_toml_starts_this_release(tmp_path, commit, caplog):
    caplog.set_level(logging.WARNING, logger="meshgate.coordinator")
    config = CoordinatorConfig.load(placed(shipped_at(commit, "coordinator.toml"), tmp_path))
    assert config.store_kind == "sqlite" and config.require_vouch and config.heartbeat_interval_s == 5.0
    changed = [r.getMessage() for r in caplog.records if "DEFAULT CHANGED" in r.getMessage()]
    # dddf737's has no quarantine_after: the new default applies, and says so; 7736840's sets it.
    assert changed == ([QUARANTINE_DEFAULT_CHANGED] if commit == "dddf737" else []), changed


# ---- [future]: a config for a later release staged now ------------------------------------------

AGENT = '[agent]\ncoordinator = "head:7443"\ninsecure = true\nstate_dir = "state"\nrun_as = "nobody"\n'


def test_staged_agent_keys_this_release_does_not_know_are_warned_of_not_refused(tmp_path, caplog):
    path = tmp_path / "agent.toml"
    path.write_text(AGENT + "[future.agent]\nrun_in_pods = true\n[future.telemetry]\nendpoint = 'x'\n")
    with pytest.raises(AgentConfigError, match=r"unknown key\(s\) \['run_in_pods'\]"):  # not staged: refused
        AgentConfig.from_mapping({"coordinator": "head:7443", "insecure": True, "run_in_pods": True})
    caplog.set_level(logging.WARNING, logger="meshgate.agent")
    config = AgentConfig.load(path)
    assert config.run_as == "nobody"
    lines = [r.getMessage() for r in caplog.records]
    assert any("[future.agent] run_in_pods: not a key of release" in line and str(path) in line for line in lines)
    assert any("[future.telemetry]: release" in line and "stages no keys for it" in line for line in lines), lines


def test_a_staged_key_this_release_knows_is_applied_and_a_key_set_twice_is_refused(tmp_path, caplog):
    path = tmp_path / "agent.toml"
    path.write_text(AGENT + "[future.agent]\ndrain_grace_s = 7\n")
    caplog.set_level(logging.WARNING, logger="meshgate.agent")
    assert AgentConfig.load(path).drain_grace_s == 7
    assert any(
        "drain_grace_s: release" in r.getMessage() and "move it into [agent]" in r.getMessage() for r in caplog.records
    )
    path.write_text(AGENT + "drain_grace_s = 5\n[future.agent]\ndrain_grace_s = 7\n")
    with pytest.raises(AgentConfigError, match=r"\[future.agent\] drain_grace_s is set in \[agent\] too"):
        AgentConfig.load(path)


def test_staged_coordinator_keys_are_applied_or_warned_of(tmp_path, caplog):
    path = tmp_path / "coordinator.toml"
    path.write_text(
        '[cluster]\nquarantine_after = 0\n[server]\nlisten = "127.0.0.1:0"\ninsecure = true\n'
        f'[keys]\ndir = "{tmp_path}/keys"\n[store]\nkind = "memory"\n'
        '[future.cluster]\nretention = "2d"\npreemption = true\n[future.plan]\ntp = 2\n'
    )
    caplog.set_level(logging.WARNING, logger="meshgate")
    config = CoordinatorConfig.load(path)
    assert config.retention_s == 2 * 86400
    lines = [r.getMessage() for r in caplog.records]
    assert any("[future.cluster] retention: release" in line for line in lines), lines
    assert any("[future.cluster] preemption: not a key of release" in line for line in lines), lines
    assert any("[future.plan]: release" in line for line in lines), lines
    path.write_text(path.read_text().replace("[future.cluster]", "[nonsense]\n[future.cluster]"))
    with pytest.raises(ConfigError, match=r"unknown section\(s\) \['nonsense'\]"):  # outside [future]: refused
        CoordinatorConfig.load(path)
