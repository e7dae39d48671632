"""Agent fan-in: the node agent serves the Rendezvous API on a node-local Unix socket
and forwards its workers' Registers to the coordinator in batches, one RegisterBatch
per short window. The coordinator signs each batch once: every worker gets its own
attestation (its nonce, its rank) with the signed batch attached, and verifies both
the signature and that its attestation is an entry of the batch. The coordinator sees
one call and makes one signature per node per window instead of one per worker.

The socket is mode 0660, and each connection's caller is checked as the vouch socket's
is (SO_PEERCRED pid and uid, the agent's check_caller: while a job run is on the node,
only a process of its unit) by a front (agent/peer_front.py) that splices an allowed
connection to the gRPC server on a private socket, since gRPC hides the peer: a vouch
read out of another job's /proc environ is no use from outside that job. A Register must
also carry a vouch this agent signed (checked here with the node key), so only workers
the agent launched, or that got a vouch from its SO_PEERCRED-checked vouch socket, get
through. AwaitWorld is coalesced: one upstream
call per generation serves every local waiter.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from pathlib import Path
from typing import Callable, Optional

import grpc

from meshgate.agent.peer_front import PeerCheckedFront
from meshgate.attestation import AttestationError, verify_vouch, with_batch
from meshgate.v1 import nodes_pb2, rendezvous_pb2, rendezvous_pb2_grpc

log = logging.getLogger("meshgate.agent")


class FanInServicer(rendezvous_pb2_grpc.RendezvousServicer):
    def __init__(self, agent, *, window_s: float = 0.005, max_batch: int = 2048) -> None:
        self.agent = agent
        self.window_s = window_s
        self.max_batch = max_batch
        self._pending: list[tuple[rendezvous_pb2.RegisterRequest, asyncio.Future]] = []
        self._flusher: Optional[asyncio.Task] = None
        # One AwaitWorld in flight per (job, generation, include_members): the job is part of
        # the key, or a node's next job at the same generation would get its last job's world.
        self._worlds: dict[tuple[str, int, bool], asyncio.Future] = {}
        self.batches_sent = 0
        self.forwarded = 0

    # ---- Register: check the vouch here, forward in batches -----------------------------

    async def Register(self, request, context):
        refusal = self._check_locally(request)
        if refusal is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        future = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush_soon())
        result = await future
        if result.HasField("refusal"):
            await context.abort(getattr(grpc.StatusCode, result.refusal.code), result.refusal.message)
        return rendezvous_pb2.RegisterResponse(attestation=result.attestation, heartbeat_secret=result.heartbeat_secret)

    def _check_locally(self, request) -> Optional[str]:
        agent = self.agent
        if request.node_id != agent.config.node_id:
            return f"this agent serves node {agent.config.node_id!r}, not node_id {request.node_id!r}"
        mode = request.WhichOneof("mode")
        local_rank = request.claimed.local_rank if mode == "claimed" else request.assigned.local_rank
        rank = request.claimed.rank if mode == "claimed" else None
        try:
            verify_vouch(
                request.vouch,
                agent.identity.public_key,
                job_id=agent.job_id,
                node_id=agent.config.node_id,
                generation=agent.generation,
                local_rank=local_rank,
                now=time.time(),
                rank=rank,
            )
        except AttestationError as exc:
            return f"worker_id {request.worker_id!r}: {exc}"
        return None

    async def _flush_soon(self) -> None:
        while self._pending:
            await asyncio.sleep(self.window_s)
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
            asyncio.ensure_future(self._send(batch))

    async def _send(self, batch) -> None:
        agent = self.agent
        message = nodes_pb2.RegisterBatchRequest(
            job_id=agent.job_id,
            node_id=agent.config.node_id,
            node_credential=agent.credential,
            one_signature=True,
        )
        message.requests.extend(request for request, _ in batch)
        try:
            reply = await agent.nodes.RegisterBatch(message, timeout=60)
            self.batches_sent += 1
            self.forwarded += len(batch)
            results = list(reply.results)
            for result in results:
                if result.HasField("attestation"):  # each worker verifies the one batch signature
                    result.attestation.CopyFrom(with_batch(result.attestation, reply.batch))
        except grpc.aio.AioRpcError as exc:
            failed = nodes_pb2.RegisterResult(
                refusal=nodes_pb2.Refusal(code=exc.code().name, message=exc.details() or "")
            )
            results = [failed] * len(batch)
        for (_, future), result in zip(batch, results):
            if not future.done():
                future.set_result(result)

    # ---- the rest: coalesced or proxied -------------------------------------------------

    async def AwaitWorld(self, request, context):
        if request.job_id != self.agent.job_id:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"this node serves job {self.agent.job_id or '(none)'!r}, not job_id {request.job_id[:64]!r}",
            )
        key = (request.job_id, request.generation, request.include_members)
        if any(k[0] != request.job_id for k in self._worlds):
            self._worlds = {k: f for k, f in self._worlds.items() if k[0] == request.job_id}  # an ended job's
        shared = self._worlds.get(key)
        if shared is None or shared.done() and shared.exception() is not None:
            shared = asyncio.ensure_future(
                self.agent.rendezvous.AwaitWorld(
                    request, timeout=request.timeout_ms / 1000 + 5 if request.timeout_ms else None
                )
            )
            self._worlds[key] = shared
        try:
            return await asyncio.shield(shared)
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "")

    async def Heartbeat(self, request, context):
        try:
            return await self.agent.rendezvous.Heartbeat(request, timeout=10)
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "")

    async def GetTrustBundle(self, request, context):
        try:
            return await self.agent.rendezvous.GetTrustBundle(request, timeout=10)
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "")


class FanInServer:
    """The fan-in as served: the gRPC server on its private socket, and the front that
    checks each caller on the public one (agent/peer_front.py)."""

    def __init__(self, server: grpc.aio.Server, front: PeerCheckedFront, private_dir: Path) -> None:
        self.server = server
        self.front = front
        self.private_dir = private_dir

    async def stop(self, grace: Optional[float] = None) -> None:
        self.front.stop_listening()
        try:
            await self.server.stop(grace)  # reaches the open connections through the front
        finally:
            self.front.close()
            await asyncio.sleep(0)  # the closed transports let their sockets go
            try:
                (self.private_dir / PRIVATE_SOCKET).unlink(missing_ok=True)
                self.private_dir.rmdir()
            except OSError:
                pass


PRIVATE_SOCKET = "grpc"


def private_dir_for(path: Path) -> Path:
    """Where the fan-in's gRPC server listens: a 0700 directory of the agent's next to
    the public socket (a name barely longer than the public one, as a Unix socket path
    holds at most 107 bytes).

    Not an abstract socket: an abstract name has no permission check at all (any process
    in the network namespace may connect) and /proc/net/unix lists it to everyone, so a
    random name hides nothing. A socket file is reached only through a search (x) right on
    every directory of its path, which the kernel checks against the caller; in a 0700
    directory the agent owns that is the agent's uid (and root) alone. The job user cannot
    make or replace this directory either: the state dir is the agent's, 0700 or 0711."""
    return path.with_name(f".{path.stem}")


