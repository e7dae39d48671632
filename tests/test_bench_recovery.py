"""Section 8's parts (bench/recovery_torchrun.py, bench/__main__.py, bench/report.py):
which world counts as re-formed after a kill, how the recovery figures meet the goal and
read, and which processes a failed run must kill. No timing is asserted (BENCHMARKS.md
holds the figures)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from bench.__main__ import variant_goals
from bench.recovery_torchrun import _descendants, reformed_world

KILLED = 100.0


def record(round_: str, rank: int, world_size: int, node: str, formed_at: float) -> dict:
    return {"round": round_, "rank": rank, "world_size": world_size, "node": node, "pid": 1, "formed_at": formed_at}


def test_the_first_world_whole_after_the_kill_counts_not_the_one_before_nor_a_partial_one():
    records = [record("g0", r, 4, f"n{r // 2}", 90.0 + r) for r in range(4)]  # before the kill
    records += [record("g1", r, 4, f"n{r // 2}", 101.0 + r) for r in range(3)]  # rank 3 never came
    records += [record("g2", r, 4, ("n0", "n0", "n2", "n2")[r], 110.0 + r) for r in range(4)]
    world = reformed_world(records, KILLED)
    assert world == {"round": "g2", "world_size": 4, "nodes": ["n0", "n2"], "formed_at": 113.0}


def test_a_round_is_keyed_by_the_world_not_a_per_node_counter_and_no_world_means_none():
    # c10d: one survivor restarted (count 1), another only re-joined (count 0): one world,
    # keyed by its store's port; a record of the old world formed after the kill is not it.
    records = [record("store 5000", r, 2, f"n{r}", 105.0 + r) for r in range(2)]
    assert reformed_world(records, KILLED)["formed_at"] == 106.0
    assert reformed_world(records[:1], KILLED) is None
    assert reformed_world(records, 200.0) is None
    mixed = [record("store 5000", 0, 2, "n0", 105.0), record("store 5000", 1, 3, "n1", 106.0)]
    assert reformed_world(mixed, KILLED) is None  # sizes disagree: not one world


def run(nodes: int, world_s: float, **extra) -> dict:
    bound = 6.0
    return {
        "nodes": nodes,
        "workers": nodes * 8,
        "replacement": "spare",
        "heartbeat_s": 2.0,
        "misses": 3,
        "detection_bound_s": bound,
        "detect_s": 6.5,
        "told_s": 7.5,
        "world_s": world_s,
        "goal_s": bound + 2.0,
        "goal_met": world_s <= bound + 2.0,
        **extra,
    }


def test_the_recovery_goal_is_judged_at_1000_nodes_only_and_a_failed_run_is_not_met():
    rows = variant_goals("v", {"recovery": {"runs": [run(8, 2.0), run(1000, 10.8)]}}, None)
    assert [(r["measured"].split(" (")[0], r["met"]) for r in rows] == [("10.80 s at 1000 nodes", "NO")]
    rows = variant_goals("v", {"recovery": {"runs": [run(8, 2.0)]}}, None)
    assert [r["met"] for r in rows] == ["not run at 1,000 nodes in this mode"]
    failed = {"nodes": 1000, "replacement": "from the pool", "error": "generation 1's world never formed\nlog"}
    rows = variant_goals("v", {"recovery": {"runs": [run(1000, 7.9), failed]}}, None)
    assert [(r["goal"].rsplit("(", 1)[1], r["met"]) for r in rows] == [("spare)", "yes"), ("from the pool)", "NO")]


def test_the_section_renders_each_run_and_the_real_process_comparison():
    from bench.report import _section_recovery

    figures = {
        "recovery": {"runs": [run(1000, 10.8, last_told_s=9.5, bench_cpu_s=9.1, coordinator_cpu_s=2.5, loadavg=1.5)]}
    }
    failed = {"nodes": 8, "replacement": "from the pool", "error": "boom"}
    figures_2 = {"recovery": {"runs": [failed]}}
    real = {
        "members": 3,
        "workers_per_node": 2,
        "meshgate": {
            "backend": "meshgate",
            "nodes": "3 + 1 spare",
            "heartbeat": "0.5 s x 3",
            "world_s": 7.3,
            "world_size": 6,
            "job_state": "SUCCEEDED",
            "loadavg": 0.4,
        },
        "c10d": {
            "backend": "c10d",
            "nnodes": "3:4",
            "rdzv_conf": "torch's defaults",
            "error": "no world\nmore",
            "loadavg": 1.9,
        },
        "c10d_vs_meshgate": None,
    }
    text = "\n".join(_section_recovery({"a": figures, "b": figures_2}, real))
    assert "| a " in text and "10.80" in text and "NO (≤ 8 s)" in text and "9.1 / 2.5" in text and "7.50 / 9.50" in text
    assert "| b " in text and "FAILED" in text
    assert "7.30 s" in text and "SUCCEEDED" in text and "FAILED: no world" in text and "--nnodes=3:4" in text


def test_the_processes_a_launcher_started_in_sessions_of_their_own_are_found_under_it():
    """What a failed c10d run kills: torchrun's workers leave its process group."""
    worker_code = "import time; time.sleep(60)"
    script = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {worker_code!r}], start_new_session=True); time.sleep(60)"
    )
    launcher = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 20
        while not _descendants(launcher.pid):
            assert time.monotonic() < deadline, "the launcher's child never started"
            time.sleep(0.05)
        (worker,) = _descendants(launcher.pid)
        assert os.getsid(worker) == worker != os.getsid(launcher.pid)  # a session of its own
        assert _descendants(worker) == []
    finally:
        for pid in _descendants(launcher.pid):
            os.kill(pid, signal.SIGKILL)
        launcher.kill()
        launcher.wait()
