"""The admin CLI against a real coordinator over mTLS: `meshgate token create` mints a
single-use token an agent joins with; `meshgate keys rotate` reaches the agent's trust
bundle through its endorsed refresh."""

from __future__ import annotations

import datetime
import json
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, worker_env
from meshgate.plan import ParallelPlan
from meshgate.tls import init_dev_ca
from test_agent import start_agent, wait_for

pytestmark = pytest.mark.slow
PLAN = ParallelPlan(tp=2, dp_shard=2)


def cli(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshgate.cli", *args],
        cwd=REPO,
        env=env or worker_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_token_create_join_reuse_and_rotate(coordinator_factory, tmp_path):
    ca = init_dev_ca(tmp_path / "tls", agent_names=("node-a", "node-b"))
    coordinator = coordinator_factory(
        PLAN,
        slots_per_node=2,
        job={"heartbeat_interval_s": 0.5},
        server={
            "insecure": False,
            "ca_file": str(ca.ca),
            "cert_file": str(ca.server.cert),
            "key_file": str(ca.server.key),
            "require_client_cert": True,
        },
    )
    admin = [
        "--coordinator",
        coordinator.address,
        "--job",
        "test",
        "--ca-file",
        str(ca.ca),
        "--cert-file",
        str(ca.admin.cert),
        "--key-file",
        str(ca.admin.key),
    ]

    # an agent certificate is not an admin credential
    refused = cli(
        "token",
        "create",
        "--node-id",
        "node-a",
        "--coordinator",
        coordinator.address,
        "--job",
        "test",
        "--ca-file",
        str(ca.ca),
        "--cert-file",
        str(ca.agent("node-a").cert),
        "--key-file",
        str(ca.agent("node-a").key),
    )
    assert refused.returncode == 2 and "PERMISSION_DENIED" in refused.stderr

    # a token for whichever node spends it first, asked for explicitly
    made = cli("token", "create", "--any-node", "--ttl", "5m", *admin)
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert "single-use" in made.stderr and len(token) >= 32
    # --ttl spelled as the config spells durations (meshgate/durations.py): a day, and it says so
    day = cli("token", "create", "--node-id", "node-c", "--ttl", "1d", *admin)
    assert day.returncode == 0, day.stderr
    expires = datetime.datetime.fromisoformat(re.search(r"expires (\S+)", day.stderr).group(1))
    assert abs(expires.timestamp() - time.time() - 86400) < 120, day.stderr
    weeks = cli("token", "create", "--node-id", "node-c", "--ttl", "2w", *admin)
    assert weeks.returncode == 2 and "--ttl must be a positive number of seconds" in weeks.stderr, weeks.stderr
    assert "'2w'" in weeks.stderr and not weeks.stdout

    tls = lambda n: {
        "insecure": False,
        "ca_file": str(ca.ca),
        "cert_file": str(ca.agent(n).cert),
        "key_file": str(ca.agent(n).key),
        "bundle_refresh_s": 0.5,
    }
    a = start_agent(tmp_path, coordinator.address, "node-a", join_token=token, **tls("node-a"))
    try:
        wait_for(lambda: "joined job test" in (tmp_path / "node-a.log").read_text(), 30, "node-a joins")
        # the same token again: refused, and the second agent exits 2
        b = start_agent(tmp_path, coordinator.address, "node-b", join_token=token, **tls("node-b"))
        assert b.wait(timeout=30) == 2
        assert "already used" in (tmp_path / "node-b.log").read_text()
        assert token not in (tmp_path / "node-a.log").read_text() + (tmp_path / "node-b.log").read_text()

        rotated = cli("keys", "rotate", *admin)
        assert rotated.returncode == 0, rotated.stderr
        assert "trust bundle v2" in rotated.stdout and rotated.stdout.count("ed25519:") >= 3
        bundle_file = tmp_path / "node-a-state" / "trust-bundle.json"
        wait_for(lambda: len(json.loads(bundle_file.read_text())["keys"]) == 2, 20, "agent refreshes its bundle")
    finally:
        a.send_signal(signal.SIGTERM)
        assert a.wait(timeout=30) == 0
