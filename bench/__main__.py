"""python -m bench [--quick | --smoke]: measure meshgate against its baselines, print one
table and write the same figures as JSON under bench/results/ (the path is printed last).

Sections (see bench/__init__.py): 1 throughput vs a bare echo server, 2 time to a
verified world, 3 against torch's c10d rendezvous, 4 growth with N, 5 through agents,
6 jobs (a large job from SubmitJob to its world; small jobs per minute),
7 torchrun on meshgate's backend against torchrun on c10d (real agents and torchrun),
8 recovery: a node of a running job dies (simulated agents, a spare and from the pool;
then real torchrun on c10d against real agents, the same shape).

Each section runs once per variant (bench/variants.py; by default memory+plaintext and
sqlite+mtls, the daemon's defaults), one variant right after the other, so both see the
same machine; torch's c10d runs once per node count, and only meshgate's side per variant.
The JSON keeps each variant's figures under results["variants"][name][section].
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from bench.common import machine, median, ratio, round_world
from bench.load import run_load, summarise_runs
from bench.report import c10d_joins
from bench.servers import ServerProcess
from bench.variants import DEFAULT_VARIANTS, Variant, parse_variants

RESULTS = Path(__file__).resolve().parent / "results"

MODES = {
    # throughput workers, rounds; worlds; c10d node counts, cap; profile the coordinator
    "full": dict(
        throughput_n=10_000,
        rounds=5,
        worlds=[1_000, 10_000, 100_000],
        c10d_nodes=[64, 256, 1024],
        c10d_timeout=120.0,
        job_nodes=1_000,
        small_jobs=64,
        profile=True,
        concurrency=256,
        await_concurrency=512,
        torchrun_nodes=4,
        torchrun_rounds=3,
        # nodes of section 8's jobs (8 workers each; heartbeat: recovery_heartbeat_s)
        recovery_nodes=[8, 1000],
        recovery_torchrun=True,
    ),
    "quick": dict(
        throughput_n=2_000,
        rounds=3,
        worlds=[1_000, 5_000],
        c10d_nodes=[16, 64],
        c10d_timeout=30.0,
        job_nodes=100,
        small_jobs=16,
        profile=False,
        concurrency=256,
        await_concurrency=512,
        torchrun_nodes=3,
        torchrun_rounds=1,
        recovery_nodes=[8],
        recovery_torchrun=True,
    ),
    "smoke": dict(
        throughput_n=256,
        rounds=1,
        worlds=[64, 256],
        c10d_nodes=[4],
        c10d_timeout=30.0,
        job_nodes=4,
        small_jobs=8,
        profile=False,
        concurrency=32,
        await_concurrency=64,
        # Section 7 starts real torchrun and agent processes (a minute or more here): the
        # smoke run leaves it out; tests/test_torchrun.py runs it at 2 nodes.
        torchrun_nodes=0,
        torchrun_rounds=1,
        # Section 8 is left out too: tests/test_bench.py runs bench/recovery.py on the real
        # daemon, tests/test_bench_recovery.py what the section makes of its figures.
        recovery_nodes=[],
        recovery_torchrun=False,
    ),
}

THROUGHPUT_KEYS = (
    "register_per_s",
    "latency_p50_ms",
    "latency_p99_ms",
    "server_cpu_per_call_us",
    "server_cpu_utilisation",
    "client_cpu_per_worker_us",
    "wall_s",
)


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _median_run(runs: list[dict]) -> dict:
    return {key: summarise_runs(runs, key) for key in THROUGHPUT_KEYS}


def section_throughput(args, tmp: Path, variant: Variant) -> dict:
    n = round_world(args.throughput_n)
    echo_runs, coord_runs, round_ratios = [], [], []
    sizes = {}
    for r in range(args.rounds):
        # Paired rounds, fresh servers each time, in ABBA order (echo first in even rounds,
        # meshgate first in odd ones): a noisy neighbour or a drift hits both sides alike.
        got = {}
        for kind in ("echo", "coordinator") if r % 2 == 0 else ("coordinator", "echo"):
            with ServerProcess(kind, n, tmp / f"tp-{kind}-{r}", variant) as server:
                if kind == "echo":
                    sizes = {
                        "echo_request_bytes": server.info["request_bytes"],
                        "echo_response_bytes": server.info["response_bytes"],
                    }
                got[kind] = run_load(server, kind, n, procs=args.procs, concurrency=args.concurrency)
        e, c = got["echo"], got["coordinator"]
        echo_runs.append(e)
        coord_runs.append(c)
        round_ratios.append(ratio(c["register_per_s"], e["register_per_s"]))
        log(
            f"{variant.name} throughput round {r + 1}/{args.rounds}: echo {e['register_per_s']:.0f}/s, "
            f"meshgate {c['register_per_s']:.0f}/s (errors {e['errors']}/{c['errors']})"
        )
    echo_m, coord_m = _median_run(echo_runs), _median_run(coord_runs)
    return {
        "n": n,
        "rounds": args.rounds,
        "transport": {"echo": echo_runs[-1]["transport"], "coordinator": coord_runs[-1]["transport"]},
        "request_bytes": coord_runs[-1]["request_bytes"],
        "response_bytes": coord_runs[-1]["response_bytes"],
        **sizes,
        "echo": echo_m,
        "coordinator": coord_m,
        # The goal's figure: throughput against the echo server's, same harness, same run;
        # the median of the paired rounds (each pair ran back to back on the same machine).
        "ratio": median(r for r in round_ratios if r is not None),
        "round_ratios": round_ratios,
        "ratio_of_medians": ratio(coord_m["register_per_s"], echo_m["register_per_s"]),
        # Less sensitive to a shared machine: server CPU per call, echo over coordinator.
        "cpu_ratio": ratio(echo_m["server_cpu_per_call_us"], coord_m["server_cpu_per_call_us"]),
        "errors": sum(r["errors"] for r in echo_runs + coord_runs),
        "runs": {"echo": echo_runs, "coordinator": coord_runs},
    }


def section_profile(args, tmp: Path, out_base: Path, variant: Variant) -> dict:
    """One more throughput round per server with a profiler attached (not in the figures):
    where the coordinator's time per Register goes, next to the echo server's per call.
    py-spy (sampling from outside, native frames too) where installed, else pyinstrument
    inside the server process (Python frames of the event loop's thread only)."""
    from bench import profile
    from bench.servers import PYINSTRUMENT_ENV

    n = round_world(args.throughput_n)
    tool = args.profiler
    if tool == "auto":
        tool = "py-spy" if profile.py_spy() else "pyinstrument"
    out: dict = {"n": n, "profiler": tool}
    for kind in ("echo", "coordinator"):
        raw = out_base.with_name(f"{out_base.name}-profile-{variant.name}-{kind}.txt")
        env = {PYINSTRUMENT_ENV: str(raw)} if tool == "pyinstrument" else None
        spy = None
        with ServerProcess(kind, n, tmp / f"profile-{kind}", variant, env_extra=env) as server:
            if tool == "py-spy":
                spy = profile.Spy(server.pid, raw)
            run = run_load(server, kind, n, procs=args.procs, concurrency=args.concurrency)
            path = spy.stop() if spy else None
        if spy is None:
            path = raw if raw.exists() else None
        if path is None:
            return {"n": n, "profiler": tool, "error": spy.error if spy else f"pyinstrument wrote no profile to {raw}"}
        out[kind] = {
            "raw": str(path),
            "native": bool(spy and spy.native),
            "register_per_s_while_profiled": run["register_per_s"],
            "server_cpu_per_call_us": run["server_cpu_per_call_us"],
            "summary": profile.summarise(path),
        }
    out["text"] = profile.render_comparison(out["echo"], out["coordinator"], tool)
    return out


def world_run(args, tmp: Path, n: int, label: str, variant: Variant) -> dict:
    with ServerProcess("coordinator", n, tmp / label, variant) as coord:
        run = run_load(
            coord,
            "coordinator",
            n,
            procs=args.procs,
            concurrency=args.concurrency,
            await_world=True,
            await_concurrency=args.await_concurrency,
            timeout_s=args.world_timeout,
        )
    log(
        f"{variant.name} world {n}: {run['wall_s']:.2f} s, p99 {run['latency_p99_ms']:.0f} ms, "
        f"peak RSS {run['rss_peak_per_worker_kib']:.2f} KiB/worker, errors {run['errors']}"
    )
    return run


def section_world(args, tmp: Path, variant: Variant, echo_rate: Optional[float]) -> dict:
    runs, failed = [], []
    for n in args.worlds:
        try:
            run = world_run(args, tmp, round_world(n), f"world-{n}", variant)
        except (RuntimeError, TimeoutError) as exc:
            # Say so in the results and go on: one world that did not finish must not
            # cost the whole run its figures.
            log(f"{variant.name} world {n}: FAILED: {exc}")
            failed.append({"world": round_world(n), "error": str(exc)[:2000]})
            continue
        # The echo server's time for N Register-sized calls, measured in section 1.
        run["echo_floor_s"] = round_world(n) / echo_rate if echo_rate else None
        run["vs_echo_floor"] = ratio(run["wall_s"], run["echo_floor_s"])
        run["errors_kept"] = run["errors_kept"][:3]
        runs.append(run)
    out = {"await_concurrency": args.await_concurrency, "runs": runs, "failed": failed}
    if len(runs) > 1:
        # Fixed costs (in-flight calls, allocator arenas) dominate small worlds; the slope
        # between the smallest and the largest world is the memory each worker adds.
        small, large = min(runs, key=lambda r: r["world"]), max(runs, key=lambda r: r["world"])
        grown = (large["rss_peak_kib"] - large["rss_before_kib"]) - (small["rss_peak_kib"] - small["rss_before_kib"])
        out["rss_marginal_kib_per_worker"] = grown / (large["world"] - small["world"])
    return out


def section_fan_in(args, tmp: Path, variant: Variant, world: Optional[dict]) -> dict:
    """Mode 5: the same world through agent fan-in, next to section 2's direct run."""
    from bench.fanin import run_fan_in

    n = round_world(args.fanin_workers or max(args.worlds))
    try:
        run = run_fan_in(n, tmp / f"fan-in-{n}", processes=args.procs, variant=variant)
    except (RuntimeError, TimeoutError, OSError) as exc:
        # An open-file limit, memory, a stuck agent process: say so, keep the other figures.
        log(f"{variant.name} fan-in {n}: FAILED: {exc}")
        return {"variant": variant.name, "workers": n, "error": str(exc)[:2000]}
    direct = next((r for r in (world or {}).get("runs", []) if r["world"] == n), None)
    run["direct_wall_s"] = direct["wall_s"] if direct else None
    run["speedup_vs_direct"] = ratio(run["direct_wall_s"], run["wall_s"])
    log(
        f"{variant.name} fan-in {n}: {run['wall_s']:.2f} s ({run['nodes']} agents, setup "
        f"{run['setup_s']:.1f} s), coordinator CPU {run['coordinator_cpu_s']:.1f} s, "
        f"direct {run['direct_wall_s']}"
    )
    return run


def section_jobs(args, tmp: Path, variant: Variant) -> dict:
    """Mode 6: one large job from SubmitJob to its verified world; small jobs per minute."""
    from bench.jobs import SMALL_JOB_AGENTS, run_large_job, run_small_jobs

    figures: dict = {"variant": variant.name}
    runs = {
        "large": lambda: run_large_job(tmp / "jobs-large", variant, args.job_nodes, args.procs, args.job_heartbeat),
        "small": lambda: run_small_jobs(
            tmp / "jobs-small", variant, args.small_jobs, SMALL_JOB_AGENTS, args.procs, args.job_heartbeat
        ),
    }
    for name, run in runs.items():
        try:
            figures[name] = run()
        except (RuntimeError, TimeoutError, OSError) as exc:
            log(f"{variant.name} jobs, {name}: FAILED: {exc}")
            figures[name] = {"error": str(exc)[:2000]}
    large, small = figures["large"], figures["small"]
    if "error" not in large and "error" not in small:
        log(
            f"{variant.name} jobs: {large['nodes']}-node job submitted to world in {large['submit_to_world_s']:.2f} s; "
            f"{small['jobs']} small jobs at {small['jobs_per_min']:.0f}/min, "
            f"{small['coordinator_cpu_ms_per_job']:.0f} ms coordinator CPU each"
        )
    return figures


def _against_c10d(c: dict, m: dict) -> dict:
    """One node count: meshgate's run next to c10d's, and how much faster it was."""
    if c.get("finished"):
        speedup, lower = ratio(c["wall_s"], m["wall_s"]), False
    else:
        speedup, lower = ratio(c["timeout_s"], m["wall_s"]), True
    m = {
        k: m[k]
        for k in (
            "world",
            "verified",
            "awaited",
            "wall_s",
            "latency_p50_ms",
            "latency_p99_ms",
            "server_cpu_s",
            "errors",
            "rss_peak_per_worker_kib",
            "transport",
        )
    }
    return {"nodes": c["nodes"], "meshgate": m, "speedup": speedup, "speedup_is_lower_bound": lower}


def section_c10d(args, tmp: Path, variants: list[Variant]) -> tuple[dict, dict[str, dict]]:
    """torch's c10d once per node count, then meshgate's side in every variant; returns
    the c10d runs and each variant's meshgate runs against them."""
    from bench.c10d import run_c10d

    baseline, sides = [], {v.name: [] for v in variants}
    for nodes in args.c10d_nodes:
        log(f"c10d: {nodes} nodes (cap {args.c10d_timeout:g} s)")
        c = run_c10d(nodes, args.c10d_timeout)
        baseline.append({"nodes": nodes, "c10d": c})
        for v in variants:
            row = _against_c10d(c, world_run(args, tmp / v.name, nodes * 8, f"c10d-mg-{nodes}", v))
            sides[v.name].append(row)
            log(
                f"c10d {nodes} nodes: {c.get('wall_s')} s (finished {c.get('finished')}), "
                f"meshgate {v.name} {row['meshgate']['wall_s']:.2f} s"
            )
    c10d = {
        "c10d_timeout_s": args.c10d_timeout,
        "c10d_mode": "threads, one process",
        "workers_per_node": 8,
        "runs": baseline,
    }
    return c10d, {name: {"runs": runs} for name, runs in sides.items()}


def recovery_heartbeat_s(nodes: int) -> float:
    """The agents' heartbeat interval of section 8: 0.5 s for small jobs; 2 s from 100 nodes
    (1,000 nodes at 0.5 s would be 2,000 heartbeats a second from one load process)."""
    return 0.5 if nodes < 100 else 2.0


def section_recovery(args, tmp: Path, variant: Variant) -> dict:
    """Mode 8: a node of a running job dies; detect, told, world; a spare, then the pool."""
    from bench.recovery import run_recovery

    runs = []
    for nodes in args.recovery_nodes:
        for from_pool in (False, True):
            label = f"recovery-{nodes}-{'pool' if from_pool else 'spare'}"
            try:
                run = run_recovery(tmp / label, variant, nodes, recovery_heartbeat_s(nodes), 3, from_pool)
            except (RuntimeError, TimeoutError, OSError) as exc:
                log(f"{variant.name} {label}: FAILED: {exc}")
                replacement = "from the pool" if from_pool else "spare"
                runs.append({"nodes": nodes, "replacement": replacement, "error": str(exc)[:2000]})
                continue
            log(
                f"{variant.name} {label}: detect {_s(run['detect_s'])}, told {_s(run['told_s'])}, "
                f"world {_s(run['world_s'])} (goal {run['goal_s']:g} s), load {run['loadavg']:.1f}"
            )
            runs.append(run)
    return {"runs": runs}


def _s(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f} s"


def section_growth(world: dict) -> dict:
    runs = sorted(world["runs"], key=lambda r: r["world"])
    base = runs[0]
    rows = [
        {
            "world": r["world"],
            "wall_per_worker_us": r["wall_per_worker_us"],
            "wall_vs_smallest": ratio(r["wall_per_worker_us"], base["wall_per_worker_us"]),
            "server_cpu_per_worker_us": r["server_cpu_per_worker_us"],
            "cpu_vs_smallest": ratio(r["server_cpu_per_worker_us"], base["server_cpu_per_worker_us"]),
        }
        for r in runs
    ]
    return {
        "rows": rows,
        "largest_vs_smallest_wall": rows[-1]["wall_vs_smallest"],
        "largest_vs_smallest_cpu": rows[-1]["cpu_vs_smallest"],
    }


def goals(results: dict) -> list[dict]:
    """One row per goal and variant, the variants of a goal next to each other."""
    rows = [
        row
        for name, figures in results["variants"].items()
        for row in variant_goals(name, figures, results.get("c10d"))
    ]
    first: dict[str, int] = {}
    for i, row in enumerate(rows):
        first.setdefault(row["goal"], i)
    return sorted(rows, key=lambda row: first[row["goal"]])


def variant_goals(variant: str, results: dict, c10d_baseline: Optional[dict]) -> list[dict]:
    """The goals as one variant's figures meet them; ``c10d_baseline``: section 3's c10d runs."""
    out = []

    def add(goal: str, measured: str, met) -> None:
        if met is None:
            met = "not measured"
        elif not isinstance(met, str):
            met = "yes" if met else "NO"
        out.append({"goal": goal, "variant": variant, "measured": measured, "met": met})

    tp = results.get("throughput")
    if tp:
        spread = [r for r in tp["round_ratios"] if r is not None]
        add(
            "Register throughput ≥ 0.8 x bare echo",
            f"{tp['ratio']:.2f} x (rounds {min(spread):.2f}–{max(spread):.2f}; "
            f"server CPU per call: {tp['cpu_ratio']:.2f} x)",
            tp["ratio"] >= 0.8,
        )
    world = results.get("world")
    for failure in (world or {}).get("failed", []):
        add(
            f"a verified world of {failure['world']} workers",
            "did not complete: " + failure["error"].splitlines()[0][:120],
            False,
        )
    if world and world["runs"]:
        big = [r for r in world["runs"] if r["world"] >= 100_000]
        if big:
            add(
                "100k workers to a verified world ≤ 30 s (2 cores, direct)",
                f"{big[0]['wall_s']:.1f} s",
                big[0]["wall_s"] <= 30 and not big[0]["errors"],
            )
        else:
            largest = max(world["runs"], key=lambda r: r["world"])
            add(
                "100k workers to a verified world ≤ 30 s (2 cores, direct)",
                f"not run in this mode (largest N {largest['world']}: {largest['wall_s']:.1f} s)",
                None,
            )
        largest = max(world["runs"], key=lambda r: r["world"])
        marginal = world.get("rss_marginal_kib_per_worker")
        slope = f"; marginal {marginal:.2f} KiB/worker" if marginal is not None else ""
        per_worker = largest["rss_peak_per_worker_kib"]
        add(
            "coordinator peak RSS ≤ 2 KiB/worker",
            f"{per_worker:.2f} KiB/worker at N={largest['world']}{slope}",
            # Below ~50k workers the fixed costs of ~1.5k calls in flight dominate the
            # per-worker figure; the goal is about large worlds.
            per_worker <= 2.0
            if largest["world"] >= 50_000 or per_worker <= 2.0
            else "n/a below 50k workers (fixed costs dominate)",
        )
    c10d = results.get("c10d")
    if c10d:
        runs = [r for r in c10d["runs"] if r["nodes"] >= 1024]
        last = runs[0] if runs else max(c10d["runs"], key=lambda r: r["nodes"])
        lower = last["speedup_is_lower_bound"]
        measured = f"{'≥ ' if lower else ''}{last['speedup']:.1f}x at {last['nodes']} nodes" + (
            f" (c10d did not finish in {c10d_baseline['c10d_timeout_s']:g} s: a lower bound)" if lower else ""
        )
        torch_run = next(r["c10d"] for r in c10d_baseline["runs"] if r["nodes"] == last["nodes"])
        peak, at_cap = c10d_joins(torch_run)
        if peak is not None:
            measured += f"; c10d joined at most {peak}/{last['nodes']} nodes, {at_cap} at the cap"
        if not runs:
            met = None
        elif last["speedup"] >= 20:
            met = True
        elif lower:
            met = "lower bound only" + (": c10d was not converging" if peak and at_cap < peak else "")
        else:
            met = False
        add("≥ 20x faster than torch c10d at 1024 nodes", measured, met)
    fan_in = results.get("fan_in")
    if fan_in and "error" in fan_in:
        add(
            "100k workers verified ≤ 10 s through agents",
            f"{fan_in['workers']} workers did not complete: " + fan_in["error"].splitlines()[0][:120],
            False,
        )
    elif fan_in:
        measured = f"{fan_in['wall_s']:.1f} s for {fan_in['workers']} workers on {fan_in['nodes']} agents" + (
            f" ({fan_in['speedup_vs_direct']:.1f}x faster than direct)" if fan_in["speedup_vs_direct"] else ""
        )
        add(
            "100k workers verified ≤ 10 s through agents",
            measured,
            (fan_in["wall_s"] <= 10 and fan_in["verified"] == fan_in["workers"])
            if fan_in["workers"] >= 100_000
            else "not run at 100k in this mode",
        )
    if fan_in and "error" not in fan_in:
        per_worker = 1e6 * fan_in["coordinator_cpu_s"] / fan_in["workers"]
        add(
            "coordinator CPU ≤ 100 µs/worker through agents (100k)",
            f"{per_worker:.0f} µs/worker ({fan_in['coordinator_cpu_s']:.1f} s for {fan_in['workers']} workers)",
            per_worker <= 100 if fan_in["workers"] >= 100_000 else "not run at 100k in this mode",
        )
    jobs = results.get("jobs") or {}
    large, small = jobs.get("large"), jobs.get("small")
    goal = "a 1,000-node job: SubmitJob to world ≤ one heartbeat interval + 2 s"
    if large and "error" in large:
        add(goal, large["error"].splitlines()[0][:120], False)
    elif large:
        add(
            goal,
            f"{large['submit_to_world_s']:.2f} s for {large['nodes']} nodes (heartbeat {large['heartbeat_s']:g} s; "
            f"last node told after {large['last_node_told_s']:.2f} s)",
            large["submit_to_world_s"] <= large["heartbeat_s"] + 2
            if large["nodes"] >= 1000
            else "not run at 1,000 nodes in this mode",
        )
    goal = "≥ 1,000 small jobs a minute of one coordinator core (60 s / CPU per job)"
    if small and "error" in small:
        add(goal, small["error"].splitlines()[0][:120], False)
    elif small:
        capacity = 60_000 / small["coordinator_cpu_ms_per_job"]
        add(
            goal,
            f"{capacity:.0f} jobs/min ({small['coordinator_cpu_ms_per_job']:.1f} ms CPU per job; "
            f"{small['jobs_per_min']:.0f}/min run through {small['agents']} agents)",
            capacity >= 1000,
        )
    goal = "recovery at 1,000 nodes: world re-formed ≤ detection bound + 2 s"
    for run in (results.get("recovery") or {}).get("runs", []):
        if run["nodes"] < 1000 and any(r["nodes"] >= 1000 for r in results["recovery"]["runs"]):
            continue
        if "error" in run:
            add(f"{goal} ({run['replacement']})", run["error"].splitlines()[0][:120], False)
            continue
        add(
            f"{goal} ({run['replacement']})",
            f"{run['world_s']:.2f} s at {run['nodes']} nodes (detect {_s(run['detect_s'])}, "
            f"bound {run['detection_bound_s']:g} s)",
            run["goal_met"] if run["nodes"] >= 1000 else "not run at 1,000 nodes in this mode",
        )
    growth = results.get("growth")
    if growth and len(growth["rows"]) > 1:
        g = growth["largest_vs_smallest_wall"]
        add(
            "time per worker flat in N (largest/smallest N ≤ 1.5)",
            f"{g:.2f} x wall, {growth['largest_vs_smallest_cpu']:.2f} x coordinator CPU",
            g <= 1.5,
        )
    return out


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes, well under 3 minutes")
    size.add_argument("--smoke", action="store_true", help="tiny sizes for the test suite")
    parser.add_argument(
        "--sections", default="1,2,3,4,5,6,7,8", help="which sections to run, e.g. 1,2 (4 needs 2; 5 compares with 2)"
    )
    parser.add_argument(
        "--variants",
        default=",".join(v.name for v in DEFAULT_VARIANTS),
        help="STORE+TRANSPORT of the coordinator under test, each section once per "
        "variant (store memory or sqlite, transport plaintext or mtls)",
    )
    parser.add_argument(
        "--fanin-workers", type=int, help="workers in section 5 (default: the largest world of section 2)"
    )
    parser.add_argument("--job-nodes", type=int, help="nodes of section 6's large job (8 workers each)")
    parser.add_argument("--small-jobs", type=int, help="one-node jobs in section 6")
    parser.add_argument(
        "--job-heartbeat", type=float, default=1.0, help="section 6: [cluster] heartbeat_interval_s of the agents"
    )
    parser.add_argument("--procs", type=int, default=2, help="load generator processes")
    parser.add_argument("--concurrency", type=int, help="Register calls in flight per process")
    parser.add_argument("--await-concurrency", type=int, help="AwaitWorld calls in flight per process")
    parser.add_argument("--throughput-n", type=int, help="workers in section 1")
    parser.add_argument("--rounds", type=int, help="interleaved rounds in section 1")
    parser.add_argument("--worlds", help="world sizes in section 2, e.g. 1000,10000")
    parser.add_argument("--c10d-nodes", help="node counts in section 3, e.g. 64,256")
    parser.add_argument("--c10d-timeout", type=float, help="cap of each c10d run, seconds")
    parser.add_argument("--world-timeout", type=float, default=900.0)
    parser.add_argument(
        "--torchrun-nodes", type=int, help="nodes (agents, torchrun processes) in section 7; 0 skips it"
    )
    parser.add_argument("--torchrun-rounds", type=int, help="rounds of both backends in section 7")
    parser.add_argument("--recovery-nodes", help="section 8: nodes of the jobs that lose one, e.g. 8,1000")
    parser.add_argument(
        "--recovery-torchrun",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="section 8: the same failure on real torchrun (c10d) and real agents (default: on, not in smoke)",
    )
    parser.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="profile both servers (default: on in full mode)",
    )
    parser.add_argument(
        "--profiler",
        choices=("auto", "py-spy", "pyinstrument"),
        default="auto",
        help="auto: py-spy where installed, else pyinstrument",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="keep every server's files (config, state, keys, certificates, logs) "
        "here, one folder per variant (default: a temporary directory, removed)",
    )
    args = parser.parse_args(argv)
    try:
        args.variants = parse_variants(args.variants)
    except ValueError as exc:
        parser.error(str(exc))
    args.mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    defaults = MODES[args.mode]
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if isinstance(args.worlds, str):
        args.worlds = [int(x) for x in args.worlds.split(",") if x]
    if isinstance(args.recovery_nodes, str):
        args.recovery_nodes = [int(x) for x in args.recovery_nodes.split(",") if x]
    if isinstance(args.c10d_nodes, str):
        args.c10d_nodes = [int(x) for x in args.c10d_nodes.split(",") if x]
    args.sections = {int(s) for s in args.sections.split(",") if s}
    return args


