"""Jobs mode on real processes: one coordinator and three agents (mTLS with a dev CA,
vouches required) serve job after job, and jobs side by side, with no config edited and
no daemon restarted between them.

One cluster for the module (the tests run in order and each leaves every node idle).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from conftest import (
    REPO,
    RunningCoordinator,
    _wait_for_address,
    free_port,
    simulated_machine_id,
    worker_env,
    write_config,
)
from meshgate import admin
from meshgate.attestation import TrustBundle, verify_attestation
from meshgate.cli import main as meshgate_main
from meshgate.job_cli import spec_message
from meshgate.client import RendezvousRefused
from meshgate.plan import ParallelPlan
from meshgate.tls import init_dev_ca
from meshgate.v1 import attestation_pb2
from meshgate.v1 import rendezvous_pb2 as pb

pytestmark = pytest.mark.slow

NODES = ("n0", "n1", "n2")
LIGHT = [sys.executable, str(REPO / "tests" / "light_worker.py")]


class Cluster:
    def __init__(
        self, root: Path, nodes: tuple[str, ...] = NODES, labels=None, cluster=None, **coordinator_env: str
    ) -> None:
        """``coordinator_env``: added to the coordinator's environment at every start (a test hook);
        ``labels``: node id -> its agent's labels (default: n2 alone on switch s2); ``cluster``:
        [cluster] keys over the module's."""
        self.root = root
        self.nodes = tuple(nodes)
        self.labels = labels or {n: {"switch": "s1" if n != "n2" else "s2"} for n in self.nodes}
        self.coordinator_env = coordinator_env
        self.ca = init_dev_ca(root / "tls", agent_names=self.nodes)
        self.admin_tls = self.ca.client_tls(self.ca.admin)
        port, metrics_port = free_port(), free_port()
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.config = write_config(
            root / "coordinator.toml",
            {
                "server": {
                    "listen": f"127.0.0.1:{port}",
                    "metrics_listen": f"127.0.0.1:{metrics_port}",
                    "ca_file": str(self.ca.ca),
                    "cert_file": str(self.ca.server.cert),
                    "key_file": str(self.ca.server.key),
                    "require_client_cert": True,
                },
                "keys": {"dir": str(root / "keys")},
                "store": {"dir": str(root / "state")},
                # quarantine_after = 0: the module's jobs fail workers on purpose, test after
                # test on the same three nodes; quarantine has its own tests
                # (test_node_admission.py, test_node_health_shipped.py).
                "cluster": {
                    "heartbeat_interval_s": 0.5,
                    "heartbeat_misses": 3,
                    "quarantine_after": 0,
                    **(cluster or {}),
                },
            },
        )
        self.coordinator = self._start()
        self.agents: dict[str, subprocess.Popen] = {}
        for node_id in self.nodes:
            self.start_agent(node_id)

    def _start(self) -> RunningCoordinator:
        port_file, log_path = self.root / "coordinator.addr", self.root / "coordinator.log"
        port_file.unlink(missing_ok=True)
        process = self.spawn(
            "coordinator",
            ["-m", "meshgate.coordinator", "--config", str(self.config), "--port-file", str(port_file)],
            log_path,
            self.coordinator_env,
        )
        return RunningCoordinator(
            address=_wait_for_address(process, port_file, log_path, 30),
            job_id="",
            plan=ParallelPlan(),
            trust_bundle_path=self.root / "keys" / "trust-bundle.json",
            config_path=self.config,
            process=process,
            log_path=log_path,
        )

    @property
    def address(self) -> str:
        return self.coordinator.address

    def start_agent(self, node_id: str, **env: str) -> None:
        state = self.root / f"{node_id}-state"
        table = {
            "coordinator": self.address,
            "node_id": node_id,
            "slots": 2,
            "state_dir": str(state),
            "machine_id_file": simulated_machine_id(self.root, node_id),
            "ca_file": str(self.ca.ca),
            "cert_file": str(self.ca.agent(node_id).cert),
            "key_file": str(self.ca.agent(node_id).key),
            "worker_cert_file": str(self.ca.worker.cert),
            "worker_key_file": str(self.ca.worker.key),
            "drain_grace_s": 3,
            "labels": self.labels[node_id],
            # The workers import meshgate from the test venv under /root: no job user could
            # run it here (tests/test_containment.py runs a real job user).
            "run_jobs_as_agent": True,
        }
        if not (state / "node.credential").exists():
            table["join_token"] = admin.create_join_token(self.address, "", node_id=node_id, tls=self.admin_tls).token
        config = write_config(self.root / f"{node_id}.toml", self.agent_sections(table))
        self.agents[node_id] = self.spawn(
            node_id, ["-m", "meshgate.agent", "--config", str(config)], self.root / f"{node_id}.log", env
        )

    def agent_sections(self, table: dict) -> dict[str, dict]:
        """The agent.toml of a node whose [agent] table is ``table``."""
        return {"agent": table}

    def spawn(self, daemon: str, argv: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
        """``daemon``: "coordinator" or a node id (tests/test_upgrade_matrix.py runs some of
        them under an earlier release)."""
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                [sys.executable, *argv], cwd=REPO, env=worker_env(**env), stdout=log, stderr=subprocess.STDOUT
            )

    def cli(self, command: str, *argv: str) -> list[str]:
        """``meshgate job COMMAND`` with this cluster's admin connection, then ``argv``."""
        return [
            "job",
            command,
            "--coordinator",
            self.address,
            "--ca-file",
            str(self.ca.ca),
            "--cert-file",
            str(self.ca.admin.cert),
            "--key-file",
            str(self.ca.admin.key),
            *argv,
        ]

    def submit(self, job_id: str, plan: ParallelPlan, nodes: int, command: list[str], **spec) -> pb.JobInfo:
        """``spec``: more [job] keys, as a job file spells them (restart_policy="on-failure")."""
        message = spec_message({"id": job_id, "plan": plan, "nodes": nodes, "command": command, **spec})
        return admin.submit_job(self.address, message, tls=self.admin_tls)

    def job(self, job_id: str) -> pb.JobInfo:
        return admin.get_job(self.address, job_id, tls=self.admin_tls)

    def wait_ended(self, job_id: str, timeout: float = 120) -> pb.JobInfo:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.state in (pb.SUCCEEDED, pb.FAILED, pb.CANCELLED):
                return info
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} did not end in {timeout}s: {info}\n{self.logs()}")

    def wait_idle(self, timeout: float = 30) -> None:
        """Every job ended and every node is back in the pool (its agent showed the
        containment units of its last job empty)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            busy = [
                j.spec.job_id
                for j in admin.list_jobs(self.address, tls=self.admin_tls).jobs
                if j.state in (pb.PENDING, pb.RUNNING)
            ]
            with urllib.request.urlopen(self.metrics_url, timeout=5) as response:
                idle = f'meshgate_nodes{{state="idle"}} {float(len(self.nodes))}' in response.read().decode()
            if not busy and idle:
                return
            time.sleep(0.2)
        raise AssertionError(f"jobs still running: {busy}, or not every node idle")

    def wait_joined(self, timeout: float = 60) -> None:
        """Every agent has joined the cluster."""
        deadline = time.monotonic() + timeout
        while not all("joined the cluster" in self.agent_log(n) for n in self.nodes):
            assert time.monotonic() < deadline, self.logs()
            time.sleep(0.1)

    def agent_log(self, node_id: str) -> str:
        return (self.root / f"{node_id}.log").read_text(errors="replace")

    def logs(self) -> str:
        return (
            "\n".join(f"--- {n} ---\n{self.agent_log(n)[-3000:]}" for n in self.nodes)
            + f"\n--- coordinator ---\n{self.coordinator.log()[-4000:]}"
        )

    def close(self) -> None:
        for process in self.agents.values():
            process.terminate()
        for process in self.agents.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
        self.coordinator.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("jobs"))
    try:
        cluster.wait_joined()
        yield cluster
    finally:
        cluster.close()


def results(directory: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in directory.glob("*.json")), key=lambda r: r["rank"])


def test_job_after_job_and_two_jobs_side_by_side_each_verify_their_device_mesh(cluster, tmp_path, capsys):
    """Job A (tp=2, dp_shard=2 on 2 nodes) to SUCCEEDED, then B (dp_shard=4 on 2 nodes)
    and C (dp_shard=2 on the third node) at the same time, through the same daemons."""
    mesh_worker = [sys.executable, "-m", "meshgate.launchers.demo_worker", "--out"]
    outs = {name: tmp_path / name for name in "ABC"}
    for out in outs.values():
        out.mkdir()
    plan_a, plan_b, plan_c = ParallelPlan(tp=2, dp_shard=2), ParallelPlan(dp_shard=4), ParallelPlan(dp_shard=2)
    plan_file = tmp_path / "a.toml"
    plan_file.write_text("tp = 2\ndp_shard = 2\n")
    assert (
        meshgate_main(
            cluster.cli(
                "submit", "--plan", str(plan_file), "--nodes", "2", "--id", "A", "--", *mesh_worker, str(outs["A"])
            )
        )
        == 0
    )
    assert "job A submitted: RUNNING on n0, n1" in capsys.readouterr().out  # both on switch s1
    assert meshgate_main(cluster.cli("wait", "A", "--wait-timeout", "120")) == 0, cluster.logs()
    cluster.wait_idle()  # A's nodes are back in the pool once their agents show A's units empty

    cluster.submit("B", plan_b, 2, mesh_worker + [str(outs["B"])])
    cluster.submit("C", plan_c, 1, mesh_worker + [str(outs["C"])])
    b, c = cluster.wait_ended("B"), cluster.wait_ended("C")
    assert (b.state, c.state) == (pb.SUCCEEDED, pb.SUCCEEDED), cluster.logs()
    assert set(b.nodes) == {"n0", "n1"} and list(c.nodes) == ["n2"]
    # C ran while B ran: its interval overlaps B's
    assert c.submitted_at.ToNanoseconds() < b.ended_at.ToNanoseconds()

    bundle = TrustBundle.load(cluster.coordinator.trust_bundle_path)
    for name, plan in zip("ABC", (plan_a, plan_b, plan_c)):
        got = results(outs[name])
        assert [r["rank"] for r in got] == list(range(plan.world_size)), (name, got, cluster.logs())
        assert all(r["check"] == "ok" for r in got), (name, got)
        info = cluster.job(name)
        assert info.status.job_id == name and info.status.registered == plan.world_size
        assert info.plan_digest == plan.digest()
        exits = [e for n in info.status.nodes for e in n.exits]
        assert len(exits) == plan.world_size and all(e.endswith("exit 0") for e in exits)
    # every worker's attestation names its own job, and verifies against the cluster's bundle
    for name, plan in zip("ABC", (plan_a, plan_b, plan_c)):
        for r in results(outs[name]):
            signed = attestation_pb2.SignedAttestation.FromString(bytes.fromhex(r["attestation"]))
            att = verify_attestation(
                signed, bundle, job_id=name, plan=plan, nonce=bytes.fromhex(r["nonce"]), generation=0, now=time.time()
            )
            assert (att.rank, att.job_id) == (r["rank"], name)

    # what each rank verified and checked is in its output: `meshgate job logs` shows it, and
    # the attestation it prints verifies offline with `meshgate verify`
    capsys.readouterr()
    assert meshgate_main(cluster.cli("logs", "A")) == 0
    logs = capsys.readouterr().out
    for rank in range(plan_a.world_size):
        assert f"rank {rank} VERIFIED: job A gen 0 rank {rank}/4" in logs, logs
    assert logs.count("check passed: DeviceMesh built from it matches the plan on dp_shard, tp") == 4
    printed = logs.split("attestation (base64; meshgate verify FILE --trust-bundle B): ")[1].split()[0]
    (tmp_path / "from-logs.att").write_text(printed)
    verify = ["verify", str(tmp_path / "from-logs.att"), "--trust-bundle", str(cluster.coordinator.trust_bundle_path)]
    assert meshgate_main([*verify, "--job", "A"]) == 0
    assert capsys.readouterr().out.startswith("verified: job A gen 0 rank ")

    capsys.readouterr()
    assert meshgate_main(cluster.cli("list")) == 0
    listed = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[1:]}
    assert {k: listed[k] for k in "ABC"} == {"A": "SUCCEEDED", "B": "SUCCEEDED", "C": "SUCCEEDED"}
    # meshgate status reads one job's rendezvous
    status_argv = cluster.cli("x")[2:]
    assert meshgate_main(["status", "--job", "B", *status_argv]) == 0
    assert "registered 4/4 ranks" in capsys.readouterr().out
    cluster.wait_idle()


def test_a_job_that_does_not_fit_waits_and_says_why_then_runs_when_nodes_free(cluster, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    cluster.submit("hold", ParallelPlan(dp_shard=4), 2, LIGHT, env={"LIGHT_OUT": str(out), "LIGHT_SLEEP": "30"})
    big = cluster.submit("big", ParallelPlan(dp_shard=4), 2, LIGHT, env={"LIGHT_OUT": str(out)})
    assert big.state == pb.PENDING
    assert big.reason.startswith("needs 2 nodes of 2 slots; 1 idle; first in line: "), big.reason
    assert big.reason.endswith(" reserved for it from when job 'hold' ends (it has no time limit)"), big.reason
    later = cluster.submit("later", ParallelPlan(dp_shard=2), 1, LIGHT, env={"LIGHT_OUT": str(out)})
    # it waits behind big although a node is idle: that node is big's, and later has no time limit
    assert later.state == pb.PENDING
    assert "behind job 'big' (first in line)" in later.reason, later.reason
    with pytest.raises(Exception, match="not known"):
        admin.get_job(cluster.address, "nope", tls=cluster.admin_tls)
    cancelled = admin.cancel_job(cluster.address, "hold", "make room", tls=cluster.admin_tls)
    assert cancelled.state == pb.CANCELLED and cancelled.reason == "make room"
    assert cluster.wait_ended("big").state == pb.SUCCEEDED, cluster.logs()
    assert cluster.wait_ended("later").state == pb.SUCCEEDED, cluster.logs()
    cluster.wait_idle()


def _allocated_at(cluster: Cluster, job_id: str) -> float:
    timeline = admin.get_job_timeline(cluster.address, job_id, tls=cluster.admin_tls)
    (at,) = [e.at.ToNanoseconds() / 1e9 for e in timeline.entries if e.moment == pb.TIMELINE_ALLOCATED]
    return at


def test_backfill_starts_what_cannot_delay_the_waiting_big_job_which_starts_first_when_its_nodes_free(
    cluster, tmp_path
):
    """Backfill on real agents: a big job waits for a node a time-limited job holds; a small
    job whose time limit ends before then runs at once on the idle nodes reserved for big;
    one without a time limit, and one naming a reserved node, wait (they could delay big);
    once the node frees, big starts before either; big itself is ended at its time limit."""
    out, big_out, release = tmp_path / "out", tmp_path / "big", tmp_path / "release"
    out.mkdir()
    big_out.mkdir()
    env = {"LIGHT_OUT": str(out)}
    lingering = {**env, "LIGHT_SLEEP": "600", "LIGHT_EXIT_0_WHEN": str(release)}
    two = ParallelPlan(dp_shard=2)
    hold = cluster.submit("bf-hold", two, 0, LIGHT, node_ids=["n0"], time_limit_s=3600, env=lingering)
    assert hold.state == pb.RUNNING, hold.reason
    big_env = {"LIGHT_OUT": str(big_out), "LIGHT_SLEEP": "600"}
    big = cluster.submit("bf-big", ParallelPlan(dp_shard=6), 3, LIGHT, time_limit_s=10, env=big_env)
    assert big.state == pb.PENDING
    assert "; first in line: n0, n1, n2 reserved for it from in ~" in big.reason, big.reason
    assert big.reason.endswith("when job 'bf-hold' reaches its time limit"), big.reason
    small = cluster.submit("bf-small", two, 1, LIGHT, time_limit_s=600, env=env)
    assert small.state == pb.RUNNING, small.reason  # ends (at the latest) long before bf-hold's limit
    nolimit = cluster.submit("bf-nolimit", two, 1, LIGHT, env=env)
    named = cluster.submit("bf-named", two, 0, LIGHT, node_ids=["n2"], env=env)
    for waiting in (nolimit, named):
        assert waiting.state == pb.PENDING, waiting
        assert "behind job 'bf-big' (first in line): n0, n1, n2 reserved for it" in waiting.reason, waiting.reason
        assert "a time limit of " in waiting.reason and " or less would start it now" in waiting.reason
    assert cluster.wait_ended("bf-small").state == pb.SUCCEEDED, cluster.logs()
    assert cluster.job("bf-big").state == pb.PENDING
    release.touch()  # bf-hold's workers exit 0: n0 frees
    assert cluster.wait_ended("bf-hold").state == pb.SUCCEEDED, cluster.logs()
    big_pids = [r["pid"] for r in _wait_results(big_out, 6, cluster)]  # its workers linger, to be stopped
    ended = cluster.wait_ended("bf-big")
    assert (ended.state, ended.reason) == (pb.FAILED, "time limit 10s reached"), cluster.logs()
    for later in ("bf-nolimit", "bf-named"):
        assert cluster.wait_ended(later).state == pb.SUCCEEDED, cluster.logs()
        # big got its nodes first; the later jobs only once it had ended
        assert _allocated_at(cluster, "bf-big") < _allocated_at(cluster, later)
        assert _allocated_at(cluster, later) >= ended.ended_at.ToNanoseconds() / 1e9
    assert list(cluster.job("bf-named").nodes) == ["n2"]
    # big's workers (lingering 600 s) were stopped at its time limit, as a cancel stops them
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in big_pids):
        assert time.monotonic() < deadline, f"bf-big's workers {big_pids} outlived its time limit\n{cluster.logs()}"
        time.sleep(0.1)
    cluster.wait_idle()


def test_an_impossible_job_is_refused_and_one_waiting_for_nodes_does_not_block_a_job_that_fits(
    cluster,
    tmp_path,
    capsys,
):
    out = tmp_path / "out"
    out.mkdir()
    plan_file = tmp_path / "wide.toml"
    plan_file.write_text("dp_shard = 8\n")  # on 1 node: 8 slots, and every node has 2
    wide = ("submit", "--plan", str(plan_file), "--nodes", "1", "--id", "wide", "--", *LIGHT)
    capsys.readouterr()
    assert meshgate_main(cluster.cli(*wide)) == 2
    refusal = capsys.readouterr().err
    assert "needs 1 node of 8 slots, but only 0 of the 3 joined nodes have 8 slots or more" in refusal, refusal
    assert "(the most any has is 2)" in refusal and "--wait-for-nodes" in refusal
    with pytest.raises(RendezvousRefused, match="pinned node\\(s\\) n9 have not joined") as refused:
        cluster.submit("pinned", ParallelPlan(dp_shard=2), 0, LIGHT, node_ids=["n9"])
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert not [
        j for j in admin.list_jobs(cluster.address, tls=cluster.admin_tls).jobs if j.spec.job_id in ("wide", "pinned")
    ]  # nothing was recorded
    # said to wait for nodes: PENDING, saying waiting for these nodes cannot help
    assert meshgate_main(cluster.cli(*wide[: -len(LIGHT) - 1], "--wait-for-nodes", "--", *LIGHT)) == 0
    assert "it waits for nodes that have not joined" in capsys.readouterr().out
    # a later job that fits on nodes the waiting one can never use runs at once
    later = cluster.submit("fits", ParallelPlan(dp_shard=2), 1, LIGHT, env={"LIGHT_OUT": str(out)})
    assert later.state == pb.RUNNING, later.reason
    assert cluster.wait_ended("fits").state == pb.SUCCEEDED, cluster.logs()
    assert cluster.job("wide").state == pb.PENDING
    admin.cancel_job(cluster.address, "wide", "no 8-slot nodes here", tls=cluster.admin_tls)
    cluster.wait_idle()


def test_cancel_stops_the_workers_and_returns_the_nodes(cluster, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    cluster.submit("long", ParallelPlan(dp_shard=2), 1, LIGHT, env={"LIGHT_OUT": str(out), "LIGHT_SLEEP": "120"})
    deadline = time.monotonic() + 60
    while len(list(out.glob("*.json"))) < 2:
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.1)
    pids = [r["pid"] for r in results(out)]
    assert meshgate_main(cluster.cli("cancel", "long")) == 0
    assert meshgate_main(cluster.cli("wait", "long")) == 3
    info = cluster.job("long")
    assert info.state == pb.CANCELLED
    with pytest.raises(Exception, match="already ended"):
        admin.cancel_job(cluster.address, "long", "", tls=cluster.admin_tls)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"workers {pids} still running after cancel\n{cluster.logs()}"
        time.sleep(0.1)
    assert admin.get_job(cluster.address, "long", tls=cluster.admin_tls).state == pb.CANCELLED
    cluster.wait_idle()


def test_a_worker_failure_restarts_the_whole_job_then_fails_it_naming_worker_and_node(cluster, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    marker = tmp_path / "failed-once"
    once = cluster.submit(
        "flaky",
        ParallelPlan(dp_shard=4),
        2,
        LIGHT,
        restart_policy="on-failure",
        max_restarts=1,
        env={"LIGHT_OUT": str(out), "LIGHT_FAIL_RANK": "3", "LIGHT_FAIL_MARKER": str(marker)},
    )
    assert once.state == pb.RUNNING
    info = cluster.wait_ended("flaky")
    assert info.state == pb.SUCCEEDED and info.status.generation == 1, (info, cluster.logs())
    always = cluster.submit(
        "broken",
        ParallelPlan(dp_shard=2),
        1,
        LIGHT,
        restart_policy="on-failure",
        max_restarts=1,
        env={"LIGHT_OUT": str(out), "LIGHT_FAIL_RANK": "1"},
    )
    assert meshgate_main(cluster.cli("watch", "broken")) == 1  # the exit code is the outcome
    info = cluster.wait_ended("broken")
    assert info.state == pb.FAILED, (info, cluster.logs())
    node = always.nodes[0]
    assert f"on node '{node}' exited 1" in info.reason and "restarts exhausted (1/1)" in info.reason, info.reason
    cluster.wait_idle()


def test_coordinator_kill_9_mid_two_jobs_both_resume_with_the_same_ranks(cluster, tmp_path):
    outs = {name: tmp_path / name for name in ("P", "Q")}
    for out in outs.values():
        out.mkdir()
    cluster.submit("P", ParallelPlan(tp=2, dp_shard=2), 2, LIGHT, env={"LIGHT_OUT": str(outs["P"]), "LIGHT_SLEEP": "8"})
    cluster.submit("Q", ParallelPlan(dp_shard=2), 1, LIGHT, env={"LIGHT_OUT": str(outs["Q"]), "LIGHT_SLEEP": "8"})
    deadline = time.monotonic() + 60
    while len(list(outs["P"].glob("*.json"))) < 4 or len(list(outs["Q"].glob("*.json"))) < 2:
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.1)
    before = {name: _holders(cluster.job(name)) for name in outs}
    cluster.coordinator.kill()
    cluster.coordinator = cluster._start()
    after = {name: _holders(cluster.job(name)) for name in outs}
    assert after == before  # every rank with the same node after the restart
    for name in outs:
        info = cluster.wait_ended(name)
        assert info.state == pb.SUCCEEDED and info.status.generation == 0, (info, cluster.logs())
        assert [r["rank"] for r in results(outs[name])] == list(range(info.status.plan.dp_shard * info.status.plan.tp))
    cluster.wait_idle()


def _holders(info: pb.JobInfo) -> dict[str, tuple]:
    return {n.node_id: (n.node_rank, n.first_rank, n.registered) for n in info.status.nodes}


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_results(out: Path, count: int, cluster: Cluster, timeout: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout
    while len(list(out.glob("*.json"))) < count:
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.1)
    return results(out)


def _kill_node(cluster: Cluster, node_id: str, workers: list[dict]) -> None:
    """The node dies: its agent and its workers, at once (SIGKILL)."""
    import os
    import signal

    cluster.agents[node_id].kill()
    cluster.agents[node_id].wait()
    for r in workers:
        if r["node_id"] == node_id:
            try:
                os.kill(r["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_lost_node_is_replaced_by_the_jobs_spare_and_the_job_succeeds(cluster, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    job = cluster.submit(
        "spared",
        ParallelPlan(dp_shard=4),
        2,
        LIGHT,
        spares=1,
        env={"LIGHT_OUT": str(out), "LIGHT_SLEEP": "60", "LIGHT_LINGER_GENERATION": "0"},
    )
    assert len(job.nodes) == 2 and len(job.spare_nodes) == 1
    lost, spare = job.nodes[1], job.spare_nodes[0]
    first = _wait_results(out, 4, cluster)
    _kill_node(cluster, lost, first)
    info = cluster.wait_ended("spared")
    assert info.state == pb.SUCCEEDED and info.status.generation == 1, (info, cluster.logs())
    states = {n.node_id: (n.state, n.node_rank) for n in info.status.nodes}
    assert states[spare] == (pb.NODE_STATE_ACTIVE, 1) and states[lost][0] in (
        pb.NODE_STATE_LOST,
        pb.NODE_STATE_REPLACED,
    ), states
    # the survivor kept its ranks, the spare took the lost node's whole block
    final = {r["rank"]: r["node_id"] for r in results(out) if r["generation"] == 1}
    assert final == {0: job.nodes[0], 1: job.nodes[0], 2: spare, 3: spare}, final
    cluster.start_agent(lost)  # it comes back, rejoins the cluster with its credential
    cluster.wait_idle()


def test_an_agent_killed_for_good_loses_its_node_though_its_workers_heartbeat_and_the_spare_takes_the_block(
    cluster, tmp_path
):
    """kill -9 of one member's agent, never restarted: its workers run on and heartbeat
    (directly, as workers of an agent without fan_in do). A node is alive while its agent
    is: it is lost within the liveness bound, the spare takes its block in generation 1,
    and the orphans' heartbeats are refused (their generation is over). Every view names
    the nodes that hold the job now, while it runs and once it ended."""
    import os
    import signal

    out, release = tmp_path / "out", tmp_path / "release"
    out.mkdir()
    job = cluster.submit(
        "orphaned",
        ParallelPlan(dp_shard=4),
        2,
        LIGHT,
        spares=1,
        env={
            "LIGHT_OUT": str(out),
            "LIGHT_SLEEP": "60",
            "LIGHT_EXIT_0_WHEN": str(release),
            "LIGHT_HEARTBEAT": "0.2",
            "LIGHT_KEEP_GENERATIONS": "1",
        },
    )
    lost, spare = job.nodes[1], job.spare_nodes[0]
    orphans = [r for r in _wait_results(out, 4, cluster) if r["node_id"] == lost]
    cluster.agents[lost].kill()
    cluster.agents[lost].wait()
    killed_at = time.monotonic()
    now_held = [job.nodes[0], spare]

    def views_name_the_holders() -> None:
        info = cluster.job("orphaned")
        (listed,) = [
            j for j in admin.list_jobs(cluster.address, tls=cluster.admin_tls).jobs if j.spec.job_id == "orphaned"
        ]
        for shown in (info, listed):
            assert (list(shown.nodes), list(shown.spare_nodes)) == (now_held, []), (shown.nodes, shown.spare_nodes)

    try:
        deadline = time.monotonic() + 40
        while len(list(out.glob("*.g1.result"))) < 4:
            assert time.monotonic() < deadline, cluster.logs()
            time.sleep(0.1)
        replaced_in = time.monotonic() - killed_at
        views_name_the_holders()  # running: from its rendezvous
        for orphan in orphans:  # still running, and told their generation is over
            os.kill(orphan["pid"], 0)
            beats = out / f"{lost}-{orphan['local_rank']}.hb"
            deadline = time.monotonic() + 10
            while not beats.exists():
                assert time.monotonic() < deadline, f"{beats} never written: the orphan's heartbeats were answered"
                time.sleep(0.1)
            assert "over" in json.loads(beats.read_text()), beats
        release.touch()
        info = cluster.wait_ended("orphaned", timeout=40)
        assert info.state == pb.SUCCEEDED and info.status.generation == 1, (info, cluster.logs())
        views_name_the_holders()  # ended: from its summary
        held = [json.loads(p.read_text()) for p in out.glob("*.result")]
        holders = [(r["generation"], r["rank"]) for r in held]
        assert sorted(holders) == sorted(set(holders)) and len(holders) == 8, holders  # one holder each
        final = {r["rank"]: r["node_id"] for r in held if r["generation"] == 1}
        assert final == {0: job.nodes[0], 1: job.nodes[0], 2: spare, 3: spare}, final
        print(f"agent killed -> generation 1's world on the spare in {replaced_in:.1f} s (heartbeat 0.5 s x 3)")
    finally:
        release.touch()
        for orphan in orphans:
            try:
                os.kill(orphan["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        cluster.start_agent(lost)
    cluster.wait_idle()


def test_a_lost_node_without_a_spare_or_a_node_of_the_pool_fails_the_job_after_lost_node_timeout(cluster, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    deadline = time.monotonic() + 30  # the node brought back by the last test is idle again
    while "joined the cluster" not in cluster.agent_log(next(iter(cluster.agents))):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    job = cluster.submit(
        "alone",
        ParallelPlan(dp_shard=2),
        1,
        LIGHT,
        lost_node_timeout_s=2.0,
        env={"LIGHT_OUT": str(out), "LIGHT_SLEEP": "60"},
    )
    node = job.nodes[0]
    others = [n for n in cluster.nodes if n != node]  # held: no node of the pool can take the block
    for other in others:
        admin.cordon_node(cluster.address, other, "no replacement for this test", tls=cluster.admin_tls)
    try:
        _kill_node(cluster, node, _wait_results(out, 2, cluster))
        info = cluster.wait_ended("alone", timeout=60)
    finally:
        for other in others:
            admin.cordon_node(cluster.address, other, "", uncordon=True, tls=cluster.admin_tls)
    assert info.state == pb.FAILED, (info, cluster.logs())
    assert f"node '{node}' (ranks 0-1) was lost" in info.reason and "lost_node_timeout_s=2" in info.reason, info.reason
    cluster.start_agent(node)
    cluster.wait_idle()


def test_only_admins_and_submitters_touch_jobs_and_a_submitter_nothing_else(cluster, tmp_path):
    from meshgate.client import RendezvousRefused
    from meshgate.tls import issue_cert

    alice = issue_cert(cluster.root / "tls", "submitter", "alice")
    submitter = cluster.ca.client_tls(alice)
    info = admin.submit_job(
        cluster.address,
        pb.JobSpec(
            job_id="by-alice",
            plan=ParallelPlan(dp_shard=2).to_proto(),
            nodes=1,
            command=LIGHT,
            env={"LIGHT_OUT": str(tmp_path)},
        ),
        tls=submitter,
    )
    assert info.state in (pb.RUNNING, pb.PENDING)
    assert any(j.spec.job_id == "by-alice" for j in admin.list_jobs(cluster.address, tls=submitter).jobs)
    assert cluster.wait_ended("by-alice").state == pb.SUCCEEDED, cluster.logs()
    with pytest.raises(
        RendezvousRefused, match="needs role admin; the client certificate 'alice' has role 'submitter'"
    ):
        admin.create_join_token(cluster.address, "", node_id="n9", tls=submitter)
    worker = cluster.ca.client_tls(cluster.ca.worker)
    with pytest.raises(RendezvousRefused, match="needs role admin or submitter") as refused:
        admin.submit_job(
            cluster.address,
            pb.JobSpec(job_id="by-worker", plan=ParallelPlan(dp_shard=2).to_proto(), nodes=1, command=LIGHT),
            tls=worker,
        )
    assert refused.value.code.name == "PERMISSION_DENIED"
    with pytest.raises(RendezvousRefused, match="not known"):
        admin.get_job(cluster.address, "by-worker", tls=submitter)  # nothing was created
    with pytest.raises(RendezvousRefused) as anonymous:
        admin.list_jobs(cluster.address, tls=cluster.ca.client_tls())  # no client certificate at all
    assert anonymous.value.code.name in ("UNAVAILABLE", "UNAUTHENTICATED")


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("nodes", 3, "nodes 3 does not divide the plan's world size 4"),
        ("mode", 7, r"spec.mode: 7 is not a RankMode \(one of RANK_MODE_UNSPECIFIED"),
        ("job_id", "x" * 5000, "job_id 'xxxxxxxx"),
        ("node_ids", ["n0", "n0"], "node_ids has duplicates"),
    ],
)
def test_a_bad_submission_is_invalid_argument_naming_the_field_and_creates_nothing(cluster, field, value, message):
    from meshgate.client import RendezvousRefused

    before = len(admin.list_jobs(cluster.address, tls=cluster.admin_tls).jobs)
    spec = pb.JobSpec(plan=ParallelPlan(dp_shard=4).to_proto(), nodes=2, command=LIGHT)
    if isinstance(value, list):
        getattr(spec, field).extend(value)
    else:
        setattr(spec, field, value)
    with pytest.raises(RendezvousRefused, match=message) as refused:
        admin.submit_job(cluster.address, spec, tls=cluster.admin_tls)
    assert refused.value.code.name == "INVALID_ARGUMENT" and len(str(refused.value)) < 400
    assert len(admin.list_jobs(cluster.address, tls=cluster.admin_tls).jobs) == before


def test_a_node_cannot_call_a_job_it_was_not_given_and_nothing_changes(cluster):
    """n2 (real credential, real agent certificate) against job A, which ran on n0 and n1."""
    import grpc

    from meshgate.tls import secure_channel
    from meshgate.v1 import nodes_pb2, nodes_pb2_grpc

    credential = (cluster.root / "n2-state" / "node.credential").read_bytes()
    before = cluster.job("A")
    tls = cluster.ca.client_tls(cluster.ca.agent("n2"))
    with secure_channel(cluster.address, tls) as channel:
        nodes = nodes_pb2_grpc.NodesStub(channel)
        calls = [
            lambda: nodes.Join(
                nodes_pb2.JoinRequest(job_id="A", node_id="n2", slots=2, slot_kind="cpu", node_credential=credential),
                timeout=5,
            ),
            lambda: nodes.RegisterBatch(
                nodes_pb2.RegisterBatchRequest(job_id="A", node_id="n2", node_credential=credential), timeout=5
            ),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "node_id 'n2' does not serve job 'A'" in refused.value.details()
        # and n2 cannot act as n0 (its certificate names n2)
        with pytest.raises(grpc.RpcError) as refused:
            nodes.NodeHeartbeat(nodes_pb2.NodeHeartbeatRequest(node_id="n0", node_credential=credential), timeout=5)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    after = cluster.job("A")
    assert [(n.node_id, n.state, n.registered) for n in after.status.nodes] == [
        (n.node_id, n.state, n.registered) for n in before.status.nodes
    ]


def test_a_lightning_fabric_job_runs_through_jobs_with_the_agents_node_identity(cluster, tmp_path):
    """A claimed-mode job whose command is a Fabric script: the agent launches it, Fabric
    picks the ranks, each worker asks the agent's socket for a vouch naming its rank and
    registers under the agent's node id."""
    out = tmp_path / "out"
    out.mkdir()
    plan = ParallelPlan(dp_replicate=2, microbatches=3)  # the worker's script does not rebuild it
    job = cluster.submit(
        "fabric",
        plan,
        1,
        [sys.executable, str(REPO / "tests" / "workers" / "jobs_fabric_worker.py"), str(out)],
        mode="claimed",
    )
    info = cluster.wait_ended("fabric", timeout=180)
    assert info.state == pb.SUCCEEDED, (info, cluster.logs())
    got = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])
    node = job.nodes[0]
    assert [(r["rank"], r["attested_rank"], r["job"], r["node"], r["world_size"]) for r in got] == [
        (0, 0, "fabric", node, 2),
        (1, 1, "fabric", node, 2),
    ]
    assert all(r["rank_sum"] == 1.0 for r in got)
    assert all(r["plan"] == r["attested_plan"] == plan.to_dict() for r in got)
    cluster.wait_idle()
