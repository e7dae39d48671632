"""Recovery on real processes: a node of a running job dies under torchrun's c10d
rendezvous and under meshgate's agents, the same shape, the same machine, the same run.

The shape: N members and one more node (3+1 by default), 2 workers a node, gloo on
loopback. Every worker is bench/recovery_worker.py: it forms the world, passes a first
barrier, writes a record, then all_reduces every 0.1 s (so a dead peer breaks the
collective, as it breaks a training step).

- **c10d**: N+1 real ``python -m torch.distributed.run`` processes with
  ``--rdzv-backend=c10d --nnodes=N:N+1 --max-restarts=3`` (node 0 hosts the store): the
  world holds all N+1 nodes; after the kill the survivors' workers fail, their agents
  restart them and re-rendezvous, and the world re-forms with N nodes. torch's own
  rendezvous timeouts unless ``c10d_conf`` says otherwise (the figure says which), and a
  store per round (C10D_ENV: torch's shared store does not survive a restart here).
- **meshgate**: the coordinator (mTLS, SQLite, its defaults; heartbeat 0.5 s × 3) and N+1
  real agents in jobs mode (bench/torchrun.py's Cluster); a job of N nodes with one spare,
  ``restart_policy = "on-failure"``; the agents launch the workers, which register,
  verify, await the world and start gloo with the attested ranks. After the kill the
  spare takes the lost node's block in a new generation: N nodes again, the same ranks.

The victim is the last member (never the c10d store's host, never meshgate's rank 0):
kill -9 of its torchrun (or agent) and of its workers at once. **world**: from the kill
to the last worker of the first complete world formed after it past its barrier.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from bench.common import ratio
from bench.torchrun import ENV, REPO, Cluster, _free_port

WORKER = str(REPO / "bench" / "recovery_worker.py")
WORKERS_PER_NODE = 2  # the Cluster's agents have 2 slots
# torch 2.13 hands the workers the rendezvous store itself (shared across rounds, no prefix
# per attempt): after a restart the survivors read the first round's gloo addresses, of
# processes now dead, and never form a world (connectFullMesh: connection refused, seen
# here). With this set, each round's rank 0 hosts a store of its own, as before 2.4.
C10D_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def reformed_world(records: list[dict], killed_at: float) -> Optional[dict]:
    """The first world complete after ``killed_at``: the round whose records, all formed
    after the kill, hold every rank of its world size; when its last worker formed it."""
    rounds: dict[str, list[dict]] = {}
    for record in records:
        if record["formed_at"] > killed_at:
            rounds.setdefault(record["round"], []).append(record)
    complete = [
        got
        for got in rounds.values()
        if {r["rank"] for r in got} == set(range(got[0]["world_size"]))
        and all(r["world_size"] == got[0]["world_size"] for r in got)
    ]
    if not complete:
        return None
    first = min(complete, key=lambda got: max(r["formed_at"] for r in got))
    return {
        "round": first[0]["round"],
        "world_size": first[0]["world_size"],
        "nodes": sorted({r["node"] for r in first}),
        "formed_at": max(r["formed_at"] for r in first),
    }


def _records(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in out.glob("*.json")]


def _wait_records(out: Path, until, timeout: float, what: str, logs) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        records = _records(out)
        if until(records):
            return records
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout:g} s; records {records}\n{logs()}")
        time.sleep(0.05)


def _descendants(pid: int) -> list[int]:
    """The processes under ``pid`` now (Linux /proc), children before grandchildren."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        children = parents.get(queue.pop(0), [])
        found += children
        queue += children
    return found


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _measure(out: Path, world_size: int, kill, logs, timeout: float) -> dict:
    """Once the first world is whole, ``kill()`` the victim; until a world is whole again."""
    first = _wait_records(out, lambda rs: len({r["rank"] for r in rs}) == world_size, timeout, "the first world", logs)
    time.sleep(0.5)  # a few steps of all_reduce on the whole world
    killed_at = time.time()
    victim = kill(first)
    records = _wait_records(
        out, lambda rs: reformed_world(rs, killed_at) is not None, timeout, "a world after the kill", logs
    )
    world = reformed_world(records, killed_at)
    return {
        "victim": victim,
        "first_world_size": world_size,
        "world_size": world["world_size"],
        "world_round": world["round"],  # c10d: its store's port; meshgate: the generation
        "world_nodes": world["nodes"],
        "world_s": round(world["formed_at"] - killed_at, 3),
    }


def _stop(out: Path, processes: list[subprocess.Popen], timeout: float = 60) -> list[Optional[int]]:
    (out / "stop").touch()
    codes = []
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            codes.append(process.wait(timeout=max(deadline - time.monotonic(), 1)))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            codes.append(process.wait())
    return codes


