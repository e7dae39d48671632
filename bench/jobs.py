"""Section 6: jobs through one jobs-mode coordinator and simulated agents.

The real ``meshgate-coordinator`` daemon runs a cluster config in the variant
(bench.variants.write_cluster_config: no [job]; under mTLS vouches are required, the
daemon's default). Load processes play the node agents, as section 5's do, but the
whole way a jobs-mode agent goes (agent/daemon.py): in the untimed setup each joins the
cluster once with a join token minted for it (and, under mTLS, its own agent certificate
and connection); then it heartbeats the pool every ``heartbeat_s`` (the config's
``[cluster] heartbeat_interval_s``) until a heartbeat names a RUNNING job for it; it joins
that job, signs its 8 workers' vouches (under mTLS), sends their Registers in one
RegisterBatch signed once, verifies every worker's attestation with that worker's nonce,
parks one AwaitWorld, reports each worker's exit 0 (ReportExit), and heartbeats the pool
again at once. No command runs: the simulated workers exit as soon as their world is
verified.

Two figures, each on its own daemon:
- **one large job**: the time from SubmitJob (an operator, admin certificate under mTLS) to
  the last of its nodes holding a verified world, for ``nodes`` nodes of 8 workers; split
  into the wait for the heartbeat that tells a node (at most one interval) and the rest.
- **small jobs per minute**: ``jobs`` one-node jobs (8 workers each) through 8 agents, as
  many in flight as agents, each submitted as one ends; with the coordinator's CPU per job.

  python -m bench.jobs [--nodes 1000] [--jobs 64] [--variant sqlite+mtls]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from meshgate.tls import TLSConfig

from bench.common import ENDPOINT_HOST, ENDPOINT_PORT, SLOTS_PER_NODE, percentile, plan_for, proc_cpu_s, raise_fd_limit
from bench.fanin import FD_MARGIN, TOKEN_TTL_S, _receive, _tail, run_reporting, start_daemon
from bench.variants import MEMORY_PLAINTEXT, Variant, write_cluster_config

# Nothing is declared lost during a run: the simulated agents heartbeat the pool, not the
# jobs they serve (a job here lasts seconds).
HEARTBEAT_MISSES = 600
SMALL_JOB_AGENTS = 8


@dataclass(frozen=True)
class PoolAgents:
    """What one load process plays: the agents of ``nodes``, each with its transport."""

    address: str
    nodes: tuple[str, ...]
    tls: tuple[Optional[TLSConfig], ...]  # each node's: its agent certificate, or None
    admin_tls: Optional[TLSConfig]  # the operator's, to mint the join tokens
    heartbeat_s: float
    vouch: bool  # the coordinator requires a vouch per Register: each agent signs them


async def _pool_agents(spec: PoolAgents, stop, out) -> None:
    import grpc

    from meshgate.attestation import SigningKey, TrustBundle, sign_vouch, verify_attestation, with_batch
    from meshgate.tls import secure_channel
    from meshgate.v1 import nodes_pb2, nodes_pb2_grpc
    from meshgate.v1 import rendezvous_pb2 as pb
    from meshgate.v1 import rendezvous_pb2_grpc

    options = [("grpc.max_receive_message_length", 64 << 20)]
    channels = {tls: secure_channel(spec.address, tls, aio=True, options=options) for tls in set(spec.tls)}
    nodes = {node: nodes_pb2_grpc.NodesStub(channels[tls]) for node, tls in zip(spec.nodes, spec.tls)}
    worlds = {node: rendezvous_pb2_grpc.RendezvousStub(channels[tls]) for node, tls in zip(spec.nodes, spec.tls)}
    operator = secure_channel(spec.address, spec.admin_tls, aio=True)
    admin = rendezvous_pb2_grpc.AdminStub(operator)
    keys = {node: SigningKey.generate() for node in spec.nodes}
    credentials: dict[str, bytes] = {}
    limit = asyncio.Semaphore(64)

    async def join_cluster(node: str) -> None:
        async with limit:
            token = await admin.CreateJoinToken(pb.CreateJoinTokenRequest(node_id=node, ttl_s=TOKEN_TTL_S))
            reply = await nodes[node].Join(
                nodes_pb2.JoinRequest(
                    node_id=node,
                    hostname="bench",
                    slots=SLOTS_PER_NODE,
                    slot_kind="cpu",
                    join_token=token.token,
                    node_public_key=keys[node].public_raw,
                )
            )
            credentials[node] = reply.node_credential

    await asyncio.gather(*(join_cluster(node) for node in spec.nodes))
    await operator.close()
    out.send(("joined", {"nodes": len(spec.nodes), "connections": len(channels)}))

    async def serve(node: str, job_id: str) -> dict:
        """One node's part of a job, as the agent does it (agent/daemon.py, agent/fanin.py)."""
        seen = time.time()
        credential, stub = credentials[node], nodes[node]
        join = nodes_pb2.JoinRequest(
            job_id=job_id,
            node_id=node,
            hostname="bench",
            slots=SLOTS_PER_NODE,
            slot_kind="cpu",
            node_credential=credential,
            node_public_key=keys[node].public_raw,
        )
        deadline = time.monotonic() + 60
        while True:  # UNAVAILABLE (its log is being opened) is retried after 0.2 s, as the agent does
            try:
                joined = await stub.Join(join, timeout=600)
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        generation, bundle = joined.generation, TrustBundle.from_proto(joined.trust_bundle)
        batch = nodes_pb2.RegisterBatchRequest(
            job_id=job_id, node_id=node, node_credential=credential, one_signature=True
        )
        nonces = [secrets.token_bytes(32) for _ in range(SLOTS_PER_NODE)]
        for local, nonce in enumerate(nonces):
            request = batch.requests.add(
                job_id=job_id,
                worker_id=f"{node}/local{local}",
                nonce=nonce,
                node_id=node,
                generation=generation,
                endpoint_host=ENDPOINT_HOST,
                endpoint_port=ENDPOINT_PORT,
            )
            request.assigned.local_rank = local
            if spec.vouch:  # what the agent signs as it launches each worker
                vouch = sign_vouch(
                    keys[node],
                    job_id=job_id,
                    node_id=node,
                    generation=generation,
                    local_rank=local,
                    expires_at=time.time() + TOKEN_TTL_S,
                )
                request.vouch.CopyFrom(vouch)
        reply = await stub.RegisterBatch(batch, timeout=600)
        for local, result in enumerate(reply.results):
            if not result.HasField("attestation"):
                raise RuntimeError(f"{node} local {local}: {result.refusal.code}: {result.refusal.message}")
            verify_attestation(
                with_batch(result.attestation, reply.batch),
                bundle,
                job_id=job_id,
                nonce=nonces[local],
                generation=generation,
            )
        await worlds[node].AwaitWorld(
            pb.AwaitWorldRequest(job_id=job_id, generation=generation, timeout_ms=600_000), timeout=700
        )
        verified = time.time()
        for local in range(SLOTS_PER_NODE):  # the workers are done: each one's exit 0
            await stub.ReportExit(
                nodes_pb2.WorkerExitReport(
                    job_id=job_id,
                    node_id=node,
                    local_rank=local,
                    exit_code=0,
                    node_credential=credential,
                    generation=generation,
                ),
                timeout=600,
            )
        return {"job": job_id, "node": node, "seen": seen, "verified": verified, "exited": time.time()}

    async def agent(node: str) -> None:
        served: set[str] = set()
        while not stop.is_set():
            reply = await nodes[node].NodeHeartbeat(
                nodes_pb2.NodeHeartbeatRequest(node_id=node, node_credential=credentials[node], live_units=[]),
                timeout=600,
            )
            if reply.job_id and reply.job_state == pb.RUNNING and reply.job_id not in served:
                served.add(reply.job_id)
                out.send(("served", await serve(node, reply.job_id)))
                continue  # back to the pool at once: the next heartbeat says the node is idle
            await asyncio.sleep(spec.heartbeat_s)

    await asyncio.gather(*(agent(node) for node in spec.nodes))
    await asyncio.gather(*(channel.close() for channel in channels.values()))


