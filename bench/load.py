"""The load generator: P processes (spawned), each one grpc.aio event loop.

One harness for every server. Each simulated worker i:

1. builds the RegisterRequest meshgate.client.register sends (fresh 32-byte nonce, plan
   digest, generation, endpoint), sends it (to Register, or to the echo method),
2. parses the RegisterResponse and verifies the attestation exactly as a worker does
   (meshgate.attestation.verify_attestation: signature, expiry, job, generation, nonce,
   plan digest, coordinate),
3. optionally (``await_world``) then calls AwaitWorld and checks the World it gets.

``concurrency`` bounds the Register calls in flight per process. AwaitWorld calls go
through their own bound (``await_concurrency`` per process): a worker's AwaitWorld is
sent as soon as it has verified its attestation and an AwaitWorld slot is free. (Bounding
both with one pool would deadlock: the barrier holds every slot until the world is
complete.) The first ones wait on the barrier; once the world is complete the rest
return at once.

Channels use the transport the server announced (ServerProcess.client_tls): plaintext,
or mTLS with the worker certificate an agent hands its workers. A Register needs no
role under mTLS (coordinator/service.py checks roles on Nodes and Admin calls only): a
client certificate from the job's CA is what the handshake asks of a worker. Workers of
one process share its channels, as in plaintext, so the handshakes (one per channel)
happen while connecting, before the clock starts.

The parent releases all processes at once (after every channel is connected and warm),
and reads the server's CPU time and memory from /proc around the run.
"""

from __future__ import annotations

import array
import asyncio
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass
from typing import Optional

from meshgate.tls import TLSConfig

from bench.common import (
    AWAIT_METHOD,
    ECHO_METHOD,
    ECHO_NONCE,
    JOB,
    REGISTER_METHOD,
    SLOTS_PER_NODE,
    TRUST_METHOD,
    median,
    percentile,
    plan_for,
    proc_status,
    register_request,
    reset_peak_rss,
    worker_id,
)

MAX_ERRORS_KEPT = 5


@dataclass(frozen=True)
class LoadSpec:
    address: str
    kind: str  # "coordinator" or "echo"
    world: int
    first: int  # this process's workers: [first, first + count)
    count: int
    bundle_path: str
    concurrency: int = 256
    await_world: bool = False
    await_concurrency: int = 512
    channels: int = 1
    slots: int = SLOTS_PER_NODE
    rpc_timeout_s: float = 600.0
    tls: Optional[TLSConfig] = None  # None: plaintext


# ---- the child ------------------------------------------------------------------------------


def _child_main(spec: LoadSpec, conn, start_event) -> None:
    try:
        result = asyncio.run(_child(spec, conn, start_event))
    except BaseException as exc:  # report, never hang the parent
        conn.send({"fatal": f"{type(exc).__name__}: {exc}"})
        raise
    conn.send(result)
    conn.close()


