"""Ray Train across simulated hosts whose host name does not resolve to their NIC.

Two hosts in network namespaces of their own (tests/test_netns.py's ``_cluster``: host-a at
10.77.0.2, host-b at 10.77.0.3, each with ``mgnet0`` on one bridge, the coordinator at
10.77.0.1 in a third). Each host runs a real meshgate agent (its own machine-id) and a Ray
node (`ray start`, the head on host-a); the Ray Train driver runs on host-a. Inside a
namespace this machine's host name still resolves to 127.0.0.1 (/etc/hosts), an address
every namespace has on its own ``lo``: gloo, left to the host name, binds there and the
other host cannot reach it (the user's failure: the cross-host world never forms).

Nothing here sets GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME (every process's environment is
test_netns's ``_env``, which drops them): a RayTrainLauncher job of 2 hosts x 1 worker (gloo,
an all_reduce across the hosts) succeeds only because each worker asked its node's agent
for the interface it advertises (launchers/ray.py ``set_agent_interface``), and each worker
recorded that interface, ``mgnet0``, in its environment when Ray Train initialized its
process group. Without that step (the driver's --without-fix) gloo fails to connect its
pairs: docs/launchers.md, Ray Train.

Ray and the agents run as root here, as in tests/test_ray.py (the agent's vouch socket
answers its own uid by default); tests/test_ray_cluster.py covers Ray as a user of its own
beside agents started as shipped. Skipped, with the reason, where `ip netns` is not
permitted."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import REPO, simulated_machine_id, write_config
from test_netns import COORDINATOR_IP, HOSTS, IFNAME, _cluster, _env, _in, _netns_permitted
from test_ray_cluster import RAY_ENV

pytestmark = pytest.mark.slow

JOB = "raynet"
TOKEN = "raynet-token"
COORDINATOR = f"{COORDINATOR_IP}:7443"
RAY_PORT = 6379  # each host its own network namespace: no clash
DRIVER = REPO / "tests" / "workers" / "ray_netns_driver.py"


def _host_env(**extra: str) -> dict[str, str]:
    """test_netns's environment (no interface, no MASTER_*, no MESHGATE_*) with the repository
    importable and the coordinator plaintext."""
    env = _env()
    env.update(PYTHONPATH=str(REPO), MESHGATE_INSECURE="1", **extra)
    assert not {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"} & set(env)
    return env


class RayHosts:
    """The coordinator, an agent and a Ray node per host, each a real process in its namespace."""

    def __init__(self, namespaces: dict[str, str], root: Path) -> None:
        self.namespaces, self.root = namespaces, root
        self.processes: list[subprocess.Popen] = []  # stopped in reverse order
        self.groups: list[int] = []  # process groups of the Ray nodes
        self.short = Path(tempfile.mkdtemp(prefix="mgrn", dir="/tmp"))  # short socket paths

    def spawn(self, role: str, name: str, argv: list[str], env: dict[str, str], group: bool = False):
        log = open(self.root / f"{name}.log", "ab")
        process = subprocess.Popen(
            _in(self.namespaces[role], *argv),
            env=env,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=group,
        )
        self.processes.append(process)
        if group:
            self.groups.append(process.pid)
        return process

    def wait(self, done, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            dead = [p.args for p in self.processes if p.poll() is not None]
            assert not dead and time.monotonic() < deadline, f"waiting for {what}; exited: {dead}\n{self.logs()}"
            time.sleep(0.1)

    def start_coordinator(self) -> None:
        config = write_config(
            self.root / "coordinator.toml",
            {
                "job": {
                    "id": JOB,
                    "slots_per_node": 1,
                    "join_token": TOKEN,
                    "require_vouch": True,
                    "mode": "claimed",
                    "node_order": list(HOSTS),
                },
                "plan": {"dp_shard": 2},
                "server": {"listen": COORDINATOR, "insecure": True},
                "keys": {"dir": str(self.root / "keys")},
            },
        )
        port_file = self.root / "coordinator.addr"
        argv = [sys.executable, "-m", "meshgate.coordinator", "--config", str(config), "--port-file", str(port_file)]
        self.spawn("coordinator", "coordinator", argv, _host_env())
        self.wait(port_file.exists, "the coordinator")
        self.bundle = self.root / "keys" / "trust-bundle.json"

    def socket(self, host: str) -> Path:
        return self.short / f"{host}.sock"

    def labels(self, host: str) -> Path:
        return self.root / f"{host}-ray-labels.yaml"

    def start_agent(self, host: str) -> None:
        config = write_config(
            self.root / f"{host}.toml",
            {
                "agent": {
                    "coordinator": COORDINATOR,
                    "job": JOB,
                    "node_id": host,
                    "join_token": TOKEN,
                    "slots": 1,
                    "state_dir": str(self.root / f"{host}-state"),
                    "machine_id_file": simulated_machine_id(self.root, host),
                    "insecure": True,
                    "drain_grace_s": 5,
                    "vouch_socket": str(self.socket(host)),
                    "ray_labels_file": str(self.labels(host)),
                }
            },
        )
        self.spawn(host, host, [sys.executable, "-m", "meshgate.agent", "--config", str(config)], _host_env())

    def advertised(self, host: str) -> str:
        found = re.search(r"workers advertise \S+ on interface (\S+)", (self.root / f"{host}.log").read_text())
        assert found, self.logs()
        return found.group(1)

    def start_ray(self, host: str, head: bool) -> None:
        where = ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"]
        if not head:
            where = [f"--address={HOSTS['host-a']}:{RAY_PORT}"]
        log = self.root / f"ray-{host}.log"
        argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats"]
        argv += [f"--node-ip-address={HOSTS[host]}", *where, "--num-cpus=1"]
        argv += [f"--labels-file={self.labels(host)}", f"--temp-dir={tempfile.mkdtemp(prefix='r', dir=self.short)}"]
        env = _host_env(**RAY_ENV, MESHGATE_AGENT_SOCKET=str(self.socket(host)))  # inherited by its workers
        self.spawn(host, f"ray-{host}", argv, env, group=True)
        # One node at a time: the second joins the head's GCS once it is up.
        self.wait(lambda: b"Ray runtime started" in log.read_bytes(), f"ray start on {host}", timeout=90)

    def drive(self, out: Path, *flags: str, timeout: float = 150) -> subprocess.CompletedProcess:
        """RayTrainLauncher.fit() on host-a (tests/workers/ray_netns_driver.py)."""
        out.mkdir(parents=True)
        argv = [sys.executable, str(DRIVER), f"{HOSTS['host-a']}:{RAY_PORT}", COORDINATOR, JOB, str(self.bundle)]
        return subprocess.run(
            _in(self.namespaces["host-a"], *argv, str(out), *flags),
            env=_host_env(**RAY_ENV),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name} ---\n{p.read_text(errors='replace')[-2500:]}" for p in sorted(self.root.glob("*.log"))
        )

    def close(self) -> None:
        # SIGTERM to `ray start --block` stops its node; then whatever is left in its group.
        for process in self.processes[::-1]:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        for pid in self.groups:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.short, ignore_errors=True)


@pytest.fixture
def ray_hosts(tmp_path):
    why = _netns_permitted()
    if why:
        pytest.skip(why)
    with _cluster() as namespaces:
        hosts = RayHosts(namespaces, tmp_path)
        try:
            hosts.start_coordinator()
            for host in HOSTS:
                hosts.start_agent(host)
            for host in HOSTS:
                hosts.wait(lambda: hosts.socket(host).exists() and hosts.labels(host).exists(), f"agent {host}")
            for index, host in enumerate(HOSTS):
                hosts.start_ray(host, head=index == 0)
            yield hosts
        finally:
            hosts.close()


def test_ray_across_hosts_takes_each_agents_interface_as_root_since_netns_hosts_miss_the_shipped_notify_socket(
    ray_hosts, tmp_path
):
    """Each agent advertises the interface that routes to the coordinator (mgnet0); every
    Ray worker had GLOO_SOCKET_IFNAME of its node's agent's interface when its process group
    was made, and the all_reduce across the two hosts returned the sum of both ranks."""
    advertised = {host: ray_hosts.advertised(host) for host in HOSTS}
    assert advertised == {host: IFNAME for host in HOSTS}, ray_hosts.logs()
    out = tmp_path / "out"
    run = ray_hosts.drive(out)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-5000:]}\n{ray_hosts.logs()}"
    ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    at_init = {int(p.stem[4:]): json.loads(p.read_text()) for p in (out / "init").glob("init*.json")}
    assert sorted(ranks) == sorted(at_init) == [0, 1], (ranks, at_init)
    assert {seen["node"] for seen in ranks.values()} == set(HOSTS), ranks  # one worker per host
    for rank, seen in ranks.items():
        host = seen["node"]
        assert seen["node_ip"] == HOSTS[host], seen  # its Ray node is its host's
        assert seen["sum"] == 3, seen  # (0 + 1) + (1 + 1), across the hosts
        wanted = {"GLOO_SOCKET_IFNAME": advertised[host], "NCCL_SOCKET_IFNAME": advertised[host]}
        assert {k: at_init[rank][k] for k in wanted} == wanted != {k: "lo" for k in wanted}, at_init[rank]
        assert seen["ifnames"] == wanted, seen
