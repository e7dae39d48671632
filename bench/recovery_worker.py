"""A worker of the real-process recovery bench (bench/recovery_torchrun.py), the same for
torchrun on c10d and for meshgate's agents: form the world (gloo), pass a first barrier,
write one record of it, then all_reduce every 0.1 s until some rank sees BENCH_STOP (all exit 0 together). A
peer that died breaks the collective: the worker exits 1, as a training step would, and
its launcher (torchrun's agent, or meshgate's) starts the next round.

Under torchrun (RANK in the environment) the world comes from torchrun's rendezvous and
the round is its store's port; launched by a meshgate agent, the worker
registers (vouched by its agent), awaits the world and starts torch.distributed with the
attested rank, and the round is the generation. The record, BENCH_OUT/<rank>-<pid>.json:
round, rank, world size, node, pid and when the barrier returned.
"""

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=120)


def join() -> tuple[str, str]:
    """Start torch.distributed; the round (a key the whole world shares) and this worker's node."""
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo", timeout=TIMEOUT)
        # Not TORCHELASTIC_RESTART_COUNT: a node restarted because another node joined keeps
        # its count. Each round's store gets a port of its own (TORCH_DISABLE_SHARE_RDZV_TCP_STORE).
        return f"store {os.environ['MASTER_PORT']}", os.environ["BENCH_NODE"]
    from meshgate.client import await_world, register

    att = register()
    world = await_world(generation=att.generation, timeout=120)
    dist.init_process_group(
        "gloo", init_method=world.init_method, rank=att.rank, world_size=att.world_size, timeout=TIMEOUT
    )
    return f"generation {att.generation}", att.node_id


def main() -> int:
    round_, node = join()
    dist.barrier()
    record = {
        "round": round_,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "node": node,
        "pid": os.getpid(),
        "formed_at": time.time(),
    }
    path = os.path.join(os.environ["BENCH_OUT"], f"{record['rank']}-{record['pid']}.json")
    with open(path + ".partial", "w") as handle:
        json.dump(record, handle)
    os.replace(path + ".partial", path)
    stop = os.environ["BENCH_STOP"]
    while True:  # every rank stops in the same step: one that left early would break the others'
        value = torch.tensor([1.0 if os.path.exists(stop) else 0.0])
        try:
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        except RuntimeError:  # a peer is gone: this round is over
            return 1
        if value.item() > 0:
            dist.destroy_process_group()
            return 0
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
