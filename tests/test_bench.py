"""The benchmark suite cannot rot: its smoke mode runs end to end in both variants, every
section is in the JSON, and the numbers are sane. What each variant claims is checked
from outside: the sqlite+mtls coordinators' logs are read back with the daemon's own
store (chain and durable mark verified) and hold every rank, and their servers refused
plaintext and certificate-less clients. Speed goals are not asserted here (BENCHMARKS.md)."""

from __future__ import annotations

import collections
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from bench.common import JOB

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("memory+plaintext", "sqlite+mtls")
PLAINTEXT = {"plaintext": "OK"}
MTLS = {"plaintext": "UNAVAILABLE", "TLS, no client certificate": "UNAVAILABLE", "mTLS, worker certificate": "OK"}
TRANSPORT = {"memory+plaintext": PLAINTEXT, "sqlite+mtls": MTLS}


def positive(value) -> bool:
    return isinstance(value, (int, float)) and not math.isnan(value) and value > 0


def stored_events(server_dir: Path) -> collections.Counter:
    """The events a server's store holds, by kind, read back as the daemon reads them on
    start (its config, its store, the log's chain and high-water mark verified)."""
    from meshgate.coordinator.config import CoordinatorConfig
    from meshgate.coordinator.leadership import job_store_opener

    config = CoordinatorConfig.load(server_dir / "coordinator.toml")
    store = job_store_opener(config)(config.rendezvous)  # the declared job's own log
    try:
        events = store.load()
    finally:
        store.close()
    counted = collections.Counter(type(event).__name__ for event in events)
    # Ranks given against a vouch (the coordinator recorded the vouch it spent).
    counted["vouched"] = sum(1 for e in events if type(e).__name__ == "RankAssigned" and e.vouch_id)
    return counted


def check_store(variant: str, server_dir: Path, workers: int) -> collections.Counter:
    state = server_dir / "state" / "jobs" / JOB / "state.sqlite3"
    if variant == "memory+plaintext":
        assert not state.exists()
        return collections.Counter()
    assert state.exists()
    events = stored_events(server_dir)
    assert events["RankAssigned"] == workers and events["NodeJoined"] == workers // 8, events
    return events


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_smoke_writes_every_section_in_both_variants(tmp_path):
    env = dict(os.environ, RES_OPTIONS="timeout:1 attempts:1", PYTHONPATH=str(REPO))
    work = tmp_path / "work"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--out", str(tmp_path), "--work-dir", str(work)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    json_line = [line for line in proc.stdout.splitlines() if line.startswith("JSON: ")]
    assert json_line, proc.stdout[-2000:]
    path = Path(json_line[-1][len("JSON: ") :])
    assert path.parent == tmp_path and path.exists()
    results = json.loads(path.read_text())
    table = path.with_suffix(".txt").read_text()

    for section in ("machine", "variants", "c10d", "goals"):
        assert section in results, section
    assert list(results["variants"]) == list(VARIANTS)
    machine = results["machine"]
    assert machine["nproc"] >= 1 and machine["cpu_model"] and machine["grpcio"] and machine["torch"]
    assert machine["cpu_model"] in table
    for variant in VARIANTS:
        check_variant(variant, results["variants"][variant], work / variant)

    # 3. torch's c10d rendezvous ran once per node count and finished at the smoke size.
    for row in results["c10d"]["runs"]:
        assert row["c10d"]["finished"], row["c10d"]
        assert row["c10d"]["ranks_ok"]

    goals = results["goals"]
    for goal in (
        "Register throughput ≥ 0.8 x bare echo",
        "coordinator peak RSS ≤ 2 KiB/worker",
        "100k workers verified ≤ 10 s through agents",
    ):
        assert [g["variant"] for g in goals if g["goal"] == goal] == list(VARIANTS), goal
    assert {g["variant"] for g in goals} == set(VARIANTS)
    for heading in (
        "1. Register throughput",
        "2. Time to a verified world",
        "3. Against torch's c10d",
        "4. How cost grows",
        "5. Through agents",
        "6. Jobs",
        "Goals, per variant",
        *VARIANTS,
    ):
        assert heading in table


