"""Section 7: torchrun on meshgate's backend against torchrun on torch's c10d backend.

The same nodes in the same run: a coordinator (mTLS, SQLite, vouches required, the
daemon's defaults) and N real agents on loopback (distinct node ids, rack labels), then
per round N real ``python -m torch.distributed.run`` processes, 2 workers each, once with
``--rdzv-backend=meshgate`` (a claimed-mode job submitted just before; workers start
through the bootstrap, ``-m meshgate.torchrun``: each registers its RANK, vouched by its
agent, and verifies the signed attestation) and once with ``--rdzv-backend=c10d`` (node 0
hosts the rendezvous store, ``is_host``). The order alternates between rounds.

Time to a formed world: from the moment the N torchrun processes are started to the last
worker's return from its first collective (``init_process_group("gloo")`` then a
barrier). Both sides pay the same interpreter and torch start-up; meshgate's side also
pays the attestation. Node order: meshgate's node ranks follow the racks; c10d's follow
the order the nodes reached its store.

A third backend, ``meshgate-per-node`` (issue #32): the same torchrun command as a per-node
job's (``launch = "per-node"``): the agents start torchrun themselves, one per node, inside
the job's containment unit, so its clock starts at the SubmitJob, not at the torchrun
starts (it also pays the allocation, the agents hearing of the job and the launch).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from bench.common import median, ratio
from bench.variants import toml_text

REPO = Path(__file__).resolve().parent.parent
WORKER = str(REPO / "bench" / "torchrun_worker.py")
# Hand-started torchrun on meshgate's backend, on c10d's, and meshgate's per-node launch.
BACKENDS = ("meshgate", "c10d", "meshgate-per-node")
ENV = {
    "RES_OPTIONS": "timeout:1 attempts:1",  # TCPStore's reverse-DNS lookups stall otherwise
    "OMP_NUM_THREADS": "1",
    "GLOO_SOCKET_IFNAME": "lo",
    "PYTHONPATH": str(REPO),
    "PYTHONWARNINGS": "ignore",
}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A coordinator and N agents, each its own process, under ``root``."""

    def __init__(self, root: Path, nodes: int) -> None:
        from meshgate import admin
        from meshgate.tls import init_dev_ca

        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        # Racks in reverse of the node ids: meshgate's node order is not the ids' order.
        self.nodes = [f"node-{i}" for i in range(nodes)]
        self.ca = init_dev_ca(root / "tls", hosts=("127.0.0.1",), agent_names=self.nodes)
        self.admin_tls = self.ca.client_tls(self.ca.admin)
        port = _free_port()
        self.address = f"127.0.0.1:{port}"
        tls = {"ca_file": str(self.ca.ca), "cert_file": str(self.ca.server.cert), "key_file": str(self.ca.server.key)}
        config = root / "coordinator.toml"
        config.write_text(
            toml_text(
                {
                    "server": {"listen": self.address, "require_client_cert": True, **tls},
                    "keys": {"dir": str(root / "keys")},
                    "store": {"dir": str(root / "state")},
                    "cluster": {"heartbeat_interval_s": 0.5, "heartbeat_misses": 3},
                }
            )
        )
        self.processes = [
            self._spawn("coordinator", [sys.executable, "-m", "meshgate.coordinator", "--config", str(config)])
        ]
        for index, node_id in enumerate(self.nodes):
            token = self._token(admin, node_id)
            # Simulated hosts on one machine: each its own machine-id (the coordinator
            # refuses one another live node presents).
            identity = root / f"{node_id}.machine-id"
            identity.write_text(secrets.token_hex(16) + "\n")
            agent = {
                "coordinator": self.address,
                "node_id": node_id,
                "join_token": token,
                "slots": 2,
                "state_dir": str(root / f"{node_id}-state"),
                "machine_id_file": str(identity),
                "ca_file": str(self.ca.ca),
                "cert_file": str(self.ca.agent(node_id).cert),
                "key_file": str(self.ca.agent(node_id).key),
                "worker_cert_file": str(self.ca.worker.cert),
                "worker_key_file": str(self.ca.worker.key),
                "run_jobs_as_agent": True,
                "labels": {"switch": "s1", "rack": f"r{nodes - index}"},
            }
            path = root / f"{node_id}.toml"
            path.write_text(toml_text({"agent": agent}))
            self.processes.append(self._spawn(node_id, [sys.executable, "-m", "meshgate.agent", "--config", str(path)]))
        deadline = time.monotonic() + 120
        while not all("joined the cluster" in self.log(n) for n in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("agents did not join:\n" + "\n".join(self.log(n)[-1500:] for n in self.nodes))
            time.sleep(0.1)

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "ab")
        return subprocess.Popen(argv, cwd=REPO, env={**os.environ, **ENV}, stdout=log, stderr=subprocess.STDOUT)

    def _token(self, admin, node_id: str) -> str:
        deadline = time.monotonic() + 60
        while True:
            try:
                return admin.create_join_token(self.address, "", node_id=node_id, tls=self.admin_tls).token
            except Exception:  # noqa: BLE001 - the coordinator is still starting
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def submit(self, job_id: str, nodes: int) -> list[str]:
        """A claimed-mode job with no command; its nodes in node-rank order."""
        from meshgate import admin
        from meshgate.job_cli import spec_message
        from meshgate.plan import ParallelPlan

        spec = spec_message({"id": job_id, "plan": ParallelPlan(dp_shard=nodes * 2), "nodes": nodes, "mode": "claimed"})
        return list(admin.submit_job(self.address, spec, tls=self.admin_tls).nodes)

    def submit_per_node(self, job_id: str, nodes: int, command: list[str], env: dict[str, str]) -> list[str]:
        """A per-node job whose command is torchrun (the agents start it); its nodes in
        node-rank order."""
        from meshgate import admin
        from meshgate.job_cli import spec_message
        from meshgate.plan import ParallelPlan

        spec = spec_message(
            {
                "id": job_id,
                "plan": ParallelPlan(dp_shard=nodes * 2),
                "nodes": nodes,
                "launch": "per-node",
                "command": command,
                "env": env,
            }
        )
        return list(admin.submit_job(self.address, spec, tls=self.admin_tls).nodes)

    def job_state(self, job_id: str) -> str:
        from meshgate import admin
        from meshgate.v1 import rendezvous_pb2 as pb

        return pb.JobState.Name(admin.get_job(self.address, job_id, tls=self.admin_tls).state)

    def worker_tls(self) -> dict[str, str]:
        return {
            "MESHGATE_INSECURE": "0",
            "MESHGATE_TLS_CA": str(self.ca.ca),
            "MESHGATE_TLS_CERT": str(self.ca.worker.cert),
            "MESHGATE_TLS_KEY": str(self.ca.worker.key),
        }

    def close(self) -> None:
        for process in reversed(self.processes):
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()


