"""Ray Train on meshgate's ranks, on a multi-node local Ray cluster: a jobs-mode coordinator,
two node agents started exactly as the shipped systemd unit starts them (tests/shipped.py:
the unit's user and capabilities, its delegated cgroup, deploy/systemd/agent.toml with a
job user of its own per agent), each labelling its Ray node through the file it writes,
and two `ray start` nodes on this machine (distinct addresses, each started with its
agent's labels file and its agent's socket). RayTrainLauncher passes one label selector
per worker, so Ray's world ranks are the ranks meshgate assigns (node-contiguous blocks in
the job's node order) and `topology_policy = "refuse"` passes. One cluster for the whole
module: Ray starts slowly on 2 cores.

Who runs Ray. The agent does not start Ray's workers: they run as whoever runs `ray start`.
A real node runs Ray as a user of its own, never root, the agent's user nor the job user:
the agent's socket answers the job user only from inside a job's containment unit, which
Ray's workers are not in (agent/daemon.py `check_vouch_caller`: "workers the agent does not
start (Ray) run as a uid of [agent] vouch_socket_uids"). So here, as on a node, Ray runs as
a user the test makes, listed in each agent's `[agent] vouch_socket_uids` (SECURITY.md,
"Agent vouching"), in no group of the job users': the agent's socket is 0666 and the
agent's own uid check is the gate (agent/vouch_socket.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

import shipped
from conftest import REPO, free_port
from meshgate import admin
from meshgate.job_cli import spec_message
from meshgate.launchers.ray_labels import NODE_ID_LABEL
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb
from shipped import ShippedCluster

pytestmark = pytest.mark.slow

shipped_host = shipped.shipped_host  # the fixture: users, interpreter, delegated cgroup

# As tests/test_ray.py (docs/design.md, "Ray on a small machine"), set before ray is imported.
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",  # several nodes (tests/test_ray.py keeps one on 127.0.0.1)
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RES_OPTIONS": "timeout:1 attempts:1",
    "OMP_NUM_THREADS": "1",
    "PYTHONWARNINGS": "ignore",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "180",
    # Ray's nodes run the host's interpreter (Debian's python3.11, one the Ray user can
    # execute: tests/shipped.py), this driver the project venv's; the same minor version.
    "RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL": "minor",
}
# No GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME in Ray's nodes (as on a node nothing set them):
# each worker takes the interface its node's agent advertises (RayTrainLauncher). Node b's
# operator chose NCCL's interface (NCCL's exact-match syntax, still loopback): that is kept.
OPERATOR_ENV = {"mg-node-b": {"NCCL_SOCKET_IFNAME": "=lo"}}
SLOTS = 2
# Node "a" hosts Ray's head (and the driver) on this machine's own address, as Ray picks it;
# node "b" another loopback address, so Ray sees two nodes. meshgate's labels: racks r1, r2.
NODES = {"mg-node-a": ("", "r1"), "mg-node-b": ("127.0.0.2", "r2")}


class RayOnMeshgate:
    """The coordinator and the agents (as shipped) and the Ray nodes (as the Ray user), each
    a real process."""

    def __init__(self, host: shipped.ShippedHost) -> None:
        self.ray_nodes: list[subprocess.Popen] = []
        self.temp_dirs: list[str] = []
        self.cluster = ShippedCluster(host, tuple(NODES), start=False)
        try:
            self.root = self.cluster.root
            self.address = self.cluster.address
            self.bundle = str(self.cluster.coordinator.trust_bundle_path)
            # Ray's user: listed in each agent's vouch_socket_uids (the agent's uid check), in
            # no job user's group.
            self.ray_user = host.add_user("mgray")
            self.work = self.ray_dir(self.root / "ray")  # Ray's outputs, its HOME
            for node_id, (_, rack) in NODES.items():
                self.cluster.start_agent(
                    node_id,
                    extra={
                        "slots": SLOTS,
                        "labels": {"switch": "s1", "rack": rack},
                        "vouch_socket_uids": [self.ray_user.pw_uid],
                    },
                )
            for node_id in NODES:
                self._wait(lambda: self.socket(node_id).exists(), f"agent {node_id}'s vouch socket")
        except BaseException:
            self.close()
            raise

    def ray_dir(self, path: Path) -> Path:
        """A directory of the Ray user's (Ray's processes write there)."""
        path.mkdir(mode=0o755, parents=True, exist_ok=True)
        os.chown(path, self.ray_user.pw_uid, self.ray_user.pw_gid)
        return path

    def socket(self, node_id: str) -> Path:
        return self.cluster.agents[node_id].state_dir / "vouch.sock"  # the shipped default

    def labels_file(self, node_id: str) -> Path:
        return self.cluster.agents[node_id].state_dir / "ray-labels.yaml"  # the shipped default

    def _temp_dir(self, prefix: str) -> str:
        # Short (Ray's socket paths), and the Ray user's.
        self.temp_dirs.append(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
        self.ray_dir(Path(self.temp_dirs[-1]))
        return self.temp_dirs[-1]

    def _wait(self, done, what: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            agents = [a.process for a in self.cluster.agents.values() if a.process is not None]
            dead = [p.args for p in agents + self.ray_nodes if p.poll() is not None]
            assert not dead and time.monotonic() < deadline, f"waiting for {what}; exited: {dead}\n{self.logs()}"
            time.sleep(0.2)

    def start_ray(self) -> str:
        """`ray start` on each node as the Ray user, with the labels its agent wrote and its
        agent's socket; the head on node a. Returns the head's address."""
        port = free_port()
        user = self.ray_user
        for index, (node_id, (ip, _)) in enumerate(NODES.items()):
            head = ["--head", f"--port={port}", f"--ray-client-server-port={free_port()}", "--include-dashboard=false"]
            where = head if index == 0 else []
            where = where or [f"--address=127.0.0.1:{port}"]
            env = {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "HOME": str(self.work),
                "USER": user.pw_name,
                "LOGNAME": user.pw_name,
                **RAY_ENV,
                "MESHGATE_AGENT_SOCKET": str(self.socket(node_id)),  # inherited by the node's Ray workers
                **OPERATOR_ENV.get(node_id, {}),
                "PYTHONPATH": str(REPO),
            }
            log = open(self.root / f"ray-{node_id}.log", "ab")
            self.ray_nodes.append(
                subprocess.Popen(
                    [self.cluster.host.python, "-m", "ray.scripts.scripts", "start", "--block"]
                    + ["--disable-usage-stats"]
                    + ([f"--node-ip-address={ip}"] if ip else [])
                    + where
                    + [f"--num-cpus={SLOTS}", f"--labels-file={self.labels_file(node_id)}"]
                    + [f"--temp-dir={self._temp_dir('mgr')}"],
                    env=env,
                    cwd=self.work,
                    user=user.pw_uid,
                    group=user.pw_gid,
                    extra_groups=os.getgrouplist(user.pw_name, user.pw_gid),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: close() can stop all it started
                )
            )
            # One node at a time: a node that starts while the head's GCS is still coming up
            # times out on a loaded 2-core machine.
            self._wait(lambda: b"Ray runtime started" in (self.root / f"ray-{node_id}.log").read_bytes(), "ray start")
        return f"127.0.0.1:{port}"

    def logs(self) -> str:
        ray_logs = "\n".join(
            f"--- {p.name} ---\n{p.read_text(errors='replace')[-2500:]}" for p in sorted(self.root.glob("ray-*.log"))
        )
        return f"{self.cluster.logs()}\n{ray_logs}"

    def close(self) -> None:
        # SIGTERM to `ray start --block` drains the node (up to 30 s) and stops its processes.
        try:
            for process in self.ray_nodes[::-1]:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
                    try:
                        process.wait(timeout=90)
                    except subprocess.TimeoutExpired:
                        process.kill()
                        process.wait()
            for process in self.ray_nodes:  # whatever a Ray node left in its own group
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        finally:
            self.cluster.close()
            for temp_dir in self.temp_dirs:
                shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_on_meshgate(shipped_host):
    saved = dict(os.environ)
    cluster = RayOnMeshgate(shipped_host)
    try:
        head = cluster.start_ray()
        os.environ.update(RAY_ENV)
        os.environ.pop("MESHGATE_AGENT_SOCKET", None)  # each Ray node's workers have their own
        import ray

        ray.init(address=head, log_to_driver=False, configure_logging=False)
        cluster._wait(lambda: sum(n["Alive"] for n in ray.nodes()) == len(NODES), "both Ray nodes")
        yield cluster
    finally:
        try:
            import ray

            ray.shutdown()
        finally:
            cluster.close()
            os.environ.clear()
            os.environ.update(saved)


def record_to(out: Path):
    """A train loop that records, per worker, what Ray and meshgate say about it."""

    def record(config):  # a closure: cloudpickled by value into the workers
        import os

        import ray
        import ray.train
        import torch
        import torch.distributed as dist

        from meshgate.launchers.ray import current_attestation

        context = ray.train.get_context()
        attestation = current_attestation()
        value = torch.tensor([attestation.rank], dtype=torch.int64)
        dist.all_reduce(value)
        result = {
            "world_rank": context.get_world_rank(),
            "local_rank": context.get_local_rank(),
            "node_rank": context.get_node_rank(),
            "ray_labels": dict(ray.get_runtime_context().get_node_labels()),
            "rank": attestation.rank,
            "local": attestation.local_rank,
            "node": attestation.node_id,
            "job": attestation.job_id,
            "config_rank": config["meshgate_rank"],
            "rank_sum": int(value.item()),
            "uid": os.getuid(),
            "ifnames": {k: os.environ.get(k) for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")},
        }
        Path(out, f"rank{result['world_rank']}.json").write_text(json.dumps(result))

    return record


def results(out: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def test_agents_label_their_ray_nodes(ray_on_meshgate):
    """Each agent, running as the unit's user, wrote its node id, switch and rack for
    `ray start --labels-file`; Ray, running as its own user, took them."""
    import ray

    agent_uid = ray_on_meshgate.cluster.host.agent_user.pw_uid
    for node_id, (_, rack) in NODES.items():
        assert ray_on_meshgate.cluster.agents[node_id].status()["Uid"].split()[0] == str(agent_uid)
        written = json.loads(ray_on_meshgate.labels_file(node_id).read_text())
        assert written == {NODE_ID_LABEL: node_id, "meshgate.io/switch": "s1", "meshgate.io/rack": rack}
    seen = {n["Labels"].get(NODE_ID_LABEL): n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    assert set(seen) == set(NODES) and seen["mg-node-b"] == "127.0.0.2" != seen["mg-node-a"]


def test_ray_world_ranks_are_meshgates_assigned_ranks(ray_on_meshgate):
    """A claimed-mode job (topology_policy refuse) pinned to node b then node a, the reverse
    of Ray's own order (its head, where the driver runs, is node a): every worker's Ray world
    rank is the rank meshgate assigns there (node_rank * slots + local_rank), on that node, and
    every TP group stays on one node."""
    from ray.train import RunConfig

    from meshgate.launchers.ray import RayPlacementError, RayTrainLauncher

    cluster = ray_on_meshgate
    plan = ParallelPlan(tp=2, dp_shard=2)
    order = ["mg-node-b", "mg-node-a"]
    spec = spec_message(
        {"id": "ray-placed", "plan": plan, "node_ids": order, "mode": "claimed", "topology_policy": "refuse"}
    )
    assert admin.submit_job(cluster.address, spec, tls=False).state == pb.RUNNING
    out = cluster.ray_dir(cluster.work / "placed-out")  # the workers write there, as the Ray user
    launcher = RayTrainLauncher(
        plan,
        coordinator=cluster.address,
        job_id="ray-placed",
        trust_bundle=cluster.bundle,
        train_loop_per_worker=record_to(out),
        resources_per_worker={"CPU": 1},
        world_timeout=120,
        run_config=RunConfig(name="ray-placed", storage_path=str(cluster.ray_dir(cluster.work / "placed-results"))),
    )
    try:
        launcher.fit()
    except Exception as exc:
        raise AssertionError(f"fit() failed: {exc}\n{cluster.logs()}") from exc
    ranks = results(out)
    assert sorted(ranks) == [0, 1, 2, 3], cluster.logs()
    for rank, seen in ranks.items():
        node_rank, local_rank = divmod(rank, SLOTS)
        assert seen["node"] == order[node_rank] == seen["ray_labels"][NODE_ID_LABEL], seen
        assert seen["rank"] == seen["config_rank"] == seen["world_rank"] == rank
        assert seen["local"] == seen["local_rank"] == local_rank
        assert seen["node_rank"] == node_rank  # Ray's node rank too: node b first
        assert seen["job"] == "ray-placed" and seen["rank_sum"] == 6
        assert seen["uid"] == cluster.ray_user.pw_uid  # Ray's user, whom the agents' sockets admit
    info = admin.get_job(cluster.address, "ray-placed", tls=False)
    assert info.spec.topology_policy == pb.TOPOLOGY_POLICY_REFUSE and info.spec.mode == pb.RANK_MODE_CLAIMED
    assert {n.node_id: n.registered for n in info.status.nodes} == {"mg-node-a": 2, "mg-node-b": 2}
    # Nothing finished the attached job: it is the submitter's to finish.
    admin.finish_job(cluster.address, "ray-placed", True, "test done", tls=False)
    with pytest.raises(RayPlacementError, match="job 'ray-placed' is SUCCEEDED: test done"):
        launcher.fit()  # an ended job is refused before Ray is asked for anything


def test_the_seeds_launch_shape_submits_its_own_job(ray_on_meshgate, monkeypatch):
    """RayTrainLauncher().launch(loop, plan=...) as the seed spells it, with only the
    coordinator and the trust bundle in the environment and no job: the launcher submits a
    claimed-mode job, meshgate allocates its node, the workers run there on its ranks, and the
    run's end finishes the job SUCCEEDED (its node goes back to the pool)."""
    from ray.train import RunConfig

    from meshgate.launchers.compat import RayTrainLauncher as SeedShapedLauncher

    cluster = ray_on_meshgate
    monkeypatch.setenv("MESHGATE_COORDINATOR", cluster.address)
    monkeypatch.setenv("MESHGATE_TRUST_BUNDLE", cluster.bundle)
    monkeypatch.delenv("MESHGATE_JOB", raising=False)
    plan = ParallelPlan(tp=2)
    out = cluster.ray_dir(cluster.work / "seed-out")
    SeedShapedLauncher().launch(
        record_to(out),
        plan=plan,
        resources_per_worker={"CPU": 1},
        run_config=RunConfig(name="ray-seed", storage_path=str(cluster.ray_dir(cluster.work / "seed-results"))),
    )
    ranks = results(out)
    assert sorted(ranks) == [0, 1], cluster.logs()
    job_id = ranks[0]["job"]
    info = admin.get_job(cluster.address, job_id, tls=False)
    assert info.state == pb.SUCCEEDED and info.reason == "the run returned", info
    assert info.spec.mode == pb.RANK_MODE_CLAIMED and info.spec.topology_policy == pb.TOPOLOGY_POLICY_REFUSE
    (node,) = info.nodes  # meshgate chose it
    for rank, seen in ranks.items():
        assert seen["node"] == node == seen["ray_labels"][NODE_ID_LABEL]
        assert seen["rank"] == seen["world_rank"] == seen["local"] == rank
        assert seen["uid"] == cluster.ray_user.pw_uid


