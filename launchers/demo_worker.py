"""The demo's worker: register, verify, init_process_group, build the mesh, check it.

Run by ``meshgate demo`` through launchers/local.py, and by the deploying guide's jobs;
writes one JSON result per rank, and prints what it verified and checked to its output,
so `meshgate job logs` shows it: the signed claims (rank, coordinate, generation, key),
every check that passed, and the attestation itself in base64 (`meshgate verify` takes it
from a file, offline, against the trust bundle).
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import sys
import time
import traceback


def all_reduce_check(att, mesh) -> list[str]:
    """Sum the ranks over each mesh dimension; it must equal the plan group's sum."""
    import torch
    import torch.distributed as dist

    checked = []
    for axis in mesh.mesh_dim_names or ():
        members = att.plan.group(axis, att.rank)
        value = torch.tensor([att.rank], dtype=torch.int64)
        dist.all_reduce(value, group=mesh.get_group(axis))
        if int(value.item()) != sum(members):
            raise RuntimeError(
                f"all_reduce over {axis} gave {int(value.item())}, expected sum{list(members)} = {sum(members)}"
            )
        checked.append(axis)
    return checked


def run(out_dir: str, megatron: bool) -> dict:
    started = time.monotonic()
    from meshgate.client import await_world, register

    result: dict = {
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "node": os.environ.get("MESHGATE_NODE_ID", ""),
    }
    att = register()
    result.update(
        rank=att.rank,
        node=att.node_id,
        node_rank=att.node_rank,
        coordinate=dict(att.coordinate),
        generation=att.generation,
        job=att.job_id,
        # what `meshgate verify` (or a test) re-checks offline
        attestation=att.signed.SerializeToString().hex(),
        attestation_b64=base64.b64encode(att.signed.SerializeToString()).decode(),
        nonce=att.nonce.hex(),
    )
    world = await_world(generation=att.generation, timeout=120)

    import torch.distributed as dist

    from meshgate.launchers.mesh import device_mesh_from

    dist.init_process_group(
        "gloo",
        init_method=world.init_method,
        rank=att.rank,
        world_size=att.world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        mesh = device_mesh_from(att, device_type="cpu")  # cross-checks every dimension
        result["checked_axes"] = all_reduce_check(att, mesh)
        if megatron:
            from meshgate.launchers.megatron import initialize_megatron_from

            initialize_megatron_from(att)
            result["megatron"] = "ok"
        dist.barrier()
    finally:
        dist.destroy_process_group()
    result["seconds"] = round(time.monotonic() - started, 2)
    print(verified_lines(att, result), flush=True)
    return result


def verified_lines(att, result: dict) -> str:
    """What this rank verified and checked, as `meshgate job logs` shows it."""
    checks = [
        "attestation signature, job, generation and nonce (verified before anything was built)",
        f"DeviceMesh built from it matches the plan on {', '.join(result['checked_axes']) or 'every axis'} "
        "(an all_reduce per axis summed the expected ranks)",
        f"gloo world of {att.world_size} ranks formed and passed a barrier",
    ]
    if result.get("megatron") == "ok":
        checks.append("megatron-core's groups agree with the attestation")
    return "\n".join(
        [
            f"rank {att.rank} VERIFIED: {att.describe()}",
            *(f"  check passed: {check}" for check in checks),
            f"  attestation (base64; meshgate verify FILE --trust-bundle B): {result['attestation_b64']}",
        ]
    )


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--megatron", action="store_true")
    args = parser.parse_args()
    local_rank = os.environ.get("LOCAL_RANK", "0")
    node = os.environ.get("MESHGATE_NODE_ID", "node")
    try:
        result = run(args.out, args.megatron)
        result["check"] = "ok"
        code = 0
    except Exception as exc:  # report any failure as this rank's result, then fail
        result = {"node": node, "local_rank": int(local_rank), "check": f"FAILED: {type(exc).__name__}: {exc}"}
        traceback.print_exc()
        code = 1
    path = os.path.join(args.out, f"{node}-{local_rank}.json")
    with open(path, "w") as handle:
        json.dump(result, handle)
    return code


if __name__ == "__main__":
    code = main()
    # The result is on disk and the process group destroyed: skip the interpreter's C++
    # teardown, where torch's background threads occasionally abort ("terminate called
    # without an active exception", exit -6) after a verified run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
