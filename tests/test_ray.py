"""RayTrainLauncher: argument checks before Ray is touched, the claimed-mode topology
check on the worker path, and a real local Ray cluster (2 CPUs) running a TorchTrainer
with 2 attested workers against a real coordinator process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from meshgate.launchers.ray import (
    INJECTED_KEYS,
    RayLauncherArgumentError,
    RayLauncherTypeError,
    RayTopologyError,
    RayTrainLauncher,
    WorkerSettings,
    attest_worker,
    current_attestation,
)
from meshgate.launchers.checks import GpuConflictError, ReservedConfigKeyError, ResourceAmountError
from meshgate.launchers.claimed import check_placement
from meshgate.launchers.ray import Placement, RayPlacementError, check_ray_nodes
from meshgate.launchers.ray_labels import NODE_ID_LABEL, label_selectors, node_label_value, ray_node_labels
from meshgate.attestation import SigningKey, TrustBundle
from meshgate.client import RendezvousRefused
from meshgate.plan import ParallelPlan, current_plan

REPO = Path(__file__).resolve().parent.parent

# Set before ray is imported (docs/design.md, "Ray on a small machine"); workers inherit them.
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RES_OPTIONS": "timeout:1 attempts:1",  # TCPStore's reverse-DNS lookups stall otherwise
    "OMP_NUM_THREADS": "1",
    "GLOO_SOCKET_IFNAME": "lo",
    "PYTHONWARNINGS": "ignore",
    # Ray Train waits 60 s for its workers to start; a loaded 2-core machine may need more.
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "180",
}


def loop(config):
    pass


@pytest.fixture
def bundle_file(tmp_path):
    path = tmp_path / "trust-bundle.json"
    TrustBundle.of(SigningKey.generate(), job_id="unit").save(path)
    return path


def make(bundle_file, plan=None, **kwargs):
    kwargs.setdefault("train_loop_per_worker", loop)
    return RayTrainLauncher(
        plan or ParallelPlan(dp_replicate=2),
        coordinator="127.0.0.1:1",
        job_id="unit",
        trust_bundle=str(bundle_file),
        **kwargs,
    )


# ---- refusals, before Ray ---------------------------------------------------------------------


def test_non_callable_and_bad_loops_are_refused(bundle_file):
    with pytest.raises(TypeError, match="train_loop_per_worker must be callable"):
        make(bundle_file, train_loop_per_worker="train.py")
    with pytest.raises(ValueError, match="must be callable"):  # every refusal is a ValueError
        make(bundle_file, train_loop_per_worker=None)
    with pytest.raises(TypeError, match="0 or 1 required argument"):
        make(bundle_file, train_loop_per_worker=lambda a, b: None)
    assert make(bundle_file, train_loop_per_worker=lambda: None).worker_loop().takes_config is False
    assert make(bundle_file, train_loop_per_worker=lambda c: None).worker_loop().takes_config is True
    assert make(bundle_file, train_loop_per_worker=lambda c=None: None).worker_loop().takes_config


def test_reserved_config_keys_are_refused(bundle_file):
    for key in INJECTED_KEYS + ("meshgate_future",):
        with pytest.raises(ReservedConfigKeyError, match=rf"reserved key\(s\) '{key}'"):
            make(bundle_file, train_loop_config={"lr": 0.1, key: 1})
    with pytest.raises(TypeError, match="train_loop_config must be a dict"):
        make(bundle_file, train_loop_config=[("lr", 0.1)])
    with pytest.raises(TypeError, match="keys must be strings"):
        make(bundle_file, train_loop_config={1: "x"})
    assert make(bundle_file, train_loop_config={"lr": 0.1}).train_loop_config == {"lr": 0.1}


def test_resources_per_worker_are_checked(bundle_file):
    with pytest.raises(GpuConflictError, match=r"GPU=1 but use_gpu=False"):
        make(bundle_file, resources_per_worker={"CPU": 1, "GPU": 1})
    with pytest.raises(GpuConflictError, match=r"use_gpu=True but resources_per_worker sets GPU=0"):
        make(bundle_file, resources_per_worker={"GPU": 0}, use_gpu=True)
    for bad in ({"CPU": -1}, {"CPU": True}, {"CPU": "1"}, {"CPU": float("nan")}, {"CPU": float("inf")}):
        with pytest.raises(ResourceAmountError, match=r"resources_per_worker\['CPU'\] must be a finite non-negative"):
            make(bundle_file, resources_per_worker=bad)
    with pytest.raises(TypeError, match="keys must be non-empty strings"):
        make(bundle_file, resources_per_worker={1: 1})
    with pytest.raises(TypeError, match="must be a dict"):
        make(bundle_file, resources_per_worker=[("CPU", 1)])
    with pytest.raises(TypeError, match="use_gpu must be a bool"):
        make(bundle_file, use_gpu="yes")
    with pytest.raises(RayLauncherArgumentError, match="placement_strategy"):
        make(bundle_file, placement_strategy="ANYWHERE")
    with pytest.raises(TypeError, match="scaling_config is set by RayTrainLauncher"):
        make(bundle_file, scaling_config=object())
    launcher = make(bundle_file, plan=ParallelPlan(dp_shard=2, tp=2), resources_per_worker={"CPU": 0.5})
    assert launcher.num_workers == 4
    assert launcher.resources_per_worker == {"CPU": 0.5}
    assert make(bundle_file, resources_per_worker={"GPU": 1}, use_gpu=True).use_gpu is True


def test_checks_run_without_ray_and_building_names_the_extra(bundle_file):
    """A fresh interpreter: the refusals never import ray; with ray unimportable, building
    the trainer raises an ImportError naming the extra."""
    script = f"""