def advertised_interface(cluster: RayOnMeshgate, node_id: str) -> str:
    """The interface node ``node_id``'s agent advertises, as its log says (agent/node.py)."""
    found = re.search(r"workers advertise \S+ on interface (\S+)", cluster.cluster.agents[node_id].log_path.read_text())
    assert found, cluster.logs()
    return found.group(1)


def test_ray_workers_init_their_process_group_on_their_agents_interface(ray_on_meshgate):
    """Ray Train initializes the process group before the user's loop: each worker, at the
    moment its process group was initialized (recorded inside the worker, in that call), had
    GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME of the interface its node's agent advertises,
    though Ray's nodes set neither (gloo would take the host name's address: here 127.0.0.1,
    on a real node whose name does not resolve to its NIC a job across nodes fails). Node
    b's operator's NCCL_SOCKET_IFNAME is kept. The recorder is a user's own TorchConfig
    subclass: the launcher keeps it (its backend, its fields) and runs its own step first."""
    from ray.train import RunConfig

    from meshgate.launchers.ray import RayTrainLauncher
    from tests.workers.ray_init_recorder import RecordingTorchConfig

    cluster = ray_on_meshgate
    advertised = {node_id: advertised_interface(cluster, node_id) for node_id in NODES}
    plan = ParallelPlan(tp=2, dp_shard=2)
    order = ["mg-node-a", "mg-node-b"]
    spec = spec_message({"id": "ray-ifname", "plan": plan, "node_ids": order, "mode": "claimed"})
    admin.submit_job(cluster.address, spec, tls=False)
    # PENDING until both nodes are back in the pool (an earlier test's job just ended).
    cluster._wait(lambda: admin.get_job(cluster.address, "ray-ifname", tls=False).state == pb.RUNNING, "the job")
    out = cluster.ray_dir(cluster.work / "ifname-out")
    inits = cluster.ray_dir(cluster.work / "ifname-init")
    launcher = RayTrainLauncher(
        plan,
        coordinator=cluster.address,
        job_id="ray-ifname",
        trust_bundle=cluster.bundle,
        train_loop_per_worker=record_to(out),
        resources_per_worker={"CPU": 1},
        world_timeout=120,
        torch_config=RecordingTorchConfig(out=str(inits), timeout_s=120),
        run_config=RunConfig(name="ray-ifname", storage_path=str(cluster.ray_dir(cluster.work / "ifname-results"))),
    )
    try:
        launcher.fit()
    except Exception as exc:
        raise AssertionError(f"fit() failed: {exc}\n{cluster.logs()}") from exc
    finally:
        admin.finish_job(cluster.address, "ray-ifname", True, "test done", tls=False)
    ranks = results(out)
    at_init = {int(p.stem[4:]): json.loads(p.read_text()) for p in inits.glob("init*.json")}
    assert sorted(ranks) == sorted(at_init) == [0, 1, 2, 3], (at_init, cluster.logs())
    for rank, seen in ranks.items():
        node = seen["node"]
        assert node == order[rank // SLOTS] and seen["rank_sum"] == 6, seen
        operator = OPERATOR_ENV.get(node, {}).get("NCCL_SOCKET_IFNAME")
        wanted = {"GLOO_SOCKET_IFNAME": advertised[node], "NCCL_SOCKET_IFNAME": operator or advertised[node]}
        assert {k: at_init[rank][k] for k in wanted} == wanted, (rank, at_init[rank], advertised)
        assert seen["ifnames"] == wanted, seen  # and the loop runs with them
    assert launcher.torch_config == RecordingTorchConfig(out=str(inits), timeout_s=120)  # the user's, untouched
