"""The job boundary (issue #29), with every agent started as its shipped unit starts it
(tests/shipped.py: the unit's user, capabilities, no_new_privs, umask, delegated cgroup,
the shipped agent.toml with a job user of its own): a job cannot make the agent reach
anything outside the job's own directory, cannot reach another agent's job, cannot write
the agent's records, and can write its checkpoints where the operator lets it.

Each planting test runs one job whose local rank 0 plants one kind of thing (a symlink, a
hard link, a FIFO, a directory swap) at every path the agent touches or once touched in
and around the job's directory, in generation 0 (then fails, so the agent writes the plan
again for generation 1) and in generation 1 (then the job ends, so the agent removes the
directory). The targets, all outside the job's directory, keep their bytes, owner and
mode; the agent keeps serving.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from pathlib import Path

import pytest

import shipped
from conftest import REPO
from meshgate import admin
from meshgate.agent.job_user import JobUser
from meshgate.agent.launcher import Launcher
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb
from shipped import AgentExited, ShippedAgent, ShippedCluster
from test_containment import SYSTEM_PYTHON, alive, records, wait_for

pytestmark = pytest.mark.slow

shipped_host = shipped.shipped_host  # the fixture: users, interpreter, delegated cgroup

PLANTER = str(REPO / "tests" / "workers" / "planting_job.py")


def snapshot(path: Path) -> tuple:
    found = os.lstat(path)
    content = path.read_bytes() if stat.S_ISREG(found.st_mode) else None
    return (found.st_uid, found.st_gid, stat.S_IMODE(found.st_mode), stat.S_IFMT(found.st_mode), content)


@pytest.fixture(scope="module")
def cluster(shipped_host):
    """One node, its agent as shipped, with a checkpoint directory of the job user's as
    its one [agent] job_paths entry (the operator's part of "jobs can do their work")."""
    with ShippedCluster(shipped_host, ("n0",), start=False) as running:
        checkpoints = running.root / "checkpoints"
        checkpoints.mkdir()
        os.chown(checkpoints, shipped_host.job_user.pw_uid, shipped_host.job_user.pw_gid)
        checkpoints.chmod(0o700)
        running.start_agent("n0", extra={"job_paths": [str(checkpoints)]})
        yield running


def job_user_of(cluster: ShippedCluster, node_id: str = "n0") -> JobUser:
    return JobUser.resolve(cluster.agents[node_id].run_as.pw_name)


@pytest.fixture(scope="module")
def targets(cluster):
    """Files outside every job's directory: the agent's own credential, a root-owned 0600
    file, and a file of the job user's own in a directory of its own (a removal that
    followed a link would delete it with the job user's rights)."""
    root, job_user = cluster.root, job_user_of(cluster)
    secret = root / "root-secret"
    secret.write_bytes(b"root only\n")
    secret.chmod(0o600)
    owned_dir = root / "job-owned"
    owned_dir.mkdir(exist_ok=True)
    owned = owned_dir / "keep.txt"
    owned.write_bytes(b"the job user's, outside any job\n")
    os.chown(owned_dir, job_user.uid, job_user.gid)
    os.chown(owned, job_user.uid, job_user.gid)
    credential = cluster.agents["n0"].state_dir / "node.credential"
    return [credential, secret, owned]


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo", "dirswap"])
def test_a_plant_in_the_job_directory_changes_nothing_outside_it_and_the_agent_serves_on(cluster, targets, kind):
    before = {t: snapshot(t) for t in targets}
    out = cluster.root / f"plants-{kind}"
    out.mkdir()
    out.chmod(0o777)
    job = f"plant-{kind}"
    spec = pb.JobSpec(
        job_id=job,
        plan=ParallelPlan(dp_shard=2).to_proto(),
        nodes=1,
        command=[SYSTEM_PYTHON, PLANTER],
        env={"PLANT_KIND": kind, "PLANT_TARGETS": ":".join(map(str, targets)), "PLANT_OUT": str(out)},
        restart_policy=pb.RESTART_POLICY_ON_FAILURE,
        max_restarts=1,
    )
    admin.submit_job(cluster.address, spec)
    assert cluster.wait_ended(job).state == pb.SUCCEEDED, cluster.logs()
    found = records(out, f"{job}-g", 4, cluster)
    planted: dict[str, str] = {}  # what each plant came to, "done" in either generation winning
    for record in found:
        for place, result in record.get("planted", {}).items():
            planted[place] = "done" if "done" in (result, planted.get(place)) else result
    assert planted, found
    # the kernel let the job plant where it may (its own work directory) ...
    run_dir = cluster.agents["n0"].state_dir / "jobs" / job
    if kind != "hardlink":  # hard links to files it does not own: refused by fs.protected_hardlinks
        assert any(v == "done" and k.startswith(str(run_dir / "work")) for k, v in planted.items()), planted
    # ... and never in the agent's directory that holds it
    assert all(v != "done" for k, v in planted.items() if os.path.dirname(k) == str(run_dir)), planted
    if kind == "dirswap":
        assert planted["rename work"] == "PermissionError" and planted["link in run root"] == "PermissionError"
    # generation 1 read the plan the agent wrote again, through whatever generation 0 planted
    for record in found:
        assert record["plan_file"] == str(run_dir / "plan.toml"), record
        assert ParallelPlan.from_toml_text(record["plan_text"]) == ParallelPlan(dp_shard=2), record
    # nothing outside the job's directory changed: bytes, owner, mode
    assert {t: snapshot(t) for t in targets} == before
    # what the job left is gone: its directory, and its plants in the shared temporary dirs
    wait_for(lambda: not run_dir.exists(), 30, cluster.logs)
    leftovers = [p for p in planted if p.startswith(("/tmp/mg-plant-", "/dev/shm/mg-plant-"))]
    assert leftovers and not any(os.path.lexists(p) for p in leftovers), leftovers
    # the agent serves on: alive, and it never logged a traceback
    assert cluster.agents["n0"].process.poll() is None
    assert "Traceback" not in cluster.agent_log("n0"), cluster.agent_log("n0")[-3000:]


def test_a_jobs_own_exited_line_for_workers_the_agent_started_is_refused_and_no_vouch_after_its_end(cluster):
    """The worker sends ``exited`` (exit 0 of every local rank) for itself while it runs on:
    refused, the job stays RUNNING (its record true); once the job is over, the socket
    mints no vouch for it."""
    out = cluster.root / "forged"
    out.mkdir()
    out.chmod(0o777)
    forge = (
        "import json, os, socket, sys, time\n"
        "def ask(line):\n"
        "    s = socket.socket(socket.AF_UNIX); s.connect(os.environ['MESHGATE_AGENT_SOCKET'])\n"
        "    s.sendall(json.dumps(line).encode() + b'\\n'); return json.loads(s.makefile().readline())\n"
        "rank = os.environ['LOCAL_RANK']\n"
        "answer = ask({'exited': {'generation': 0, 'local_ranks': [0, 1], 'exit_code': 0}}) if rank == '0' else {}\n"
        "open(sys.argv[1] + f'/forged-{rank}.json', 'w').write(json.dumps({'answer': answer, 'pid': os.getpid()}))\n"
        "time.sleep(300)\n"
    )
    cluster.submit("forger", [SYSTEM_PYTHON, "-c", forge, str(out)], procs=2)
    wait_for(lambda: len(list(out.glob("forged-*.json"))) == 2, 60, cluster.logs)
    answer = json.loads((out / "forged-0.json").read_text())["answer"]
    assert "generation" not in answer and "reports their exits itself" in answer["error"], answer
    assert "vouch refused to pid" in cluster.agent_log("n0")
    assert cluster.job("forger").state == pb.RUNNING  # the forged exits changed nothing
    pids = [json.loads(p.read_text())["pid"] for p in out.glob("forged-*.json")]
    assert all(alive(p) for p in pids)
    admin.cancel_job(cluster.address, "forger", "test over")
    assert cluster.wait_ended("forger").state == pb.CANCELLED
    wait_for(lambda: not any(alive(p) for p in pids), 30, cluster.logs)
    # No vouch for anyone once the job is over: a caller of an allowed uid (the agent's own
    # user: what Ray's workers run as) asks for one and is refused.
    code = (
        "import json, socket, sys\n"
        "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
        "s.sendall(b'{\"local_rank\": 0}\\n'); print(s.makefile().readline())\n"
    )
    wait_for(lambda: "back to the pool" in cluster.agent_log("n0").split("forger", 1)[-1], 30, cluster.logs)
    done = cluster.host.as_agent_user([SYSTEM_PYTHON, "-c", code, str(cluster.agents["n0"].state_dir / "vouch.sock")])
    reply = json.loads(done.stdout)
    assert "vouch" not in reply and "serves no job now" in reply["error"], reply


CROSS = str(REPO / "tests" / "workers" / "cross_job.py")


@pytest.fixture(scope="module")
def two_agents(shipped_host):
    """Two agents on one host (one network namespace, one /proc), as shipped: each with a
    job user of its own, fan-in on (the shipped agent.toml)."""
    with ShippedCluster(shipped_host, ("a", "b"), own_job_users=True) as running:
        yield running


def test_two_agents_on_one_host_cannot_share_a_job_user(two_agents):
    cluster = two_agents
    job_user = job_user_of(cluster, "a")
    holder = cluster.agents["a"].process.pid
    third = ShippedAgent(cluster.host, "c", cluster.root / "c", job_user=cluster.agents["a"].run_as)
    cluster.agents["c"] = third
    try:
        with pytest.raises(AgentExited):
            cluster.start_agent("c")  # names a's job user
        log = third.log()
    finally:
        cluster.agents.pop("c").stop()
    assert f"[agent] run_as {job_user.name!r} (uid {job_user.uid}) is already the job user of pid " in log, log
    # the holder named is a's agent (the process the setpriv wrapper became)
    assert f"is already the job user of pid {holder} (uid {cluster.host.agent_user.pw_uid}" in log, log
    assert "two agents must never share a job user" in log
    assert all(cluster.agents[n].process.poll() is None for n in ("a", "b"))  # the holders serve on


def test_a_job_of_one_agent_cannot_read_signal_trace_or_write_a_job_of_another(two_agents):
    cluster = two_agents
    out = cluster.root / "cross"
    out.mkdir()
    out.chmod(0o777)
    secret = "victim-secret-" + secrets.token_hex(8)
    victim_spec = pb.JobSpec(
        job_id="victim",
        plan=ParallelPlan(dp_shard=2).to_proto(),
        node_ids=["b"],
        command=[SYSTEM_PYTHON, CROSS],
        env={"CROSS_ROLE": "victim", "CROSS_OUT": str(out), "CROSS_SECRET": secret},
    )
    admin.submit_job(cluster.address, victim_spec)
    wait_for(lambda: (out / "victim.json").exists(), 60, cluster.logs)
    b_state = cluster.agents["b"].state_dir
    sockets = [b_state / "vouch.sock", b_state / "rendezvous.sock"]
    assert all(p.exists() for p in sockets)
    thief_spec = pb.JobSpec(
        job_id="thief",
        plan=ParallelPlan(dp_shard=2).to_proto(),
        node_ids=["a"],
        command=[SYSTEM_PYTHON, CROSS],
        env={"CROSS_ROLE": "thief", "CROSS_OUT": str(out), "CROSS_SOCKETS": ":".join(map(str, sockets))},
    )
    admin.submit_job(cluster.address, thief_spec)
    assert cluster.wait_ended("thief").state == pb.SUCCEEDED, cluster.logs()
    record = json.loads((out / "thief.json").read_text())
    victim = record["victim"]
    assert victim["uid"] == cluster.agents["b"].run_as.pw_uid and record["uid"] != victim["uid"], record
    tries = record["tries"]
    assert tries == {
        "environ": "PermissionError",
        "signal 0": "PermissionError",
        "SIGTERM": "PermissionError",
        "ptrace": "Operation not permitted",
        "write work": "PermissionError",
        "list work": "PermissionError",
        "dial vouch.sock": tries["dial vouch.sock"],  # below: the agent's own refusal
        "dial rendezvous.sock": "PermissionError",  # the fan-in: the victim's job group only
    }, tries
    # the vouch socket lets any local process connect: b's agent refuses the thief itself,
    # names why (its pid is in no unit of b's job) and logs it with its uid
    refused = json.loads(tries["dial vouch.sock"].removeprefix("done: "))
    assert "vouch" not in refused and "is not a process of job 'victim'" in refused["error"], refused
    wait_for(
        lambda: (
            "vouch refused to pid" in cluster.agent_log("b") and f" uid {record['uid']}: " in cluster.agent_log("b")
        ),
        10,
        cluster.logs,
    )
    assert secret not in json.dumps(record)
    assert alive(victim["pid"]) and cluster.job("victim").state == pb.RUNNING
    assert not (Path(victim["cwd"]) / "planted-by-thief.py").exists()
    admin.cancel_job(cluster.address, "victim", "test over")
    cluster.wait_ended("victim")


def test_a_job_writes_a_checkpoint_to_a_configured_path_as_the_job_user(cluster):
    """The shipped unit leaves the job its checkpoints: a torch checkpoint written to the
    agent's [agent] job_paths entry, as the job user, read back by the next job."""
    checkpoints = cluster.root / "checkpoints"
    checkpoint = (
        "import os, sys, torch\n"
        "rank = int(os.environ['LOCAL_RANK'])\n"
        "path = os.environ['MESHGATE_JOB_PATHS'].split(':')[0] + f'/ckpt-{rank}.pt'\n"
        "if sys.argv[1] == 'save':\n"
        "    torch.save({'rank': rank, 'weights': torch.arange(4.0)}, path)\n"
        "else:\n"
        "    state = torch.load(path)\n"
        "    assert state['rank'] == rank and state['weights'].tolist() == [0, 1, 2, 3], state\n"
    )
    cluster.submit("ckpt-save", [cluster.host.python, "-c", checkpoint, "save"], procs=2)
    assert cluster.wait_ended("ckpt-save").state == pb.SUCCEEDED, cluster.logs()
    written = sorted(checkpoints.glob("ckpt-*.pt"))
    assert [p.name for p in written] == ["ckpt-0.pt", "ckpt-1.pt"]
    assert {p.stat().st_uid for p in written} == {cluster.agents["n0"].run_as.pw_uid}
    cluster.submit("ckpt-load", [cluster.host.python, "-c", checkpoint, "load"], procs=2)
    assert cluster.wait_ended("ckpt-load").state == pb.SUCCEEDED, cluster.logs()


def test_a_job_path_the_job_user_cannot_write_is_named_at_start(cluster, tmp_path):
    """Asked of the kernel as the job user: a root-owned 0755 directory is refused, naming
    it, its owner and mode; the job user's own directory passes."""
    user = job_user_of(cluster)
    launcher = Launcher(user, tmp_path)
    closed = cluster.root / "not-the-jobs"
    closed.mkdir(exist_ok=True)
    closed.chmod(0o755)
    refusal = launcher.job_user_may_write(closed)
    assert refusal is not None and str(closed) in refusal and "owner uid 0" in refusal and "mode 755" in refusal
    assert launcher.job_user_may_write(cluster.root / "checkpoints") is None


def test_the_job_user_can_change_nothing_of_the_agents(cluster):
    """A job tries to write, truncate, chmod, rename, remove and touch every path in the
    agent's state directory (named to it: it cannot list them), its trust bundle, sockets,
    journals and its own plan included: every try is refused, nothing changes."""
    state = cluster.agents["n0"].state_dir
    out = cluster.root / "tamper"
    out.mkdir()
    out.chmod(0o777)
    tamper = (
        "import json, os, sys\n"
        "tries = {}\n"
        "for path in sys.argv[2:]:\n"
        "    for name, act in (\n"
        "        ('write', lambda: os.close(os.open(path, os.O_WRONLY | os.O_APPEND))),\n"
        "        ('truncate', lambda: os.truncate(path, 0)),\n"
        "        ('chmod', lambda: os.chmod(path, 0o777)),\n"
        "        ('rename', lambda: os.rename(path, path + '.moved')),\n"
        "        ('unlink', lambda: os.unlink(path) if not os.path.isdir(path) else os.rmdir(path)),\n"
        "        ('touch', lambda: os.utime(path, (0, 0))),\n"
        "        ('plant', lambda: os.close(os.open(os.path.join(path, 'x'), os.O_CREAT | os.O_WRONLY))),\n"
        "    ):\n"
        "        try:\n"
        "            act(); tries[f'{name} {path}'] = 'done'\n"
        "        except OSError as exc:\n"
        "            tries[f'{name} {path}'] = type(exc).__name__\n"
        "json.dump(tries, open(sys.argv[1] + '/tamper.json', 'w'))\n"
    )
    job_work = state / "jobs" / "tamper" / "work"
    # what the agent itself still removes of the last job is not the job's doing
    wait_for(lambda: not any((state / "jobs").iterdir()), 30, cluster.logs)
    paths = [state] + [
        Path(root) / name
        for root, dirs, files in os.walk(state)
        for name in dirs + files
        if not str(Path(root) / name).startswith(str(job_work))
    ]
    before = {p: snapshot(p) for p in paths}
    # the job's own plan and directory (made at its launch) are tried too
    extra = [state / "jobs", state / "jobs" / "tamper", state / "jobs" / "tamper" / "plan.toml"]
    tried = list(dict.fromkeys(paths + extra))
    cluster.submit("tamper", [SYSTEM_PYTHON, "-c", tamper, str(out), *map(str, tried)])
    assert cluster.wait_ended("tamper").state == pb.SUCCEEDED, cluster.logs()
    tries = json.loads((out / "tamper.json").read_text())
    assert len(tries) == 7 * len(tried) and not [t for t, result in tries.items() if result == "done"], tries
    assert {p: snapshot(p) for p in paths if p.exists()} == before
    assert cluster.agents["n0"].process.poll() is None
