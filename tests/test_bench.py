"""The benchmark suite cannot rot: its smoke mode runs end to end, every section is in
the JSON, and the numbers are sane. Speed goals are not asserted here (BENCHMARKS.md)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def positive(value) -> bool:
    return isinstance(value, (int, float)) and not math.isnan(value) and value > 0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_smoke_writes_every_section(tmp_path):
    env = dict(os.environ, RES_OPTIONS="timeout:1 attempts:1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=220,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    json_line = [line for line in proc.stdout.splitlines() if line.startswith("JSON: ")]
    assert json_line, proc.stdout[-2000:]
    path = Path(json_line[-1][len("JSON: "):])
    assert path.parent == tmp_path and path.exists()
    results = json.loads(path.read_text())
    table = path.with_suffix(".txt").read_text()

    for section in ("machine", "throughput", "world", "c10d", "growth", "fan_in", "goals"):
        assert section in results, section
    machine = results["machine"]
    assert machine["nproc"] >= 1 and machine["cpu_model"] and machine["grpcio"] and machine["torch"]
    assert machine["cpu_model"] in table

    # 1. throughput: both servers served every call, the client verified every answer.
    tp = results["throughput"]
    for side in ("echo", "coordinator"):
        assert positive(tp[side]["register_per_s"]), side
        assert positive(tp[side]["server_cpu_per_call_us"]), side
        assert tp[side]["latency_p50_ms"] <= tp[side]["latency_p99_ms"]
        for run in tp["runs"][side]:
            assert run["errors"] == 0, run["errors_kept"]
            assert run["verified"] == tp["n"]
    assert positive(tp["ratio"]) and positive(tp["cpu_ratio"])
    assert tp["ratio_of_medians"] == pytest.approx(
        tp["coordinator"]["register_per_s"] / tp["echo"]["register_per_s"])
    assert len(tp["round_ratios"]) == tp["rounds"]
    assert min(tp["round_ratios"]) <= tp["ratio"] <= max(tp["round_ratios"])
    assert tp["request_bytes"] > 50 and tp["response_bytes"] > tp["request_bytes"]
    # The echo server answers with a real RegisterResponse of the same size (± varints).
    assert abs(tp["echo_response_bytes"] - tp["response_bytes"]) <= 8

    # 2. a verified world: every worker registered, verified and got through the barrier.
    worlds = results["world"]["runs"]
    assert [r["world"] for r in worlds] == sorted(r["world"] for r in worlds)
    for run in worlds:
        assert run["errors"] == 0, run["errors_kept"]
        assert run["verified"] == run["world"] and run["awaited"] == run["world"]
        assert positive(run["wall_s"]) and positive(run["latency_p99_ms"])
        assert positive(run["rss_before_kib"]) and positive(run["rss_peak_kib"])
        assert run["rss_peak_kib"] >= run["rss_before_kib"]
        assert positive(run["server_cpu_s"])

    # 3. torch's c10d rendezvous finished at the smoke size, and the ratio is computed.
    for row in results["c10d"]["runs"]:
        assert row["c10d"]["finished"], row["c10d"]
        assert row["c10d"]["ranks_ok"]
        assert row["meshgate"]["errors"] == 0
        assert row["meshgate"]["world"] == 8 * row["nodes"]
        assert positive(row["speedup"]) and row["speedup_is_lower_bound"] is False

    # 4. growth: one row per world size, normalised to the smallest.
    growth = results["growth"]["rows"]
    assert len(growth) == len(worlds)
    assert growth[0]["wall_vs_smallest"] == pytest.approx(1.0)
    assert all(positive(r["wall_per_worker_us"]) for r in growth)

    # 5. fan-in: the largest world again, through simulated agents, every worker verified.
    fan_in = results["fan_in"]
    assert fan_in["workers"] == worlds[-1]["world"] and fan_in["verified"] == fan_in["workers"]
    assert fan_in["nodes"] == fan_in["workers"] // 8 and positive(fan_in["wall_s"])
    assert fan_in["direct_wall_s"] == worlds[-1]["wall_s"] and positive(fan_in["speedup_vs_direct"])

    assert {g["goal"] for g in results["goals"]} >= {
        "Register throughput ≥ 0.8 x bare echo",
        "coordinator peak RSS ≤ 2 KiB/worker",
    }
    for heading in ("1. Register throughput", "2. Time to a verified world",
                    "3. Against torch's c10d", "4. How cost grows", "5. Through agents", "Goals"):
        assert heading in table
