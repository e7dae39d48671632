"""How many workers this node can run: its GPUs (agent/inventory.py) if it has them, else
configured CPU slots. Pure: the inventory is read once, at the agent's start."""

from __future__ import annotations

from typing import Optional

from meshgate.agent.inventory import Inventory


def node_slots(inventory: Inventory, configured: Optional[int], cpu_slots: int) -> tuple[int, str]:
    """(slots, kind): an explicit count wins (of the node's kind); else one per GPU; else
    the CPU slot count."""
    kind = "gpu" if inventory.gpus else "cpu"
    if configured is not None:
        return configured, kind
    return (len(inventory.gpus), kind) if inventory.gpus else (cpu_slots, kind)
