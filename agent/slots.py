"""How many workers this node can run: GPUs if it has them, else configured CPU slots."""

from __future__ import annotations

import shutil
import subprocess
from typing import Optional


def count_gpus() -> int:
    """GPUs via nvidia-smi (cheap, no CUDA context), else torch if it is installed."""
    if shutil.which("nvidia-smi"):
        try:
            listing = subprocess.run(
                ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=True
            ).stdout
            return sum(1 for line in listing.splitlines() if line.startswith("GPU "))
        except (subprocess.SubprocessError, OSError):
            pass
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def detect_slots(configured: Optional[int], cpu_slots: int) -> tuple[int, str]:
    """(slots, kind): an explicit count wins; else GPUs; else the CPU slot count."""
    if configured is not None:
        return configured, "gpu" if shutil.which("nvidia-smi") else "cpu"
    gpus = count_gpus()
    return (gpus, "gpu") if gpus else (cpu_slots, "cpu")
