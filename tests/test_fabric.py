"""LightningFabricLauncher: the plan checks (no lightning needed) and a real Fabric run
(ddp_fork, 2 CPU processes) whose ranks hold verified attestations from a real
coordinator process. ddp_fork, not ddp_spawn: a spawned process re-imports torch and
lightning (10+ s each on 2 cores); that spawn can unpickle what it is given is checked
in-process instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import shipped
from meshgate import admin
from meshgate.launchers.fabric import FabricTopologyError, LightningFabricLauncher, current_attestation
from meshgate.attestation import TrustBundle, verify_attestation
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb
from shipped import ShippedCluster

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def bundle_file(tmp_path):
    """A trust bundle file for launchers that never reach a coordinator."""
    from meshgate.attestation import SigningKey

    path = tmp_path / "trust-bundle.json"
    TrustBundle.of(SigningKey.generate(), job_id="unit").save(path)
    return path


def make(plan, bundle_file, **kwargs):
    kwargs.setdefault("coordinator", "127.0.0.1:1")
    kwargs.setdefault("job_id", "unit")
    return LightningFabricLauncher(plan, trust_bundle=str(bundle_file), **kwargs)


# ---- refusals (before lightning is touched) ------------------------------------------------


@pytest.mark.parametrize("axis", ["tp", "pp", "cp"])
def test_model_parallel_axes_are_refused_by_name(bundle_file, axis):
    plan = ParallelPlan(dp_shard=2, **{axis: 2})
    with pytest.raises(ValueError, match=rf"data parallelism only.*{axis}=2"):
        make(plan, bundle_file, devices=4)


def test_expert_axes_are_refused_by_name(bundle_file):
    plan = ParallelPlan(dp_shard=4, ep=2)
    with pytest.raises(ValueError, match=r"ep=2"):
        make(plan, bundle_file, devices=4)
    plan = ParallelPlan(dp_shard=2, tp=2, etp=2)
    with pytest.raises(ValueError, match=r"tp=2, etp=2"):
        make(plan, bundle_file, devices=4)


def test_devices_times_nodes_must_equal_world(bundle_file):
    plan = ParallelPlan(dp_replicate=4)
    with pytest.raises(ValueError, match=r"devices \(3\) \* num_nodes \(1\) = 3 .* world_size 4"):
        make(plan, bundle_file, devices=3)
    with pytest.raises(ValueError, match=r"devices \(4\) \* num_nodes \(2\) = 8 .* world_size 4"):
        make(plan, bundle_file, devices=4, num_nodes=2, node_rank=0, master_addr="h", master_port=1)
    with pytest.raises(ValueError, match=r"devices \(1\) \* num_nodes \(2\) = 2"):
        make(plan, bundle_file, devices=[0], num_nodes=2, node_rank=0, master_addr="h", master_port=1)
    for bad in ("auto", -1, 0, True, 2.0):
        with pytest.raises(ValueError, match="devices must be"):
            make(plan, bundle_file, devices=bad)
    with pytest.raises(ValueError, match="num_nodes"):
        make(plan, bundle_file, devices=4, num_nodes=0)
    with pytest.raises(ValueError, match="not divisible by num_nodes 3"):
        make(plan, bundle_file, num_nodes=3)
    # devices defaults to world_size / num_nodes
    assert make(plan, bundle_file).devices_per_node == 4


def test_hybrid_sharding_needs_an_explicit_strategy(bundle_file):
    plan = ParallelPlan(dp_replicate=2, dp_shard=2)
    with pytest.raises(ValueError, match=r"hybrid sharding \(dp_replicate=2 x dp_shard=2\).*explicit strategy"):
        make(plan, bundle_file, devices=4)
    launcher = make(plan, bundle_file, devices=4, strategy="hybrid-by-caller")
    assert launcher.strategy == "hybrid-by-caller"


def test_strategy_defaults_and_checks(bundle_file):
    assert make(ParallelPlan(dp_shard=2), bundle_file, accelerator="cuda").strategy == "fsdp"
    assert make(ParallelPlan(dp_replicate=2), bundle_file).strategy == "ddp"
    assert make(ParallelPlan(dp_replicate=2), bundle_file, strategy="ddp_spawn").strategy == "ddp_spawn"
    with pytest.raises(ValueError, match="runs one process"):
        make(ParallelPlan(dp_replicate=2), bundle_file, strategy="single_device")
    with pytest.warns(UserWarning, match="replicates the model"):
        make(ParallelPlan(dp_shard=2), bundle_file, strategy="ddp")


def test_fsdp_on_cpu_is_refused_before_any_rank_naming_the_remedy(bundle_file):
    """Lightning refuses FSDP on CPU inside every worker once the job runs; the launcher
    refuses it first, in one line naming both ways out."""
    for strategy in (None, "fsdp"):
        with pytest.raises(ValueError) as refused:
            make(ParallelPlan(dp_shard=2), bundle_file, strategy=strategy)  # accelerator defaults to "cpu"
        message = str(refused.value)
        assert "\n" not in message and "strategy 'fsdp' (dp_shard=2) needs accelerator='cuda'" in message, message
        assert "pass accelerator='cuda'" in message and "dp_replicate=2 and dp_shard=1 (strategy 'ddp')" in message
    assert make(ParallelPlan(dp_shard=2), bundle_file, accelerator="gpu").strategy == "fsdp"
    assert make(ParallelPlan(dp_replicate=2), bundle_file).strategy == "ddp"  # CPU DDP is fine


def test_multi_node_takes_its_assignment_from_args_or_env(bundle_file, monkeypatch):
    plan = ParallelPlan(dp_replicate=4)
    for name in ("MESHGATE_NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="MESHGATE_NODE_RANK"):
        make(plan, bundle_file, num_nodes=2)
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT"):
        make(plan, bundle_file, num_nodes=2, node_rank=1)
    with pytest.raises(ValueError, match=r"node_rank 2 out of range \[0, 2\)"):
        make(plan, bundle_file, num_nodes=2, node_rank=2, master_addr="h", master_port=1)
    monkeypatch.setenv("MESHGATE_NODE_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29555")
    launcher = make(plan, bundle_file, num_nodes=2)
    assert (launcher.node_rank, launcher.master_addr, launcher.master_port) == (1, "10.0.0.1", 29555)
    assert launcher.devices_per_node == 2
    monkeypatch.setenv("MASTER_PORT", "http")
    with pytest.raises(ValueError, match="master_port must be an integer"):
        make(plan, bundle_file, num_nodes=2)


def test_missing_settings_name_the_environment(bundle_file, monkeypatch):
    for name in ("MESHGATE_COORDINATOR", "MESHGATE_JOB", "MESHGATE_TRUST_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    plan = ParallelPlan(dp_replicate=2)
    with pytest.raises(ValueError, match="MESHGATE_COORDINATOR"):
        LightningFabricLauncher(plan, job_id="j", trust_bundle=str(bundle_file))
    with pytest.raises(ValueError, match="MESHGATE_JOB"):
        LightningFabricLauncher(plan, coordinator="h:1", trust_bundle=str(bundle_file))
    with pytest.raises(Exception, match="MESHGATE_TRUST_BUNDLE"):
        LightningFabricLauncher(plan, coordinator="h:1", job_id="j")


def test_checks_run_without_lightning_and_building_names_the_extra(bundle_file):
    """In a fresh interpreter where lightning cannot be imported: the checks still work,
    and building the Fabric raises an ImportError naming the extra."""
    script = f"""
