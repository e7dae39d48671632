"""The node-local Unix socket where workers the agent did not spawn (Ray, Fabric)
ask for their vouch. The agent checks the caller with SO_PEERCRED before answering:
its uid must be allowed, and where possible its pid must descend from an allowed
ancestor (e.g. the Ray raylet started under this node's training user).

Protocol: one JSON line in, one JSON line out; nothing is evaluated or unpickled.
  {"local_rank": N} (a claimed-mode worker adds "rank": R, which the vouch then names)
      -> {"vouch": base64, "node_id": ...}
  {"whoami": true} (torchrun's handler adds "launcher": true: the agent adopts it)
      -> {"node_id": ..., "job_id": ..., "generation": G, ...}: which meshgate node this is
         (LocalNode: also its node rank, slots, the job's master and whether the job is
         over). Workers a framework placed (Ray, Fabric) register under this node id, the
         one the agent vouches under, never under the framework's own node id; torchrun's
         rendezvous handler (meshgate/torchrun.py) forms its world from the rest.
  {"progress": {"local_rank": L, "step": S, "loss": x, "samples_per_s": y, "step_time_s": z}}
      -> {}: a worker's training progress (meshgate.report; the last three optional); the
         agent keeps the latest per local rank for the generation served now and carries it
         on its heartbeat (`job show`, metrics, the straggler).
  {"exited": {"generation": G, "local_ranks": [..], "exit_code": C, "detail": "..."}}
      -> {"generation": G'}: workers this agent did not start (torchrun's) exited; the agent
         reports them as its own, so a failure ends generation G for the whole job and
         every worker's exit 0 makes the job SUCCEEDED. G' is the generation after it.
  {"master_socket": true}
      -> {"port": P} and, in the same message (SCM_RIGHTS), a copy of the LISTENING socket of
         the job's master: only to a process of node rank 0 of the job served now, where a
         meshgate handler hosts the store (agent/netif.py MasterReservation); the caller
         serves its store on it (TCPStore(master_listen_fd=...)) and the port is never free.
Any refusal is {"error": "..."}; a line longer than MAX_REQUEST_BYTES gets one too.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import socket
import struct
from dataclasses import asdict
from pathlib import Path
from typing import Awaitable, Callable, Iterable, Optional

from meshgate.agent_socket import ExternalExits, LocalNode, ReportedProgress, bounded_int

log = logging.getLogger("meshgate.agent")

__all__ = ["ExternalExits", "LocalNode", "VouchSocket", "descends_from", "parent_pid", "peer_credentials"]

_UCRED = struct.Struct("3i")  # pid, uid, gid
MAX_REQUEST_BYTES = 4096  # a request is a few dozen bytes
FD_KEY = "_fd"  # an answer's descriptor, sent with SCM_RIGHTS, never in the JSON


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process on the other end, from the kernel."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


def parent_pid(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return None
    # the command name may hold spaces and parentheses: the ppid follows the last ")"
    return int(stat[stat.rindex(b")") + 2 :].split()[1])


def descends_from(pid: int, ancestors: Iterable[int]) -> bool:
    wanted = set(ancestors)
    seen = 0
    while pid and pid > 1 and seen < 64:
        if pid in wanted:
            return True
        pid = parent_pid(pid) or 0
        seen += 1
    return bool(wanted & {pid})


class Refused(Exception):
    """The agent's answer to a well-formed request it will not serve now (the job is
    over, or the request is not for this job's kind): an error line, logged (``quiet``:
    at debug, for a request a worker repeats every second, as progress; the caller check's
    refusals are always warnings)."""

    def __init__(self, message: str, quiet: bool = False) -> None:
        super().__init__(message)
        self.quiet = quiet


class VouchSocket:
    def __init__(
        self,
        path: Path,
        mint: Callable[[int, Optional[int]], bytes],
        whoami: Callable[[], LocalNode],
        *,
        allowed_uids: Iterable[int] = (),
        ancestor_pids: Iterable[int] = (),
        max_local_rank: int = 1 << 16,
        check_caller: Optional[Callable[[int, int], Optional[str]]] = None,
        report_exits: Optional[Callable[[ExternalExits], Awaitable[int]]] = None,
        note_progress: Optional[Callable[[ReportedProgress], None]] = None,
        master_socket: Optional[Callable[[], socket.socket]] = None,
        on_admitted: Optional[Callable[[int, bool], None]] = None,
    ) -> None:
        self.path = Path(path)
        self.mint = mint  # (local_rank, claimed rank or None) -> serialized WorkerVouch
        self.whoami = whoami
        self.allowed_uids = set(allowed_uids) or {os.getuid()}
        self.ancestor_pids = tuple(ancestor_pids)
        self.max_local_rank = max_local_rank
        # The agent's own check first (pid, uid) -> refusal or None: only a process of the
        # job run it serves now, while it runs one (agent/containment.py).
        self.check_caller = check_caller
        # "exited": report the exits of workers the agent did not start; returns the
        # generation after the report. None: the request is refused.
        self.report_exits = report_exits
        self.note_progress = note_progress  # "progress": a worker's latest step; None: refused
        # "master_socket": the master's listening socket for this caller (Refused: not now).
        self.master_socket = master_socket
        # An admitted caller's pid, and whether it says it is a launcher (agent/adopted.py).
        self.on_admitted = on_admitted
        self.server: Optional[asyncio.AbstractServer] = None

    async def start(self) -> None:
        self.path.unlink(missing_ok=True)
        self.server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        # Any local process may connect: the agent's own check (SO_PEERCRED uid against
        # [agent] vouch_socket_uids and the job user, pid against the job run's unit) is the
        # gate, and every refusal is logged with the caller's pid, uid and cgroup. A 0660 mode
        # would refuse a vouch_socket_uids user (Ray's, torchrun's) outside the job user's
        # group in the kernel, unseen, before that check could admit it.
        os.chmod(self.path, 0o666)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.path.unlink(missing_ok=True)

    def check_peer(self, pid: int, uid: int) -> Optional[str]:
        """None if the caller may have a vouch, else why not."""
        if self.check_caller is not None:
            refusal = self.check_caller(pid, uid)
            if refusal is not None:
                return refusal
        if uid not in self.allowed_uids:
            return (
                f"uid {uid} is not allowed (allowed: {sorted(self.allowed_uids)}): run the workers as one of "
                f"those uids, or add {uid} to [agent] vouch_socket_uids on this node"
            )
        if self.ancestor_pids and not descends_from(pid, self.ancestor_pids):
            return f"pid {pid} does not descend from {list(self.ancestor_pids)}"
        return None

    _rank = staticmethod(bounded_int)

    def _parse(self, line: bytes) -> Callable[[], Awaitable[dict]]:
        """The answer to one request line, checked now and computed when awaited: a
        table of request kinds (the key that names one), a vouch otherwise."""
        request = json.loads(line)
        if not isinstance(request, dict):
            raise TypeError("the request must be a JSON object")
        for key, kind in self.KINDS.items():
            if key in request:
                return kind(self, request)
        local_rank = self._rank(request, "local_rank", self.max_local_rank)
        rank = self._rank(request, "rank", 1 << 31) if "rank" in request else None
        return lambda: self._vouch(local_rank, rank)

    async def _vouch(self, local_rank: int, rank: Optional[int]) -> dict:
        vouch = base64.b64encode(self.mint(local_rank, rank)).decode()
        return {"vouch": vouch, "node_id": self.whoami().node_id}

    def _whoami(self, request: dict) -> Callable[[], Awaitable[dict]]:
        if request["whoami"] is not True:
            raise ValueError("whoami must be true")

        async def answer() -> dict:
            return asdict(self.whoami())

        return answer

    def _exited(self, request: dict) -> Callable[[], Awaitable[dict]]:
        if self.report_exits is None:
            raise ValueError("this socket takes no exit reports")
        exits = ExternalExits.parse(request["exited"], self.max_local_rank)

        async def answer() -> dict:
            return {"generation": await self.report_exits(exits)}

        return answer

    def _progress(self, request: dict) -> Callable[[], Awaitable[dict]]:
        if self.note_progress is None:
            raise ValueError("this socket takes no progress reports")
        progress = ReportedProgress.parse(request["progress"], self.max_local_rank)

        async def answer() -> dict:
            self.note_progress(progress)
            return {}

        return answer

    def _master(self, request: dict) -> Callable[[], Awaitable[dict]]:
        if request["master_socket"] is not True or self.master_socket is None:
            raise ValueError("master_socket must be true, on an agent that hands its master over")

        async def answer() -> dict:
            listener = self.master_socket()
            return {"port": listener.getsockname()[1], FD_KEY: listener.fileno()}

        return answer

    KINDS = {"whoami": _whoami, "exited": _exited, "progress": _progress, "master_socket": _master}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        try:
            pid, uid, _ = peer_credentials(sock)
            # Read the request even from a caller that will be refused, so it always
            # gets its answer line rather than a broken pipe.
            try:
                line = await asyncio.wait_for(reader.readuntil(b"\n"), timeout=5)
                too_long = len(line) > MAX_REQUEST_BYTES
            except asyncio.LimitOverrunError:
                line, too_long = b"", True
            except asyncio.IncompleteReadError as exc:
                line, too_long = exc.partial, len(exc.partial) > MAX_REQUEST_BYTES
            refusal = self.check_peer(pid, uid)
            if refusal is None and too_long:
                refusal = f"bad request: the request line is longer than {MAX_REQUEST_BYTES} bytes"
            answer_for: Optional[Callable[[], Awaitable[dict]]] = None
            if refusal is None:
                try:
                    answer_for = self._parse(line)
                except (ValueError, KeyError, TypeError) as exc:
                    refusal = f"bad request: {str(exc)[:200]}"
            if refusal is None and self.on_admitted is not None:
                self.on_admitted(pid, json.loads(line).get("launcher") is True)
            answer: dict = {}
            quiet = False
            if refusal is None:
                try:
                    answer = await answer_for()
                except Refused as exc:
                    refusal, quiet = str(exc), exc.quiet
            if refusal is not None:
                (log.debug if quiet else log.warning)("vouch refused to pid %d uid %d: %s", pid, uid, refusal)
                answer = {"error": refusal}
            fd = answer.pop(FD_KEY, None)
            if fd is None:
                writer.write(json.dumps(answer).encode() + b"\n")
                await writer.drain()
            else:  # the answer line and the descriptor in one message (the caller's recv_fds)
                with socket.socket(fileno=os.dup(sock.fileno())) as raw:  # a few bytes: the buffer takes them
                    socket.send_fds(raw, [json.dumps(answer).encode() + b"\n"], [fd])
        except (asyncio.TimeoutError, ConnectionError, OSError) as exc:
            log.warning("vouch socket: %s", exc)
        finally:
            writer.close()