import sys
from meshgate.launchers.ray import RayTrainLauncher
from meshgate.plan import ParallelPlan
common = dict(coordinator="h:1", job_id="j", trust_bundle={str(bundle_file)!r})
for kwargs in (dict(train_loop_per_worker=42),
               dict(train_loop_per_worker=print, resources_per_worker={{"GPU": 1}}),
               dict(train_loop_per_worker=print, resources_per_worker={{"GPU": 0}}, use_gpu=True),
               dict(train_loop_per_worker=print, train_loop_config={{"meshgate_rank": 3}})):
    try:
        RayTrainLauncher(ParallelPlan(dp_replicate=2), **common, **kwargs)
    except ValueError:
        pass
    else:
        raise SystemExit(f"not refused: {{kwargs}}")
assert "ray" not in sys.modules, "the checks imported ray"
launcher = RayTrainLauncher(ParallelPlan(dp_replicate=2), train_loop_per_worker=print, **common)
assert "ray" not in sys.modules and "torch" not in sys.modules
sys.modules["ray"] = None
try:
    launcher.trainer()
except ImportError as exc:
    assert "meshgate's [ray] extra" in str(exc) and "pip install 'ray" in str(exc), exc
else:
    raise SystemExit("no ImportError")
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_current_attestation_outside_a_worker_is_a_clear_error():
    with pytest.raises(RayTopologyError, match="before train_loop_per_worker runs"):
        current_attestation()


def test_new_arguments_are_checked(bundle_file):
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(RayLauncherArgumentError, match="nodes must be an integer >= 0"):
            make(bundle_file, nodes=bad)
        with pytest.raises(RayLauncherArgumentError, match="slots_per_node must be an integer >= 0"):
            make(bundle_file, slots_per_node=bad)
    with pytest.raises(RayLauncherArgumentError, match="topology_policy must be one of allow, warn, refuse"):
        make(bundle_file, topology_policy="strict")
    for bad in (0, -1, float("nan"), True, "60"):
        with pytest.raises(RayLauncherArgumentError, match="start_timeout must be a positive number"):
            make(bundle_file, start_timeout=bad)


def test_no_job_means_fit_submits_one(bundle_file, monkeypatch):
    monkeypatch.delenv("MESHGATE_JOB", raising=False)
    launcher = RayTrainLauncher(
        ParallelPlan(dp_replicate=2), coordinator="h:1", trust_bundle=str(bundle_file), train_loop_per_worker=loop
    )
    assert launcher.settings.job_id == "" and launcher.topology_policy == "refuse"
    monkeypatch.setenv("MESHGATE_JOB", "from-env")
    assert make(bundle_file).settings.job_id == "unit"  # the argument wins
    launcher = RayTrainLauncher(
        ParallelPlan(dp_replicate=2), coordinator="h:1", trust_bundle=str(bundle_file), train_loop_per_worker=loop
    )
    assert launcher.settings.job_id == "from-env"