def _pool_process(spec: PoolAgents, stop, out) -> None:
    run_reporting(_pool_agents(spec, stop, out), out)


class Cluster:
    """A jobs-mode daemon and ``nodes`` simulated agents in ``processes`` load processes."""

    def __init__(self, directory: Path, variant: Variant, nodes: int, processes: int, heartbeat_s: float) -> None:
        self.directory, self.variant, self.heartbeat_s = directory, variant, heartbeat_s
        self.node_ids = [f"pool-{i:06d}" for i in range(nodes)]
        self.processes = min(processes, nodes)
        self.daemon = None
        self.procs: list = []
        self.pipes: list = []

    def __enter__(self) -> "Cluster":
        from meshgate.tls import secure_channel
        from meshgate.v1 import rendezvous_pb2_grpc

        deployment = write_cluster_config(self.directory, self.variant, self.heartbeat_s, HEARTBEAT_MISSES)
        self.daemon, self.address = start_daemon(self.directory, deployment)
        try:
            tls = [deployment.agent_tls(node) for node in self.node_ids]
            self.fd_limit = raise_fd_limit(len(set(tls)) + FD_MARGIN)
            ctx = multiprocessing.get_context("spawn")
            self.stop = ctx.Event()
            share = -(-len(self.node_ids) // self.processes)
            began = time.monotonic()
            for first in range(0, len(self.node_ids), share):
                spec = PoolAgents(
                    self.address,
                    tuple(self.node_ids[first : first + share]),
                    tuple(tls[first : first + share]),
                    deployment.admin_tls(),
                    self.heartbeat_s,
                    self.variant.requires_vouch(agents=True),
                )
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_pool_process, args=(spec, self.stop, child))
                proc.start()
                self.pipes.append(parent)
                self.procs.append(proc)
            joined = [_receive(pipe, proc, "joined", 900) for pipe, proc in zip(self.pipes, self.procs)]
            self.setup_s = time.monotonic() - began
            self.connections = sum(j["connections"] for j in joined)
            self.channel = secure_channel(self.address, deployment.admin_tls())
            self.admin = rendezvous_pb2_grpc.AdminStub(self.channel)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.procs:
            self.stop.set()
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        if getattr(self, "channel", None) is not None:
            self.channel.close()
        if self.daemon is not None:
            self.daemon.terminate()
            self.daemon.wait(timeout=30)

    def submit(self, job_id: str, nodes: int) -> float:
        """Submit an assigned-mode job of ``nodes`` nodes of 8 workers; when it was sent."""
        from meshgate.v1 import rendezvous_pb2 as pb

        spec = pb.JobSpec(
            job_id=job_id,
            plan=plan_for(nodes * SLOTS_PER_NODE).to_proto(),
            nodes=nodes,
            slots_per_node=SLOTS_PER_NODE,
            command=["true"],  # never run: the agents are simulated
            mode=pb.RANK_MODE_ASSIGNED,
        )
        sent = time.time()
        self.admin.SubmitJob(pb.SubmitJobRequest(spec=spec), timeout=600)
        return sent

    def served(self, timeout_s: float = 900) -> list[dict]:
        """The next records of nodes that served their part of a job (at least one)."""
        deadline = time.monotonic() + timeout_s
        while True:
            ready = multiprocessing.connection.wait(self.pipes, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"no agent served a job in {timeout_s:g} s")
            records = []
            for pipe in ready:
                proc = self.procs[self.pipes.index(pipe)]
                records.append(_receive(pipe, proc, "served", 1))
            return records

    def state_of(self, job_id: str) -> str:
        from meshgate.v1 import rendezvous_pb2 as pb

        return pb.JobState.Name(self.admin.GetJob(pb.GetJobRequest(job_id=job_id), timeout=60).state)

    def wait_ended(self, job_ids: list[str], timeout_s: float = 120) -> dict[str, str]:
        """Each job's state once none is PENDING or RUNNING (ReportExit answers once the
        exit is durable and the job reconciled, so this is normally at once)."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = {job: self.state_of(job) for job in job_ids}
            if all(s not in ("PENDING", "RUNNING") for s in states.values()) or time.monotonic() > deadline:
                return states
            time.sleep(0.05)


def run_large_job(directory: Path, variant: Variant, nodes: int, processes: int, heartbeat_s: float) -> dict:
    """SubmitJob to a verified world for one job of ``nodes`` nodes (8 workers each)."""
    with Cluster(directory, variant, nodes, processes, heartbeat_s) as cluster:
        try:
            cpu_before = proc_cpu_s(cluster.daemon.pid)
            submitted = cluster.submit("large", nodes)
            records: list[dict] = []
            while len(records) < nodes:
                records += [r for r in cluster.served() if r["job"] == "large"]
            cpu = proc_cpu_s(cluster.daemon.pid) - cpu_before
            states = cluster.wait_ended(["large"])
        except (RuntimeError, TimeoutError) as exc:
            log = directory / "coordinator.log"
            raise RuntimeError(f"{exc}\ncoordinator log {log}, last lines:\n{_tail(log)}") from None
        seen = sorted(r["seen"] - submitted for r in records)
        verified = sorted(r["verified"] - submitted for r in records)
        return {
            "variant": variant.name,
            "nodes": nodes,
            "workers": nodes * SLOTS_PER_NODE,
            "heartbeat_s": heartbeat_s,
            "submit_to_world_s": verified[-1],
            "last_node_told_s": seen[-1],  # the heartbeat wait: at most one interval, plus load
            "last_told_to_world_s": verified[-1] - seen[-1],
            "world_p50_s": percentile(verified, 50),
            "coordinator_cpu_s": cpu,  # submit to the world, with the idle nodes' heartbeats
            "final_state": states["large"],
            "setup_s": cluster.setup_s,
            "connections": cluster.connections,
        }


def run_small_jobs(
    directory: Path, variant: Variant, jobs: int, agents: int, processes: int, heartbeat_s: float
) -> dict:
    """``jobs`` one-node jobs through ``agents`` agents, one in flight per agent."""
    with Cluster(directory, variant, agents, processes, heartbeat_s) as cluster:
        try:
            cpu_before = proc_cpu_s(cluster.daemon.pid)
            began = time.monotonic()
            submitted, done = {}, []
            for i in range(min(agents, jobs)):
                submitted[f"small-{i:05d}"] = cluster.submit(f"small-{i:05d}", 1)
            while len(done) < jobs:
                for record in cluster.served():
                    done.append(record["verified"] - submitted[record["job"]])
                    if len(submitted) < jobs:
                        job_id = f"small-{len(submitted):05d}"
                        submitted[job_id] = cluster.submit(job_id, 1)
            wall = time.monotonic() - began
            cpu = proc_cpu_s(cluster.daemon.pid) - cpu_before
            states = cluster.wait_ended(list(submitted))
        except (RuntimeError, TimeoutError) as exc:
            log = directory / "coordinator.log"
            raise RuntimeError(f"{exc}\ncoordinator log {log}, last lines:\n{_tail(log)}") from None
        done.sort()
        return {
            "variant": variant.name,
            "jobs": jobs,
            "agents": agents,
            "heartbeat_s": heartbeat_s,
            "wall_s": wall,
            "jobs_per_min": 60 * jobs / wall,
            "submit_to_world_p50_s": percentile(done, 50),
            "submit_to_world_max_s": done[-1],
            "coordinator_cpu_s": cpu,
            "coordinator_cpu_ms_per_job": 1000 * cpu / jobs,
            "succeeded": sum(1 for s in states.values() if s == "SUCCEEDED"),
            "states": sorted(set(states.values())),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.jobs")
    parser.add_argument("--nodes", type=int, default=1000, help="nodes of the large job (8 workers each)")
    parser.add_argument("--jobs", type=int, default=64, help="small one-node jobs")
    parser.add_argument("--agents", type=int, default=SMALL_JOB_AGENTS, help="agents the small jobs go through")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--heartbeat", type=float, default=1.0, help="[cluster] heartbeat_interval_s")
    parser.add_argument("--variant", type=Variant.parse, default=MEMORY_PLAINTEXT)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="meshgate-jobs-") as tmp:
        large = run_large_job(Path(tmp) / "large", args.variant, args.nodes, args.processes, args.heartbeat)
        small = run_small_jobs(
            Path(tmp) / "small", args.variant, args.jobs, args.agents, args.processes, args.heartbeat
        )
    print(json.dumps({"large": large, "small": small}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
