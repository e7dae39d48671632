"""`make demo`'s job, as a user runs it: one coordinator in jobs mode and its agents over
mTLS serve two jobs back to back, and both worlds verify."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO, worker_env

pytestmark = pytest.mark.slow


def test_demo_runs_two_verified_jobs_back_to_back_through_the_same_daemons_over_mtls():
    env = worker_env()
    env.pop("MESHGATE_INSECURE", None)  # the demo brings its own dev CA
    result = subprocess.run(
        [sys.executable, "-m", "meshgate.cli", "demo", "--nodes", "2"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "(jobs mode), mTLS with a dev CA" in out and "joined once" in out
    assert ("AS ROOT: the demo's agents run its workers as root" in out) == (os.geteuid() == 0)
    assert out.count("world verified: 4/4 ranks, generation 0") == 2, out
    assert "job demo-1: SUCCEEDED" in out and "job demo-2: SUCCEEDED" in out
    assert out.index("job demo-1: SUCCEEDED") < out.index("job demo-2 submitted")  # back to back
    assert "2 jobs through one coordinator and 2 agents: all verified" in out
    rows = [line.split() for line in out.splitlines() if line[:1].isdigit() and " jobs through " not in line]
    assert [(r[0], r[1]) for r in rows] == 2 * [
        ("0", "demo-node-0"),
        ("1", "demo-node-0"),
        ("2", "demo-node-1"),
        ("3", "demo-node-1"),
    ]
    assert all(r[-2] == "ok:" for r in rows), rows  # every rank checked every mesh dimension
    assert {r[-1] for r in rows[:4]} == {"dp_shard,tp"} and {r[-1] for r in rows[4:]} == {"dp_shard"}