def _work_dir(path: Optional[Path]):
    if path is None:
        return tempfile.TemporaryDirectory(prefix="meshgate-bench-")
    path.mkdir(parents=True, exist_ok=True)
    return contextlib.nullcontext(str(path))


def main(argv: Optional[list[str]] = None) -> int:
    from bench.report import render

    args = parse_args(argv)
    started = time.monotonic()
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    out_base = args.out / f"{stamp}-{args.mode}"
    variants = args.variants
    results: dict = {
        "mode": args.mode,
        "started_at": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(),
        "settings": {
            k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items() if k not in ("out", "variants")
        },
        "variants": {v.name: {} for v in variants},
    }
    results["settings"]["out"] = str(args.out)
    results["settings"]["variants"] = [v.name for v in variants]
    # The machine may be shared: record how busy it was as each section began, per variant.
    timings: dict = {}
    loads: dict = {}

    def timed(label: str, section: Callable[..., dict], *section_args):
        loads[label] = os.getloadavg()[0]
        t = time.monotonic()
        out = section(*section_args)
        timings[label] = time.monotonic() - t
        return out

    with _work_dir(args.work_dir) as work_name:
        work = Path(work_name)
        if 1 in args.sections:
            log(f"1. throughput: {args.throughput_n} workers x {args.rounds} rounds")
            for v in variants:
                results["variants"][v.name]["throughput"] = timed(
                    f"throughput {v.name}", section_throughput, args, work / v.name, v
                )
        if args.profile and 1 in args.sections:
            log("profiling both servers during one more throughput round each")
            for v in variants:
                results["variants"][v.name]["profile"] = timed(
                    f"profile {v.name}", section_profile, args, work / v.name, out_base, v
                )
        if 2 in args.sections:
            log(f"2. time to a verified world: N = {args.worlds}")
            for v in variants:
                figures = results["variants"][v.name]
                echo_rate = (figures.get("throughput") or {}).get("echo", {}).get("register_per_s")
                figures["world"] = timed(f"world {v.name}", section_world, args, work / v.name, v, echo_rate)
                if 4 in args.sections and figures["world"]["runs"]:
                    figures["growth"] = section_growth(figures["world"])
        if 5 in args.sections:
            log("5. through agents (fan-in)")
            for v in variants:
                figures = results["variants"][v.name]
                figures["fan_in"] = timed(
                    f"fan_in {v.name}", section_fan_in, args, work / v.name, v, figures.get("world")
                )
        if 6 in args.sections:
            log(f"6. jobs: a {args.job_nodes}-node job; {args.small_jobs} small jobs")
            for v in variants:
                results["variants"][v.name]["jobs"] = timed(f"jobs {v.name}", section_jobs, args, work / v.name, v)
        if 3 in args.sections:
            log(f"3. against torch c10d: nodes = {args.c10d_nodes}")
            results["c10d"], sides = timed("c10d", section_c10d, args, work, variants)
            for name, side in sides.items():
                results["variants"][name]["c10d"] = side
        if 7 in args.sections and args.torchrun_nodes > 0:
            from bench.torchrun import run_section

            log(f"7. torchrun: meshgate's backend against c10d, {args.torchrun_nodes} nodes x 2 workers")
            results["torchrun"] = timed(
                "torchrun", run_section, work, args.torchrun_nodes, args.torchrun_rounds, 300.0, log
            )
        if 8 in args.sections and args.recovery_nodes:
            log(f"8. recovery: jobs of {args.recovery_nodes} nodes lose one")
            for v in variants:
                results["variants"][v.name]["recovery"] = timed(
                    f"recovery {v.name}", section_recovery, args, work / v.name, v
                )
            if args.recovery_torchrun:
                from bench.recovery_torchrun import run_section as recovery_on_processes

                results["recovery_torchrun"] = timed(
                    "recovery torchrun", recovery_on_processes, work / "recovery", 3, 240.0, "", log
                )
    results["goals"] = goals(results)
    results["section_seconds"] = timings
    results["loadavg_at_section_start"] = loads
    results["loadavg_at_end"] = list(os.getloadavg())
    results["duration_s"] = time.monotonic() - started
    text = render(results)
    json_path = out_base.with_suffix(".json")
    json_path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    out_base.with_suffix(".txt").write_text(text + "\n")
    print(text)
    print(f"\nJSON: {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
