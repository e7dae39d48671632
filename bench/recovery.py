"""Recovery time: one node of a running job dies, how long until the job has a verified world again.

The real ``meshgate-coordinator`` daemon runs a cluster config in the variant with the
agents' heartbeat interval ``heartbeat_s`` and ``misses`` (the loss bound is their
product). Simulated agents (this process, asyncio) go the way a jobs-mode agent goes
(agent/job_runner.py): join the cluster, heartbeat the pool until a heartbeat names the
job, Join it (a spare learns it is one), register their 8 workers in one RegisterBatch
(vouched under mTLS), verify every attestation, AwaitWorld; then heartbeat the job. A
heartbeat answer with a new generation (a survivor) or that says the spare is ACTIVE now
makes that node Join again and register its workers into the new generation, as the agent
relaunches them.

Once generation 0's world is verified on every node, one member stops every call (kill -9
of its agent and its workers: nothing more comes from it). Measured from that moment:
- **detect**: until the coordinator declared it lost (its timeline's entry, the coordinator's clock);
- **told**: until the first survivor's heartbeat answer names the next generation;
- **world**: until the last node (survivors and the spare) holds generation 1's verified world.
And the CPU each side spent from the kill to the world: this process (every simulated
agent and worker, one event loop) and the coordinator, on the same cores.
The goal: the world re-formed within the detection bound (heartbeat_s × misses) + 2 s.

With ``--from-pool`` the job has no spare: the extra node stays idle in the pool (it
heartbeats the pool) until the coordinator gives it the lost block (issue #30 item 4); its
next idle heartbeat names the job, and it Joins at the block's node rank. Section 8 of
``python -m bench`` runs both, in both variants; bench/recovery_torchrun.py the same
failure on real processes under torchrun's c10d and meshgate's agents.

  python -m bench.recovery [--nodes 8] [--heartbeat 0.5] [--misses 3] [--variant memory+plaintext] [--from-pool]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from bench.common import ENDPOINT_HOST, ENDPOINT_PORT, SLOTS_PER_NODE, plan_for, raise_fd_limit
from bench.fanin import FD_MARGIN, TOKEN_TTL_S, _tail, start_daemon
from bench.variants import MEMORY_PLAINTEXT, SQLITE_MTLS, Variant, write_cluster_config

JOB = "recovery"


class SimulatedNode:
    """One agent and its 8 workers, as far as the coordinator can tell."""

    def __init__(self, node_id: str, stubs, key, vouch: bool) -> None:
        self.node_id, self.vouch = node_id, vouch
        self.nodes, self.rendezvous = stubs
        self.key = key
        self.credential = b""
        self.generation = -1  # the generation whose world this node verified
        self.spare = False
        self.dead = False  # killed: no call leaves it any more
        self.worlds: dict[int, float] = {}  # generation -> when its world was verified here
        self.told: dict[int, float] = {}  # generation -> when a heartbeat answer first named it

    async def join_cluster(self, admin) -> None:
        from meshgate.v1 import rendezvous_pb2 as pb

        token = await admin.CreateJoinToken(pb.CreateJoinTokenRequest(node_id=self.node_id, ttl_s=TOKEN_TTL_S))
        reply = await self.nodes.Join(self._join_request(token=token.token))
        self.credential = reply.node_credential

    def _join_request(self, job_id: str = "", token: str = ""):
        from meshgate.v1 import nodes_pb2

        return nodes_pb2.JoinRequest(
            job_id=job_id,
            node_id=self.node_id,
            hostname="bench",
            slots=SLOTS_PER_NODE,
            slot_kind="cpu",
            join_token=token,
            node_credential=b"" if token else self.credential,
            node_public_key=self.key.public_raw,
        )

    async def until_assigned(self, heartbeat_s: float) -> None:
        from meshgate.v1 import nodes_pb2
        from meshgate.v1 import rendezvous_pb2 as pb

        while True:
            reply = await self.nodes.NodeHeartbeat(
                nodes_pb2.NodeHeartbeatRequest(node_id=self.node_id, node_credential=self.credential), timeout=60
            )
            if reply.job_id == JOB and reply.job_state == pb.RUNNING:
                return
            await asyncio.sleep(heartbeat_s)

    async def join_and_register(self) -> None:
        """Join the job (idempotent) and, unless a spare, register the 8 workers into its
        generation, verify each attestation, and await the world."""
        import grpc

        from meshgate.attestation import TrustBundle, sign_vouch, verify_attestation, with_batch
        from meshgate.v1 import nodes_pb2
        from meshgate.v1 import rendezvous_pb2 as pb

        while True:  # UNAVAILABLE (its log is being opened) is retried, as the agent does
            try:
                joined = await self.nodes.Join(self._join_request(JOB), timeout=120)
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                await asyncio.sleep(0.2)
        self.spare = joined.spare
        if self.spare:
            return
        generation, bundle = joined.generation, TrustBundle.from_proto(joined.trust_bundle)
        batch = nodes_pb2.RegisterBatchRequest(
            job_id=JOB, node_id=self.node_id, node_credential=self.credential, one_signature=True
        )
        nonces = [secrets.token_bytes(32) for _ in range(SLOTS_PER_NODE)]
        for local, nonce in enumerate(nonces):
            request = batch.requests.add(
                job_id=JOB,
                worker_id=f"{self.node_id}/local{local}",  # stable, as the agent names them
                nonce=nonce,
                node_id=self.node_id,
                generation=generation,
                endpoint_host=ENDPOINT_HOST,
                endpoint_port=ENDPOINT_PORT,
            )
            request.assigned.local_rank = local
            if self.vouch:
                request.vouch.CopyFrom(
                    sign_vouch(
                        self.key,
                        job_id=JOB,
                        node_id=self.node_id,
                        generation=generation,
                        local_rank=local,
                        expires_at=time.time() + TOKEN_TTL_S,
                    )
                )
        reply = await self.nodes.RegisterBatch(batch, timeout=120)
        for local, result in enumerate(reply.results):
            if not result.HasField("attestation"):
                raise RuntimeError(f"{self.node_id} local {local}: {result.refusal.code}: {result.refusal.message}")
            verify_attestation(
                with_batch(result.attestation, reply.batch),
                bundle,
                job_id=JOB,
                nonce=nonces[local],
                generation=generation,
            )
        await self.rendezvous.AwaitWorld(
            pb.AwaitWorldRequest(job_id=JOB, generation=generation, timeout_ms=120_000), timeout=130
        )
        self.generation = generation
        self.worlds[generation] = time.time()

    async def serve(self, heartbeat_s: float, stop: asyncio.Event) -> None:
        """The job's heartbeats until ``stop`` (or this node's death); a new generation, or
        this spare's promotion, relaunches its workers (Join, register, await the world)."""
        from meshgate.v1 import nodes_pb2
        from meshgate.v1 import rendezvous_pb2 as pb

        await self.join_and_register()
        while not stop.is_set() and not self.dead:
            reply = await self.nodes.NodeHeartbeat(
                nodes_pb2.NodeHeartbeatRequest(
                    job_id=JOB,
                    node_id=self.node_id,
                    generation=max(self.generation, 0),
                    running_workers=0 if self.spare else SLOTS_PER_NODE,
                    node_credential=self.credential,
                ),
                timeout=60,
            )
            if self.dead:
                return
            self.told.setdefault(reply.generation, time.time())
            promoted = self.spare and reply.node_state == pb.NODE_STATE_ACTIVE
            if promoted or (not self.spare and reply.generation != self.generation):
                await self.join_and_register()
                continue
            try:
                await asyncio.wait_for(stop.wait(), heartbeat_s)
            except asyncio.TimeoutError:
                pass


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(
    address: str,
    deployment,
    nodes: int,
    heartbeat_s: float,
    misses: int,
    vouch: bool,
    from_pool: bool = False,
    coordinator_pid: Optional[int] = None,
) -> dict:
    from meshgate.attestation import SigningKey
    from meshgate.tls import secure_channel
    from meshgate.v1 import nodes_pb2_grpc, rendezvous_pb2_grpc
    from meshgate.v1 import rendezvous_pb2 as pb

    ids = [f"node-{i:05d}" for i in range(nodes + 1)]  # the last one: the spare, or idle in the pool
    tls = {node: deployment.agent_tls(node) for node in ids}
    raise_fd_limit(len(ids) + FD_MARGIN)
    channels = {node: secure_channel(address, tls[node], aio=True) for node in ids}
    operator = secure_channel(address, deployment.admin_tls(), aio=True)
    admin = rendezvous_pb2_grpc.AdminStub(operator)
    simulated = [
        SimulatedNode(
            node,
            (nodes_pb2_grpc.NodesStub(channels[node]), rendezvous_pb2_grpc.RendezvousStub(channels[node])),
            SigningKey.generate(),
            vouch,
        )
        for node in ids
    ]
    limit = asyncio.Semaphore(64)

    async def join(node: SimulatedNode) -> None:
        async with limit:
            await node.join_cluster(admin)

    await asyncio.gather(*(join(n) for n in simulated))
    spec = pb.JobSpec(
        job_id=JOB,
        plan=plan_for(nodes * SLOTS_PER_NODE).to_proto(),
        nodes=nodes,
        spares=0 if from_pool else 1,
        slots_per_node=SLOTS_PER_NODE,
        command=["true"],  # never run: the agents are simulated
        mode=pb.RANK_MODE_ASSIGNED,
        lost_node_timeout_s=600,
    )
    await admin.SubmitJob(pb.SubmitJobRequest(spec=spec), timeout=120)
    pool = simulated[-1:] if from_pool else []  # idle until the coordinator gives it the lost block
    await asyncio.gather(*(n.until_assigned(heartbeat_s) for n in simulated if n not in pool))
    stop = asyncio.Event()

    async def assigned_then_serve(node: SimulatedNode) -> None:
        await node.until_assigned(heartbeat_s)
        await node.serve(heartbeat_s, stop)

    serving = [asyncio.ensure_future(n.serve(heartbeat_s, stop)) for n in simulated if n not in pool]
    serving += [asyncio.ensure_future(assigned_then_serve(n)) for n in pool]
    try:
        deadline = time.monotonic() + 300

        def members() -> list[SimulatedNode]:  # a spare (a node of the pool) turns member once it takes a block
            return [n for n in simulated if not n.spare and n not in pool]

        while not all(0 in n.worlds for n in members()) or not (pool or any(n.spare for n in simulated)):
            if time.monotonic() > deadline:
                raise TimeoutError("generation 0's world never formed on every member")
            for task in serving:
                if task.done():
                    task.result()  # a node failed: say why
            await asyncio.sleep(0.05)
        victim = members()[-1]
        victim.dead = True
        killed = time.time()
        cpu_at_kill = (time.process_time(), process_cpu_s(coordinator_pid) if coordinator_pid else None)
        cpu_at_told = None  # when the first survivor heard of generation 1 (to 20 ms)
        while not all(1 in n.worlds for n in simulated if not n.dead and not n.spare):
            if time.monotonic() > deadline:
                raise TimeoutError("generation 1's world never formed on every survivor")
            for task in serving:
                if task.done():
                    task.result()
            if cpu_at_told is None and any(1 in n.told for n in simulated if not n.dead):
                cpu_at_told = (time.process_time(), process_cpu_s(coordinator_pid) if coordinator_pid else None)
            await asyncio.sleep(0.02)
        # Where the 2 cores went from the kill to the world: this process (every simulated
        # agent and worker) against the coordinator.
        cpu_at_world = (time.process_time(), process_cpu_s(coordinator_pid) if coordinator_pid else None)
        cpu_at_told = cpu_at_told or cpu_at_world  # told and the world between two polls
        bench_cpu, bench_cpu_after_told = (cpu_at_world[0] - cpu_at_kill[0], cpu_at_world[0] - cpu_at_told[0])
        coordinator_cpu = coordinator_cpu_after_told = None
        if coordinator_pid:
            coordinator_cpu = cpu_at_world[1] - cpu_at_kill[1]
            coordinator_cpu_after_told = cpu_at_world[1] - cpu_at_told[1]
        timeline = await admin.GetJobTimeline(pb.GetJobTimelineRequest(job_id=JOB), timeout=60)
        lost = [
            e.at.ToNanoseconds() / 1e9
            for e in timeline.entries
            if e.moment == pb.TIMELINE_NODE_CHANGED and e.node_id == victim.node_id and e.detail.startswith("lost")
        ]
        survivors = [n for n in simulated if not n.dead]
        told = min(n.told[1] for n in survivors if 1 in n.told)
        last_told = max(n.told[1] for n in survivors if 1 in n.told)
        world = max(n.worlds[1] for n in survivors if 1 in n.worlds)
        import grpc

        try:  # durable at once; answered CANCELLED once the nodes' heartbeats show its processes gone
            await admin.CancelJob(pb.CancelJobRequest(job_id=JOB, reason="bench over"), timeout=3)
        except grpc.aio.AioRpcError as exc:  # simulated agents (and the killed one) do not all show it
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
    finally:
        stop.set()
        for node in simulated:
            node.dead = True
        await asyncio.gather(*serving, return_exceptions=True)
        await asyncio.gather(operator.close(), *(c.close() for c in channels.values()))
    bound = heartbeat_s * misses
    world_s = world - killed
    return {
        "replacement": "from the pool" if from_pool else "spare",
        "nodes": nodes,
        "workers": nodes * SLOTS_PER_NODE,
        "heartbeat_s": heartbeat_s,
        "misses": misses,
        "detection_bound_s": bound,
        "detect_s": (lost[0] - killed) if lost else None,
        "told_s": told - killed,
        "last_told_s": last_told - killed,  # the last node to hear of generation 1
        "world_s": world_s,
        "world_after_detect_s": (world - lost[0]) if lost else None,
        "goal_s": bound + 2.0,
        "goal_met": world_s <= bound + 2.0,
        "bench_cpu_s": bench_cpu,
        "coordinator_cpu_s": coordinator_cpu,
        # the same from the first survivor told to the world: the re-registration
        "bench_cpu_after_told_s": bench_cpu_after_told,
        "coordinator_cpu_after_told_s": coordinator_cpu_after_told,
    }