async def _child(spec: LoadSpec, conn, start_event) -> dict:
    import grpc

    from meshgate.attestation import AttestationError, TrustBundle, verify_attestation
    from meshgate.tls import secure_channel
    from meshgate.v1 import attestation_pb2, rendezvous_pb2

    plan = plan_for(spec.world, spec.slots)
    digest = plan.digest()
    bundle = TrustBundle.load(spec.bundle_path)
    echo = spec.kind == "echo"

    channels = [
        secure_channel(
            spec.address,
            spec.tls,
            aio=True,
            # Separate channels must not share one subchannel (one TCP connection).
            options=[("grpc.use_local_subchannel_pool", 1), ("grpc.channel_index", k)],
        )
        for k in range(spec.channels)
    ]
    register_calls = [
        ch.unary_unary(
            ECHO_METHOD if echo else REGISTER_METHOD,
            request_serializer=rendezvous_pb2.RegisterRequest.SerializeToString,
            response_deserializer=rendezvous_pb2.RegisterResponse.FromString,
        )
        for ch in channels
    ]
    await_calls = [
        ch.unary_unary(
            AWAIT_METHOD,
            request_serializer=rendezvous_pb2.AwaitWorldRequest.SerializeToString,
            response_deserializer=rendezvous_pb2.World.FromString,
        )
        for ch in channels
    ]
    # Warm up every connection and the server's dispatch path, without taking a rank.
    for ch in channels:
        await asyncio.wait_for(ch.channel_ready(), timeout=60)
        if echo:
            warm = ch.unary_unary(
                ECHO_METHOD,
                request_serializer=rendezvous_pb2.RegisterRequest.SerializeToString,
                response_deserializer=rendezvous_pb2.RegisterResponse.FromString,
            )
            for _ in range(5):
                await warm(register_request(0, ECHO_NONCE, digest, spec.slots), timeout=30)
        else:
            warm = ch.unary_unary(
                TRUST_METHOD,
                request_serializer=rendezvous_pb2.GetTrustBundleRequest.SerializeToString,
                response_deserializer=attestation_pb2.TrustBundle.FromString,
            )
            for _ in range(5):
                await warm(rendezvous_pb2.GetTrustBundleRequest(job_id=JOB), timeout=30)

    conn.send({"ready": True})
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, start_event.wait)
    cpu0 = time.process_time()
    t_start = time.monotonic()

    latencies = array.array("d")
    errors: list[str] = []
    counts = {"registered": 0, "verified": 0, "errors": 0, "awaited": 0, "request_bytes": 0, "response_bytes": 0}
    indices = iter(range(spec.first, spec.first + spec.count))
    queue: asyncio.Queue = asyncio.Queue()

    def failed(message: str) -> None:
        counts["errors"] += 1
        if len(errors) < MAX_ERRORS_KEPT:
            errors.append(message)

    async def registrar(k: int) -> None:
        call = register_calls[k % len(register_calls)]
        for i in indices:
            nonce = os.urandom(32)
            request = register_request(i, nonce, digest, spec.slots)
            t = time.monotonic()
            try:
                reply = await call(request, timeout=spec.rpc_timeout_s)
            except grpc.aio.AioRpcError as exc:
                failed(f"Register {i}: {exc.code().name}: {exc.details()}")
                continue
            latencies.append(time.monotonic() - t)
            counts["registered"] += 1
            try:
                verified = verify_attestation(
                    reply.attestation,
                    bundle,
                    job_id=JOB,
                    nonce=ECHO_NONCE if echo else nonce,
                    generation=0,
                    plan=plan,
                )
            except AttestationError as exc:
                failed(f"verify {i}: {type(exc).__name__}: {exc}")
                continue
            if not echo and (verified.worker_id != worker_id(i, spec.slots) or verified.local_rank != i % spec.slots):
                failed(f"worker {i}: attested as {verified.worker_id} local {verified.local_rank}")
                continue
            counts["verified"] += 1
            if counts["verified"] == 1:
                counts["request_bytes"] = request.ByteSize()
                counts["response_bytes"] = reply.ByteSize()
            if spec.await_world:  # AwaitWorld answers a worker of the job: its id and heartbeat secret
                queue.put_nowait((verified.generation, verified.worker_id, reply.heartbeat_secret))

    async def awaiter(k: int) -> None:
        call = await_calls[k % len(await_calls)]
        while True:
            asked = await queue.get()
            if asked is None:
                return
            generation, worker, secret = asked
            request = rendezvous_pb2.AwaitWorldRequest(
                job_id=JOB,
                generation=generation,
                timeout_ms=int(spec.rpc_timeout_s * 1000),
                worker_id=worker,
                heartbeat_secret=secret,
            )
            try:
                world = await call(request, timeout=spec.rpc_timeout_s + 5)
            except grpc.aio.AioRpcError as exc:
                failed(f"AwaitWorld: {exc.code().name}: {exc.details()}")
                continue
            if world.world_size != spec.world or world.plan_digest != digest:
                failed(f"AwaitWorld: world_size {world.world_size}, digest mismatch {world.plan_digest != digest}")
                continue
            counts["awaited"] += 1

    awaiters = []
    if spec.await_world:
        awaiters = [asyncio.create_task(awaiter(k)) for k in range(min(spec.await_concurrency, spec.count))]
    await asyncio.gather(*(registrar(k) for k in range(min(spec.concurrency, spec.count))))
    t_registered = time.monotonic()
    for _ in awaiters:
        queue.put_nowait(None)
    await asyncio.gather(*awaiters)
    t_end = time.monotonic()
    cpu = time.process_time() - cpu0
    for ch in channels:
        await ch.close()
    return {
        "t_start": t_start,
        "t_registered": t_registered,
        "t_end": t_end,
        "client_cpu_s": cpu,
        "latencies": latencies.tobytes(),
        "errors_kept": errors,
        **counts,
    }


# ---- the parent -------------------------------------------------------------------------------


