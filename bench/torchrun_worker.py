"""A torchrun worker of bench section 6 (bench/torchrun.py), the same for both backends:
start torch.distributed from torchrun's environment, pass one barrier (the world formed),
and write when, which rank and which node to BENCH_OUT/rank-<RANK>.json. Under meshgate's
bootstrap it also writes the signed rank."""

import json
import os
import sys
import time

import torch.distributed as dist


def main() -> int:
    dist.init_process_group("gloo")
    dist.barrier()
    formed_at = time.time()
    result = {
        "rank": int(os.environ["RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "group_rank": int(os.environ["GROUP_RANK"]),
        "node": os.environ.get("BENCH_NODE") or os.environ["MESHGATE_NODE_ID"],  # per-node: the agent's
        "formed_at": formed_at,
    }
    if "meshgate.torchrun" in sys.modules:
        result["signed_rank"] = sys.modules["meshgate.torchrun"].attestation().rank
    path = os.path.join(os.environ["BENCH_OUT"], f"rank-{result['rank']}.json")
    with open(path + ".partial", "w") as handle:
        json.dump(result, handle)
    os.replace(path + ".partial", path)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
