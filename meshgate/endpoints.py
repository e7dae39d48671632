"""Coordinator addresses with failover: the address list every client walks through
meshgate/connection.py (the worker client, the agent, the admin client, the CLI, the launchers).

A setting such as ``"head-a:7443,head-b:7443"`` lists the coordinators of an HA pair.
A standby answers UNAVAILABLE and names the leader in the ``meshgate-leader`` trailing
metadata; callers go there next, else to the next address.
"""

from __future__ import annotations

import functools
import ipaddress
from typing import Optional

import grpc

LEADER_METADATA_KEY = "meshgate-leader"
# Retried at the next address: always for an idempotent call (Register, AwaitWorld, reads); for
# one that is not, only when the first coordinator did not act (Connection.call says when).
FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})


def join_host_port(host: str, port: int) -> str:
    """HOST:PORT, with an IPv6 literal in brackets: ``"::1", 29500 -> "[::1]:29500"``.

    IPv4 addresses and host names stay as they are; a host already in brackets is kept.
    """
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        host = f"[{host}]"
    return f"{host}:{int(port)}"


def tcp_init_method(host: str, port: int) -> str:
    """torch.distributed's ``init_method`` for a TCP store at host:port."""
    return f"tcp://{join_host_port(host, port)}"


def is_loopback_host(host: str) -> bool:
    """True for a loopback address literal or the name ``localhost`` (no DNS lookup)."""
    host = host.strip("[]").split("%")[0]
    if host.lower() == "localhost":
        return True
    if ":" not in host and not host.startswith("127."):
        # Every Register asks this: skip the ipaddress parse where its answer is known. With
        # no colon only an IPv4 literal can parse, and ipaddress takes only strict dotted
        # decimal (no leading zeros), so a loopback one starts with "127.".
        return False
    return _is_loopback_literal(host)


@functools.lru_cache(maxsize=1024)  # bounded: hosts come from requests; few distinct in practice
def _is_loopback_literal(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 from a dual-stack socket
    return (mapped or address).is_loopback


def parse_addresses(spec: str) -> list[str]:
    addresses = [part.strip() for part in spec.split(",") if part.strip()]
    if not addresses:
        raise ValueError(f"no coordinator address in {spec!r}")
    return addresses


def leader_hint(error: grpc.RpcError) -> str:
    try:
        metadata = error.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - some errors carry none
        return ""
    for key, value in metadata:
        if key == LEADER_METADATA_KEY:
            return value if isinstance(value, str) else value.decode()
    return ""


class Endpoints:
    def __init__(self, spec: str) -> None:
        self.addresses = parse_addresses(spec)
        self.index = 0

    @property
    def current(self) -> str:
        return self.addresses[self.index]

    def failed(self, error: Optional[grpc.RpcError] = None) -> str:
        """Move on after ``error``: to the leader it names, else to the next address."""
        hint = leader_hint(error) if error is not None else ""
        if hint and hint != self.current:
            if hint not in self.addresses:
                self.addresses.append(hint)
            self.index = self.addresses.index(hint)
        else:
            self.index = (self.index + 1) % len(self.addresses)
        return self.current