def _make_private_dir(directory: Path) -> None:
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise RuntimeError(f"{directory} must be a directory of the agent's uid {os.geteuid()} (not a link)")
    os.chmod(directory, 0o700)  # an earlier run's directory with a looser mode is fixed
    (directory / PRIVATE_SOCKET).unlink(missing_ok=True)


async def serve_fan_in(
    agent, path: Path, *, check_caller: Callable[[int, int], Optional[str]]
) -> tuple[FanInServer, FanInServicer]:
    """Serve the fan-in on ``path`` (mode 0660): every connection's caller, per SO_PEERCRED,
    must pass ``check_caller(pid, uid)`` (the vouch socket's check) before its bytes reach
    the gRPC server, which listens only on a private socket in a 0700 directory."""
    private_dir = private_dir_for(path)
    _make_private_dir(private_dir)
    private = private_dir / PRIVATE_SOCKET
    if len(os.fsencode(private)) > 107:
        raise RuntimeError(f"the fan-in's private socket path {private} is longer than a Unix socket path may be")
    server = grpc.aio.server(options=[("grpc.server.max_pending_requests", 1_000_000)])
    servicer = FanInServicer(agent)
    rendezvous_pb2_grpc.add_RendezvousServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix:{private}")
    await server.start()
    front = PeerCheckedFront(path, private, check_caller, name="fan-in")
    try:
        await front.start(0o660)  # the node's training user (group) only
    except BaseException:
        await server.stop(None)
        raise
    log.info("fan-in: serving Register on unix:%s", path)
    log.debug("fan-in: each caller checked, then spliced to gRPC on unix:%s", private)
    return FanInServer(server, front, private_dir), servicer