class _RssSampler(threading.Thread):
    """Samples the server's VmRSS every ``interval`` seconds (a cross-check of VmHWM)."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak_kib = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                self.peak_kib = max(self.peak_kib, proc_status(self.pid)["VmRSS"])
            except (OSError, KeyError):
                return
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def _receive(conn, process) -> dict:
    try:
        return conn.recv()
    except EOFError:
        process.join(timeout=5)
        raise RuntimeError(f"a load process died (exit code {process.exitcode})") from None


def run_load(
    server,
    kind: str,
    world: int,
    *,
    procs: int,
    concurrency: int,
    await_world: bool = False,
    await_concurrency: int = 512,
    channels: int = 1,
    slots: int = SLOTS_PER_NODE,
    timeout_s: float = 900.0,
) -> dict:
    """Drive ``world`` simulated workers at ``server`` (a bench.servers.ServerProcess);
    return the figures of the run."""
    ctx = mp.get_context("spawn")
    start_event = ctx.Event()
    procs = max(1, min(procs, world))
    bounds = [world * p // procs for p in range(procs + 1)]
    children = []
    for p in range(procs):
        spec = LoadSpec(
            address=server.address,
            kind=kind,
            world=world,
            first=bounds[p],
            count=bounds[p + 1] - bounds[p],
            bundle_path=server.bundle_path,
            concurrency=concurrency,
            await_world=await_world,
            await_concurrency=await_concurrency,
            channels=channels,
            slots=slots,
            tls=server.client_tls,
        )
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        process = ctx.Process(target=_child_main, args=(spec, child_conn, start_event), daemon=True)
        process.start()
        child_conn.close()
        children.append((process, parent_conn))
    try:
        for process, conn in children:
            if not conn.poll(120):
                raise RuntimeError("a load process did not get ready in 120 s")
            message = _receive(conn, process)
            if "fatal" in message:
                raise RuntimeError(f"load process failed: {message['fatal']}")

        before = server.status()
        cpu0 = server.cpu_s()
        hwm_reset = reset_peak_rss(server.pid)
        if hwm_reset:
            before = server.status()
        sampler = _RssSampler(server.pid)
        sampler.start()
        t0 = time.monotonic()
        start_event.set()

        results = []
        deadline = t0 + timeout_s
        for process, conn in children:
            if not conn.poll(max(1.0, deadline - time.monotonic())):
                raise TimeoutError(f"load did not finish in {timeout_s:g}s")
            message = _receive(conn, process)
            if "fatal" in message:
                raise RuntimeError(f"load process failed: {message['fatal']}")
            results.append(message)
        after = server.status()
        cpu1 = server.cpu_s()
        sampler.stop()
    finally:
        for process, _conn in children:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()

    latencies = array.array("d")
    for r in results:
        chunk = array.array("d")
        chunk.frombytes(r["latencies"])
        latencies.extend(chunk)
    ordered = sorted(latencies)

    def total(key: str):
        return sum(r[key] for r in results)

    t_registered = max(r["t_registered"] for r in results)
    t_end = max(r["t_end"] for r in results)
    register_wall = t_registered - t0
    wall = t_end - t0
    server_cpu = cpu1 - cpu0
    peak_hwm = after.get("VmHWM", 0) if hwm_reset else 0
    peak_kib = max(peak_hwm, sampler.peak_kib, after.get("VmRSS", 0))
    calls = total("registered") + total("awaited")
    return {
        "kind": kind,
        "world": world,
        # What the server answered to each kind of client (bench.servers.transport_check).
        "transport": server.transport,
        "procs": procs,
        "concurrency_per_proc": concurrency,
        "await_concurrency_per_proc": await_concurrency if await_world else 0,
        "channels_per_proc": channels,
        "await_world": await_world,
        "registered": total("registered"),
        "verified": total("verified"),
        "awaited": total("awaited"),
        "errors": total("errors"),
        "errors_kept": [e for r in results for e in r["errors_kept"]][:MAX_ERRORS_KEPT],
        "request_bytes": max(r["request_bytes"] for r in results),
        "response_bytes": max(r["response_bytes"] for r in results),
        "wall_s": wall,
        "register_wall_s": register_wall,
        "register_per_s": total("verified") / register_wall if register_wall > 0 else None,
        "wall_per_worker_us": wall / world * 1e6,
        "latency_p50_ms": percentile(ordered, 50) * 1e3,
        "latency_p99_ms": percentile(ordered, 99) * 1e3,
        "latency_max_ms": (ordered[-1] * 1e3) if ordered else None,
        "latency_mean_ms": (sum(ordered) / len(ordered) * 1e3) if ordered else None,
        "server_cpu_s": server_cpu,
        "server_cpu_per_call_us": server_cpu / calls * 1e6 if calls else None,
        "server_cpu_per_worker_us": server_cpu / world * 1e6,
        "server_cpu_utilisation": server_cpu / wall if wall > 0 else None,
        "client_cpu_s": total("client_cpu_s"),
        "client_cpu_per_worker_us": total("client_cpu_s") / world * 1e6,
        "rss_before_kib": before.get("VmRSS"),
        "rss_after_kib": after.get("VmRSS"),
        "rss_peak_kib": peak_kib,
        "rss_peak_method": "VmHWM after clear_refs" if hwm_reset else "VmRSS sampled every 50 ms",
        "rss_peak_per_worker_kib": (peak_kib - before.get("VmRSS", 0)) / world,
        "rss_retained_per_worker_kib": (after.get("VmRSS", 0) - before.get("VmRSS", 0)) / world,
        "server_threads": after.get("Threads"),
    }


def summarise_runs(runs: list[dict], key: str) -> Optional[float]:
    values = [r[key] for r in runs if r.get(key) is not None]
    return median(values) if values else None
