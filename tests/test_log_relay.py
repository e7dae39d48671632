"""The coordinator's relay of job logs (coordinator/log_relay.py), without sockets: which
nodes a read asks (log_targets, pure), and the relay between a reader and its nodes' pushes
with a clock the test moves: bounded inputs, a node that never picks a request up or goes
silent is named, a reader that left stops its nodes, a slow reader holds its nodes back."""

from __future__ import annotations

import asyncio

import pytest

from meshgate.coordinator import log_relay
from meshgate.coordinator.jobs import Job, JobSpec, JobState
from meshgate.coordinator.log_relay import LogRelay, check_exit_tail, log_targets
from meshgate.coordinator.rendezvous import RendezvousError
from meshgate.plan import ParallelPlan
from meshgate.v1 import nodes_pb2
from meshgate.v1 import rendezvous_pb2 as pb


def _job(command=("python", "train.py"), state=JobState.RUNNING) -> Job:
    mode = pb.RANK_MODE_ASSIGNED if command else pb.RANK_MODE_CLAIMED  # claimed: external workers, no command
    message = pb.JobSpec(plan=ParallelPlan(dp_shard=4).to_proto(), nodes=2, command=list(command), mode=mode)
    return Job(JobSpec.from_proto(message, "j"), 0.0, state)


STATUS = pb.Status(
    nodes=[
        pb.NodeStatus(node_id="a", node_rank=0, first_rank=0, slots=2),
        pb.NodeStatus(node_id="b", node_rank=1, first_rank=2, slots=2),
        pb.NodeStatus(node_id="spare", node_rank=-1, first_rank=0, slots=2),
    ]
)


def _ask(**fields) -> pb.JobLogsRequest:
    return pb.JobLogsRequest(job_id="j", **fields)


def test_a_read_asks_the_rank_holder_one_node_or_every_placed_node():
    assert log_targets(_job(), STATUS, _ask(rank=3)) == [("b", [3])]
    assert log_targets(_job(), STATUS, _ask(rank=0)) == [("a", [0])]
    assert log_targets(_job(), STATUS, _ask(node_id="b")) == [("b", [])]
    assert log_targets(_job(), STATUS, _ask()) == [("a", []), ("b", [])]


@pytest.mark.parametrize(
    "job, request_, code, message",
    [
        (_job(), _ask(rank=4), "INVALID_ARGUMENT", "rank 4 is not a rank of job 'j' (world size 4: ranks 0-3)"),
        (
            _job(),
            _ask(node_id="zz"),
            "INVALID_ARGUMENT",
            "node_id 'zz' is not a node of job 'j' (its nodes: a, b, spare)",
        ),
        (_job(), _ask(rank=1, node_id="a"), "INVALID_ARGUMENT", "rank and node_id: give one of them"),
        (_job(), _ask(tail_lines=100_001), "INVALID_ARGUMENT", "tail_lines 100001 is more than 100000"),
        (_job(command=()), _ask(), "FAILED_PRECONDITION", "has no command"),
        (_job(state=JobState.PENDING), _ask(), "FAILED_PRECONDITION", "is PENDING: no worker of it has run yet"),
    ],
)
def test_a_read_the_job_cannot_answer_is_refused_naming_the_field(job, request_, code, message):
    with pytest.raises(RendezvousError) as refused:
        log_targets(job, STATUS, request_)
    assert refused.value.code.value == code and message in refused.value.message


def test_an_exit_tail_is_bounded():
    check_exit_tail("x" * 4096)
    with pytest.raises(RendezvousError, match="log_tail is 4098 bytes; at most 4096"):
        check_exit_tail("é" * 2049)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _push(request_id: str, data: bytes = b"", done: bool = False, rank: int = 0) -> nodes_pb2.PushLogsRequest:
    return nodes_pb2.PushLogsRequest(request_id=request_id, rank=rank, data=data, done=done)


def test_pushes_reach_the_reader_in_order_and_a_node_that_never_picks_up_is_named(monkeypatch):
    monkeypatch.setattr(log_relay, "TICK_S", 0.01)
    clock, relay, written = Clock(), None, []
    relay = LogRelay(clock)

    async def write(chunk):
        written.append(chunk)

    async def scenario():
        reading = asyncio.ensure_future(relay.relay(_ask(), [("a", []), ("b", [])], write, 10, STATUS, ALICE))
        await asyncio.sleep(0.05)
        (request,) = relay.take("a")  # a's heartbeat carries it; b never heartbeats
        assert request.job_id == "j" and relay.take("a") == []
        assert not await relay.push("a", _push(request.request_id, b"one\n", rank=1))
        assert await relay.push("b", _push(request.request_id, b"forged\n"))  # not b's: told to stop
        assert not await relay.push("a", _push(request.request_id, b"two\n", done=True, rank=1))
        clock.now = 11  # b's request was never picked up
        await asyncio.wait_for(reading, 5)

    asyncio.run(scenario())
    assert [(c.node_id, c.rank, c.data) for c in written[:2]] == [("a", 1, b"one\n"), ("a", 1, b"two\n")]
    assert written[2].node_id == "b" and "did not pick the request up within 10s" in written[2].notice
    assert relay.open == {} and relay.waiting == {}


