"""Coordinator addresses with failover: the address list every client walks through
meshgate/connection.py (the worker client, the agent, the admin client, the CLI, the launchers).

A setting such as ``"head-a:7443,head-b:7443"`` lists the coordinators of an HA pair.
A standby answers UNAVAILABLE and names the leader in the ``meshgate-leader`` trailing
metadata; callers go there next, else to the next address.
"""

from __future__ import annotations

import functools
import ipaddress
import re
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


class AddressError(ValueError):
    """Not a HOST:PORT; the message names the setting and the value."""


_HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?")


def split_host_port(
    text: str, field: str, *, default_port: Optional[int] = None, listen: bool = False
) -> tuple[str, int]:
    """``"10.0.0.5:2379"`` -> ("10.0.0.5", 2379); ``"[::1]:2379"`` -> ("::1", 2379): the one
    reading of HOST:PORT every setting and peer goes through (issue #31). An IPv6 literal
    takes brackets when a port follows. A bare host (``"10.0.0.5"``, ``"[::1]"``, ``"::1"``)
    gets ``default_port``, and is refused where there is none. Ports are 1..65535; a
    ``listen`` address may also ask for port 0 (the kernel picks one) and leave the host
    out (every interface: ``":9464"`` -> ("", 9464)). ``field`` names the setting in errors.

    Hand-written over urllib.parse.urlsplit, which lowercases host names, takes
    ``user@host`` and paths, and refuses a bare IPv6 literal."""
    if not isinstance(text, str) or not text.strip():
        raise AddressError(f"{field} must be HOST:PORT, got {text!r}"[:200])
    shown = repr(text) if len(text) <= 100 else repr(text[:97] + "...")
    text = text.strip()
    port_text: Optional[str] = None
    if text.startswith("["):  # [IPv6] or [IPv6]:PORT
        close = text.find("]")
        host, rest = (text[1:close], text[close + 1 :]) if close > 0 else ("", "?")
        if rest and not rest.startswith(":") or not _is_ipv6(host):
            raise AddressError(f"{field} {shown}: expected [IPv6]:PORT, e.g. [fd00::1]:7443")
        port_text = rest[1:] if rest else None
    elif text.count(":") > 1:  # an IPv6 literal without brackets: no port can follow it
        if not _is_ipv6(text):
            raise AddressError(f"{field} {shown}: an IPv6 address with a port takes brackets, e.g. [fd00::1]:7443")
        host = text
    else:
        host, colon, port_text = text.partition(":")
        port_text = port_text if colon else None
        if not (host or listen) or host and not _HOST_NAME.fullmatch(host):
            raise AddressError(f"{field} {shown}: {host!r} is not a host name or address")
    if port_text is None:
        if default_port is None:
            raise AddressError(f"{field} {shown} needs a port: HOST:PORT")
        return host, default_port
    lowest = 0 if listen else 1
    if not port_text.isdigit() or not lowest <= int(port_text) <= 65535:
        raise AddressError(f"{field} {shown}: port {port_text[:16]!r} is not a TCP port ({lowest}..65535)")
    return host, int(port_text)


def host_of(address: str, field: str = "address") -> str:
    """The host of HOST:PORT (or of a bare host): ``"[fd00::1]:7443"`` -> ``"fd00::1"``."""
    return split_host_port(address, field, default_port=0)[0]


def _is_ipv6(text: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(text), ipaddress.IPv6Address)
    except ValueError:
        return False


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
