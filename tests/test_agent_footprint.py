"""The agent counts its slots without torch (issue #34): an agent started from the shipped
agent.toml (``slots = "auto"``), as its unit starts it, has joined the cluster without
loading libtorch, and stays small. The dev venv has torch installed, so importing it would
show here."""

from __future__ import annotations

from pathlib import Path

import shipped

shipped_host = shipped.shipped_host
shipped_cluster = shipped.shipped_cluster


def _mapped_files(pid: int) -> set[str]:
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split()[-1] for line in lines if len(line.split()) >= 6}


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"/proc/{pid}/status has no VmRSS")


def test_a_joined_agent_with_auto_slots_has_not_loaded_torch(shipped_cluster):
    agent = shipped_cluster.agents["n0"]
    assert shipped.tomllib.loads(shipped.AGENT_TOML.read_text())["agent"]["slots"] == "auto"
    assert "joined the cluster as node n0" in agent.log()
    machine_id = agent.machine_id_path.read_text().strip()  # its simulated host's own (tests/shipped.py)
    assert f"hardware: machine-id {machine_id}; 0 GPU(s) (NVML: " in agent.log(), agent.log()
    pid = agent.process.pid
    assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0").count(b"--config"), "not the agent process"
    print(f"agent pid {pid} RSS after join: {_rss_mb(pid):.1f} MB")
    torch_libs = sorted(f for f in _mapped_files(pid) if "libtorch" in f or "/torch/" in f)
    assert torch_libs == [], f"the agent loaded torch to count its slots: {torch_libs[:5]}"
    # Far below the ~566 MB an agent holding torch had (issue #34); the figure: the report.
    assert _rss_mb(pid) < 100, f"agent RSS {_rss_mb(pid):.0f} MB after join"


def test_slots_come_from_nvml_never_from_nvidia_smi_nor_torch(tmp_path):
    """The agent's inventory asks NVML (nvidia-ml-py, installed here by the CI lock) and
    nothing else: on this host, which has no NVIDIA driver, it finds no GPU and says why,
    an ``nvidia-smi`` on PATH is never run, torch is never imported, and the node runs
    its CPU slots."""
    import subprocess
    import sys

    ran = tmp_path / "nvidia-smi-ran"
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\ntouch {ran}\necho 'GPU 0: NVIDIA H100 (UUID: GPU-a)'\n")
    fake.chmod(0o755)
    probe = (
        "import sys; from meshgate.agent.inventory import read_inventory; "
        "from meshgate.agent.slots import node_slots; i = read_inventory(); "
        "print(node_slots(i, None, 8), node_slots(i, 3, 8), 'torch' in sys.modules); print(i.gpu_source)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env={"PATH": str(tmp_path)}
    )
    assert done.returncode == 0, done.stderr
    counted, source = done.stdout.splitlines()
    assert counted == "(8, 'cpu') (3, 'cpu') False", done.stdout
    assert source.startswith("NVML: "), source  # the library's own reason: no driver here
    assert not ran.exists(), "the agent ran nvidia-smi"
