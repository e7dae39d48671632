"""Hosts simulated with Linux network namespaces (issue #14).

One namespace per host: the coordinator at 10.77.0.1, agents on host-a (10.77.0.2) and host-b
(10.77.0.3), each host's only non-loopback interface named ``mgnet0`` and plugged into a bridge
that lives in a fifth namespace. Every address exists only inside the namespaces made here,
and every namespace is removed at the end, even on failure.

Certificates come from the CLI a user would run (`certs init --host 10.77.0.1`, `certs issue
--role agent --node-id`), join tokens from `meshgate token create` against 10.77.0.1. The test
gives the agents no network setting at all: the world only verifies if the agents chose the
interface that routes to the coordinator and exported it (GLOO_SOCKET_IFNAME), because the
container's host name means nothing inside a namespace.

A second test cuts host-b's link: 1 s (under the 2 s tolerance) changes nothing; a cut past
3 s loses the node, bumps the generation, and it rejoins with its node rank.

Skipped, with the reason, where `ip netns` is not permitted (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import simulated_machine_id

pytestmark = pytest.mark.slow

SUBNET = "10.77.0"
COORDINATOR_IP = f"{SUBNET}.1"
HOSTS = {"host-a": f"{SUBNET}.2", "host-b": f"{SUBNET}.3"}
IFNAME = "mgnet0"
JOB = "netns"
DEADLINE_S = 90.0
REPO = Path(__file__).resolve().parents[1]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


def _netns_permitted() -> str:
    """'' when namespaces can be made here, else why not."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"mgprobe{secrets.token_hex(3)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()[:200]}"
    _ip("netns", "del", probe, check=False)
    return ""


