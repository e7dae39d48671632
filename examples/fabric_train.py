"""Lightning Fabric as a meshgate job (docs/launchers.md, "Lightning Fabric").

    meshgate job submit --mode claimed --plan PLAN --nodes N -- python examples/fabric_train.py N

Each node's agent starts one process per slot (LOCAL_RANK, MASTER_ADDR/PORT, NODE_RANK set);
the launcher takes the job's plan from the agent (``meshgate.current_plan()``), and every
process registers Fabric's rank, vouched by its agent, before ``train`` runs.
"""

from __future__ import annotations

import sys


def train(fabric) -> None:
    import torch

    attestation = fabric.attest_topology()  # verified before train runs
    total = fabric.all_reduce(torch.tensor(float(fabric.global_rank)), reduce_op="sum")
    print(
        f"fabric rank {fabric.global_rank} = meshgate rank {attestation.rank} on {attestation.node_id} "
        f"{attestation.coordinate} (job {attestation.job_id}; all_reduce of ranks = {int(total)})",
        flush=True,
    )


def main(argv: list[str]) -> int:
    import os

    from meshgate.launchers.fabric import LightningFabricLauncher

    num_nodes = int(argv[0]) if argv else 1
    launcher = LightningFabricLauncher(  # no plan: the job's
        num_nodes=num_nodes,
        accelerator="cpu",
        strategy="ddp",  # the agent started the processes; Fabric starts none
    )
    launcher.launch(train)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip torch's gloo teardown at exit, which can abort after a finished run


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
