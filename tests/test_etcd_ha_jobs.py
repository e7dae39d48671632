"""Jobs mode on the etcd HA pair, real processes: two coordinators on one etcd (one lease
and one leader key for the cluster), three agents given both addresses, two jobs running
(every worker registered and its world formed). The leader is killed with SIGKILL, or etcd
is stopped and started again; a coordinator leads again, every running job resumes with
the same ranks (no rank lost, doubled or changed: every worker's attestation is recorded
and verified, and no worker is started again), and each job ends truthfully.

The workers hold until the test lets them finish (LIGHT_EXIT_0_WHEN), so the fault always
lands while both jobs run."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, RunningCoordinator, _spawn, _wait_for_address, free_port, start_agent, write_config
from test_etcd_ha import CLUSTER_ROOT as ROOT
from test_etcd_ha import serving, wait_until, wipe_cluster
from meshgate import admin
from meshgate.attestation import TrustBundle, verify_attestation
from meshgate.plan import ParallelPlan
from meshgate.v1 import attestation_pb2
from meshgate.v1 import rendezvous_pb2 as pb

pytestmark = pytest.mark.slow

NODES = ("n0", "n1", "n2")
LIGHT = [sys.executable, str(REPO / "tests" / "light_worker.py")]
LEASE_TTL_S = 2
PLANS = {"P": (ParallelPlan(tp=2, dp_shard=2), 2), "Q": (ParallelPlan(dp_shard=2), 1)}  # plan, nodes


class HACluster:
    """Two jobs-mode coordinators on etcd (one keys directory, as the HA pair provisions)
    and three agents with ``coordinator = "A,B"``."""

    def __init__(self, root: Path, etcd_endpoint: str) -> None:
        self.root = root
        self.coordinators: list[RunningCoordinator] = []
        for name in ("a", "b"):
            self.coordinators.append(self._start(name, etcd_endpoint))
            if name == "a":
                wait_until(lambda: serving(self.coordinators[0].address), 60, "the first coordinator leads", self.logs)
        spec = ",".join(c.address for c in self.coordinators)
        self.agents: dict[str, subprocess.Popen] = {}
        for node_id in NODES:
            token = admin.create_join_token(self.leader().address, "", node_id=node_id, tls=False).token
            self.agents[node_id] = start_agent(root, spec, node_id, job="", join_token=token, drain_grace_s=3)
        wait_until(lambda: all("joined the cluster" in self.agent_log(n) for n in NODES), 60, "agents join", self.logs)

    def _start(self, name: str, etcd_endpoint: str) -> RunningCoordinator:
        directory = self.root / name
        directory.mkdir()
        port = free_port()
        config = write_config(
            directory / "coordinator.toml",
            {
                "server": {"listen": f"127.0.0.1:{port}", "insecure": True},
                "keys": {"dir": str(self.root / "keys")},
                "store": {"kind": "etcd", "endpoints": [etcd_endpoint], "lease_ttl_s": LEASE_TTL_S},
                # a node has 5 s to find the new leader after a takeover before it counts as lost
                "cluster": {"heartbeat_interval_s": 0.5, "heartbeat_misses": 10},
            },
        )
        port_file, log_path = directory / "coordinator.addr", directory / "coordinator.log"
        process = _spawn(config, port_file, log_path)
        return RunningCoordinator(
            address=_wait_for_address(process, port_file, log_path, 60),
            job_id="",
            plan=ParallelPlan(),
            trust_bundle_path=self.root / "keys" / "trust-bundle.json",
            config_path=config,
            process=process,
            log_path=log_path,
        )

    def leader(self) -> RunningCoordinator:
        """The one coordinator that serves (never two: checked on every call)."""
        serving_now: list[RunningCoordinator] = []

        def one_serves() -> bool:
            serving_now[:] = [c for c in self.coordinators if c.process.poll() is None and serving(c.address)]
            assert len(serving_now) <= 1, f"{len(serving_now)} coordinators serve\n{self.logs()}"
            return len(serving_now) == 1

        wait_until(one_serves, 30, "a coordinator serves", self.logs)
        return serving_now[0]

    def submit(self, job_id: str, out: Path, done: Path) -> None:
        plan, nodes = PLANS[job_id]
        env = {
            "LIGHT_OUT": str(out),
            "LIGHT_SLEEP": "600",
            "LIGHT_EXIT_0_WHEN": str(done),
            "LIGHT_KEEP_GENERATIONS": "1",
        }
        spec = pb.JobSpec(job_id=job_id, plan=plan.to_proto(), nodes=nodes, command=LIGHT, env=env)
        info = admin.submit_job(self.leader().address, spec, tls=False)
        assert info.state == pb.RUNNING, info

    def job(self, job_id: str) -> pb.JobInfo:
        return admin.get_job(self.leader().address, job_id, tls=False)

    def wait_ended(self, job_id: str, timeout: float = 120) -> pb.JobInfo:
        ended = (pb.SUCCEEDED, pb.FAILED, pb.CANCELLED)
        wait_until(lambda: self.job(job_id).state in ended, timeout, f"job {job_id} ends", self.logs)
        return self.job(job_id)

    def agent_log(self, node_id: str) -> str:
        return (self.root / f"{node_id}.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"--- {n} ---\n{self.agent_log(n)[-2500:]}" for n in NODES) + "".join(
            f"\n--- coordinator {c.address} ---\n{c.log()[-4000:]}" for c in self.coordinators
        )

    def close(self) -> None:
        for process in self.agents.values():
            process.terminate()
        for process in self.agents.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
        for coordinator in self.coordinators:
            coordinator.stop()


@pytest.fixture
def ha(tmp_path, etcd_server):
    wipe_cluster(etcd_server)  # each test starts a new cluster on the module's etcd
    cluster = HACluster(tmp_path, etcd_server.endpoint)
    try:
        yield cluster
    finally:
        cluster.close()


def holders(info: pb.JobInfo) -> dict[str, tuple]:
    return {n.node_id: (n.node_rank, n.first_rank, n.registered) for n in info.status.nodes}


def attested(out: Path, job_id: str, bundle: TrustBundle) -> dict[tuple[int, int], tuple]:
    """Every attestation the job's workers received, verified: (generation, rank) -> holder.
    A second holder of a rank in one generation fails here."""
    plan, _ = PLANS[job_id]
    ranks: dict[tuple[int, int], tuple] = {}
    for path in sorted(out.glob("*.result")):
        r = json.loads(path.read_text())
        signed = attestation_pb2.SignedAttestation.FromString(bytes.fromhex(r["signed"]))
        att = verify_attestation(
            signed,
            bundle,
            job_id=job_id,
            plan=plan,
            nonce=bytes.fromhex(r["nonce"]),
            generation=r["generation"],
            now=time.time(),
        )
        key, holder = (att.generation, att.rank), (att.node_id, att.local_rank, r["pid"])
        assert ranks.setdefault(key, holder) == holder, f"rank {att.rank} has two holders: {ranks[key]}, {holder}"
    return ranks


def start_two_jobs(ha: HACluster, tmp_path: Path) -> tuple[dict, dict, dict, TrustBundle]:
    """P (4 ranks on 2 nodes) and Q (2 ranks on 1 node), every worker registered and its
    world formed; returns the outs, done files, holders and the trust bundle."""
    outs, done = {}, {}
    for job_id in PLANS:
        outs[job_id], done[job_id] = tmp_path / job_id, tmp_path / f"{job_id}.done"
        outs[job_id].mkdir()
        ha.submit(job_id, outs[job_id], done[job_id])
    for job_id, (plan, _) in PLANS.items():
        wait_until(
            lambda: len(list(outs[job_id].glob("*.result"))) == plan.world_size,
            120,
            f"job {job_id}'s workers register",
            ha.logs,
        )
    before = {job_id: holders(ha.job(job_id)) for job_id in PLANS}
    return outs, done, before, TrustBundle.load(ha.root / "keys" / "trust-bundle.json")


def check_same_ranks(ha: HACluster, outs: dict, before: dict, recorded: dict, bundle: TrustBundle) -> None:
    """After the fault: the leader reports every job's nodes with the same ranks, and the
    workers hold the same attestations (generation 0, no worker started again)."""
    assert {job_id: holders(ha.job(job_id)) for job_id in PLANS} == before, ha.logs()
    for job_id, (plan, _) in PLANS.items():
        now = attested(outs[job_id], job_id, bundle)
        assert now == recorded[job_id], f"job {job_id}: an attested rank changed or was added\n{ha.logs()}"
        assert sorted(rank for _, rank in now) == list(range(plan.world_size))


def finish_truthfully(ha: HACluster, done: dict) -> None:
    """P's workers finish (exit 0): SUCCEEDED in generation 0 with every exit 0; Q is
    cancelled: CANCELLED. GetJob says so."""
    done["P"].touch()
    p = ha.wait_ended("P")
    assert p.state == pb.SUCCEEDED and p.status.generation == 0, (p, ha.logs())
    exits = [e for n in p.status.nodes for e in n.exits]
    assert len(exits) == 4 and all(e.endswith("exit 0") for e in exits), exits
    assert p.status.registered == 4
    admin.cancel_job(ha.leader().address, "Q", "enough", tls=False)
    q = ha.wait_ended("Q")
    assert q.state == pb.CANCELLED and "enough" in q.reason, q
    assert q.status.generation == 0 and q.status.registered == 2


def test_leader_kill_9_with_two_jobs_running_loses_doubles_and_changes_no_rank(ha, tmp_path):
    outs, done, before, bundle = start_two_jobs(ha, tmp_path)
    recorded = {job_id: attested(outs[job_id], job_id, bundle) for job_id in PLANS}
    old = ha.leader()
    standby = next(c for c in ha.coordinators if c is not old)
    old.kill()
    takeover = wait_until(lambda: serving(standby.address), 6 * LEASE_TTL_S, "the standby leads", ha.logs)
    assert takeover <= 2 * LEASE_TTL_S + 1.5, f"the standby took {takeover:.1f}s to lead"
    check_same_ranks(ha, outs, before, recorded, bundle)
    finish_truthfully(ha, done)
    assert "Traceback" not in standby.log(), standby.log()[-3000:]
    print(
        f"leader kill -9 with 2 jobs running: the standby led {takeover:.2f}s later; "
        f"6 ranks, 0 lost, 0 doubled, 0 changed"
    )


def test_etcd_stopped_and_restarted_with_two_jobs_running_loses_doubles_and_changes_no_rank(ha, tmp_path, etcd_server):
    outs, done, before, bundle = start_two_jobs(ha, tmp_path)
    recorded = {job_id: attested(outs[job_id], job_id, bundle) for job_id in PLANS}
    old = ha.leader()
    etcd_server.stop()
    try:
        wait_until(lambda: not serving(old.address), 30, "the leader steps down", ha.logs)
        wait_until(
            lambda: all("etcd unavailable" in c.log() for c in ha.coordinators),
            30,
            "both coordinators see etcd gone",
            ha.logs,
        )
        assert all(c.process.poll() is None for c in ha.coordinators), "a coordinator exited"
    finally:
        etcd_server.start()
    back = wait_until(
        lambda: any(serving(c.address) for c in ha.coordinators), 40, "a coordinator leads again", ha.logs
    )
    check_same_ranks(ha, outs, before, recorded, bundle)
    finish_truthfully(ha, done)
    assert all(c.process.poll() is None for c in ha.coordinators), "a coordinator exited"
    for coordinator in ha.coordinators:
        assert "Traceback" not in coordinator.log(), coordinator.log()[-3000:]
    print(
        f"etcd stopped and restarted with 2 jobs running: a coordinator led again {back:.2f}s after etcd "
        "served; 6 ranks, 0 lost, 0 doubled, 0 changed"
    )


def test_garbage_in_the_cluster_log_in_etcd_stops_the_coordinator_naming_the_key_and_how_to_reset(
    etcd_server, tmp_path
):
    import aetcd

    from conftest import worker_env

    async def plant():
        host, port = etcd_server.endpoint.rsplit(":", 1)
        async with aetcd.Client(host=host, port=int(port)) as client:
            await client.put(f"{ROOT}meta".encode(), json.dumps({"schema": 2, "job_id": "cluster"}).encode())
            await client.put(f"{ROOT}events/000000000001".encode(), b"\x00 not json")

    wipe_cluster(etcd_server)
    asyncio.run(plant())
    config = write_config(
        tmp_path / "coordinator.toml",
        {
            "server": {"listen": f"127.0.0.1:{free_port()}", "insecure": True},
            "keys": {"dir": str(tmp_path / "keys")},
            "store": {"kind": "etcd", "endpoints": [etcd_server.endpoint], "lease_ttl_s": LEASE_TTL_S},
        },
    )
    result = subprocess.run(
        [sys.executable, "-m", "meshgate.coordinator", "--config", str(config)],
        cwd=REPO,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert f"{ROOT}events/000000000001" in result.stderr
    assert f"etcdctl del --prefix {ROOT}" in result.stderr and str(tmp_path / "keys" / "marks") in result.stderr


def test_a_paused_leader_that_wakes_deposed_changes_no_job(ha, tmp_path):
    """The leader is frozen (SIGSTOP) past its lease and past the nodes' heartbeat tolerance,
    as in a partition, and the standby takes over. When the old leader runs again, every
    node has been silent for longer than the tolerance, so its sweeper would declare them
    lost and end the generation. Whichever comes first, its lease check or such a write (then
    fenced), nothing of it lands: it steps down without exiting, and the jobs go on in
    generation 0 with the same ranks and end truthfully."""
    import os
    import signal

    outs, done, before, bundle = start_two_jobs(ha, tmp_path)
    recorded = {job_id: attested(outs[job_id], job_id, bundle) for job_id in PLANS}
    old = ha.leader()
    standby = next(c for c in ha.coordinators if c is not old)
    os.kill(old.process.pid, signal.SIGSTOP)
    paused_at = time.monotonic()
    try:
        wait_until(lambda: serving(standby.address), 6 * LEASE_TTL_S + 10, "the standby leads", ha.logs)
        tolerance = 0.5 * 10 + 1  # heartbeat_interval_s x heartbeat_misses, and a second more
        wait_until(lambda: time.monotonic() - paused_at > tolerance, tolerance + 1, "the pause to pass the tolerance")
    finally:
        os.kill(old.process.pid, signal.SIGCONT)
    wait_until(lambda: "stepping down to standby" in old.log(), 30, "the old leader steps down", ha.logs)
    assert old.process.poll() is None, "the deposed leader exited"
    assert ha.leader() is standby
    check_same_ranks(ha, outs, before, recorded, bundle)
    finish_truthfully(ha, done)
    assert "Traceback" not in old.log(), old.log()[-3000:]
    how = "a fenced write" if "write refused (fenced)" in old.log() else "its lease check"
    print(
        f"leader paused {tolerance:g}s+: the standby led; the old one woke and stepped down on {how}; "
        "6 ranks, 0 lost, 0 doubled, 0 changed"
    )
