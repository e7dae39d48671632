"""The benchmark's one table (plain text, also valid Markdown) from its JSON results."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from bench.common import describe_machine


def _fmt(value: Any, spec: str = ".2f") -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return format(value, spec)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], text_columns: int = 1) -> str:
    """The first ``text_columns`` columns left-aligned, the figures after them right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = ["| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + " |"]
    out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells[1:]:
        out.append(
            "| "
            + " | ".join(c.ljust(w) if i < text_columns else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
            + " |"
        )
    return "\n".join(out)


def _speedup(row: dict) -> str:
    value = row.get("speedup")
    if value is None:
        return "-"
    return ("≥ " if row.get("speedup_is_lower_bound") else "") + f"{value:.1f}x"


def c10d_joins(c: dict) -> tuple[Optional[int], Optional[int]]:
    """Where c10d did not finish: (the most nodes ever joined at once, those joined at the
    cap), from the probes of bench.c10d. A peak above the final count means joined nodes
    were dropped again (missed keep-alive heartbeats): the rendezvous was not converging."""
    joined = [p["joined"] for p in c.get("progress") or [] if "joined" in p]
    if c.get("finished") or not joined:
        return None, None
    return max(joined), joined[-1]


def _c10d_cell(c: dict) -> str:
    if c.get("finished"):
        return f"{c['wall_s']:.2f} s"
    peak, last = c10d_joins(c)
    text = f"did not finish in {c['timeout_s']:g} s"
    if peak is not None:
        text += f"; joined: peak {peak}/{c['nodes']}, {last} at the cap"
    return text


def _transport(figures: dict) -> Optional[dict]:
    """What the variant's coordinator answered each kind of client (bench.servers.transport_check)."""
    tp = figures.get("throughput")
    if tp:
        return tp["transport"]["coordinator"]
    runs = (figures.get("world") or {}).get("runs")
    if runs:
        return runs[0]["transport"]
    return (figures.get("fan_in") or {}).get("transport")


def _section_throughput(variants: dict) -> list[str]:
    named = [(name, f["throughput"]) for name, f in variants.items() if f.get("throughput")]
    if not named:
        return []
    tp = named[0][1]
    rows, spreads = [], []
    for name, tp in named:
        e, c = tp["echo"], tp["coordinator"]
        rows.append(
            [
                name,
                "bare grpc.aio echo",
                _fmt(e["register_per_s"], ".0f"),
                "1.00",
                _fmt(e["latency_p50_ms"], ".1f"),
                _fmt(e["latency_p99_ms"], ".1f"),
                _fmt(e["server_cpu_per_call_us"], ".0f"),
                "1.00",
            ]
        )
        rows.append(
            [
                name,
                "meshgate Register",
                _fmt(c["register_per_s"], ".0f"),
                _fmt(tp["ratio"], ".2f"),
                _fmt(c["latency_p50_ms"], ".1f"),
                _fmt(c["latency_p99_ms"], ".1f"),
                _fmt(c["server_cpu_per_call_us"], ".0f"),
                _fmt(tp["cpu_ratio"], ".2f"),
            ]
        )
        spreads.append(f"{name} " + ", ".join(_fmt(r, ".2f") for r in tp["round_ratios"]))
    return [
        "",
        f"1. Register throughput vs the physical limit: {tp['n']} workers, Register + "
        f"client-side verify, median of {tp['rounds']} paired rounds "
        f"(request {tp['request_bytes']} B, response {tp['response_bytes']} B); each variant "
        "against an echo server on its own transport",
        table(
            [
                "variant",
                "server",
                "calls/s",
                "vs echo",
                "p50 ms",
                "p99 ms",
                "server CPU µs/call",
                "echo CPU / this CPU",
            ],
            rows,
            text_columns=2,
        ),
        "vs echo = median of the per-round ratios (each round: both servers back to back, ABBA "
        "order): " + "; ".join(spreads),
    ]


def _section_world(variants: dict) -> list[str]:
    named = [(name, f["world"]) for name, f in variants.items() if f.get("world")]
    if not named:
        return []
    rows = []
    for n in sorted({r["world"] for _, w in named for r in w["runs"] + w.get("failed", [])}):
        for name, world in named:
            for r in (r for r in world["runs"] if r["world"] == n):
                rows.append(
                    [
                        r["world"],
                        name,
                        _fmt(r["wall_s"], ".2f"),
                        _fmt(r.get("vs_echo_floor"), ".2f"),
                        _fmt(r["latency_p50_ms"], ".1f"),
                        _fmt(r["latency_p99_ms"], ".1f"),
                        _fmt(r["rss_peak_per_worker_kib"], ".2f"),
                        _fmt(r["server_cpu_s"], ".1f"),
                        _fmt(r["client_cpu_s"], ".1f"),
                        r["errors"],
                    ]
                )
            for r in (r for r in world.get("failed", []) if r["world"] == n):
                rows.append([r["world"], name, "did not complete: " + r["error"].splitlines()[0][:60]] + ["-"] * 7)
    out = [
        "",
        "2. Time to a verified world (each worker: Register, verify, AwaitWorld; "
        f"{named[0][1]['await_concurrency']} AwaitWorld in flight per load process)",
        table(
            [
                "N",
                "variant",
                "wall s",
                "x echo floor",
                "Register p50 ms",
                "p99 ms",
                "peak RSS KiB/worker",
                "coordinator CPU s",
                "load-gen CPU s",
                "errors",
            ],
            rows,
            text_columns=2,
        ),
    ]
    marginal = [
        f"{name} {w['rss_marginal_kib_per_worker']:.2f}"
        for name, w in named
        if w.get("rss_marginal_kib_per_worker") is not None
    ]
    if marginal:
        out.append("marginal coordinator memory, smallest to largest N (KiB/worker): " + "; ".join(marginal))
    return out


def _section_c10d(c10d: Optional[dict], variants: dict) -> list[str]:
    if not c10d:
        return []
    names = [name for name, f in variants.items() if f.get("c10d")]
    headers = ["nodes", "torch c10d", "meshgate workers"]
    for name in names:
        headers += [f"meshgate {name}", "faster by"]
    rows = []
    for base in c10d["runs"]:
        row = [base["nodes"], _c10d_cell(base["c10d"]), base["nodes"] * c10d["workers_per_node"]]
        for name in names:
            side = next(r for r in variants[name]["c10d"]["runs"] if r["nodes"] == base["nodes"])
            row += [_fmt(side["meshgate"]["wall_s"], ".2f") + " s", _speedup(side)]
        rows.append(row)
    return [
        "",
        "3. Against torch's c10d dynamic rendezvous (c10d: each node a thread in one process, "
        "default settings, run once; meshgate: 8 workers per node, each Register + verify + "
        "AwaitWorld, in each variant)",
        table(headers, rows),
    ]


def _section_growth(variants: dict) -> list[str]:
    named = [(name, f["growth"]) for name, f in variants.items() if f.get("growth")]
    if not named:
        return []
    rows = [
        [
            r["world"],
            name,
            _fmt(r["wall_per_worker_us"], ".0f"),
            _fmt(r["wall_vs_smallest"], ".2f"),
            _fmt(r["server_cpu_per_worker_us"], ".0f"),
            _fmt(r["cpu_vs_smallest"], ".2f"),
        ]
        for n in sorted({r["world"] for _, g in named for r in g["rows"]})
        for name, growth in named
        for r in growth["rows"]
        if r["world"] == n
    ]
    return [
        "",
        "4. How cost grows with N (from 2)",
        table(
            ["N", "variant", "wall µs/worker", "vs smallest N", "coordinator CPU µs/worker", "vs smallest N"],
            rows,
            text_columns=2,
        ),
    ]


def _section_fan_in(variants: dict) -> list[str]:
    named = [(name, f["fan_in"]) for name, f in variants.items() if f.get("fan_in")]
    if not named:
        return []
    rows = []
    for name, f in named:
        if "error" in f:
            rows.append([f["workers"], name, "did not complete: " + f["error"].splitlines()[0][:60]] + ["-"] * 12)
            continue
        rows.append(
            [
                f["workers"],
                name,
                f["nodes"],
                f["connections"],
                "yes" if f["vouched"] else "no",
                _fmt(f["wall_s"], ".2f"),
                _fmt(f["direct_wall_s"], ".2f"),
                _fmt(f["speedup_vs_direct"], ".1f"),
                _fmt(f["batch_p50_ms"], ".0f"),
                _fmt(f["batch_p99_ms"], ".0f"),
                _fmt(f["coordinator_cpu_s"], ".1f"),
                _fmt(f["coordinator_peak_rss_kib"] / 1024, ".0f"),
                f["verified"],
                _fmt(f["setup_s"], ".1f"),
                _fmt(f["certs_s"], ".1f"),
            ]
        )
    return [
        "",
        "5. Through agents (fan-in): each simulated agent sends its node's Registers in one "
        "RegisterBatch signed once, as the agent does, and parks one AwaitWorld; every attestation is "
        "verified with its worker's nonce (all on these cores). Setup, not timed: agent certificates "
        "issued (mTLS), a join token minted "
        "per node, every agent connected and joined, and (where the coordinator requires vouches, its "
        "default under TLS) each worker's vouch signed by its agent's node key; under mTLS each agent "
        "has its own connection",
        table(
            [
                "N",
                "variant",
                "agents",
                "connections",
                "vouches",
                "wall s",
                "direct wall s (2)",
                "x faster",
                "batch p50 ms",
                "batch p99 ms",
                "coordinator CPU s",
                "coordinator peak RSS MiB",
                "verified",
                "setup s",
                "certs s",
            ],
            rows,
            text_columns=2,
        ),
    ]


def _section_jobs(variants: dict) -> list[str]:
    named = [(name, f["jobs"]) for name, f in variants.items() if f.get("jobs")]
    if not named:
        return []
    large_rows, small_rows = [], []
    for name, f in named:
        large, small = f["large"], f["small"]
        if "error" in large:
            large_rows.append([name, "did not complete: " + large["error"].splitlines()[0][:60]] + ["-"] * 7)
        else:
            large_rows.append(
                [
                    name,
                    large["nodes"],
                    large["workers"],
                    _fmt(large["submit_to_world_s"]),
                    _fmt(large["last_node_told_s"]),
                    _fmt(large["last_told_to_world_s"]),
                    _fmt(large["coordinator_cpu_s"], ".1f"),
                    large["final_state"],
                    _fmt(large["setup_s"], ".1f"),
                ]
            )
        if "error" in small:
            small_rows.append([name, "did not complete: " + small["error"].splitlines()[0][:60]] + ["-"] * 6)
        else:
            small_rows.append(
                [
                    name,
                    small["jobs"],
                    small["agents"],
                    _fmt(small["jobs_per_min"], ".0f"),
                    _fmt(small["submit_to_world_p50_s"]),
                    _fmt(small["submit_to_world_max_s"]),
                    _fmt(small["coordinator_cpu_ms_per_job"], ".1f"),
                    f"{small['succeeded']}/{small['jobs']}",
                ]
            )
    heartbeat = next((f[k]["heartbeat_s"] for _, f in named for k in ("large", "small") if "heartbeat_s" in f[k]), None)
    return [
        "",
        "6. Jobs (jobs-mode daemon, simulated agents that heartbeat the pool every "
        f"{_fmt(heartbeat, 'g')} s, join the job they are told of, vouch (mTLS), send one RegisterBatch, "
        "verify every attestation, park one AwaitWorld and report each worker's exit 0; setup not timed)",
        table(
            [
                "variant",
                "nodes",
                "workers",
                "SubmitJob to world s",
                "last node told s",
                "told to world s",
                "coordinator CPU s",
                "job ended",
                "setup s",
            ],
            large_rows,
        ),
        "",
        table(
            [
                "variant",
                "one-node jobs",
                "agents",
                "jobs/min",
                "submit to world p50 s",
                "max s",
                "coordinator CPU ms/job",
                "succeeded",
            ],
            small_rows,
        ),
    ]


def _section_profile(variants: dict) -> list[str]:
    out = []
    for name, f in variants.items():
        profile = f.get("profile")
        if not profile:
            continue
        out.append("")
        if profile.get("text"):
            out.append(
                f"Profile, {name} ({profile.get('profiler', 'py-spy')}, one more "
                f"{profile.get('n')}-worker throughput round per server, not part of "
                "the figures above):"
            )
            out.append(profile["text"])
        else:
            out.append(f"Profile, {name}: {profile.get('error', 'not taken')}")
    return out


def _section_torchrun(section: Optional[dict]) -> list[str]:
    if not section:
        return []
    rows = []
    for run in section["runs"]:
        signed = {True: "yes", False: "NO", None: "-"}[run["ranks_signed"]]
        rows.append(
            [
                run["backend"],
                _fmt(run["formed_s"], ".2f") + " s" if run["formed_s"] is not None else "not formed",
                f"{run['workers']}/{2 * section['nodes']}",
                " ".join(run["node_order"]),
                signed,
                run.get("job_state", "-"),
            ]
        )
    ratio = section["meshgate_vs_c10d"]
    per_node = section.get("per_node_vs_hand_started")
    return [
        "",
        f"7. torchrun: --rdzv-backend=meshgate against c10d ({section['nodes']} nodes x 2 gloo workers, real "
        "agents and torchrun; from the torchrun starts to the last worker past its first barrier; "
        f"median meshgate/c10d = {_fmt(ratio, '.2f')}"
        + (
            "; meshgate-per-node, the agents starting torchrun, from the SubmitJob: "
            f"median per-node/hand-started = {_fmt(per_node, '.2f')}"
            if "per_node_formed_s" in section
            else ""
        )
        + ")",
        table(["backend", "world formed", "workers", "node order (by node rank)", "ranks signed", "job"], rows, 4),
    ]


def _section_recovery(variants: dict, on_processes: Optional[dict]) -> list[str]:
    rows = []
    for name, figures in variants.items():
        for run in (figures.get("recovery") or {}).get("runs", []):
            if "error" in run:
                rows.append([name, str(run["nodes"]), run["replacement"], "FAILED"] + [""] * 6)
                continue
            rows.append(
                [
                    name,
                    f"{run['nodes']} ({run['workers']})",
                    run["replacement"],
                    f"{run['heartbeat_s']:g} s x {run['misses']}",
                    _fmt(run["detect_s"], ".2f"),
                    f"{_fmt(run['told_s'], '.2f')} / {_fmt(run.get('last_told_s'), '.2f')}",
                    _fmt(run["world_s"], ".2f"),
                    f"{'yes' if run['goal_met'] else 'NO'} (≤ {run['goal_s']:g} s)",
                    f"{run['bench_cpu_s']:.1f} / {_fmt(run['coordinator_cpu_s'], '.1f')}"
                    + (
                        f" ({run['bench_cpu_after_told_s']:.1f} / {_fmt(run['coordinator_cpu_after_told_s'], '.1f')})"
                        if "bench_cpu_after_told_s" in run
                        else ""
                    ),
                    f"{run['loadavg']:.1f}",
                ]
            )
    if not rows:
        return []
    parts = [
        "",
        "8. Recovery: one node of a running job dies (simulated agents, 8 workers a node; seconds from the "
        "kill: detect = declared lost, told = the first / last survivor's heartbeat names the new generation, "
        "world = the last node's verified world of it; CPU s from the kill to the world (from the first told "
        "to the world): the bench's one load process / the coordinator)",
        table(
            [
                "variant",
                "nodes (workers)",
                "replacement",
                "heartbeat",
                "detect",
                "told first / last",
                "world",
                "goal met",
                "CPU s",
                "load",
            ],
            rows,
            4,
        ),
    ]
    if on_processes:
        real = []
        for backend in ("meshgate", "c10d"):
            run = on_processes[backend]
            shape = run.get("nodes") or run.get("nnodes", "")
            real.append(
                [
                    backend,
                    f"--nnodes={shape}" if backend == "c10d" else shape,
                    run.get("rdzv_conf", run.get("heartbeat", "")),
                    "FAILED: " + run["error"].splitlines()[0][:60] if "error" in run else f"{run['world_s']:.2f} s",
                    str(run.get("world_size", "-")),
                    run.get("job_state", "-"),
                    f"{run['loadavg']:.1f}",
                ]
            )
        parts += [
            "",
            f"8b. The same failure on real processes: {on_processes['members']}+1 nodes x "
            f"{on_processes['workers_per_node']} gloo workers, kill -9 of a member's torchrun (agent) and workers, "
            "to the last worker of the re-formed world past its first barrier "
            f"(c10d/meshgate = {_fmt(on_processes['c10d_vs_meshgate'], '.1f')})",
            table(["backend", "shape", "settings", "world again", "world size", "job", "load"], real, 3),
        ]
    return parts


def _goals(goals: Sequence[dict]) -> list[str]:
    rows, previous = [], None
    for g in goals:
        rows.append(["" if g["goal"] == previous else g["goal"], g["variant"], g["measured"], g["met"]])
        previous = g["goal"]
    return ["", "Goals, per variant", table(["goal", "variant", "measured", "met"], rows, text_columns=3)]


def render(results: dict) -> str:
    from bench.variants import Variant

    m = results["machine"]
    variants = results["variants"]
    parts = [
        f"meshgate benchmark ({results['mode']} mode), {results['started_at']}",
        f"machine: {describe_machine(m)}",
        f"load generator: {results['settings']['procs']} processes x "
        f"{results['settings']['concurrency']} Register calls in flight (grpc.aio), on the same "
        f"cores as the server under test",
        "variants (the coordinator under test; without agents, sections 1-3, workers bring no vouch; "
        "through agents, 5, an mTLS coordinator requires them):",
    ]
    for name, figures in variants.items():
        transport = _transport(figures)
        probed = ("; probed: " + ", ".join(f"{k} -> {v}" for k, v in transport.items())) if transport else ""
        parts.append(f"  {name}: {Variant.parse(name).description}{probed}")
    parts += _section_throughput(variants)
    parts += _section_world(variants)
    parts += _section_c10d(results.get("c10d"), variants)
    parts += _section_growth(variants)
    parts += _section_fan_in(variants)
    parts += _section_jobs(variants)
    parts += _section_profile(variants)
    parts += _section_torchrun(results.get("torchrun"))
    parts += _section_recovery(variants, results.get("recovery_torchrun"))
    if results.get("goals"):
        parts += _goals(results["goals"])
    parts.append("")
    loads = results.get("loadavg_at_section_start")
    if loads:
        parts.append(
            "load average (1 min) as each section began: "
            + ", ".join(f"{k} {v:.1f}" for k, v in loads.items())
            + f" (the machine has {m['nproc']} cores)"
        )
    parts.append(
        f"load average at end: {', '.join(f'{x:.2f}' for x in results.get('loadavg_at_end', []))}; "
        f"total {results.get('duration_s', 0):.0f} s"
    )
    return "\n".join(parts)
