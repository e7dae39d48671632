"""Jobs whose nodes come from a scheduler: a job naming its nodes (``job submit --node-list``,
``--nodes-from-slurm``) runs on exactly those nodes in that order, and is refused, naming
the node and why, when one cannot serve it; Slurm's compressed node lists expand as
``scontrol show hostnames`` expands them.

On real processes: a coordinator and three agents (n0, n1, n2; mTLS, vouches required);
where Debian's slurm-wlm is installed, a real Slurm too (its own munged, slurmctld and
one slurmd per node name, all on this host: NodeName n0..n2 at 127.0.0.1 with distinct
ports), and examples/slurm/meshgate-job.sbatch submitted with sbatch.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from conftest import REPO, free_port
from meshgate import admin
from meshgate.attestation import TrustBundle, verify_attestation
from meshgate.cli import main as meshgate_main
from meshgate.job_cli import JobCliError, spec_from_args
from meshgate.client import RendezvousRefused
from meshgate.plan import ParallelPlan
from meshgate.slurm import HostlistError, expand_hostlist, nodes_from_env
from meshgate.v1 import attestation_pb2
from meshgate.v1 import rendezvous_pb2 as pb
from test_job_spelling import submit_args
import test_jobs_cluster
from test_jobs_cluster import LIGHT, NODES, Cluster, results

# The jobs tests' module fixture, one for this module too: a coordinator and agents n0, n1, n2.
cluster = test_jobs_cluster.cluster
SBATCH_SCRIPT = REPO / "examples" / "slurm" / "meshgate-job.sbatch"
SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
SLURM_TOOLS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")


def slurm_missing() -> list[str]:
    return [tool for tool in SLURM_TOOLS if not shutil.which(tool, path=SBIN_PATH)]


needs_slurm = pytest.mark.skipif(
    bool(slurm_missing()) or os.geteuid() != 0,
    reason=f"Slurm is not installed (apt-get install slurm-wlm): no {slurm_missing()}"
    if slurm_missing()
    else "slurmd runs jobs as their users: it needs root",
)

# ---- Slurm's hostlists ------------------------------------------------------------------------

EXPANSIONS = {
    "node[01-03,07]": ["node01", "node02", "node03", "node07"],
    "n[8-11]": ["n8", "n9", "n10", "n11"],
    "n[009-011]": ["n009", "n010", "n011"],
    "n[01-2]": ["n01", "n02"],  # zero-padded to the width of the range's start
    "n[1-02]": ["n1", "n2"],
    "gpu-[001-002],cpu7,x[1,3-4]": ["gpu-001", "gpu-002", "cpu7", "x1", "x3", "x4"],
    "rack[1-2]-n[01-02]": ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"],
    "n2,n0,n1": ["n2", "n0", "n1"],  # a plain list keeps its order
    "a,,b": ["a", "b"],
    "a,b,a": ["a", "b", "a"],  # duplicates are kept (the job spec refuses them, naming them)
}


@pytest.mark.parametrize("text, hosts", list(EXPANSIONS.items()))
def test_a_slurm_hostlist_expands_in_slurms_order(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    "text, message",
    [
        ("n[3-1]", "'n[3-1]': range '3-1' runs backwards"),
        ("n[1-2", "'n[1-2': '[' without ']'"),
        ("n[]", "'' is not a number or a range like 01-03"),
        ("n[a-b]", "'a-b' is not a number"),
        ("n]1[", "brackets do not pair"),
        ("n[[1]]", "brackets do not pair"),
        ("n[1-99999999]", "names more than 65536 hosts"),
        ("a[1-300]b[1-300]", "names more than 65536 hosts"),  # refused before it is built
    ],
)
def test_a_bad_hostlist_is_refused_naming_the_part(text, message):
    with pytest.raises(HostlistError, match=re.escape(message)):
        expand_hostlist(text)


@pytest.mark.skipif(not shutil.which("scontrol", path=SBIN_PATH), reason="no scontrol (apt-get install slurm-client)")
def test_our_expansion_is_scontrols(tmp_path):
    conf = tmp_path / "slurm.conf"  # scontrol reads one before it expands anything
    conf.write_text("ClusterName=hostlists\nSlurmctldHost=localhost\n")
    for text, hosts in EXPANSIONS.items():
        shown = subprocess.run(
            [shutil.which("scontrol", path=SBIN_PATH), "show", "hostnames", text],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "SLURM_CONF": str(conf)},
        )
        assert shown.stdout.split() == hosts, (text, shown)


def test_nodes_from_slurm_need_an_allocation():
    assert nodes_from_env({"SLURM_JOB_NODELIST": "n[0-2]"}) == ["n0", "n1", "n2"]
    with pytest.raises(HostlistError, match="SLURM_JOB_NODELIST is not set: --nodes-from-slurm runs inside"):
        nodes_from_env({})


def test_job_submit_names_the_nodes_of_a_list_or_of_the_slurm_allocation_in_their_order(monkeypatch):
    plan = str(REPO / "examples" / "plan-4.toml")  # world 4: 2 nodes of 2 slots
    assert spec_from_args(submit_args(plan=plan, node_list="n2,n0", command=["x"])).node_ids == ["n2", "n0"]
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[07,03]")
    from_slurm = spec_from_args(submit_args(plan=plan, nodes_from_slurm=True, command=["x"]))
    assert (list(from_slurm.node_ids), from_slurm.slots_per_node) == (["gpu07", "gpu03"], 0)
    with pytest.raises(JobCliError, match=re.escape("--node-list: 'n[2-': '[' without ']'")):
        spec_from_args(submit_args(plan=plan, node_list="n[2-", command=["x"]))
    monkeypatch.delenv("SLURM_JOB_NODELIST")
    with pytest.raises(JobCliError, match="SLURM_JOB_NODELIST is not set"):
        spec_from_args(submit_args(plan=plan, nodes_from_slurm=True, command=["x"]))


# ---- a job naming its nodes, on real processes --------------------------------------------------


def check_ranks_follow(cluster: Cluster, job_id: str, order: list[str], plan: ParallelPlan, out: Path) -> None:
    """Node rank i is ``order[i]``; each worker's rank is node rank x slots + local rank,
    and its attestation, signed by the cluster, says the same rank on the same node."""
    info = cluster.job(job_id)
    assert list(info.nodes) == order, info
    got = results(out)
    assert [r["rank"] for r in got] == list(range(plan.world_size)), (got, cluster.logs())
    bundle = TrustBundle.load(cluster.coordinator.trust_bundle_path)
    for r in got:
        assert r["node_rank"] == order.index(r["node_id"]), r
        assert r["rank"] == 2 * r["node_rank"] + r["local_rank"], r
        signed = attestation_pb2.SignedAttestation.FromString(bytes.fromhex(r["signed"]))
        att = verify_attestation(
            signed, bundle, job_id=job_id, plan=plan, nonce=bytes.fromhex(r["nonce"]), generation=0, now=time.time()
        )
        assert (att.rank, att.node_id, att.node_rank) == (r["rank"], r["node_id"], order.index(r["node_id"]))


@pytest.mark.slow
def test_a_job_given_its_nodes_in_a_list_runs_on_exactly_those_in_that_order(cluster, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    plan_file = tmp_path / "plan.toml"
    plan_file.write_text("dp_shard = 6\n")
    order = ["n2", "n0", "n1"]  # neither sorted nor the topology's (n0, n1 share switch s1)
    argv = ("submit", "--plan", str(plan_file), "--node-list", ",".join(order), "--id", "listed")
    assert meshgate_main(cluster.cli(*argv, "--env", f"LIGHT_OUT={out}", "--", *LIGHT)) == 0, cluster.logs()
    assert "job listed submitted: RUNNING on n2, n0, n1" in capsys.readouterr().out
    assert cluster.wait_ended("listed").state == pb.SUCCEEDED, cluster.logs()
    check_ranks_follow(cluster, "listed", order, ParallelPlan(dp_shard=6), out)
    cluster.wait_idle()


@pytest.mark.slow
def test_a_job_naming_a_busy_node_waits_saying_so_then_runs_on_exactly_its_nodes(cluster, tmp_path, capsys):
    out, release = tmp_path / "out", tmp_path / "release"
    out.mkdir()
    env = {"LIGHT_OUT": str(out), "LIGHT_SLEEP": "600", "LIGHT_EXIT_0_WHEN": str(release)}
    cluster.submit("holder", ParallelPlan(dp_shard=2), 0, LIGHT, node_ids=["n0"], env=env)
    named = cluster.submit(
        "named", ParallelPlan(dp_shard=4), 0, LIGHT, node_ids=["n1", "n0"], env={"LIGHT_OUT": str(out)}
    )
    assert named.state == pb.PENDING  # accepted: it waits for n0, as any job waits for its nodes
    assert named.reason == (
        "needs 2 nodes of 2 slots: named node(s) not idle yet: n0; first in line: n0, n1 reserved for it "
        "from when job 'holder' ends (it has no time limit)"
    ), named.reason
    plan_file = tmp_path / "plan.toml"
    plan_file.write_text("dp_shard = 4\n")
    capsys.readouterr()
    argv = (
        "submit",
        "--plan",
        str(plan_file),
        "--node-list",
        "n[0-1]",
        "--id",
        "waits-listed",
        "--env",
        f"LIGHT_OUT={out}",
    )
    argv += ("--", *LIGHT)
    assert meshgate_main(cluster.cli(*argv)) == 0
    printed = capsys.readouterr().out
    assert "job waits-listed submitted: PENDING" in printed, printed
    assert "named node(s) not idle yet: n0; after job 'named' (first in line: n0, n1 reserved for it)" in printed
    # a node no job could ever have is still refused at once, naming it, and nothing is recorded
    with pytest.raises(RendezvousRefused, match="pinned node\\(s\\) n9 have not joined") as refused:
        cluster.submit("never", ParallelPlan(dp_shard=4), 0, LIGHT, node_ids=["n1", "n9"])
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "never" not in [j.spec.job_id for j in admin.list_jobs(cluster.address, tls=cluster.admin_tls).jobs]
    release.touch()
    assert cluster.wait_ended("holder").state == pb.SUCCEEDED, cluster.logs()
    for job_id, order in (("named", ["n1", "n0"]), ("waits-listed", ["n0", "n1"])):
        info = cluster.wait_ended(job_id)
        assert (info.state, list(info.nodes)) == (pb.SUCCEEDED, order), cluster.logs()
    cluster.wait_idle()


# ---- a real Slurm on this host ------------------------------------------------------------------


class Slurm:
    """munged, slurmctld and one slurmd per node name, all in the foreground under ``root``,
    with their own socket, ports, spool and state: nothing of the host's /etc is used."""

    def __init__(self, root: Path, node_names: tuple[str, ...]) -> None:
        self.root, self.node_names = root, node_names
        self.processes: list[subprocess.Popen] = []
        self.tool = {name: shutil.which(name, path=SBIN_PATH) for name in SLURM_TOOLS}
        self.conf = root / "slurm.conf"
        # The daemons' and the users' environment: no MESHGATE_* of this test process's own.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("MESHGATE_")}
        self.env["SLURM_CONF"] = str(self.conf)

    def start(self) -> None:
        """Every daemon, then wait until Slurm sees every node idle (close() stops what started)."""
        root, node_names, tool = self.root, self.node_names, self.tool
        socket, key = root / "munge.sock", root / "munge.key"
        subprocess.run([tool["mungekey"], "--create", "--keyfile", str(key)], check=True, timeout=30)
        self._start(
            [tool["munged"], "--foreground", "--force", f"--socket={socket}", f"--key-file={key}"]
            + [f"--pid-file={root / 'munged.pid'}", f"--log-file={root / 'munged.log'}"]
            + [f"--seed-file={root / 'munged.seed'}"],
            "munged",
        )
        for directory in ("state", *(f"spool/{n}" for n in node_names)):
            (root / directory).mkdir(parents=True)
        nodes = "\n".join(
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={free_port()} CPUs=2 State=UNKNOWN"
            for n in node_names
        )
        self.conf.write_text(
            f"""ClusterName=meshgate-test
SlurmctldHost=localhost
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/linear
ReturnToService=2
KillWait=10
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
PlugStackConfig=/dev/null
{nodes}
PartitionName=test Nodes={",".join(node_names)} Default=YES MaxTime=INFINITE State=UP
"""
        )
        self._start([tool["slurmctld"], "-D", "-i", "-f", str(self.conf)], "slurmctld")
        for name in node_names:
            self._start([tool["slurmd"], "-D", "-f", str(self.conf), "-N", name], f"slurmd-{name}")
        deadline = time.monotonic() + 90
        while True:
            shown = self.run("sinfo", "--noheader", "--format=%T %D", check=False)
            if shown.stdout.split() == ["idle", str(len(node_names))]:
                break
            assert time.monotonic() < deadline, (shown, self.logs())
            time.sleep(0.5)

    def _start(self, argv: list[str], name: str) -> None:
        with open(self.root / f"{name}.out", "ab") as log:
            self.processes.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env))

    def run(self, tool: str, *argv: str, check: bool = True, timeout: float = 60, **env: str):
        return subprocess.run(
            [self.tool[tool], *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
            env={**self.env, **env},
            cwd=self.root,
        )

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name} ---\n{p.read_text(errors='replace')[-2000:]}"
            for p in sorted([*self.root.glob("*.log"), *self.root.glob("*.out")])
        )

    def close(self) -> None:
        for process in reversed(self.processes):
            process.terminate()
        for process in reversed(self.processes):
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory, cluster):
    slurm = Slurm(tmp_path_factory.mktemp("slurm"), NODES)
    try:
        slurm.start()
        yield slurm
    finally:
        slurm.close()