def test_the_plan_defaults_to_the_jobs_plan_file(bundle_file, tmp_path, monkeypatch):
    monkeypatch.delenv("MESHGATE_PLAN_FILE", raising=False)
    with pytest.raises(ValueError, match="MESHGATE_PLAN_FILE is not set: meshgate.current_plan"):
        make_without_plan(bundle_file)
    plan = ParallelPlan(tp=2, dp_shard=2)
    path = tmp_path / "meshgate-plan.toml"
    path.write_text(plan.to_toml())
    monkeypatch.setenv("MESHGATE_PLAN_FILE", str(path))
    assert make_without_plan(bundle_file).plan == plan
    # any order and every count round-trip
    order = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    odd = ParallelPlan(dp_shard=2, pp=2, microbatches=4, gradient_accumulation_steps=3, order=order)
    path.write_text(odd.to_toml())
    assert current_plan() == odd and current_plan().digest() == odd.digest()
    path.write_text("[plan]\ntp = 0\n")
    with pytest.raises(ValueError, match=r"meshgate-plan.toml: .*tp.* \(MESHGATE_PLAN_FILE\)"):
        current_plan()
    path.unlink()
    with pytest.raises(ValueError, match=r"meshgate-plan.toml \(MESHGATE_PLAN_FILE\): No such file"):
        current_plan()


def make_without_plan(bundle_file):
    return RayTrainLauncher(
        coordinator="127.0.0.1:1", job_id="unit", trust_bundle=str(bundle_file), train_loop_per_worker=loop
    )


def test_ray_labels_name_meshgate_nodes():
    assert ray_node_labels("gpu-07", {"switch": "s1", "rack": "r4", "bad key": "x", "zone": "a/b"}) == {
        NODE_ID_LABEL: "gpu-07",
        "meshgate.io/rack": "r4",
        "meshgate.io/switch": "s1",
    }
    # a node id Ray's label syntax cannot hold is named by a digest, the same on both sides
    for odd in ("spiffe://x/node/1", "n" * 64, "-leading", "a:b"):
        value = node_label_value(odd)
        assert value.startswith("sha256-") and len(value) <= 63 and value == node_label_value(odd)
    assert label_selectors(["b", "a"], 2) == [{NODE_ID_LABEL: n} for n in ("b", "b", "a", "a")]
    assert Placement("j", ("b", "b", "a", "a")).label_selectors() == label_selectors(["b", "a"], 2)
    assert Placement("j").label_selectors() is None  # Ray places


def test_a_worker_off_its_ranks_node_is_refused():
    rank_nodes = ("b", "b", "a", "a")
    check_placement(rank_nodes, rank=3, local_rank=1, node_id="a", framework="Ray Train", error=RayTopologyError)
    check_placement((), rank=3, local_rank=0, node_id="x", framework="Ray Train")  # not placed: Ray's choice
    with pytest.raises(RayTopologyError, match=r"put rank 0 on meshgate node 'a'; the job's rank 0 belongs to 'b'"):
        check_placement(rank_nodes, rank=0, local_rank=0, node_id="a", framework="Ray Train", error=RayTopologyError)
    with pytest.raises(
        RayTopologyError, match="local rank 0 on node 'a'; in the job's rank block there it is local rank 1"
    ):
        check_placement(rank_nodes, rank=3, local_rank=0, node_id="a", framework="Ray Train", error=RayTopologyError)


# ---- the worker path without Ray: claimed mode and the topology the framework chose -----------


def _settings(coordinator, plan):
    return WorkerSettings(
        plan=plan,
        coordinator=coordinator.address,
        job_id=coordinator.job_id,
        trust_bundle_json=TrustBundle.load(coordinator.trust_bundle_path).to_json(),
        await_world=False,
        register_timeout=10.0,
        world_timeout=10.0,
    )


