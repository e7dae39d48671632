"""A worker for tests/test_fabric.py: one process of a Lightning Fabric DDP job (CPU, gloo)
that a node agent started as the job user (claimed mode: Fabric's rank is
NODE_RANK * devices + LOCAL_RANK from what the agent gives; the agent's socket vouches for
it). Verifies its attestation again against the trust bundle the agent hands the job
(MESHGATE_TRUST_BUNDLE) and writes what it saw as rank<R>.json in argv[1].

argv: OUT DEVICES NUM_NODES."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def train(fabric, out: str) -> None:
    import torch

    import meshgate
    from meshgate.attestation import TrustBundle, verify_attestation

    attestation = fabric.attest_topology()
    verified = verify_attestation(
        attestation.signed,
        TrustBundle.load(os.environ["MESHGATE_TRUST_BUNDLE"]),
        job_id=attestation.job_id,
        nonce=attestation.nonce,
        plan=fabric.meshgate_plan,
    )
    total = fabric.all_reduce(torch.tensor(float(fabric.global_rank)), reduce_op="sum")
    with open("/proc/self/cgroup", encoding="utf-8") as handle:
        cgroup = next((line[3:].strip() for line in handle if line.startswith("0::")), "")
    Path(out, f"rank{fabric.global_rank}.json").write_text(
        json.dumps(
            {
                "rank": fabric.global_rank,
                "world_size": fabric.world_size,
                "local_rank": fabric.local_rank,
                "node_rank": fabric.node_rank,
                "verified_rank": verified.rank,
                "verified_world": verified.world_size,
                "verified_local_rank": verified.local_rank,
                "job": verified.job_id,
                "node": verified.node_id,
                "coordinate": dict(verified.coordinate),
                "rank_sum": float(total),
                "plan": meshgate.current_plan().to_dict(),  # the job's, from the agent's file
                "env": {k: os.environ.get(k) for k in ("NODE_RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")},
                "uid": os.getuid(),
                "cgroup": cgroup,
            }
        )
    )


def main() -> int:
    from meshgate.launchers.fabric import LightningFabricLauncher

    out, devices, num_nodes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    # "ddp": the agent started every process (LOCAL_RANK is set), Fabric starts none. No plan:
    # the launcher takes the job's (meshgate.current_plan(), the file the agent wrote).
    launcher = LightningFabricLauncher(
        devices=devices,
        num_nodes=num_nodes,
        accelerator="cpu",
        strategy="ddp",
        world_timeout=120,
    )
    launcher.launch(train, out)
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
