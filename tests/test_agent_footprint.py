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
    pid = agent.process.pid
    assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0").count(b"--config"), "not the agent process"
    print(f"agent pid {pid} RSS after join: {_rss_mb(pid):.1f} MB")
    torch_libs = sorted(f for f in _mapped_files(pid) if "libtorch" in f or "/torch/" in f)
    assert torch_libs == [], f"the agent loaded torch to count its slots: {torch_libs[:5]}"
    # Far below the ~566 MB an agent holding torch had (issue #34); the figure: the report.
    assert _rss_mb(pid) < 100, f"agent RSS {_rss_mb(pid):.0f} MB after join"


def test_gpus_are_counted_from_nvidia_smi_without_torch(tmp_path):
    """No NVML here (no driver): ``nvidia-smi -L``'s GPU lines are the count; neither path
    imports torch. Without nvidia-smi either: CPU slots."""
    import subprocess
    import sys

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 (UUID: GPU-a)'\necho 'GPU 1: NVIDIA H100 (UUID: GPU-b)'\n")
    fake.chmod(0o755)
    probe = (
        "import sys; from meshgate.agent.slots import detect_slots; "
        "print(detect_slots(None, 8), 'torch' in sys.modules)"
    )
    for path, expected in ((str(tmp_path), "(2, 'gpu') False"), ("/nonexistent", "(8, 'cpu') False")):
        done = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env={"PATH": path}
        )
        assert done.returncode == 0 and done.stdout.strip() == expected, done.stdout + done.stderr


def test_nvml_is_asked_first_and_a_missing_driver_falls_back(tmp_path):
    """nvidia-ml-py's module (``pynvml``) answers first when importable; its NVMLError (no
    driver, as on this machine) falls back to nvidia-smi. This machine has neither NVML
    nor a GPU, so pynvml here is a module of the same API whose count is set by the test."""
    import subprocess
    import sys

    (tmp_path / "pynvml.py").write_text(
        "import os\n"
        "class NVMLError(Exception):\n    pass\n"
        "def nvmlInit():\n"
        "    if os.environ.get('NO_DRIVER'):\n        raise NVMLError('Driver Not Loaded')\n"
        "def nvmlDeviceGetCount():\n    return 4\n"
        "def nvmlShutdown():\n    pass\n"
    )
    probe = (
        "import sys; from meshgate.agent.slots import detect_slots; "
        "print(detect_slots(None, 8), 'torch' in sys.modules)"
    )
    for extra, expected in (({}, "(4, 'gpu') False"), ({"NO_DRIVER": "1"}, "(8, 'cpu') False")):
        env = {"PATH": "/nonexistent", "PYTHONPATH": str(tmp_path), **extra}
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 0 and done.stdout.strip() == expected, done.stdout + done.stderr
