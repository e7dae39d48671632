"""Mode 5: time to a verified world through agent fan-in, side by side with direct.

The real ``meshgate-coordinator`` daemon serves a world of N from the variant's config
(bench.variants: memory+plaintext, or the daemon's defaults, sqlite+mtls). Load processes
play the node agents. In the setup (not timed: agents join before they launch workers)
each simulated node gets a single-use join token that an operator mints for it (Admin
CreateJoinToken, with the admin certificate under mTLS) and joins once with it; under
mTLS each agent has its own certificate naming its node (issued beforehand from the
run's dev CA) and so its own connection, as the coordinator checks on every Nodes call.
Plaintext agents of one process share one connection. Then, timed, each agent
sends its workers' Registers in one ``RegisterBatch`` signed once, as the agent
does, hands each worker its own attestation with the signed batch, which is verified
against the trust bundle with that worker's nonce (as each worker does itself: every
worker checks the batch signature, 8 Ed25519 verifications per node here), and parks
one AwaitWorld per node (the agent coalesces its workers' waits). RegisterBatch calls
in flight are bounded per load process (64); the parked waits are not. The direct
baseline in the same run: every worker calls Register,
verifies, and calls AwaitWorld itself (bench.load, as in mode 2).

  python -m bench.fanin --workers 100000 [--per-node 8] [--processes 2] [--variant sqlite+mtls]
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
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from meshgate.tls import TLSConfig

from bench.common import (
    JOB,
    SLOTS_PER_NODE,
    TRUST_METHOD,
    node_id,
    proc_cpu_s,
    proc_status,
    raise_fd_limit,
    register_request,
)
from bench.servers import transport_check
from bench.variants import MEMORY_PLAINTEXT, Deployment, Variant, write_config

REPO = Path(__file__).resolve().parent.parent
TOKEN_TTL_S = 3600
# Open files besides the connections: the daemon's store, logs, pipes, grpc's own.
FD_MARGIN = 256


def start_daemon(directory: Path, deployment: Deployment) -> tuple[subprocess.Popen, str]:
    """The real daemon serving ``deployment``'s config; its log in ``directory``."""
    config = deployment.config_path
    port_file = directory / "addr"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshgate.coordinator",
            "--config",
            str(config),
            "--port-file",
            str(port_file),
            "--log-level",
            "WARNING",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=open(directory / "coordinator.log", "wb"),
    )
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError((directory / "coordinator.log").read_text())
        time.sleep(0.05)
    return process, port_file.read_text().strip()


@dataclass(frozen=True)
class Agents:
    """What one load process plays: the agents of nodes ``first`` .. ``first + len(tls)``."""

    address: str
    first: int
    tls: tuple[Optional[TLSConfig], ...]  # each node's transport: its agent certificate, or None
    admin_tls: Optional[TLSConfig]  # the operator's, to mint the join tokens
    per_node: int
    bundle_path: str
    vouch: bool = False  # the coordinator requires a vouch per Register: each agent signs them

    @property
    def nodes(self) -> range:
        return range(self.first, self.first + len(self.tls))