import sys
sys.modules["lightning"] = None
sys.modules["lightning_fabric"] = None
from meshgate.launchers.fabric import LightningFabricLauncher
from meshgate.plan import ParallelPlan
try:
    LightningFabricLauncher(ParallelPlan(dp_shard=2, tp=2), coordinator="h:1", job_id="j",
                            trust_bundle={str(bundle_file)!r}, devices=4)
except ValueError as exc:
    assert "tp=2" in str(exc), exc
else:
    raise SystemExit("tp=2 was not refused")
launcher = LightningFabricLauncher(ParallelPlan(dp_replicate=2), coordinator="h:1",
                                   job_id="j", trust_bundle={str(bundle_file)!r})
try:
    launcher.fabric()
except ImportError as exc:
    assert "meshgate's [lightning] extra" in str(exc) and "pip install 'lightning" in str(exc), exc
else:
    raise SystemExit("no ImportError")
assert "torch" not in sys.modules, "the checks imported torch"
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_attestation_before_launch_is_a_clear_error(bundle_file):
    launcher = make(ParallelPlan(dp_replicate=2), bundle_file, strategy="ddp_spawn")
    fabric = launcher.fabric()
    with pytest.raises(FabricTopologyError, match=r"call fabric.launch\(fn\) first"):
        fabric.attest_topology()
    with pytest.raises(FabricTopologyError, match="launch"):
        fabric.meshgate_attestation
    with pytest.raises(FabricTopologyError, match="no meshgate attestation in this process"):
        current_attestation()
    with pytest.raises(FabricTopologyError, match="before the launched function runs"):
        launcher.attest_topology()
    with pytest.raises(TypeError, match="needs a callable"):
        fabric.launch(42)
    with pytest.raises(TypeError, match="at least one argument"):
        fabric.launch(lambda: None)