def test_a_tp_group_across_ray_nodes_is_refused_by_policy(coordinator_factory):
    plan = ParallelPlan(tp=2, dp_shard=2)
    coordinator = coordinator_factory(plan, job_id="ray", job={"topology_policy": "refuse"})
    settings = _settings(coordinator, plan)
    first = attest_worker(settings, rank=0, world_size=4, local_rank=0, node_id="ray-node-a")
    assert (first.rank, first.node_id, first.coordinate["tp"]) == (0, "ray-node-a", 0)
    # rank 1 shares rank 0's TP group but Ray put it on another node
    with pytest.raises(RendezvousRefused, match=r"FAILED_PRECONDITION.*tp group \[0, 1\].*straddle"):
        attest_worker(settings, rank=1, world_size=4, local_rank=0, node_id="ray-node-b")
    # on the same node it is fine; so is the next TP group on the other node
    assert attest_worker(settings, rank=1, world_size=4, local_rank=1, node_id="ray-node-a").rank == 1
    assert attest_worker(settings, rank=2, world_size=4, local_rank=0, node_id="ray-node-b").rank == 2


def test_a_tp_group_across_ray_nodes_is_only_warned_by_default(coordinator_factory):
    plan = ParallelPlan(tp=2)
    coordinator = coordinator_factory(plan, job_id="ray")
    settings = _settings(coordinator, plan)
    attest_worker(settings, rank=0, world_size=2, local_rank=0, node_id="ray-node-a")
    assert attest_worker(settings, rank=1, world_size=2, local_rank=0, node_id="ray-node-b").rank == 1
    with pytest.raises(RayTopologyError, match="Ray Train runs 3 workers; the plan's world_size is 2"):
        attest_worker(settings, rank=1, world_size=3, local_rank=0, node_id="ray-node-b")


# ---- a real local Ray cluster ------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster():
    saved = dict(os.environ)  # ray.init writes into it too (PYTHONBREAKPOINT, ...)
    os.environ.update(RAY_ENV)
    import ray

    temp_dirs = []
    # The raylet gives its agents a fixed 15 s to start (ray-project/ray#65983); on a
    # loaded 2-core machine that can run out once, so start the cluster at most twice.
    for attempt in range(2):
        temp_dirs.append(tempfile.mkdtemp(prefix="mgray", dir="/tmp"))  # short socket paths
        try:
            ray.init(
                num_cpus=2,
                labels={NODE_ID_LABEL: AGENT_NODE_ID},  # as `ray start --labels-file` with the agent's file
                include_dashboard=False,
                _temp_dir=temp_dirs[-1],
                log_to_driver=False,
                configure_logging=False,
            )
            break
        except Exception:
            ray.shutdown()
            if attempt:
                raise
    try:
        yield ray
    finally:
        ray.shutdown()
        for temp_dir in temp_dirs:
            shutil.rmtree(temp_dir, ignore_errors=True)
        os.environ.clear()
        os.environ.update(saved)


AGENT_NODE_ID = "meshgate-node-1"  # the agent's own id: nothing like Ray's 56-hex node id


@pytest.fixture
def agent_socket(coordinator_factory, tmp_path):
    """A coordinator that demands vouches (claimed mode) and a real node agent under its
    own node id, serving its vouch socket; yields (coordinator, socket path)."""
    import signal
    import time

    from conftest import start_agent

    coordinator = coordinator_factory(
        ParallelPlan(dp_replicate=2),
        job_id="ray",
        job={"join_token": "ray-token", "require_vouch": True, "mode": "claimed"},
    )
    socket_dir = tempfile.mkdtemp(prefix="mgvs", dir="/tmp")  # short socket paths
    path = os.path.join(socket_dir, "vouch.sock")
    agent = start_agent(
        tmp_path, coordinator.address, AGENT_NODE_ID, job="ray", join_token="ray-token", vouch_socket=path
    )
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        assert agent.poll() is None and time.monotonic() < deadline, (tmp_path / f"{AGENT_NODE_ID}.log").read_text()
        time.sleep(0.1)
    try:
        yield coordinator, path
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
        shutil.rmtree(socket_dir, ignore_errors=True)


