"""`make demo`'s job, as a user runs it: coordinator, agents over mTLS, a verified world."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, worker_env

pytestmark = pytest.mark.slow


def test_demo_verifies_the_default_world_over_mtls():
    env = worker_env()
    env.pop("MESHGATE_INSECURE", None)  # the demo brings its own dev CA
    result = subprocess.run(
        [sys.executable, "-m", "meshgate.cli", "demo", "--nodes", "2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "mTLS with a dev CA" in result.stdout
    assert "world verified: 4/4 ranks, generation 0" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if line[:1].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [
        ("0", "demo-node-0"), ("1", "demo-node-0"), ("2", "demo-node-1"), ("3", "demo-node-1")
    ]
    assert all("ok:" in r for r in rows), rows  # every rank checked every mesh dimension