def test_fabric_pickles_by_reference_for_spawned_processes(bundle_file):
    """ddp_spawn pickles the Fabric and the wrapped function into each process."""
    import pickle

    from meshgate.launchers.fabric import MeshgateFabric, _AttestedCall

    fabric = make(ParallelPlan(dp_replicate=2), bundle_file, strategy="ddp_spawn").fabric()
    assert isinstance(fabric, MeshgateFabric)
    clone = pickle.loads(pickle.dumps(fabric))
    assert type(clone) is MeshgateFabric and clone.meshgate_plan == fabric.meshgate_plan
    call = pickle.loads(pickle.dumps(_AttestedCall(record_attestation)))
    assert call.function is record_attestation


# ---- a real Fabric (ddp_fork, 2 CPU processes) against a real coordinator ------------------


def record_attestation(fabric, out_dir: str, bundle_path: str) -> int:
    """Runs in each spawned process (module level: spawn pickles it by reference)."""
    attestation = fabric.attest_topology()
    assert attestation is current_attestation()
    # Re-verify independently: signature, job, nonce, plan digest, coordinate.
    verified = verify_attestation(
        attestation.signed,
        TrustBundle.load(bundle_path),
        job_id=attestation.job_id,
        nonce=attestation.nonce,
        plan=fabric.meshgate_plan,
    )
    import torch

    total = fabric.all_reduce(torch.tensor(float(fabric.global_rank)), reduce_op="sum")
    result = {
        "global_rank": fabric.global_rank,
        "world_size": fabric.world_size,
        "local_rank": fabric.local_rank,
        "attested_rank": verified.rank,
        "attested_world": verified.world_size,
        "attested_local_rank": verified.local_rank,
        "node_id": verified.node_id,
        "coordinate": dict(verified.coordinate),
        "rank_sum": float(total),
    }
    Path(out_dir, f"rank{fabric.global_rank}.json").write_text(json.dumps(result))
    return fabric.global_rank


def must_not_run(fabric, out_dir: str) -> None:
    Path(out_dir, f"ran{fabric.global_rank}").write_text("user code ran")


