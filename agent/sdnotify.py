"""systemd's notify protocol (sd_notify(3)): one datagram to $NOTIFY_SOCKET.

The protocol is a single sendto; a library would add a dependency for four lines.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("meshgate.agent")


def notify(state: str) -> bool:
    """Send e.g. "READY=1" or "STOPPING=1"; False when not run under systemd, or when the
    socket is gone (a status line is never worth the agent: said, not raised)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:
        log.warning("systemd notify socket %s: %s (%s not sent)", os.environ["NOTIFY_SOCKET"], exc, state[:40])
        return False
    return True
