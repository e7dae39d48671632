"""Job logs (issue 24, part 1) on real processes: a coordinator and two agents under mTLS,
each agent started as its shipped systemd unit starts it (tests/shipped.py: the unit's
user, capabilities and delegated cgroup, the shipped agent.toml with its TLS keys through
LoadCredential=, a job user of its own per agent), so every worker runs as that job user.
Each worker's stdout and stderr stay on its node, in the agent's state dir; `meshgate job
logs` reads them through the coordinator, which relays the request over the agents' own
heartbeat channel and their PushLogs answers. A failed job's `job show` quotes the last
lines of the worker that failed first, after a coordinator restart too. Only the job's
owner or an admin may read; bad --rank/--tail/--node values are refused naming them.
"""

from __future__ import annotations

import os
import queue
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

import shipped
from conftest import REPO
from meshgate import admin, wire
from meshgate.cli import main as meshgate_main
from meshgate.job_cli import spec_message
from meshgate.client import RendezvousRefused
from meshgate.plan import ParallelPlan
from meshgate.tls import issue_cert
from meshgate.v1 import nodes_pb2, nodes_pb2_grpc
from meshgate.v1 import rendezvous_pb2 as pb
from shipped import ShippedCluster

pytestmark = pytest.mark.slow

shipped_host = shipped.shipped_host  # the fixture: users, interpreter, delegated cgroup

NODES = ("n0", "n1")
CHATTY_SCRIPT = str(REPO / "tests" / "workers" / "chatty_worker.py")  # the repo is world-readable
PLAN = ParallelPlan(dp_shard=2)  # one rank per node: rank 0 on one, rank 1 on the other


@pytest.fixture(scope="module")
def cluster(shipped_host):
    """Two nodes under mTLS, their agents as shipped, each with a job user of its own."""
    with ShippedCluster(shipped_host, NODES, tls=True) as running:
        yield running


@pytest.fixture(scope="module")
def chatty(shipped_host) -> list[str]:
    """The worker's command: an interpreter the job users can execute (the fixture's venv),
    never the test's own (under the project venv, for root)."""
    return [shipped_host.python, CHATTY_SCRIPT]


@pytest.fixture
def scratch(cluster) -> Path:
    """Where the test and the workers (each node's job user) meet: markers and release files.
    Not tmp_path: /tmp/pytest-of-root is root's 0700; under the cluster's root (0755), 1777."""
    path = Path(tempfile.mkdtemp(prefix="scratch-", dir=cluster.root))
    path.chmod(0o1777)
    return path


def cli(cluster: ShippedCluster, command: str, *argv: str) -> list[str]:
    """``meshgate job COMMAND`` with this cluster's admin connection, then ``argv``."""
    return [
        "job",
        command,
        "--coordinator",
        cluster.address,
        "--ca-file",
        str(cluster.ca.ca),
        "--cert-file",
        str(cluster.ca.admin.cert),
        "--key-file",
        str(cluster.ca.admin.key),
        *argv,
    ]


def submit(cluster: ShippedCluster, job_id: str, nodes: int, command: list[str], **spec) -> pb.JobInfo:
    """``spec``: more [job] keys, as a job file spells them (restart_policy="on-failure")."""
    message = spec_message({"id": job_id, "plan": PLAN, "nodes": nodes, "command": command, **spec})
    return admin.submit_job(cluster.address, message, tls=cluster.admin_tls)


