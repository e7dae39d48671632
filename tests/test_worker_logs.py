"""The agent's keeping of workers' output (agent/worker_logs.py), without a coordinator:
real pipes and real child processes, rotation, tails, retention and following, and the
answer to a log request as the agent sends it (PushLogs calls recorded)."""

from __future__ import annotations

import asyncio
import os
import random
import stat
import subprocess
import sys

import pytest

from meshgate.agent.worker_logs import CHUNK_BYTES, RankLog, RankOutput, WorkerLogs, rotated
from meshgate.v1 import nodes_pb2


def _run(logs: WorkerLogs, job_id: str, rank: int, code: str) -> int:
    """A child that runs ``code`` with its stdout and stderr on the agent's pipe."""
    sink = logs.capture(job_id, 3, rank).sink
    try:
        child = subprocess.Popen([sys.executable, "-c", code], stdout=sink, stderr=subprocess.STDOUT)
    finally:
        sink.close()
    returncode = child.wait(timeout=60)
    assert logs.drained(job_id, rank, 10)
    return returncode


def test_stdout_and_stderr_in_order_in_a_file_only_the_agent_reads(tmp_path):
    logs = WorkerLogs(tmp_path / "worker-logs")
    code = "import sys; print('out 1', flush=True); print('err 2', file=sys.stderr, flush=True); print('out 3')"
    assert _run(logs, "job/../x", 4, code) == 0
    directory = logs.job_dir("job/../x")
    assert directory.parent == tmp_path / "worker-logs" and directory.name == "job-job%2F..%2Fx"
    kept = directory / "rank-4.log"
    assert kept.read_text().splitlines()[1:] == ["out 1", "err 2", "out 3"]
    assert kept.read_text().startswith("--- meshgate: rank 4, generation 3, started ")
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700 and stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert stat.S_IMODE(directory.parent.stat().st_mode) == 0o700
    assert logs.ranks("job/../x") == [4] and logs.ranks("other") == []


def test_a_rank_keeps_at_most_two_files_of_max_bytes_and_the_newest_output(tmp_path):
    logs = WorkerLogs(tmp_path, max_bytes=64 << 10)
    code = "for i in range(20000): print(f'line {i:06d}')"  # 240 kB
    assert _run(logs, "big", 0, code) == 0
    current = logs.job_dir("big") / "rank-0.log"
    sizes = [current.stat().st_size, rotated(current).stat().st_size]
    assert all(size <= (64 << 10) for size in sizes), sizes
    assert logs.tail("big", 0, 3) == "line 019997\nline 019998\nline 019999\n"
    with logs.read("big", 0) as output:
        data = b"".join(iter(output.chunk, b""))
    assert len(data) == sum(sizes) and data.endswith(b"line 019999\n")
    everything = "".join(f"line {i:06d}\n" for i in range(20000)).encode()
    assert everything.endswith(data) and len(data) > 64 << 10  # the newest output, nothing lost in between


def test_a_tail_is_the_last_lines_across_the_rotated_and_current_file(tmp_path):
    rng = random.Random(7)
    path = tmp_path / "rank-0.log"
    for trial in range(300):
        lines = [("x" * rng.choice((0, 1, 5, CHUNK_BYTES + 3))).encode() for _ in range(rng.randint(0, 12))]
        data = b"\n".join(lines) + (b"\n" if rng.random() < 0.7 else b"")
        cut = rng.randint(0, len(data))
        rotated(path).write_bytes(data[:cut])
        path.write_bytes(data[cut:])
        if rng.random() < 0.2:
            rotated(path).unlink()
            data = data[cut:]
        want = rng.randint(0, 15)
        with RankOutput(path, want) as output:
            got = b"".join(iter(output.chunk, b""))
        expected = data if not want else b"".join(data.splitlines(keepends=True)[-want:])
        assert got == expected, (trial, want, len(data), cut)


def test_only_the_most_recent_jobs_output_is_kept(tmp_path):
    logs = WorkerLogs(tmp_path, keep_jobs=2)
    for job_id in ("a", "b", "c"):
        assert _run(logs, job_id, 0, "print('hi')") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job-b", "job-c"]


