"""The seed's call shapes (meshgate.launchers.compat) and the migration guide's claims.

Pure: no Ray cluster, no Fabric process, no socket. The one real run of each adapter
lives next to the native launcher's real run (tests/test_ray.py, tests/test_fabric.py),
reusing its fixtures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshgate.attestation import (
    SigningKey,
    TrustBundle,
    build_attestation,
    sign_attestation,
    verify_attestation,
)
from meshgate.launchers import ray as native_ray
from meshgate.launchers.checks import (
    GpuConflictError,
    LauncherArgumentError,
    LauncherTypeError,
    ReservedConfigKeyError,
    ResourceAmountError,
    UnsupportedPlanError,
    WorldSizeMismatchError,
    bounded_repr,
)
from meshgate.launchers.compat import LightningFabricLauncher, RayTrainLauncher
from meshgate.plan import PHYSICAL_AXES, SEED_ORDER, ParallelPlan

REPO = Path(__file__).resolve().parent.parent
SETTINGS_ENV = ("MESHGATE_COORDINATOR", "MESHGATE_JOB", "MESHGATE_TRUST_BUNDLE", "MESHGATE_NODE_ID")


def loop(config):
    pass


@pytest.fixture
def bundle_file(tmp_path):
    path = tmp_path / "trust-bundle.json"
    TrustBundle.of(SigningKey.generate(), job_id="unit").save(path)
    return path


@pytest.fixture
def env(monkeypatch, bundle_file):
    """The MESHGATE_* settings a worker host would have."""
    monkeypatch.setenv("MESHGATE_COORDINATOR", "10.0.0.9:7443")
    monkeypatch.setenv("MESHGATE_JOB", "seed-job")
    monkeypatch.setenv("MESHGATE_TRUST_BUNDLE", str(bundle_file))
    monkeypatch.delenv("MESHGATE_NODE_ID", raising=False)
    return monkeypatch


@pytest.fixture
def no_env(monkeypatch):
    for name in SETTINGS_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def ray_launcher(**kwargs):
    kwargs.setdefault("plan", ParallelPlan(dp_replicate=2))
    loop_ = kwargs.pop("train_loop_per_worker", loop)
    return RayTrainLauncher().launcher(loop_, **kwargs)


HUGE = "x" * 1_000_000


# ---- bounded reprs ----------------------------------------------------------------------------


def test_bounded_repr_cuts_long_values_and_survives_broken_reprs():
    assert bounded_repr("short") == "'short'"
    cut = bounded_repr(HUGE)
    assert len(cut) == 80 and cut.endswith("...") and cut.startswith("'xxx")

    class Broken:
        def __repr__(self):
            raise RuntimeError("no")

    assert bounded_repr(Broken()) == "<Broken with a failing repr>"


# ---- RayTrainLauncher().launch(...): the seed's argument checks, before Ray ---------------------


def test_ray_refuses_a_loop_that_is_not_callable_naming_it_with_a_bounded_value(env):
    with pytest.raises(LauncherTypeError, match=r"train_loop_per_worker must be callable, got str 'xxx") as info:
        RayTrainLauncher().launch(HUGE, plan=ParallelPlan())
    assert len(str(info.value)) < 200
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


def test_ray_refuses_a_plan_that_is_not_a_parallel_plan(env):
    for bad in ({"dp_replicate": 2}, None, "plan.toml"):
        with pytest.raises(TypeError, match=r"plan must be a meshgate.plan.ParallelPlan, got"):
            RayTrainLauncher().launch(loop, plan=bad)


def test_ray_refuses_bad_config_types_and_reserved_keys(env):
    with pytest.raises(LauncherTypeError, match=r"train_loop_config must be a dict, got list"):
        ray_launcher(train_loop_config=[("lr", 0.1)])
    with pytest.raises(LauncherTypeError, match=r"use_gpu must be a bool, got str 'yes'"):
        ray_launcher(use_gpu="yes")
    for key in native_ray.INJECTED_KEYS:
        with pytest.raises(ReservedConfigKeyError, match=rf"train_loop_config uses the reserved key\(s\) '{key}'"):
            ray_launcher(train_loop_config={"lr": 0.1, key: 1})
    many = {f"meshgate_{i:02d}": i for i in range(20)}
    with pytest.raises(ReservedConfigKeyError) as info:
        ray_launcher(train_loop_config=many)
    assert "'meshgate_07', ..." in str(info.value) and "meshgate_08" not in str(info.value)


@pytest.mark.parametrize("amount", [float("nan"), float("inf"), -float("inf"), -1, -0.5, True, False, "1", None])
def test_ray_refuses_resource_amounts_that_are_not_finite_non_negative_numbers(env, amount):
    with pytest.raises(
        ResourceAmountError, match=r"resources_per_worker\['CPU'\] must be a finite non-negative number, got"
    ):
        ray_launcher(resources_per_worker={"CPU": amount})


def test_ray_refuses_resource_names_and_containers_of_the_wrong_type(env):
    for bad in ({1: 1}, {"": 1}, {"  ": 1}):
        with pytest.raises(LauncherTypeError, match="resources_per_worker keys must be non-empty strings"):
            ray_launcher(resources_per_worker=bad)
    with pytest.raises(LauncherTypeError, match=r"resources_per_worker must be a dict .* got list"):
        ray_launcher(resources_per_worker=[("CPU", 1)])


def test_ray_gpu_and_use_gpu_must_agree_and_the_refusal_names_both(env):
    # use_gpu defaults to False here (the seed: True), so a GPU request must say so.
    with pytest.raises(GpuConflictError, match=r"resources_per_worker asks for GPU=1 but use_gpu=False"):
        ray_launcher(resources_per_worker={"CPU": 1, "GPU": 1})
    with pytest.raises(GpuConflictError, match=r"use_gpu=True but resources_per_worker sets GPU=0"):
        ray_launcher(resources_per_worker={"GPU": 0}, use_gpu=True)
    launcher = ray_launcher(resources_per_worker={"GPU": 0.5}, use_gpu=True)
    assert (launcher.use_gpu, launcher.resources_per_worker) == (True, {"GPU": 0.5})
    assert ray_launcher().use_gpu is False


def test_ray_takes_the_coordinator_from_the_environment_or_the_constructor(env, bundle_file):
    launcher = ray_launcher(plan=ParallelPlan(dp_shard=2, tp=2), train_loop_config={"lr": 0.1})
    assert isinstance(launcher, native_ray.RayTrainLauncher)
    settings = launcher.settings
    assert (settings.coordinator, settings.job_id) == ("10.0.0.9:7443", "seed-job")
    assert settings.trust_bundle_json == TrustBundle.load(bundle_file).to_json()
    assert launcher.num_workers == 4 and launcher.train_loop_config == {"lr": 0.1}
    given = RayTrainLauncher(coordinator="head:1", job_id="other").launcher(loop, plan=ParallelPlan())
    assert (given.settings.coordinator, given.settings.job_id) == ("head:1", "other")


def test_ray_without_settings_names_the_environment(no_env):
    with pytest.raises(
        LauncherArgumentError, match=r"coordinator is not set: pass coordinator= or set MESHGATE_COORDINATOR"
    ):
        RayTrainLauncher().launch(loop, plan=ParallelPlan())


# ---- LightningFabricLauncher().create(...) -------------------------------------------------------


def fabric_launcher(**kwargs):
    kwargs.setdefault("plan", ParallelPlan(dp_replicate=2))
    return LightningFabricLauncher().launcher(**kwargs)


def test_fabric_refuses_a_plan_that_is_not_a_parallel_plan(env):
    with pytest.raises(TypeError, match=r"plan must be a meshgate.plan.ParallelPlan, got dict"):
        LightningFabricLauncher().create(plan={"dp_shard": 2})


@pytest.mark.parametrize("axes", [{"tp": 2}, {"pp": 2}, {"cp": 2}, {"ep": 2, "dp_shard": 2}])
def test_fabric_refuses_model_parallel_plans_as_the_seed_did(env, axes):
    plan = ParallelPlan(**{"dp_shard": 1, **axes})
    with pytest.raises(UnsupportedPlanError, match=r"data parallelism only") as info:
        fabric_launcher(plan=plan)
    assert isinstance(info.value, NotImplementedError)  # what the seed raised


def test_fabric_refuses_hybrid_sharding_without_a_strategy(env):
    with pytest.raises(NotImplementedError, match=r"hybrid sharding .* explicit strategy"):
        fabric_launcher(plan=ParallelPlan(dp_replicate=2, dp_shard=2))


def test_fabric_devices_and_num_nodes_must_make_the_plans_world(env):
    plan = ParallelPlan(dp_replicate=4)
    with pytest.raises(WorldSizeMismatchError, match=r"devices \(3\) \* num_nodes \(1\) = 3 .* world_size 4"):
        fabric_launcher(plan=plan, devices=3)
    with pytest.raises(WorldSizeMismatchError, match=r"devices \(4\) \* num_nodes \(2\) = 8"):
        fabric_launcher(plan=plan, devices=4, num_nodes=2, node_rank=0, master_addr="h", master_port=1)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(LauncherArgumentError, match="devices must be"):
            fabric_launcher(plan=plan, devices=bad)
    for bad in (0, True, "2", 1.5):
        with pytest.raises(LauncherArgumentError, match=r"num_nodes must be an exact positive integer"):
            fabric_launcher(plan=plan, num_nodes=bad)
    with pytest.raises(LauncherArgumentError, match=r"devices must be 'auto', .* got 'gpu'"):
        fabric_launcher(plan=plan, devices="gpu")
    # the seed's "auto": the plan's world on one node; refused on several, as in the seed
    assert fabric_launcher(plan=plan, devices="auto").devices_per_node == 4
    with pytest.raises(LauncherArgumentError, match=r"devices='auto' with num_nodes=2"):
        fabric_launcher(plan=plan, devices="auto", num_nodes=2)
    assert fabric_launcher(plan=plan).devices_per_node == 4  # the default: world // num_nodes


def test_fabric_defaults_and_pass_through(env):
    assert fabric_launcher().accelerator == "cpu"  # the seed: "auto"
    launcher = fabric_launcher(plan=ParallelPlan(dp_shard=2), accelerator="cuda")  # FSDP: GPUs only
    assert launcher.strategy == "fsdp"
    assert launcher.fabric_kwargs == {"precision": "32-true"}
    assert (launcher.settings.coordinator, launcher.settings.job_id) == ("10.0.0.9:7443", "seed-job")
    launcher = fabric_launcher(accelerator="cuda", precision="bf16-mixed", strategy="ddp_spawn")
    assert (launcher.accelerator, launcher.strategy) == ("cuda", "ddp_spawn")
    assert launcher.fabric_kwargs == {"precision": "bf16-mixed"}


def test_fabric_without_settings_names_the_environment(no_env):
    with pytest.raises(LauncherArgumentError, match="MESHGATE_COORDINATOR"):
        LightningFabricLauncher().create(plan=ParallelPlan())


def test_refusals_need_neither_ray_nor_lightning(bundle_file):
    """A fresh interpreter where neither framework imports: every argument refusal still
    comes, as the launcher's own error, not an ImportError."""
    script = f"""
import sys
for name in ("ray", "lightning", "lightning_fabric", "torch"):
    sys.modules[name] = None
from meshgate.launchers.checks import LauncherArgumentError
from meshgate.launchers.compat import LightningFabricLauncher, RayTrainLauncher
from meshgate.plan import ParallelPlan
common = dict(coordinator="h:1", job_id="j", trust_bundle={str(bundle_file)!r})
calls = [
    lambda: RayTrainLauncher(**common).launch(42, plan=ParallelPlan()),
    lambda: RayTrainLauncher(**common).launch(print, plan=ParallelPlan(), resources_per_worker={{"GPU": 1}}),
    lambda: RayTrainLauncher(**common).launch(print, plan=ParallelPlan(), train_loop_config={{"meshgate_rank": 1}}),
    lambda: LightningFabricLauncher(**common).create(plan=ParallelPlan(tp=2)),
    lambda: LightningFabricLauncher(**common).create(plan=ParallelPlan(dp_shard=2), devices=3),
]
for call in calls:
    try:
        call()
    except LauncherArgumentError:
        pass
    else:
        raise SystemExit("not refused")
try:
    RayTrainLauncher(**common).launch(print, plan=ParallelPlan())
except ImportError as exc:
    assert "meshgate's [ray] extra" in str(exc), exc
else:
    raise SystemExit("no ImportError")
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


# ---- WorkerTopologyAttestation.as_dict() -> VerifiedAttestation.as_dict() ------------------------


def verified(plan: ParallelPlan, rank: int):
    key = SigningKey.generate()
    nonce = b"n" * 32
    unsigned = build_attestation(
        job_id="seed-job",
        generation=3,
        plan=plan,
        rank=rank,
        local_rank=rank % 2,
        node_rank=rank // 2,
        node_id="node-a",
        worker_id="node-a/rank1",
        nonce=nonce,
        issued_at=1_000.0,
        ttl_s=60.0,
    )
    return verify_attestation(
        sign_attestation(unsigned, key), TrustBundle.of(key), job_id="seed-job", nonce=nonce, now=1_010.0
    )


def test_as_dict_keeps_the_seeds_keys_and_adds_what_is_signed():
    plan = ParallelPlan(dp_replicate=2, tp=2, pp=2, cp=2)
    attestation = verified(plan, 1)
    as_dict = attestation.as_dict()
    assert list(as_dict)[:3] == ["rank", "world_size", "coordinate"]  # the seed's keys, first
    assert (as_dict["rank"], as_dict["world_size"]) == (1, 16)
    assert list(as_dict["coordinate"]) == list(PHYSICAL_AXES)  # the seed's key order too
    assert as_dict["coordinate"] == plan.coordinate(1) == {"dp_replicate": 0, "dp_shard": 0, "tp": 1, "pp": 0, "cp": 0}
    assert as_dict["job_id"] == "seed-job" and as_dict["generation"] == 3
    assert (as_dict["local_rank"], as_dict["node_rank"], as_dict["node_id"]) == (1, 0, "node-a")
    assert as_dict["plan"] == plan.to_dict() and as_dict["plan_digest"] == plan.digest().hex()
    assert as_dict["key_id"] == attestation.key_id
    assert (as_dict["issued_at"], as_dict["expires_at"]) == (1_000.0, 1_060.0)
    assert "nonce" not in as_dict and "signed" not in as_dict
    assert json.loads(json.dumps(as_dict)) == as_dict  # plain data


# ---- the axis order: the seed's, ours, and how to keep the seed's ------------------------------


def seed_coordinate(plan: ParallelPlan, rank: int) -> dict[str, int]:
    """The seed's rule, restated: axes listed dp_replicate, dp_shard, tp, pp, cp; the last
    one (cp) varies fastest."""
    out, remainder = {}, rank
    for axis in reversed(PHYSICAL_AXES):
        size = getattr(plan, axis)
        out[axis] = remainder % size
        remainder //= size
    assert remainder == 0
    return {axis: out[axis] for axis in PHYSICAL_AXES}


@pytest.mark.parametrize(
    "sizes",
    [
        dict(dp_replicate=2, tp=2, pp=2, cp=2),
        dict(dp_replicate=3, dp_shard=2, tp=4),
        dict(dp_shard=2, pp=3, cp=2),
        dict(tp=8),
    ],
)
def test_order_seed_order_reproduces_the_seeds_coordinates(sizes):
    plan = ParallelPlan(**sizes, order=SEED_ORDER)
    for rank in range(plan.world_size):
        assert plan.coordinate(rank) == seed_coordinate(plan, rank)
        assert plan.rank(seed_coordinate(plan, rank)) == rank


def worked_example_rows() -> list[str]:
    """The rows of the guide's worked example, computed here."""
    ours = ParallelPlan(dp_replicate=2, tp=2, pp=2, cp=2)
    seed = ParallelPlan(dp_replicate=2, tp=2, pp=2, cp=2, order=SEED_ORDER)
    axes = ("dp_replicate", "pp", "tp", "cp")

    def cell(coordinate):
        return " ".join(f"{a}={coordinate[a]}" for a in axes)

    return [
        f"| {rank} | {cell(seed.coordinate(rank))} | {cell(ours.coordinate(rank))} |" for rank in (0, 1, 2, 3, 4, 8, 13)
    ]


