"""Register: a worker takes its rank. Assigned mode derives it from the node's block;
claimed mode takes the framework's claim, vouched for by the node's agent and held to
the topology policy. Also the worker calls that follow (await, heartbeat). Pure."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping, Optional

from meshgate.attestation import VouchRefused, verify_vouch, vouch_claims
from meshgate.coordinator.rendezvous.apply import renew
from meshgate.coordinator.rendezvous.errors import Code, RendezvousError, check_id
from meshgate.coordinator.rendezvous.events import Event, MasterChosen, NodeJoined, RankAssigned
from meshgate.coordinator.rendezvous.model import MAX_NONCE, MIN_NONCE, Assignment, Node, RankMode, RegisterInput
from meshgate.plan import compress_ranks

if TYPE_CHECKING:
    from meshgate.coordinator.rendezvous.state import RendezvousState


@dataclass(frozen=True)
class RegisterDecision:
    assignment: Assignment
    events: tuple[Event, ...]
    warnings: tuple[str, ...] = ()

    @property
    def is_new(self) -> bool:
        return any(isinstance(e, RankAssigned) for e in self.events)


def decide_register(
    state: RendezvousState, request: RegisterInput, now: float, agent_channel: bool = False
) -> RegisterDecision:
    """``agent_channel``: the request came in a RegisterBatch of its node's own agent, over
    an mTLS connection whose certificate names that node, with the node's credential
    (check_vouch)."""
    check_common(state, request)
    vouch_id = check_vouch(state, request, now, agent_channel)
    existing = state.by_worker.get(request.worker_id)
    if existing is not None:
        return decide_again(state, existing, request, now, vouch_id)

    if state.complete:
        raise RendezvousError(
            Code.RESOURCE_EXHAUSTED,
            f"world is full: all {state.world_size} ranks of generation {state.generation} "
            f"are held; worker_id {request.worker_id!r} is not one of them",
        )

    events: list[Event] = []
    node = state.nodes.get(request.node_id)
    if node is not None and node.node_rank < 0:
        raise RendezvousError(
            Code.FAILED_PRECONDITION,
            f"node_id {request.node_id!r} is {node.state.value} and holds no rank block; its "
            "workers register once it has replaced a lost node",
        )
    if node is not None:
        node_rank = node.node_rank
    elif request.claimed_rank is None:
        node_rank = free_node_rank(state, request.node_id)
        events.append(NodeJoined(request.node_id, node_rank, now))
    else:
        node_rank = next_claimed_node_rank(state)
        events.append(NodeJoined(request.node_id, node_rank, now))

    if request.claimed_rank is None:
        rank = node_rank * state.config.slots_per_node + request.local_rank
    else:
        rank = request.claimed_rank
    holder = state.by_rank.get(rank)
    if holder is not None:
        raise RendezvousError(
            Code.ALREADY_EXISTS,
            f"rank {rank} is already held by worker_id {holder.worker_id!r} on node "
            f"{holder.node_id!r}; worker_id {request.worker_id!r} cannot take it",
        )
    warnings: list[str] | tuple[()] = ()
    if request.claimed_rank is not None:
        check_node_share(state, rank, request.node_id, node)
        warnings = check_topology(state, rank, request.node_id)
    assignment = Assignment(request.worker_id, rank, request.node_id, node_rank, request.local_rank)
    events.append(
        RankAssigned(
            request.worker_id,
            rank,
            request.node_id,
            request.local_rank,
            now,
            claimed=request.claimed_rank is not None,
            vouch_id=vouch_id,
        )
    )
    if rank == 0 and request.endpoint_host:
        events.append(MasterChosen(request.endpoint_host, request.endpoint_port))
    return RegisterDecision(assignment, tuple(events), tuple(warnings))


def check_vouch(state: RendezvousState, request: RegisterInput, now: float, agent_channel: bool = False) -> str:
    """PERMISSION_DENIED unless the worker's node agent vouched for it, for this job,
    node, generation and local rank, and no other worker spent the vouch.
    Over ``agent_channel`` the node's agent itself forwards the vouch (and its fan-in
    verified the signature on the node): that channel speaks for the node key, so the
    signature is not verified again; binding, expiry and single use are (SECURITY.md)."""
    if not state.config.require_vouch:
        return ""
    node = state.nodes.get(request.node_id)
    if node is None or not node.public_key:
        raise RendezvousError(
            Code.PERMISSION_DENIED,
            f"node_id {request.node_id!r} has no joined agent to vouch for worker_id {request.worker_id!r}",
        )
    if request.vouch is None:
        raise RendezvousError(
            Code.PERMISSION_DENIED,
            f"worker_id {request.worker_id!r} brought no vouch from its node agent: a worker the agent did "
            "not start (Ray, Fabric by hand) asks the agent's socket for one; set MESHGATE_AGENT_SOCKET to "
            "the node agent's [agent] vouch_socket (default <state_dir>/vouch.sock)",
        )
    binding = dict(
        job_id=request.job_id,
        node_id=request.node_id,
        generation=state.generation,
        local_rank=request.local_rank,
        now=now,
        rank=request.claimed_rank,
    )
    try:
        if agent_channel:
            claims = vouch_claims(request.vouch, **binding)
        else:
            claims = verify_vouch(request.vouch, node.public_key, **binding)
    except VouchRefused as exc:
        raise RendezvousError(Code.PERMISSION_DENIED, f"worker_id {request.worker_id!r}: {exc}") from None
    vouch_id = claims.vouch_id.hex()
    spent_by = state.used_vouches.get(vouch_id)
    if spent_by is not None and spent_by != request.worker_id:
        raise RendezvousError(
            Code.PERMISSION_DENIED,
            f"vouch {vouch_id[:12]}... was already used by worker_id {spent_by!r}",
        )
    return vouch_id


def decide_again(
    state: RendezvousState, existing: Assignment, request: RegisterInput, now: float = 0.0, vouch_id: str = ""
) -> RegisterDecision:
    """Idempotent Register: same identity, same place, same rank. A survivor's worker kept its
    rank across a generation bump: its Register in the new generation is recorded (the same
    RankAssigned), so it counts in that world, durably, only from now on."""
    if existing.node_id != request.node_id:
        raise RendezvousError(
            Code.ALREADY_EXISTS,
            f"worker_id {request.worker_id!r} holds rank {existing.rank} on node "
            f"{existing.node_id!r}; it cannot register again from node {request.node_id!r}",
        )
    asked = request.claimed_rank
    if asked is not None and asked != existing.rank:
        raise RendezvousError(
            Code.ALREADY_EXISTS,
            f"worker_id {request.worker_id!r} holds rank {existing.rank}; it cannot claim rank {asked}",
        )
    if request.local_rank != existing.local_rank:
        raise RendezvousError(
            Code.ALREADY_EXISTS,
            f"worker_id {request.worker_id!r} holds local_rank {existing.local_rank}; it "
            f"asked for local_rank {request.local_rank}",
        )
    events: tuple[Event, ...] = ()
    if existing.generation != state.generation:
        claimed = request.claimed_rank is not None
        events = (
            RankAssigned(
                existing.worker_id, existing.rank, existing.node_id, existing.local_rank, now, claimed, vouch_id
            ),
        )
    if existing.rank == 0 and request.endpoint_host and state.master is None:
        events += (MasterChosen(request.endpoint_host, request.endpoint_port),)
    return RegisterDecision(existing, events)


def check_common(state: RendezvousState, request: RegisterInput) -> None:
    check_id("job_id", request.job_id)
    state.check_job(request.job_id)
    check_id("worker_id", request.worker_id)
    check_id("node_id", request.node_id)
    if not MIN_NONCE <= len(request.nonce) <= MAX_NONCE:
        raise RendezvousError(
            Code.INVALID_ARGUMENT,
            f"nonce must be {MIN_NONCE}..{MAX_NONCE} bytes, got {len(request.nonce)}",
        )
    if request.plan_digest:
        if len(request.plan_digest) != 32:
            raise RendezvousError(
                Code.INVALID_ARGUMENT,
                f"plan_digest must be 32 bytes (sha256) or empty, got {len(request.plan_digest)}",
            )
        if request.plan_digest != state.plan.digest():
            raise RendezvousError(
                Code.FAILED_PRECONDITION,
                f"plan_digest {request.plan_digest.hex()[:16]}... differs from this job's "
                f"plan {state.plan.digest().hex()[:16]}... ({state.plan.describe()})",
            )
    if request.generation is not None and request.generation != state.generation:
        raise RendezvousError(
            Code.FAILED_PRECONDITION,
            f"generation {request.generation} is not the current generation {state.generation}: register again "
            f"with generation {state.generation} (or none: the current one)",
        )
    mode = state.config.mode
    if mode is RankMode.ASSIGNED and request.claimed_rank is not None:
        raise RendezvousError(
            Code.INVALID_ARGUMENT,
            f'mode: job {state.config.job_id!r} assigns ranks (mode = "assigned"): a worker registers with its '
            f"local_rank alone (RegisterRequest.assigned) and the job picks its rank, but this Register claimed rank "
            f"{request.claimed_rank}. A framework that picks its own ranks (Ray Train, Lightning Fabric) needs a "
            "claimed-mode job: resubmit the job with `--mode claimed` (meshgate job submit --mode claimed; "
            'job file or [job] table: mode = "claimed")',
        )
    if mode is RankMode.CLAIMED and request.claimed_rank is None:
        raise RendezvousError(
            Code.INVALID_ARGUMENT,
            f'mode: job {state.config.job_id!r} takes claimed ranks (mode = "claimed"): a Register names its rank '
            f"and local_rank (RegisterRequest.claimed), but this one sent local_rank {request.local_rank} alone. "
            f"For ranks meshgate picks, submit the job in assigned mode (the default: meshgate job submit --mode "
            f'assigned; mode = "assigned")',
        )
    if request.claimed_rank is None:
        if not 0 <= request.local_rank < state.config.slots_per_node:
            raise RendezvousError(
                Code.INVALID_ARGUMENT,
                f"local_rank {request.local_rank} out of range [0, {state.config.slots_per_node}) (slots_per_node)",
            )
    elif not 0 <= request.claimed_rank < state.world_size:
        raise RendezvousError(
            Code.INVALID_ARGUMENT,
            f"rank {request.claimed_rank} out of range [0, {state.world_size})",
        )
    elif not 0 <= request.local_rank < state.world_size:
        raise RendezvousError(
            Code.INVALID_ARGUMENT,
            f"local_rank {request.local_rank} out of range [0, {state.world_size})",
        )
    if (request.endpoint_host or request.endpoint_port) and not 0 < request.endpoint_port < 65536:
        raise RendezvousError(
            Code.INVALID_ARGUMENT,
            f"endpoint_port {request.endpoint_port} out of range [1, 65535]",
        )
    if len(request.endpoint_host) > 255:
        raise RendezvousError(
            Code.INVALID_ARGUMENT,
            f"endpoint_host is {len(request.endpoint_host)} characters; at most 255",
        )


def free_node_rank(state: RendezvousState, node_id: str) -> int:
    order = state.config.node_order
    if node_id in order:
        return order.index(node_id)
    for node_rank in range(max(state.free_node_rank_from, len(order)), state.config.num_nodes):
        if node_rank not in state.node_ids_by_rank:
            return node_rank
    held = ", ".join(
        f"{r}={state.node_ids_by_rank.get(r, order[r] if r < len(order) else '?')}"
        for r in range(min(state.config.num_nodes, 16))
    ) + (", ..." if state.config.num_nodes > 16 else "")
    raise RendezvousError(
        Code.RESOURCE_EXHAUSTED,
        f"no free node rank for node_id {node_id!r}: the plan needs "
        f"{state.config.num_nodes} nodes and their ranks are taken or pinned ({held})",
    )


def next_claimed_node_rank(state: RendezvousState) -> int:
    # Claimed mode: node ranks only label nodes in join order; ranks come from the framework.
    node_rank = max(state.free_node_rank_from, len(state.config.node_order))
    while node_rank in state.node_ids_by_rank:
        node_rank += 1
    return node_rank


def check_node_share(state: RendezvousState, rank: int, node_id: str, node: Optional[Node]) -> None:
    """Claimed mode stays inside the node: a node holds at most its slots' worth of
    ranks in a generation (RESOURCE_EXHAUSTED), and with topology_policy "refuse" its
    ranks' TP and CP groups must fit in those slots together (FAILED_PRECONDITION):
    a node holding ranks of more groups than it can hold whole would make a group
    straddle nodes once the rest of the world registers."""
    slots = state.config.slots_per_node
    held = node.registered if node is not None else 0
    if held >= slots:
        ranks = sorted(a.rank for a in state.by_rank.values() if a.node_id == node_id)
        raise RendezvousError(
            Code.RESOURCE_EXHAUSTED,
            f"node {node_id!r} has {slots} slots (slots_per_node) and already holds ranks "
            f"{compress_ranks(ranks)} of generation {state.generation}; it cannot claim rank {rank}",
        )
    if state.config.topology_policy != "refuse" or not held:
        return
    ranks = [a.rank for a in state.by_rank.values() if a.node_id == node_id] + [rank]
    for axis in ("tp", "cp"):
        size = state.plan.size(axis)
        if size == 1 or size > slots:  # a group larger than a node straddles anyway: _check_topology says so
            continue
        groups = {tuple(state.plan.group(axis, r)) for r in ranks}
        if len(groups) * size > slots:
            raise RendezvousError(
                Code.FAILED_PRECONDITION,
                f"node {node_id!r} has {slots} slots; with rank {rank} it would hold ranks of "
                f"{len(groups)} {axis} groups of {size} ({', '.join(str(list(g)) for g in sorted(groups))}), "
                f"which cannot all stay on it: topology_policy refuse",
            )


def one_nvlink_domain(domains: Mapping[str, str], node_ids: Iterable[str]) -> str:
    """The NVLink domain every one of ``node_ids`` is known to be in; "" when one is
    unknown or they differ (then their GPUs talk over the network, not NVLink)."""
    found = {domains.get(node_id, "") for node_id in node_ids}
    return found.pop() if len(found) == 1 and "" not in found else ""


def check_topology(state: RendezvousState, rank: int, node_id: str) -> list[str]:
    """A TP or CP group stays on one node, or within one NVLink domain its nodes' agents
    discovered (a multi-node NVLink rack: GB200 NVL72); else a warning, or with
    topology_policy "refuse" FAILED_PRECONDITION naming the ranks, nodes and domains."""
    if state.config.topology_policy == "allow":
        return []
    problems = []
    for axis in ("tp", "cp"):
        if state.plan.size(axis) == 1:
            continue
        members = state.plan.group(axis, rank)
        elsewhere = sorted(
            {(state.by_rank[m].node_id, m) for m in members if m in state.by_rank} - {(node_id, m) for m in members}
        )
        involved = [node_id, *(n for n, _ in elsewhere)]
        if not elsewhere or one_nvlink_domain(state.nvlink_domains, involved):
            continue  # on one node, or across nodes over one NVLink fabric
        where = ", ".join(f"rank {m} on {n!r}" for n, m in elsewhere)
        problem = f"{axis} group {list(members)} would straddle nodes: rank {rank} on {node_id!r}, {where}"
        known = sorted({(n, state.nvlink_domains[n]) for n in involved if state.nvlink_domains.get(n)})
        if known:  # the nodes whose domain is known (the others' is not)
            problem += f" outside one NVLink domain ({', '.join(f'{n!r} in {d}' for n, d in known)})"
        problems.append(problem)
    if problems and state.config.topology_policy == "refuse":
        raise RendezvousError(Code.FAILED_PRECONDITION, "; ".join(problems))
    return problems


def check_await(state: RendezvousState, job_id: str, generation: int) -> None:
    state.check_job(job_id)
    if generation != state.generation:
        raise RendezvousError(
            Code.FAILED_PRECONDITION,
            f"generation {generation} is over; the current generation is {state.generation}",
        )


def decide_heartbeat(
    state: RendezvousState,
    job_id: str,
    worker_id: str,
    generation: int,
    secret: bytes = b"",
    valid: Iterable[bytes] = (),
) -> None:
    """Only the worker itself keeps itself alive: ``secret`` must be one of ``valid``,
    the heartbeat secrets the owner derives for (job, generation, worker) and handed
    to that worker with its attestation."""
    check_await(state, job_id, generation)
    check_id("worker_id", worker_id)
    if worker_id not in state.by_worker:
        raise RendezvousError(Code.NOT_FOUND, f"worker_id {worker_id!r} is not registered in this generation")
    if not secret:
        raise RendezvousError(Code.UNAUTHENTICATED, f"heartbeat_secret missing for worker_id {worker_id!r}")
    if not any(hmac.compare_digest(secret, v) for v in valid):
        raise RendezvousError(Code.PERMISSION_DENIED, f"heartbeat_secret does not belong to worker_id {worker_id!r}")


def touch(state: RendezvousState, worker_id: str, now: float, proven_generation: int = -1) -> None:
    """Liveness is not state worth persisting: a restart gives every worker a fresh start.
    A worker keeps itself alive, and its node only when the node has no agent: a node an
    agent manages is alive while its agent heartbeats. (The workers of an agent killed
    for good run on, outside anything that can stop or restart them; their own
    heartbeats kept such a node "alive" for as long as they ran, so its spare never took
    the block.) ``proven_generation``: the generation whose heartbeat secret the worker
    showed (decide_heartbeat checked it)."""
    state.worker_seen[worker_id] = now
    assignment = state.by_worker.get(worker_id)
    if assignment is not None and proven_generation == state.generation:
        renew(state, assignment)  # a log written before renewals were recorded: its proof heals the count
    if assignment is not None and not state.nodes[assignment.node_id].managed:
        state.nodes[assignment.node_id].last_seen = now
