"""A worker for tests/test_jobs_cluster.py: one process of a Lightning Fabric job that a
jobs-mode agent launched (claimed mode: Fabric picks the rank; the agent's socket vouches
for it and says which meshgate node this is). Writes what it saw as rank<R>.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def train(fabric, out: str) -> None:
    import torch

    import meshgate

    attestation = fabric.attest_topology()
    total = fabric.all_reduce(torch.tensor(float(fabric.global_rank)), reduce_op="sum")
    Path(out, f"rank{fabric.global_rank}.json").write_text(
        json.dumps(
            {
                "rank": fabric.global_rank,
                "world_size": fabric.world_size,
                "attested_rank": attestation.rank,
                "job": attestation.job_id,
                "node": attestation.node_id,
                "rank_sum": float(total),
                "plan": meshgate.current_plan().to_dict(),  # the job's, from the agent's file
                "attested_plan": attestation.plan.to_dict(),
            }
        )
    )


def main() -> int:
    from meshgate.launchers.fabric import LightningFabricLauncher

    # "ddp": the agent started both processes (LOCAL_RANK is set), Fabric starts none. No plan:
    # the launcher takes the job's (meshgate.current_plan(), the file the agent wrote).
    launcher = LightningFabricLauncher(
        devices=2,
        num_nodes=1,
        accelerator="cpu",
        strategy="ddp",
        world_timeout=60,
    )
    launcher.launch(train, sys.argv[1])
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # The result is on disk: skip the interpreter's C++ teardown, where torch's gloo threads
    # occasionally abort ("terminate called without an active exception", exit -6).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
