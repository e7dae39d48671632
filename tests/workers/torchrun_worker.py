"""A torchrun worker for tests/test_torchrun.py, started as
``torchrun --rdzv-backend=meshgate ... -m meshgate.torchrun tests/workers/torchrun_worker.py``:
the bootstrap has registered it and checked its attestation against torchrun's placement.

It starts torch.distributed from torchrun's environment (env://, the agent's store), builds
the DeviceMesh of the attested plan (checked against the attestation), all-reduces the
ranks, and writes what torchrun and meshgate said to TR_OUT/g<generation>-r<rank>.json.
Then, by generation: in TR_FAIL_GENERATION the worker of rank TR_FAIL_RANK exits 1 (a
worker failure); in TR_HOLD_GENERATION every worker waits until torchrun stops it (the
test takes a node away); in any other generation every worker exits 0.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from meshgate import torchrun
from meshgate.launchers.mesh import device_mesh_from


def write_whole(path: str, result: dict) -> None:
    with open(path + ".partial", "w") as handle:
        json.dump(result, handle)
    os.replace(path + ".partial", path)


def main() -> int:
    att = torchrun.attestation()
    dist.init_process_group("gloo")
    mesh = device_mesh_from(att, device_type="cpu")  # raises MeshMismatchError on a mismatch
    total = torch.tensor([att.rank], dtype=torch.int64)
    dist.all_reduce(total)
    result = {
        "env": {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")},
        # What the handler exported, or not: the interface gloo uses, the agent's socket, credentials.
        "exported": {
            k: os.environ.get(k)
            for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MESHGATE_AGENT_SOCKET", "MESHGATE_ADMIN_TOKEN")
        },
        "restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
        "master": [os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]],
        "rank": att.rank,
        "node_rank": att.node_rank,
        "node_id": att.node_id,
        "local_rank": att.local_rank,
        "generation": att.generation,
        "world_size": att.world_size,
        "dist_rank": dist.get_rank(),
        "mesh_coordinate": dict(zip(mesh.mesh_dim_names, mesh.get_coordinate())),
        "coordinate": dict(att.coordinate),
        "sum": int(total.item()),
        "pid": os.getpid(),
    }
    write_whole(os.path.join(os.environ["TR_OUT"], f"g{att.generation}-r{att.rank}.json"), result)
    dist.barrier()  # every worker wrote its result before any leaves
    if str(att.generation) == os.environ.get("TR_FAIL_GENERATION") and str(att.rank) == os.environ.get("TR_FAIL_RANK"):
        return 1
    if str(att.generation) in (os.environ.get("TR_FAIL_GENERATION"), os.environ.get("TR_HOLD_GENERATION")):
        while True:  # torchrun stops this worker when it restarts the group
            time.sleep(1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