@pytest.mark.slow
def test_ray_workers_hold_verified_attestations(ray_cluster, agent_socket, tmp_path, monkeypatch):
    """The workers register under the node agent's id (asked of its socket, with its
    vouch), not Ray's node id: the agent runs under its own name."""
    from ray.train import RunConfig

    plan = ParallelPlan(dp_replicate=2)
    coordinator, socket_path = agent_socket
    monkeypatch.setenv("MESHGATE_AGENT_SOCKET", socket_path)  # shipped to the workers
    out = tmp_path / "out"
    out.mkdir()
    bundle_path = str(coordinator.trust_bundle_path)

    def record(config):  # a closure: cloudpickled by value into the workers
        import ray
        import ray.train
        import torch
        import torch.distributed as dist

        from meshgate.launchers.ray import current_attestation
        from meshgate.attestation import TrustBundle, verify_attestation
        from meshgate.v1 import attestation_pb2

        context = ray.train.get_context()
        attestation = current_attestation()
        signed = attestation_pb2.SignedAttestation.FromString(config["meshgate_attestation"])
        verified = verify_attestation(
            signed,
            TrustBundle.load(bundle_path),
            job_id="ray",
            nonce=attestation.nonce,
            plan=ParallelPlan.from_mapping(config["meshgate_plan"]),
        )
        value = torch.tensor([verified.rank], dtype=torch.int64)
        dist.all_reduce(value)
        result = {
            "world_rank": context.get_world_rank(),
            "world_size": context.get_world_size(),
            "local_rank": context.get_local_rank(),
            "ray_node_id": ray.get_runtime_context().get_node_id(),
            "attested_rank": verified.rank,
            "attested_local_rank": verified.local_rank,
            "attested_node_id": verified.node_id,
            "keys": {k: config[k] for k in config if k != "meshgate_attestation"},
            "rank_sum": int(value.item()),
        }
        Path(out, f"rank{result['world_rank']}.json").write_text(json.dumps(result))

    launcher = RayTrainLauncher(
        plan,
        coordinator=coordinator.address,
        job_id=coordinator.job_id,
        trust_bundle=bundle_path,
        train_loop_per_worker=record,
        train_loop_config={"lr": 0.5},
        resources_per_worker={"CPU": 1},
        use_gpu=False,
        run_config=RunConfig(name="meshgate-ray", storage_path=str(tmp_path / "ray-results")),
        world_timeout=60,
    )
    try:
        launcher.fit()
    except Exception as exc:  # say what the coordinator saw, too
        raise AssertionError(f"fit() failed: {exc}\n--- coordinator log ---\n{coordinator.log()}") from exc

    results = {r["world_rank"]: r for r in (json.loads(p.read_text()) for p in out.glob("rank*.json"))}
    assert sorted(results) == [0, 1], coordinator.log()
    for rank, result in results.items():
        assert result["attested_rank"] == result["world_rank"] == rank
        assert result["attested_local_rank"] == result["local_rank"]
        assert result["attested_node_id"] == AGENT_NODE_ID != result["ray_node_id"]
        assert result["rank_sum"] == 1
        keys = result["keys"]
        assert keys["lr"] == 0.5  # the user's config is kept
        assert set(INJECTED_KEYS) - {"meshgate_attestation"} <= set(keys)
        assert keys["meshgate_rank"] == rank
        assert keys["meshgate_world_size"] == 2
        assert keys["meshgate_coordinate"] == plan.coordinate(rank)
        assert keys["meshgate_plan"] == plan.to_dict()
    # both workers share the one Ray node, and registered under its agent's node id
    assert results[0]["ray_node_id"] == results[1]["ray_node_id"]
    import grpc

    from meshgate.v1 import rendezvous_pb2, rendezvous_pb2_grpc

    with grpc.insecure_channel(coordinator.address) as channel:
        view = rendezvous_pb2_grpc.AdminStub(channel).GetStatus(
            rendezvous_pb2.GetStatusRequest(job_id="ray"), timeout=5
        )
    assert {n.node_id: n.registered for n in view.nodes} == {AGENT_NODE_ID: 2}


