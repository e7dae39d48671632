"""Which nodes may take a job (issue #30): an operator's cordon, the quarantine of a repeat
offender, a failing health check. Pure decisions, table-tested; the agent's check verdict."""

from __future__ import annotations

import asyncio
import sys

import pytest

from meshgate.agent.health import HealthCheck, HealthCheckConfig, HealthConfigError, judge
from meshgate.coordinator.cluster_state.admission import (
    QuarantinePolicy,
    decide_returned,
    exit_blames_node,
    hold,
    uncordon_waits,
)
from meshgate.coordinator.jobs import Caller, ClusterNode, ClusterState, PoolState
from meshgate.coordinator.rendezvous import Code, RendezvousError
from meshgate.v1.nodes_pb2 import NodeHealth

ALICE = Caller("admin:alice", admin=True)


def cluster(after: int = 3, window_s: float = 3600.0, nodes: tuple[str, ...] = ("n0", "n1")) -> ClusterState:
    state = ClusterState(quarantine=QuarantinePolicy(after, window_s))
    for node_id in nodes:
        state.nodes[node_id] = ClusterNode(node_id, node_id, 2, "cpu", {}, "h", bytes(32), 0.0, 100.0)
    return state


def test_a_cordoned_node_is_never_idle_and_its_cordon_is_a_replayable_event():
    state = cluster()
    events = state.decide_cordon("n0", "  bad DIMM  ", ALICE, 100.0)
    state.apply_all(events)
    assert [n.node_id for n in state.idle_nodes(100.0)] == ["n1"]
    assert state.pool_state(state.nodes["n0"], 100.0) is PoolState.CORDONED
    assert hold(state.nodes["n0"]) == (PoolState.CORDONED, "by admin:alice: bad DIMM")
    replayed = cluster()  # a restarted coordinator folds the same log
    replayed.apply_all(events)
    assert replayed.nodes["n0"].cordon == "by admin:alice: bad DIMM"
    state.apply_all(state.decide_uncordon("n0", ALICE, 101.0))
    assert [n.node_id for n in state.idle_nodes(101.0)] == ["n0", "n1"]
    assert state.decide_uncordon("n0", ALICE, 102.0) == ()  # nothing holds it: nothing to log


@pytest.mark.parametrize(
    "node_id, reason, code, named",
    [
        ("ghost", "x", Code.NOT_FOUND, "'ghost'"),
        ("n0", "   ", Code.INVALID_ARGUMENT, "reason is required"),
        ("n0", "x" * 201, Code.INVALID_ARGUMENT, "at most 200"),
        ("n0", "two\nlines", Code.INVALID_ARGUMENT, "one line"),
        ("bad id!", "x", Code.INVALID_ARGUMENT, "node_id"),
    ],
)
def test_a_cordon_refuses_bad_input_naming_it(node_id, reason, code, named):
    with pytest.raises(RendezvousError) as refused:
        cluster().decide_cordon(node_id, reason, ALICE, 1.0)
    assert refused.value.code is code and named in refused.value.message


@pytest.mark.parametrize(
    "after, window_s, failures_at, quarantined",
    [
        (3, 3600.0, (10.0, 20.0), False),  # two of three
        (3, 3600.0, (10.0, 20.0, 30.0), True),  # the third within the window
        (3, 15.0, (10.0, 20.0, 30.0), False),  # the first fell out of the window
        (1, 3600.0, (10.0,), True),
        (0, 3600.0, (1.0, 2.0, 3.0, 4.0), False),  # 0: never
    ],
)
def test_the_kth_failure_within_the_window_quarantines(after, window_s, failures_at, quarantined):
    state = cluster(after, window_s)
    for at in failures_at:
        state.apply_all(state.decide_failure("n0", f"worker exited 1 at {at}", at))
    node = state.nodes["n0"]
    assert bool(node.quarantine) is quarantined
    assert (state.pool_state(node, failures_at[-1]) is PoolState.QUARANTINED) is quarantined
    if quarantined:
        assert f"quarantine_after = {after}" in node.quarantine and "worker exited 1" in node.quarantine


