"""Worker exits to the coordinator: journalled first (agent/exits.py), then sent; what is not
acknowledged is resent (beside the heartbeats, at a restart, before a Join) until it is.

The coordinator is idempotent per (job, generation, node, local rank), so a resend changes
nothing the second time; one exit is never on its way twice at once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Optional

import grpc

from meshgate.agent.exits import HOLD_REPORTS_ENV, ExitJournal, PendingExit, reports_held
from meshgate.v1 import nodes_pb2

log = logging.getLogger("meshgate.agent")

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}

# call(method, request, timeout, wait_for_ready) -> the answer: the coordinator session's.
Call = Callable[..., Awaitable[nodes_pb2.ReportExitResponse]]


class Reporter:
    def __init__(self, journal: ExitJournal, call: Call, credential: Callable[[], bytes]) -> None:
        self.exits = journal
        self.call = call
        self.credential = credential
        self.heartbeat_interval_s = 5.0  # the coordinator's, from the first Join
        self.in_flight: set[str] = set()  # journal names being sent now: never twice at once
        self.resending: Optional["asyncio.Task[bool]"] = None  # the heartbeat loop's resend, if running

    async def report(self, pending: PendingExit) -> Optional[nodes_pb2.ReportExitResponse]:
        """Journal one exit and send it: the coordinator's answer, or None while it is
        not acknowledged (it stays in the journal and is sent again)."""
        try:
            self.exits.record(pending)
        except OSError as exc:  # a full or broken state dir must not stop the report itself
            log.error(
                "exit journal %s: %s; sending the exit of local %d unjournalled",
                self.exits.directory,
                exc,
                pending.local_rank,
            )
        return await self.send(pending)

    async def send(self, pending: PendingExit) -> Optional[nodes_pb2.ReportExitResponse]:
        """One try at reporting a journalled exit: the answer acknowledges it (taken off
        the journal). Waits for the channel to be ready (a reconnect backoff is not a
        refusal); an unreachable coordinator leaves it pending, a refusal drops it.
        The coordinator may hold a failure up to its heartbeat tolerance before it
        decides (a lost node is named, not this worker), so the wait allows for that."""
        timeout_s = max(5.0, 5 * self.heartbeat_interval_s)
        if reports_held():
            log.warning("%s: exit of local %d journalled, not sent", HOLD_REPORTS_ENV, pending.local_rank)
            return None
        if pending.name in self.in_flight:
            return None  # already on its way; it stays journalled until that send is answered
        self.in_flight.add(pending.name)
        try:
            reply = await self.call(
                "ReportExit",
                nodes_pb2.WorkerExitReport(
                    job_id=pending.job_id,
                    node_id=pending.node_id,
                    local_rank=pending.local_rank,
                    exit_code=pending.exit_code,
                    generation=pending.generation,
                    stopped_by_agent=pending.stopped_by_agent,
                    start_failed=pending.start_failed,
                    detail=pending.detail,
                    log_tail=pending.log_tail,
                    node_credential=self.credential(),
                ),
                timeout=timeout_s,
                wait_for_ready=True,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in RETRYABLE:
                log.warning(
                    "exit of local %d (job %s, generation %d) not acknowledged yet: %s; kept to resend",
                    pending.local_rank,
                    pending.job_id,
                    pending.generation,
                    exc.code().name,
                )
                return None
            log.error(
                "exit of local %d (job %s) refused: %s: %s; dropped from the journal",
                pending.local_rank,
                pending.job_id,
                exc.code().name,
                exc.details(),
            )
            self.exits.acknowledge(pending)
            return None
        finally:
            self.in_flight.discard(pending.name)
        self.exits.acknowledge(pending)
        return reply

    async def flush(self) -> bool:
        """Resend every exit still pending (after a reconnect, each heartbeat cycle, a
        restart). True when none is left."""
        left = False
        for pending in self.exits.pending():
            if await self.send(pending) is not None:
                log.info(
                    "exit of local %d (job %s, generation %d, exit %d) acknowledged on resend",
                    pending.local_rank,
                    pending.job_id,
                    pending.generation,
                    pending.exit_code,
                )
            elif self.exits.holds(pending):
                left = True
        return not left

    def resend_beside(self) -> None:
        """The heartbeat loop's turn: resend what is pending, beside the heartbeats and
        never in their way (a resend may wait seconds); one resend at a time."""
        if self.exits.pending() and (self.resending is None or self.resending.done()):
            self.resending = asyncio.ensure_future(self.flush())

    async def settle(self) -> None:
        """Before this node joins a job: every pending exit sent once more (waiting for a
        resend the heartbeat loop has under way), so a job they end is not joined."""
        if self.resending is not None and not self.resending.done():
            await self.resending
        await self.flush()

    def close(self) -> None:
        if self.resending is not None:
            self.resending.cancel()  # what it had not sent stays journalled
