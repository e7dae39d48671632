"""Jobs are contained (issue #20): real processes, a real job user created here with
useradd (and removed after, whatever happens), real cgroup v2 units, and the agent
started as its shipped unit starts it (tests/shipped.py, issue #29).

A hostile job forks a daemon, ignores SIGTERM and tries to read the agent's secrets; its
workers run as the job user, cannot read them, and every process of it is gone when it
is cancelled and when it ends, before the next job on the node starts. A process of the
job user outside the unit gets no vouch. ``kill -9`` of an agent mid-job and a restart
never leaves two live holders of one rank.

The job user cannot execute the venv's interpreter (it lives under /root, mode 0700):
its workers run Debian's /usr/bin/python3.11, and those that need meshgate a venv made
from it that reads the project venv's packages (``job_python``).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Optional

import pytest

import shipped
from conftest import REPO, worker_env
from meshgate import admin
from meshgate.agent.containment import (
    CgroupContainment,
    agent_subtree_name,
    ContainmentError,
    cgroup2_mount,
    unit_name,
)
from meshgate.agent.job_user import JobUser, JobUserError
from meshgate.coordinator.jobs import ClusterState
from meshgate.coordinator.rendezvous import (
    Code,
    GenerationBumped,
    NodeState,
    NodeStateChanged,
    RendezvousConfig,
    RendezvousError,
    RendezvousState,
)
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb
from shipped import ShippedCluster

pytestmark = pytest.mark.slow

shipped_host = shipped.shipped_host  # the fixture: users, interpreter, delegated cgroup

SYSTEM_PYTHON = "/usr/bin/python3.11"
HOSTILE = str(REPO / "tests" / "workers" / "hostile_job.py")
HOLDER = str(REPO / "tests" / "workers" / "rank_holder.py")


def _cgroup_writable() -> bool:
    try:
        CgroupContainment.open("probe-" + secrets.token_hex(3), None, Path("/nonexistent")).subtree.rmdir()
        return True
    except (ContainmentError, OSError):
        return False


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("useradd") or not os.path.exists(SYSTEM_PYTHON),
    reason="needs root (useradd, setuid) and /usr/bin/python3.11",
)


# ---- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def job_user():
    if os.geteuid() != 0 or not shutil.which("useradd"):
        pytest.skip("needs root and useradd to create a job user")
    name = f"mgjob{secrets.token_hex(3)}"
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin", name],
        check=True,
    )
    try:
        yield JobUser.resolve(name)
    finally:
        subprocess.run(["userdel", "--force", name], check=False)


@pytest.fixture(scope="module")
def root_dir():
    """A directory the job user may traverse (pytest's tmp dirs are 0700): so a refused
    read below is the file's mode at work, not a closed parent."""
    path = Path(tempfile.mkdtemp(prefix="mg-containment-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def job_python(root_dir, job_user):
    """An interpreter the job user can execute that imports meshgate: Debian's python3.11
    in a venv whose .pth adds the project venv's packages (same CPython minor version)."""
    if not os.path.exists(SYSTEM_PYTHON):
        pytest.skip(f"{SYSTEM_PYTHON} is not installed")
    venv = root_dir / "job-python"
    subprocess.run([SYSTEM_PYTHON, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(sysconfig.get_paths()["purelib"])
    (next(venv.glob("lib/python3*/site-packages")) / "meshgate-venv.pth").write_text(
        f"import site; site.addsitedir({str(site)!r})\n"
    )
    python = str(venv / "bin" / "python")
    probe = subprocess.run(
        [python, "-c", "import meshgate.client, grpc"],
        user=job_user.uid,
        group=job_user.gid,
        cwd="/tmp",
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"the job user cannot import meshgate with {python}: {probe.stderr[-400:]}")
    return python


def wait_for(condition, timeout: float, explain=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s\n{explain()}")
        time.sleep(0.1)


def alive(pid: int) -> bool:
    """Running (a zombie no longer runs: its parent died, pid 1 may reap it late)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 :][:1] != b"Z"


def records(out: Path, prefix: str, count: int, cluster: ShippedCluster, timeout: float = 60) -> list[dict]:
    pattern = f"{prefix}*.json"
    wait_for(lambda: len(list(out.glob(pattern))) >= count, timeout, cluster.logs)
    return [json.loads(p.read_text()) for p in sorted(out.glob(pattern))]


def hostile_env(cluster: ShippedCluster, node_id: str, **extra: str) -> dict[str, str]:
    state = cluster.state_dir(node_id)
    # and the workers' own output, which only the agent reads (agent/worker_logs.py)
    secrets_ = [
        state / "node-key.pem",
        state / "node.credential",
        state / "worker-logs" / "job-hostile-1" / "rank-0.log",
    ]
    return {"HOSTILE_OUT": str(cluster.out), "HOSTILE_SECRETS": ":".join(map(str, secrets_)), **extra}


def ask_vouch_as(user: JobUser, socket_path: Path) -> tuple[int, dict]:
    """A process of the job user that no unit holds (started "by any trick") asks the vouch socket."""
    code = (
        "import json, os, socket, sys\n"
        "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
        "s.sendall(b'{\"local_rank\": 0}\\n')\n"
        "print(json.dumps({'pid': os.getpid(), 'answer': json.loads(s.makefile().readline())}))\n"
    )
    done = subprocess.run(
        [SYSTEM_PYTHON, "-c", code, str(socket_path)],
        user=user.uid,
        group=user.gid,
        cwd="/tmp",
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    return reply["pid"], reply["answer"]


# ---- pure decisions ---------------------------------------------------------------------------


def test_a_member_back_under_a_new_agent_instance_ends_its_generation_never_rejoins_it():
    from meshgate.coordinator.rendezvous import AdmittedNode

    state = RendezvousState(RendezvousConfig(job_id="j", plan=ParallelPlan(dp_shard=4), slots_per_node=2))
    state.apply_all(
        state.decide_admit(
            [AdmittedNode("a", 0, "a", 2, "cpu", "h", "00" * 32), AdmittedNode("b", 1, "b", 2, "cpu", "h", "00" * 32)],
            1.0,
        )
    )
    state.note_instance("a", "first", joined=True)
    assert state.decide_restarted(state.nodes["a"], "first", 2.0) == ()  # the same agent: nothing
    assert state.decide_restarted(state.nodes["a"], "", 2.0) == ()  # an agent that names none
    events = state.decide_restarted(state.nodes["a"], "second", 2.0)
    assert [type(e) for e in events] == [NodeStateChanged, GenerationBumped, NodeStateChanged]
    assert events[1].generation == 1 and "came back under a new agent instance" in events[1].reason
    state.apply_all(events)
    assert state.generation == 1 and state.nodes["a"].state is NodeState.ACTIVE and not state.lost_since
    # a heartbeat's instance is taken only where none is known (after a coordinator restart)
    state.note_instance("a", "third", joined=False)
    assert state.nodes["a"].agent_instance == "first"


def test_a_node_goes_back_to_the_pool_only_after_a_heartbeat_shows_its_units_empty():
    state = ClusterState()
    with pytest.raises(RendezvousError) as refused:
        state.note_units("n0", [f"j{i}" for i in range(65)])
    assert refused.value.code is Code.INVALID_ARGUMENT and "live_units lists 65 jobs" in str(refused.value)


def test_a_restarted_coordinator_gives_a_node_no_job_before_its_heartbeat_shows_no_live_unit(tmp_path):
    import asyncio

    from meshgate.attestation import secret_hash
    from meshgate.coordinator import readmodel
    from meshgate.coordinator.cluster import ClusterCoordinator
    from meshgate.coordinator.keys import KeyRing
    from meshgate.coordinator.rendezvous import JoinAuth
    from meshgate.coordinator.store import MemoryStore

    store, keys = MemoryStore(), KeyRing(tmp_path / "keys")

    def coordinator() -> ClusterCoordinator:
        return ClusterCoordinator(
            store,
            keys,
            lambda config: MemoryStore(),
            attestation_ttl_s=60,
            heartbeat_timeout_s=15,
            require_vouch=False,
            clock=lambda: 10.0,
        )

    async def joined() -> None:
        first = coordinator()
        state = first.state
        await first.apply(state.decide_create_token(secret_hash("t"), 600, "n0", 10.0))
        await first.apply(
            state.decide_join(
                "n0",
                "n0",
                2,
                "cpu",
                {},
                JoinAuth("t", public_key=bytes(32), new_credential_hash=secret_hash(b"cred")),
                10.0,
            )
        )
        assert [n.node_id for n in state.idle_nodes(10.0)] == ["n0"]

    asyncio.run(joined())
    restarted = coordinator()
    assert restarted.state.idle_nodes(10.0) == []  # its agent may still run a unit of its last job
    assert readmodel.gauges(restarted).nodes["clearing"] == 1
    restarted.pool.heartbeat("n0", b"cred", ["old-job"])
    assert restarted.state.idle_nodes(10.0) == []
    restarted.pool.heartbeat("n0", b"cred", [])
    assert [n.node_id for n in restarted.state.idle_nodes(10.0)] == ["n0"]
    assert readmodel.gauges(restarted).nodes == {
        "idle": 1.0,
        "serving": 0.0,
        "clearing": 0.0,
        "left": 0.0,
        "cordoned": 0.0,
        "quarantined": 0.0,
        "unhealthy": 0.0,
        "draining": 0.0,
    }


def test_the_job_user_is_never_root_nor_the_agent():
    with pytest.raises(JobUserError, match="uid 0: jobs never run as root"):
        JobUser.resolve("root")
    with pytest.raises(JobUserError, match="no such user"):
        JobUser.resolve("no-such-user-" + secrets.token_hex(3))


def test_a_unit_name_is_never_a_path():
    for job_id in ("../escape", "/abs", "..", "a/b"):
        name = unit_name(job_id, 3)
        assert "/" not in name and name not in (".", "..") and name.endswith("-g3")


@needs_root
def test_the_agent_uid_is_refused_as_job_user(job_user):
    with pytest.raises(JobUserError, match="the agent's own uid"):
        JobUser.resolve(job_user.name, agent_uid=job_user.uid)


@needs_root
def test_the_fallback_kills_a_daemon_that_left_its_process_group():
    """Without cgroups: a process group, and the agent as subreaper finds the daemon
    that setsid()'ed away once its parent exited. In a child process: a subreaper
    pytest would collect every orphan of the other tests."""
    code = (
        "import json, os, subprocess, sys, time\n"
        "from meshgate.agent.containment import ProcessGroupContainment\n"
        "c = ProcessGroupContainment(); unit = c.create('j', 0)\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import os,signal,time\\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
        "if os.fork() == 0:\\n os.setsid()\\n print(os.getpid(), flush=True)\\n time.sleep(300)\\n"
        "os._exit(0)'], stdout=subprocess.PIPE, **unit.spawn_options())\n"
        "unit.started(p.pid); daemon = int(p.stdout.readline()); p.wait()\n"
        "held = unit.holds(daemon); killed = unit.kill_and_wait(10)\n"
        "print(json.dumps({'daemon': daemon, 'held': held, 'killed': killed, 'empty': unit.is_empty(),\n"
        "  'gone': not os.path.exists(f'/proc/{daemon}')}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["held"] and result["daemon"] in result["killed"] and result["empty"] and result["gone"], result


# ---- real processes ----------------------------------------------------------------------------


class ContainedAsShipped(ShippedCluster):
    """One node whose agent runs as its shipped unit starts
    it (tests/shipped.py): the unit's user and capabilities, its delegated cgroup, the
    shipped agent.toml with the host's job user."""

    # The shipped drain_grace_s (30 s) is for real training; these jobs ignore SIGTERM on purpose.
    GRACE = {"drain_grace_s": 2}

    def __init__(self, host) -> None:
        super().__init__(host, ("n0",), start=False)
        try:
            self.start_agent("n0")
        except BaseException:
            self.close()
            raise
        self.job_user = JobUser.resolve(host.job_user.pw_name)
        self.agent_uid, self.agent_gid = host.agent_user.pw_uid, host.group_gid
        self.out = self.root / "out"
        self.out.mkdir()
        self.out.chmod(0o777)

    def start_agent(self, node_id: str, extra: Optional[dict] = None):
        return super().start_agent(node_id, {**self.GRACE, **(extra or {})})

    def state_dir(self, node_id: str) -> Path:
        return self.agents[node_id].state_dir

    def submit(self, job_id: str, command: list[str], env: dict[str, str], nodes: int = 1) -> pb.JobInfo:
        return super().submit(job_id, command, env, nodes=nodes, procs=2)

    def stop_agent(self, node_id: str) -> None:
        """SIGTERM, as systemd stops it: a clean stop leaves no unit and no subtree behind."""
        agent = self.agents[node_id]
        agent.process.terminate()
        agent.process.wait(timeout=60)
        subtree = agent.cgroup / "meshgate" / agent_subtree_name(node_id, agent.state_dir)
        assert not subtree.exists(), list(subtree.iterdir())


@pytest.fixture(scope="module")
def contained(shipped_host):
    if cgroup2_mount() is None or not _cgroup_writable():
        pytest.skip("no writable cgroup v2 on this machine")
    with ContainedAsShipped(shipped_host) as cluster:
        yield cluster
        cluster.stop_agent("n0")


def test_a_hostile_job_reads_no_secret_and_leaves_nothing_behind_when_cancelled_or_done(contained):
    cluster, out, job_user = contained, contained.out, contained.job_user
    command = [SYSTEM_PYTHON, HOSTILE]
    cluster.submit("hostile-1", command, hostile_env(cluster, "n0"))
    first = records(out, "job-hostile-1-g0-", 2, cluster)
    for record in first:
        assert record["uid"] == job_user.uid, record
        assert set(record["reads"].values()) == {"PermissionError"}, record["reads"]
        assert record["cgroup"].endswith(
            f"/meshgate/{agent_subtree_name('n0', cluster.state_dir('n0'))}/job-hostile-1-g0"
        ), record
        assert "vouch" in record["vouch"], record["vouch"]  # a process of the unit is vouched for
        assert alive(record["daemon"]) and alive(record["pid"])
    state = cluster.state_dir("n0")
    # its own private work directory: cwd and HOME, the job user's, inside a directory of the
    # agent's that the job reads and never writes (agent/launcher.py)
    run_dir = state / "jobs" / "hostile-1"
    job_dir = run_dir / "work"
    assert {(r["cwd"], r["home"]) for r in first} == {(str(job_dir), str(job_dir))}, first
    # the job's plan is beside it, readable by the job user (meshgate.current_plan())
    assert {r["plan_file"] for r in first} == {str(run_dir / "plan.toml")}, first
    assert all(ParallelPlan.from_toml_text(r["plan_text"]) == ParallelPlan(dp_shard=2) for r in first)
    # the job user's, and the agent's group may enter it (it starts workers there, as the agent)
    assert (job_dir.stat().st_uid, job_dir.stat().st_gid) == (job_user.uid, cluster.agent_gid)
    assert oct(job_dir.stat().st_mode & 0o777) == "0o710"
    assert (run_dir.stat().st_uid, oct(run_dir.stat().st_mode & 0o777)) == (cluster.agent_uid, "0o711")
    assert oct(state.stat().st_mode & 0o777) == "0o711"
    assert all(oct((state / f).stat().st_mode & 0o777) == "0o600" for f in ("node-key.pem", "node.credential"))
    output = state / "worker-logs" / "job-hostile-1"
    assert (output.stat().st_uid, oct(output.stat().st_mode & 0o777)) == (cluster.agent_uid, "0o700")
    assert {(p.stat().st_uid, oct(p.stat().st_mode & 0o777)) for p in output.iterdir()} == {
        (cluster.agent_uid, "0o600")
    }

    # A process of the job user that no unit holds (a leftover "by any trick") gets no vouch.
    pid, answer = ask_vouch_as(job_user, state / "vouch.sock")
    assert "vouch" not in answer and "is not a process of job 'hostile-1' generation 0" in answer["error"], answer
    wait_for(lambda: f"vouch refused to pid {pid} uid {job_user.uid}" in cluster.agent_log("n0"), 10, cluster.logs)
    audit = next(line for line in cluster.agent_log("n0").splitlines() if f"vouch refused to pid {pid}" in line)
    assert "WARNING" in audit and "cgroup /" in audit, audit

    # The next job waits for the node; cancelling the hostile job kills every process of it
    # (SIGTERM ignored, a daemon in its own session) before the next job starts there.
    cluster.submit("after-cancel", command, hostile_env(cluster, "n0", HOSTILE_EXIT="1"))
    assert cluster.job("after-cancel").state == pb.PENDING
    admin.cancel_job(cluster.address, "hostile-1", "test")
    second = records(out, "job-after-cancel-g0-", 2, cluster)
    cancelled = {p for r in first for p in (r["pid"], r["daemon"])}
    for record in second:
        assert not cancelled & set(record["alive_at_start"]), (record, cancelled)
    assert not any(alive(p) for p in cancelled)
    # what the cancelled job left in its directory died with it: the next job never sees it
    assert not run_dir.exists()
    assert not any(r["plants_seen"] for r in second) and {r["cwd"] for r in second} == {
        str(state / "jobs" / "after-cancel" / "work")
    }

    # A job whose workers exit 0 ends SUCCEEDED; the daemons they left die with the unit
    # before the node takes the next job.
    assert cluster.wait_ended("after-cancel").state == pb.SUCCEEDED
    cluster.submit("after-end", command, hostile_env(cluster, "n0", HOSTILE_EXIT="1"))
    third = records(out, "job-after-end-g0-", 2, cluster)
    left = {r["daemon"] for r in second}
    for record in third:
        assert not left & set(record["alive_at_start"]), (record, left)
    assert not any(alive(p) for p in left)
    assert cluster.wait_ended("after-end").state == pb.SUCCEEDED
    wait_for(lambda: not any(alive(r["daemon"]) for r in third), 30, cluster.logs)
    # the agent's word for it: the daemons were still in the unit when it was killed
    killed = re.search(
        r"containment unit \S+/job-hostile-1-g0 of job hostile-1 generation 0 is empty "
        r"\(killed pids \[([\d, ]*)\]\)",
        cluster.agent_log("n0"),
    )
    assert killed and {r["daemon"] for r in first} <= {int(p) for p in killed[1].split(",")}, cluster.logs()


def test_a_new_generation_starts_only_after_every_process_of_the_last_one_is_gone(contained):
    """Local rank 0 fails once: the job restarts into generation 1, and the daemons of
    generation 0 (and its worker that ignores SIGTERM) die with its unit first."""
    cluster, out = contained, contained.out
    env = hostile_env(cluster, "n0", HOSTILE_FAIL_ONCE=str(cluster.out / "failed-once"))
    spec = pb.JobSpec(
        job_id="restarts",
        plan=ParallelPlan(dp_shard=2).to_proto(),
        nodes=1,
        command=[SYSTEM_PYTHON, HOSTILE],
        env=env,
        restart_policy=pb.RESTART_POLICY_ON_FAILURE,
        max_restarts=1,
    )
    admin.submit_job(cluster.address, spec)
    first = records(out, "job-restarts-g0-", 2, cluster)
    second = records(out, "job-restarts-g1-", 2, cluster)
    old = {p for r in first for p in (r["pid"], r["daemon"])}
    for record in second:
        assert record["cgroup"].endswith("/job-restarts-g1") and "vouch" in record["vouch"], record
        assert not old & set(record["alive_at_start"]), (record, old)
    assert not any(alive(p) for p in old)
    admin.cancel_job(cluster.address, "restarts", "test over")
    cluster.wait_ended("restarts")
    wait_for(lambda: not any(alive(p) for r in second for p in (r["pid"], r["daemon"])), 30, cluster.logs)


def test_agent_kill_9_mid_job_then_restart_never_leaves_two_live_holders_of_a_rank(contained, job_python):
    cluster = contained
    holders = cluster.root / "holders"
    holders.mkdir()
    holders.chmod(0o777)
    cluster.submit("held", [job_python, HOLDER], {"HOLDER_OUT": str(holders)})
    before = records(holders, "g0-", 2, cluster)
    assert sorted(r["rank"] for r in before) == [0, 1]
    timeline = [("registered g0", {r["pid"]: alive(r["pid"]) for r in before})]

    agent = cluster.agents["n0"].process
    agent.kill()  # kill -9: no drain, no Leave; its workers live on in their unit
    agent.wait()
    timeline.append(("agent killed", {r["pid"]: alive(r["pid"]) for r in before}))
    assert all(timeline[-1][1].values()), timeline  # the danger this test is about

    cluster.start_agent("n0")
    after = [r for r in records(holders, "g", 4, cluster, timeout=90) if r["generation"] > 0]
    timeline.append(("registered again", {r["pid"]: alive(r["pid"]) for r in before + after}))
    assert sorted(r["rank"] for r in after) == [0, 1], (after, cluster.logs())
    old = {r["pid"] for r in before}
    for record in after:
        # at the moment each new holder registered, no old holder of any rank was alive
        assert not old & set(record["alive_at_register"]), (record, old, timeline)
        assert record["generation"] >= 1  # never a re-admission into generation 0
    assert not any(alive(p) for p in old), timeline
    every = [(r["rank"], r["generation"]) for r in before + after]
    assert len(every) == len(set(every)), every  # one attestation per rank and generation
    log = cluster.agent_log("n0")
    assert "killed containment unit job-held-g0 of this agent's earlier run before joining" in log, log[-3000:]
    # Generation 0 ended for n0's new instance: at its Join, or before it when a loaded machine
    # let the restart take longer than the heartbeat tolerance (2 s here) and n0 was found lost
    # first. Either way no new holder registered while an old one lived (checked above).
    coordinator_log = cluster.coordinator.log()
    assert "GenerationBumped(generation=1" in coordinator_log, coordinator_log[-3000:]
    assert "came back under a new agent instance" in coordinator_log or re.search(
        r"NodeStateChanged\(node_id='n0', state=<NodeState.LOST: 'lost'>, at=[0-9.]+, reason='no heartbeat for",
        coordinator_log,
    ), coordinator_log[-3000:]
    admin.cancel_job(cluster.address, "held", "test over")
    cluster.wait_ended("held")
    wait_for(lambda: not any(alive(r["pid"]) for r in after), 30, cluster.logs)


def test_jobs_mode_refuses_to_run_jobs_as_the_agent_unless_told_so_on_purpose(tmp_path):
    from meshgate.agent.config import AgentConfig, AgentConfigError

    base = {"coordinator": "127.0.0.1:7443", "insecure": True, "state_dir": str(tmp_path)}
    with pytest.raises(AgentConfigError, match=r"run_as is required in jobs mode.*run_jobs_as_agent = true"):
        AgentConfig.from_mapping(base, tmp_path)
    assert AgentConfig.from_mapping({**base, "run_as": "meshgate-job"}, tmp_path).run_as == "meshgate-job"
    assert AgentConfig.from_mapping({**base, "run_jobs_as_agent": True}, tmp_path).run_jobs_as_agent
    with pytest.raises(AgentConfigError, match="run_as is required"):  # only a real true says so
        AgentConfig.from_mapping({**base, "run_jobs_as_agent": "yes"}, tmp_path)
    assert AgentConfig.from_mapping({**base, "job": "j"}, tmp_path).run_as == ""  # a single job: the operator's


def test_each_agent_has_its_own_subtree_so_a_second_agent_never_kills_the_firsts_units(tmp_path):
    # the same node id under another state dir (a second agent on the host, a test run beside
    # another) gets another subtree; the same agent restarted finds its own again
    one, other = tmp_path / "a-state", tmp_path / "b-state"
    assert agent_subtree_name("n0", one) == agent_subtree_name("n0", tmp_path / "x" / ".." / "a-state")
    assert agent_subtree_name("n0", one) != agent_subtree_name("n0", other)
    assert agent_subtree_name("n0", one).startswith("n0-") and "/" not in agent_subtree_name("a/b", one)
