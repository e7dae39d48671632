"""Run N worker scripts as subprocesses and collect one JSON result per rank.

Used by tests/test_mesh.py and tests/test_megatron.py (loaded by file path, so it does
not depend on how pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

# TCPStore does a reverse-DNS lookup of each client, which here sometimes stalls 5 s:
# cap the resolver; keep gloo on loopback; one thread per process on a 2-core machine.
WORKER_ENV = {
    "RES_OPTIONS": "timeout:1 attempts:1",
    "OMP_NUM_THREADS": "1",
    "GLOO_SOCKET_IFNAME": "lo",
    "MASTER_ADDR": "127.0.0.1",
    "PYTHONPATH": str(REPO),
    "PYTHONWARNINGS": "ignore",
}


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "<no log>"


def run_workers(
    script: Path, n: int, spec: dict[str, Any], tmp: Path, timeout: float
) -> tuple[list[dict[str, Any]], float]:
    """Start ``n`` copies of ``script`` (local ranks 0..n-1); return (results, wall seconds).

    Each worker gets ``--spec FILE --local-rank I --out FILE`` and must write its JSON
    result to the out file. A run that outlives ``timeout`` is killed and fails, with
    every worker's log tail in the message.
    """
    tmp.mkdir(parents=True, exist_ok=True)
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    env.update(WORKER_ENV)
    outs = [tmp / f"result{i}.json" for i in range(n)]
    logs = [tmp / f"worker{i}.log" for i in range(n)]
    procs = []
    start = time.monotonic()
    for i in range(n):
        with open(logs[i], "wb") as log:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(script),
                        "--spec",
                        str(spec_path),
                        "--local-rank",
                        str(i),
                        "--out",
                        str(outs[i]),
                    ],
                    cwd=REPO,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )
    deadline = start + timeout
    try:
        for proc in procs:
            remaining = deadline - time.monotonic()
            proc.wait(timeout=max(remaining, 0.1))
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait()
        details = "\n".join(f"--- worker {i} ---\n{_tail(logs[i])}" for i in range(n))
        raise AssertionError(f"{script.name}: {n} workers did not finish in {timeout}s\n{details}")
    wall = time.monotonic() - start
    results = []
    for i, proc in enumerate(procs):
        if not outs[i].exists():
            raise AssertionError(
                f"{script.name}: worker {i} exited {proc.returncode} without a result\n{_tail(logs[i])}"
            )
        result = json.loads(outs[i].read_text())
        result["_log"] = _tail(logs[i], 2000)
        result["_returncode"] = proc.returncode
        results.append(result)
    return results, wall
