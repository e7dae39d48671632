"""Shared start-up of the test workers.

The spec lists phases; each phase has a world size and cases (one coordinator each).
A worker takes part in the phases whose world includes its local rank: it registers
with each case's coordinator, starts torch.distributed with the first case's world,
runs the cases in turn, and tears torch.distributed down again. One JSON result per
worker, with every case's outcome and timings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any, Callable


def group_sum(dist: Any, torch: Any, group: Any, rank: int) -> int:
    """all_reduce(SUM) of the members' ranks over ``group``."""
    value = torch.tensor([rank], dtype=torch.int64)
    dist.all_reduce(value, group=group)
    return int(value.item())


def _run_phase(phase: dict, local_rank: int, run_case: Callable, result: dict) -> None:
    import torch.distributed as dist

    from meshgate.launchers.mesh import init_process_group_from
    from meshgate.client import await_world, register

    attestations = {}
    for case in phase["cases"]:
        attestations[case["name"]] = register(
            coordinator=case["coordinator"],
            job_id=case["job_id"],
            trust_bundle=case["trust_bundle"],
            node_id="node-0",
            local_rank=local_rank,
        )
    first = phase["cases"][0]
    att0 = attestations[first["name"]]
    world = await_world(
        coordinator=first["coordinator"],
        job_id=first["job_id"],
        generation=att0.generation,
        timeout=60,
    )
    init_process_group_from(att0, world.master_addr, world.master_port, timeout_s=120)
    try:
        for case in phase["cases"]:
            t0 = time.monotonic()
            att = attestations[case["name"]]
            assert att.rank == dist.get_rank(), (case["name"], att.rank, dist.get_rank())
            outcome = run_case(case, att)
            outcome["rank"] = att.rank
            result["cases"][case["name"]] = outcome
            result["seconds"][case["name"]] = round(time.monotonic() - t0, 2)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(run_case: Callable[[dict, Any], dict], started: float) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--local-rank", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with open(args.spec) as handle:
        spec = json.load(handle)
    result: dict[str, Any] = {"local_rank": args.local_rank, "cases": {}, "seconds": {}}
    result["seconds"]["import"] = round(time.monotonic() - started, 2)
    try:
        for phase in spec["phases"]:
            if args.local_rank < phase["world"]:
                _run_phase(phase, args.local_rank, run_case, result)
        result["ok"] = True
    except BaseException:  # noqa: BLE001 - everything goes back to the test
        result["error"] = traceback.format_exc()
    result["seconds"]["total"] = round(time.monotonic() - started, 2)
    with open(args.out, "w") as handle:
        json.dump(result, handle)
    # Skip the interpreter's teardown of torch/megatron (seconds on a loaded machine).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
