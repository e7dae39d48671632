"""Worker for tests/test_mesh.py: DeviceMesh and hand-made groups from an attestation."""

# ruff: noqa: E402  (imports timed from the first line)
from __future__ import annotations

import time

STARTED = time.monotonic()

import torch
import torch.distributed as dist

from common import group_sum, main

from meshgate.launchers.mesh import MeshMismatchError, device_mesh_from, verify_process_groups
from meshgate.plan import PHYSICAL_AXES, ParallelPlan


def mesh_case(att) -> dict:
    mesh = device_mesh_from(att, device_type="cpu")
    names = list(mesh.mesh_dim_names)
    flat = list(mesh._get_root_mesh()._flatten_mapping)
    coordinate = mesh.get_coordinate()
    out = {
        "dims": names,
        "shape": list(mesh.shape),
        "flattened": flat,
        "coordinate": dict(zip(names, coordinate)),
        "groups": {},
        "sums": {},
    }
    for name in names + flat:
        group = mesh.get_group(name)
        out["groups"][name] = dist.get_process_group_ranks(group)
        out["sums"][name] = group_sum(dist, torch, group, att.rank)
    # the flattened meshes are the ones TorchTitan gets back from _flatten
    for name in flat:
        out.setdefault("flat_coordinate", {})[name] = mesh._get_root_mesh()._flatten_mapping[name].get_local_rank()
    return out


def hand_made_groups(plan: ParallelPlan) -> dict:
    """One new_group per group of every physical axis of size > 1 (every rank calls all)."""
    mine = {}
    for axis in PHYSICAL_AXES:
        if plan.size(axis) == 1:
            continue
        for members in plan.groups(axis):
            group = dist.new_group(list(members))
            if dist.get_rank() in members:
                mine[axis] = group
    return mine


def verify_case(att, case: dict) -> dict:
    # Groups cut for the plan of case["groups_order"] (same sizes), checked against att.
    values = att.plan.to_dict()
    values["order"] = case.get("groups_order") or values["order"]
    groups = hand_made_groups(ParallelPlan.from_mapping(values))
    try:
        verify_process_groups(att, groups)
    except MeshMismatchError as exc:
        return {
            "error": "MeshMismatchError",
            "message": str(exc),
            "axis": exc.axis,
            "attested_coordinate": exc.attested_coordinate,
            "actual_coordinate": exc.actual_coordinate,
            "attested_members": exc.attested_members,
            "actual_members": exc.actual_members,
        }
    return {"verified": sorted(groups)}


def run_case(case: dict, att) -> dict:
    if case["kind"] == "mesh":
        return mesh_case(att)
    if case["kind"] == "verify_groups":
        return verify_case(att, case)
    raise ValueError(case["kind"])


if __name__ == "__main__":
    main(run_case, STARTED)
