"""The agent's decisions (agent/decide.py), table-driven: a view of the job run and a signal
in, actions out. Pure: no processes, no sockets, no event loop."""

from __future__ import annotations

import pytest

from meshgate.agent import decide as d
from meshgate.agent.decide import (
    Act,
    Action,
    ExitAcknowledged,
    HeartbeatAnswer,
    HeartbeatRefused,
    JobEnded,
    JobPhase,
    JobView,
    Stop,
    WorkerExited,
    decide,
)

F, R, OV, S = JobPhase.FOLLOWING, JobPhase.RELAUNCH, JobPhase.OVER, JobPhase.STOPPED


def view(phase=F, generation=1, launched=1, spare=False, pool=False, job="j"):
    return JobView(job, phase, generation, launched, spare, pool=pool)


CASES = [
    # -- heartbeat answers
    ("same generation: nothing", view(), HeartbeatAnswer("j", 1), ()),
    (
        "a new generation relaunches",
        view(),
        HeartbeatAnswer("j", 2),
        (Action(Act.RELAUNCH, "generation 1 -> 2"),),
    ),
    ("a spare ignores the generation", view(spare=True), HeartbeatAnswer("j", 2), ()),
    (
        "a spare's promotion relaunches",
        view(spare=True),
        HeartbeatAnswer("j", 2, promoted=True, node_rank=3),
        (Action(Act.RELAUNCH, "promoted from spare to node_rank 3"),),
    ),
    ("a member's ACTIVE state is no promotion", view(), HeartbeatAnswer("j", 1, promoted=True), ()),
    (
        "the first reason to relaunch holds",
        view(phase=R),
        HeartbeatAnswer("j", 3),
        (),
    ),
    ("an over job relaunches nothing", view(phase=OV), HeartbeatAnswer("j", 3), ()),
    (
        "a failure named fails the job",
        view(),
        HeartbeatAnswer("j", 1, job_failure="rank 3 broke"),
        (Action(Act.FAIL_JOB, "rank 3 broke"),),
    ),
    (
        "a new generation and a failure: relaunch asked, then the job is over",
        view(),
        HeartbeatAnswer("j", 2, job_failure="no restarts left"),
        (Action(Act.RELAUNCH, "generation 1 -> 2"), Action(Act.FAIL_JOB, "no restarts left")),
    ),
    ("a failure once over: nothing", view(phase=OV), HeartbeatAnswer("j", 1, job_failure="x"), ()),
    # -- pool nodes (jobs mode)
    ("pool: another job's generation is not ours", view(pool=True), HeartbeatAnswer("k", 5), ()),
    ("pool: idle, nothing to follow", view(pool=True, job=""), HeartbeatAnswer("k", 5, job_state="RUNNING"), ()),
    (
        "pool: idle, a failure still applies (as the heartbeat loop always did)",
        view(pool=True, job=""),
        HeartbeatAnswer("", 0, job_failure="gone"),
        (Action(Act.FAIL_JOB, "gone"),),
    ),
    (
        "pool: the job served succeeded elsewhere",
        view(pool=True),
        HeartbeatAnswer("j", 1, job_state="SUCCEEDED"),
        (Action(Act.END_JOB, "job j SUCCEEDED"),),
    ),
    (
        "pool: the job failed, its failure in the reason; the failure is not said twice",
        view(pool=True),
        HeartbeatAnswer("j", 1, job_state="FAILED", job_failure="rank 0 broke"),
        (Action(Act.END_JOB, "job j FAILED: rank 0 broke"),),
    ),
    ("pool: another job's end is not ours", view(pool=True), HeartbeatAnswer("k", 1, job_state="CANCELLED"), ()),
    (
        "pool: the job served moved on a generation",
        view(pool=True),
        HeartbeatAnswer("j", 2, job_state="RUNNING"),
        (Action(Act.RELAUNCH, "generation 1 -> 2"),),
    ),
    # -- a refused heartbeat
    (
        "FAILED_PRECONDITION rejoins",
        view(),
        HeartbeatRefused("unknown instance"),
        (Action(Act.RELAUNCH, "coordinator: unknown instance; rejoining"),),
    ),
    ("a refusal once over: nothing", view(phase=OV), HeartbeatRefused("x"), ()),
    # -- exit acknowledgements
    ("an exit in the launched generation: nothing", view(), ExitAcknowledged(1), ()),
    (
        "a worker failed: the coordinator's new generation relaunches",
        view(),
        ExitAcknowledged(2),
        (Action(Act.RELAUNCH, "generation 1 -> 2 (a worker failed)"),),
    ),
    (
        "compared with the launched generation, not the last heard",
        view(generation=2, launched=1),
        ExitAcknowledged(2),
        (Action(Act.RELAUNCH, "generation 1 -> 2 (a worker failed)"),),
    ),
    ("an exit the agent caused never relaunches", view(), ExitAcknowledged(2, stopped_by_agent=True), ()),
    (
        "the failure wins over the generation",
        view(),
        ExitAcknowledged(2, job_failure="restarts spent"),
        (Action(Act.FAIL_JOB, "restarts spent"),),
    ),
    # -- worker exits
    ("one of two exited 0", view(), WorkerExited(0, 0, (0, None)), ()),
    ("all exited 0", view(), WorkerExited(1, 0, (0, 0)), (Action(Act.ALL_EXITED, "ok"),)),
    (
        "a failure stops the others",
        view(),
        WorkerExited(1, 3, (None, 3)),
        (Action(Act.STOP_OTHERS, "worker local 1 exited 3"),),
    ),
    (
        "the last to exit failing still stops (nothing left to stop)",
        view(),
        WorkerExited(1, 3, (0, 3)),
        (Action(Act.STOP_OTHERS, "worker local 1 exited 3"),),
    ),
    # -- the rest
    ("a refused Join ends the job", view(), JobEnded("job j CANCELLED"), (Action(Act.END_JOB, "job j CANCELLED"),)),
    ("SIGTERM", view(), Stop(), (Action(Act.STOP),)),
    ("SIGTERM once over", view(phase=OV), Stop(), (Action(Act.STOP),)),
]


@pytest.mark.parametrize("name, seen, signal, wanted", CASES, ids=[c[0] for c in CASES])
def test_decide(name, seen, signal, wanted):
    assert decide(seen, signal) == wanted


def test_every_signal_has_exactly_one_handler():
    assert set(d.HANDLERS) == set(d.Signal.__args__)


@pytest.mark.parametrize(
    "phase, act, after",
    [
        (F, Act.RELAUNCH, R),
        (R, Act.RELAUNCH, R),
        (F, Act.FAIL_JOB, OV),
        (R, Act.END_JOB, OV),
        (OV, Act.RELAUNCH, OV),
        (OV, Act.STOP, S),
        (S, Act.RELAUNCH, S),
        (S, Act.END_JOB, S),
        (F, Act.STOP_OTHERS, F),
        (F, Act.ALL_EXITED, F),
    ],
)
def test_the_phase_moves_one_way(phase, act, after):
    assert d.next_phase(phase, Action(act)) is after
