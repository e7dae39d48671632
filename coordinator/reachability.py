"""Is the master a worker advertises reachable by the rest of its world? (issue #14)

Rank 0's Register names the address every other rank dials for torch.distributed. A worker
that reached the coordinator over the network, but advertises a loopback address, hands every
other host an address that leads back to itself: the collective hangs until its timeout.
The coordinator refuses that Register at once, naming the address, instead.

Pure: the caller passes the endpoint and the gRPC peer string (``context.peer()``).
"""

from __future__ import annotations

from typing import Optional
from urllib.parse import unquote

from meshgate.coordinator.rendezvous import Code, RendezvousError
from meshgate.endpoints import AddressError, is_loopback_host, split_host_port


def peer_host(peer: str) -> Optional[str]:
    """'ipv4:10.0.0.2:5123' -> '10.0.0.2'; 'ipv6:[::1]:5123' -> '::1' (grpc 1.85 writes it
    'ipv6:%5B::1%5D:5123', percent-encoded); None for a Unix socket or anything else."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6") or not rest:
        return None
    try:
        return split_host_port(unquote(rest), "peer", default_port=0)[0] or None
    except AddressError:
        return None


def check_endpoint_reachable(endpoint_host: str, peer: str, field: str = "endpoint_host") -> None:
    """INVALID_ARGUMENT when ``endpoint_host`` is loopback but the caller came from another host.
    ``field`` names the request field in the message (a Join's ``master_addr`` too)."""
    if not endpoint_host or not is_loopback_host(endpoint_host):
        return
    caller = peer_host(peer)
    if caller is None or is_loopback_host(caller):
        return
    raise RendezvousError(
        Code.INVALID_ARGUMENT,
        f"{field} {endpoint_host[:64]!r} is a loopback address, but this caller reached the "
        f"coordinator from {caller}: no other host could reach a master there. Advertise the "
        f"address of the interface that reaches the other nodes (MESHGATE_ADVERTISE_ADDR, set "
        f"by the node agent)",
    )