def test_a_quarantine_goes_by_uncordon_or_a_passing_check_and_the_count_restarts():
    state = cluster(after=2)
    for at in (1.0, 2.0):
        state.apply_all(state.decide_failure("n0", "lost", at))
    assert state.nodes["n0"].quarantine
    state.apply_all(state.decide_uncordon("n0", ALICE, 3.0))
    assert not state.nodes["n0"].quarantine and state.nodes["n0"].failures == ()
    for at in (4.0, 5.0):
        state.apply_all(state.decide_failure("n0", "lost", at))
    state.apply_all(state.decide_health(state.nodes["n0"], True, "ok", 6.0))
    assert not state.nodes["n0"].quarantine and state.pool_state(state.nodes["n0"], 6.0) is PoolState.IDLE


def test_a_failing_check_holds_the_node_and_counts_once_until_it_passes():
    state = cluster()
    node = state.nodes["n0"]
    for at in (1.0, 2.0, 3.0):  # every idle heartbeat carries the same failing result
        state.apply_all(state.decide_health(node, False, "disk full", at))
        state.note_health("n0", False, "disk full", ("i1", 1))
    assert len(node.failures) == 1 and state.pool_state(node, 3.0) is PoolState.UNHEALTHY
    assert [n.node_id for n in state.idle_nodes(3.0)] == ["n1"]
    state.note_health("n0", True, "ok", ("i1", 2))
    assert state.pool_state(node, 4.0) is PoolState.IDLE


def passing(seq: int, asked: bool) -> NodeHealth:
    return NodeHealth(passed=True, summary="ok", seq=seq, asked=asked)


def test_an_uncordon_of_a_checked_node_returns_it_only_on_a_passing_check_begun_after_it_was_asked():
    state = cluster()
    node = state.nodes["n0"]
    state.note_health("n0", True, "ok", ("i1", 4))  # its agent runs a check: the 4th passed
    state.apply_all(state.decide_cordon("n0", "bad DIMM", ALICE, 10.0))
    events = state.decide_uncordon("n0", ALICE, 11.0)
    assert events and uncordon_waits(node)
    state.note_uncordon_asked("n0", ALICE, 11.0)  # the pool does this instead of applying them
    assert state.pool_state(node, 11.0) is PoolState.CORDONED
    # the report already seen, and a check begun before the agent heard the ask: not answers
    assert decide_returned(node, passing(4, False), ("i1", 4), 12.0) == ()
    assert decide_returned(node, passing(5, False), ("i1", 5), 12.0) == ()
    assert decide_returned(node, NodeHealth(passed=False, summary="x", seq=6, asked=True), ("i1", 6), 12.0) == ()
    (returned,) = decide_returned(node, passing(7, True), ("i1", 7), 13.0)
    assert (returned.node_id, returned.by) == ("n0", "admin:alice")
    state.apply_all((returned,))
    assert node.uncordon_asked is None and not node.cordon and state.pool_state(node, 13.0) is PoolState.IDLE
    # an agent of a release that numbers no checks (seq 0) cannot be asked: its next pass is taken
    state.apply_all(state.decide_cordon("n0", "again", ALICE, 20.0))
    state.note_uncordon_asked("n0", ALICE, 21.0)
    assert decide_returned(node, passing(0, False), ("i0", 0), 22.0)
    # cordoned again while an uncordon waited: the operator's latest word holds
    state.apply_all(state.decide_cordon("n0", "third", ALICE, 23.0))
    assert node.uncordon_asked is None


def test_an_uncordon_of_a_node_that_runs_no_check_is_at_once():
    state = cluster()
    node = state.nodes["n0"]
    state.note_health("n0", False, "disk full", ("i1", 1))
    state.note_no_health("n0")  # its agent restarted without a check: nothing to wait for, nothing holds
    assert not uncordon_waits(node) and state.pool_state(node, 1.0) is PoolState.IDLE