@contextmanager
def _cluster():
    """Namespaces {role: name} wired to one bridge; all removed on the way out."""
    tag = secrets.token_hex(3)
    names = {"switch": f"mg{tag}sw", "coordinator": f"mg{tag}co"}
    names.update({host: f"mg{tag}{host[-1]}" for host in HOSTS})
    addresses = {"coordinator": COORDINATOR_IP, **HOSTS}
    made: list[str] = []
    try:
        for name in names.values():
            _ip("netns", "add", name)
            made.append(name)
        switch = names["switch"]
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for index, (role, address) in enumerate(addresses.items()):
            host = names[role]
            port = f"port{index}"
            _ip("-n", switch, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", host)
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            _ip("-n", host, "addr", "add", f"{address}/24", "dev", IFNAME)
            _ip("-n", host, "link", "set", IFNAME, "up")
            _ip("-n", host, "link", "set", "lo", "up")
        yield names
    finally:
        for name in reversed(made):
            _ip("netns", "del", name, check=False)


def _env() -> dict[str, str]:
    """The test's own environment minus anything that would choose the network for meshgate."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MESHGATE_")
        and k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT")
    }
    env["RES_OPTIONS"] = "timeout:1 attempts:1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _in(namespace: str, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", namespace, *argv]


def _cli(namespace: str, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        _in(namespace, sys.executable, "-m", "meshgate.cli", *argv),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
    )


def _coordinator_config(
    directory: Path,
    command: list[str],
    job: tuple[str, ...] = ("slots_per_node = 2", "require_vouch = true"),
    plan: tuple[str, ...] = ("dp_shard = 2", "tp = 2"),
) -> Path:
    path = directory / "coordinator.toml"
    path.write_text(
        "\n".join(
            [
                "[job]",
                f'id = "{JOB}"',
                *job,
                'node_order = ["host-a", "host-b"]',
                "heartbeat_interval_s = 1.0",
                "",
                "[plan]",
                *plan,
                "",
                "[server]",
                f'listen = "{COORDINATOR_IP}:7443"',
                'ca_file = "tls/ca.pem"',
                'cert_file = "tls/coordinator.pem"',
                'key_file = "tls/coordinator.key"',
                "require_client_cert = true",
                "",
                "[keys]",
                'dir = "keys"',
                "",
                "[launch]",
                "command = " + json.dumps(command),
            ]
        )
        + "\n"
    )
    return path


def _agent_config(directory: Path, node_id: str, token: str) -> Path:
    path = directory / f"{node_id}.toml"
    path.write_text(
        "\n".join(
            [
                "[agent]",
                f'coordinator = "{COORDINATOR_IP}:7443"',
                f'job = "{JOB}"',
                f'node_id = "{node_id}"',
                f'join_token = "{token}"',
                "slots = 2",
                f'state_dir = "{node_id}-state"',
                f'machine_id_file = "{simulated_machine_id(directory, node_id)}"',
                "exit_when_done = true",
                'ca_file = "tls/ca.pem"',
                f'cert_file = "tls/agent-{node_id}.pem"',
                f'key_file = "tls/agent-{node_id}.key"',
                'worker_cert_file = "tls/worker.pem"',
                'worker_key_file = "tls/worker.key"',
            ]
        )
        + "\n"
    )
    return path


def _wait_for(path: Path, process: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{path.name} never appeared:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.05)


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


def _loopback_register(namespace: str, directory: Path) -> subprocess.CompletedProcess:
    """A worker on host-a that advertises 127.0.0.1 as its endpoint, with a raw stub (the
    client library refuses to send it)."""
    script = f"""
import grpc, secrets
from meshgate.tls import TLSConfig, secure_channel
from meshgate.v1 import rendezvous_pb2, rendezvous_pb2_grpc
tls = TLSConfig("{directory}/tls/ca.pem", "{directory}/tls/worker.pem", "{directory}/tls/worker.key")
request = rendezvous_pb2.RegisterRequest(job_id="{JOB}", worker_id="rogue", nonce=secrets.token_bytes(32),
    node_id="host-a", endpoint_host="127.0.0.1", endpoint_port=29500)
request.assigned.local_rank = 0
with secure_channel("{COORDINATOR_IP}:7443", tls) as channel:
    try:
        rendezvous_pb2_grpc.RendezvousStub(channel).Register(request, timeout=10)
        print("ACCEPTED")
    except grpc.RpcError as exc:
        print(exc.code().name, exc.details())
"""
    return subprocess.run(
        _in(namespace, sys.executable, "-c", script), capture_output=True, text=True, timeout=30, env=_env()
    )


def test_gloo_device_mesh_across_namespaced_hosts(tmp_path):
    reason = _netns_permitted()
    if reason:
        pytest.skip(reason)
    started = time.monotonic()
    results = tmp_path / "results"
    results.mkdir()
    tls = tmp_path / "tls"
    made = subprocess.run(
        [sys.executable, "-m", "meshgate.cli", "certs", "init", str(tls), "--host", COORDINATOR_IP, "--no-worker"],
        capture_output=True,
        text=True,
        timeout=30,
        env=_env(),
    )
    assert made.returncode == 0, made.stderr
    for argv in (["--role", "worker"], *(["--role", "agent", "--node-id", n] for n in HOSTS)):
        issued = subprocess.run(
            [sys.executable, "-m", "meshgate.cli", "certs", "issue", str(tls), *argv],
            capture_output=True,
            text=True,
            timeout=30,
            env=_env(),
        )
        assert issued.returncode == 0, issued.stderr
        assert "sha256 " in issued.stdout
    command = [sys.executable, str(REPO / "tests" / "workers" / "netns_worker.py"), str(results)]
    config = _coordinator_config(tmp_path, command)

    processes: list[subprocess.Popen] = []
    with _cluster() as ns:
        try:
            log = tmp_path / "coordinator.log"
            port_file = tmp_path / "coordinator.addr"
            processes.append(
                subprocess.Popen(
                    _in(
                        ns["coordinator"],
                        sys.executable,
                        "-m",
                        "meshgate.coordinator",
                        "--config",
                        str(config),
                        "--port-file",
                        str(port_file),
                    ),
                    stdout=open(log, "wb"),
                    stderr=subprocess.STDOUT,
                    env=_env(),
                )
            )
            _wait_for(port_file, processes[0], log, 30)
            admin = [
                "--coordinator",
                f"{COORDINATOR_IP}:7443",
                "--job",
                JOB,
                "--ca-file",
                str(tls / "ca.pem"),
                "--cert-file",
                str(tls / "admin.pem"),
                "--key-file",
                str(tls / "admin.key"),
            ]
            tokens = {}
            for node_id in HOSTS:
                # From host-a, dialling the coordinator by its address: the SAN must match.
                created = _cli(ns["host-a"], "token", "create", "--node-id", node_id, *admin)
                assert created.returncode == 0, created.stderr
                tokens[node_id] = created.stdout.strip()

            refused = _loopback_register(ns["host-a"], tmp_path)
            assert refused.stdout.startswith("INVALID_ARGUMENT endpoint_host '127.0.0.1' is a loopback address"), (
                refused.stdout + refused.stderr
            )
            assert f"from {HOSTS['host-a']}" in refused.stdout

            agents = {}
            for node_id in HOSTS:
                agent_log = tmp_path / f"{node_id}.log"
                agents[node_id] = subprocess.Popen(
                    _in(
                        ns[node_id],
                        sys.executable,
                        "-m",
                        "meshgate.agent",
                        "--config",
                        str(_agent_config(tmp_path, node_id, tokens[node_id])),
                    ),
                    stdout=open(agent_log, "wb"),
                    stderr=subprocess.STDOUT,
                    env=_env(),
                )
                processes.append(agents[node_id])
            deadline = time.monotonic() + DEADLINE_S
            codes = {}
            for node_id, agent in agents.items():
                try:
                    codes[node_id] = agent.wait(timeout=max(deadline - time.monotonic(), 1.0))
                except subprocess.TimeoutExpired:
                    codes[node_id] = "timeout"
            elapsed = time.monotonic() - started
            logs = "\n".join(
                f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in sorted(tmp_path.glob("*.log"))
            )
            outcomes = [json.loads(p.read_text()) for p in sorted(results.glob("*.json"))]
            failures = [o.get("error") for o in outcomes if o.get("check") != "ok"]
            assert codes == {n: 0 for n in HOSTS}, f"{codes}\n{failures}\n{logs}"
        finally:
            _stop(processes)

    assert sorted(o["rank"] for o in outcomes) == [0, 1, 2, 3], outcomes
    for outcome in outcomes:
        assert outcome["check"] == "ok", outcome
        assert outcome["checked_axes"] == ["dp_shard", "tp"], outcome
        # The agent chose the interface that routes to the coordinator, and exported it.
        assert outcome["env"] == {
            "MESHGATE_ADVERTISE_ADDR": HOSTS[outcome["node"]],
            "GLOO_SOCKET_IFNAME": IFNAME,
            "NCCL_SOCKET_IFNAME": IFNAME,
        }, outcome
        # Rank 0 lives on host-a (node_order) and advertised host-a's address as the master.
        assert outcome["master"][0] == HOSTS["host-a"], outcome
    agent_log = (tmp_path / "host-a.log").read_text()
    assert f"workers advertise {HOSTS['host-a']} on interface {IFNAME} (route to {COORDINATOR_IP})" in agent_log
    print(f"netns world of 4 ranks on 2 hosts verified in {elapsed:.1f}s")


# ---- a multi-node Lightning Fabric job: its master from node rank 0's agent ------------------


def test_multi_node_fabric_takes_its_master_from_node_rank_zeros_agent(tmp_path):
    """Two agents, one Fabric process each ("ddp", devices=1, num_nodes=2); nobody sets a
    master. host-b's agent joins first: its workers must still get host-a's master (node
    rank 0 by node_order), and `meshgate status` must show the master Fabric used."""
    reason = _netns_permitted()
    if reason:
        pytest.skip(reason)
    started = time.monotonic()
    results = tmp_path / "results"
    results.mkdir()
    tls = tmp_path / "tls"
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshgate.cli",
            "certs",
            "init",
            str(tls),
            "--host",
            COORDINATOR_IP,
            *(a for n in HOSTS for a in ("--agent", n)),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=_env(),
    )
    assert made.returncode == 0, made.stderr
    command = [sys.executable, str(REPO / "tests" / "workers" / "netns_fabric_worker.py"), str(results)]
    # Claimed mode: Fabric picks the ranks, and each worker asks its agent's socket for a
    # vouch that names its claimed rank (the launch-time vouch names none).
    config = _coordinator_config(
        tmp_path,
        command,
        job=("slots_per_node = 1", 'mode = "claimed"', "require_vouch = true"),
        plan=("dp_replicate = 2",),
    )
    processes: list[subprocess.Popen] = []
    with _cluster() as ns:
        try:
            log = tmp_path / "coordinator.log"
            port_file = tmp_path / "coordinator.addr"
            processes.append(
                subprocess.Popen(
                    _in(
                        ns["coordinator"],
                        sys.executable,
                        "-m",
                        "meshgate.coordinator",
                        "--config",
                        str(config),
                        "--port-file",
                        str(port_file),
                    ),
                    stdout=open(log, "wb"),
                    stderr=subprocess.STDOUT,
                    env=_env(),
                )
            )
            _wait_for(port_file, processes[0], log, 30)
            admin = [
                "--coordinator",
                f"{COORDINATOR_IP}:7443",
                "--job",
                JOB,
                "--ca-file",
                str(tls / "ca.pem"),
                "--cert-file",
                str(tls / "admin.pem"),
                "--key-file",
                str(tls / "admin.key"),
            ]
            agents = {}
            for node_id in ("host-b", "host-a"):  # node rank 1 first: its workers wait for the master
                created = _cli(ns["coordinator"], "token", "create", "--node-id", node_id, *admin)
                assert created.returncode == 0, created.stderr
                agents[node_id] = subprocess.Popen(
                    _in(
                        ns[node_id],
                        sys.executable,
                        "-m",
                        "meshgate.agent",
                        "--config",
                        str(_agent_config(tmp_path, node_id, created.stdout.strip())),
                    ),
                    stdout=open(tmp_path / f"{node_id}.log", "wb"),
                    stderr=subprocess.STDOUT,
                    env=_env(),
                )
                processes.append(agents[node_id])
                if node_id == "host-b":
                    _until(
                        lambda: "waiting for node rank 0" in (tmp_path / "host-b.log").read_text(errors="replace"),
                        "host-b waiting for node rank 0's master",
                        30,
                    )
            try:
                _until(lambda: len(list(results.glob("*.json"))) == 2, "both Fabric ranks", 60)
            except AssertionError:
                logs = "\n".join(
                    f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                    for p in sorted([*tmp_path.glob("*.log"), *results.glob("*.json")])
                )
                raise AssertionError(f"the Fabric ranks did not report:\n{logs}") from None
            status = _status(ns["coordinator"], tls)  # mid-job: both ranks hold their group
            (results / "release").touch()
            codes = {n: a.wait(timeout=60) for n, a in agents.items()}
            elapsed = time.monotonic() - started
        finally:
            _stop(processes)
    outcomes = {o["node"]: o for o in (json.loads(p.read_text()) for p in results.glob("*.json"))}
    assert all(o["check"] == "ok" for o in outcomes.values()), outcomes
    assert codes == {"host-a": 0, "host-b": 0}, (codes, outcomes)
    assert {o["rank"] for o in outcomes.values()} == {0, 1}
    for node, outcome in outcomes.items():
        assert outcome["attested_rank"] == outcome["rank"] and outcome["rank_sum"] == 1.0, outcome
    # Every rank got node rank 0's advertised address and the port its agent reserved.
    masters = {(o["env"]["MASTER_ADDR"], o["env"]["MASTER_PORT"]) for o in outcomes.values()}
    assert len(masters) == 1, outcomes
    ((master_addr, master_port),) = masters
    assert master_addr == HOSTS["host-a"], outcomes
    assert outcomes["host-a"]["env"]["NODE_RANK"] == "0" and outcomes["host-b"]["env"]["NODE_RANK"] == "1"
    assert outcomes["host-a"]["env"]["WORLD_SIZE"] == "2"
    # status shows the master Fabric used.
    assert status["master"] == f"{master_addr}:{master_port}", status
    print(f"2-node Fabric with its master from node rank 0's agent in {elapsed:.1f}s")


# ---- liveness over a real link: a blip under the bound, a cut over it -------------------------

INTERVAL_S, MISSES = 1.0, 3  # tolerance (MISSES - 1) * INTERVAL_S = 2 s (agent/liveness.py)


def _status(namespace: str, tls: Path) -> dict:
    done = _cli(
        namespace,
        "status",
        "--json",
        "--coordinator",
        f"{COORDINATOR_IP}:7443",
        "--job",
        JOB,
        "--ca-file",
        str(tls / "ca.pem"),
        "--cert-file",
        str(tls / "admin.pem"),
        "--key-file",
        str(tls / "admin.key"),
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _states(status: dict) -> dict[str, str]:
    return {n["node_id"]: n["state"] for n in status["nodes"]}


def _until(predicate, what: str, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def test_a_blip_under_the_bound_changes_nothing_and_a_cut_over_it_loses_the_node(tmp_path):
    reason = _netns_permitted()
    if reason:
        pytest.skip(reason)
    tls = tmp_path / "tls"
    for argv in (["init", str(tls), "--host", COORDINATOR_IP, *(a for n in HOSTS for a in ("--agent", n))],):
        made = subprocess.run(
            [sys.executable, "-m", "meshgate.cli", "certs", *argv],
            capture_output=True,
            text=True,
            timeout=30,
            env=_env(),
        )
        assert made.returncode == 0, made.stderr
    config = _coordinator_config(tmp_path, [])  # no command: the agents only keep their nodes
    config.write_text(
        config.read_text().replace(
            "heartbeat_interval_s = 1.0", f"heartbeat_interval_s = {INTERVAL_S}\nheartbeat_misses = {MISSES}"
        )
    )
    processes: list[subprocess.Popen] = []
    with _cluster() as ns:
        try:
            log = tmp_path / "coordinator.log"
            port_file = tmp_path / "coordinator.addr"
            processes.append(
                subprocess.Popen(
                    _in(
                        ns["coordinator"],
                        sys.executable,
                        "-m",
                        "meshgate.coordinator",
                        "--config",
                        str(config),
                        "--port-file",
                        str(port_file),
                    ),
                    stdout=open(log, "wb"),
                    stderr=subprocess.STDOUT,
                    env=_env(),
                )
            )
            _wait_for(port_file, processes[0], log, 30)
            admin = [
                "--coordinator",
                f"{COORDINATOR_IP}:7443",
                "--job",
                JOB,
                "--ca-file",
                str(tls / "ca.pem"),
                "--cert-file",
                str(tls / "admin.pem"),
                "--key-file",
                str(tls / "admin.key"),
            ]
            for node_id in HOSTS:
                created = _cli(ns["coordinator"], "token", "create", "--node-id", node_id, *admin)
                assert created.returncode == 0, created.stderr
                agent_config = _agent_config(tmp_path, node_id, created.stdout.strip())
                agent_config.write_text(
                    agent_config.read_text().replace("exit_when_done = true", "exit_when_done = false")
                )
                processes.append(
                    subprocess.Popen(
                        _in(ns[node_id], sys.executable, "-m", "meshgate.agent", "--config", str(agent_config)),
                        stdout=open(tmp_path / f"{node_id}.log", "wb"),
                        stderr=subprocess.STDOUT,
                        env=_env(),
                    )
                )
            before = _until(
                lambda: (
                    (s := _status(ns["coordinator"], tls))
                    and _states(s) == {"host-a": "active", "host-b": "active"}
                    and s
                ),
                "both nodes active",
                30,
            )
            port_b = "port2"  # host-b's switch port (coordinator, host-a, host-b in order)

            # A blip just under the tolerance, (misses - 1) x interval (docs/operating.md).
            _ip("-n", ns["switch"], "link", "set", port_b, "down")
            time.sleep((MISSES - 1) * INTERVAL_S - 0.2)
            _ip("-n", ns["switch"], "link", "set", port_b, "up")
            time.sleep(MISSES * INTERVAL_S + INTERVAL_S)  # past the point a loss would have shown
            after_blip = _status(ns["coordinator"], tls)
            assert after_blip["generation"] == before["generation"], after_blip
            assert _states(after_blip) == {"host-a": "active", "host-b": "active"}, after_blip

            # A cut longer than misses x interval: lost, generation bumped, then it rejoins.
            _ip("-n", ns["switch"], "link", "set", port_b, "down")
            cut_at = time.time()
            lost = _until(
                lambda: (s := _status(ns["coordinator"], tls)) and _states(s)["host-b"] == "lost" and s,
                "host-b lost",
                15,
            )
            # When the coordinator decided (its log), not when our polling saw it: within
            # misses x interval of the last heartbeat (at or before the cut) plus one sweep.
            lost_after = _logged_at(log, "state=<NodeState.LOST") - cut_at
            assert lost_after <= MISSES * INTERVAL_S + INTERVAL_S / 2 + 0.3, lost_after
            assert lost["generation"] == before["generation"] + 1, lost
            _ip("-n", ns["switch"], "link", "set", port_b, "up")
            back = _until(
                lambda: (s := _status(ns["coordinator"], tls)) and _states(s)["host-b"] == "active" and s,
                "host-b back",
                30,
            )
            node_rank = {n["node_id"]: n["node_rank"] for n in back["nodes"]}
            assert node_rank == {n["node_id"]: n["node_rank"] for n in before["nodes"]}, back
        finally:
            _stop(processes)
    print(f"cut of host-b detected as lost {lost_after:.2f}s after the cut (bound {MISSES * INTERVAL_S:.0f}s + sweep)")


def _logged_at(log: Path, fragment: str) -> float:
    """The wall-clock time of the first coordinator log line containing ``fragment``."""
    import datetime

    for line in log.read_text(errors="replace").splitlines():
        if fragment in line:
            stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            return stamp.timestamp()
    raise AssertionError(f"no log line with {fragment!r} in {log}")
