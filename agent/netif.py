"""The address and interface this node's workers use: chosen once, by the agent.

Collectives pick their own interface unless told: gloo resolves the host name (which
/etc/hosts often maps to 127.0.1.1 or 127.0.0.1) and NCCL takes the first interface it likes.
On a multi-homed host neither is reliably the one that reaches the other nodes. The agent
settles it once, from the route to the coordinator, and hands it to every worker:

* ``MESHGATE_ADVERTISE_ADDR``: the address rank 0 advertises as the master
  (``meshgate.client`` reads it);
* ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``: the interface that carries that address.

The job's master comes from the same choice: every agent listens on a port of its advertised
address (``MasterReservation``) and offers it at Join; the coordinator makes node rank 0's
offer the job's master and every agent exports it as ``MASTER_ADDR`` / ``MASTER_PORT``.

``choose(coordinator_host, advertise_address=, interface=)`` decides. Configured values win:
an interface alone gives its (first IPv4) address, an address alone gives the interface that
holds it. Otherwise the source address of the route to the coordinator is found with a UDP
``connect`` (the kernel picks the route; no packet is sent) and mapped to the interface that
holds it. The lookup reads the kernel's interface list through ``SIOCGIFADDR`` (IPv4, pure
Python); IPv6 addresses fall back to ``ip -j addr``.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import shutil
import socket
import struct
import subprocess
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from meshgate.agent_socket import IFNAME_ENVS
from meshgate.endpoints import AddressError, host_of

ADVERTISE_ENV = "MESHGATE_ADVERTISE_ADDR"
_SIOCGIFADDR = 0x8915


class InterfaceError(RuntimeError):
    """No usable address or interface: the message names what was asked and what exists."""


@dataclass(frozen=True)
class Route:
    """Where this node's workers listen and which interface their collectives use."""

    address: str
    interface: str
    source: str  # "config" or "route to <host>": why this one, for the log line

    def worker_env(self, already_set: Iterable[str] = ()) -> dict[str, str]:
        """The variables for workers, leaving out any the operator set (``already_set``)."""
        wanted = {ADVERTISE_ENV: self.address, **{name: self.interface for name in IFNAME_ENVS}}
        skip = set(already_set)
        return {k: v for k, v in wanted.items() if k not in skip}


def coordinator_host(coordinator: str) -> str:
    """'10.0.0.1:7443' -> '10.0.0.1'; '[fd00::1]:7443' -> 'fd00::1'; an HA list -> its first."""
    first = coordinator.split(",")[0].strip()
    if first.startswith("unix:"):
        raise InterfaceError(f"coordinator {first!r} is a Unix socket; no network route to follow")
    try:
        return host_of(first, "[agent] coordinator")
    except AddressError as exc:
        raise InterfaceError(str(exc)) from None


