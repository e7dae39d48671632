"""What each node's agent read of its hardware (agent/inventory.py), as its Joins and the
heartbeats the coordinator asked for bring it: checked, kept in memory (a restarted
coordinator asks each node again, ``send_hardware``), and compared across the live nodes.

Pure decisions, no I/O:

- ``check_hardware``: the message is bounded and well formed, or INVALID_ARGUMENT naming
  the field and value (an agent's bug never grows the coordinator's memory).
- ``hardware_clash``: a GPU UUID or a machine-id another live node presents refuses the
  Join, naming both nodes and the device. Two agents on one GPU host would each hand out
  the same GPUs' ranks (a GPU cannot be on two hosts); one host under two node ids (a
  second agent, a node renamed while its old agent runs) or a cloned image would put two
  of a job's nodes on one machine. Hosts simulated on one machine give each agent its own
  (``[agent] machine_id_file``; a container names the host's). An empty machine-id is
  unknown and clashes with nothing.
- ``shared_with``: what the node shares with another live node, shown in ``meshgate
  nodes`` and logged: what a heartbeat brought (a restarted coordinator hears its nodes in
  any order and refuses none of them already running jobs).

Not persisted (the cluster's log would change format, and a rollback would refuse it):
the coordinator learns each node again within a heartbeat of its start.
"""

from __future__ import annotations

import re
from typing import Callable, Iterator, Optional

from meshgate.attestation import hardware_field
from meshgate.wire import HARDWARE_MAX_DEVICES, HARDWARE_MAX_TEXT
from meshgate.coordinator.rendezvous.errors import Code, RendezvousError
from meshgate.v1 import attestation_pb2, rendezvous_pb2

MAX_DEVICES = HARDWARE_MAX_DEVICES  # GPUs or NICs one node may list
MAX_TEXT = HARDWARE_MAX_TEXT  # any one string of the message

_MACHINE_ID = re.compile(r"^([0-9a-f]{32})?$")


def check_hardware(hardware: rendezvous_pb2.NodeHardware, where: str) -> None:
    """Raises INVALID_ARGUMENT naming the first field out of bounds (``where``: the
    request's field, "JoinRequest.hardware")."""

    def refuse(field: str, value: object, why: str) -> None:
        raise RendezvousError(Code.INVALID_ARGUMENT, f"{where}.{field} = {str(value)[:MAX_TEXT]!r}: {why}")

    if not _MACHINE_ID.match(hardware.machine_id):
        refuse("machine_id", hardware.machine_id, "not 32 lower-case hex digits (or empty: unknown)")
    for name, devices in (("gpus", hardware.gpus), ("nics", hardware.nics)):
        if len(devices) > MAX_DEVICES:
            refuse(name, f"{len(devices)} entries", f"at most {MAX_DEVICES}")
    texts = [("nvlink_domain", hardware.nvlink_domain), ("gpu_source", hardware.gpu_source)]
    for i, gpu in enumerate(hardware.gpus):
        if not gpu.uuid:
            refuse(f"gpus[{i}].uuid", gpu.uuid, "empty: a GPU is named by its UUID")
        texts += [(f"gpus[{i}].{f}", getattr(gpu, f)) for f in ("uuid", "pci_bus_id", "serial", "nvlink_domain")]
    for i, nic in enumerate(hardware.nics):
        texts += [(f"nics[{i}].{f}", getattr(nic, f)) for f in ("name", "kind", "address", "state")]
    for field, text in texts:
        if len(text) > MAX_TEXT:
            refuse(field, text, f"longer than {MAX_TEXT} characters")
    uuids = [gpu.uuid for gpu in hardware.gpus]
    if len(set(uuids)) != len(uuids):
        twice = next(u for u in uuids if uuids.count(u) > 1)
        refuse("gpus", twice, "the same GPU UUID listed twice")


def live_in(state, now: float) -> Callable[[str], bool]:
    """Whether a node of ``state`` (a ClusterState) was heard within the heartbeat timeout:
    only live nodes clash (a node that left may come back under another id)."""

    def live(node_id: str) -> bool:
        node = state.nodes.get(node_id)
        return node is not None and state.is_live(node, now)

    return live


def worker_hardware(hardware: rendezvous_pb2.NodeHardware, local_rank: int) -> attestation_pb2.WorkerHardware:
    """What the attestation of ``local_rank`` on a node with ``hardware`` states: the GPU
    of that index (NVML's order; none past the node's GPUs, or on a CPU node), the node's
    machine-id, NVLink domain and InfiniBand devices (its rails)."""
    gpu = hardware.gpus[local_rank] if local_rank < len(hardware.gpus) else None
    return attestation_pb2.WorkerHardware(
        machine_id=hardware.machine_id,
        gpu_uuid=gpu.uuid if gpu is not None else "",
        gpu_pci_bus_id=gpu.pci_bus_id if gpu is not None else "",
        nvlink_domain=hardware.nvlink_domain,
        rail_nics=[nic.name for nic in hardware.nics if nic.kind == "infiniband"],
    )


