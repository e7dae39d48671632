"""launchers/megatron.py: Megatron-core parallel_state from an attestation, cross-checked.

Real megatron-core on gloo (CPU). Its import costs ~6 s per process, so the plans are
grouped into two multi-process runs that initialize, check, destroy and re-initialize.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from meshgate.launchers.megatron import (
    MegatronLayout,
    MegatronPlanError,
    check_megatron_layout,
    megatron_layout,
    megatron_order,
)
from meshgate.plan import DEFAULT_ORDER, SEED_ORDER, ParallelPlan, PlanError

WORKERS = Path(__file__).resolve().parent / "workers"
_spec = importlib.util.spec_from_file_location("meshgate_test_harness", WORKERS / "harness.py")
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)

# dp_shard and dp_replicate not adjacent: Megatron's single dp axis cannot say it.
UNEXPRESSIBLE_ORDER = ("dp_shard", "tp", "dp_replicate", "cp", "pp")


# ---- the mapping, pure (no megatron import) ----------------------------------------------


def test_default_order_is_megatrons_default():
    layout = megatron_layout(ParallelPlan(tp=2, cp=2, dp_shard=2, pp=2))
    assert layout.order == "tp-cp-ep-dp-pp"
    assert layout.num_distributed_optimizer_instances == 1


def test_dp_replicate_maps_onto_distributed_optimizer_instances():
    plan = ParallelPlan(tp=2, pp=2, dp_replicate=2)
    layout = check_megatron_layout(plan)
    assert layout == MegatronLayout(
        order="tp-cp-ep-dp-pp",
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        context_parallel_size=1,
        expert_model_parallel_size=1,
        expert_tensor_parallel_size=1,
        num_distributed_optimizer_instances=2,
    )
    check_megatron_layout(ParallelPlan(dp_replicate=2, dp_shard=2, cp=2))
    check_megatron_layout(ParallelPlan(tp=2, dp_replicate=2, dp_shard=2, ep=2))


def test_seed_order_is_expressible_when_megatron_allows_it():
    plan = ParallelPlan(tp=2, cp=2, dp_shard=2, order=SEED_ORDER)
    assert check_megatron_layout(plan).order == "cp-pp-tp-ep-dp"


def test_size_one_dp_axis_may_sit_anywhere():
    plan = ParallelPlan(tp=2, dp_shard=2, order=("tp", "dp_replicate", "cp", "dp_shard", "pp"))
    with pytest.raises(PlanError):
        plan.megatron_order()
    assert megatron_order(plan) == "tp-cp-ep-dp-pp"
    check_megatron_layout(plan)


@pytest.mark.parametrize(
    "plan, needle",
    [
        (ParallelPlan(tp=2, dp_shard=2, dp_replicate=2, order=UNEXPRESSIBLE_ORDER), "one 'dp' axis"),
        (
            ParallelPlan(dp_shard=2, dp_replicate=2, order=("tp", "dp_replicate", "dp_shard", "cp", "pp")),
            "dp_shard directly inside dp_replicate",
        ),
        # cp outside dp: Megatron's intra-instance slices would not be dp_shard x cp
        (
            ParallelPlan(cp=2, dp_shard=2, dp_replicate=2, order=("tp", "dp_shard", "dp_replicate", "cp", "pp")),
            "axis 'dp_shard_cp'",
        ),
        # ep spanning dp_replicate: no inter-instance group is dp_replicate
        (ParallelPlan(dp_shard=2, dp_replicate=2, ep=4), "must divide"),
        # pp not outermost with a different expert dp size: Megatron's own assert
        (ParallelPlan(tp=2, pp=2, dp_shard=2, order=SEED_ORDER), "pp outermost"),
    ],
)
def test_unexpressible_plans_are_refused(plan, needle):
    with pytest.raises(MegatronPlanError, match=needle):
        check_megatron_layout(plan)


def test_missing_megatron_names_the_extra(monkeypatch):
    from meshgate.launchers import megatron

    monkeypatch.setitem(sys.modules, "megatron", None)
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    with pytest.raises(ImportError, match=r"meshgate.s \[megatron\] extra"):
        megatron.initialize_megatron_from(object())


# ---- multi-process runs: real megatron-core on gloo, attestations from a coordinator -----


def _cases(coordinator_factory, cases):
    out = []
    for name, plan, kind, extra in cases:
        running = coordinator_factory(plan, job_id=name)
        out.append(
            {
                "name": name,
                "kind": kind,
                "plan": plan.to_dict(),
                "coordinator": running.address,
                "job_id": running.job_id,
                "trust_bundle": str(running.trust_bundle_path),
                **extra,
            }
        )
    return out


def _assert_ok(results):
    for result in results:
        assert result.get("ok"), f"rank {result.get('local_rank')}:\n{result.get('error')}\n{result['_log']}"


def _check_megatron_case(plan: ParallelPlan, results: list[dict], name: str) -> None:
    for result in results:
        got = result["cases"][name]
        rank = got["rank"]
        assert got["mirror_ok"], (name, rank)
        assert got["layout"]["num_distributed_optimizer_instances"] == plan.dp_replicate
        axes = ["tp", "pp", "cp", "dp", "dp_cp", "dp_shard_cp", "ep", "etp", "edp"]
        if plan.dp_replicate > 1:
            axes.append("dp_replicate")
        assert sorted(got["groups"]) == sorted(axes)
        for axis in axes:
            members = list(plan.group(axis, rank))
            assert got["groups"][axis] == members, (name, rank, axis)
            assert got["ranks"][axis] == members.index(rank), (name, rank, axis)
            assert got["sums"][axis] == sum(members), (name, rank, axis)
        for axis, size in got["world_sizes"].items():
            assert size == plan.size(axis), (name, axis)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_megatron_from_coordinator_attestations(coordinator_factory, tmp_path):
    """One run of 8 workers (megatron-core's import is the cost): the 8-rank plans in
    turn (initialize, check, destroy_model_parallel), then ranks 0-3 start a 4-rank world."""
    tp_cp_dp = ParallelPlan(tp=2, cp=2, dp_shard=2)
    tp_pp_rep = ParallelPlan(tp=2, pp=2, dp_replicate=2)
    moe = ParallelPlan(tp=2, dp_shard=2, dp_replicate=2, ep=2)
    seed_ok = ParallelPlan(tp=2, cp=2, dp_shard=2, order=SEED_ORDER)
    seed_bad = ParallelPlan(tp=2, pp=2, dp_shard=2, order=SEED_ORDER)
    unexpressible = ParallelPlan(tp=2, dp_shard=2, dp_replicate=2, order=UNEXPRESSIBLE_ORDER)
    tp_dp = ParallelPlan(tp=2, dp_shard=2)
    hsdp = ParallelPlan(dp_replicate=2, dp_shard=2)
    default_order = megatron_order(ParallelPlan(order=DEFAULT_ORDER))
    phases = [
        {
            "world": 8,
            "cases": _cases(
                coordinator_factory,
                [
                    ("tp2-cp2-dp_shard2", tp_cp_dp, "megatron", {}),
                    # refused before any group is made; the run goes on afterwards
                    ("unexpressible", unexpressible, "megatron_refused", {}),
                    ("tp2-pp2-dp_replicate2", tp_pp_rep, "megatron", {}),
                    # a validly signed seed-order plan, Megatron asked for the default order
                    ("seed-order-vs-default", seed_bad, "megatron_order_override", {"order": default_order}),
                    ("ep2-tp2-hsdp", moe, "megatron", {}),
                    ("seed-order-tp2-cp2-dp_shard2", seed_ok, "megatron", {}),
                ],
            ),
        },
        {
            "world": 4,
            "cases": _cases(
                coordinator_factory,
                [
                    ("tp2-dp_shard2", tp_dp, "megatron", {}),
                    ("hsdp-dp_replicate2-dp_shard2", hsdp, "megatron", {}),
                ],
            ),
        },
    ]
    results, wall = harness.run_workers(WORKERS / "megatron_worker.py", 8, {"phases": phases}, tmp_path / "run", 540)
    print(f"\nMegatron run, 8 workers: {wall:.1f}s wall; per rank: {[r['seconds'] for r in results]}")
    _assert_ok(results)
    _check_megatron_case(tp_cp_dp, results, "tp2-cp2-dp_shard2")
    _check_megatron_case(tp_pp_rep, results, "tp2-pp2-dp_replicate2")
    _check_megatron_case(moe, results, "ep2-tp2-hsdp")
    _check_megatron_case(seed_ok, results, "seed-order-tp2-cp2-dp_shard2")
    _check_megatron_case(tp_dp, results[:4], "tp2-dp_shard2")
    _check_megatron_case(hsdp, results[:4], "hsdp-dp_replicate2-dp_shard2")
    default = ParallelPlan(tp=2, pp=2, dp_shard=2)
    for result in results:
        refused = result["cases"]["unexpressible"]
        assert refused["error"] == "MegatronPlanError", refused
        assert "one 'dp' axis" in refused["message"]
        assert refused["groups_after"] == refused["groups_before"]
        assert not refused["initialized_after"]

        bad = result["cases"]["seed-order-vs-default"]
        rank = bad["rank"]
        assert bad["error"] == "MeshMismatchError", bad
        assert bad["axis"] == "tp"  # the first axis checked
        assert bad["attested_members"] == list(seed_bad.group("tp", rank))
        assert bad["actual_members"] == list(default.group("tp", rank))
        assert bad["attested_coordinate"] == seed_bad.coordinate(rank)["tp"]
        assert bad["actual_coordinate"] == default.coordinate(rank)["tp"]
        assert "Megatron-core axis 'tp'" in bad["message"]
        assert not bad["initialized_after"]  # destroyed again before raising
