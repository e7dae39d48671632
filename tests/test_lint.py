"""ruff (pinned in the CI lock) finds no error in the tree: syntax, undefined or unused
names and imports ([tool.ruff] in pyproject.toml says which rules and why)."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_ruff_finds_no_error():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