@pytest.mark.slow
def test_the_seeds_call_shape_runs_attested_workers(ray_cluster, coordinator_factory, tmp_path, monkeypatch):
    """RayTrainLauncher().launch(loop, plan=...) from meshgate.launchers.compat, with the
    coordinator taken from MESHGATE_*: the same cluster, a real coordinator, and the
    seed's attestation dict (rank, world_size, coordinate) from as_dict()."""
    from ray.train import RunConfig

    from meshgate.launchers.compat import RayTrainLauncher as SeedShapedLauncher

    plan = ParallelPlan(tp=2)
    coordinator = coordinator_factory(plan, job_id="seed")
    monkeypatch.setenv("MESHGATE_COORDINATOR", coordinator.address)
    monkeypatch.setenv("MESHGATE_JOB", coordinator.job_id)
    monkeypatch.setenv("MESHGATE_TRUST_BUNDLE", str(coordinator.trust_bundle_path))
    out = tmp_path / "out"
    out.mkdir()

    def train_loop(config):
        import ray.train

        from meshgate.launchers.ray import current_attestation

        rank = ray.train.get_context().get_world_rank()
        seen = {"as_dict": current_attestation().as_dict(), "lr": config["lr"], "rank": config["meshgate_rank"]}
        Path(out, f"rank{rank}.json").write_text(json.dumps(seen))

    SeedShapedLauncher().launch(
        train_loop,
        plan=plan,
        train_loop_config={"lr": 0.25},
        resources_per_worker={"CPU": 1},
        run_config=RunConfig(name="meshgate-seed", storage_path=str(tmp_path / "ray-results")),
    )
    results = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(results) == [0, 1], coordinator.log()
    for rank, seen in results.items():
        assert seen["lr"] == 0.25 and seen["rank"] == rank
        as_dict = seen["as_dict"]
        assert (as_dict["rank"], as_dict["world_size"]) == (rank, 2)
        assert as_dict["coordinate"] == plan.coordinate(rank)
        assert as_dict["coordinate"]["tp"] == rank  # the default order: tp innermost
        assert as_dict["job_id"] == "seed" and as_dict["plan"] == plan.to_dict()


@pytest.mark.slow
def test_a_placement_on_nodes_ray_does_not_have_says_how_to_label_them(ray_cluster):
    check_ray_nodes(Placement("ray", (AGENT_NODE_ID, AGENT_NODE_ID)))  # the cluster's node is labelled so
    with pytest.raises(
        RayPlacementError, match=r"'gpu-9'.*no live Ray node is labelled meshgate.io/node-id=.*--labels-file"
    ):
        check_ray_nodes(Placement("ray", (AGENT_NODE_ID, "gpu-9")))


def test_a_missing_agent_socket_names_the_variable_and_the_path(tmp_path, monkeypatch):
    from meshgate.client import agent_node_id

    missing = str(tmp_path / "nowhere" / "vouch.sock")
    monkeypatch.setenv("MESHGATE_AGENT_SOCKET", missing)
    with pytest.raises(RendezvousRefused, match=rf"no node agent answers on {missing} \(No such file") as caught:
        agent_node_id()
    assert "[agent] vouch_socket" in str(caught.value)


def test_the_agent_writes_its_ray_labels_where_its_config_says(tmp_path):
    from meshgate.agent.config import AgentConfig
    from meshgate.launchers.ray_labels import write_labels_file

    base = {"coordinator": "h:1", "job": "j", "node_id": "n1", "state_dir": "state", "insecure": True}
    assert AgentConfig.from_mapping(base, tmp_path).ray_labels_file == tmp_path / "state" / "ray-labels.yaml"
    assert AgentConfig.from_mapping({**base, "ray_labels_file": ""}, tmp_path).ray_labels_file is None
    chosen = AgentConfig.from_mapping({**base, "ray_labels_file": "/run/meshgate/ray.yaml"}, tmp_path)
    assert chosen.ray_labels_file == Path("/run/meshgate/ray.yaml")
    # what `ray start --labels-file` reads: YAML (JSON is YAML), any user may read it
    import yaml

    path = tmp_path / "out" / "ray-labels.yaml"
    write_labels_file(path, ray_node_labels("n1", {"rack": "r4"}))
    assert yaml.safe_load(path.read_text()) == {NODE_ID_LABEL: "n1", "meshgate.io/rack": "r4"}
    assert path.stat().st_mode & 0o777 == 0o644


