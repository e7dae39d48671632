"""Mode 5: time to a verified world through agent fan-in, side by side with direct.

The real ``meshgate-coordinator`` daemon serves a world of N (memory store, plaintext,
a static join token). Load processes play the node agents: each simulated node joins
once (setup, not timed: agents join before they launch workers), then for the timed
phase sends its workers' Registers in one ``RegisterBatch`` signed once, as the agent
does, hands each worker its own attestation with the signed batch, which is verified
against the trust bundle with that worker's nonce (as each worker does itself: every
worker checks the batch signature, 8 Ed25519 verifications per node here), and waits in one AwaitWorld per node (the agent coalesces
its workers' waits). The direct baseline in the same run: every worker calls Register,
verifies, and calls AwaitWorld itself (bench.load, as in mode 2).

  python -m bench.fanin --workers 100000 [--per-node 8] [--processes 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import JOB, SLOTS_PER_NODE, node_id, plan_for, proc_cpu_s, register_request

REPO = Path(__file__).resolve().parent.parent
TOKEN = "bench-fan-in-token"


def start_daemon(world: int, slots: int, directory: Path) -> tuple[subprocess.Popen, str]:
    plan = plan_for(world, slots)
    config = directory / "coordinator.toml"
    config.write_text(
        "\n".join(
            [
                "[job]", f'id = "{JOB}"', f"slots_per_node = {slots}", f'join_token = "{TOKEN}"',
                "heartbeat_interval_s = 3600", "require_vouch = false",
                "[plan]", *(f"{k} = {v}" for k, v in plan.to_dict().items() if k != "order"),
                "[server]", 'listen = "127.0.0.1:0"', "insecure = true",
                "[keys]", 'dir = "keys"',
                "[store]", 'kind = "memory"',
            ]
        )
        + "\n"
    )
    port_file = directory / "addr"
    process = subprocess.Popen(
        [sys.executable, "-m", "meshgate.coordinator", "--config", str(config), "--port-file", str(port_file),
         "--log-level", "WARNING"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(directory / "coordinator.log", "wb"),
    )
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError((directory / "coordinator.log").read_text())
        time.sleep(0.05)
    return process, port_file.read_text().strip()


async def _agents(address: str, nodes: range, per_node: int, bundle_path: str, start, out) -> None:
    import grpc

    from meshgate.attestation import TrustBundle, verify_attestation, with_batch
    from meshgate.v1 import nodes_pb2, nodes_pb2_grpc
    from meshgate.v1 import rendezvous_pb2 as pb
    from meshgate.v1 import rendezvous_pb2_grpc

    bundle = TrustBundle.load(bundle_path)
    channel = grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
    node_stub = nodes_pb2_grpc.NodesStub(channel)
    world_stub = rendezvous_pb2_grpc.RendezvousStub(channel)
    limit = asyncio.Semaphore(64)
    credentials = {}

    async def join(n: int) -> None:
        async with limit:
            reply = await node_stub.Join(nodes_pb2.JoinRequest(
                job_id=JOB, node_id=node_id(n * per_node, per_node), hostname="bench",
                slots=per_node, slot_kind="cpu", join_token=TOKEN))
            credentials[n] = reply.node_credential

    await asyncio.gather(*(join(n) for n in nodes))  # setup: agents join before launching
    out.send(("joined", len(nodes)))
    start.wait()
    digest = b""  # the plan digest is optional in a Register
    latencies, verified = [], 0
    began = time.monotonic()

    async def node(n: int) -> None:
        nonlocal verified
        workers = range(n * per_node, (n + 1) * per_node)
        nonces = {i: secrets.token_bytes(32) for i in workers}
        batch = nodes_pb2.RegisterBatchRequest(
            job_id=JOB, node_id=node_id(n * per_node, per_node), node_credential=credentials[n],
            one_signature=True)  # what the agent asks for (agent/fanin.py)
        batch.requests.extend(register_request(i, nonces[i], digest, per_node) for i in workers)
        async with limit:
            sent = time.monotonic()
            reply = await node_stub.RegisterBatch(batch, timeout=600)
            latencies.append(time.monotonic() - sent)
        for i, result in zip(workers, reply.results):
            if not result.HasField("attestation"):
                raise RuntimeError(f"worker {i}: {result.refusal.code}: {result.refusal.message}")
            # What each worker does with what its agent hands it: the one batch signature,
            # then its own entry, with its own nonce.
            verify_attestation(with_batch(result.attestation, reply.batch), bundle, job_id=JOB,
                               nonce=nonces[i], generation=0)
            verified += 1
        # Not under the batch bound: an agent parks its one AwaitWorld as soon as its batch
        # is answered (under a shared bound, FIFO would queue every wait behind every batch).
        await world_stub.AwaitWorld(pb.AwaitWorldRequest(job_id=JOB, generation=0, timeout_ms=600_000), timeout=700)

    await asyncio.gather(*(node(n) for n in nodes))
    out.send(("done", {"verified": verified, "seconds": time.monotonic() - began, "batch_latencies": latencies}))
    await channel.close()


def _agent_process(address, first, count, per_node, bundle_path, start, out) -> None:
    asyncio.run(_agents(address, range(first, first + count), per_node, bundle_path, start, out))


def run_fan_in(workers: int, per_node: int = SLOTS_PER_NODE, processes: int = 2) -> dict:
    world = -(-workers // per_node) * per_node
    nodes = world // per_node
    with tempfile.TemporaryDirectory(prefix="meshgate-fanin-") as tmp:
        daemon, address = start_daemon(world, per_node, Path(tmp))
        try:
            bundle = str(Path(tmp) / "keys" / "trust-bundle.json")
            ctx = multiprocessing.get_context("spawn")
            start = ctx.Event()
            pipes, procs = [], []
            share = -(-nodes // processes)
            for p in range(processes):
                first, count = p * share, max(0, min(share, nodes - p * share))
                if not count:
                    continue
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_agent_process, args=(address, first, count, per_node, bundle, start, child))
                proc.start()
                pipes.append(parent)
                procs.append(proc)
            joined = sum(pipe.recv()[1] for pipe in pipes)
            cpu_before = proc_cpu_s(daemon.pid)
            began = time.monotonic()
            start.set()
            results = [pipe.recv()[1] for pipe in pipes]
            wall = time.monotonic() - began
            cpu = proc_cpu_s(daemon.pid) - cpu_before
            for proc in procs:
                proc.join(timeout=30)
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)
    latencies = sorted(x for r in results for x in r["batch_latencies"])
    return {
        "workers": world,
        "nodes": joined,
        "per_node": per_node,
        "wall_s": wall,
        "verified": sum(r["verified"] for r in results),
        "coordinator_cpu_s": cpu,
        "batch_p50_ms": 1000 * latencies[len(latencies) // 2] if latencies else None,
        "batch_p99_ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] if latencies else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fanin")
    parser.add_argument("--workers", type=int, default=100_000)
    parser.add_argument("--per-node", type=int, default=SLOTS_PER_NODE)
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args(argv)
    print(json.dumps(run_fan_in(args.workers, args.per_node, args.processes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