async def _agents(spec: Agents, start, out) -> None:
    from meshgate.attestation import SigningKey, TrustBundle, sign_vouch, verify_attestation, with_batch
    from meshgate.tls import secure_channel
    from meshgate.v1 import nodes_pb2, nodes_pb2_grpc
    from meshgate.v1 import rendezvous_pb2 as pb
    from meshgate.v1 import rendezvous_pb2_grpc

    nodes, per_node = spec.nodes, spec.per_node
    bundle = TrustBundle.load(spec.bundle_path)
    # Agents with the same transport share a connection: all of a process's plaintext agents
    # one, each mTLS agent its own (its certificate is its identity on every Nodes call).
    options = [("grpc.max_receive_message_length", 64 << 20)]
    channels = {tls: secure_channel(spec.address, tls, aio=True, options=options) for tls in set(spec.tls)}
    stubs = {
        n: (nodes_pb2_grpc.NodesStub(channels[tls]), rendezvous_pb2_grpc.RendezvousStub(channels[tls]))
        for n, tls in zip(nodes, spec.tls)
    }
    operator = secure_channel(spec.address, spec.admin_tls, aio=True)
    admin = rendezvous_pb2_grpc.AdminStub(operator)
    limit = asyncio.Semaphore(64)
    credentials, vouches = {}, {}

    async def join(n: int) -> None:
        node = node_id(n * per_node, per_node)
        # Every agent has a node key (a first Join to the cluster needs it, as the real agent
        # sends it); it signs the workers' vouches where the coordinator requires them.
        node_key = SigningKey.generate()
        async with limit:
            token = await admin.CreateJoinToken(pb.CreateJoinTokenRequest(job_id=JOB, node_id=node, ttl_s=TOKEN_TTL_S))
            reply = await stubs[n][0].Join(
                nodes_pb2.JoinRequest(
                    job_id=JOB,
                    node_id=node,
                    hostname="bench",
                    slots=per_node,
                    slot_kind="cpu",
                    join_token=token.token,
                    node_public_key=node_key.public_raw,
                )
            )
            credentials[n] = reply.node_credential
        if spec.vouch:  # what the agent signs as it launches each worker
            vouches[n] = [
                sign_vouch(
                    node_key,
                    job_id=JOB,
                    node_id=node,
                    generation=0,
                    local_rank=local,
                    expires_at=time.time() + TOKEN_TTL_S,
                )
                for local in range(per_node)
            ]

    await asyncio.gather(*(join(n) for n in nodes))  # setup: agents join and launch workers
    await operator.close()
    out.send(("joined", {"nodes": len(nodes), "connections": len(channels)}))
    start.wait()
    digest = b""  # the plan digest is optional in a Register
    latencies, verified = [], 0
    began = time.monotonic()

    async def node(n: int) -> None:
        nonlocal verified
        node_stub, world_stub = stubs[n]  # this node's agent connection
        workers = range(n * per_node, (n + 1) * per_node)
        nonces = {i: secrets.token_bytes(32) for i in workers}
        batch = nodes_pb2.RegisterBatchRequest(
            job_id=JOB, node_id=node_id(n * per_node, per_node), node_credential=credentials[n], one_signature=True
        )  # what the agent asks for (agent/fanin.py)
        batch.requests.extend(register_request(i, nonces[i], digest, per_node) for i in workers)
        for request, vouch in zip(batch.requests, vouches.get(n, ())):
            request.vouch.CopyFrom(vouch)  # each worker's own, checked by the coordinator
        async with limit:
            sent = time.monotonic()
            reply = await node_stub.RegisterBatch(batch, timeout=600)
            latencies.append(time.monotonic() - sent)
        for i, result in zip(workers, reply.results):
            if not result.HasField("attestation"):
                raise RuntimeError(f"worker {i}: {result.refusal.code}: {result.refusal.message}")
            # What each worker does with what its agent hands it: the one batch signature,
            # then its own entry, with its own nonce.
            verify_attestation(
                with_batch(result.attestation, reply.batch), bundle, job_id=JOB, nonce=nonces[i], generation=0
            )
            verified += 1
        # Not under the batch bound: an agent parks its one AwaitWorld as soon as its batch
        # is answered (under a shared bound, FIFO would queue every wait behind every batch).
        await world_stub.AwaitWorld(pb.AwaitWorldRequest(job_id=JOB, generation=0, timeout_ms=600_000), timeout=700)

    await asyncio.gather(*(node(n) for n in nodes))
    out.send(("done", {"verified": verified, "seconds": time.monotonic() - began, "batch_latencies": latencies}))
    await asyncio.gather(*(channel.close() for channel in channels.values()))


def run_reporting(main, out) -> None:
    """A load process's body: run ``main``; if it fails, say where on ``out`` first."""
    try:
        asyncio.run(main)
    except BaseException:  # report where it failed, never leave the parent waiting
        out.send(("fatal", traceback.format_exc(limit=4)[-2000:]))
        raise


def _agent_process(spec: Agents, start, out) -> None:
    run_reporting(_agents(spec, start, out), out)