@pytest.mark.slow
def test_the_scaling_config_puts_worker_i_on_rank_is_node(ray_cluster, bundle_file):
    """One label selector per worker, in world-rank order; the workers learn the same
    placement (and the job), so each checks its node before it registers."""
    launcher = make(bundle_file, plan=ParallelPlan(tp=2, dp_shard=2))
    placement = Placement("placed", ("b", "b", "a", "a"))
    config = launcher.scaling_config(placement)
    assert config.num_workers == 4
    assert config.label_selector == [{NODE_ID_LABEL: node} for node in ("b", "b", "a", "a")]
    assert launcher.scaling_config().label_selector is None  # no placement: Ray's choice
    settings = launcher.worker_loop(placement).settings
    assert (settings.job_id, settings.rank_nodes) == ("placed", ("b", "b", "a", "a"))


# ---- the workers' interface, before Ray Train initializes the process group -------------------


@pytest.fixture
def answering_agent(monkeypatch):
    """A Unix socket answering each request line with the JSON the test puts in ``answer``
    (the agent's "whoami" answer); MESHGATE_AGENT_SOCKET names it, no interface variable is set."""
    import socket
    import threading

    socket_dir = tempfile.mkdtemp(prefix="mgif", dir="/tmp")
    path = os.path.join(socket_dir, "vouch.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    state = {"answer": {"node_id": "gpu-7", "job_id": "unit", "interface": "mgnet0"}, "asked": []}

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                state["asked"].append(json.loads(conn.makefile().readline()))
                conn.sendall(json.dumps(state["answer"]).encode() + b"\n")

    threading.Thread(target=serve, daemon=True).start()
    monkeypatch.setenv("MESHGATE_AGENT_SOCKET", path)
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    try:
        yield state
    finally:
        server.close()
        shutil.rmtree(socket_dir, ignore_errors=True)


def test_a_ray_worker_takes_its_agents_interface_where_none_is_set(answering_agent, monkeypatch):
    from meshgate.launchers.ray import set_agent_interface

    assert set_agent_interface() == {"GLOO_SOCKET_IFNAME": "mgnet0", "NCCL_SOCKET_IFNAME": "mgnet0"}
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "mgnet0"
    assert answering_agent["asked"] == [{"whoami": True}]
    # An operator's choice is kept; an empty one is no choice (as the agent and torchrun read it).
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "")
    assert set_agent_interface() == {"NCCL_SOCKET_IFNAME": "mgnet0"}
    assert (os.environ["GLOO_SOCKET_IFNAME"], os.environ["NCCL_SOCKET_IFNAME"]) == ("eth9", "mgnet0")
    asked = len(answering_agent["asked"])
    assert set_agent_interface() == {} and len(answering_agent["asked"]) == asked  # both set: no question
    # An agent that names no interface (none chosen): gloo and NCCL choose, as before.
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    answering_agent["answer"] = {"node_id": "gpu-7", "job_id": "unit", "interface": ""}
    assert set_agent_interface() == {} and "GLOO_SOCKET_IFNAME" not in os.environ


def test_a_ray_worker_whose_agent_does_not_answer_fails_before_the_process_group(
    answering_agent, tmp_path, monkeypatch
):
    from meshgate.launchers.ray import set_agent_interface

    answering_agent["answer"] = {"error": "uid 4242 may not ask: not in [agent] vouch_socket_uids"}
    with pytest.raises(RayTopologyError, match=r"GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME.*vouch_socket_uids"):
        set_agent_interface()
    monkeypatch.setenv("MESHGATE_AGENT_SOCKET", str(tmp_path / "vouch.sock"))  # set, nothing there
    with pytest.raises(RayTopologyError, match=r"no node agent answers on"):
        set_agent_interface()
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    # No agent on this node (no socket set, none where the shipped agent's would be): nothing.
    monkeypatch.delenv("MESHGATE_AGENT_SOCKET")
    monkeypatch.setenv("MESHGATE_AGENT_CONFIG", str(tmp_path / "agent.toml"))
    if os.path.exists("/var/lib/meshgate-agent/vouch.sock"):
        pytest.skip("a shipped agent runs on this machine")
    assert set_agent_interface() == {} and "GLOO_SOCKET_IFNAME" not in os.environ


