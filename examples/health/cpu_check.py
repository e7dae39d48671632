#!/usr/bin/env python3
"""A node health check a CPU node can run ([agent.health_check] command; docs/operating.md).

Exit 0 when healthy, 1 with one line saying what failed. Two probes:
  - disk: write, fsync and read back --disk-mib MiB in --dir (a full or read-only disk,
    a failing device);
  - collective: a short gloo all-reduce over --procs local processes (the node's slots):
    the sum must be exact, within --timeout seconds (a broken loopback, a hung process group).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import sys
import tempfile


def disk_probe(directory: str, mib: int) -> str:
    data = os.urandom(mib << 20)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".meshgate-health-") as probe:
        probe.write(data)
        probe.flush()
        os.fsync(probe.fileno())
        probe.seek(0)
        if hashlib.sha256(probe.read()).digest() != hashlib.sha256(data).digest():
            return f"disk probe: {mib} MiB read back from {directory} differ from what was written"
    return ""


def _all_reduce(rank: int, world: int, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tensor = torch.full((1024,), float(rank + 1))
    dist.all_reduce(tensor)
    out.put((rank, float(tensor[0])))
    dist.destroy_process_group()


def collective_probe(procs: int, timeout: float) -> str:
    try:
        import torch.multiprocessing as mp
    except ImportError:
        return "collective probe: torch is not installed (pip install torch, or --procs 0)"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    out = context.Queue()
    workers = [context.Process(target=_all_reduce, args=(r, procs, port, out)) for r in range(procs)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout)
    hung = [w for w in workers if w.is_alive()]
    for w in hung:
        w.kill()
    if hung or any(w.exitcode for w in workers):
        return f"collective probe: gloo all-reduce over {procs} processes did not finish in {timeout:g}s"
    want = procs * (procs + 1) / 2
    got = sorted(out.get(timeout=5) for _ in workers)
    wrong = [(rank, value) for rank, value in got if value != want]
    return f"collective probe: all-reduce sums {wrong} (want {want:g})" if wrong else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the disk probe writes")
    parser.add_argument("--disk-mib", type=int, default=4)
    parser.add_argument("--procs", type=int, default=2, help="processes of the all-reduce (0: skip it)")
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()
    try:
        failure = disk_probe(args.dir, args.disk_mib)
    except OSError as exc:
        failure = f"disk probe: {args.dir}: {exc.strerror or exc}"
    if not failure and args.procs:
        failure = collective_probe(args.procs, args.timeout)
    print(failure or f"healthy: disk ({args.disk_mib} MiB in {args.dir}) and gloo all-reduce over {args.procs}")
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())