def meshgate_env(cluster: Cluster) -> dict[str, str]:
    """What a user's shell holds when it calls sbatch: the coordinator and meshgate on PATH."""
    return {
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), SBIN_PATH]),
        "MESHGATE_COORDINATOR": cluster.address,
        "MESHGATE_TLS_CA": str(cluster.ca.ca),
        "MESHGATE_TLS_CERT": str(cluster.ca.admin.cert),
        "MESHGATE_TLS_KEY": str(cluster.ca.admin.key),
    }


def sbatch(slurm: Slurm, cluster: Cluster, tmp_path: Path, options: list[str], world: int, **env: str):
    """examples/slurm/meshgate-job.sbatch submitted with sbatch ``options``: a job of ``world``
    light workers writing to tmp_path/out (``env``: more of their variables). Returns
    sbatch's answer, where the workers write, and the batch output's path."""
    out, plan_file = tmp_path / "out", tmp_path / "plan.toml"
    out.mkdir()
    plan_file.write_text(f"dp_shard = {world}\n")
    variables = [f"--env={key}={value}" for key, value in {"LIGHT_OUT": out, **env}.items()]
    answer = slurm.run(
        "sbatch",
        *options,
        f"--output={tmp_path / 'batch.out'}",
        str(SBATCH_SCRIPT),
        *("--plan", str(plan_file), *variables, "--", *LIGHT),
        timeout=300,
        check=False,
        **meshgate_env(cluster),
    )
    return answer, out, tmp_path / "batch.out"