def wait_idle(cluster: ShippedCluster, timeout: float = 30) -> None:
    """Every job ended and every node is back in the pool (its agent showed the
    containment units of its last job empty)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = [
            j.spec.job_id
            for j in admin.list_jobs(cluster.address, tls=cluster.admin_tls).jobs
            if j.state in (pb.PENDING, pb.RUNNING)
        ]
        with urllib.request.urlopen(cluster.metrics_url, timeout=5) as response:
            idle = f'meshgate_nodes{{state="idle"}} {float(len(cluster.nodes))}' in response.read().decode()
        if not busy and idle:
            return
        time.sleep(0.2)
    raise AssertionError(f"jobs still running: {busy}, or not every node idle\n{cluster.logs()}")


@pytest.fixture(scope="module")
def failed(cluster, chatty):
    """A job whose rank-1 worker raises: FAILED, its nodes idle again."""
    submit(cluster, "boom", 2, chatty, env={"CHATTY_FAIL_RANK": "1"})
    info = cluster.wait_ended("boom")
    assert info.state == pb.FAILED, (info, cluster.logs())
    wait_idle(cluster)
    return info


def _cli(cluster, capsys, *argv: str) -> tuple[int, str, str]:
    code = meshgate_main(cli(cluster, "logs", *argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_failing_workers_traceback_is_read_from_anywhere_through_the_coordinator(cluster, failed, capsys):
    code, out, err = _cli(cluster, capsys, "boom", "--rank", "1")
    assert code == 0, err
    assert "hello from rank 1" in out and "about to fail" in out, out
    assert "Traceback (most recent call last)" in out and "RuntimeError: rank 1 fails on purpose" in out, out
    assert "hello from rank 0" not in out  # only rank 1's output
    # every rank, each line led by its rank; and the last line only
    code, out, err = _cli(cluster, capsys, "boom")
    assert code == 0 and "[rank 0] hello from rank 0" in out and "[rank 1] RuntimeError: rank 1 fails" in out, out
    code, out, err = _cli(cluster, capsys, "boom", "--rank", "1", "--tail", "1")
    assert (code, out) == (0, "RuntimeError: rank 1 fails on purpose\n"), (out, err)
    node = next(n.node_id for n in failed.status.nodes if n.first_rank == 1)
    code, out, err = _cli(cluster, capsys, "boom", "--node", node, "--tail", "2")
    assert code == 0 and out.startswith("[rank 1] ") and "RuntimeError" in out, out


def test_the_output_stays_in_the_agents_state_dir_readable_by_the_agent_only(cluster, failed):
    node = next(n.node_id for n in failed.status.nodes if n.first_rank == 1)
    agent = cluster.agents[node]
    directory = agent.state_dir / "worker-logs" / "job-boom"
    kept = directory / "rank-1.log"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700 and stat.S_IMODE(kept.stat().st_mode) == 0o600
    # the agent's, not root's nor the job user's: the worker that wrote it cannot read it back
    agent_uid = cluster.host.agent_user.pw_uid
    assert (directory.stat().st_uid, kept.stat().st_uid) == (agent_uid, agent_uid)
    assert "RuntimeError: rank 1 fails on purpose" in kept.read_text()
    job_user = agent.run_as
    read = subprocess.run(
        [cluster.host.python, "-c", f"open({str(kept)!r}).read()"],
        user=job_user.pw_uid,
        group=job_user.pw_gid,
        extra_groups=[],
        cwd="/",
        capture_output=True,
        text=True,
    )
    assert read.returncode != 0 and "PermissionError" in read.stderr, read


def test_follow_streams_new_lines_of_a_running_job_and_ends_when_the_job_ends(cluster, failed, chatty, scratch):
    release = scratch / "release"
    submit(cluster, "chatter", 2, chatty, env={"CHATTY_TICK_UNTIL": str(release)})
    follower = subprocess.Popen(
        [sys.executable, "-m", "meshgate.cli", *cli(cluster, "logs", "chatter", "--rank", "0", "--follow")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: "queue.Queue[str]" = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in follower.stdout], daemon=True)
    reader.start()
    seen: list[str] = []

    def wait_for(predicate, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            try:
                seen.append(lines.get(timeout=max(deadline - time.monotonic(), 0.01)).rstrip("\n"))
            except queue.Empty:
                follower.kill()
                raise AssertionError(f"follow saw {seen[-5:]}; stderr {follower.stderr.read()}\n{cluster.logs()}")

    try:
        wait_for(lambda: any(line.startswith("tick ") for line in seen))
        first = max(int(line.split()[1]) for line in seen if line.startswith("tick "))
        wait_for(lambda: any(line == f"tick {first + 10}" for line in seen))  # new lines, as they are written
        release.touch()
        info = cluster.wait_ended("chatter")
        assert info.state == pb.SUCCEEDED, (info, cluster.logs())
        assert follower.wait(timeout=60) == 0, follower.stderr.read()  # it ends with the job
        reader.join(timeout=10)
        while not lines.empty():
            seen.append(lines.get().rstrip("\n"))
    finally:
        release.touch()  # a failed check still lets the job end, so the next test gets the nodes
        if follower.poll() is None:
            follower.kill()
    assert seen[0].startswith("--- meshgate: rank 0, generation ") and seen[1] == "hello from rank 0", seen[:3]
    assert seen[-1] == "rank 0 done", seen[-3:]
    ticks = [int(line.split()[1]) for line in seen if line.startswith("tick ")]
    assert ticks == list(range(len(ticks))), "every line once, in order"
    wait_idle(cluster)


def test_a_follow_from_submit_shows_each_generation_of_a_restarted_rank_and_ends_with_the_job(
    cluster, failed, chatty, scratch
):
    (scratch / "go").touch()
    env = {
        "CHATTY_FAIL_RANK": "1",
        "CHATTY_FAIL_MARKER": str(scratch / "failed"),  # made by rank 1's worker, as its node's job user
        "CHATTY_TICK_UNTIL": str(scratch / "go"),
    }
    submit(cluster, "again", 2, chatty, restart_policy="on-failure", max_restarts=1, env=env)
    follow = subprocess.run(  # from the submit on: it waits for rank 1 to start, and ends with the job
        [sys.executable, "-m", "meshgate.cli", *cli(cluster, "logs", "again", "--rank", "1", "--follow")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    info = cluster.wait_ended("again")
    assert info.state == pb.SUCCEEDED and info.status.generation == 1, (info, cluster.logs())
    assert follow.returncode == 0, follow.stderr
    lines = follow.stdout.splitlines()
    headers = [n for n, line in enumerate(lines) if line.startswith("--- meshgate: rank 1, generation ")]
    assert [lines[n].split(",")[1] for n in headers] == [" generation 0", " generation 1"], lines
    first, second = lines[headers[0] + 1 : headers[1]], lines[headers[1] + 1 :]
    assert first[:2] == ["hello from rank 1", "about to fail"] and first[-1] == "RuntimeError: rank 1 fails on purpose"
    assert second == ["hello from rank 1", "rank 1 done"], lines
    wait_idle(cluster)


def test_only_the_jobs_owner_or_an_admin_reads_its_logs(cluster, failed, chatty, scratch):
    alice, bob = (
        cluster.ca.client_tls(issue_cert(cluster.root / "tls", "submitter", name)) for name in ("alice", "bob")
    )
    with pytest.raises(RendezvousRefused) as refused:
        list(admin.job_logs(cluster.address, "boom", rank=1, tls=alice))  # the admin's job
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED, refused.value
    assert "may not read the output of job 'boom'" in refused.value.details, refused.value.details
    with pytest.raises(RendezvousRefused) as unknown:
        list(admin.job_logs(cluster.address, "no-such-job", tls=alice))
    assert unknown.value.code == grpc.StatusCode.NOT_FOUND, unknown.value
    # alice's own job: she reads it, bob does not, an admin does
    (scratch / "go").touch()
    message = spec_message({"id": "alices", "plan": PLAN, "nodes": 2, "command": chatty})
    message.env["CHATTY_TICK_UNTIL"] = str(scratch / "go")
    admin.submit_job(cluster.address, message, tls=alice)
    assert cluster.wait_ended("alices").state == pb.SUCCEEDED, cluster.logs()
    for reader in (alice, cluster.admin_tls):
        text = b"".join(c.data for c in admin.job_logs(cluster.address, "alices", rank=1, tls=reader)).decode()
        assert text.splitlines()[1:] == ["hello from rank 1", "rank 1 done"], text
    with pytest.raises(RendezvousRefused) as refused:
        list(admin.job_logs(cluster.address, "alices", tls=bob))
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED, refused.value
    assert "only its owner 'submitter:alice' or an admin may" in refused.value.details, refused.value.details
    wait_idle(cluster)


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--rank", "5"), "rank 5 is not a rank of job 'boom' (world size 2: ranks 0-1)"),
        (("--rank", "-1"), "--rank must be 0 or more, got -1"),
        (("--tail", "-3"), "--tail must be 0 or more, got -3"),
        (("--tail", "1000000"), "tail_lines 1000000 is more than 100000"),
        (("--node", "n9"), "node_id 'n9' is not a node of job 'boom'"),
    ],
)
def test_bad_rank_tail_or_node_values_are_refused_naming_them(cluster, failed, capsys, argv, message):
    code, out, err = _cli(cluster, capsys, "boom", *argv)
    assert code == 2 and message in err and out == "", (code, out, err)


def test_bad_pushes_and_exit_tails_from_an_agent_are_refused_naming_the_field(cluster, failed):
    tls = cluster.ca.client_tls(cluster.ca.agent("n0"))
    credential = (cluster.agents["n0"].state_dir / "node.credential").read_bytes()
    from meshgate.tls import secure_channel

    with secure_channel(cluster.address, tls) as channel:
        nodes = nodes_pb2_grpc.NodesStub(channel)
        cases = [
            (nodes_pb2.PushLogsRequest(request_id="r1", data=b"x" * (64 << 10 | 1)), "data is 65537 bytes"),
            (nodes_pb2.PushLogsRequest(request_id=""), "request_id '' is not one a LogRequest carried"),
            (nodes_pb2.PushLogsRequest(request_id="r1", notice="n" * 301), "notice is 301 characters"),
        ]
        for request, message in cases:
            request.node_id, request.node_credential = "n0", credential
            with pytest.raises(grpc.RpcError) as refused:
                nodes.PushLogs(request, timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in refused.value.details()
        stale = nodes.PushLogs(nodes_pb2.PushLogsRequest(node_id="n0", node_credential=credential, request_id="r1"))
        assert stale.stop  # no reader waits for it: the agent is told to stop
        with pytest.raises(grpc.RpcError) as refused:
            nodes.PushLogs(nodes_pb2.PushLogsRequest(node_id="n0", node_credential=b"x" * 32, request_id="r1"))
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        report = nodes_pb2.WorkerExitReport(job_id="boom", node_id="n0", node_credential=credential, exit_code=1)
        report.log_tail = "y" * 5000
        with pytest.raises(grpc.RpcError) as refused:
            nodes.ReportExit(report, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "log_tail is 5000 bytes; at most 4096" in refused.value.details()


def test_job_show_of_the_failed_job_quotes_the_failing_workers_last_lines_after_a_restart_too(cluster, failed, capsys):
    for restart in (False, True):
        if restart:
            cluster.coordinator.kill()
            cluster.coordinator.restart()  # the same config, state and port
        assert meshgate_main(cli(cluster, "show", "boom")) == 0
        out = capsys.readouterr().out
        assert "last output of the worker that failed first" in out, out
        assert "  | RuntimeError: rank 1 fails on purpose" in out and "  | about to fail" in out, out
    assert "exited 1" in failed.reason and failed.status.failure_log_tail.endswith("fails on purpose\n")


def test_twenty_followers_of_one_job_leave_another_submitter_able_to_read_their_own_logs(
    cluster, failed, chatty, scratch
):
    """erin follows her running job twenty times; each node gives one reader at most half
    its log requests (4 of 8), so 16 of them are refused RESOURCE_EXHAUSTED naming that
    limit, and frank still reads the output his older job left on both nodes."""
    erin, frank = (
        cluster.ca.client_tls(issue_cert(cluster.root / "tls", "submitter", name))
        for name in ("erin", "frank")  # the owner test issued alice and bob
    )
    (scratch / "go").touch()
    message = spec_message({"id": "franks-old", "plan": PLAN, "nodes": 2, "command": chatty})
    message.env["CHATTY_TICK_UNTIL"] = str(scratch / "go")
    admin.submit_job(cluster.address, message, tls=frank)
    assert cluster.wait_ended("franks-old").state == pb.SUCCEEDED, cluster.logs()
    wait_idle(cluster)
    release = scratch / "release"
    message = spec_message({"id": "erins-loud", "plan": PLAN, "nodes": 2, "command": chatty})
    message.env["CHATTY_TICK_UNTIL"] = str(release)
    admin.submit_job(cluster.address, message, tls=erin)
    answers: "queue.Queue[tuple[int, str]]" = queue.Queue()  # (follower, "output" or the refusal)

    def follow(index: int) -> None:
        try:
            for chunk in admin.job_logs(cluster.address, "erins-loud", follow=True, tls=erin, timeout=None):
                if chunk.data:
                    answers.put((index, "output"))
                    break  # it holds its requests until the job ends
            for _ in admin.job_logs(cluster.address, "erins-loud", follow=True, tls=erin, timeout=None):
                pass
        except RendezvousRefused as exc:
            answers.put((index, f"{exc.code.name}: {exc.details}"))

    try:
        followers = [threading.Thread(target=follow, args=(i,), daemon=True) for i in range(20)]
        for thread in followers:
            thread.start()
        seen = [answers.get(timeout=60) for _ in range(20)]
        refused = [why for _, why in seen if why != "output"]
        assert len(refused) == 16, seen
        assert all(
            why.startswith("RESOURCE_EXHAUSTED: 'submitter:erin' already reads 4 log streams from node")
            and "(at most 4 of its 8, so that others can read theirs)" in why
            for why in refused
        ), refused
        for rank in (0, 1):  # one node each: neither is shut out to frank
            text = b"".join(c.data for c in admin.job_logs(cluster.address, "franks-old", rank=rank, tls=frank))
            assert f"hello from rank {rank}\nrank {rank} done\n" in text.decode(), text
    finally:
        release.touch()
    assert cluster.wait_ended("erins-loud").state == pb.SUCCEEDED, cluster.logs()
    wait_idle(cluster)


def test_a_pushed_chunk_of_a_rank_the_node_does_not_hold_is_refused_naming_rank_and_node(cluster, failed):
    """The agent of n0 is stopped (SIGSTOP) while the test answers a reader's request in its
    place, with its certificate and credential: output of rank 7 of a world of 2, or of
    the other node's rank, is refused PERMISSION_DENIED, and never reaches the reader."""
    from meshgate.tls import secure_channel

    agent = cluster.agents["n0"]
    tls = cluster.ca.client_tls(cluster.ca.agent("n0"))
    credential = (agent.state_dir / "node.credential").read_bytes()
    holder = next(
        n for n in admin.get_job(cluster.address, "boom", tls=cluster.admin_tls).status.nodes if n.node_id == "n0"
    )
    own, other = holder.first_rank, 1 - holder.first_rank
    os.kill(agent.process.pid, signal.SIGSTOP)  # its heartbeats stop: the reader's request waits for the test
    try:
        chunks: "queue.Queue" = queue.Queue()
        reader = threading.Thread(
            target=lambda: [
                chunks.put(c) for c in admin.job_logs(cluster.address, "boom", node_id="n0", tls=cluster.admin_tls)
            ],
            daemon=True,
        )
        reader.start()
        with secure_channel(cluster.address, tls) as channel:
            nodes = nodes_pb2_grpc.NodesStub(channel)
            deadline, requests = time.monotonic() + 30, []
            while not requests and time.monotonic() < deadline:
                # As the agent calls: with this release's versions (wire.metadata()), or the
                # coordinator takes n0 for an agent too old to keep logs and never asks it.
                beat = nodes.NodeHeartbeat(
                    nodes_pb2.NodeHeartbeatRequest(node_id="n0", node_credential=credential), metadata=wire.metadata()
                )
                requests = list(beat.log_requests)
                time.sleep(0.1)
            (request,) = requests
            for rank in (7, other):
                push = nodes_pb2.PushLogsRequest(
                    node_id="n0", node_credential=credential, request_id=request.request_id, rank=rank, data=b"forged\n"
                )
                with pytest.raises(grpc.RpcError) as refused:
                    nodes.PushLogs(push, timeout=10, metadata=wire.metadata())
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
                assert f"node 'n0' pushed output of rank {rank} of job 'boom', which it does not hold" in (
                    refused.value.details()
                ), refused.value.details()
            for push in (
                nodes_pb2.PushLogsRequest(rank=own, data=b"mine\n"),
                nodes_pb2.PushLogsRequest(done=True),
            ):
                push.node_id, push.node_credential, push.request_id = "n0", credential, request.request_id
                assert not nodes.PushLogs(push, timeout=10, metadata=wire.metadata()).stop
        reader.join(timeout=30)
    finally:
        os.kill(agent.process.pid, signal.SIGCONT)
    got = [chunks.get_nowait() for _ in range(chunks.qsize())]
    assert [(c.node_id, c.rank, c.data) for c in got] == [("n0", own, b"mine\n")], got
