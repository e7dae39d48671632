"""Refusals and input checks shared by every rendezvous decision: a status code and a
message naming the field and its (bounded) value."""

from __future__ import annotations

import enum
import re
from typing import Optional


class Code(enum.Enum):
    """gRPC status names, without importing grpc here (the servicer maps them)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    NOT_FOUND = "NOT_FOUND"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    UNAVAILABLE = "UNAVAILABLE"
    DATA_LOSS = "DATA_LOSS"


class RendezvousError(Exception):
    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"

    def __reduce__(self):
        return (type(self), (self.code, self.message))


MAX_ID_LEN = 253
_ID_RE = re.compile(r"^[A-Za-z0-9._:@/+=\-]+$")
_HOST_RE = re.compile(r"^[A-Za-z0-9._:%\-]+$")  # a host name, IPv4 or IPv6 (with a zone)

SHOWN_PREFIX = 64


def shown(value: object, limit: int = SHOWN_PREFIX) -> str:
    """How an error message echoes caller input: the repr of a bounded prefix, so a
    10 kB id never outgrows a client's metadata limit."""
    text = value if isinstance(value, (str, bytes)) else str(value)
    return repr(text if len(text) <= limit else text[:limit] + ("..." if isinstance(text, str) else b"..."))


def check_master_offer(offer: Optional[tuple[str, int]]) -> None:
    """INVALID_ARGUMENT naming master_addr / master_port unless ``offer`` is None or a
    host (1..253 characters, no spaces) and a port in 1..65535."""
    if offer is None:
        return
    host, port = offer
    if not isinstance(host, str) or not host or len(host) > MAX_ID_LEN or not _HOST_RE.match(host):
        raise RendezvousError(
            Code.INVALID_ARGUMENT,
            f"master_addr {shown(host)} must be an IP address or host name of 1..{MAX_ID_LEN} characters",
        )
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise RendezvousError(Code.INVALID_ARGUMENT, f"master_port {shown(port)} out of range [1, 65535]")


def check_id(name: str, value: str) -> None:
    if not isinstance(value, str) or not value:
        raise RendezvousError(Code.INVALID_ARGUMENT, f"{name} must be a non-empty string")
    if len(value) > MAX_ID_LEN or not _ID_RE.match(value):
        raise RendezvousError(
            Code.INVALID_ARGUMENT,
            f"{name} {shown(value)} must be 1..{MAX_ID_LEN} characters of [A-Za-z0-9._:@/+=-]",
        )