def _receive(pipe, proc, expected: str, timeout_s: float):
    if not pipe.poll(timeout_s):
        raise TimeoutError(f"an agent process sent no {expected!r} in {timeout_s:g} s")
    try:
        kind, value = pipe.recv()
    except EOFError:
        proc.join(timeout=5)
        raise RuntimeError(f"an agent process died (exit code {proc.exitcode})") from None
    if kind != expected:
        raise RuntimeError(f"agent process: {value}")
    return value


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"({exc.strerror})"


def run_fan_in(
    workers: int,
    directory: Path,
    per_node: int = SLOTS_PER_NODE,
    processes: int = 2,
    variant: Variant = MEMORY_PLAINTEXT,
) -> dict:
    """``directory`` keeps the daemon's config, state, keys, certificates and log."""
    world = -(-workers // per_node) * per_node
    nodes = world // per_node
    deployment = write_config(directory, world, per_node, variant, agents=True)
    daemon, address = start_daemon(directory, deployment)
    procs = []
    try:
        transport = transport_check(address, deployment.worker_tls(), TRUST_METHOD)
        began = time.monotonic()
        tls = [deployment.agent_tls(node_id(n * per_node, per_node)) for n in range(nodes)]
        certs_s = time.monotonic() - began
        # One open file per connection, in the daemon and in the agent processes (they inherit it).
        fd_limit = raise_fd_limit(len(set(tls)) + FD_MARGIN)
        ctx = multiprocessing.get_context("spawn")
        start = ctx.Event()
        pipes = []
        share = -(-nodes // processes)
        cpu_before = proc_cpu_s(daemon.pid)
        began = time.monotonic()
        for first in range(0, nodes, share):
            spec = Agents(
                address,
                first,
                tuple(tls[first : first + share]),
                deployment.admin_tls(),
                per_node,
                str(directory / "keys" / "trust-bundle.json"),
                variant.requires_vouch(agents=True),
            )
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_agent_process, args=(spec, start, child))
            proc.start()
            pipes.append(parent)
            procs.append(proc)
        joined = [_receive(pipe, proc, "joined", 900) for pipe, proc in zip(pipes, procs)]
        setup_s, setup_cpu = time.monotonic() - began, proc_cpu_s(daemon.pid) - cpu_before
        cpu_before = proc_cpu_s(daemon.pid)
        began = time.monotonic()
        start.set()
        results = [_receive(pipe, proc, "done", 900) for pipe, proc in zip(pipes, procs)]
        wall = time.monotonic() - began
        cpu = proc_cpu_s(daemon.pid) - cpu_before
        peak_rss_kib = proc_status(daemon.pid)["VmHWM"]  # under mTLS: a connection per agent
        for proc in procs:
            proc.join(timeout=30)
    except (RuntimeError, TimeoutError) as exc:
        log = directory / "coordinator.log"
        raise RuntimeError(f"{exc}\ncoordinator log {log}, last lines:\n{_tail(log)}") from None
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    latencies = sorted(x for r in results for x in r["batch_latencies"])
    return {
        "variant": variant.name,
        "workers": world,
        "nodes": sum(j["nodes"] for j in joined),
        "per_node": per_node,
        "wall_s": wall,
        "verified": sum(r["verified"] for r in results),
        "vouched": variant.requires_vouch(agents=True),  # each Register carried its agent's vouch
        "coordinator_cpu_s": cpu,
        "coordinator_peak_rss_kib": peak_rss_kib,
        "batch_p50_ms": 1000 * latencies[len(latencies) // 2] if latencies else None,
        "batch_p99_ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] if latencies else None,
        # The untimed setup: agent certificates issued, tokens minted, every agent connected and joined.
        "certs_s": certs_s,
        "setup_s": setup_s,
        "setup_coordinator_cpu_s": setup_cpu,
        "connections": sum(j["connections"] for j in joined),
        "fd_limit": fd_limit,
        "transport": transport,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fanin")
    parser.add_argument("--workers", type=int, default=100_000)
    parser.add_argument("--per-node", type=int, default=SLOTS_PER_NODE)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument(
        "--variant",
        type=Variant.parse,
        default=MEMORY_PLAINTEXT,
        help="memory+plaintext (default) or sqlite+mtls (the daemon's defaults)",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="meshgate-fanin-") as tmp:
        print(json.dumps(run_fan_in(args.workers, Path(tmp), args.per_node, args.processes, args.variant)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
