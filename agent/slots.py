"""How many workers this node can run: GPUs if it has them, else configured CPU slots.

Counting GPUs never imports torch: importing it costs the agent about half a GB resident
for the whole of its life (issue #34). NVML (the ``nvidia-ml-py`` package, when installed)
or ``nvidia-smi -L`` answer without a CUDA context; a host with neither has no NVIDIA GPU
meshgate can use, and runs CPU slots.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from typing import Optional


def _nvml_count() -> Optional[int]:
    """GPUs through NVML, or None where nvidia-ml-py or the driver's libnvidia-ml is missing."""
    if importlib.util.find_spec("pynvml") is None:
        return None
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


def _nvidia_smi_count() -> Optional[int]:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    return sum(1 for line in listing.splitlines() if line.startswith("GPU "))


def count_gpus() -> int:
    """NVIDIA GPUs via NVML if nvidia-ml-py is importable, else ``nvidia-smi -L``; 0 without either."""
    for count in (_nvml_count, _nvidia_smi_count):
        found = count()
        if found is not None:
            return found
    return 0


def detect_slots(configured: Optional[int], cpu_slots: int) -> tuple[int, str]:
    """(slots, kind): an explicit count wins; else GPUs; else the CPU slot count."""
    if configured is not None:
        return configured, "gpu" if shutil.which("nvidia-smi") else "cpu"
    gpus = count_gpus()
    return (gpus, "gpu") if gpus else (cpu_slots, "cpu")