@pytest.fixture
def spawn_env():
    """The environment the launched processes inherit (docs/design.md: reverse-DNS stalls).

    Fabric itself writes MASTER_PORT, LOCAL_RANK, WORLD_SIZE... into this process's
    environment, so the whole environment is put back afterwards."""
    saved = dict(os.environ)
    os.environ.update(
        {
            "RES_OPTIONS": "timeout:1 attempts:1",
            "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": "lo",
            "MASTER_ADDR": "127.0.0.1",
            "PYTHONWARNINGS": "ignore",
        }
    )
    for name in ("MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "MESHGATE_NODE_RANK", "MESHGATE_RANK"):
        os.environ.pop(name, None)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.slow
def test_fabric_ranks_hold_verified_attestations(coordinator_factory, tmp_path, spawn_env):
    plan = ParallelPlan(dp_replicate=2)
    coordinator = coordinator_factory(plan, job_id="fabric")
    out = tmp_path / "out"
    out.mkdir()
    launcher = LightningFabricLauncher(
        plan,
        coordinator=coordinator.address,
        job_id=coordinator.job_id,
        trust_bundle=str(coordinator.trust_bundle_path),
        devices=2,
        accelerator="cpu",
        strategy="ddp_fork",
        node_id="fabric-node",
        world_timeout=60,
    )
    fabric = launcher.fabric()
    returned = fabric.launch(record_attestation, str(out), str(coordinator.trust_bundle_path))
    assert returned == 0  # rank 0's return value

    results = {r["global_rank"]: r for r in (json.loads(p.read_text()) for p in out.glob("rank*.json"))}
    assert sorted(results) == [0, 1], coordinator.log()
    for rank, result in results.items():
        assert result["attested_rank"] == result["global_rank"] == rank
        assert result["attested_world"] == result["world_size"] == 2
        assert result["attested_local_rank"] == result["local_rank"] == rank
        assert result["node_id"] == "fabric-node"
        assert result["coordinate"] == plan.coordinate(rank)
        assert result["rank_sum"] == 1.0
    # The parent is no rank: it holds no attestation.
    with pytest.raises(FabricTopologyError):
        fabric.attest_topology()


@pytest.mark.slow
def test_launch_without_a_function_attests_this_process(coordinator_factory, spawn_env):
    """Script launchers ("ddp") return from launch() in every process: it attests there."""
    import torch.distributed as dist

    plan = ParallelPlan()  # one rank: Fabric starts no other process
    coordinator = coordinator_factory(plan, job_id="fabric")
    launcher = LightningFabricLauncher(
        plan,
        coordinator=coordinator.address,
        job_id=coordinator.job_id,
        trust_bundle=str(coordinator.trust_bundle_path),
        strategy="ddp",
        node_id="script-node",
        world_timeout=30,
    )
    fabric = launcher.fabric()
    try:
        fabric.launch()
        attestation = fabric.attest_topology()
        assert attestation is current_attestation()
        assert (attestation.rank, attestation.world_size, attestation.node_id) == (0, 1, "script-node")
        assert dist.is_initialized() and dist.get_rank() == attestation.rank
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        import meshgate.launchers.fabric

        meshgate.launchers.fabric._CURRENT = None


@pytest.mark.slow
def test_a_refused_register_stops_before_user_code(coordinator_factory, tmp_path, spawn_env):
    plan = ParallelPlan(dp_replicate=2)
    coordinator = coordinator_factory(plan, job_id="fabric")
    out = tmp_path / "out"
    out.mkdir()
    launcher = LightningFabricLauncher(
        plan,
        coordinator=coordinator.address,
        job_id="another-job",  # the coordinator refuses: FAILED_PRECONDITION
        trust_bundle=str(coordinator.trust_bundle_path),
        devices=2,
        strategy="ddp_fork",
        world_timeout=30,
    )
    with pytest.raises(Exception, match="another-job"):
        launcher.launch(must_not_run, str(out))
    assert list(out.iterdir()) == []


def record_seed_view(fabric, out_dir: str) -> None:
    """What seed-era code reads: fabric.attest_topology().as_dict() (module level: pickled)."""
    as_dict = fabric.attest_topology().as_dict()
    Path(out_dir, f"rank{fabric.global_rank}.json").write_text(json.dumps(as_dict))


@pytest.mark.slow
def test_the_seeds_call_shape_builds_an_attested_fabric(coordinator_factory, tmp_path, spawn_env, monkeypatch):
    """LightningFabricLauncher().create(plan=..., ...) from meshgate.launchers.compat, the
    coordinator taken from MESHGATE_*: every rank holds a verified attestation whose
    as_dict() has the seed's keys."""
    from meshgate.launchers.compat import LightningFabricLauncher as SeedShapedLauncher

    plan = ParallelPlan(dp_replicate=2)
    coordinator = coordinator_factory(plan, job_id="seed")
    monkeypatch.setenv("MESHGATE_COORDINATOR", coordinator.address)
    monkeypatch.setenv("MESHGATE_JOB", coordinator.job_id)
    monkeypatch.setenv("MESHGATE_TRUST_BUNDLE", str(coordinator.trust_bundle_path))
    monkeypatch.setenv("MESHGATE_NODE_ID", "seed-node")
    out = tmp_path / "out"
    out.mkdir()
    fabric = SeedShapedLauncher().create(plan=plan, devices=2, strategy="ddp_fork")
    fabric.launch(record_seed_view, str(out))

    results = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(results) == [0, 1], coordinator.log()
    for rank, as_dict in results.items():
        assert (as_dict["rank"], as_dict["world_size"]) == (rank, 2)
        assert as_dict["coordinate"] == plan.coordinate(rank) and as_dict["coordinate"]["dp_replicate"] == rank
        assert (as_dict["node_id"], as_dict["job_id"]) == ("seed-node", "seed")


# ---- a Fabric DDP job under node agents started as the shipped unit starts them ----------------

shipped_host = shipped.shipped_host  # the fixture: users, interpreter, delegated cgroup

FABRIC_JOB = str(REPO / "tests" / "workers" / "fabric_ddp_job.py")


@pytest.mark.slow
def test_a_fabric_ddp_job_runs_as_the_job_users_of_shipped_agents_and_its_ranks_verify_their_attestations(
    shipped_host,
):
    """The Fabric deployment shape (docs/launchers.md, "Lightning Fabric"): a claimed-mode
    job whose command is a Fabric script, on two nodes of one slot each, their agents started
    as the shipped unit starts them. Each agent starts its worker as its own job user, in the
    job's cgroup, with NODE_RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT; Fabric (ddp,
    CPU, gloo) takes its rank from them, the agent's socket vouches for it, and every rank
    verifies its attestation again against the trust bundle the agent hands the job."""
    plan = ParallelPlan(dp_replicate=2)
    with ShippedCluster(shipped_host, ("f0", "f1"), start=False) as cluster:
        for node_id in cluster.nodes:
            cluster.start_agent(node_id, extra={"slots": 1})
        out = cluster.root / "fabric-out"
        out.mkdir()
        out.chmod(0o777)  # two job users write there
        spec = pb.JobSpec(
            job_id="fabric-ddp",
            plan=plan.to_proto(),
            nodes=2,
            command=[shipped_host.python, FABRIC_JOB, str(out), "1", "2"],
            env={"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "RES_OPTIONS": "timeout:1 attempts:1"},
            mode=pb.RANK_MODE_CLAIMED,
        )
        admin.submit_job(cluster.address, spec)
        info = cluster.wait_ended("fabric-ddp", timeout=240)
        assert info.state == pb.SUCCEEDED, (info, cluster.logs())
        results = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
        assert sorted(results) == [0, 1], cluster.logs()
        for rank, seen in results.items():
            node = info.nodes[rank]  # one slot per node: rank r on node rank r
            assert seen["rank"] == seen["verified_rank"] == seen["node_rank"] == rank, seen
            assert seen["world_size"] == seen["verified_world"] == 2 and seen["local_rank"] == 0, seen
            assert seen["env"]["NODE_RANK"] == str(rank) and seen["env"]["WORLD_SIZE"] == "2", seen
            assert seen["env"]["LOCAL_RANK"] == "0" and seen["env"]["MASTER_ADDR"], seen
            assert (seen["job"], seen["node"]) == ("fabric-ddp", node), seen
            assert seen["coordinate"] == plan.coordinate(rank) and seen["plan"] == plan.to_dict(), seen
            assert seen["rank_sum"] == 1.0, seen
            assert seen["uid"] == cluster.agents[node].run_as.pw_uid, seen  # that node's job user
            assert "/meshgate/" in seen["cgroup"] and seen["cgroup"].endswith("/job-fabric-ddp-g0"), seen
