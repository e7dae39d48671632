"""Worker for tests/test_megatron.py: Megatron-core parallel_state from an attestation.

One process runs several plans in turn: initialize, check, destroy_model_parallel(),
next plan (megatron-core's import costs ~6 s per process).
"""

# ruff: noqa: E402  (imports timed from the first line)
from __future__ import annotations

import time

STARTED = time.monotonic()

import torch
import torch.distributed as dist

from common import group_sum, main

from meshgate.launchers.megatron import (
    MegatronPlanError,
    _rank_groups,
    initialize_megatron_from,
    megatron_layout,
)
from meshgate.launchers.mesh import MeshMismatchError
from megatron.core import parallel_state as ps

KWARGS = {"distributed_timeout_minutes": 2}


def megatron_groups(att) -> dict:
    """Megatron's groups and ranks, by plan axis, through its own accessors."""
    accessors = {
        "tp": (ps.get_tensor_model_parallel_group, ps.get_tensor_model_parallel_rank),
        "pp": (ps.get_pipeline_model_parallel_group, ps.get_pipeline_model_parallel_rank),
        "cp": (ps.get_context_parallel_group, ps.get_context_parallel_rank),
        "dp": (ps.get_data_parallel_group, ps.get_data_parallel_rank),
        "dp_cp": (
            lambda: ps.get_data_parallel_group(with_context_parallel=True),
            lambda: ps.get_data_parallel_rank(with_context_parallel=True),
        ),
        "dp_shard_cp": (
            lambda: ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True),
            lambda: ps.get_data_parallel_rank(with_context_parallel=True, partial_data_parallel=True),
        ),
        "ep": (ps.get_expert_model_parallel_group, ps.get_expert_model_parallel_rank),
        "etp": (ps.get_expert_tensor_parallel_group, ps.get_expert_tensor_parallel_rank),
        "edp": (ps.get_expert_data_parallel_group, ps.get_expert_data_parallel_rank),
    }
    if att.plan.dp_replicate > 1:
        accessors["dp_replicate"] = (
            ps.get_inter_distributed_optimizer_instance_group,
            lambda: dist.get_rank(ps.get_inter_distributed_optimizer_instance_group()),
        )
    out = {"groups": {}, "ranks": {}, "sums": {}}
    for axis, (group_of, rank_of) in accessors.items():
        group = group_of()
        out["groups"][axis] = dist.get_process_group_ranks(group)
        out["ranks"][axis] = rank_of()
        out["sums"][axis] = group_sum(dist, torch, group, att.rank)
    out["world_sizes"] = {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
    }
    return out


def mirror_matches_megatron(att) -> bool:
    """meshgate.launchers.megatron's rank-group mirror equals Megatron's RankGenerator here."""
    layout = megatron_layout(att.plan)
    plan, world = att.plan, att.plan.world_size
    dp = world // (plan.tp * plan.pp * plan.cp)
    edp = world // (plan.etp * plan.ep * plan.pp)
    decoder = {"tp": plan.tp, "ep": 1, "dp": dp, "pp": plan.pp, "cp": plan.cp}
    expert = {"tp": plan.etp, "ep": plan.ep, "dp": edp, "pp": plan.pp, "cp": 1}
    for sizes, tokens in ((decoder, ["tp", "pp", "cp", "dp", "dp-cp", "tp-pp"]), (expert, ["tp", "ep", "dp", "pp"])):
        generator = ps.RankGenerator(order=layout.order, **sizes)
        for token in tokens:
            if generator.get_ranks(token) != _rank_groups(world, sizes, layout.order, token):
                return False
    return True


def run_case(case: dict, att) -> dict:
    kind = case["kind"]
    if kind == "megatron":
        layout = initialize_megatron_from(att, **KWARGS)
        out = megatron_groups(att)
        out["layout"] = layout.kwargs()
        out["mirror_ok"] = mirror_matches_megatron(att)
        ps.destroy_model_parallel()
        return out
    if kind == "megatron_order_override":
        try:
            initialize_megatron_from(att, order=case["order"], **KWARGS)
        except MeshMismatchError as exc:
            return {
                "error": "MeshMismatchError",
                "message": str(exc),
                "axis": exc.axis,
                "attested_coordinate": exc.attested_coordinate,
                "actual_coordinate": exc.actual_coordinate,
                "attested_members": exc.attested_members,
                "actual_members": exc.actual_members,
                "initialized_after": ps.model_parallel_is_initialized(),
            }
        ps.destroy_model_parallel()
        return {"error": None}
    if kind == "megatron_refused":
        from torch.distributed import distributed_c10d as c10d

        before = len(c10d._world.pg_map)
        try:
            initialize_megatron_from(att, **KWARGS)
        except MegatronPlanError as exc:
            return {
                "error": "MegatronPlanError",
                "message": str(exc),
                "groups_before": before,
                "groups_after": len(c10d._world.pg_map),
                "initialized_after": ps.model_parallel_is_initialized(),
            }
        ps.destroy_model_parallel()
        return {"error": None}
    raise ValueError(kind)


if __name__ == "__main__":
    main(run_case, STARTED)
