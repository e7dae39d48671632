"""The node's hardware, read once by the agent at its start: its GPUs through NVML (the
``nvidia-ml-py`` package, meshgate's [gpu] extra), its NICs from sysfs, its machine-id.
Slots come from here (agent/slots.py); nothing else on the node counts GPUs.

NVML answers without a CUDA context, so the agent never imports torch (about half a GB
resident for its whole life, issue #34), and nothing parses ``nvidia-smi``'s text.

Sentinels are unknowns, never identities: an all-zero or all-0xff fabric cluster UUID
(H100 reports zeros, torchcomms#1385), a fabric whose registration has not completed, an
empty or uninitialised ``/etc/machine-id`` (a container image's), a serial NVML does not
give. An NVLink domain is the pair (cluster UUID, clique id): the clique id alone repeats
across racks (torchcomms#3612), so it is never compared without its cluster UUID.

A host whose NVIDIA driver is loaded (``/proc/driver/nvidia/gpus`` lists its GPUs) but
whose NVML cannot be read is refused (:class:`GpusUnreadable`): counted as a CPU node it
would silently run CPU slots on GPUs.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from meshgate.v1 import rendezvous_pb2
from meshgate.wire import HARDWARE_MAX_DEVICES, HARDWARE_MAX_TEXT

SYSFS_NET = Path("/sys/class/net")
SYSFS_INFINIBAND = Path("/sys/class/infiniband")
MACHINE_ID = Path("/etc/machine-id")
NVIDIA_DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")  # one folder per GPU the driver holds

_FABRIC_COMPLETED = 3  # NVML_GPU_FABRIC_STATE_COMPLETED
_MACHINE_ID = re.compile(r"^[0-9a-f]{32}$")


class GpusUnreadable(RuntimeError):
    """The NVIDIA driver holds GPUs here, but NVML cannot count them."""


@dataclass(frozen=True)
class Gpu:
    index: int  # NVML's (and CUDA_VISIBLE_DEVICES's, with CUDA_DEVICE_ORDER=PCI_BUS_ID) order
    uuid: str  # "GPU-8f3c..." as NVML names it (torch's device properties give it without "GPU-")
    pci_bus_id: str  # "00000000:4f:00.0", lower case
    serial: str = ""  # the board's serial, "" where NVML has none; never in metrics
    nvlink_domain: str = ""  # "<fabric cluster uuid>/<clique id>", "" where unknown


@dataclass(frozen=True)
class Nic:
    name: str  # "mlx5_0" (InfiniBand / RoCE device) or "eth0" (network interface)
    kind: str  # "infiniband" or "net"
    address: str  # the node GUID (infiniband) or the MAC address (net)
    state: str  # "ACTIVE" / "DOWN" ... (infiniband: its first port's) or operstate ("up", "down")


@dataclass(frozen=True)
class Inventory:
    machine_id: str  # "" where the host has none that identifies it
    gpus: tuple[Gpu, ...]
    nics: tuple[Nic, ...]
    gpu_source: str  # where the GPU list came from, or why there is none

    @property
    def nvlink_domain(self) -> str:
        """The node's NVLink domain: the one every GPU reports; "" when unknown or mixed."""
        domains = {gpu.nvlink_domain for gpu in self.gpus}
        return domains.pop() if len(domains) == 1 else ""

    def describe(self) -> str:
        """One log line; no serials (they stay on the node and in the attestation)."""
        gpus = f"{len(self.gpus)} GPU(s) ({self.gpu_source})"
        if self.gpus:
            gpus += f", NVLink domain {self.nvlink_domain or 'unknown'}"
        nics = ", ".join(f"{n.name} {n.state}" for n in self.nics) or "none"
        return f"machine-id {self.machine_id or 'unknown'}; {gpus}; NICs: {nics}"


# ---- pure: raw values to what they mean ----------------------------------------------------


def fabric_domain(cluster_uuid: bytes, clique_id: int, state: int, status: int) -> str:
    """An NVLink domain from NVML's fabric info, or "" for the sentinels: registration not
    completed (or failed: ``status`` not NVML_SUCCESS), a cluster UUID of zeros (H100) or
    of 0xff bytes."""
    if state != _FABRIC_COMPLETED or status != 0 or not cluster_uuid:
        return ""
    if cluster_uuid in (bytes(len(cluster_uuid)), b"\xff" * len(cluster_uuid)):
        return ""
    text = cluster_uuid.hex()
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}/{clique_id}"


def machine_id(text: str) -> str:
    """``/etc/machine-id``'s identity: 32 lower-case hex digits; "" for an empty file or
    systemd's "uninitialized" (an image not yet booted) or anything else."""
    value = text.strip()
    return value if _MACHINE_ID.match(value) else ""


def pci_bus_id(raw: str) -> str:
    """NVML spells the domain with 8 digits and upper-case hex; sysfs and torch lower case."""
    return raw.strip().lower()


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# ---- what the node has ------------------------------------------------------------------------


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def read_nics(net: Path = SYSFS_NET, infiniband: Path = SYSFS_INFINIBAND) -> tuple[Nic, ...]:
    """InfiniBand (and RoCE) devices, then the network interfaces backed by a device (not
    ``lo``, bridges, veths or other virtual ones: they name no rail)."""
    found = []
    for device in sorted(infiniband.glob("*")):
        ports = sorted((device / "ports").glob("*"))
        state = _read(ports[0] / "state").partition(":")[2].strip() if ports else ""
        found.append(Nic(device.name, "infiniband", _read(device / "node_guid"), state or "unknown"))
    for interface in sorted(net.glob("*")):
        if (interface / "device").exists():
            found.append(Nic(interface.name, "net", _read(interface / "address"), _read(interface / "operstate")))
    return tuple(found)


