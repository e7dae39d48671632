"""A Unix-socket front that checks who is calling before it lets a connection through.

gRPC (grpcio) hides the peer of a Unix-socket connection from its servicers: no
SO_PEERCRED, so a gRPC server cannot ask who the caller is, only what it sent. The fan-in
(agent/fanin.py) needs the caller's pid as much as the vouch socket does (a job on this
host that read another job's MESHGATE_VOUCH from /proc must not register with it). So the
public socket is served here: each connection's (pid, uid, gid) is read from the kernel
once, the agent's check (the vouch socket's check_caller) decides, and an allowed
connection is spliced byte for byte to the real gRPC server on a socket only the agent can
reach; a refused one is closed before it reaches gRPC (its client sees UNAVAILABLE).

The splice is two asyncio protocols over the two transports: no task per connection once
it is open, flow control from each transport's write buffer, an EOF passed on as a
half-close, and both ends closed when either is lost.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Callable, Optional

from meshgate.agent.vouch_socket import peer_credentials

log = logging.getLogger("meshgate.agent")

CheckCaller = Callable[[int, int], Optional[str]]


class _End(asyncio.Protocol):
    """One side of a splice: what it reads is written to the other side's transport."""

    def __init__(self, splice: "_Splice") -> None:
        self.splice = splice
        self.peer: Optional[_End] = None
        self.transport: Optional[asyncio.Transport] = None
        self.eof = False
        # What was read before the other side's transport existed (only the caller's end:
        # asyncio starts reading a new connection after connection_made, whatever it
        # paused there, so a caller's first bytes can come before the server is reached).
        self.early: list[bytes] = []

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.peer.transport is None:
            self.early.append(data)
            self.transport.pause_reading()  # holds now: the reader is registered
            return
        self.peer.transport.write(data)

    def eof_received(self) -> bool:
        # The caller or the server stopped sending: pass the half-close on, and keep this
        # transport open for what the other direction still has to write.
        if self.eof:
            return True
        self.eof = True
        if self.peer.transport is not None:
            self._pass_eof()
        return True

    def _pass_eof(self) -> None:
        if self.peer.transport.can_write_eof():
            self.peer.transport.write_eof()
        self.splice.one_direction_done()

    def flush_early(self) -> None:
        """The other side is connected: hand it what was read before, and the EOF if one came."""
        for data in self.early:
            self.peer.transport.write(data)
        self.early.clear()
        if self.eof:
            self._pass_eof()
        else:
            self.transport.resume_reading()

    # The other side's transport buffers what this one reads: when it holds too much,
    # stop reading here until it drains.
    def pause_writing(self) -> None:
        self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if not self.peer.eof:  # an end that has read its EOF is never read again
            self.peer.transport.resume_reading()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.splice.lost(exc)


class _Client(_End):
    """The caller's end: checked when it connects, then spliced to the server."""

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.splice.front._accepted(self)


class _Splice:
    """One allowed connection: the caller's transport and the server's, joined."""

    def __init__(self, front: "PeerCheckedFront") -> None:
        self.front = front
        self.client = _Client(self)
        self.server = _End(self)
        self.client.peer, self.server.peer = self.server, self.client
        self._directions_done = 0
        self._closed = False

    def one_direction_done(self) -> None:
        self._directions_done += 1
        if self._directions_done == 2:  # both sides have sent EOF: nothing more can move
            self.close()

    def lost(self, exc: Optional[Exception]) -> None:
        # Either end gone: the other is closed too (close() still flushes what it holds;
        # an error aborts it).
        self.close(abort=exc is not None)

    def close(self, abort: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        self.front._live.discard(self)
        for end in (self.client, self.server):
            if end.transport is not None:
                end.transport.abort() if abort else end.transport.close()


class PeerCheckedFront:
    """Serves ``path`` (a Unix socket) for the server at ``upstream`` (a Unix socket only
    the agent can reach): each connection is let through only if ``check_caller(pid,
    uid)`` returns None for the process that connected, per SO_PEERCRED; otherwise it is
    logged (one WARNING with pid, uid and why) and closed."""

    def __init__(self, path: Path, upstream: Path, check_caller: CheckCaller, *, name: str = "fan-in") -> None:
        self.path = Path(path)
        self.upstream = Path(upstream)
        self.check_caller = check_caller
        self.name = name
        self.server: Optional[asyncio.AbstractServer] = None
        self._live: set[_Splice] = set()
        self._connecting: set[asyncio.Task] = set()
        self.accepted = 0
        self.refused = 0

    async def start(self, mode: int = 0o660) -> None:
        self.path.unlink(missing_ok=True)
        loop = asyncio.get_running_loop()
        self.server = await loop.create_unix_server(lambda: _Splice(self).client, path=str(self.path))
        # The check on each connection is the gate; the mode keeps strangers out early.
        os.chmod(self.path, mode)

    def _accepted(self, client: _Client) -> None:
        transport = client.transport
        # Decided here, in connection_made, before asyncio reads anything from the caller:
        # a refused caller's bytes are never read.
        try:
            pid, uid, _ = peer_credentials(transport.get_extra_info("socket"))
        except OSError as exc:
            log.warning("%s refused a caller whose credentials cannot be read: %s", self.name, exc)
            self.refused += 1
            transport.abort()
            return
        try:
            refusal = self.check_caller(pid, uid)
        except Exception as exc:  # a check that fails refuses: never let a caller through unchecked
            refusal = f"the caller check failed: {exc!r}"
        if refusal is not None:
            log.warning("%s refused to pid %d uid %d: %s", self.name, pid, uid, refusal)
            self.refused += 1
            transport.abort()  # the caller sent nothing we read: nothing to flush
            return
        self.accepted += 1
        splice = client.splice
        self._live.add(splice)
        task = asyncio.ensure_future(self._connect(splice))
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)

    async def _connect(self, splice: _Splice) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.create_unix_connection(lambda: splice.server, path=str(self.upstream))
        except OSError as exc:
            log.warning("%s: cannot reach the server at %s: %s", self.name, self.upstream, exc)
            splice.close(abort=True)
            return
        if splice._closed:  # the caller left (or the front closed) while connecting
            splice.server.transport.abort()
            return
        splice.client.flush_early()

    def stop_listening(self) -> None:
        """No new connections; the open ones go on (a graceful server stop still reaches them)."""
        if self.server is not None:
            self.server.close()
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Stop listening and close every open connection."""
        self.stop_listening()
        for task in list(self._connecting):
            task.cancel()
        for splice in list(self._live):
            splice.close(abort=True)

    @property
    def open_connections(self) -> int:
        return len(self._live)
