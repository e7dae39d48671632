"""A worker for tests/test_netns.py: register, gloo across hosts, DeviceMesh, all_reduce.

Launched by a node agent inside a network namespace. It takes every network setting from
the environment the agent gave it, and records them next to its result.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from pathlib import Path


def main() -> int:
    out = Path(sys.argv[1])
    node = os.environ.get("MESHGATE_NODE_ID", "?")
    local_rank = os.environ.get("LOCAL_RANK", "0")
    result: dict = {
        "node": node,
        "env": {k: os.environ.get(k) for k in ("MESHGATE_ADVERTISE_ADDR", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")},
    }
    try:
        import torch.distributed as dist

        from meshgate.client import await_world, register
        from meshgate.launchers.demo_worker import all_reduce_check
        from meshgate.launchers.mesh import device_mesh_from

        att = register()
        world = await_world(generation=att.generation, timeout=60)
        result.update(rank=att.rank, master=[world.master_addr, world.master_port])
        dist.init_process_group(
            "gloo",
            init_method=world.init_method,
            rank=att.rank,
            world_size=att.world_size,
            timeout=datetime.timedelta(seconds=30),
        )
        try:
            mesh = device_mesh_from(att, device_type="cpu")
            result["checked_axes"] = all_reduce_check(att, mesh)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        result["check"] = "ok"
    except Exception:  # noqa: BLE001 - the test reads the reason
        result["check"] = "failed"
        result["error"] = traceback.format_exc()[-3000:]
    (out / f"{node}-{local_rank}.json").write_text(json.dumps(result))
    return 0 if result["check"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