def _torchrun(backend: str, node_index: int, nodes: int, run_id: str, endpoint: str, conf: str, out: Path) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        f"--nnodes={nodes}",
        "--nproc-per-node=2",
        "--max-restarts=0",
        f"--rdzv-conf={conf}",
    ]
    return argv + (["-m", "meshgate.torchrun", WORKER] if backend == "meshgate" else [WORKER])


def per_node_command(nodes: int, run_id: str) -> list[str]:
    """torchrun as a per-node job's command: no endpoint, agent socket or node rank (the
    agent gives each its place and its socket)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--rdzv-backend=meshgate",
        f"--rdzv-id={run_id}",
        f"--nnodes={nodes}",
        "--nproc-per-node=2",
        "--max-restarts=0",
        "-m",
        "meshgate.torchrun",
        WORKER,
    ]


def _results(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in out.glob("rank-*.json")]


def _world(backend: str, results: list[dict], nodes: int, started: float) -> dict:
    formed = max((r["formed_at"] for r in results), default=None)
    by_rank = sorted(results, key=lambda r: r["rank"])
    return {
        "backend": backend,
        "workers": len(results),
        "formed_s": None if formed is None or len(results) != 2 * nodes else round(formed - started, 3),
        "node_order": [r["node"] for r in by_rank if r["local_rank"] == 0],
        "ranks_signed": all(r.get("signed_rank") == r["rank"] for r in results) if backend != "c10d" else None,
    }


def _ended(cluster: Cluster, run_id: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while cluster.job_state(run_id) in ("PENDING", "RUNNING") and time.monotonic() < deadline:
        time.sleep(0.2)
    return cluster.job_state(run_id)


def one_per_node_run(cluster: Cluster, run_id: str, out: Path, timeout: float) -> dict:
    """A per-node job of torchrun: from its SubmitJob to the last worker past its barrier."""
    nodes = len(cluster.nodes)
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in ENV.items() if k != "GLOO_SOCKET_IFNAME"}  # the agent gives its own
    started = time.time()
    order = cluster.submit_per_node(run_id, nodes, per_node_command(nodes, run_id), {**env, "BENCH_OUT": str(out)})
    deadline = time.monotonic() + timeout
    while len(_results(out)) < 2 * nodes and time.monotonic() < deadline:
        if cluster.job_state(run_id) not in ("PENDING", "RUNNING"):
            break
        time.sleep(0.05)
    run = _world("meshgate-per-node", _results(out), nodes, started)
    run.update(exit_codes=[], meshgate_order=order, job_state=_ended(cluster, run_id, 30))
    return run


def one_run(cluster: Cluster, backend: str, run_id: str, out: Path, timeout: float) -> dict:
    """N torchrun processes of ``backend``; the time to the world formed and its node order."""
    if backend == "meshgate-per-node":
        return one_per_node_run(cluster, run_id, out, timeout)
    nodes = len(cluster.nodes)
    out.mkdir(parents=True, exist_ok=True)
    if backend == "meshgate":
        meshgate_order = cluster.submit(run_id, nodes)
        endpoint = cluster.address
        confs = [f"agent_socket={cluster.root / f'{n}-state' / 'vouch.sock'}" for n in cluster.nodes]
    else:
        meshgate_order = []
        endpoint = f"127.0.0.1:{_free_port()}"
        confs = [f"is_host={'true' if i == 0 else 'false'}" for i in range(nodes)]
    logs = [open(out / f"torchrun-{n}.log", "ab") for n in cluster.nodes]
    started = time.time()
    processes = [
        subprocess.Popen(
            _torchrun(backend, i, nodes, run_id, endpoint, confs[i], out),
            cwd=REPO,
            env={**os.environ, **ENV, **cluster.worker_tls(), "BENCH_OUT": str(out), "BENCH_NODE": node_id},
            stdout=logs[i],
            stderr=subprocess.STDOUT,
        )
        for i, node_id in enumerate(cluster.nodes)
    ]
    codes: list[Optional[int]] = []
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            codes.append(process.wait(timeout=max(deadline - time.monotonic(), 1)))
        except subprocess.TimeoutExpired:
            process.kill()
            codes.append(process.wait())
    run = _world(backend, _results(out), nodes, started)
    run["exit_codes"] = codes
    if backend == "meshgate":
        run.update(meshgate_order=meshgate_order, job_state=_ended(cluster, run_id, 30))
    return run


def run_section(work: Path, nodes: int, rounds: int, timeout: float, log=print) -> dict:
    """Section 7: ``rounds`` rounds of both backends on one cluster of ``nodes`` agents."""
    cluster = Cluster(work / "torchrun", nodes)
    runs: list[dict] = []
    try:
        for r in range(rounds):
            order = BACKENDS[r % len(BACKENDS) :] + BACKENDS[: r % len(BACKENDS)]  # each goes first in turn
            for backend in order:
                run = one_run(cluster, backend, f"bench-{backend}-{r}", work / "torchrun" / f"{backend}-{r}", timeout)
                log(f"torchrun {backend} round {r + 1}/{rounds}: world formed in {run['formed_s']} s")
                runs.append(run)
    finally:
        cluster.close()
    side = {b: [r["formed_s"] for r in runs if r["backend"] == b and r["formed_s"] is not None] for b in BACKENDS}
    meshgate_s, c10d_s, per_node_s = (median(side[b]) if side[b] else None for b in BACKENDS)
    return {
        "nodes": nodes,
        "workers_per_node": 2,
        "rounds": rounds,
        "runs": runs,
        "meshgate_formed_s": meshgate_s,
        "c10d_formed_s": c10d_s,
        "meshgate_vs_c10d": ratio(meshgate_s, c10d_s),
        "per_node_formed_s": per_node_s,
        "per_node_vs_hand_started": ratio(per_node_s, meshgate_s),
    }
