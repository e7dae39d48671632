"""A worker for tests/test_netns.py: one node's process of a 2-node Lightning Fabric job.

Launched by a node agent inside a network namespace, with no master setting of its own:
MASTER_ADDR / MASTER_PORT / NODE_RANK come from the agent (the coordinator's assignment).
Each rank records what it saw, says it is ready, and holds its process group until the test
has read ``meshgate status`` (the file ``release`` appears), so status is read mid-job.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

SEEN = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "MESHGATE_NODE_RANK", "GLOO_SOCKET_IFNAME")


def train(fabric, out: str) -> None:
    import torch

    attestation = fabric.attest_topology()
    total = fabric.all_reduce(torch.tensor(float(fabric.global_rank)), reduce_op="sum")
    result = {
        "node": os.environ["MESHGATE_NODE_ID"],
        "rank": fabric.global_rank,
        "world_size": fabric.world_size,
        "attested_rank": attestation.rank,
        "rank_sum": float(total),
        "env": {k: os.environ.get(k) for k in SEEN},
        "check": "ok",
    }
    Path(out, f"{result['node']}.json").write_text(json.dumps(result))
    deadline = time.monotonic() + 60
    while not Path(out, "release").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    fabric.barrier()


def main() -> int:
    out = sys.argv[1]
    seen = {k: os.environ.get(k) for k in SEEN}  # before Fabric writes its own
    try:
        from meshgate.launchers.fabric import LightningFabricLauncher
        from meshgate.plan import ParallelPlan

        # "ddp": the agent started this process (LOCAL_RANK is set), Fabric starts no other.
        launcher = LightningFabricLauncher(
            ParallelPlan(dp_replicate=2),
            devices=1,
            num_nodes=2,
            accelerator="cpu",
            strategy="ddp",
            world_timeout=60,
        )
        launcher.launch(train, out)
        return 0
    except Exception:  # noqa: BLE001 - the test reads the reason
        node = os.environ.get("MESHGATE_NODE_ID", "?")
        Path(out, f"{node}.json").write_text(
            json.dumps({"node": node, "check": "failed", "env": seen, "error": traceback.format_exc()[-3000:]})
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
