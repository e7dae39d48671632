"""Job logs, relayed (``meshgate job logs``): the workers' output stays on their nodes
(agent/worker_logs.py); a reader's JobLogs call asks each node concerned, the node's next
heartbeat answer carries the request (NodeHeartbeatResponse.log_requests), and its agent
answers with PushLogs calls, bounded chunks that this relay hands to the reader's stream.
No port opens on a node: the agent's own channel to the coordinator carries both ways.

Bounded everywhere: a chunk is at most ``MAX_CHUNK_BYTES``; a reader's queue holds
``QUEUE_CHUNKS`` chunks, and a PushLogs waits (at most ``PUSH_WAIT_S``) while the reader
is slow, so an agent never outruns its reader; a node has at most ``MAX_OPEN_PER_NODE``
requests open (no more than its agent answers at once, agent/worker_logs.py MAX_SERVING), and
the readers of one submitter at most ``MAX_OPEN_PER_READER`` of them, so that twenty followers
of one submitter's job leave the others room to read their own jobs' output on that node. A
node pushes only output of the ranks it holds in the job's world (and was asked for).
A node that does not pick a request up within the heartbeat tolerance,
or goes silent mid-answer, is named to the reader and the stream goes on without it.
Who may read (the job's owner or an admin) is checked before anything is asked.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Mapping, Optional

from meshgate.coordinator.jobs import Job, JobState
from meshgate.wire import LOG_RELAY_WIRE, PeerVersion, agent_lacks
from meshgate.coordinator.rendezvous import Code, RendezvousError, shown
from meshgate.coordinator.rendezvous.model import MAX_LOG_TAIL
from meshgate.v1 import nodes_pb2, rendezvous_pb2

MAX_CHUNK_BYTES = 64 << 10
MAX_NOTICE = 300
MAX_TAIL_LINES = 100_000
MAX_OPEN_PER_NODE = 8
# Of a node's requests open, those of one reader (as a job records its owner, e.g.
# "submitter:alice"): half, so a second reader always finds room.
MAX_OPEN_PER_READER = MAX_OPEN_PER_NODE // 2
QUEUE_CHUNKS = 16
PUSH_WAIT_S = 30.0
SILENT_S = 20.0  # a node answering a request that sends nothing this long has stopped (agents keep alive every 2 s)
TICK_S = 0.5

Write = Callable[[rendezvous_pb2.JobLogsChunk], Awaitable[None]]


@dataclass
class Reader:
    """One JobLogs call: what its nodes pushed, in order, and whether it went away."""

    queue: "asyncio.Queue[rendezvous_pb2.JobLogsChunk | str]" = field(
        default_factory=lambda: asyncio.Queue(QUEUE_CHUNKS)
    )
    gone: bool = False


class LogSlotsTaken(RendezvousError):
    """A read past a node's log request limit, or past one reader's share of it."""

    def __init__(self, message: str) -> None:
        super().__init__(Code.RESOURCE_EXHAUSTED, message)


class RankNotHeld(RendezvousError):
    """A node's push of output of a rank it does not hold (or was not asked for)."""

    def __init__(self, node_id: str, rank: int, job_id: str, ranks: "range | list[int]") -> None:
        held = f"{ranks.start}-{ranks.stop - 1}" if isinstance(ranks, range) and ranks else ", ".join(map(str, ranks))
        super().__init__(
            Code.PERMISSION_DENIED,
            f"node {shown(node_id)} pushed output of rank {rank} of job {shown(job_id)}, which it does not hold "
            f"(it was asked for ranks: {held or 'none'}): a node pushes only its own ranks' output",
        )


def check_room(open_asks: "list[Asked]", node_id: str, owner: str) -> None:
    """LogSlotsTaken naming the limit unless ``node_id`` can take one more request, and
    ``owner``'s readers hold less than their share of its requests."""
    on_node = [a for a in open_asks if a.node_id == node_id]
    if len(on_node) >= MAX_OPEN_PER_NODE:
        raise LogSlotsTaken(
            f"node {node_id!r} already answers {len(on_node)} log requests (at most {MAX_OPEN_PER_NODE}); "
            "try again later"
        )
    mine = sum(1 for a in on_node if a.owner == owner)
    if mine >= MAX_OPEN_PER_READER:
        raise LogSlotsTaken(
            f"{shown(owner or '(anonymous)')} already reads {mine} log streams from node {node_id!r} (at most "
            f"{MAX_OPEN_PER_READER} of its {MAX_OPEN_PER_NODE}, so that others can read theirs): end a "
            "follow (job logs -f) first",
        )


def node_ranks(status: rendezvous_pb2.Status) -> dict[str, range]:
    """Each node's block of ranks in the job's current world (a spare's is empty)."""
    return {
        n.node_id: range(n.first_rank, n.first_rank + n.slots) if n.node_rank >= 0 else range(0) for n in status.nodes
    }