def test_the_migration_guide_shows_what_the_code_computes():
    guide = (REPO / "docs" / "migrating-from-training-launchers.md").read_text()
    for row in worked_example_rows():
        assert row in guide, f"missing or stale row: {row}"
    assert worked_example_rows()[1] == "| 1 | dp_replicate=0 pp=0 tp=0 cp=1 | dp_replicate=0 pp=0 tp=1 cp=0 |"
    ours = ParallelPlan(dp_replicate=2, tp=2, pp=2, cp=2)
    seed = ParallelPlan(dp_replicate=2, tp=2, pp=2, cp=2, order=SEED_ORDER)
    assert f"TP groups {_groups(ours.groups('tp')[:4])}" in guide
    assert f"TP groups {_groups(seed.groups('tp')[:4])}" in guide


def _groups(groups) -> str:
    return ", ".join("{" + ",".join(map(str, g)) + "}" for g in groups) + ", …"


# The shared design file and the workspace path outside this repository, spelled in parts so
# that this test (which scans itself too) does not refer to them.
OUTSIDE_REFERENCES = ("DESIGN" + ".md", "/work/" + "shared")


def test_the_design_doc_exists_and_nothing_refers_outside_the_repository():
    design = (REPO / "docs" / "design.md").read_text()
    for needed in (
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0",
        "RAY_AUTH_MODE=disabled",
        "include_dashboard=False",
        'RES_OPTIONS="timeout:1 attempts:1"',
        "reverse-DNS",
    ):
        assert needed in design, needed
    offenders = []
    for path in sorted(REPO.rglob("*")):
        parts = path.relative_to(REPO).parts
        if not path.is_file() or parts[0] in (".venv", ".git", "build") or "__pycache__" in parts:
            continue
        if path.suffix not in (".py", ".md", ".toml", ".txt", ".cfg", ".service", ".sh", ""):
            continue
        text = path.read_text(errors="replace")
        if any(outside in text for outside in OUTSIDE_REFERENCES):
            offenders.append(str(path.relative_to(REPO)))
    assert not offenders, offenders
