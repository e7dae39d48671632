"""A per-slot job's store port is never free (issue 32, item 2, for per-slot jobs): two
agents started as the shipped unit starts them, two slots each, real gloo workers. Node
rank 0's agent listens on the job's master from its first Join and keeps the socket for
the job's life; its workers (every rank a TCPStore client: TORCHELASTIC_USE_AGENT_STORE)
meet at a store that a store host, started by the agent in the job's unit as the job
user at the first connection, serves on that socket.

A local process that tries to take the port fails at every seam: while the job waits for
its workers (the test, polling), as each worker starts before it touches torch (the
worker itself), once the world is formed (the worker again, and the test while the
world holds), and as the next generation's workers start. The port listens on the
attested address alone (/proc/net/tcp). Generation 0 forms its world with ``env://``;
a killed worker restarts the job (on-failure) and generation 1 forms a new one with
meshgate's ``init_process_group_from`` on the same port; the job SUCCEEDS."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import shipped
from conftest import REPO
from meshgate import admin
from meshgate.agent.netif import MasterReservation
from meshgate.agent.store_activation import StoreActivation, StoreHost, store_env, store_host_for, store_host_missing
from meshgate.job_cli import spec_message
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb
from shipped import ShippedCluster
from test_store_socket import listening_on, squat

shipped_host = shipped.shipped_host  # the fixture: users, interpreter, delegated cgroup

WORKER = str(REPO / "tests" / "workers" / "store_worker.py")
WORKER_ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "RES_OPTIONS": "timeout:1 attempts:1"}


def results(out: Path, generation: int) -> dict[int, dict]:
    found = {}
    for path in out.glob(f"g{generation}-r*.json"):
        try:
            found[int(path.stem.split("-r")[1])] = json.loads(path.read_text())
        except (ValueError, OSError):
            pass  # being written
    return found


def test_who_serves_the_store_is_decided_from_the_launch_alone():
    """Per-slot workers with a held master: the agent's store host, every worker a client;
    a per-node launcher or a job with no command: the handler the socket is handed to;
    an operator-set master (nothing held): worker rank 0, as torch's default."""
    assert store_host_for(has_command=True, per_node=False, agent_holds_listener=True) is StoreHost.AGENT
    assert store_host_for(has_command=True, per_node=False, agent_holds_listener=False) is StoreHost.WORKERS
    assert store_host_for(has_command=True, per_node=True, agent_holds_listener=True) is StoreHost.HANDED_OVER
    assert store_host_for(has_command=False, per_node=False, agent_holds_listener=True) is StoreHost.HANDED_OVER
    assert store_env(StoreHost.AGENT) == {"TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert store_env(StoreHost.WORKERS) == store_env(StoreHost.HANDED_OVER) == {}


def test_an_agent_whose_interpreter_lacks_torch_says_so_at_its_start_naming_the_fix():
    assert store_host_missing() is None  # this venv has torch (looked up, never imported)
    said = store_host_missing(lambda name: None)
    assert said is not None and "torch is not importable by the agent's interpreter" in said
    assert "install meshgate[torch] beside the agent" in said


def test_the_store_host_starts_at_the_first_pending_connection_only_and_once():
    """Socket activation on the held master: nothing starts while no connection is pending;
    the first one starts the store host, later ones (queued in the backlog) start no other;
    the socket never stops listening."""
    reservation = MasterReservation.reserve("127.0.0.1", {})
    port = reservation.port
    started: list[subprocess.Popen] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        came = asyncio.Event()

        def start() -> subprocess.Popen:
            started.append(subprocess.Popen([sys.executable, "-c", "pass"], stdout=subprocess.PIPE))
            loop.call_soon(came.set)
            return started[-1]

        activation = StoreActivation(reservation.listener, start, "job j generation 0")
        activation.arm()
        for _ in range(20):
            await asyncio.sleep(0)  # the loop polls the socket: nothing pending, nothing starts
        assert started == []
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        await asyncio.wait_for(came.wait(), 10)
        for _ in range(20):
            await asyncio.sleep(0)
        assert len(started) == 1 and activation.process is started[0]
        assert squat(port, "127.0.0.1") == [] and listening_on(port) == {"127.0.0.1"}
        activation.close()
        for client in clients:
            client.close()

    try:
        asyncio.run(scenario())
    finally:
        for process in started:
            process.wait()
        reservation.release()


def test_a_store_host_that_ends_by_itself_gets_its_pending_connections_refused_at_once():
    """A store host that cannot serve (here: it exits 3, as one without torch does) leaves
    the workers' connections queued; the agent accepts and closes them, so their rendezvous
    fails now, not at its timeout, and the master keeps listening (nobody else takes it)."""
    reservation = MasterReservation.reserve("127.0.0.1", {})
    port = reservation.port
    started: list[subprocess.Popen] = []

    async def scenario() -> None:
        def start() -> subprocess.Popen:
            started.append(
                subprocess.Popen(
                    [sys.executable, "-c", "print('no torch'); raise SystemExit(3)"], stdout=subprocess.PIPE
                )
            )
            return started[-1]

        activation = StoreActivation(reservation.listener, start, "job j generation 0")
        activation.arm()
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        for client in clients:
            client.settimeout(20)
            client.sendall(b"hello")
            try:
                answered = await asyncio.to_thread(client.recv, 16)
            except ConnectionResetError:
                answered = b""
            assert answered == b""  # closed by the agent, never left waiting
            client.close()
        assert len(started) == 1 and started[0].wait() == 3
        assert squat(port, "127.0.0.1") == [] and listening_on(port) == {"127.0.0.1"}
        activation.close()

    try:
        asyncio.run(scenario())
    finally:
        reservation.release()


def store_hosts(uid: int) -> list[dict]:
    """Every running ``python -m meshgate.store_host`` of user ``uid`` (other tests' jobs
    may run theirs meanwhile): its pid, uid and cgroup."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if b"meshgate.store_host" not in argv:
                continue
            owner = int(
                next(line for line in (entry / "status").read_text().splitlines() if line.startswith("Uid:")).split()[1]
            )
            cgroup = next(line[3:] for line in (entry / "cgroup").read_text().splitlines() if line.startswith("0::"))
        except (OSError, ValueError, StopIteration):
            continue
        if owner == uid:
            found.append({"pid": int(entry.name), "uid": owner, "cgroup": cgroup})
    return found


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_per_slot_jobs_store_port_is_never_free_and_a_restart_meets_on_the_same_port(shipped_host):
    with ShippedCluster(shipped_host, ("s0", "s1"), start=False) as cluster:
        for node_id in cluster.nodes:
            cluster.start_agent(node_id, extra={"slots": 2})
        out = cluster.root / "store-out"
        out.mkdir()
        out.chmod(0o1777)  # two job users write there
        spec = spec_message(
            {
                "id": "slots",
                "plan": ParallelPlan(dp_shard=4),
                "nodes": 2,
                "command": [shipped_host.python, WORKER, str(out)],
                "env": WORKER_ENV,
                "restart_policy": "on-failure",
                "max_restarts": 1,
            }
        )
        admin.submit_job(cluster.address, spec)
        explain = lambda: cluster.logs() + "\n" + "\n".join(p.read_text() for p in out.glob("*.json"))

        # Until generation 0's world is formed: the test squats on the master at every poll.
        taken_while_waiting, deadline = [], time.monotonic() + 240
        while len(results(out, 0)) < 4:
            status = cluster.job("slots").status
            if status.master_port:
                taken_while_waiting += squat(status.master_port, status.master_addr)
            assert time.monotonic() < deadline, explain()
            time.sleep(0.05)
        first = results(out, 0)
        assert all(r["check"] == "ok" for r in first.values()), explain()
        master = cluster.job("slots").status
        address, port = master.master_addr, master.master_port
        assert taken_while_waiting == [], taken_while_waiting
        for rank, seen in first.items():
            assert seen["master"] == [address, port] == seen["world_master"], seen
            assert seen["agent_store"] == "True" and seen["init"] == "env://", seen
            assert seen["squat_at_start"] == [] and seen["squat_after_init"] == [], (rank, seen)
            assert seen["rank_sum"] == 6.0, seen
        assert first[0]["own_master_store"] == "g0", first[0]  # a client of the store, docs/launchers.md "plain"
        # The world holds: nobody can take the port, and it listens on the attested address alone.
        assert squat(port, address) == [], explain()
        assert listening_on(port) == {address}, listening_on(port)
        # Its one store host: node rank 0's (s0), as its job user, in the generation's unit.
        job_user = cluster.agents["s0"].run_as.pw_uid
        (host,) = store_hosts(job_user)
        assert host["cgroup"].endswith("/job-slots-g0"), host

        os.kill(first[3]["pid"], signal.SIGKILL)  # a worker dies: on-failure restarts the job
        deadline = time.monotonic() + 240
        while len(results(out, 1)) < 4:
            assert time.monotonic() < deadline, explain()
            assert squat(port, address) == [], explain()  # between the generations too
            time.sleep(0.05)
        second = results(out, 1)
        for rank, seen in second.items():
            assert seen["check"] == "ok", explain()
            assert seen["master"] == [address, port] == seen["world_master"], seen  # the same port
            assert seen["init"] == "init_process_group_from" and seen["rank_sum"] == 6.0, seen
            assert seen["squat_at_start"] == [] and seen["squat_after_init"] == [], (rank, seen)
        assert second[0]["own_master_store"] == "g1" and second[1]["stale_marker"] is False, second
        info = cluster.wait_ended("slots", timeout=120)
        assert info.state == pb.SUCCEEDED and info.status.generation == 1, (info, explain())
        # One store host per generation, both on node rank 0; the other agent started none.
        assert cluster.agent_log("s0").count("connected to the master; store host pid") == 2, cluster.agent_log("s0")
        assert "store host" not in cluster.agent_log("s1"), cluster.agent_log("s1")
        deadline = time.monotonic() + 60  # the job is over: node rank 0's unit is killed, the store host with it
        while store_hosts(job_user):
            assert time.monotonic() < deadline, (store_hosts(job_user), explain())
            time.sleep(0.1)
