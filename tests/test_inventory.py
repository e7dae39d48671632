"""The node's hardware as the agent reads it (agent/inventory.py): the pure readings of
NVML's raw values and of sysfs, on trees the tests lay out as the kernel does, and on this
host's own /sys. NVML itself is only read on a GPU host (docs/operating.md, "Hardware");
here nvidia-ml-py is installed and finds no driver (tests/test_agent_footprint.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshgate.agent.inventory import (
    Gpu,
    GpusUnreadable,
    Inventory,
    MachineIdUnreadable,
    fabric_domain,
    machine_id,
    pci_bus_id,
    read_gpus,
    read_inventory,
    read_nics,
)

UUID = bytes.fromhex("5f1c3a2b9d8e4f60a1b2c3d4e5f60718")


def test_an_nvlink_domain_is_the_cluster_uuid_with_the_clique_and_sentinels_are_unknown():
    assert fabric_domain(UUID, 7, 3, 0) == "5f1c3a2b-9d8e-4f60-a1b2-c3d4e5f60718/7"
    # The same clique id under another cluster UUID is another domain (torchcomms#3612).
    other = bytes.fromhex("00000000000000000000000000000001")
    assert fabric_domain(other, 7, 3, 0) != fabric_domain(UUID, 7, 3, 0)
    assert fabric_domain(bytes(16), 0, 3, 0) == ""  # H100: zeros (torchcomms#1385)
    assert fabric_domain(b"\xff" * 16, 7, 3, 0) == ""
    assert fabric_domain(UUID, 7, 2, 0) == ""  # registration still in progress
    assert fabric_domain(UUID, 7, 3, 1) == ""  # registration failed
    assert fabric_domain(b"", 7, 3, 0) == ""


def test_a_machine_id_is_32_hex_digits_and_an_unbooted_image_has_none():
    assert machine_id("3d1219c7c4c5404aaa1f6d2a48adfda4\n") == "3d1219c7c4c5404aaa1f6d2a48adfda4"
    for text in ("", "\n", "uninitialized\n", "3D1219C7C4C5404AAA1F6D2A48ADFDA4", "3d1219c7"):
        assert machine_id(text) == "", text


def test_a_named_machine_id_file_is_read_and_one_without_a_machine_id_refuses_the_start(tmp_path):
    """[agent] machine_id_file (a container's view of its host): the operator named it, so a
    file there with no machine-id is a mistake; the host's own empty one is only unknown."""
    named = tmp_path / "machine-id"
    named.write_text("0123456789abcdef0123456789abcdef\n")
    assert read_inventory(named).machine_id == "0123456789abcdef0123456789abcdef"
    for text in ("", "uninitialized\n"):
        named.write_text(text)
        with pytest.raises(MachineIdUnreadable, match=r"\[agent\] machine_id_file = '.*machine-id': no machine-id"):
            read_inventory(named)
    with pytest.raises(MachineIdUnreadable):
        read_inventory(tmp_path / "missing")
    host = Path("/etc/machine-id")
    assert read_inventory().machine_id == (machine_id(host.read_text()) if host.exists() else "")


def test_pci_bus_ids_are_spelled_as_sysfs_and_torch_spell_them():
    assert pci_bus_id("00000000:4F:00.0\n") == "00000000:4f:00.0"


def test_the_node_domain_is_the_one_every_gpu_reports():
    def gpus(*domains):
        return tuple(Gpu(i, f"GPU-{i}", f"00000000:0{i}:00.0", nvlink_domain=d) for i, d in enumerate(domains))

    assert Inventory("", gpus("a/1", "a/1"), (), "NVML").nvlink_domain == "a/1"
    assert Inventory("", gpus("a/1", "b/1"), (), "NVML").nvlink_domain == ""  # mixed: not one domain
    assert Inventory("", gpus("a/1", ""), (), "NVML").nvlink_domain == ""
    assert Inventory("", (), (), "none").nvlink_domain == ""
    line = Inventory("", gpus("a/1"), (), "NVML").describe()
    assert line == "machine-id unknown; 1 GPU(s) (NVML), NVLink domain a/1; NICs: none", line


def _sysfs(root: Path) -> tuple[Path, Path]:
    """An InfiniBand device with two ports, a physical interface, a virtual one and lo, as
    the kernel lays them out (a virtual interface has no ``device`` link)."""
    ib = root / "infiniband" / "mlx5_0"
    for port, state in (("1", "4: ACTIVE"), ("2", "1: DOWN")):
        (ib / "ports" / port).mkdir(parents=True)
        (ib / "ports" / port / "state").write_text(state + "\n")
    (ib / "node_guid").write_text("b859:9f03:00d4:1a2e\n")
    for name, address, state, physical in (
        ("eth0", "02:fc:00:00:00:01", "up", True),
        ("veth1", "6a:16:8d:d3:41:a2", "up", False),
        ("lo", "00:00:00:00:00:00", "unknown", False),
    ):
        interface = root / "net" / name
        interface.mkdir(parents=True)
        (interface / "address").write_text(address + "\n")
        (interface / "operstate").write_text(state + "\n")
        if physical:
            (interface / "device").symlink_to(root)
    return root / "net", root / "infiniband"


def test_nics_are_infiniband_devices_and_interfaces_backed_by_a_device(tmp_path):
    net, infiniband = _sysfs(tmp_path)
    assert [(n.name, n.kind, n.address, n.state) for n in read_nics(net, infiniband)] == [
        ("mlx5_0", "infiniband", "b859:9f03:00d4:1a2e", "ACTIVE"),
        ("eth0", "net", "02:fc:00:00:00:01", "up"),
    ]
    assert read_nics(tmp_path / "none", tmp_path / "none") == ()


def test_this_hosts_own_nics_leave_out_loopback_and_virtual_interfaces():
    found = read_nics()
    assert all(nic.name != "lo" for nic in found)
    assert all(Path("/sys/class/net", nic.name, "device").exists() for nic in found if nic.kind == "net")


def test_a_driver_holding_gpus_that_nvml_cannot_read_is_refused_naming_them_and_the_fix(tmp_path):
    """Counted as a CPU node, a GPU host would run CPU slots on its GPUs without a word.
    The driver's /proc/driver/nvidia/gpus is laid out here; NVML finds no driver on this
    host, so the refusal is the one a GPU host without a readable NVML meets."""
    assert read_gpus(tmp_path / "absent")[0] == ()  # no driver, no GPU: a CPU node
    for bus in ("0000:4f:00.0", "0000:52:00.0"):
        (tmp_path / bus).mkdir()
    with pytest.raises(GpusUnreadable) as refused:
        read_gpus(tmp_path)
    assert "the NVIDIA driver holds 2 GPU(s) (0000:4f:00.0, 0000:52:00.0) but NVML: " in str(refused.value)
    assert "install meshgate's [gpu] extra (nvidia-ml-py)" in str(refused.value)