def c10d_run(root: Path, members: int, conf: str, timeout: float) -> dict:
    """N+1 torchrun processes on c10d, ``--nnodes=N:N+1``; the last one dies."""
    out = root / "out"
    out.mkdir(parents=True, exist_ok=True)
    nodes = [f"node-{i}" for i in range(members + 1)]
    endpoint = f"127.0.0.1:{_free_port()}"
    processes = []
    for i, node in enumerate(nodes):
        rdzv_conf = ",".join(c for c in (f"is_host={'true' if i == 0 else 'false'}", conf) if c)
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            "--rdzv-id=recovery",
            f"--nnodes={members}:{members + 1}",
            f"--nproc-per-node={WORKERS_PER_NODE}",
            "--max-restarts=3",
            f"--rdzv-conf={rdzv_conf}",
            WORKER,
        ]
        env = {
            **os.environ,
            **ENV,
            **C10D_ENV,
            "BENCH_OUT": str(out),
            "BENCH_STOP": str(out / "stop"),
            "BENCH_NODE": node,
        }
        with open(root / f"{node}.log", "ab") as log:
            processes.append(
                subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )

    def logs() -> str:
        return "\n".join((root / f"{n}.log").read_text(errors="replace")[-1500:] for n in nodes)

    def kill(first: list[dict]) -> str:
        victim = nodes[-1]
        os.killpg(processes[-1].pid, signal.SIGKILL)  # its torchrun and the workers it started
        _kill([r["pid"] for r in first if r["node"] == victim])
        return victim

    try:
        run = _measure(out, (members + 1) * WORKERS_PER_NODE, kill, logs, timeout)
        run["exit_codes"] = _stop(out, processes[:-1])
    finally:
        # torchrun starts its workers in sessions of their own: a run that failed would
        # leave them behind its killed torchrun (seen here), so they go by pid first.
        _kill([pid for process in processes for pid in _descendants(process.pid)])
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    return {"backend": "c10d", "nnodes": f"{members}:{members + 1}", "rdzv_conf": conf or "torch's defaults", **run}


def meshgate_run(root: Path, members: int, timeout: float) -> dict:
    """N+1 real agents, a job of N nodes with one spare; the last member dies."""
    from meshgate import admin
    from meshgate.job_cli import spec_message
    from meshgate.plan import ParallelPlan

    out = root / "out"
    out.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(root, members + 1)
    try:
        spec = spec_message(
            {
                "id": "recovery",
                "plan": ParallelPlan(dp_shard=members * WORKERS_PER_NODE),
                "nodes": members,
                "spares": 1,
                "command": [sys.executable, WORKER],
                "env": {"BENCH_OUT": str(out), "BENCH_STOP": str(out / "stop"), **ENV},
                "restart_policy": "on-failure",
                "lost_node_timeout_s": 120,
            }
        )
        job = admin.submit_job(cluster.address, spec, tls=cluster.admin_tls)
        members_in_order, spare = list(job.nodes), list(job.spare_nodes)

        def logs() -> str:
            return "\n".join(cluster.log(n)[-1500:] for n in ["coordinator", *cluster.nodes])

        def kill(first: list[dict]) -> str:
            victim = members_in_order[-1]
            agent = cluster.processes[1 + cluster.nodes.index(victim)]
            agent.kill()
            _kill([r["pid"] for r in first if r["node"] == victim])
            agent.wait()
            return victim

        run = _measure(out, members * WORKERS_PER_NODE, kill, logs, timeout)
        (out / "stop").touch()
        deadline = time.monotonic() + 60
        while cluster.job_state("recovery") == "RUNNING" and time.monotonic() < deadline:
            time.sleep(0.2)
        run["job_state"] = cluster.job_state("recovery")
        run["spare"] = spare
    finally:
        cluster.close()
    return {"backend": "meshgate", "nodes": f"{members} + 1 spare", "heartbeat": "0.5 s x 3", **run}


def run_section(work: Path, members: int = 3, timeout: float = 240.0, c10d_conf: str = "", log=print) -> dict:
    """Both backends, one after the other, on the same machine."""
    runs = {}
    for backend in ("meshgate", "c10d"):
        load = os.getloadavg()[0]
        try:
            if backend == "c10d":
                run = c10d_run(work / "recovery-c10d", members, c10d_conf, timeout)
            else:
                run = meshgate_run(work / "recovery-meshgate", members, timeout)
        except (RuntimeError, TimeoutError, OSError) as exc:
            log(f"recovery under {backend}: FAILED: {str(exc)[:300]}")
            run = {"backend": backend, "error": str(exc)[:2000]}
        run["loadavg"] = load
        runs[backend] = run
        log(f"recovery under {backend} ({members}+1 nodes x {WORKERS_PER_NODE}): world again in {run.get('world_s')} s")
    return {
        "members": members,
        "workers_per_node": WORKERS_PER_NODE,
        **runs,
        "c10d_vs_meshgate": ratio(runs["c10d"].get("world_s"), runs["meshgate"].get("world_s")),
    }


if __name__ == "__main__":
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--c10d-conf", default="", help="more --rdzv-conf for c10d, e.g. last_call_timeout=1")
    parser.add_argument("--backend", choices=("both", "meshgate", "c10d"), default="both")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mg-recovery-torchrun-") as tmp:
        if args.backend == "both":
            result = run_section(Path(tmp), args.members, c10d_conf=args.c10d_conf)
        elif args.backend == "c10d":
            result = c10d_run(Path(tmp), args.members, args.c10d_conf, 240.0)
        else:
            result = meshgate_run(Path(tmp), args.members, 240.0)
    print(json.dumps(result, indent=2))