def check_variant(variant: str, figures: dict, work: Path) -> None:
    for section in ("throughput", "world", "growth", "fan_in", "jobs", "c10d"):
        assert section in figures, (variant, section)
    transport = TRANSPORT[variant]

    # 1. throughput: both servers served every call, the client verified every answer.
    tp = figures["throughput"]
    assert tp["transport"] == {"echo": transport, "coordinator": transport}
    for side in ("echo", "coordinator"):
        assert positive(tp[side]["register_per_s"]), side
        assert positive(tp[side]["server_cpu_per_call_us"]), side
        assert tp[side]["latency_p50_ms"] <= tp[side]["latency_p99_ms"]
        for run in tp["runs"][side]:
            assert run["errors"] == 0, run["errors_kept"]
            assert run["verified"] == tp["n"]
            assert run["transport"] == transport
    assert positive(tp["ratio"]) and positive(tp["cpu_ratio"])
    assert tp["ratio_of_medians"] == pytest.approx(tp["coordinator"]["register_per_s"] / tp["echo"]["register_per_s"])
    assert len(tp["round_ratios"]) == tp["rounds"]
    assert min(tp["round_ratios"]) <= tp["ratio"] <= max(tp["round_ratios"])
    assert tp["request_bytes"] > 50 and tp["response_bytes"] > tp["request_bytes"]
    # The echo server answers with a real RegisterResponse of the same size (± varints).
    assert abs(tp["echo_response_bytes"] - tp["response_bytes"]) <= 8
    for r in range(tp["rounds"]):
        check_store(variant, work / f"tp-coordinator-{r}", tp["n"])

    # 2. a verified world: every worker registered, verified and got through the barrier,
    # and (SQLite) every rank is in the log the coordinator left behind.
    worlds = figures["world"]["runs"]
    assert [r["world"] for r in worlds] == sorted(r["world"] for r in worlds)
    assert not figures["world"]["failed"]
    for run in worlds:
        assert run["errors"] == 0, run["errors_kept"]
        assert run["verified"] == run["world"] and run["awaited"] == run["world"]
        assert run["transport"] == transport
        assert positive(run["wall_s"]) and positive(run["latency_p99_ms"])
        assert positive(run["rss_before_kib"]) and positive(run["rss_peak_kib"])
        assert run["rss_peak_kib"] >= run["rss_before_kib"]
        assert positive(run["server_cpu_s"])
        check_store(variant, work / f"world-{run['world']}", run["world"])

    # 3. meshgate's side of the c10d comparison.
    for row in figures["c10d"]["runs"]:
        m = row["meshgate"]
        assert m["errors"] == 0 and m["world"] == 8 * row["nodes"]
        assert m["verified"] == m["awaited"] == m["world"] and m["transport"] == transport
        assert positive(row["speedup"]) and row["speedup_is_lower_bound"] is False
        check_store(variant, work / f"c10d-mg-{row['nodes']}", m["world"])

    # 4. growth: one row per world size, normalised to the smallest.
    growth = figures["growth"]["rows"]
    assert len(growth) == len(worlds)
    assert growth[0]["wall_vs_smallest"] == pytest.approx(1.0)
    assert all(positive(r["wall_per_worker_us"]) for r in growth)

    # 5. fan-in: the largest world again, through simulated agents, every worker verified;
    # each agent joined with its own token (and, under mTLS, its own certificate and connection).
    fan_in = figures["fan_in"]
    assert "error" not in fan_in, fan_in
    nodes = fan_in["workers"] // 8
    assert fan_in["workers"] == worlds[-1]["world"] and fan_in["verified"] == fan_in["workers"]
    assert fan_in["nodes"] == nodes and positive(fan_in["wall_s"]) and positive(fan_in["setup_s"])
    assert fan_in["direct_wall_s"] == worlds[-1]["wall_s"] and positive(fan_in["speedup_vs_direct"])
    assert fan_in["transport"] == transport
    fan_dir = work / f"fan-in-{fan_in['workers']}"
    events = check_store(variant, fan_dir, fan_in["workers"])
    if variant == "sqlite+mtls":
        # each agent keyed into the job; its token was the cluster's (created and spent in the
        # cluster's log, never the job's: node identity is checked once, by the cluster)
        assert events["NodeKeyed"] == nodes and events["TokenCreated"] == 0, events
        # The daemon's default under TLS: every Register through an agent carried its vouch.
        assert fan_in["vouched"] and events["vouched"] == fan_in["workers"], events
        assert fan_in["connections"] == nodes
        certs = sorted((fan_dir / "tls").glob("agent-*.pem"))
        assert len(certs) == nodes
        for cert in certs:
            subject = x509.load_pem_x509_certificate(cert.read_bytes()).subject
            assert cert.name == f"agent-{subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value}.pem"
    else:
        assert fan_in["connections"] <= 2  # one per agent process

    # 6. jobs: the large job reached a verified world on every node and then succeeded (each
    # worker's exit reported); every small job too, one at a time per agent.
    large, small = figures["jobs"]["large"], figures["jobs"]["small"]
    assert "error" not in large and "error" not in small, figures["jobs"]
    assert large["workers"] == 8 * large["nodes"] and large["final_state"] == "SUCCEEDED"
    assert 0 < large["last_node_told_s"] <= large["submit_to_world_s"] and positive(large["coordinator_cpu_s"])
    assert large["connections"] == (large["nodes"] if variant == "sqlite+mtls" else min(2, large["nodes"]))
    assert small["succeeded"] == small["jobs"] and small["states"] == ["SUCCEEDED"] and small["agents"] == 8
    assert positive(small["jobs_per_min"]) and small["submit_to_world_p50_s"] <= small["submit_to_world_max_s"]


@pytest.mark.parametrize("variant, from_pool", [(v, False) for v in VARIANTS] + [("memory+plaintext", True)])
def test_the_recovery_bench_runs_end_to_end_and_the_spare_takes_the_lost_block(tmp_path, variant, from_pool):
    """bench/recovery.py cannot rot: 2 nodes and a spare (or an idle node of the pool) on
    the real daemon, one member killed, the world of generation 1 verified on the survivor
    and the node that took the block. The order of its moments is checked; its speed is
    BENCHMARKS.md's."""
    from bench.recovery import run_recovery
    from bench.variants import MEMORY_PLAINTEXT, SQLITE_MTLS

    chosen = MEMORY_PLAINTEXT if variant == "memory+plaintext" else SQLITE_MTLS
    result = run_recovery(tmp_path, chosen, nodes=2, heartbeat_s=0.3, misses=3, from_pool=from_pool)
    assert result["variant"] == chosen.name and result["workers"] == 16, result
    assert result["replacement"] == ("from the pool" if from_pool else "spare"), result
    assert positive(result["detect_s"]) and result["detect_s"] <= result["told_s"] <= result["world_s"], result
    # where the cores went from the kill to the world (the coordinator's may round to 0 ticks)
    assert positive(result["bench_cpu_s"]) and result["coordinator_cpu_s"] >= 0, result