def test_a_reader_that_leaves_stops_its_nodes_and_a_slow_one_holds_them_back(monkeypatch):
    monkeypatch.setattr(log_relay, "PUSH_WAIT_S", 0.2)
    relay = LogRelay(Clock())

    async def scenario():
        release = asyncio.Event()  # never set: this reader takes one chunk and reads no more

        async def slow_write(chunk):
            await release.wait()

        reading = asyncio.ensure_future(relay.relay(_ask(follow=True), [("a", [])], slow_write, 10, STATUS, ALICE))
        await asyncio.sleep(0.05)
        (request,) = relay.take("a")
        stops = [await relay.push("a", _push(request.request_id, b"x")) for _ in range(log_relay.QUEUE_CHUNKS + 1)]
        assert stops[: log_relay.QUEUE_CHUNKS] == [False] * log_relay.QUEUE_CHUNKS
        assert await relay.push("a", _push(request.request_id, b"x"))  # the queue stayed full: the reader is gone
        reading.cancel()  # the reader's call ends (Ctrl-C)
        await asyncio.gather(reading, return_exceptions=True)
        assert await relay.push("a", _push(request.request_id, b"y"))  # and its node is told to stop
        assert relay.open == {}

    asyncio.run(scenario())


ALICE, BOB, CAROL = "submitter:alice", "submitter:bob", "submitter:carol"


def test_one_reader_holds_at_most_half_a_nodes_log_requests_so_another_always_has_room():
    relay = LogRelay(Clock())
    reader = log_relay.Reader()
    for _ in range(log_relay.MAX_OPEN_PER_READER):
        relay.ask(reader, "a", "j", [], 0, True, range(0, 2), ALICE)
    with pytest.raises(log_relay.LogSlotsTaken) as refused:  # alice's twentieth follower
        relay.ask(reader, "a", "j", [], 0, True, range(0, 2), ALICE)
    assert refused.value.code.value == "RESOURCE_EXHAUSTED"
    assert "'submitter:alice' already reads 4 log streams from node 'a' (at most 4 of its 8" in refused.value.message
    relay.ask(reader, "b", "j", [], 0, True, range(2, 4), ALICE)  # another node: its own share
    for _ in range(log_relay.MAX_OPEN_PER_READER):
        relay.ask(reader, "a", "j", [], 0, True, range(0, 2), BOB)  # bob is not shut out
    with pytest.raises(log_relay.LogSlotsTaken, match="node 'a' already answers 8 log requests \\(at most 8\\)"):
        relay.ask(reader, "a", "j", [], 0, True, range(0, 2), CAROL)


def test_pushes_are_bounded():
    relay = LogRelay(Clock())
    for push, message in (
        (_push("r", b"x" * (64 << 10 | 1)), "data is 65537 bytes; at most 65536"),
        (nodes_pb2.PushLogsRequest(request_id="r" * 65), "request_id 'rrrr"),
        (nodes_pb2.PushLogsRequest(request_id="r", notice="n" * 301), "notice is 301 characters; at most 300"),
    ):
        with pytest.raises(RendezvousError, match=message) as refused:
            asyncio.run(relay.push("a", push))
        assert refused.value.code.value == "INVALID_ARGUMENT"


def test_the_failing_exits_tail_is_kept_in_its_jobfailed_event_and_an_old_event_reads_without_one():
    from meshgate.coordinator.rendezvous import JobFailed
    from meshgate.coordinator.store.codec import decode, encode

    failed = JobFailed("worker local_rank 0 (rank 1) exited 1", 5.0, "Traceback ...\nRuntimeError: x\n")
    assert decode(encode(failed), "test") == failed
    old = '{"at":5.0,"kind":"JobFailed","reason":"node lost"}'  # written before tails were kept
    assert decode(old, "test") == JobFailed("node lost", 5.0, "")


def test_a_push_of_a_rank_the_node_does_not_hold_or_was_not_asked_for_is_refused_naming_both():
    relay, written = LogRelay(Clock()), []

    async def write(chunk):
        written.append(chunk)

    async def scenario():
        whole = asyncio.ensure_future(relay.relay(_ask(), [("a", []), ("b", [])], write, 10, STATUS, ALICE))
        one = asyncio.ensure_future(relay.relay(_ask(rank=2), [("b", [2])], write, 10, STATUS, ALICE))
        await asyncio.sleep(0.05)
        (to_a,), (to_b, to_b_rank_2) = relay.take("a"), relay.take("b")
        for node, request_id, rank, held in (
            ("a", to_a.request_id, 7, "0-1"),  # rank 7 of a world of 4
            ("a", to_a.request_id, 2, "0-1"),  # b's rank
            ("b", to_b_rank_2.request_id, 3, "2"),  # b's own, but not asked for
        ):
            with pytest.raises(log_relay.RankNotHeld) as refused:
                await relay.push(node, _push(request_id, b"forged\n", rank=rank))
            assert refused.value.code.value == "PERMISSION_DENIED"
            assert f"node '{node}' pushed output of rank {rank} of job 'j', which it does not hold" in str(
                refused.value
            )
            assert f"(it was asked for ranks: {held})" in str(refused.value)
        assert not await relay.push("b", _push(to_b.request_id, b"b3\n", rank=3))
        for request in (to_a, to_b, to_b_rank_2):  # a done or notice names no rank: rank 0 is no claim
            node = "a" if request is to_a else "b"
            assert not await relay.push(node, nodes_pb2.PushLogsRequest(request_id=request.request_id, done=True))
        await asyncio.wait_for(asyncio.gather(whole, one), 5)

    asyncio.run(scenario())
    assert [(c.node_id, c.rank, c.data) for c in written] == [("b", 3, b"b3\n")]