@pytest.mark.slow
@needs_slurm
def test_sbatch_runs_a_job_on_exactly_the_nodes_slurm_gave_in_slurms_order(cluster, slurm, tmp_path):
    # Slurm gives n2 and n0 (not n1), and lists them as n[0,2]: node ranks follow its order.
    ran, out, batch_out = sbatch(slurm, cluster, tmp_path, ["--wait", "--nodes=2", "--nodelist=n2,n0"], 4)
    assert ran.returncode == 0, (ran, batch_out.read_text(), slurm.logs(), cluster.logs())
    job_id = "slurm-" + re.search(r"Submitted batch job (\d+)", ran.stdout).group(1)
    assert f"job {job_id} submitted: RUNNING on n0, n2" in batch_out.read_text()
    assert cluster.job(job_id).state == pb.SUCCEEDED
    check_ranks_follow(cluster, job_id, ["n0", "n2"], ParallelPlan(dp_shard=4), out)
    cluster.wait_idle()


@pytest.mark.slow
@needs_slurm
def test_scancel_cancels_the_meshgate_job_and_its_workers_stop(cluster, slurm, tmp_path):
    submitted, out, batch_out = sbatch(slurm, cluster, tmp_path, ["--parsable", "--nodes=3"], 6, LIGHT_SLEEP=600)
    assert submitted.returncode == 0, (submitted, slurm.logs())
    slurm_job = submitted.stdout.strip().split(";")[0]
    job_id = f"slurm-{slurm_job}"
    deadline = time.monotonic() + 120
    while len(list(out.glob("*.json"))) < 6:  # every worker registered and wrote its result
        assert time.monotonic() < deadline, (batch_out.read_text(), slurm.logs(), cluster.logs())
        time.sleep(0.2)
    assert list(cluster.job(job_id).nodes) == ["n0", "n1", "n2"]
    slurm.run("scancel", slurm_job)
    info = cluster.wait_ended(job_id, timeout=120)
    assert info.state == pb.CANCELLED, (info, batch_out.read_text())
    assert info.reason == f"Slurm job {slurm_job} was cancelled", info.reason
    cluster.wait_idle(timeout=60)  # every worker stopped: the agents showed the job's units empty
