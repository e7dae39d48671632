"""The shipped systemd units pass `systemd-analyze verify` and the example configs load."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from meshgate.agent.config import AgentConfig
from meshgate.coordinator.config import CoordinatorConfig

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "systemd"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("unit", ["meshgate-coordinator.service", "meshgate-agent.service"])
def test_units_verify(unit, tmp_path):
    # verify checks that ExecStart exists: point it at a real binary in a copy of the unit.
    text = (DEPLOY / unit).read_text()
    text = text.replace("/usr/local/bin/meshgate-coordinator", shutil.which("true"))
    text = text.replace("/usr/local/bin/meshgate-agent", shutil.which("true"))
    copy = tmp_path / unit
    copy.write_text(text)
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(copy)], capture_output=True, text=True
    )
    problems = [
        line for line in (result.stdout + result.stderr).splitlines()
        if unit in line or "Unknown" in line or "Failed" in line
    ]
    assert result.returncode == 0 and not problems, result.stdout + result.stderr


def test_hardening_is_present():
    for unit in ("meshgate-coordinator.service", "meshgate-agent.service"):
        text = (DEPLOY / unit).read_text()
        for directive in ("NoNewPrivileges=yes", "ProtectSystem=strict", "Restart=on-failure"):
            assert directive in text, f"{unit} lacks {directive}"
        assert "DynamicUser=yes" in text or "User=meshgate" in text
    assert "Type=notify" in (DEPLOY / "meshgate-agent.service").read_text()


def test_example_configs_load(tmp_path):
    """The shipped configs load as they are, given the files they name (a dev CA here)."""
    import shutil

    from meshgate.tls import init_dev_ca

    etc = tmp_path / "etc"
    etc.mkdir()
    ca = init_dev_ca(etc / "tls", hosts=("head-a", "127.0.0.1"))
    for name in ("agent", "worker"):
        for suffix in ("pem", "key"):
            assert (etc / "tls" / f"{name}.{suffix}").exists()
    for name in ("coordinator.toml", "agent.toml"):
        shutil.copy(DEPLOY / name, etc / name)
    (etc / "join-token").write_text("a-token\n")
    (etc / "join-token").chmod(0o600)  # a secret file: a looser mode is refused
    coordinator = CoordinatorConfig.load(etc / "coordinator.toml")
    assert coordinator.rendezvous.plan.world_size == 16
    assert coordinator.tls is not None and coordinator.tls.require_client_cert
    assert coordinator.rendezvous.require_vouch and coordinator.store_kind == "sqlite"
    assert coordinator.launch.restart_policy == "on-failure"
    agent = AgentConfig.load(etc / "agent.toml")
    assert agent.slots is None and agent.join_token == "a-token"
    assert agent.tls is not None and agent.tls.ca_file == ca.ca