async def test_the_agent_numbers_its_checks_as_they_begin_and_marks_the_one_begun_after_an_ask(tmp_path):
    gate = tmp_path / "gate"
    script = 'while [ ! -e "$0" ]; do sleep 0.02; done; echo ok'
    check = HealthCheck(HealthCheckConfig(("/bin/sh", "-c", script, str(gate)), timeout_s=10, interval_s=0))
    gate.touch()
    first = await check.check("before the first Join")
    assert (first.passed, first.seq, first.asked) == (True, 1, False)
    gate.unlink()
    running = asyncio.create_task(check.check("periodic"))  # begun before the ask ...
    await asyncio.sleep(0.1)
    check.ask()  # ... heard while it runs
    gate.touch()
    assert ((await running).seq, running.result().asked) == (2, False)
    stopping = asyncio.Event()
    idle = asyncio.create_task(check.while_idle(stopping, lambda: True))  # interval 0: only when asked
    for _ in range(100):
        if check.latest.seq == 3:
            break
        await asyncio.sleep(0.02)
    assert (check.latest.seq, check.latest.asked) == (3, True)
    stopping.set()
    await idle


def test_a_held_node_that_serves_a_job_stays_serving():
    state = cluster()
    state.nodes["n0"].job_id, state.nodes["n0"].cordon = "j", "by x: y"
    assert state.pool_state(state.nodes["n0"], 1.0) is PoolState.SERVING


@pytest.mark.parametrize(
    "exit_code, stopped, restarts, failure, blamed",
    [
        (-11, False, (0, 1), ("", ""), "crashed (SIGSEGV) and restarted its job"),
        (135, False, (0, 1), ("", ""), "crashed (SIGBUS) and restarted its job"),  # a shell's 128 + 7
        (
            -7,
            False,
            (2, 2),
            ("", "worker local_rank 0 (rank 0) on node 'n0' exited -7 in generation 2; x"),
            "crashed (SIGBUS) and failed its job",
        ),
        (-11, False, (0, 0), ("", ""), ""),  # a peer was lost: the loss ended the generation
        (-11, False, (0, 0), ("", "worker local_rank 0 (rank 4) on node 'n1' exited 1 in generation 0"), ""),
        (0, False, (0, 0), ("", ""), ""),
        (-11, True, (0, 1), ("", ""), ""),  # its agent stopped it
        # the job's own failures never count against the node: an exception, an abort, the OOM killer
        (1, False, (0, 1), ("", ""), ""),
        (3, False, (2, 2), ("", "worker local_rank 0 (rank 0) on node 'n0' exited 3 in generation 2; x"), ""),
        (-6, False, (0, 1), ("", ""), ""),
        (-9, False, (0, 1), ("", ""), ""),
        (137, False, (0, 1), ("", ""), ""),
    ],
)
def test_an_exit_blames_its_node_only_when_a_crash_restarted_or_failed_the_job(
    exit_code, stopped, restarts, failure, blamed
):
    why = exit_blames_node("n0", exit_code, stopped, *restarts, *failure)
    assert (blamed in why) if blamed else why == ""


@pytest.mark.parametrize(
    "exit_code, output, timed_out, error, on_error, passed, said",
    [
        (0, b"ok\n", False, "", "fail", True, "ok"),
        (1, b"probe\ndisk write failed\n", False, "", "fail", False, "exit 1: probe | disk write failed"),
        (-9, b"", False, "", "fail", False, "killed by signal 9"),
        (None, b"", True, "", "fail", False, "ran past timeout_s=5"),
        (None, b"", False, "/x: No such file", "fail", False, "could not run: /x: No such file; fails closed"),
        (None, b"", False, "/x: No such file", "pass", True, 'passes by on_error = "pass"'),
        (1, b"y" * 5000, False, "", "fail", False, "exit 1: ..."),
    ],
)
def test_the_agent_judges_its_check(exit_code, output, timed_out, error, on_error, passed, said):
    result = judge(exit_code, output, timed_out, error, on_error, 5.0)
    assert result.passed is passed and said in result.summary and len(result.summary) <= 512


