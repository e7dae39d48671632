"""The node-local Unix socket where workers the agent did not spawn (Ray, Fabric)
ask for their vouch. The agent checks the caller with SO_PEERCRED before answering:
its uid must be allowed, and where possible its pid must descend from an allowed
ancestor (e.g. the Ray raylet started under this node's training user).

Protocol: one JSON line in, {"local_rank": N}; one JSON line out, {"vouch": base64}
or {"error": "..."}. Nothing is evaluated or unpickled.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import socket
import struct
from pathlib import Path
from typing import Callable, Iterable, Optional

log = logging.getLogger("meshgate.agent")

_UCRED = struct.Struct("3i")  # pid, uid, gid


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


class VouchSocket:
    def __init__(
        self,
        path: Path,
        mint: Callable[[int], bytes],
        *,
        allowed_uids: Iterable[int] = (),
        ancestor_pids: Iterable[int] = (),
        max_local_rank: int = 1 << 16,
    ) -> None:
        self.path = Path(path)
        self.mint = mint  # local_rank -> serialized WorkerVouch
        self.allowed_uids = set(allowed_uids) or {os.getuid()}
        self.ancestor_pids = tuple(ancestor_pids)
        self.max_local_rank = max_local_rank
        self.server: Optional[asyncio.AbstractServer] = None

    async def start(self) -> None:
        self.path.unlink(missing_ok=True)
        self.server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        os.chmod(self.path, 0o660)  # the uid check is the gate; the mode keeps strangers out early

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.path.unlink(missing_ok=True)

    def check_peer(self, pid: int, uid: int) -> Optional[str]:
        """None if the caller may have a vouch, else why not."""
        if uid not in self.allowed_uids:
            return f"uid {uid} is not allowed (allowed: {sorted(self.allowed_uids)})"
        if self.ancestor_pids and not descends_from(pid, self.ancestor_pids):
            return f"pid {pid} does not descend from {list(self.ancestor_pids)}"
        return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        try:
            pid, uid, _ = peer_credentials(sock)
            # Read the request even from a caller that will be refused, so it always
            # gets its answer line rather than a broken pipe.
            line = await asyncio.wait_for(reader.readline(), timeout=5)
            refusal = self.check_peer(pid, uid)
            if refusal is None:
                try:
                    request = json.loads(line[:4096])
                    local_rank = request["local_rank"]
                    if isinstance(local_rank, bool) or not isinstance(local_rank, int) or not 0 <= local_rank < self.max_local_rank:
                        raise ValueError(f"local_rank {local_rank!r} out of range")
                except (ValueError, KeyError, TypeError) as exc:
                    refusal = f"bad request: {exc}"
            if refusal is not None:
                log.warning("vouch refused to pid %d uid %d: %s", pid, uid, refusal)
                answer = {"error": refusal}
            else:
                answer = {"vouch": base64.b64encode(self.mint(local_rank)).decode()}
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError, OSError) as exc:
            log.warning("vouch socket: %s", exc)
        finally:
            writer.close()
