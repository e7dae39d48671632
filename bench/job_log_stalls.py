"""How long job starts hold the coordinator's event loop (issue 25): ``--jobs`` one-node
jobs, one after the other, through a ClusterCoordinator over real SQLite logs (the
daemon's own opener, in a temporary directory), while a task on the same loop ticks every
1 ms; the gaps between its ticks are the loop's stalls.

    python -m bench.job_log_stalls [--jobs 48]

Prints the gaps over 3 ms (count, sum, longest) and the wall time for the jobs. In
process, no RPCs: a check of one cost (creating each job's own log), not a benchmark of
the daemon."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

TICK_S = 0.001
STALL_S = 0.003


async def measure(directory: Path, jobs: int, nodes: int = 8) -> dict:
    from meshgate.coordinator.cluster import ClusterCoordinator
    from meshgate.coordinator.config import CoordinatorConfig
    from meshgate.coordinator.jobs import JobSpec
    from meshgate.coordinator.keys import KeyRing
    from meshgate.coordinator.leadership import job_store_opener
    from meshgate.coordinator.store import MemoryStore
    from meshgate.plan import ParallelPlan

    config = CoordinatorConfig.from_mapping(
        {"server": {"insecure": True}, "keys": {"dir": str(directory / "keys")}, "store": {"dir": str(directory)}}
    )
    cluster = ClusterCoordinator(
        MemoryStore(),
        KeyRing(config.keys_dir),
        job_store_opener(config),
        attestation_ttl_s=60,
        heartbeat_timeout_s=1e9,
        require_vouch=False,
    )
    credentials = {}
    for n in range(nodes):
        token, _ = await cluster.pool.create_join_token(600, f"n{n}")
        _, credentials[f"n{n}"] = await cluster.pool.join(f"n{n}", "bench", 2, "cpu", {}, token, public_key=bytes(32))
    gaps: list[float] = []
    running = True

    async def tick() -> None:
        last = time.perf_counter()
        while running:
            await asyncio.sleep(TICK_S)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.ensure_future(tick())
    began = time.perf_counter()
    for j in range(jobs):
        node = f"n{j % nodes}"
        spec = JobSpec.build(job_id=f"j{j}", plan=ParallelPlan(dp_shard=2), node_ids=(node,), mode="claimed")
        await cluster.submit(spec)
        await cluster.finish(f"j{j}", True, "done")
        cluster.pool.heartbeat(node, credentials[node], live_units=())  # its node back to the pool
    wall = time.perf_counter() - began
    running = False
    await ticker
    cluster.close()
    stalls = sorted(g for g in gaps if g > STALL_S)
    return {
        "jobs": jobs,
        "wall_s": wall,
        "stalls": len(stalls),
        "stalled_ms": 1000 * sum(stalls),
        "max_ms": 1000 * max(gaps),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.job_log_stalls")
    parser.add_argument("--jobs", type=int, default=48)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="meshgate-stalls-") as directory:
        r = asyncio.run(measure(Path(directory), args.jobs))
    print(
        f"{r['jobs']} jobs in {r['wall_s']:.2f} s; loop gaps over {STALL_S * 1000:g} ms (ticks every "
        f"{TICK_S * 1000:g} ms): {r['stalls']}, {r['stalled_ms']:.0f} ms in all, the longest {r['max_ms']:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
