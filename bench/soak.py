"""``python -m bench.soak [--jobs 1000] [--nofile 128]``: push many jobs through one jobs-mode
coordinator and record what it keeps: open descriptors and RSS at the start and at every
``--every`` jobs, then the time to restart with all of them in its log, and the same
readings after the restart (issue 21: an ended job must cost almost nothing).

The coordinator is the real daemon process (``python -m meshgate.coordinator``: SQLite,
plaintext on loopback, so the figures are the store's and the engines', not TLS's), started
with the descriptor limit ``--nofile``. The jobs are claimed-mode jobs (no command: the
submitter ends them with FinishJob), each pinned to one of ``--nodes`` simulated nodes that
joined the cluster through the Nodes API and heartbeat from here; every job still gets its
own log, engine and admission, and ends through the cluster's log, as a job of agents does.

Writes the figures as JSON under bench/results/ (the path is printed last).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import grpc

from bench.common import describe_machine, machine, proc_status

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_targets(pid: int) -> list[str]:
    """Where ``pid``'s descriptors point (files by path; sockets and pipes by kind)."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass  # closed while listing
    return out


def rss_kib(pid: int) -> int:
    return proc_status(pid)["VmRSS"]


@dataclass
class SoakCoordinator:
    """One jobs-mode coordinator process over ``root`` (its config, state, keys and log),
    started with RLIMIT_NOFILE = ``nofile``; restartable on the same state."""

    root: Path
    nofile: int = 128
    retention: str = "3d"  # [cluster] retention; "" leaves it out (a coordinator from before it)
    ended_jobs_kept: int = 0  # [cluster] ended_jobs_kept; 0 leaves it out (the default, 10,000)
    heartbeat_interval_s: float = 2.0
    heartbeat_misses: int = 15
    process: Optional[subprocess.Popen] = None
    address: str = ""
    config: Path = field(init=False)

    def __post_init__(self) -> None:
        import socket

        self.root.mkdir(parents=True, exist_ok=True)
        self.config = self.root / "coordinator.toml"
        with socket.socket() as probe:  # one port for every start: agents reconnect to it
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.config.write_text(
            f'[server]\nlisten = "127.0.0.1:{port}"\ninsecure = true\n'
            f'[keys]\ndir = "{self.root / "keys"}"\n'
            f'[store]\nkind = "sqlite"\ndir = "{self.root / "state"}"\n'
            f"[cluster]\nheartbeat_interval_s = {self.heartbeat_interval_s}\n"
            f"heartbeat_misses = {self.heartbeat_misses}\n"
            + (f'retention = "{self.retention}"\n' if self.retention else "")
            + (f"ended_jobs_kept = {self.ended_jobs_kept}\n" if self.ended_jobs_kept else "")
        )

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, timeout: float = 120.0) -> float:
        """Start and wait until it serves; returns the seconds that took."""
        port_file = self.root / "coordinator.addr"
        port_file.unlink(missing_ok=True)
        limit = self.nofile

        def limit_descriptors() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

        started = time.monotonic()
        with open(self.root / "coordinator.log", "ab") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "meshgate.coordinator",
                    "--config",
                    str(self.config),
                    "--port-file",
                    str(port_file),
                ],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=limit_descriptors,
            )
        while not port_file.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"coordinator exited {self.process.returncode}:\n{self.log()[-3000:]}")
            if time.monotonic() - started > timeout:
                self.process.kill()
                raise RuntimeError(f"coordinator did not start in {timeout}s:\n{self.log()[-3000:]}")
            time.sleep(0.02)
        self.address = port_file.read_text().strip()
        return time.monotonic() - started

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log(self) -> str:
        return (self.root / "coordinator.log").read_text(errors="replace")


class Client:
    """The Admin and Nodes APIs over one plaintext channel (a new channel per call would
    measure connection churn, not jobs)."""

    def __init__(self, address: str) -> None:
        from meshgate.v1 import nodes_pb2_grpc, rendezvous_pb2_grpc

        self.channel = grpc.insecure_channel(address)
        self.admin = rendezvous_pb2_grpc.AdminStub(self.channel)
        self.nodes = nodes_pb2_grpc.NodesStub(self.channel)
        self.credentials: dict[str, bytes] = {}

    def close(self) -> None:
        self.channel.close()

    def join(self, node_ids: list[str], slots: int = 2) -> None:
        """Simulated nodes join the cluster once, each with a token minted for it."""
        from meshgate.v1 import nodes_pb2
        from meshgate.v1 import rendezvous_pb2 as pb

        for node_id in node_ids:
            token = self.admin.CreateJoinToken(pb.CreateJoinTokenRequest(node_id=node_id, ttl_s=600)).token
            reply = self.nodes.Join(
                nodes_pb2.JoinRequest(
                    node_id=node_id,
                    hostname=node_id,
                    slots=slots,
                    slot_kind="cpu",
                    join_token=token,
                    node_public_key=os.urandom(32),
                )
            )
            self.credentials[node_id] = reply.node_credential

    def heartbeat(self, node_ids: Optional[list[str]] = None) -> None:
        """Idle heartbeats of simulated nodes; no live unit, as an agent whose job's
        processes are all gone reports (only then does its node go back to the pool)."""
        from meshgate.v1 import nodes_pb2

        for node_id in self.credentials if node_ids is None else node_ids:
            self.nodes.NodeHeartbeat(
                nodes_pb2.NodeHeartbeatRequest(
                    node_id=node_id,
                    node_credential=self.credentials[node_id],
                    live_units=[],
                )
            )

    def run_claimed_job(self, job_id: str, node_id: str, timeout: float = 60.0):
        """Submit a 2-worker claimed job pinned to ``node_id``, see it RUNNING, finish it."""
        from meshgate.plan import ParallelPlan
        from meshgate.v1 import rendezvous_pb2 as pb

        spec = pb.JobSpec(
            job_id=job_id, plan=ParallelPlan(dp_shard=2).to_proto(), node_ids=[node_id], mode=pb.RANK_MODE_CLAIMED
        )
        info = self.admin.SubmitJob(pb.SubmitJobRequest(spec=spec))
        deadline = time.monotonic() + timeout
        while info.state == pb.PENDING:  # its node may still be closing the job before
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job_id} still PENDING after {timeout}s: {info.reason}")
            time.sleep(0.01)
            info = self.admin.GetJob(pb.GetJobRequest(job_id=job_id))
        if info.state != pb.RUNNING:
            raise RuntimeError(f"job {job_id} is {pb.JobState.Name(info.state)}: {info.reason}")
        ended = self.admin.FinishJob(pb.FinishJobRequest(job_id=job_id, succeeded=True, reason="soak"))
        self.heartbeat([node_id])  # its simulated agent: the job's unit is empty
        if ended.state != pb.SUCCEEDED:
            raise RuntimeError(f"job {job_id} ended {pb.JobState.Name(ended.state)}: {ended.reason}")
        return ended