def test_a_follow_goes_on_across_a_rotation_without_losing_or_repeating_a_byte(tmp_path):
    logs = WorkerLogs(tmp_path, max_bytes=64 << 10)
    directory = tmp_path / "job-j"
    directory.mkdir()
    path = directory / "rank-0.log"
    path.write_bytes(b"a" * 1000)
    with logs.read("j", 0) as output:
        cursor = output.cursor()
        assert b"".join(iter(output.chunk, b"")) == b"a" * 1000
    with open(path, "ab") as handle:
        handle.write(b"b" * 10)
    path.rename(rotated(path))  # rotated by the capture thread
    path.write_bytes(b"c" * 5)
    assert b"".join(iter(cursor.read, b"")) == b"b" * 10 + b"c" * 5
    with open(path, "ab") as handle:
        handle.write(b"d" * 3)
    assert b"".join(iter(cursor.read, b"")) == b"d" * 3
    cursor.close()


def test_a_follow_slower_than_two_rotations_reads_every_file_still_kept_in_order(tmp_path):
    """Two rotations between two reads delete the file the follow was reading, and a new file
    may get its inode number (CI saw a follow skip a whole rotated file that way): the follow
    holds its file, reads what was added to it, then the rotated file, then the current one."""
    directory = tmp_path / "job-j"
    directory.mkdir()
    path = directory / "rank-0.log"
    path.write_bytes(b"a" * 100)
    with WorkerLogs(tmp_path).read("j", 0) as output:
        cursor = output.cursor()
        assert b"".join(iter(output.chunk, b"")) == b"a" * 100
    with open(path, "ab") as handle:
        handle.write(b"A" * 7)  # written before the first rotation
    for name in (b"B", b"C"):  # two rotations: the file the follow reads is deleted by the second
        os.replace(path, rotated(path))
        path.write_bytes(name * 50)
    assert b"".join(iter(cursor.read, b"")) == b"A" * 7 + b"B" * 50 + b"C" * 50
    assert cursor.read() == b""
    cursor.close()


def test_a_log_request_is_answered_in_bounded_chunks_and_a_follow_ends_with_the_job(tmp_path):
    logs = WorkerLogs(tmp_path)
    pushed: list[tuple[int, bytes, bool, str]] = []
    serving = {"j"}

    async def push(request_id, rank, data, done, notice):
        assert request_id == "r" and len(data) <= CHUNK_BYTES
        pushed.append((rank, data, done, notice))
        return False

    async def scenario():
        sink = logs.capture("j", 0, 2).sink
        child = subprocess.Popen(
            [sys.executable, "-c", "import time\nfor i in range(30): print(i, flush=True); time.sleep(0.02)"],
            stdout=sink,
        )
        sink.close()
        request = nodes_pb2.LogRequest(request_id="r", job_id="j", ranks=[2], follow=True)
        task = asyncio.ensure_future(logs._serve(request, push, lambda job_id: job_id in serving))
        await asyncio.to_thread(child.wait, 30)
        serving.clear()  # the job is over on this node
        await asyncio.wait_for(task, 30)

    asyncio.run(scenario())
    assert pushed[-1] == (0, b"", True, "")
    text = b"".join(data for _, data, _, _ in pushed).decode()
    assert text.splitlines()[1:] == [str(i) for i in range(30)]
    assert pushed and all(rank == 2 for rank, data, _, _ in pushed if data)


def test_a_request_for_output_this_node_does_not_keep_says_so(tmp_path):
    logs = WorkerLogs(tmp_path)
    pushed = []

    async def push(*fields):
        pushed.append(fields)
        return False

    asyncio.run(logs._serve(nodes_pb2.LogRequest(request_id="r", job_id="gone", ranks=[1]), push, lambda j: False))
    assert pushed == [("r", 0, b"", True, "no output of job gone (1) is kept on this node")]


