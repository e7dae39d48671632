"""The shipped systemd units pass `systemd-analyze verify` and the example configs load."""

from __future__ import annotations

import re
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
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", str(copy)], capture_output=True, text=True)
    problems = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if unit in line or "Unknown" in line or "Failed" in line
    ]
    assert result.returncode == 0 and not problems, result.stdout + result.stderr


def test_hardening_is_present():
    for unit in ("meshgate-coordinator.service", "meshgate-agent.service"):
        text = (DEPLOY / unit).read_text()
        for directive in ("NoNewPrivileges=yes", "Restart=on-failure"):
            assert directive in text, f"{unit} lacks {directive}"
        assert "DynamicUser=yes" in text or "User=meshgate" in text
    assert "ProtectSystem=strict" in (DEPLOY / "meshgate-coordinator.service").read_text()
    agent = (DEPLOY / "meshgate-agent.service").read_text()
    assert "Type=notify" in agent
    # The agent's workers see its file system: /usr, /boot, /etc read-only, and nothing that
    # would keep a job from writing its checkpoints or give every job one shared /tmp.
    assert "\nProtectSystem=full\n" in agent
    for directive in ("ProtectSystem=strict", "ProtectHome=", "PrivateTmp=", "ReadWritePaths="):
        assert f"\n{directive}" not in agent, f"the agent unit confines its jobs with {directive}"


# The config keys that name secret files (read with meshgate.secret_files, 0600 or stricter).
SECRET_KEYS = ("key_file", "worker_key_file", "join_token_file", "admin_token_file")
UNIT_OF_CONFIG = {"coordinator.toml": "meshgate-coordinator.service", "agent.toml": "meshgate-agent.service"}
_SETTING = re.compile(r'^(#\s*)?(\w+)\s*=\s*"([^"]*)"', re.M)
_LOAD_CREDENTIAL = re.compile(r"^(#)?LoadCredential=([^:\s]+):(\S+)$", re.M)


def _secret_settings(config: str) -> list[tuple[bool, str, str]]:
    """(commented out, key, path) for every secret-file setting in a shipped config."""
    found = [(bool(m[1]), m[2], m[3]) for m in _SETTING.finditer((DEPLOY / config).read_text())]
    return [s for s in found if s[1] in SECRET_KEYS or s[1].endswith(("key_file", "token_file"))]


def _credentials(unit: str) -> dict[str, tuple[bool, str]]:
    """LoadCredential id -> (commented out, source path) in a shipped unit."""
    return {m[2]: (bool(m[1]), m[3]) for m in _LOAD_CREDENTIAL.finditer((DEPLOY / unit).read_text())}


@pytest.mark.parametrize("config", sorted(UNIT_OF_CONFIG))
def test_every_secret_file_comes_in_as_a_credential(config):
    """The coordinator's DynamicUser (and the agent's meshgate user) cannot read the root-owned
    0600 files in /etc/meshgate: each secret path a config names, live or commented out, is
    /run/credentials/<its unit>/<id> with a LoadCredential=<id>:/etc/meshgate/... line in
    that unit, commented out exactly when the setting is."""
    unit = UNIT_OF_CONFIG[config]
    settings = _secret_settings(config)
    credentials = _credentials(unit)
    assert any(not commented for commented, _, _ in settings), f"{config} names no secret file"
    used = set()
    for commented, key, path in settings:
        prefix = f"/run/credentials/{unit}/"
        assert path.startswith(prefix), f"{config} {key} = {path!r} is not under {prefix}"
        ident = path[len(prefix) :]
        assert ident in credentials, f"{unit} has no LoadCredential={ident}:... for {config} {key}"
        assert credentials[ident][0] == commented, f"{config} {key} and {unit}'s {ident} disagree"
        assert credentials[ident][1].startswith("/etc/meshgate/")
        used.add(ident)
    assert used == set(credentials), f"{unit} loads credentials no setting reads: {set(credentials) - used}"


def test_secret_check_accepts_a_credential_file(tmp_path):
    """systemd hands a credential over as mode 0400, owned by the service's uid."""
    from meshgate.secret_files import SecretFileTooOpen, read_secret

    credential = tmp_path / "join-token"
    credential.write_text("a-token\n")
    credential.chmod(0o400)
    assert read_secret(credential, "[agent] join_token_file") == b"a-token\n"
    credential.chmod(0o440)
    with pytest.raises(SecretFileTooOpen):
        read_secret(credential, "[agent] join_token_file")


def stage_credentials(etc: Path, run: Path) -> None:
    """What systemd does at start, for the shipped units: each LoadCredential source under
    /etc/meshgate (here ``etc``) copied to run/<unit>/<id> with mode 0400; and the shipped
    configs in ``etc`` rewritten from /run/credentials/ to ``run``."""
    for unit in UNIT_OF_CONFIG.values():
        for ident, (commented, source) in _credentials(unit).items():
            if commented:
                continue
            target = run / unit / ident
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(etc / Path(source).relative_to("/etc/meshgate"), target)
            target.chmod(0o400)
    for config in UNIT_OF_CONFIG:
        text = (etc / config).read_text()
        (etc / config).write_text(text.replace("/run/credentials/", f"{run}/"))


def test_example_configs_load(tmp_path):
    """The shipped configs load as they are, given the files they name (a dev CA here, the
    secret files staged the way LoadCredential= hands them over)."""
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
    stage_credentials(etc, tmp_path / "run")
    coordinator = CoordinatorConfig.load(etc / "coordinator.toml")
    assert not coordinator.declared  # the shipped shape: a long-lived coordinator that serves jobs
    assert coordinator.tls is not None and coordinator.tls.require_client_cert
    assert coordinator.tls.key_file == tmp_path / "run" / "meshgate-coordinator.service" / "coordinator.key"
    assert coordinator.require_vouch and coordinator.store_kind == "sqlite"
    assert coordinator.heartbeat_timeout_s == 15.0
    agent = AgentConfig.load(etc / "agent.toml")
    assert agent.jobs_mode and dict(agent.labels) == {"switch": "leaf-03", "rack": "r12"}
    assert agent.slots is None and agent.join_token == "a-token"
    assert agent.tls is not None and agent.tls.ca_file == ca.ca
    assert agent.worker_key_file == tmp_path / "run" / "meshgate-agent.service" / "worker.key"