def route_source(host: str, port: int = 9) -> str:
    """The local address the kernel would send from to reach ``host`` (UDP connect: it
    resolves the name and picks the route, and sends nothing)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise InterfaceError(f"coordinator host {host!r} does not resolve: {exc}") from None
    errors = []
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.connect(address)
            except OSError as exc:
                errors.append(f"{address[0]}: {exc.strerror}")
                continue
            return probe.getsockname()[0]
    raise InterfaceError(f"no route to coordinator host {host!r}: {'; '.join(errors)}")


def _ipv4_of(name: str) -> Optional[str]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None  # down, or no IPv4 address
    return socket.inet_ntoa(packed[20:24])


def _ip_json() -> list[dict]:
    ip = shutil.which("ip")
    if ip is None:
        return []
    try:
        done = subprocess.run([ip, "-j", "addr"], capture_output=True, text=True, timeout=5, check=True)
        return json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return []


def interface_addresses() -> dict[str, tuple[str, ...]]:
    """Interface name -> its addresses. IPv4 (the primary address of each) from SIOCGIFADDR,
    all others from ``ip -j addr`` when it is installed."""
    found: dict[str, list[str]] = {name: [] for _, name in socket.if_nameindex()}
    for name in found:
        address = _ipv4_of(name)
        if address:
            found[name].append(address)
    for link in _ip_json():
        name = link.get("ifname")
        for info in link.get("addr_info", ()):
            local = info.get("local")
            if name in found and local and local not in found[name]:
                found[name].append(local)
    return {name: tuple(addresses) for name, addresses in found.items()}


def _same(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a.split("%")[0]) == ipaddress.ip_address(b.split("%")[0])
    except ValueError:
        return False


def interface_of(address: str, addresses: dict[str, tuple[str, ...]]) -> str:
    """The interface that holds ``address`` (pure: ``addresses`` is interface_addresses())."""
    for name, held in addresses.items():
        if any(_same(address, a) for a in held):
            return name
    listing = ", ".join(f"{n}={'/'.join(a) or '-'}" for n, a in sorted(addresses.items()))
    raise InterfaceError(f"no interface holds address {address!r} (interfaces: {listing})")


def choose(
    coordinator: str,
    *,
    advertise_address: str = "",
    interface: str = "",
    addresses: Optional[Callable[[], dict[str, tuple[str, ...]]]] = None,
    route: Callable[[str], str] = route_source,
) -> Route:
    """Decide the workers' address and interface (see the module docstring).

    ``addresses`` and ``route`` are the two seams to the kernel; tests pass their own.
    """
    table = (addresses or interface_addresses)()
    if interface:
        if interface not in table:
            raise InterfaceError(f"interface {interface!r} does not exist (have: {', '.join(sorted(table))})")
        if not advertise_address:
            held = [a for a in table[interface] if ":" not in a] or list(table[interface])
            if not held:
                raise InterfaceError(f"interface {interface!r} has no address to advertise")
            advertise_address = held[0]
        return Route(advertise_address, interface, "config")
    if advertise_address:
        return Route(advertise_address, interface_of(advertise_address, table), "config")
    host = coordinator_host(coordinator)
    source = route(host)
    return Route(source, interface_of(source, table), f"route to {host}")


# ---- the job's master: a port node rank 0's agent holds for its workers ----------------------

MASTER_ENVS = ("MASTER_ADDR", "MASTER_PORT")


class MasterReservation:
    """The master this node can host: a socket LISTENING on the advertised address from
    the first Join on, so nothing else can take the port (a bound socket that does not
    listen can be co-bound by any process that sets SO_REUSEADDR, as TCPStore does). Every
    agent offers one at Join; the coordinator makes node rank 0's the job's master.

    The agent keeps the socket for the job's life (``release()`` once the job is over here),
    so the port is never released and re-bound, and it listens only on the attested
    address. Whoever serves the store serves on it (agent/store_activation.py): a meshgate
    handler (torchrun's, started by the agent per node or by hand) takes a copy over the
    agent's Unix socket (SCM_RIGHTS), a per-slot job's store host inherits it; both run
    torch's ``TCPStore(master_listen_fd=...)``. An operator's MASTER_ADDR and MASTER_PORT,
    both set in the agent's environment, are offered as they are and nothing is bound."""

    BACKLOG = 2048  # connections the kernel queues while no store host accepts (between generations)

    def __init__(self, address: str, port: int, held: Optional[socket.socket] = None) -> None:
        self.address = address
        self.port = port
        self._held = held

    @property
    def operator_set(self) -> bool:
        return self._held is None

    @property
    def listener(self) -> Optional[socket.socket]:
        """The listening socket this agent holds (None: operator-set, or released)."""
        return self._held

    @classmethod
    def reserve(cls, address: str, environ: dict[str, str] | None = None) -> "MasterReservation":
        environ = {} if environ is None else environ
        if all(environ.get(name) for name in MASTER_ENVS):
            port = environ["MASTER_PORT"]
            if not port.isdigit() or not 0 < int(port) < 65536:
                raise InterfaceError(f"MASTER_PORT={port[:32]!r} in the agent's environment is not a port (1..65535)")
            return cls(environ["MASTER_ADDR"], int(port))
        held = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
        try:
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            held.bind((address, 0))
            held.listen(cls.BACKLOG)
        except OSError as exc:
            held.close()
            raise InterfaceError(f"cannot reserve a master port on {address}: {exc.strerror}") from None
        held.set_inheritable(False)
        return cls(address, held.getsockname()[1], held)

    def release(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None