def run_recovery(
    directory: Path, variant: Variant, nodes: int, heartbeat_s: float, misses: int, from_pool: bool = False
) -> dict:
    deployment = write_cluster_config(directory, variant, heartbeat_s, misses)
    daemon, address = start_daemon(directory, deployment)
    try:
        vouch = variant.requires_vouch(agents=True)
        load = os.getloadavg()[0]
        result = asyncio.run(
            measure(address, deployment, nodes, heartbeat_s, misses, vouch, from_pool, coordinator_pid=daemon.pid)
        )
    except (RuntimeError, TimeoutError) as exc:
        log = directory / "coordinator.log"
        raise RuntimeError(f"{exc}\ncoordinator log {log}, last lines:\n{_tail(log)}") from None
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
    return {"variant": variant.name, **result, "loadavg": load}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--heartbeat", type=float, default=0.5)
    parser.add_argument("--misses", type=int, default=3)
    parser.add_argument("--variant", choices=("memory+plaintext", "sqlite+mtls"), default="memory+plaintext")
    parser.add_argument("--from-pool", action="store_true", help="no spare: an idle node of the pool takes the block")
    args = parser.parse_args(argv)
    variant = MEMORY_PLAINTEXT if args.variant == "memory+plaintext" else SQLITE_MTLS
    with tempfile.TemporaryDirectory(prefix="mg-recovery-") as tmp:
        result = run_recovery(Path(tmp), variant, args.nodes, args.heartbeat, args.misses, args.from_pool)
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
