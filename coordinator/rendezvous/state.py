"""One job's rendezvous state: its data and what is derived from it. The decisions live
by concern (identity, register, liveness, generations) and how events change the
state in apply.py; they are bound here as methods, so a caller holds one object."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

from meshgate.coordinator.rendezvous import generations, identity, liveness, register
from meshgate.coordinator.rendezvous.apply import HANDLERS
from meshgate.coordinator.rendezvous.events import Event
from meshgate.coordinator.rendezvous.model import Assignment, Node, NodeState, RendezvousConfig, Token
from meshgate.coordinator.rendezvous.timeline import Timeline
from meshgate.plan import ParallelPlan, compress_ranks


@dataclass
class RendezvousState:
    config: RendezvousConfig
    opened_at: float = 0.0
    generation: int = 0
    nodes: dict[str, Node] = field(default_factory=dict)
    node_ids_by_rank: dict[int, str] = field(default_factory=dict)
    by_worker: dict[str, Assignment] = field(default_factory=dict)
    by_rank: dict[int, Assignment] = field(default_factory=dict)
    worker_seen: dict[str, float] = field(default_factory=dict)
    master: Optional[tuple[str, int]] = None
    tokens: dict[str, Token] = field(default_factory=dict)
    used_vouches: dict[str, str] = field(default_factory=dict)
    failed: str = ""
    failed_log_tail: str = ""  # the output that failing worker's agent reported with its exit
    lost_since: dict[str, float] = field(default_factory=dict)
    claimed_seen: bool = False
    # Generations restarted because a worker failed (GenerationBumped.worker_restart).
    worker_restarts: int = 0
    # (node_id, local_rank) of the current generation's workers that exited 0.
    succeeded_workers: set[tuple[str, int]] = field(default_factory=set)
    # No unpinned node rank below this is free. Node ranks are taken, never given back
    # (a spare takes over its lost node's number), so it only grows: kept by apply, so
    # finding a free rank costs O(1), not O(nodes), per join.
    free_node_rank_from: int = 0
    # Ranks held in the current generation (their Assignment.generation is it): the world's
    # count; the ranks kept for survivors of an earlier generation are not in it.
    registered_now: int = 0
    # What happened, in order (`meshgate job show --timeline`): folded from every event
    # applied, live and on replay, so a running job's is read without rereading its log.
    timeline: Timeline = field(default_factory=Timeline, repr=False, compare=False)
    # Liveness, not persisted: each node's NVLink domain as its agent discovered it ("":
    # unknown; the cluster that serves the job fills it, coordinator/hardware.py). Under
    # topology_policy "refuse" a TP or CP group may span nodes of one known domain.
    nvlink_domains: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    # ---- derived -------------------------------------------------------------------------

    @property
    def plan(self) -> ParallelPlan:
        return self.config.plan

    @property
    def world_size(self) -> int:
        return self.config.plan.world_size

    @property
    def complete(self) -> bool:
        return self.registered_now == self.world_size

    @property
    def succeeded(self) -> bool:
        """Every worker of the current generation exited 0 (never after a failure)."""
        return not self.failed and len(self.succeeded_workers) >= self.world_size

    @property
    def job_master(self) -> Optional[tuple[str, int]]:
        """The master every rank uses: the one node rank 0's agent offered (agents export
        it to their workers before they start), else the endpoint rank 0's Register named."""
        node_id = self.node_ids_by_rank.get(0)
        node = self.nodes.get(node_id) if node_id is not None else None
        if node is not None and node.state is NodeState.ACTIVE and node.master_offer is not None:
            return node.master_offer
        return self.master

    def missing_ranks(self) -> list[int]:
        """Ranks no worker holds in the current generation (kept ranks of survivors that have
        not registered again included)."""
        return [r for r in range(self.world_size) if getattr(self.by_rank.get(r), "generation", -1) != self.generation]

    def missing_by_node(self) -> dict[str, list[int]]:
        """Missing ranks grouped by the node expected to hold them (assigned layout)."""
        out: dict[str, list[int]] = {}
        slots = self.config.slots_per_node
        if self.claimed_seen:
            # The framework places claimed ranks; no node is expected to hold a given one.
            missing = self.missing_ranks()
            return {"unclaimed (claimed mode)": missing} if missing else {}
        for rank in self.missing_ranks():
            node_rank = rank // slots
            node_id = self.node_ids_by_rank.get(node_rank)
            label = node_id if node_id else f"node_rank {node_rank} (not joined)"
            out.setdefault(label, []).append(rank)
        return out

    def describe_missing(self, limit: int = 16) -> str:
        groups = self.missing_by_node()
        parts = [f"{node}: ranks {compress_ranks(ranks)}" for node, ranks in groups.items()]
        more = f"; and {len(parts) - limit} more nodes" if len(parts) > limit else ""
        total = sum(len(r) for r in groups.values())
        return f"{total} of {self.world_size} ranks missing: " + "; ".join(parts[:limit]) + more

    def launchers_missing(self, node_ids: Iterable[str]) -> tuple[str, ...]:
        """Of ``node_ids`` (the job's nodes, in node-rank order), those whose workers have
        not all registered while the job's first world has not formed; () once it has (a
        later generation's stragglers are the liveness checks' to judge)."""
        if self.generation or self.complete:
            return ()
        slots = self.config.slots_per_node
        return tuple(n for n in node_ids if n not in self.nodes or self.nodes[n].registered < slots)

    def finished_its_part(self, node: Node) -> bool:
        """Every worker of ``node``'s block exited 0 in the current generation."""
        return all((node.node_id, r) in self.succeeded_workers for r in range(self.config.slots_per_node))

    # ---- decisions (pure; raise RendezvousError), by concern -------------------------------

    # join and node identity (identity.py)
    check_job = identity.check_job
    decide_join = identity.decide_join
    decide_create_token = identity.decide_create_token
    decide_admit = identity.decide_admit
    decide_node_call = identity.decide_node_call
    note_instance = identity.note_instance
    touch_node = identity.touch_node
    # register and the worker calls after it (register.py)
    decide_register = register.decide_register
    check_await = register.check_await
    decide_heartbeat = register.decide_heartbeat
    touch = register.touch
    # liveness and spares (liveness.py)
    decide_lost = liveness.decide_lost
    decide_restarted = liveness.decide_restarted
    unheard_since = liveness.unheard_since
    awaiting_replacement = liveness.awaiting_replacement
    # generations and ends (generations.py)
    decide_worker_exit = generations.decide_worker_exit
    decide_worker_succeeded = generations.decide_worker_succeeded
    decide_leave = generations.decide_leave

    # ---- apply ---------------------------------------------------------------------------

    def apply(self, event: Event) -> None:
        HANDLERS[type(event)](self, event)
        self.timeline.add(event, self.complete, self.world_size)

    def apply_all(self, events: Iterable[Event]) -> None:
        for event in events:
            self.apply(event)
