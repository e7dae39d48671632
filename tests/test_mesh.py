"""launchers/mesh.py: DeviceMesh from an attestation, cross-checked (real gloo, CPU)."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

from meshgate.launchers.mesh import MeshMismatchError, flattened_dims, mesh_dims
from meshgate.plan import SEED_ORDER, ParallelPlan

WORKERS = Path(__file__).resolve().parent / "workers"
_spec = importlib.util.spec_from_file_location("meshgate_test_harness", WORKERS / "harness.py")
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)


# ---- pure parts --------------------------------------------------------------------------


def test_mesh_dims_reverse_the_plan_order_and_drop_size_one_axes():
    plan = ParallelPlan(tp=2, cp=2, dp_shard=2, dp_replicate=2, pp=2)
    assert mesh_dims(plan) == [("pp", 2), ("dp_replicate", 2), ("dp_shard", 2), ("cp", 2), ("tp", 2)]
    assert mesh_dims(ParallelPlan(tp=2, dp_shard=2)) == [("dp_shard", 2), ("tp", 2)]
    seed = ParallelPlan(tp=2, pp=2, cp=2, order=SEED_ORDER)
    assert mesh_dims(seed) == [("tp", 2), ("pp", 2), ("cp", 2)]
    assert mesh_dims(ParallelPlan()) == [("dp_shard", 1)]


def test_flattened_dims_follow_torchtitan():
    hsdp = ParallelPlan(dp_replicate=2, dp_shard=2, cp=2)
    assert flattened_dims(hsdp) == {
        "dp": ("dp_replicate", "dp_shard"),
        "dp_shard_cp": ("dp_shard", "cp"),
        "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    }
    assert flattened_dims(ParallelPlan(tp=2, pp=2)) == {}
    assert flattened_dims(ParallelPlan(tp=2, dp_shard=2)) == {
        "dp": ("dp_shard",),
        "dp_shard_cp": ("dp_shard",),
        "dp_cp": ("dp_shard",),
    }
    # dp_shard outside dp_replicate: flattened in mesh order, as plan.group counts it
    odd = ParallelPlan(dp_replicate=2, dp_shard=2, order=("tp", "dp_replicate", "dp_shard", "cp", "pp"))
    assert flattened_dims(odd)["dp"] == ("dp_shard", "dp_replicate")
    assert odd.group("dp", 0) == (0, 1, 2, 3)


def test_mismatch_error_names_axis_coordinates_and_members():
    exc = MeshMismatchError(
        "tp",
        rank=1,
        attested_coordinate=0,
        actual_coordinate=1,
        attested_members=[1, 3],
        actual_members=[0, 1],
        framework="Megatron-core",
    )
    text = str(exc)
    assert "'tp'" in text and "rank 1" in text and "Megatron-core" in text
    assert "attested coordinate 0, actual coordinate 1" in text
    assert "attested members [1, 3], actual members [0, 1]" in text
    assert isinstance(exc, RuntimeError)


def test_missing_torch_names_the_extra(monkeypatch):
    from meshgate.launchers import mesh

    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    with pytest.raises(ImportError, match=r"meshgate.s \[torch\] extra"):
        mesh.device_mesh_from(types.SimpleNamespace(hardware=None))  # names no GPU: torch is the first need


def test_device_mesh_needs_torch_distributed_started():
    import torch.distributed as dist

    from meshgate.launchers.mesh import device_mesh_from

    if dist.is_initialized():  # pragma: no cover - another test left it running
        pytest.skip("torch.distributed already initialized in this process")

    class Att:
        rank, world_size, plan, hardware = 0, 1, ParallelPlan(), None

    with pytest.raises(RuntimeError, match="init_process_group_from"):
        device_mesh_from(Att())


# ---- multi-process runs on gloo, attestations from a real coordinator --------------------


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


def _check_mesh_case(plan: ParallelPlan, results: list[dict], name: str) -> None:
    expected_dims = [axis for axis, _ in mesh_dims(plan)]
    expected_flat = flattened_dims(plan)
    for result in results:
        got = result["cases"][name]
        rank = got["rank"]
        assert got["dims"] == expected_dims, (name, rank)
        assert got["shape"] == [plan.size(a) for a in expected_dims]
        assert sorted(got["flattened"]) == sorted(expected_flat), (name, rank)
        coordinate = plan.coordinate(rank)
        assert got["coordinate"] == {a: coordinate[a] for a in expected_dims}, (name, rank)
        for axis in expected_dims + list(expected_flat):
            members = list(plan.group(axis, rank))
            assert got["groups"][axis] == members, (name, rank, axis)
            assert got["sums"][axis] == sum(members), (name, rank, axis)
        for axis, index in got.get("flat_coordinate", {}).items():
            assert index == plan.group(axis, rank).index(rank)


def _assert_ok(results):
    for result in results:
        assert result.get("ok"), f"rank {result.get('local_rank')}:\n{result.get('error')}\n{result['_log']}"


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_device_mesh_from_coordinator_attestations(coordinator_factory, tmp_path):
    """One run of 8 workers: three 8-rank plans, then ranks 0-3 start a 4-rank world."""
    tp_cp_dp = ParallelPlan(tp=2, cp=2, dp_shard=2)
    tp_pp_rep = ParallelPlan(tp=2, pp=2, dp_replicate=2)
    seed8 = ParallelPlan(tp=2, cp=2, dp_shard=2, order=SEED_ORDER)
    tp_dp = ParallelPlan(tp=2, dp_shard=2)
    hsdp = ParallelPlan(dp_replicate=2, dp_shard=2)
    seed4 = ParallelPlan(tp=2, pp=2, order=SEED_ORDER)
    default4 = ParallelPlan(tp=2, pp=2)
    phases = [
        {
            "world": 8,
            "cases": _cases(
                coordinator_factory,
                [
                    ("tp2-cp2-dp_shard2", tp_cp_dp, "mesh", {}),
                    ("tp2-pp2-dp_replicate2", tp_pp_rep, "mesh", {}),
                    # a plan may ask for any order; the mesh follows it
                    ("seed-order-tp2-cp2-dp_shard2", seed8, "mesh", {}),
                ],
            ),
        },
        {
            "world": 4,
            "cases": _cases(
                coordinator_factory,
                [
                    ("tp2-dp_shard2", tp_dp, "mesh", {}),
                    ("hsdp-dp_replicate2-dp_shard2", hsdp, "mesh", {}),
                    ("hand-made-ok", tp_dp, "verify_groups", {}),
                    # hand-made groups cut in the default order, attestation in the seed's
                    ("hand-made-seed", seed4, "verify_groups", {"groups_order": list(default4.order)}),
                ],
            ),
        },
    ]
    results, wall = harness.run_workers(WORKERS / "mesh_worker.py", 8, {"phases": phases}, tmp_path / "run", 420)
    print(f"\nDeviceMesh run, 8 workers: {wall:.1f}s wall; per rank: {[r['seconds'] for r in results]}")
    _assert_ok(results)
    _check_mesh_case(tp_cp_dp, results, "tp2-cp2-dp_shard2")
    _check_mesh_case(tp_pp_rep, results, "tp2-pp2-dp_replicate2")
    _check_mesh_case(seed8, results, "seed-order-tp2-cp2-dp_shard2")
    _check_mesh_case(tp_dp, results[:4], "tp2-dp_shard2")
    _check_mesh_case(hsdp, results[:4], "hsdp-dp_replicate2-dp_shard2")
    for result in results[:4]:
        assert result["cases"]["hand-made-ok"]["verified"] == ["dp_shard", "tp"]
        bad = result["cases"]["hand-made-seed"]
        rank = bad["rank"]
        assert bad["error"] == "MeshMismatchError", bad
        # seed order puts pp inside tp; the hand-made groups have tp innermost
        assert bad["axis"] == "tp"
        assert bad["attested_members"] == list(seed4.group("tp", rank))
        assert bad["actual_members"] == list(default4.group("tp", rank))
        assert bad["attested_coordinate"] == seed4.coordinate(rank)["tp"]
        assert bad["actual_coordinate"] == default4.coordinate(rank)["tp"]
        assert "also mismatched: 'pp'" in bad["message"]
    for result in results[4:]:
        assert "tp2-dp_shard2" not in result["cases"]


# ---- in this process: a world of one rank (FileStore, no TCP) -----------------------------


def _self_signed(plan: ParallelPlan, rank: int = 0):
    import secrets
    import time

    from meshgate.attestation import (
        SigningKey,
        TrustBundle,
        build_attestation,
        sign_attestation,
        verify_attestation,
    )

    key = SigningKey.generate()
    nonce = secrets.token_bytes(16)
    message = build_attestation(
        job_id="unit",
        generation=1,
        plan=plan,
        rank=rank,
        local_rank=rank,
        node_rank=0,
        node_id="node-0",
        worker_id=f"w{rank}",
        nonce=nonce,
        issued_at=time.time(),
        ttl_s=60,
    )
    return verify_attestation(sign_attestation(message, key), TrustBundle.of(key), job_id="unit", nonce=nonce)


def test_world_of_one(tmp_path):
    import torch.distributed as dist

    from meshgate.launchers.mesh import device_mesh_from, verify_process_groups
    from meshgate.plan import PlanError

    if dist.is_initialized():  # pragma: no cover
        pytest.skip("torch.distributed already initialized in this process")
    one = _self_signed(ParallelPlan())
    with pytest.raises(PlanError, match="bogus"):
        verify_process_groups(one, {"bogus": None})  # refused before touching torch
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = device_mesh_from(one)
        assert mesh.mesh_dim_names == ("dp_shard",)
        assert list(mesh.get_coordinate()) == [0]
        verify_process_groups(one, {"dp_shard": dist.group.WORLD, "tp": dist.group.WORLD})
        # an attestation for another world: refused before any group is made
        two = _self_signed(ParallelPlan(dp_shard=2), rank=1)
        with pytest.raises(MeshMismatchError, match="axis 'world'") as info:
            device_mesh_from(two)
        assert info.value.attested_coordinate == 1 and info.value.actual_coordinate == 0
        assert info.value.attested_members == [0, 1] and info.value.actual_members == [0]
    finally:
        dist.destroy_process_group()
