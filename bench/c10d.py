"""The baseline of section 3: torch.distributed.elastic's own c10d dynamic rendezvous.

``python -m bench.c10d --nodes N --timeout T`` runs one rendezvous of N simulated nodes
in one process and prints one JSON line. Each node is a *thread* (N processes would
swamp a small machine before the rendezvous even starts) holding what torchrun's agent
holds: its own DynamicRendezvousHandler, built the way torchrun builds it
(``rdzv_backend=c10d``: registry -> c10d_rendezvous_backend.create_backend ->
C10dRendezvousBackend over its own TCPStore client), with min_nodes = max_nodes = N and
the default timeouts and keep-alive settings. The TCPStore server (the host's) runs in
the same process. Handlers and their store connections are built before the clock
starts; the clock runs from one barrier to the last next_rendezvous() returning.

If the rendezvous has not finished after T seconds the process reports how many nodes
got through and exits (threads cannot be cancelled); run_c10d also kills it from outside
after T plus a margin, so a stuck run never hangs the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# TCPStore does a reverse-DNS lookup per connection; the resolver here sometimes drops
# it and the connect stalls 5 s (docs/design.md, "Reverse-DNS stalls"). Cap the resolver for the whole process.
RESOLVER_ENV = {"RES_OPTIONS": "timeout:1 attempts:1"}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PROBE_EVERY_S = 10.0


def _joined(store) -> dict:
    """Participants in the shared rendezvous state right now (read like a node does)."""
    import pickle

    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )

    try:
        got = C10dRendezvousBackend(store, "bench").get_state()
        if got is None:
            return {"joined": 0}
        state = pickle.loads(got[0])  # torch's own state blob, written by this process
        return {
            "joined": len(state.participants),
            "waiting": len(state.wait_list),
            "round": state.round,
            "state_bytes": len(got[0]),
        }
    except Exception as exc:  # noqa: BLE001 - a probe, not the measurement
        return {"probe_error": f"{type(exc).__name__}: {exc}"[:200]}


def run_rendezvous(nodes: int, timeout_s: float) -> dict:
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    threading.stack_size(1 << 20)
    port = _free_port()
    t_setup = time.monotonic()
    host_store = TCPStore(
        "127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    handlers = []
    for _ in range(nodes):
        params = RendezvousParameters(
            backend="c10d",
            endpoint=f"127.0.0.1:{port}",
            run_id="bench",
            min_nodes=nodes,
            max_nodes=nodes,
            local_addr="127.0.0.1",  # else every node asks DNS for its FQDN
            is_host=False,
        )
        handlers.append(get_rendezvous_handler(params))
    setup_s = time.monotonic() - t_setup

    barrier = threading.Barrier(nodes + 1)
    done = threading.Condition()
    finished: list[float] = []
    ranks: list[int] = []
    failures: list[str] = []

    def node(handler) -> None:
        barrier.wait()
        try:
            info = handler.next_rendezvous()
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            with done:
                failures.append(f"{type(exc).__name__}: {exc}"[:300])
                done.notify_all()
            return
        with done:
            finished.append(time.monotonic())
            ranks.append(info.rank)
            done.notify_all()

    threads = [threading.Thread(target=node, args=(h,), daemon=True) for h in handlers]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    progress: list[dict] = []
    next_probe = t0 + PROBE_EVERY_S
    while True:
        with done:
            if len(finished) + len(failures) >= nodes:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            done.wait(max(0.0, min(left, next_probe - time.monotonic(), 1.0)))
        now = time.monotonic()
        if now >= next_probe and now < deadline:
            # How far the join got (nobody returns before all N have joined); read outside
            # the lock so a finishing node never waits on the probe.
            progress.append({"t_s": round(now - t0, 1), **_joined(host_store)})
            next_probe = now + PROBE_EVERY_S
    with done:
        all_done = len(finished) == nodes
    if not all_done:
        progress.append({"t_s": round(time.monotonic() - t0, 1), **_joined(host_store)})
    with done:
        complete = len(finished) == nodes
        result = {
            "nodes": nodes,
            "mode": "threads, one process",
            "finished": complete,
            "timeout_s": timeout_s,
            "wall_s": (max(finished) - t0) if complete else None,
            "nodes_done": len(finished),
            "failures": len(failures),
            "first_failure": failures[0] if failures else None,
            "ranks_ok": complete and sorted(ranks) == list(range(nodes)),
            "setup_s": setup_s,
            "progress": progress,
        }
    del host_store
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.c10d")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.ERROR)
    result = run_rendezvous(args.nodes, args.timeout)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    # Handlers keep heartbeat threads and store connections alive; do not wait for them.
    os._exit(0)


def run_c10d(nodes: int, timeout_s: float, setup_margin_s: float = 90.0) -> dict:
    """Run one c10d rendezvous in a fresh process; never hang longer than the cap."""
    env = dict(os.environ)
    env.update(RESOLVER_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    started = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "bench.c10d", "--nodes", str(nodes), "--timeout", str(timeout_s)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s + setup_margin_s,
        )
    except subprocess.TimeoutExpired:
        return {
            "nodes": nodes,
            "mode": "threads, one process",
            "finished": False,
            "timeout_s": timeout_s,
            "wall_s": None,
            "nodes_done": None,
            "note": f"killed after {time.monotonic() - started:.0f} s (setup and run)",
        }
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {
        "nodes": nodes,
        "mode": "threads, one process",
        "finished": False,
        "timeout_s": timeout_s,
        "wall_s": None,
        "note": f"exit {proc.returncode}: {proc.stderr[-500:]}",
    }


if __name__ == "__main__":
    sys.exit(main())
