"""The store's listening socket, handed over by the node's agent (issue 32, item 2).

Node rank 0's agent listens on the job's master (its attested address) from its first Join
and never releases the port while the job runs; a meshgate handler (torchrun's) asks the
agent's Unix socket for a copy (``{"master_socket": true}``, the descriptor comes with
SCM_RIGHTS), a per-slot job's store host (meshgate/store_host.py) inherits it, and either
serves ``TCPStore(master_listen_fd=...)`` on it. Nobody can squat a port that never closes,
and the store listens only on the address the agent bound.
"""

from __future__ import annotations

import json
import socket
from typing import Optional

MAX_ANSWER_BYTES = 4096


class MasterSocketRefused(RuntimeError):
    """The agent holds no master socket for this caller: the message says why."""


def receive_master_socket(socket_path: str, timeout: float = 10.0) -> socket.socket:
    """A copy of the agent's listening master socket (blocking, inheritable: off)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(socket_path)
        conn.sendall(b'{"master_socket": true}\n')
        data, fds, _, _ = socket.recv_fds(conn, MAX_ANSWER_BYTES, 1)
    received: Optional[socket.socket] = socket.socket(fileno=fds[0]) if fds else None
    try:
        answer = json.loads(data or b"{}")
    except ValueError:
        answer = {"error": f"not an answer: {data[:100]!r}"}
    if received is None or "error" in answer:
        if received is not None:
            received.close()
        raise MasterSocketRefused(str(answer.get("error", "no descriptor came with the answer"))[:300])
    received.setblocking(True)
    return received


def tcp_store_on(listener: socket.socket, timeout_s: float, multi_tenant: bool = True):
    """torch's TCPStore serving on ``listener`` (which stays open as long as the store)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    host, port = listener.getsockname()[:2]
    return TCPStore(
        host,
        port,
        is_master=True,
        multi_tenant=multi_tenant,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=listener.fileno(),
    )