@pytest.mark.parametrize(
    "table, named",
    [
        ({}, "command"),
        ({"command": ["c"], "service": "/run/nvhcd.sock"}, "not both"),
        ({"service": "nvhcd.sock"}, "absolute path of a Unix socket"),
        ({"command": ["c"], "args": ["--gpu"]}, "args"),
        ({"command": "check.sh"}, "command"),
        ({"command": ["c"], "timeout_s": 0}, "timeout_s"),
        ({"command": ["c"], "on_error": "ignore"}, "on_error"),
        ({"command": ["c"], "every": 1}, "unknown"),
        ("check.sh", "must be a table"),
    ],
)
def test_a_bad_health_check_config_is_named(table, named):
    with pytest.raises(HealthConfigError, match=named):
        HealthCheckConfig.from_mapping(table)


def test_a_real_check_is_run_bounded_killed_on_timeout_and_an_unrunnable_one_fails_closed(tmp_path):
    flag = tmp_path / "broken"
    script = 'if [ -e "$0" ]; then echo "disk probe: $0 says broken"; exit 1; fi; echo fine'
    check = HealthCheck(HealthCheckConfig(("/bin/sh", "-c", script, str(flag)), timeout_s=10))
    assert asyncio.run(check.check("test")).passed
    flag.touch()
    failed = asyncio.run(check.check("test"))
    assert not failed.passed and "says broken" in failed.summary and check.report() is failed
    slow = HealthCheck(HealthCheckConfig((sys.executable, "-c", "import time; time.sleep(30)"), timeout_s=0.5))
    assert "ran past timeout_s=0.5" in asyncio.run(slow.check("test")).summary
    missing = HealthCheck(HealthCheckConfig((str(tmp_path / "no-such-check"),)))
    assert not asyncio.run(missing.check("test")).passed
    assert HealthCheck(None).report() is None


class FakeNvhcd:
    """A real gRPC node health service on a Unix socket, speaking nvhcd's proto: it answers
    what the test sets (``answer``), after ``delay_s``, and keeps the args it was asked with."""

    def __init__(self) -> None:
        from meshgate.v1 import nvhcd_pb2

        self.answer = nvhcd_pb2.HealthCheckResponse(success=True, exit_code=0, output='{"gpus": "ok"}')
        self.delay_s = 0.0
        self.asked: list[list[str]] = []

    async def RunHealthCheck(self, request, context):
        self.asked.append(list(request.args))
        await asyncio.sleep(self.delay_s)
        return self.answer


def test_a_node_health_service_speaking_nvhcd_is_asked_and_its_answer_judged(tmp_path):
    import grpc

    from meshgate.v1 import nvhcd_pb2, nvhcd_pb2_grpc

    async def scenario():
        socket_path = str(tmp_path / "nvhcd.sock")
        service = FakeNvhcd()
        server = grpc.aio.server()
        nvhcd_pb2_grpc.add_HealthCheckServiceServicer_to_server(service, server)
        server.add_insecure_port(f"unix:{socket_path}")
        await server.start()
        try:
            config = HealthCheckConfig.from_mapping(
                {"service": f"unix:{socket_path}", "args": ["--level", "1"], "timeout_s": 2}
            )
            check = HealthCheck(config)
            assert (await check.check("test")).passed and service.asked == [["--level", "1"]]
            service.answer = nvhcd_pb2.HealthCheckResponse(success=False, exit_code=3, output='{"gpu 2": "xid 79"}')
            failed = await check.check("test")
            assert not failed.passed and failed.summary == 'exit 3: {"gpu 2": "xid 79"}'
            service.answer = nvhcd_pb2.HealthCheckResponse(
                success=False, exit_code=-1, error="no check script configured"
            )
            unrunnable = await check.check("test")
            assert not unrunnable.passed and "could not run" in unrunnable.summary
            assert "no check script configured" in unrunnable.summary and "fails closed" in unrunnable.summary
            service.answer, service.delay_s = nvhcd_pb2.HealthCheckResponse(success=True), 5.0
            assert "ran past timeout_s=2" in (await check.check("test")).summary
        finally:
            await server.stop(None)
        gone = await HealthCheck(HealthCheckConfig(service=socket_path, on_error="pass")).check("test")
        assert gone.passed and "UNAVAILABLE" in gone.summary and 'passes by on_error = "pass"' in gone.summary

    asyncio.run(scenario())


