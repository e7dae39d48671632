"""How long job starts hold the coordinator's event loop (issue 25): ``--jobs`` one-node
jobs, one after the other, through the daemon itself (assembly.serve with the SQLite
store, in a temporary directory; its cluster driven in process), while a task on the same
loop ticks every 1 ms; the gaps between its ticks are the loop's stalls.

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
    from meshgate.coordinator import assembly
    from meshgate.coordinator.config import CoordinatorConfig

    # The daemon itself (assembly.serve, SQLite store, plaintext on a port of its own),
    # its cluster driven in process.
    config = CoordinatorConfig.from_mapping(
        {
            "server": {"insecure": True, "listen": "127.0.0.1:0"},
            "keys": {"dir": str(directory / "keys")},
            "store": {"kind": "sqlite", "dir": str(directory / "state")},
        }
    )
    stop = asyncio.Event()
    serving: asyncio.Future = asyncio.get_running_loop().create_future()
    daemon = asyncio.create_task(assembly.serve(config, stop=stop, on_serving=serving.set_result))
    await asyncio.wait({daemon, serving}, return_when=asyncio.FIRST_COMPLETED)
    if not serving.done():
        daemon.result()  # raises what stopped it
    cluster = serving.result().slot.coordinator
    try:
        return await _measure(cluster, serving.result().address, jobs, nodes)
    finally:
        stop.set()
        await daemon


async def _measure(cluster, address: str, jobs: int, nodes: int) -> dict:
    import grpc

    from meshgate.plan import ParallelPlan
    from meshgate.v1 import rendezvous_pb2 as pb
    from meshgate.v1 import rendezvous_pb2_grpc

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
    channel = grpc.aio.insecure_channel(address)
    admin = rendezvous_pb2_grpc.AdminStub(channel)
    for j in range(jobs):
        node = f"n{j % nodes}"
        spec = pb.JobSpec(
            job_id=f"j{j}", plan=ParallelPlan(dp_shard=2).to_proto(), node_ids=[node], mode=pb.RANK_MODE_CLAIMED
        )
        await admin.SubmitJob(pb.SubmitJobRequest(spec=spec), timeout=60)
        await cluster.finish(f"j{j}", True, "done")
        cluster.pool.heartbeat(node, credentials[node], live_units=())  # its node back to the pool
    wall = time.perf_counter() - began
    running = False
    await ticker
    await channel.close()
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
