"""One job on this node, made fresh for each job (nothing of the last one to reset): the only
writer of the job's state on this node.

What the agent learns about the job (heartbeat answers, exit acknowledgements, worker exits,
SIGTERM) is a typed signal (agent/decide.py) put on the run's one queue; the agent's job loop
takes them off in order, and ``take`` asks decide() what each means and applies it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

from meshgate import logs
from meshgate.agent.decide import Act, Action, HeartbeatAnswer, JobEnded, JobPhase, JobView, Signal, decide, next_phase
from meshgate.agent.launcher import JobRunDir
from meshgate.v1 import nodes_pb2

log = logging.getLogger("meshgate.agent")


class JobRun:
    def __init__(self, job_id: str, pool: bool = False) -> None:
        self.job_id = job_id
        self.pool = pool  # a pool node: it follows the job to its end (agent/decide.py)
        self.phase = JobPhase.FOLLOWING
        self.generation = 0  # the coordinator's, as last heard
        self.launched_generation = 0  # the generation the running workers were launched into
        self.over = False  # the job failed or ended: its workers stop, nothing of it launches again
        self.failure = ""  # why
        self.ended_as = ""  # the job's end state as the coordinator answered it ("SUCCEEDED" ...), once over
        self.relaunch_reason = ""
        self.spare = False
        # The last Join's answer, once its workers may start (a spare's at once): whoami tells
        # torchrun's handler its place from it.
        self.joined_reply: Optional[nodes_pb2.JoinResponse] = None
        self.slots = 0  # workers per node in the generation launched (their local ranks: 0 .. slots - 1)
        self.run_dir: Optional[JobRunDir] = None  # the job's directory on this node, once made
        # The job has a command: the agent starts its workers and knows their exits (an
        # "exited" line on the vouch socket is refused for it).
        self.starts_workers = False
        self.cannot_start = ""  # why this launch's command could not start here ("" when it did)
        self.signals: "asyncio.Queue[Signal]" = asyncio.Queue()

    def view(self) -> JobView:
        return JobView(self.job_id, self.phase, self.generation, self.launched_generation, self.spare, pool=self.pool)

    def post(self, signal: Signal) -> None:
        self.signals.put_nowait(signal)

    def take(self, signal: Signal) -> tuple[Action, ...]:
        """What the job makes of one signal (agent/decide.py), applied in order."""
        actions = decide(self.view(), signal)
        for action in actions:
            if action.act is Act.RELAUNCH:
                log.warning("relaunch: %s", action.reason)
                self.relaunch_reason = action.reason
            elif action.act is Act.FAIL_JOB and not logs.cancelled(action.reason):
                log.error("the job failed: %s", action.reason)  # a cancel is over at INFO only
            if action.act in (Act.FAIL_JOB, Act.END_JOB):
                log.info("the job is over: %s", action.reason)
                self.over, self.failure = True, action.reason
                if action.act is Act.END_JOB and isinstance(signal, HeartbeatAnswer):
                    self.ended_as = signal.job_state
            self.phase = next_phase(self.phase, action)
        if isinstance(signal, HeartbeatAnswer):
            self.generation = signal.generation  # the coordinator's, whatever it decided
        return actions

    def end(self, reason: str) -> None:
        """The job is over for this node (failed, cancelled, or succeeded elsewhere): its
        workers stop and nothing of it is launched again."""
        self.take(JobEnded(reason))

    async def next(self, timeout: Optional[float] = None) -> Optional[Signal]:
        """The next signal, not yet taken (None after ``timeout`` without one)."""
        try:
            return await asyncio.wait_for(self.signals.get(), timeout)
        except asyncio.TimeoutError:
            return None

    async def until_phase_moves(self, timeout: Optional[float] = None) -> JobPhase:
        """Take signals until the phase leaves FOLLOWING (or ``timeout`` runs out)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self.phase is JobPhase.FOLLOWING:
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                break
            signal = await self.next(left)
            if signal is not None:
                self.take(signal)
        return self.phase

    def relaunching(self) -> None:
        """The relaunch asked is under way: the run follows the job again."""
        if self.phase is JobPhase.RELAUNCH:
            self.phase = JobPhase.FOLLOWING

    def joined(self, joined: nodes_pb2.JoinResponse) -> None:
        self.generation = joined.generation
        # whoami shows a spare's place now, a member's once its workers may start.
        self.joined_reply = joined if self.job_id and joined.spare else None
        self.spare = joined.spare