def test_the_shipped_cpu_check_passes_on_a_writable_disk_and_fails_naming_an_unwritable_one(tmp_path):
    script = str(__import__("pathlib").Path(__file__).parents[1] / "examples" / "health" / "cpu_check.py")
    good = HealthCheck(HealthCheckConfig((sys.executable, script, "--dir", str(tmp_path), "--procs", "0")))
    assert asyncio.run(good.check("test")).passed
    bad = HealthCheck(HealthCheckConfig((sys.executable, script, "--dir", str(tmp_path / "gone"), "--procs", "0")))
    result = asyncio.run(bad.check("test"))
    assert not result.passed and "disk probe" in result.summary and "gone" in result.summary


async def test_a_loss_found_while_a_survivors_exit_waits_on_suspects_counts_against_the_lost_node_once(tmp_path):
    """node-b dies; node-a's worker exits 1 (its collective broke). The engine holds the exit
    until node-b is declared lost (engine.hold_for_suspects): that loss is a failure of
    node-b, counted once, though the cluster's own sweep never saw it; node-a is not blamed."""
    import time

    from meshgate.attestation import secret_hash
    from meshgate.coordinator.cluster import cluster_of_engine
    from meshgate.coordinator.engine import Coordinator
    from meshgate.coordinator.jobspec import JobSpec
    from meshgate.coordinator.keys import KeyRing
    from meshgate.coordinator.rendezvous import AdmittedNode, RegisterInput, RendezvousConfig
    from meshgate.coordinator.store import MemoryStore
    from meshgate.plan import ParallelPlan
    from meshgate.v1 import nodes_pb2

    plan = ParallelPlan(dp_shard=4)
    config = RendezvousConfig(job_id="held", plan=plan, slots_per_node=2, lost_node_timeout_s=30.0)
    engine = Coordinator(
        config, MemoryStore(), KeyRing(tmp_path / "keys", job_id="held"), attestation_ttl_s=60, heartbeat_timeout_s=2.0
    )
    await engine.admit(
        [
            AdmittedNode(n, rank, n, 2, "cpu", secret_hash(f"cred-{n}".encode()), f"{rank:02x}" * 32)
            for rank, n in enumerate(("node-a", "node-b"))
        ]
    )
    for rank in range(4):
        node = ("node-a", "node-b")[rank // 2]
        await engine.register(RegisterInput("held", f"{node}/{rank % 2}", b"n" * 16, node, rank % 2, None))
    cluster = cluster_of_engine(engine, JobSpec.build(job_id="held", plan=plan, num_nodes=2, command=("x",)))
    engine.state.nodes["node-a"].last_seen = time.time()
    engine.state.nodes["node-b"].last_seen = time.time() - 1.9  # silent since: its loss is declared in the hold
    request = nodes_pb2.WorkerExitReport(
        job_id="held", node_id="node-a", local_rank=0, exit_code=1, generation=0, node_credential=b"cred-node-a"
    )
    generation, failure = await cluster.pool.blame_exit(engine, request, "held")
    assert (generation, failure) == (1, "")
    (counted,) = cluster.state.nodes["node-b"].failures
    assert counted[1].startswith("lost from job held (no heartbeat for ")
    assert cluster.state.nodes["node-a"].failures == ()
    await engine.sweep_lost()  # the cluster's next sweep finds nothing new to blame
    await cluster.pool.blame_lost("held", engine.take_losses())
    assert len(cluster.state.nodes["node-b"].failures) == 1
