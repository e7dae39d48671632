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


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = ["| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + " |"]
    out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells[1:]:
        out.append("| " + " | ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
        ) + " |")
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


def render(results: dict) -> str:
    m = results["machine"]
    parts = [
        f"meshgate benchmark ({results['mode']} mode), {results['started_at']}",
        f"machine: {describe_machine(m)}",
        f"load generator: {results['settings']['procs']} processes x "
        f"{results['settings']['concurrency']} Register calls in flight (grpc.aio), on the same "
        f"cores as the server under test",
    ]

    tp: Optional[dict] = results.get("throughput")
    if tp:
        parts.append("")
        parts.append(
            f"1. Register throughput vs the physical limit: {tp['n']} workers, Register + "
            f"client-side verify, median of {tp['rounds']} paired rounds "
            f"(request {tp['request_bytes']} B, response {tp['response_bytes']} B)"
        )
        e, c = tp["echo"], tp["coordinator"]
        parts.append(table(
            ["server", "calls/s", "vs echo", "p50 ms", "p99 ms", "server CPU µs/call",
             "echo CPU / this CPU"],
            [
                ["bare grpc.aio echo", _fmt(e["register_per_s"], ".0f"), "1.00",
                 _fmt(e["latency_p50_ms"], ".1f"), _fmt(e["latency_p99_ms"], ".1f"),
                 _fmt(e["server_cpu_per_call_us"], ".0f"), "1.00"],
                ["meshgate Register", _fmt(c["register_per_s"], ".0f"),
                 _fmt(tp["ratio"], ".2f"), _fmt(c["latency_p50_ms"], ".1f"),
                 _fmt(c["latency_p99_ms"], ".1f"), _fmt(c["server_cpu_per_call_us"], ".0f"),
                 _fmt(tp["cpu_ratio"], ".2f")],
            ],
        ))
        parts.append("vs echo = median of the per-round ratios (each round: both servers back to "
                     "back, ABBA order): " + ", ".join(_fmt(r, ".2f") for r in tp["round_ratios"]))

    world: Optional[dict] = results.get("world")
    if world:
        parts.append("")
        parts.append(
            "2. Time to a verified world (each worker: Register, verify, AwaitWorld; "
            f"{world['await_concurrency']} AwaitWorld in flight per load process)"
        )
        rows = []
        for r in world["runs"]:
            rows.append([
                r["world"], _fmt(r["wall_s"], ".2f"), _fmt(r.get("vs_echo_floor"), ".2f"),
                _fmt(r["latency_p50_ms"], ".1f"), _fmt(r["latency_p99_ms"], ".1f"),
                _fmt(r["rss_peak_per_worker_kib"], ".2f"),
                _fmt(r["server_cpu_s"], ".1f"), _fmt(r["client_cpu_s"], ".1f"),
                r["errors"],
            ])
        for r in world.get("failed", []):
            rows.append([r["world"], "did not complete: " + r["error"].splitlines()[0][:60]]
                        + ["-"] * 7)
        parts.append(table(
            ["N", "wall s", "x echo floor", "Register p50 ms", "p99 ms", "peak RSS KiB/worker",
             "coordinator CPU s", "load-gen CPU s", "errors"],
            rows,
        ))
        if world.get("rss_marginal_kib_per_worker") is not None:
            parts.append(f"marginal coordinator memory, smallest to largest N: "
                         f"{world['rss_marginal_kib_per_worker']:.2f} KiB/worker")

    c10d: Optional[dict] = results.get("c10d")
    if c10d:
        parts.append("")
        parts.append(
            "3. Against torch's c10d dynamic rendezvous (c10d: each node a thread in one process, "
            "default settings; meshgate: 8 workers per node, each Register + verify + AwaitWorld)"
        )
        rows = [[r["nodes"], _c10d_cell(r["c10d"]), r["meshgate"]["world"],
                 _fmt(r["meshgate"]["wall_s"], ".2f") + " s", _speedup(r)]
                for r in c10d["runs"]]
        parts.append(table(["nodes", "torch c10d", "meshgate workers", "meshgate", "meshgate faster by"], rows))

    growth: Optional[dict] = results.get("growth")
    if growth:
        parts.append("")
        parts.append("4. How cost grows with N (from 2)")
        rows = [[r["world"], _fmt(r["wall_per_worker_us"], ".0f"), _fmt(r["wall_vs_smallest"], ".2f"),
                 _fmt(r["server_cpu_per_worker_us"], ".0f"), _fmt(r["cpu_vs_smallest"], ".2f")]
                for r in growth["rows"]]
        parts.append(table(["N", "wall µs/worker", "vs smallest N", "coordinator CPU µs/worker",
                            "vs smallest N"], rows))

    fan_in: Optional[dict] = results.get("fan_in")
    if fan_in:
        parts.append("")
        parts.append("5. Through agents (fan-in): each simulated agent sends its node's Registers in one "
                     "RegisterBatch and waits in one AwaitWorld; every attestation is verified with its "
                     "worker's nonce (agents joined beforehand, not timed)")
        rows = [[fan_in["workers"], fan_in["nodes"], _fmt(fan_in["wall_s"], ".2f"),
                 _fmt(fan_in["direct_wall_s"], ".2f"), _fmt(fan_in["speedup_vs_direct"], ".1f"),
                 _fmt(fan_in["batch_p50_ms"], ".0f"), _fmt(fan_in["batch_p99_ms"], ".0f"),
                 _fmt(fan_in["coordinator_cpu_s"], ".1f"), fan_in["verified"]]]
        parts.append(table(["N", "agents", "wall s", "direct wall s (2)", "x faster", "batch p50 ms",
                            "batch p99 ms", "coordinator CPU s", "verified"], rows))

    profile: Optional[dict] = results.get("profile")
    if profile:
        parts.append("")
        if profile.get("text"):
            parts.append(f"Profile ({profile.get('profiler', 'py-spy')}, one more "
                         f"{profile.get('n')}-worker throughput round per server, not part of "
                         "the figures above):")
            parts.append(profile["text"])
        else:
            parts.append(f"Profile: {profile.get('error', 'not taken')}")

    goals = results.get("goals")
    if goals:
        parts.append("")
        parts.append("Goals")
        parts.append(table(["goal", "measured", "met"],
                           [[g["goal"], g["measured"], g["met"]] for g in goals]))
    parts.append("")
    loads = results.get("loadavg_at_section_start")
    if loads:
        parts.append("load average (1 min) as each section began: "
                     + ", ".join(f"{k} {v:.1f}" for k, v in loads.items())
                     + f" (the machine has {m['nproc']} cores)")
    parts.append(f"load average at end: {', '.join(f'{x:.2f}' for x in results.get('loadavg_at_end', []))}; "
                 f"total {results.get('duration_s', 0):.0f} s")
    return "\n".join(parts)
