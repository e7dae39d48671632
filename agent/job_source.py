"""Where the jobs this agent serves come from, and what follows each one's end: the config's
one declared job, or (a pool node) the jobs the coordinator assigns through heartbeats.

The agent chooses one source at its start, by the config (agent/daemon.py: the one place the
mode is read); its one loop over jobs asks the source for the next and tells it of each end.
A pool job's run says it is one (JobRun.pool): what differs for such a job while it runs is
the job's own business (agent/decide.py, agent/job_runner.py), not the agent's mode.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, Optional

from meshgate.agent.config import AgentConfig
from meshgate.agent.job_run import JobRun
from meshgate.agent.job_runner import Outcome
from meshgate.agent.sdnotify import notify
from meshgate.v1 import nodes_pb2

if TYPE_CHECKING:
    from meshgate.agent.daemon import Agent

log = logging.getLogger("meshgate.agent")


class DeclaredJob:
    """[agent] job: one job, the agent's first Join is its own; served once, then the agent
    exits (exit_when_done) or waits for SIGTERM."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.claimed = ""  # never idle: no job is ever given to it

    def first(self) -> Optional[JobRun]:
        """The job the agent's first Join is for (None: the cluster's)."""
        return JobRun(self.config.job)

    def announce(self) -> None:
        pass

    def ready_status(self, joined: nodes_pb2.JoinResponse) -> str:
        return f"node_rank {joined.node_rank} of job {self.config.job}"

    def offer(self, job_id: str) -> None:
        pass  # a heartbeat's answer is about the declared job: its run takes it

    def wake(self) -> None:
        pass

    async def next_job(self) -> Optional[JobRun]:
        return None  # the one job was the first

    async def job_over(self, agent: "Agent", run: JobRun, outcome: Outcome) -> Optional[int]:
        """The agent's exit status once it should exit now (undrained), else None."""
        log.info("workers finished: %s", "all exited 0" if outcome is Outcome.OK else "failed")
        if self.config.exit_when_done:
            await agent.leave("workers finished" if outcome is Outcome.OK else "workers failed")
            return 0 if outcome is Outcome.OK else 1
        await agent.stopping.wait()
        return None


class PoolAssignments:
    """A pool node: idle in the pool until an idle heartbeat's answer names a running job for
    it, serve that job, back to the pool; job after job, until SIGTERM."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.claimed = ""  # the job an idle heartbeat named, until it is over for this node
        self.assignments: "asyncio.Queue[str]" = asyncio.Queue()  # "" wakes the loop to stop

    def first(self) -> Optional[JobRun]:
        return None  # the first Join is the cluster's

    def announce(self) -> None:
        if not self.config.run_as:  # run_jobs_as_agent = true (config.py)
            log.warning(
                "INSECURE%s: run_jobs_as_agent = true: this agent runs the command of every job the "
                "coordinator gives this node as its own user%s, for whoever may submit jobs (admin or "
                "submitter role), and a job can read the node's credential and keys; set [agent] run_as "
                'to an unprivileged job user (SECURITY.md, "Jobs")',
                " AS ROOT" if os.geteuid() == 0 else "",
                " (root)" if os.geteuid() == 0 else "",
            )

    def ready_status(self, joined: nodes_pb2.JoinResponse) -> str:
        return f"node {self.config.node_id} joined the cluster, idle"

    def offer(self, job_id: str) -> None:
        """An idle heartbeat's answer names a running job: it is this node's."""
        if not self.claimed:
            log.info("assigned to job %s", job_id)
            self.claimed = job_id
            self.assignments.put_nowait(job_id)

    def wake(self) -> None:
        self.assignments.put_nowait("")

    async def next_job(self) -> Optional[JobRun]:
        """The next job given to this node, a fresh run of it; None once the agent stops."""
        job_id = await self.assignments.get()
        return JobRun(job_id, pool=True) if job_id else None

    async def job_over(self, agent: "Agent", run: JobRun, outcome: Outcome) -> Optional[int]:
        await agent.node.close_unit(f"job {run.job_id} is over")
        await agent.runner.remove_job_dir()
        log.info(
            "job %s is over for this node (%s); back to the pool",
            run.job_id,
            "workers exited 0" if outcome is Outcome.OK else run.failure or outcome.value,
        )
        agent.runner.end()
        if outcome is not Outcome.OK:  # while still claimed (listed live): never allocated before its result
            await agent.health.check(f"after job {run.job_id} failed")
        self.claimed = ""
        notify(f"STATUS=node {self.config.node_id} idle")
        return None


JobSource = DeclaredJob | PoolAssignments