def test_a_follow_carried_by_the_heartbeat_that_assigns_the_job_waits_for_its_output(tmp_path):
    """CI saw it: a reader's follow of a job just submitted came in the very heartbeat answer
    that gave this node the job, while the node had not begun it and the previous job's end
    still showed; the follow ended at once ("no output ... is kept") and missed everything."""
    from meshgate.agent.config import AgentConfig
    from meshgate.agent.daemon import Agent
    from meshgate.agent.job_run import JobRun
    from meshgate.v1 import rendezvous_pb2

    pushed: list[tuple[int, bytes, bool, str]] = []

    async def push(request_id, rank, data, done, notice):
        pushed.append((rank, data, done, notice))
        return False

    async def scenario():
        config = {"coordinator": "h:1", "insecure": True, "run_jobs_as_agent": True, "node_id": "n0"}
        agent = Agent(AgentConfig.from_mapping({**config, "state_dir": str(tmp_path)}))
        agent.runner.begin(JobRun("boom", pool=True))
        agent.runner.run.end("job boom FAILED")
        agent.runner.end()  # back in the pool; boom's end still set
        assert not agent.serves("boom") and not agent.serves("chatter") and not agent.serves("")
        # The heartbeat loop's order: the answer's log requests, then its assignment.
        reply = nodes_pb2.NodeHeartbeatResponse(job_id="chatter", job_state=rendezvous_pb2.RUNNING)
        agent.worker_logs.answer(
            nodes_pb2.LogRequest(request_id="r", job_id="chatter", ranks=[0], follow=True), push, agent.serves
        )
        agent._follow_job(reply)
        assert agent.serves("chatter") and not agent.serves("boom")
        await asyncio.sleep(0.3)  # joining: no output yet, and the follow waits for it
        assert pushed == []
        agent.runner.begin(JobRun(agent.source.claimed, pool=True))
        sink = agent.worker_logs.capture("chatter", 0, 0).sink
        child = subprocess.Popen([sys.executable, "-c", "print('tick 1', flush=True)"], stdout=sink)
        sink.close()
        await asyncio.to_thread(child.wait, 30)
        agent.runner.run.end("job chatter SUCCEEDED")
        await asyncio.wait_for(asyncio.gather(*agent.worker_logs.serving), 30)

    asyncio.run(scenario())
    assert b"".join(data for _, data, _, _ in pushed).decode().splitlines()[1:] == ["tick 1"]
    assert pushed[-1] == (0, b"", True, "")


@pytest.mark.parametrize("key, value", [("worker_log_bytes", 1000), ("worker_log_jobs", 0), ("worker_log_jobs", "5")])
def test_the_bounds_are_checked_in_the_agent_config(key, value):
    from meshgate.agent.config import AgentConfig, AgentConfigError

    with pytest.raises(AgentConfigError, match=f"{key} must be an integer >= "):
        AgentConfig.from_mapping({"coordinator": "h:1", "insecure": True, "run_jobs_as_agent": True, key: value})


def test_a_follow_of_every_rank_takes_in_a_rank_that_starts_after_it_began(tmp_path):
    logs = WorkerLogs(tmp_path, max_bytes=64 << 10)
    pushed: dict[int, bytes] = {}
    serving = {"j"}

    async def push(request_id, rank, data, done, notice):
        pushed[rank] = pushed.get(rank, b"") + data
        return False

    def start(rank: int, code: str) -> subprocess.Popen:
        sink = logs.capture("j", 0, rank).sink
        try:
            return subprocess.Popen([sys.executable, "-c", code], stdout=sink)
        finally:
            sink.close()

    async def scenario():
        first = start(0, "print('early')")
        task = asyncio.ensure_future(
            logs._serve(nodes_pb2.LogRequest(request_id="r", job_id="j", follow=True), push, serving.__contains__)
        )
        await asyncio.sleep(0.5)
        late = start(1, "for i in range(9000): print(f'late {i:05d}')")  # 99 kB: rotated once on the way
        await asyncio.to_thread(late.wait, 30)
        await asyncio.to_thread(first.wait, 30)
        await asyncio.to_thread(logs.drained, "j", 1, 10)
        serving.clear()
        await asyncio.wait_for(task, 30)

    asyncio.run(scenario())
    assert pushed[0].decode().splitlines()[1:] == ["early"]
    late = pushed[1].decode().splitlines()
    assert late[1:] == [f"late {i:05d}" for i in range(9000)], "every line once, in order, across the rotation"


def test_a_follow_goes_on_exactly_where_the_kept_read_stopped_whatever_was_written_since(tmp_path):
    """The kept read's snapshot ends at the header; 22 kB come after it, before the read. The
    follow's cursor shares the read's descriptor: a buffered read of the header read ahead
    into those 22 kB and the follow went on after them (a new rank's first lines lost,
    under load)."""
    path = tmp_path / "rank-0.log"
    rank_log = RankLog(path, 1 << 20)
    rank_log.write(b"header\n")
    lines = b"".join(f"line {i:05d}\n".encode() for i in range(2000))
    with RankOutput(path) as output:
        rank_log.write(lines)  # after the snapshot
        kept = b""
        while chunk := output.chunk():
            kept += chunk
        cursor = output.cursor()
    try:
        followed = b""
        while data := cursor.read():
            followed += data
    finally:
        cursor.close()
        rank_log.close()
    assert kept == b"header\n"
    assert followed == lines