@dataclass
class Asked:
    """One node's part of a reader's call."""

    node_id: str
    request: nodes_pb2.LogRequest
    reader: Reader
    asked_at: float
    ranks: "range | list[int]"  # what the node may push: the ranks asked, else its block of the world
    owner: str = ""  # who reads (a caller's owner string), for the per-reader limit
    heard_at: Optional[float] = None  # picked up (then each push)


class LogRelay:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.waiting: dict[str, list[Asked]] = {}  # node -> asked, not yet picked up
        self.open: dict[str, Asked] = {}  # request id -> asked, until done or its reader left

    def take(self, node_id: str) -> list[nodes_pb2.LogRequest]:
        """The requests a node's (authenticated) heartbeat answer carries to its agent."""
        picked = self.waiting.pop(node_id, [])
        for asked in picked:
            asked.heard_at = self.clock()
        return [asked.request for asked in picked if not asked.reader.gone]

    async def push(self, node_id: str, request: nodes_pb2.PushLogsRequest) -> bool:
        """An agent's chunk (its credential already checked) to its reader; True: stop."""
        if len(request.data) > MAX_CHUNK_BYTES:
            raise RendezvousError(
                Code.INVALID_ARGUMENT, f"data is {len(request.data)} bytes; at most {MAX_CHUNK_BYTES} per PushLogs"
            )
        if not 0 < len(request.request_id) <= 64:
            raise RendezvousError(
                Code.INVALID_ARGUMENT, f"request_id {shown(request.request_id)} is not one a LogRequest carried"
            )
        if len(request.notice) > MAX_NOTICE:
            raise RendezvousError(
                Code.INVALID_ARGUMENT, f"notice is {len(request.notice)} characters; at most {MAX_NOTICE}"
            )
        asked = self.open.get(request.request_id)
        if asked is None or asked.node_id != node_id:
            # Not an error an agent can fix: its reader left (or this coordinator restarted).
            return True
        if request.data and request.rank not in asked.ranks:
            raise RankNotHeld(node_id, request.rank, asked.request.job_id, asked.ranks)
        asked.heard_at = self.clock()
        reader = asked.reader
        if reader.gone:
            self.open.pop(request.request_id, None)
            return True
        try:
            if request.data or request.notice:
                chunk = rendezvous_pb2.JobLogsChunk(
                    node_id=node_id, rank=request.rank, data=request.data, notice=request.notice
                )
                await asyncio.wait_for(reader.queue.put(chunk), PUSH_WAIT_S)
            if request.done:
                self.open.pop(request.request_id, None)
                await asyncio.wait_for(reader.queue.put(request.request_id), PUSH_WAIT_S)
        except asyncio.TimeoutError:
            reader.gone = True  # it stopped reading: its nodes are told to stop
        asked.heard_at = self.clock()  # a push held back by a slow reader is no silence of the node's
        return reader.gone

    def ask(
        self,
        reader: Reader,
        node_id: str,
        job_id: str,
        ranks: list[int],
        tail: int,
        follow: bool,
        held: range,
        owner: str,
    ) -> Asked:
        """Ask ``node_id`` for ``ranks`` (empty: all it keeps; ``held``: its block)."""
        check_room(list(self.open.values()), node_id, owner)
        request = nodes_pb2.LogRequest(
            request_id=secrets.token_hex(8), job_id=job_id, ranks=ranks, tail_lines=tail, follow=follow
        )
        asked = Asked(node_id, request, reader, self.clock(), [r for r in ranks if r in held] if ranks else held, owner)
        self.open[request.request_id] = asked
        self.waiting.setdefault(node_id, []).append(asked)
        return asked

    def _forget(self, reader: Reader) -> None:
        reader.gone = True
        for request_id in [r for r, a in self.open.items() if a.reader is reader]:
            del self.open[request_id]
        for node_id in list(self.waiting):
            self.waiting[node_id] = [a for a in self.waiting[node_id] if a.reader is not reader]
            if not self.waiting[node_id]:
                del self.waiting[node_id]

    async def relay(
        self,
        request: rendezvous_pb2.JobLogsRequest,
        parts: list[tuple[str, list[int]]],
        write: Write,
        pickup_s: float,
        status: rendezvous_pb2.Status,
        owner: str,
        agents: Optional[Mapping[str, PeerVersion]] = None,
    ) -> None:
        """Ask every node of ``parts`` (node, its ranks wanted) and write what they push,
        until each has sent all (or was named as not answering). ``status``: the job's
        world now (which ranks each node holds); ``owner``: who reads; ``agents``: each
        node's agent version: one too old to keep its workers' output is named at once
        (not asked, and then waited for in vain)."""
        reader = Reader()
        held = node_ranks(status)
        lacking = {node: agent_lacks("job logs", LOG_RELAY_WIRE, node, (agents or {}).get(node)) for node, _ in parts}
        for node, why in lacking.items():
            if why is not None:
                await write(rendezvous_pb2.JobLogsChunk(node_id=node, notice=why[:MAX_NOTICE]))
        parts = [(node, ranks) for node, ranks in parts if lacking[node] is None]
        try:
            asks = [
                self.ask(
                    reader,
                    node,
                    request.job_id,
                    ranks,
                    request.tail_lines,
                    request.follow,
                    held.get(node, range(0)),
                    owner,
                )
                for node, ranks in parts
            ]
            pending = {asked.request.request_id: asked for asked in asks}
            while pending:
                try:
                    item = await asyncio.wait_for(reader.queue.get(), TICK_S)
                except asyncio.TimeoutError:
                    for asked in [a for a in pending.values() if self._silent(a, pickup_s)]:
                        del pending[asked.request.request_id]
                        await write(
                            rendezvous_pb2.JobLogsChunk(node_id=asked.node_id, notice=self._why(asked, pickup_s))
                        )
                    continue
                if isinstance(item, str):
                    pending.pop(item, None)
                else:
                    await write(item)
        finally:
            self._forget(reader)

    def _silent(self, asked: Asked, pickup_s: float) -> bool:
        if asked.heard_at is None:
            return self.clock() - asked.asked_at > pickup_s
        return self.clock() - asked.heard_at > max(SILENT_S, pickup_s)

    def _why(self, asked: Asked, pickup_s: float) -> str:
        if asked.heard_at is None:
            return (
                f"node {asked.node_id} did not pick the request up within {pickup_s:.0f}s "
                "(its agent is not heartbeating: see meshgate nodes)"
            )
        return f"node {asked.node_id} stopped answering (its agent went away mid-answer)"