class HardwareBook:
    """Each node's hardware from its latest Join (or asked heartbeat), in memory, and what
    is read of it: who presents each GPU UUID and machine-id (so a Join's checks cost its
    own GPUs, not the cluster's size), each node's known NVLink domain (one dict, shared by
    every job's rendezvous for its topology check), and each worker's claim as the
    attestation signer appends it (field 32, serialized; cached per node and local rank
    until the node sends its hardware again; b"" for a node not heard)."""

    def __init__(self) -> None:
        self.of: dict[str, rendezvous_pb2.NodeHardware] = {}
        self.nvlink_domains: dict[str, str] = {}
        self._gpu_holders: dict[str, set[str]] = {}
        self._machine_holders: dict[str, set[str]] = {}
        self._claims: dict[str, dict[int, bytes]] = {}

    def note(self, node_id: str, hardware: rendezvous_pb2.NodeHardware) -> None:
        earlier = self.of.get(node_id)
        if earlier is not None:
            for holders, key in self._keys(earlier):
                holders[key].discard(node_id)
                if not holders[key]:
                    del holders[key]
        self.of[node_id] = hardware
        for holders, key in self._keys(hardware):
            holders.setdefault(key, set()).add(node_id)
        if hardware.nvlink_domain:
            self.nvlink_domains[node_id] = hardware.nvlink_domain
        else:
            self.nvlink_domains.pop(node_id, None)
        self._claims.pop(node_id, None)

    def _keys(self, hardware: rendezvous_pb2.NodeHardware) -> Iterator[tuple[dict[str, set[str]], str]]:
        for gpu in hardware.gpus:
            yield self._gpu_holders, gpu.uuid
        if hardware.machine_id:
            yield self._machine_holders, hardware.machine_id

    def overlaps(
        self, node_id: str, hardware: rendezvous_pb2.NodeHardware, live: Callable[[str], bool]
    ) -> Iterator[tuple[str, list[str], bool]]:
        """(other live node, the GPU UUIDs both present, whether the machine-id is the same)
        for each live node whose hardware overlaps ``hardware``, in node id order."""
        gpus: dict[str, list[str]] = {}
        for gpu in hardware.gpus:
            for other in self._gpu_holders.get(gpu.uuid, ()):
                gpus.setdefault(other, []).append(gpu.uuid)
        machine = self._machine_holders.get(hardware.machine_id, set()) if hardware.machine_id else set()
        for other in sorted((set(gpus) | machine) - {node_id}):
            if live(other):
                yield other, sorted(gpus.get(other, ())), other in machine

    def claim(self, node_id: str, local_rank: int) -> bytes:
        hardware = self.of.get(node_id)
        if hardware is None:
            return b""
        claims = self._claims.setdefault(node_id, {})
        if local_rank not in claims:
            claims[local_rank] = hardware_field(worker_hardware(hardware, local_rank))
        return claims[local_rank]


def hardware_words(hardware: rendezvous_pb2.NodeHardware) -> str:
    """A node's hardware in a timeline line: what names the machine to drain after a hang
    ("machine-id 3d12...; 8 GPU, NVLink 5f1c.../7; rails mlx5_0, mlx5_1"); the GPUs' UUIDs
    are each rank's own, in its attestation and `meshgate nodes --json`."""
    parts = [f"machine-id {hardware.machine_id or 'unknown'}", f"{len(hardware.gpus)} GPU"]
    if hardware.nvlink_domain:
        parts[-1] += f", NVLink {hardware.nvlink_domain}"
    rails = [nic.name for nic in hardware.nics if nic.kind == "infiniband"]
    if rails:
        shown = ", ".join(rails[:8]) + (f" and {len(rails) - 8} more" if len(rails) > 8 else "")
        parts.append(f"rails {shown}")
    return "; ".join(parts)


def hardware_clash(
    book: HardwareBook, live: Callable[[str], bool], node_id: str, hardware: rendezvous_pb2.NodeHardware
) -> Optional[str]:
    """Why ``node_id`` may not join with ``hardware``: a GPU, or the machine-id, another
    live node presents (the first such node in node id order; a GPU named before the host)."""
    for other, gpus, same_machine in book.overlaps(node_id, hardware, live):
        if gpus:
            what = f"GPU {gpus[0]}, which node {other!r} presents too ({len(gpus)} GPU(s) in common)"
        else:
            what = f"machine-id {hardware.machine_id}, which node {other!r} presents too"
        return (
            f"node {node_id!r} presents {what}: a second agent on one host, a node renamed while "
            f"its old agent runs, or a cloned machine image; stop one of them (or, once {other!r} "
            f"is stale, it stops counting when its heartbeats stop). Hosts simulated on one machine: "
            f"give each agent its own [agent] machine_id_file"
        )
    return None


def shared_with(book: HardwareBook, live: Callable[[str], bool], node_id: str) -> str:
    """What ``node_id``'s hardware shares with another live node ("machine-id shared with
    node 'n1'"); "" nothing, or its hardware unknown."""
    hardware = book.of.get(node_id)
    for other, gpus, _ in book.overlaps(node_id, hardware, live) if hardware is not None else ():
        return f"GPU {gpus[0]} shared with node {other!r}" if gpus else f"machine-id shared with node {other!r}"
    return ""


__all__ = [
    "MAX_DEVICES",
    "MAX_TEXT",
    "HardwareBook",
    "check_hardware",
    "hardware_clash",
    "hardware_words",
    "live_in",
    "shared_with",
    "worker_hardware",
]
