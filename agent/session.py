"""The agent's way to its coordinator: the one holder of the channel and its stubs.

``call`` is the asynchronous twin of meshgate/connection.py's ``Connection.call``: one unary
call; a coordinator that is unavailable moves the session on to the next of an HA list (the
leader a standby names, if any). Where Connection.call retries inside its timeout, the agent's
callers each have their own cadence to try again on (the heartbeats, the exit journal's
resends, the Join's backoff below), so ``call`` tries once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

import grpc

from meshgate import metrics
from meshgate.connection import Connection
from meshgate.endpoints import FAILOVER_CODES
from meshgate.v1 import nodes_pb2, nodes_pb2_grpc, rendezvous_pb2_grpc

log = logging.getLogger("meshgate.agent")

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
# A restarted coordinator must hear from its agents again within its heartbeat tolerance
# (else it declares their nodes lost): gRPC's default reconnect backoff grows to 120 s.
RECONNECT_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000))


class AgentError(RuntimeError):
    pass


class AgentStopped(AgentError):
    """SIGTERM while the agent was still trying to reach its coordinator: a clean stop."""


class CoordinatorSession:
    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.channel: Optional[grpc.aio.Channel] = None  # made inside the running loop
        self.nodes: Optional[nodes_pb2_grpc.NodesStub] = None
        self.rendezvous: Optional[rendezvous_pb2_grpc.RendezvousStub] = None

    @property
    def current(self) -> str:
        return self.connection.current

    def connect(self) -> None:
        self.channel = self.connection.channel(aio=True, options=RECONNECT_OPTIONS)
        self.nodes = nodes_pb2_grpc.NodesStub(self.channel)
        self.rendezvous = rendezvous_pb2_grpc.RendezvousStub(self.channel)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()

    async def call(self, method: str, request, timeout: float, wait_for_ready: bool = False):
        """One unary call of Nodes (or Rendezvous, for GetTrustBundle); an unavailable
        coordinator moves the session to the next before the error is raised."""
        stub = self.rendezvous if method == "GetTrustBundle" else self.nodes
        try:
            return await getattr(stub, method)(request, timeout=timeout, wait_for_ready=wait_for_ready or None)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in FAILOVER_CODES:
                await self.fail_over(exc)
            raise

    async def fail_over(self, error: grpc.RpcError) -> None:
        """Next coordinator of an HA list (the leader a standby names, if any)."""
        before = self.connection.current
        if self.connection.fail_over(error):
            log.warning("coordinator %s unavailable; trying %s", before, self.connection.current)
            await self.channel.close()
            self.connect()

    async def join(
        self, request: nodes_pb2.JoinRequest, token: str, timeout_s: float, stopping: asyncio.Event
    ) -> nodes_pb2.JoinResponse:
        """Join, retrying while the coordinator cannot be reached (for at most timeout_s);
        a credential it does not know falls back to ``token`` once (none: never)."""
        deadline = time.monotonic() + timeout_s
        delay = 0.2
        while True:
            try:
                joined = await self.call("Join", request, timeout=10)
                metrics.count_agent_join("OK")
                return joined
            except grpc.aio.AioRpcError as exc:
                metrics.count_agent_join(exc.code().name)
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED and request.node_credential and token:
                    # The coordinator does not know this credential (a new job or state):
                    # fall back to the token, once.
                    log.warning("node credential refused (%s); joining with the token", exc.details())
                    request.node_credential = b""
                    request.join_token = token
                    continue
                if exc.code() not in RETRYABLE or time.monotonic() > deadline:
                    raise AgentError(f"join refused: {exc.code().name}: {exc.details()}") from None
                log.info("coordinator %s not reachable yet (%s); retrying", self.current, exc.code().name)
            try:  # a SIGTERM ends the wait (systemd must not have to escalate to SIGKILL)
                await asyncio.wait_for(stopping.wait(), timeout=delay)
                raise AgentStopped(f"stopped while trying to reach the coordinator at {self.current}")
            except asyncio.TimeoutError:
                pass
            delay = min(delay * 2, 5.0)
