"""Ray Train on meshgate's ranks (docs/launchers.md, "Ray Train").

    MESHGATE_COORDINATOR=head:7443 MESHGATE_TRUST_BUNDLE=trust-bundle.json \\
        python examples/ray_train.py PLAN NODES

Run where `ray.init()` reaches the Ray cluster (on its head node, or with RAY_ADDRESS set).
The launcher submits a claimed-mode job for PLAN on NODES meshgate nodes, places one Ray
Train worker per rank on the node meshgate gave that rank, and finishes the job when
``fit()`` returns. Each worker prints what Ray and meshgate say about it.
"""

from __future__ import annotations

import sys


def train_loop(config):
    import ray.train
    import torch
    import torch.distributed as dist

    from meshgate.launchers.ray import current_attestation

    attestation = current_attestation()  # verified before this loop runs
    context = ray.train.get_context()
    total = torch.tensor([attestation.rank])
    dist.all_reduce(total)  # the process group Ray Train built, on meshgate's ranks
    print(
        f"ray world rank {context.get_world_rank()} local {context.get_local_rank()} = meshgate rank "
        f"{attestation.rank} local {attestation.local_rank} on {attestation.node_id} "
        f"{attestation.coordinate} (job {attestation.job_id}; all_reduce of ranks = {int(total)})",
        flush=True,
    )


def main(argv: list[str]) -> int:
    from meshgate.launchers.ray import RayTrainLauncher
    from meshgate.plan import ParallelPlan

    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    plan = ParallelPlan.from_toml(argv[0])
    RayTrainLauncher(
        plan,
        nodes=int(argv[1]),
        topology_policy="refuse",  # the default: a TP group across nodes is refused
        train_loop_per_worker=train_loop,
        resources_per_worker={"CPU": 1},
    ).fit()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