def driver_gpus(driver: Path = NVIDIA_DRIVER_GPUS) -> list[str]:
    """The PCI bus ids of the GPUs the NVIDIA driver holds, without NVML."""
    return sorted(p.name for p in driver.glob("*")) if driver.is_dir() else []


def read_gpus(driver: Path = NVIDIA_DRIVER_GPUS) -> tuple[tuple[Gpu, ...], str]:
    """(GPUs, where they came from or why none): NVML when nvidia-ml-py is installed and
    the driver's libnvidia-ml loads. Raises GpusUnreadable where the driver holds GPUs but
    NVML cannot be read."""
    if importlib.util.find_spec("pynvml") is None:
        gpus, why = (), "nvidia-ml-py is not installed"
    else:
        import pynvml

        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            gpus, why = (), f"NVML: {exc}"
        else:
            try:
                gpus = tuple(_nvml_gpu(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount()))
                why = f"NVML, driver {_text(pynvml.nvmlSystemGetDriverVersion())}"
            finally:
                pynvml.nvmlShutdown()
    held = driver_gpus(driver)
    if not gpus and held:
        raise GpusUnreadable(
            f"the NVIDIA driver holds {len(held)} GPU(s) ({', '.join(held[:4])}) but {why}: "
            "install meshgate's [gpu] extra (nvidia-ml-py) for the agent, or set slots in agent.toml"
        )
    return gpus, why


def _nvml_gpu(pynvml, index: int) -> Gpu:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    try:
        serial = _text(pynvml.nvmlDeviceGetSerial(handle))
    except pynvml.NVMLError:  # consumer boards have none
        serial = ""
    return Gpu(
        index=index,
        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
        pci_bus_id=pci_bus_id(_text(pynvml.nvmlDeviceGetPciInfo(handle).busId)),
        serial=serial,
        nvlink_domain=_nvlink_domain(pynvml, handle),
    )


def _nvlink_domain(pynvml, handle) -> str:
    """The versioned call where this nvidia-ml-py has it (the plain one is deprecated)."""
    try:
        if hasattr(pynvml, "nvmlDeviceGetGpuFabricInfoV"):
            info = pynvml.c_nvmlGpuFabricInfoV_t()
            pynvml.nvmlDeviceGetGpuFabricInfoV(handle, pynvml.byref(info))
        else:
            info = pynvml.c_nvmlGpuFabricInfo_t()
            pynvml.nvmlDeviceGetGpuFabricInfo(handle, pynvml.byref(info))
    except pynvml.NVMLError:  # no NVLink fabric (PCIe boards, a driver before r535): unknown
        return ""
    return fabric_domain(bytes(info.clusterUuid), int(info.cliqueId), int(info.state), int(info.status))


def hardware_message(inventory: Inventory) -> rendezvous_pb2.NodeHardware:
    """The inventory on the wire (NodeHardware, proto/meshgate/v1/rendezvous.proto)."""
    return rendezvous_pb2.NodeHardware(
        machine_id=inventory.machine_id,
        gpus=[
            rendezvous_pb2.GpuDevice(
                index=g.index, uuid=g.uuid, pci_bus_id=g.pci_bus_id, serial=g.serial, nvlink_domain=g.nvlink_domain
            )
            for g in inventory.gpus
        ],
        # InfiniBand devices first; a host with SR-IOV functions may list hundreds of
        # interfaces: the first HARDWARE_MAX_DEVICES are sent (the coordinator takes no more).
        nics=[
            rendezvous_pb2.NicDevice(name=n.name, kind=n.kind, address=n.address, state=n.state)
            for n in inventory.nics[:HARDWARE_MAX_DEVICES]
        ],
        nvlink_domain=inventory.nvlink_domain,
        gpu_source=inventory.gpu_source[:HARDWARE_MAX_TEXT],
    )


class MachineIdUnreadable(RuntimeError):
    """``[agent] machine_id_file`` names a file that holds no machine-id: the operator
    named it, so an unknown identity there is a mistake, not a container's empty file."""


def read_inventory(machine_id_file: Optional[Path] = None) -> Inventory:
    """The host's hardware; its machine-id from ``machine_id_file`` (``[agent]``; None: the
    host's own /etc/machine-id, where an empty or uninitialised one means unknown)."""
    identity = machine_id(_read(machine_id_file or MACHINE_ID))
    if machine_id_file is not None and not identity:
        raise MachineIdUnreadable(
            f"[agent] machine_id_file = {str(machine_id_file)[:200]!r}: no machine-id there "
            "(32 lower-case hex digits, as /etc/machine-id holds)"
        )
    gpus, source = read_gpus()
    return Inventory(identity, gpus, read_nics(), source)


__all__ = [
    "Gpu",
    "GpusUnreadable",
    "Inventory",
    "MachineIdUnreadable",
    "Nic",
    "fabric_domain",
    "machine_id",
    "read_inventory",
]