def test_ray_trains_torch_backend_inits_the_process_group_after_the_interface_is_set(answering_agent):
    """Pins the seam in the installed Ray: the trainer's TorchConfig backend's on_start (a
    DeveloperAPI hook) runs set_agent_interface through the worker group first, and only then
    does Ray's own torch backend, in that on_start, run ``_setup_torch_process_group`` (its
    init_process_group) on the workers. A Ray that makes the process group elsewhere, or
    changes the worker group's execute, fails here rather than on a user's cluster."""
    from ray.train._internal.base_worker_group import BaseWorkerGroup
    from ray.train.backend import Backend
    from ray.train.torch import TorchConfig

    from meshgate.launchers.ray import set_agent_interface, with_agent_interface

    class Initialized(Exception):
        pass

    calls: list[tuple[str, dict]] = []

    class Workers(BaseWorkerGroup):  # runs our step here; records what Ray's backend runs
        def execute(self, func, *args, **kwargs):
            calls.append((func.__name__, {}))
            return [func(*args, **kwargs)] if func is set_agent_interface else [None]

        def execute_async(self, func, *args, **kwargs):
            return self.execute(func, *args, **kwargs)

        def execute_single(self, index, func, *args, **kwargs):
            calls.append((func.__name__, {}))
            return ("127.0.0.1", 29500)

        def execute_single_async(self, index, func, *args, **kwargs):
            env = {k: os.environ.get(k) for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
            calls.append((func.__name__, env))
            if func.__name__ == "_setup_torch_process_group":
                raise Initialized(kwargs)
            return None

        def __len__(self):
            return 2

        def get_resources_per_worker(self):
            return {"CPU": 1}

    config = with_agent_interface(TorchConfig(timeout_s=77))
    backend = config.backend_cls()
    assert isinstance(backend, Backend) and isinstance(backend, TorchConfig().backend_cls)
    with pytest.raises(Initialized, match="'backend': 'gloo'.*'timeout_s': 77"):
        backend.on_start(Workers(), config)
    names = [name for name, _ in calls]
    assert names[0] == "set_agent_interface" and "_setup_torch_process_group" in names, names
    at_init = dict(calls)["_setup_torch_process_group"]
    assert at_init == {"GLOO_SOCKET_IFNAME": "mgnet0", "NCCL_SOCKET_IFNAME": "mgnet0"}


def test_the_users_torch_config_is_kept_and_not_changed(bundle_file):
    """The trainer gets a copy of the user's TorchConfig, of a subclass of its class: its
    fields, its backend (and the backend's class attributes) kept; Ray pickles it by value."""
    from dataclasses import dataclass

    import ray.cloudpickle
    from ray.train.torch import TorchConfig

    from meshgate.launchers.ray import with_agent_interface

    base_backend = TorchConfig().backend_cls

    class UsersBackend(base_backend):
        has_replica_groups = True

    @dataclass
    class UsersConfig(TorchConfig):
        extra: int = 0

        @property
        def backend_cls(self):
            return UsersBackend

    users = UsersConfig(init_method="tcp", extra=3)
    wrapped = with_agent_interface(users)
    assert isinstance(wrapped, UsersConfig) and type(users) is UsersConfig
    assert (wrapped.init_method, wrapped.extra, wrapped.backend) == ("tcp", 3, None)
    assert issubclass(wrapped.backend_cls, UsersBackend) and wrapped.backend_cls.has_replica_groups
    assert with_agent_interface(wrapped) is wrapped and type(with_agent_interface(users)) is type(wrapped)
    wrapped.backend = "gloo"  # as TorchTrainer does to the config it is given
    assert users.backend is None
    again = ray.cloudpickle.loads(ray.cloudpickle.dumps(with_agent_interface(TorchConfig(timeout_s=5))))
    assert again.timeout_s == 5 and issubclass(again.backend_cls, base_backend)
    assert again.backend_cls.on_start is not base_backend.on_start
    # The launcher refuses what is no TorchConfig, when it builds the trainer.
    with pytest.raises(RayLauncherTypeError, match="torch_config must be a ray.train.torch.TorchConfig"):
        make(bundle_file, torch_config={"backend": "gloo"}).trainer()
