"""What each node's agent read of its hardware (agent/inventory.py), as its Joins and the
heartbeats the coordinator asked for bring it: checked, kept in memory (a restarted
coordinator asks each node again, ``send_hardware``), and compared across the live nodes.

Pure decisions, no I/O:

- ``check_hardware``: the message is bounded and well formed, or INVALID_ARGUMENT naming
  the field and value (an agent's bug never grows the coordinator's memory).
- ``gpu_clash``: a GPU UUID another live node presents refuses the Join, naming both
  nodes and the device. Two agents on one GPU host would each hand out the same GPUs'
  ranks; a GPU cannot be on two hosts.
- ``shared_with``: what the node shares with another live node (a GPU, or its machine-id:
  a cloned image, or a second agent on one host), shown in ``meshgate nodes`` and logged.
  A shared machine-id is not refused: hosts simulated on one machine (the demo, the test
  fixtures) share it, and refusing it needs each of them given its own first.

Not persisted (the cluster's log would change format, and a rollback would refuse it):
the coordinator learns each node again within a heartbeat of its start.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator, Mapping, Optional

from meshgate.attestation import hardware_field
from meshgate.coordinator.rendezvous.errors import Code, RendezvousError
from meshgate.v1 import attestation_pb2, rendezvous_pb2

MAX_DEVICES = 64  # GPUs or NICs one node may list (8 GPUs and a rail NIC each, with room)
MAX_TEXT = 128  # any one string of the message

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


def live_node_ids(state, now: float) -> list[str]:
    """The nodes of ``state`` (a ClusterState) heard within the heartbeat timeout: only
    these can clash (a node that left may come back under another id)."""
    return [node.node_id for node in list(state.nodes.values()) if state.is_live(node, now)]


def _overlaps(
    book: Mapping[str, rendezvous_pb2.NodeHardware],
    live: Iterable[str],
    node_id: str,
    hardware: rendezvous_pb2.NodeHardware,
) -> Iterator[tuple[str, list[str], bool]]:
    """(other live node, the GPU UUIDs both present, whether the machine-id is the same)
    for each live node whose hardware overlaps ``hardware``, in node id order."""
    mine = {gpu.uuid for gpu in hardware.gpus}
    for other in sorted(set(live) - {node_id}):
        theirs = book.get(other)
        if theirs is None:
            continue
        gpus = sorted(mine & {gpu.uuid for gpu in theirs.gpus})
        same_machine = bool(hardware.machine_id) and hardware.machine_id == theirs.machine_id
        if gpus or same_machine:
            yield other, gpus, same_machine


def gpu_clash(
    book: Mapping[str, rendezvous_pb2.NodeHardware],
    live: Iterable[str],
    node_id: str,
    hardware: rendezvous_pb2.NodeHardware,
) -> Optional[str]:
    """Why ``node_id`` may not join with ``hardware``: a GPU another live node presents."""
    for other, gpus, _ in _overlaps(book, live, node_id, hardware):
        if gpus:
            return (
                f"node {node_id!r} presents GPU {gpus[0]}, which node {other!r} presents too "
                f"({len(gpus)} GPU(s) in common): two agents on one host, or a node id reused; "
                f"stop one of them (meshgate drain {other} if it is the stale one)"
            )
    return None


def shared_with(book: Mapping[str, rendezvous_pb2.NodeHardware], live: Iterable[str], node_id: str) -> str:
    """What ``node_id``'s hardware shares with another live node ("machine-id shared with
    node 'n1'"); "" nothing, or its hardware unknown."""
    hardware = book.get(node_id)
    for other, gpus, _ in _overlaps(book, live, node_id, hardware) if hardware is not None else ():
        return f"GPU {gpus[0]} shared with node {other!r}" if gpus else f"machine-id shared with node {other!r}"
    return ""


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


class HardwareClaims:
    """The nodes' hardware as the jobs' engines read it: each worker's claim, as the
    attestation signer appends it (field 32, serialized), from its node's latest hardware,
    cached per node and local rank until the node sends its hardware again (each Join
    replaces the record; b"" for a node not heard); and each node's known NVLink domain,
    which the rendezvous's topology check reads (one dict, shared by every engine)."""

    def __init__(self, book: dict[str, rendezvous_pb2.NodeHardware]) -> None:
        self.book = book
        self.nvlink_domains: dict[str, str] = {}
        self._cache: dict[str, tuple[rendezvous_pb2.NodeHardware, dict[int, bytes]]] = {}

    def note(self, node_id: str, hardware: rendezvous_pb2.NodeHardware) -> None:
        self.book[node_id] = hardware
        if hardware.nvlink_domain:
            self.nvlink_domains[node_id] = hardware.nvlink_domain
        else:
            self.nvlink_domains.pop(node_id, None)

    def __call__(self, node_id: str, local_rank: int) -> bytes:
        hardware = self.book.get(node_id)
        if hardware is None:
            return b""
        cached = self._cache.get(node_id)
        if cached is None or cached[0] is not hardware:
            cached = self._cache[node_id] = (hardware, {})
        claims = cached[1]
        if local_rank not in claims:
            claims[local_rank] = hardware_field(worker_hardware(hardware, local_rank))
        return claims[local_rank]


__all__ = [
    "MAX_DEVICES",
    "MAX_TEXT",
    "HardwareClaims",
    "check_hardware",
    "gpu_clash",
    "live_node_ids",
    "shared_with",
    "worker_hardware",
]
