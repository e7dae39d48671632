"""A per-slot worker for tests/test_store_host.py: one process an agent started per slot.

Before it touches torch, and again once its world is formed, it tries to take the job's
store port as any local process could (bind + listen, SO_REUSEADDR as TCPStore does, on
MASTER_ADDR and on the wildcard) and records what it got: those are the seams "the
workers start" and "the store serves". Generation 0 forms its world with ``env://``,
every later one with meshgate's ``init_process_group_from`` (tcp://). Writes
``g<generation>-r<rank>.json`` in argv[1]; in generation 0 it then holds until the test
kills a worker (the generation ends, every agent stops its workers)."""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path


def squat(address: str, port: int) -> list[str]:
    """The binds that succeeded: ``address`` and the wildcard, each bound and listening."""
    taken = []
    for host in (address, "0.0.0.0"):
        with socket.socket() as squatter:
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                squatter.bind((host, port))
                squatter.listen()
                taken.append(host)
            except OSError:
                pass
    return taken


def main() -> int:
    out = Path(sys.argv[1])
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    result: dict = {"pid": os.getpid(), "master": [address, port], "squat_at_start": squat(address, port)}
    result["agent_store"] = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
    generation, rank = "x", os.environ.get("LOCAL_RANK", "?") + "-" + os.environ.get("MESHGATE_NODE_ID", "?")
    try:
        import torch
        import torch.distributed as dist

        from meshgate.client import await_world, register
        from meshgate.launchers.mesh import init_process_group_from

        att = register()
        generation, rank = att.generation, att.rank
        world = await_world(generation=att.generation, timeout=120)
        result.update(rank=att.rank, generation=att.generation, world_master=[world.master_addr, world.master_port])
        if att.generation == 0:
            result["init"] = "env://"
            dist.init_process_group(
                "gloo",
                init_method="env://",
                rank=att.rank,
                world_size=att.world_size,
                timeout=datetime.timedelta(seconds=90),
            )
        else:
            result["init"] = "init_process_group_from"
            init_process_group_from(att, world.master_addr, world.master_port, timeout_s=90)
        total = torch.tensor(float(att.rank))
        dist.all_reduce(total)
        result["rank_sum"] = float(total)
        result["squat_after_init"] = squat(address, port)
        # Code of its own that hosts a store on the master: torch makes it a client of the
        # generation's store (TORCHELASTIC_USE_AGENT_STORE): it reads what rank 1 wrote there.
        if att.rank == 1:  # a fresh store per generation: the last one's marker is not there
            client = dist.TCPStore(address, port, None, False, datetime.timedelta(seconds=30))
            result["stale_marker"] = client.check(["marker"])
            client.set("marker", f"g{generation}")
        dist.barrier()
        if att.rank == 0:
            own = dist.TCPStore(address, port, None, True, datetime.timedelta(seconds=30))
            result["own_master_store"] = own.get("marker").decode()
        dist.barrier()
        result["check"] = "ok"
    except Exception:  # noqa: BLE001 - the test reads the reason
        result["check"] = "failed"
        result["error"] = traceback.format_exc()[-3000:]
    (out / f"g{generation}-r{rank}.json").write_text(json.dumps(result))
    if result["check"] != "ok":
        return 1
    if generation == 0:
        while True:  # held: the test kills a worker, the agents stop the rest
            time.sleep(1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