def check_exit_tail(log_tail: str) -> None:
    """A WorkerExitReport's log_tail is bounded (agents send at most 20 lines, 4 KiB)."""
    if len(log_tail.encode()) > MAX_LOG_TAIL:
        raise RendezvousError(
            Code.INVALID_ARGUMENT, f"log_tail is {len(log_tail.encode())} bytes; at most {MAX_LOG_TAIL}"
        )


def log_targets(
    job: Job, status: rendezvous_pb2.Status, request: rendezvous_pb2.JobLogsRequest
) -> list[tuple[str, list[int]]]:
    """The nodes to ask, each with the ranks wanted of it (empty: all it keeps): one
    rank's node, one node, or every node of the job. INVALID_ARGUMENT naming the field
    for a rank or node the job does not have; FAILED_PRECONDITION for a job whose
    workers no agent launched or that has not run yet."""
    job_id = request.job_id
    if request.tail_lines > MAX_TAIL_LINES:
        raise RendezvousError(Code.INVALID_ARGUMENT, f"tail_lines {request.tail_lines} is more than {MAX_TAIL_LINES}")
    if request.HasField("rank") and request.node_id:
        raise RendezvousError(Code.INVALID_ARGUMENT, "rank and node_id: give one of them, not both")
    if not job.spec.command:
        raise RendezvousError(
            Code.FAILED_PRECONDITION,
            f"job {job_id!r} has no command: its workers were not started by meshgate agents, so no agent "
            "keeps their output (read it where they run, e.g. ray job logs)",
        )
    if job.state is JobState.PENDING:
        raise RendezvousError(Code.FAILED_PRECONDITION, f"job {job_id!r} is PENDING: no worker of it has run yet")
    placed = [n for n in status.nodes if n.node_rank >= 0]
    world = job.spec.plan.world_size
    if request.HasField("rank"):
        rank = request.rank
        if rank >= world:
            raise RendezvousError(
                Code.INVALID_ARGUMENT,
                f"rank {rank} is not a rank of job {job_id!r} (world size {world}: ranks 0-{world - 1})",
            )
        holder = next((n for n in placed if n.first_rank <= rank < n.first_rank + n.slots), None)
        if holder is None:
            raise RendezvousError(Code.FAILED_PRECONDITION, f"rank {rank} of job {job_id!r} has no node (yet)")
        return [(holder.node_id, [rank])]
    if request.node_id:
        if not any(n.node_id == request.node_id for n in status.nodes):
            known = ", ".join(n.node_id for n in status.nodes) or "none yet"
            raise RendezvousError(
                Code.INVALID_ARGUMENT,
                f"node_id {shown(request.node_id)} is not a node of job {job_id!r} (its nodes: {known})",
            )
        return [(request.node_id, [])]
    return [(n.node_id, []) for n in placed]


__all__ = [
    "LogRelay",
    "LogSlotsTaken",
    "RankNotHeld",
    "check_exit_tail",
    "check_room",
    "log_targets",
    "node_ranks",
    "MAX_CHUNK_BYTES",
    "MAX_OPEN_PER_NODE",
    "MAX_OPEN_PER_READER",
    "MAX_TAIL_LINES",
]