def run_jobs(client: Client, first: int, count: int, nodes: list[str], prefix: str = "soak") -> None:
    last_beat = float("-inf")
    for i in range(first, first + count):
        if time.monotonic() - last_beat > 2.0:
            client.heartbeat()
            last_beat = time.monotonic()
        client.run_claimed_job(f"{prefix}-{i:06d}", nodes[i % len(nodes)])


def reading(coordinator: SoakCoordinator, jobs: int) -> dict:
    return {"jobs": jobs, "fds": open_fds(coordinator.pid), "rss_kib": rss_kib(coordinator.pid)}


def soak(
    root: Path,
    jobs: int,
    every: int,
    nodes: int,
    nofile: int,
    retention: str = "3d",
    log=print,
    ended_jobs_kept: int = 0,
) -> dict:
    """The soak: readings before the first job and every ``every`` jobs, then a restart."""
    from meshgate.v1 import rendezvous_pb2 as pb

    coordinator = SoakCoordinator(root, nofile=nofile, retention=retention, ended_jobs_kept=ended_jobs_kept)
    first_start_s = coordinator.start()
    client = Client(coordinator.address)
    try:
        node_ids = [f"soak-node-{i}" for i in range(nodes)]
        client.join(node_ids)
        readings = [reading(coordinator, 0)]
        log(f"0 jobs: {readings[-1]}")
        started = time.monotonic()
        done = 0
        while done < jobs:
            batch = min(every, jobs - done)
            run_jobs(client, done, batch, node_ids)
            done += batch
            readings.append(reading(coordinator, done))
            log(f"{done} jobs: {readings[-1]} ({time.monotonic() - started:.1f}s)")
        jobs_wall_s = time.monotonic() - started
        client.close()
        coordinator.stop()
        restart_s = coordinator.start()
        client = Client(coordinator.address)
        # the oldest job the coordinator still keeps ([cluster] ended_jobs_kept forgets the rest)
        oldest = f"soak-{max(0, jobs - ended_jobs_kept) if ended_jobs_kept else 0:06d}"
        t0 = time.monotonic()
        old = client.admin.GetJob(pb.GetJobRequest(job_id=oldest))
        first_show_s = time.monotonic() - t0
        assert old.state == pb.SUCCEEDED and old.status.job_id == oldest, old
        after_restart = reading(coordinator, jobs)
        log(f"restart: {restart_s:.2f}s to serve; then {after_restart}")
        first, last = readings[0], readings[-1]
        return {
            "jobs": jobs,
            "nodes": nodes,
            "nofile": nofile,
            "readings": readings,
            "jobs_wall_s": round(jobs_wall_s, 2),
            "jobs_per_s": round(jobs / jobs_wall_s, 1),
            "fds_growth": last["fds"] - first["fds"],
            "rss_kib_per_job": round((last["rss_kib"] - first["rss_kib"]) / jobs, 2),
            "first_start_s": round(first_start_s, 3),
            "restart_s": round(restart_s, 3),
            "show_old_job_after_restart_s": round(first_show_s, 4),
            "after_restart": after_restart,
            "cluster_log_bytes": (root / "state" / "cluster" / "state.sqlite3").stat().st_size,
        }
    finally:
        client.close()
        coordinator.stop()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--every", type=int, default=500, help="take a reading every this many jobs")
    parser.add_argument("--nodes", type=int, default=4, help="simulated nodes the jobs are spread over")
    parser.add_argument("--nofile", type=int, default=128, help="the coordinator's RLIMIT_NOFILE")
    parser.add_argument("--retention", default="3d", help='[cluster] retention ("": leave it out)')
    parser.add_argument("--ended-jobs-kept", type=int, default=0, help="[cluster] ended_jobs_kept (0: the default)")
    parser.add_argument("--dir", help="state directory (default: a new temporary one)")
    args = parser.parse_args(argv)
    import tempfile

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="meshgate-soak-"))
    about = machine()
    print(f"machine: {describe_machine(about)}", file=sys.stderr)
    figures = soak(
        root,
        args.jobs,
        args.every,
        args.nodes,
        args.nofile,
        args.retention,
        log=lambda m: print(f"[soak {time.strftime('%H:%M:%S')}] {m}", file=sys.stderr, flush=True),
        ended_jobs_kept=args.ended_jobs_kept,
    )
    figures["machine"] = about
    figures["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(figures, indent=2))
    print(json.dumps({k: v for k, v in figures.items() if k != "machine"}, indent=2))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
