"""Agent fan-in: the node agent serves the Rendezvous API on a node-local Unix socket
and forwards its workers' Registers to the coordinator in batches, one RegisterBatch
per short window. The coordinator signs each batch once: every worker gets its own
attestation (its nonce, its rank) with the signed batch attached, and verifies both
the signature and that its attestation is an entry of the batch. The coordinator sees
one call and makes one signature per node per window instead of one per worker.

The socket is mode 0660. A Register must carry a vouch this agent signed (checked here
with the node key), so only workers the agent launched, or that got a vouch from its
SO_PEERCRED-checked vouch socket, get through. AwaitWorld is coalesced: one upstream
call per generation serves every local waiter.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Optional

import grpc

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


async def serve_fan_in(agent, path: Path) -> tuple[grpc.aio.Server, FanInServicer]:
    path.unlink(missing_ok=True)
    server = grpc.aio.server(options=[("grpc.server.max_pending_requests", 1_000_000)])
    servicer = FanInServicer(agent)
    rendezvous_pb2_grpc.add_RendezvousServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    os.chmod(path, 0o660)  # the node's training user (group) only
    log.info("fan-in: serving Register on unix:%s", path)
    return server, servicer
