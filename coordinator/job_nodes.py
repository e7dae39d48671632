"""The nodes the cluster gives running jobs (coordinator/cluster.py): a job's allocated
nodes admitted into its engine, a node an operator drains taken out of its job, and a
block whose node was lost, left or drained, with no spare of the job standing by, given an
idle node of the pool (cluster_state/replacement.py decides which).

The cluster's events (JobReplacementGiven, NodeDrained) are durable before the job's
engine hears of them, and every reconcile brings the engines level with the cluster's log
(a node given is admitted, a drained node leaves), so a coordinator that stopped in
between does the rest after its restart; the engine takes a node given for its block only
while the block still waits (rendezvous/identity.decide_admit).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from meshgate.coordinator.cluster_state.replacement import Vacancy, replaceable
from meshgate.coordinator.engine import Coordinator
from meshgate.coordinator.jobs import Caller, ClusterNode, Job
from meshgate.coordinator.rendezvous import AdmittedNode

if TYPE_CHECKING:
    from meshgate.coordinator.cluster import ClusterCoordinator

log = logging.getLogger("meshgate.coordinator")


class JobNodes:
    def __init__(self, cluster: "ClusterCoordinator") -> None:
        self.cluster = cluster

    async def admit(self, job: Job) -> None:
        """The job's nodes join its rendezvous with their cluster credentials: members at
        their node rank, spares at -1, nodes given from the pool at -1 naming the block
        they take."""
        engine = self.cluster.engines[job.spec.job_id]
        ranked = [(rank, node_id, "") for rank, node_id in enumerate(job.nodes)]
        ranked += [(-1, node_id, "") for node_id in job.spares]
        ranked += [(-1, node_id, lost_id) for node_id, lost_id, _ in job.replacements]
        admitted = []
        for node_rank, node_id, lost_id in ranked:
            n = self.cluster.state.nodes[node_id]
            admitted.append(
                AdmittedNode(
                    node_id,
                    node_rank,
                    n.hostname,
                    n.slots,
                    n.slot_kind,
                    n.credential_hash,
                    n.public_key.hex(),
                    replaces=lost_id,
                )
            )
        await engine.admit(admitted)

    def vacancies(self) -> list[Vacancy]:
        """Every running job's blocks that wait for a node, jobs in submission order."""
        out = []
        for job_id, engine in list(self.cluster.engines.items()):
            if replaceable(self.cluster.state.jobs.get(job_id)):
                out += waiting_blocks(engine)
        return out

    async def reconcile(self) -> None:
        """What running jobs' engines must hear of the nodes (drains), then their waiting
        blocks given nodes of the pool."""
        await self.finish_drains()
        await self.replace_lost()

    async def drain(self, node_id: str, reason: str, caller: Caller) -> ClusterNode:
        """An operator's drain (admission.decide_drain): cordoned, and out of its job, whose
        block goes to a spare or a node of the pool in a new generation."""
        await self.cluster.apply(self.cluster.state.decide_drain(node_id, reason, caller, self.cluster.clock()))
        log.warning("node %s drained by %s: %s", node_id, caller.describe(), reason)
        await self.cluster.reconcile()
        return self.cluster.state.nodes[node_id]

    async def finish_drains(self) -> None:
        """A drained node still counted in the job it was drained out of leaves it: its
        generation ends as for a node that left (rendezvous decide_leave). From the cluster's
        log, so a coordinator that stopped between the two does it after its restart."""
        for node in list(self.cluster.state.nodes.values()):
            engine = self.cluster.engines.get(node.drained_from) if node.drained_from else None
            in_job = engine.state.nodes.get(node.node_id) if engine is not None else None
            if in_job is None or not in_job.state.counted_in or engine.state.failed:  # type: ignore[union-attr]
                continue
            await engine.leave(node.drained_from, node.node_id, f"drained {node.cordon}")  # type: ignore[union-attr]

    async def replace_lost(self) -> None:
        """Give each waiting block a node of the pool where one fits; the node's agent
        learns of the job from its next idle heartbeat and joins it at the block's rank."""
        state = self.cluster.state
        given = state.decide_replacements(self.vacancies(), self.cluster.clock())
        await self.cluster.apply(given)
        for event in given:
            near = f" ({event.why})" if event.why else ""
            log.warning(
                "job %s: node %s from the pool takes the block of %s%s",
                event.job_id,
                event.node_id,
                event.lost_id,
                near,
            )
            if event.job_id in self.cluster.engines:
                await self.admit(state.jobs[event.job_id])

    def waiting_reason(self, job: Job) -> str:
        """Why a running job still waits for a node for a block ("" when none waits)."""
        engine = self.cluster.engines.get(job.spec.job_id)
        if engine is None or job.state.ended or job.declared:
            return ""
        timeout_s = engine.config.lost_node_timeout_s
        return self.cluster.state.waiting_reason(job, waiting_blocks(engine), timeout_s, self.cluster.clock())


def waiting_blocks(engine: Coordinator) -> list[Vacancy]:
    """The blocks of ``engine``'s job that wait for a node (rendezvous awaiting_replacement)."""
    state, job_id = engine.state, engine.config.job_id
    return [
        Vacancy(job_id, n.node_id, n.node_rank, state.lost_since[n.node_id], n.state.value)
        for n in state.awaiting_replacement()
    ]


__all__ = ["JobNodes"]
