"""The node agent's decisions about the job it serves, pure: no I/O, no event loop, no clock.

What the agent learns about a job arrives as a typed signal (a heartbeat answer, an exit's
acknowledgement, a worker's exit, SIGTERM, a refused Join); ``decide`` turns it, with a view
of the job run, into the actions to take. The job run (agent/job_run.py) applies them and
keeps the phase; this module only says what follows from what:

- a new generation, or this spare's promotion, relaunches every worker of the node;
- a failure named by the coordinator, or (on a pool node) the job's end, ends the job here;
- a worker that fails stops the node's others (its world is broken) until the coordinator
  decides; every worker exited 0 ends the launch;
- once the job is over nothing of it is launched again, and the first reason to relaunch is
  the one that holds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Union

ENDED_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")


class JobPhase(enum.Enum):
    """Where one job run on this node stands."""

    FOLLOWING = "following"  # its workers run (or this spare waits): nothing asked of the node
    RELAUNCH = "relaunch"  # a new generation, or this spare promoted: relaunch every worker
    OVER = "over"  # the job failed or ended: nothing of it is launched again
    STOPPED = "stopped"  # SIGTERM


class Act(enum.Enum):
    NOTHING = "nothing"
    RELAUNCH = "relaunch"  # every worker of this node, into the coordinator's generation
    FAIL_JOB = "fail_job"  # the coordinator names the job's failure
    END_JOB = "end_job"  # the job is over (failed, cancelled, or succeeded elsewhere)
    STOP_OTHERS = "stop_others"  # a worker failed: stop the node's others, await the decision
    ALL_EXITED = "all_exited"  # every worker of the launch exited (reason: "ok" or "failed")
    STOP = "stop"  # SIGTERM


@dataclass(frozen=True)
class Action:
    act: Act
    reason: str = ""


NOTHING = Action(Act.NOTHING)


@dataclass(frozen=True)
class JobView:
    """What the decisions read of a job run."""

    job_id: str
    phase: JobPhase
    generation: int  # the coordinator's, as last heard
    launched_generation: int  # the one the running workers were launched into
    spare: bool
    pool: bool = False  # a pool node: it follows the job to its end, and hears of other jobs


# ---- the signals -----------------------------------------------------------------------------


@dataclass(frozen=True)
class HeartbeatAnswer:
    job_id: str  # the job the answer is about
    generation: int
    job_state: str = ""  # JobState's name, "" when unset
    job_failure: str = ""
    promoted: bool = False  # this node is ACTIVE in the job (a spare's promotion)
    node_rank: int = 0


@dataclass(frozen=True)
class HeartbeatRefused:
    """FAILED_PRECONDITION: the coordinator does not take this node's heartbeat as it is."""

    details: str


@dataclass(frozen=True)
class ExitAcknowledged:
    """The coordinator's answer to one reported exit."""

    generation: int
    job_failure: str = ""
    stopped_by_agent: bool = False


@dataclass(frozen=True)
class WorkerExited:
    local_rank: int
    code: int
    codes: tuple[Optional[int], ...]  # every worker's exit code so far (None: still running)
    pid: int = 0  # which process of that local rank


@dataclass(frozen=True)
class JobEnded:
    """The job ended while this node was away (a refused Join says so)."""

    reason: str


@dataclass(frozen=True)
class Stop:
    """SIGTERM."""


Signal = Union[HeartbeatAnswer, HeartbeatRefused, ExitAcknowledged, WorkerExited, JobEnded, Stop]


# ---- the decisions ---------------------------------------------------------------------------


def _heartbeat(view: JobView, answer: HeartbeatAnswer) -> list[Action]:
    actions = []
    about_this_job = not view.pool or (bool(view.job_id) and answer.job_id == view.job_id)
    if view.pool and about_this_job and answer.job_state in ENDED_STATES:
        failure = f": {answer.job_failure}" if answer.job_failure else ""
        actions.append(Action(Act.END_JOB, f"job {view.job_id} {answer.job_state}{failure}"))
    if about_this_job:
        if view.spare and answer.promoted:
            actions.append(Action(Act.RELAUNCH, f"promoted from spare to node_rank {answer.node_rank}"))
        elif answer.generation != view.generation and not view.spare:
            actions.append(Action(Act.RELAUNCH, f"generation {view.generation} -> {answer.generation}"))
    if answer.job_failure:
        actions.append(Action(Act.FAIL_JOB, answer.job_failure))
    return actions


def _refused(view: JobView, refused: HeartbeatRefused) -> list[Action]:
    return [Action(Act.RELAUNCH, f"coordinator: {refused.details}; rejoining")]


def _acknowledged(view: JobView, ack: ExitAcknowledged) -> list[Action]:
    if ack.job_failure:
        return [Action(Act.FAIL_JOB, ack.job_failure)]
    if ack.generation != view.launched_generation and not ack.stopped_by_agent:
        return [Action(Act.RELAUNCH, f"generation {view.launched_generation} -> {ack.generation} (a worker failed)")]
    return []


def _exited(view: JobView, exited: WorkerExited) -> list[Action]:
    # A worker that fails is never restarted alone: its peers' world has formed and could not
    # take it back. The coordinator ends the generation for the whole job, or fails it.
    if exited.code != 0:
        return [Action(Act.STOP_OTHERS, f"worker local {exited.local_rank} exited {exited.code}")]
    if all(code is not None for code in exited.codes):
        return [Action(Act.ALL_EXITED, "ok" if all(code == 0 for code in exited.codes) else "failed")]
    return []


HANDLERS = {
    HeartbeatAnswer: _heartbeat,
    HeartbeatRefused: _refused,
    ExitAcknowledged: _acknowledged,
    WorkerExited: _exited,
    JobEnded: lambda view, ended: [Action(Act.END_JOB, ended.reason)],
    Stop: lambda view, stop: [Action(Act.STOP)],
}


def decide(view: JobView, signal: Signal) -> tuple[Action, ...]:
    """The actions a signal asks of the job run, in order; none that its phase has passed
    (an over job relaunches nothing, a pending relaunch keeps its first reason)."""
    actions = []
    phase = view.phase
    for action in HANDLERS[type(signal)](view, signal):
        following = phase is JobPhase.FOLLOWING
        if action.act is Act.RELAUNCH and not following:
            continue
        if action.act in (Act.FAIL_JOB, Act.END_JOB) and phase in (JobPhase.OVER, JobPhase.STOPPED):
            continue
        phase = next_phase(phase, action)
        actions.append(action)
    return tuple(actions)


def next_phase(phase: JobPhase, action: Action) -> JobPhase:
    if phase is JobPhase.STOPPED or action.act is Act.STOP:
        return JobPhase.STOPPED
    if action.act in (Act.FAIL_JOB, Act.END_JOB):
        return JobPhase.OVER
    if action.act is Act.RELAUNCH and phase is JobPhase.FOLLOWING:
        return JobPhase.RELAUNCH
    return phase
