"""What the servicers and the CLI read: protobuf views of a job's rendezvous and of the
cluster's jobs, built from the state in one place, so no servicer walks internal state."""

from __future__ import annotations

import base64
import binascii
import bisect
import math
from dataclasses import asdict, replace
from typing import Callable, Optional

from meshgate.coordinator.cluster import ClusterCoordinator
from meshgate.coordinator.engine import Coordinator
from meshgate.coordinator.hardware import hardware_words, live_in, shared_with
from meshgate.coordinator.progress import ProgressBoard
from meshgate.progress import describe as describe_progress
from meshgate.coordinator.pages import MAX_NODE_NAMES_BYTES, MAX_STATUS_NODES_BYTES, bound_repeated, bounded_page
from meshgate.coordinator.cluster_state.admission import hold
from meshgate.coordinator.cluster_state.scheduling import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE, QueueReasons
from meshgate.coordinator.jobs import OPERATOR, Caller, ClusterNode, ClusterState, Job, JobState, PoolState
from meshgate.coordinator.cluster_state.quotas import Limits
from meshgate.coordinator.cluster_state.ends import why_pruned
from meshgate.coordinator.cluster_state.timeline import job_timeline
from meshgate.coordinator.rendezvous import Code, NodeState, RankMode, RendezvousError, compress_ranks, shown
from meshgate.coordinator.rendezvous.timeline import Entry, Moment, Timeline
from meshgate.metrics import CoordinatorGauges, JobGauges, ProgressGauges, recently_ended
from meshgate.v1 import nodes_pb2, rendezvous_pb2

from google.protobuf import unknown_fields


def node_state_message(state: NodeState) -> int:
    """NodeState.LOST -> rendezvous_pb2.NODE_STATE_LOST."""
    return rendezvous_pb2.NodeState.Value(f"NODE_STATE_{state.name}")


def pool_state_message(state: PoolState) -> int:
    """PoolState.IDLE -> rendezvous_pb2.POOL_STATE_IDLE."""
    return rendezvous_pb2.PoolState.Value(f"POOL_STATE_{state.name}")


def _upgrade_summary(final: rendezvous_pb2.Status) -> None:
    """A summary kept before NodeState carries each node's state as a string in the
    field now reserved (3): read it from there, so old jobs show as they did."""
    for node in final.nodes:
        if node.state:
            continue
        for field in unknown_fields.UnknownFieldSet(node):
            if field.field_number == 3 and isinstance(field.data, bytes):
                node.state = node_state_message(NodeState(field.data.decode()))


def _kept_summary(job: Job) -> rendezvous_pb2.Status:
    """An ended job's final Status, as its summary in the cluster's log keeps it."""
    final = rendezvous_pb2.Status.FromString(base64.b64decode(job.summary))
    _upgrade_summary(final)
    return final


def _stamp(field, seconds: float) -> None:
    field.FromNanoseconds(int(seconds * 1e9))


def status(
    engine: Coordinator,
    ended_at: float = 0.0,
    silent_for: Callable[[float, float], float] | None = None,
    progress: ProgressBoard | None = None,
) -> rendezvous_pb2.Status:
    """One job's rendezvous: generation, ranks held and missing, nodes (active, spare,
    lost, left, replaced), exits, failure, and (``ended_at``) when the job ended.
    ``silent_for(last_seen, now)``: how long a node counted in has been silent, once
    that makes it a suspect (a running job's; an ended job's nodes are never suspects).
    ``progress``: what the job's workers reported of their training (coordinator/progress.py)."""
    now = engine.clock() if silent_for is not None else 0.0
    state, config = engine.state, engine.config
    # (a dev config with no mode takes both, request by request: claimed once one was claimed)
    claimed = config.mode is RankMode.CLAIMED or (config.mode is None and state.claimed_seen)
    held: dict[str, list[int]] = {}
    for rank, assignment in sorted(state.by_rank.items()) if claimed else ():  # where the framework put them
        held.setdefault(assignment.node_id, []).append(rank)
    reply = rendezvous_pb2.Status(
        mode=rendezvous_pb2.RANK_MODE_CLAIMED if claimed else rendezvous_pb2.RANK_MODE_ASSIGNED,
        job_id=config.job_id,
        generation=state.generation,
        plan=config.plan.to_proto(),
        plan_digest=config.plan.digest(),
        world_size=state.world_size,
        registered=state.registered_now,
        missing_ranks=compress_ranks(state.missing_ranks()),
        failure=state.failed,
        failure_log_tail=state.failed_log_tail,
    )
    if state.opened_at:
        _stamp(reply.opened_at, state.opened_at)
    if ended_at:
        _stamp(reply.ended_at, ended_at)
    if state.job_master:
        reply.master_addr, reply.master_port = state.job_master
    for node in sorted(state.nodes.values(), key=lambda n: n.node_rank):
        entry = reply.nodes.add(
            node_id=node.node_id,
            node_rank=node.node_rank,
            state=node_state_message(node.state),
            first_rank=max(node.node_rank, 0) * config.slots_per_node,
            slots=config.slots_per_node,
            registered=node.registered,
            hostname=node.hostname,
            slot_kind=node.slot_kind,
            exits=node.exits,
            registered_ranks=compress_ranks(held.get(node.node_id, [])),
        )
        _stamp(entry.last_seen, node.last_seen)
        if silent_for is not None and not ended_at and node.state.counted_in:
            entry.silent_s = silent_for(node.last_seen, now)
        reported = progress.node(config.job_id, node.node_id) if progress is not None else None
        if reported is not None:
            entry.step, entry.step_time_s = reported.step, reported.step_time_s
    job_progress = progress.message(config.job_id, [n.node_id for n in reply.nodes]) if progress else None
    if job_progress is not None:
        reply.progress.CopyFrom(job_progress)
    reply.nodes_more = bound_repeated(reply.nodes, budget=MAX_STATUS_NODES_BYTES)
    return reply


def _replayed(cluster: ClusterCoordinator, job: Job) -> Coordinator:
    """A job that ended before summaries were kept (or whose summary a crash kept from
    the log): its engine replayed from its own log for reading, and the log closed
    again at once. Never kept, never written to."""
    return cluster.job_engines.replayed(cluster.rendezvous_config(job))


def summary(engine: Coordinator, job: Job, progress: ProgressBoard | None = None) -> str:
    """An ended job's final Status, as kept in the cluster's log (JobSummarized): what
    `job show`, GetJob and GetStatus answer and what its nodes are told, ever after
    (the last progress its workers reported too)."""
    reply = status(engine, job.ended_at, progress=progress)
    if not reply.failure and job.state is not JobState.SUCCEEDED:
        reply.failure = job.reason  # e.g. cancelled: the engine may not have heard yet
    return base64.b64encode(reply.SerializeToString()).decode()


def job_status(cluster: ClusterCoordinator, job: Job) -> rendezvous_pb2.Status:
    """A job's rendezvous: from its engine while it runs; once it ended, from the summary
    in the cluster's log (a job that ended before summaries were kept: replayed from its
    own log, which is closed again at once)."""
    if job.summary:
        final = _kept_summary(job)
        if job.ended_at and not final.HasField("ended_at"):  # a summary kept before ended_at was
            _stamp(final.ended_at, job.ended_at)
        return final
    if cluster.retired(job.spec.job_id) and job.nodes:  # (a declared job is never retired)
        return status(_replayed(cluster, job), job.ended_at)
    reply = status(cluster.engine(job.spec.job_id), job.ended_at, cluster.state.silent_for, cluster.progress)
    now = cluster.clock()
    for entry in reply.nodes:  # what `meshgate nodes` says of each: one read model (draining, cordoned)
        node = cluster.state.nodes.get(entry.node_id)
        if node is not None:
            entry.pool_state = pool_state_message(cluster.state.pool_state(node, now))
    reply.nodes_more += bound_repeated(reply.nodes, budget=MAX_STATUS_NODES_BYTES)  # the states weigh too
    return reply


def named_status(cluster: ClusterCoordinator, job_id: str) -> rendezvous_pb2.Status:
    """GetStatus: ``job_id``'s rendezvous, or with no id the job the config declares; a
    config that declares none is told where to look instead of that an id is empty."""
    if not job_id and len(cluster.declared) != 1:
        raise RendezvousError(
            Code.INVALID_ARGUMENT,
            "job_id is empty and this coordinator's config declares no job: name one (meshgate status --job ID; "
            "meshgate job list lists them), or see the cluster with GetCluster (meshgate status with no --job)",
        )
    return job_status(cluster, cluster.job(job_id))


def ended_heartbeat(cluster: ClusterCoordinator, job: Job, node_id: str) -> nodes_pb2.NodeHeartbeatResponse:
    """A node still following a job that ended and was closed learns the end from this."""
    final = job_status(cluster, job)
    node = next((n for n in final.nodes if n.node_id == node_id), None)
    return nodes_pb2.NodeHeartbeatResponse(
        generation=final.generation,
        node_state=node.state if node else rendezvous_pb2.NODE_STATE_LEFT,
        node_rank=node.node_rank if node else -1,
        job_failure=final.failure,
        job_id=job.spec.job_id,
        job_state=rendezvous_pb2.JobState.Value(job.state.value),
    )


def ended_exit(cluster: ClusterCoordinator, job: Job) -> nodes_pb2.ReportExitResponse:
    """A worker's exit reported after its job ended and was closed: nothing is left to
    decide; the reporter learns the end."""
    final = job_status(cluster, job)
    return nodes_pb2.ReportExitResponse(generation=final.generation, job_failure=final.failure)


REDACTED_COMMAND = "<command>"


def redact_command(text: str, command) -> str:
    """``text`` with every argument of ``command`` (3 characters or more: shorter ones are
    words of any sentence) replaced, longest first: a reason such as "cannot start
    '/opt/secret/train.py'" must not show a redacted job's command after all."""
    for argument in sorted({a for a in command if len(a) >= 3}, key=len, reverse=True):
        text = text.replace(argument, REDACTED_COMMAND)
    return text


def holders(cluster: ClusterCoordinator, job: Job) -> tuple[list[str], list[str]]:
    """The nodes that hold ``job`` now, members in node_rank order, and its spares: while it
    runs, its rendezvous says (a spare that took a lost node's block is a member from then
    on, the node it replaced is neither); once it ended, its summary does. What allocation
    gave it only before either exists. One read model: `job show`'s header, `job list` and
    the status table name the same nodes (the header named the replaced node and the used
    spare for the rest of the job)."""
    engine = cluster.engines.get(job.spec.job_id)
    if engine is not None and job.nodes:
        nodes = [(n.node_id, n.node_rank, n.state) for n in engine.state.nodes.values()]
    elif job.summary and job.nodes:
        final = _kept_summary(job)
        nodes = [(n.node_id, n.node_rank, _NODE_STATES.get(n.state)) for n in final.nodes]
    else:
        return list(job.nodes), list(job.spares)
    nodes.sort(key=lambda n: n[1])
    members = [node_id for node_id, rank, state in nodes if rank >= 0 and state is not NodeState.REPLACED]
    return members, [node_id for node_id, _, state in nodes if state is NodeState.SPARE]


_NODE_STATES = {node_state_message(state): state for state in NodeState}


def job_info(
    cluster: ClusterCoordinator,
    job: Job,
    with_status: bool = True,
    caller: Caller = OPERATOR,
    reasons: Optional[QueueReasons] = None,
) -> rendezvous_pb2.JobInfo:
    """A job as `job show` prints it; PENDING says what it waits for (``reasons``: one
    pass for a page of jobs), RUNNING what a block whose node was lost waits for. A
    caller who may not manage the job (neither its owner nor
    an admin) gets it without its command, env and rendezvous status (hosts, master
    address), marked ``redacted``."""
    reason = job.reason
    if job.state is JobState.PENDING:
        reason = (reasons or QueueReasons(cluster.state, cluster.clock())).reason(job)
    elif job.state is JobState.RUNNING:  # a block whose node was lost waits for one: why
        reason = cluster.job_nodes.waiting_reason(job) or reason
    reply = rendezvous_pb2.JobInfo(
        spec=job.spec.to_proto(),
        plan_digest=job.spec.plan.digest(),
        state=rendezvous_pb2.JobState.Value(job.state.value),
        reason=reason,
        owner=job.owner,
    )
    members, spares = holders(cluster, job)
    reply.nodes.extend(members)
    reply.spare_nodes.extend(spares)
    reply.nodes_more = bound_repeated(reply.nodes, reply.spare_nodes, budget=MAX_NODE_NAMES_BYTES)
    if not caller.may_manage(job):
        reply.redacted = True
        reply.spec.ClearField("command")
        reply.spec.ClearField("env")
        reply.reason = redact_command(reply.reason, job.spec.command)
    _stamp(reply.submitted_at, job.submitted_at)
    if job.ended_at:
        _stamp(reply.ended_at, job.ended_at)
    served = job.nodes or job.summary or job.spec.job_id in cluster.engines  # a declared job has no nodes
    if with_status and served and not reply.redacted:  # its ranks, hosts and master are the owner's
        try:
            reply.status.CopyFrom(job_status(cluster, job))
        except RendezvousError as exc:  # its log cannot be served: the job is still shown, and why
            if exc.code not in (Code.DATA_LOSS, Code.UNAVAILABLE):
                raise
            if exc.message not in reply.reason:
                reply.reason = "; ".join(part for part in (reply.reason, exc.message) if part)
    return reply


def _rendezvous_timeline(cluster: ClusterCoordinator, job: Job) -> tuple[Timeline | None, str]:
    """What the job's rendezvous came to, folded from its own log (a running job's from
    its engine, an ended one's replayed from its log and closed again), or None and why
    not: its log was pruned after the retention, or cannot be read now."""
    job_id = job.spec.job_id
    if job.log_pruned:
        why = why_pruned(job, cluster.retention_s)
        return None, f"its own log was deleted {why} ({_summary_note(cluster, job)})"
    if job_id in cluster.engines:
        return cluster.engines[job_id].state.timeline, ""
    if not job.nodes:  # pending, or cancelled before it was allocated: no rendezvous yet
        return None, ""
    try:
        engine = _replayed(cluster, job) if job.state.ended else cluster.engine(job_id)
    except RendezvousError as exc:
        if exc.code not in (Code.DATA_LOSS, Code.UNAVAILABLE):
            raise
        return None, f"its own log cannot be read: {exc.message} ({_summary_note(cluster, job)})"
    return engine.state.timeline, ""


def _summary_note(cluster: ClusterCoordinator, job: Job) -> str:
    """What the cluster's log keeps of a job whose own log is gone: its summary."""
    if not job.summary:
        return "shown: the cluster's log only"
    final = job_status(cluster, job)
    nodes = ", ".join(
        f"{n.node_id} {rendezvous_pb2.NodeState.Name(n.state).removeprefix('NODE_STATE_').lower()}"
        + (f" ({n.exits[-1]})" if n.exits else "")
        for n in final.nodes[:8]
    )
    more = f" and {len(final.nodes) - 8} more" if len(final.nodes) > 8 else ""
    failure = f"; failure: {final.failure}" if final.failure else ""
    return (
        f"shown: the cluster's log; its summary: generation {final.generation}, "
        f"{final.registered}/{final.world_size} ranks registered at the end, nodes {nodes}{more}{failure}"
    )


def _timeline_entry(entry: Entry) -> rendezvous_pb2.TimelineEntry:
    reply = rendezvous_pb2.TimelineEntry(
        moment=rendezvous_pb2.TimelineMoment.Value(f"TIMELINE_{entry.moment.name}"),
        generation=entry.generation,
        node_id=entry.node_id,
        detail=entry.detail,
        count=entry.count,
    )
    _stamp(reply.at, entry.at)
    if entry.until:
        _stamp(reply.until, entry.until)
    return reply


def timeline(cluster: ClusterCoordinator, job: Job) -> rendezvous_pb2.JobTimeline:
    """GetJobTimeline: ``job``'s timeline, from the cluster's log and its own."""
    folded, note = _rendezvous_timeline(cluster, job)
    why = why_pruned(job, cluster.retention_s)
    entries = job_timeline(job, folded.entries() if folded else None, why) + _suspects(cluster, job)
    entries += _progress(cluster, job)
    entries = [_with_hardware(cluster, e) for e in entries]
    reply = rendezvous_pb2.JobTimeline(
        job_id=job.spec.job_id,
        state=rendezvous_pb2.JobState.Value(job.state.value),
        entries=[_timeline_entry(e) for e in entries],
        entries_dropped=folded.dropped if folded else 0,
        note=note,
    )
    return reply


def _with_hardware(cluster: ClusterCoordinator, entry: Entry) -> Entry:
    """A node's join with the hardware its agent reports now (kept in memory only, so
    read when shown: a timeline line never says more than the coordinator knows)."""
    hardware = cluster.hardware.of.get(entry.node_id) if entry.moment is Moment.NODE_JOINED else None
    if hardware is None:
        return entry
    words = f"hardware now: {hardware_words(hardware)}"
    return replace(entry, detail=f"{entry.detail}; {words}" if entry.detail else words)


def _suspects(cluster: ClusterCoordinator, job: Job) -> list[Entry]:
    """A running job's nodes silent past one heartbeat interval, as of now: the last
    entries, before the loss (if it comes) is an event of its own. Not kept: a node heard
    again leaves no trace."""
    engine = cluster.engines.get(job.spec.job_id) if job.state is JobState.RUNNING else None
    if engine is None:
        return []
    now, entries = engine.clock(), []
    for node in sorted(engine.state.nodes.values(), key=lambda n: n.node_id):
        silent = cluster.state.silent_for(node.last_seen, now) if node.state.counted_in else 0.0
        if silent:
            detail = f"silent {silent:.0f}s (suspect: no heartbeat from its agent)"
            entries.append(Entry(Moment.NODE_CHANGED, now, engine.state.generation, detail, node.node_id))
    return entries


def _progress(cluster: ClusterCoordinator, job: Job) -> list[Entry]:
    """The latest progress its workers reported, at when its step last advanced: the last
    entry of a running job's timeline (as of now), and of an ended one's (from its summary)."""
    if job.state is JobState.RUNNING:
        reported = cluster.progress.message(job.spec.job_id, [])
    else:
        final = _kept_summary(job) if job.summary else None
        reported = final.progress if final is not None and final.HasField("progress") else None
    if reported is None:
        return []
    at = reported.last_step_at.ToNanoseconds() / 1e9 if reported.HasField("last_step_at") else cluster.clock()
    return [Entry(Moment.PROGRESS, at, detail=describe_progress(reported))]


_PAGE_TOKEN_PREFIX = b"jobs-from:"
_NODES_TOKEN_PREFIX = b"nodes-after:"


def _token(prefix: bytes, where: str) -> str:
    return base64.urlsafe_b64encode(prefix + where.encode()).decode()


def _token_value(token: str, prefix: bytes, reply: str, valid: Callable[[str], bool] = bool) -> str:
    """What ``_token(prefix, ...)`` wrapped; INVALID_ARGUMENT naming the field otherwise."""
    try:
        raw = base64.urlsafe_b64decode(token.encode())
        if raw.startswith(prefix) and valid(raw[len(prefix) :].decode()):
            return raw[len(prefix) :].decode()
    except (binascii.Error, ValueError):
        pass
    raise RendezvousError(
        Code.INVALID_ARGUMENT, f"page_token {shown(token)} is not a {reply}.next_page_token of this coordinator"
    )


def page_token(position: int) -> str:
    """Opaque to callers: where the next page starts in submission order (Job.seq: a job
    forgotten meanwhile leaves a gap, never a shift, so a token stays valid)."""
    return _token(_PAGE_TOKEN_PREFIX, str(position))


def page_start(token: str) -> int:
    if not token:
        return 0
    return int(_token_value(token, _PAGE_TOKEN_PREFIX, "JobList", lambda v: v.isascii() and v.isdigit()))


def job_list(
    cluster: ClusterCoordinator, request: rendezvous_pb2.ListJobsRequest, caller: Caller
) -> rendezvous_pb2.JobList:
    """One page of ListJobs: in submission order, filtered by state and owner, bounded in
    rows and bytes (pages.py); jobs the caller may not manage come redacted (id, state,
    size, owner: never their command or env)."""
    try:
        state = JobState(rendezvous_pb2.JobState.Name(request.state)) if request.state else None
    except ValueError:
        raise RendezvousError(Code.INVALID_ARGUMENT, f"state {request.state} is not a JobState") from None
    matching = cluster.state.list_jobs(page_start(request.page_token), request.page_size, state, request.owner)
    reasons = QueueReasons(cluster.state, cluster.clock())  # rows come in submission order
    rows = (
        (position, job_info(cluster, job, with_status=False, caller=caller, reasons=reasons))
        for position, job in matching
    )
    page, next_start = bounded_page(rows, request.page_size or DEFAULT_PAGE_SIZE)
    reply = rendezvous_pb2.JobList(jobs=page)
    if next_start is not None:
        reply.next_page_token = page_token(next_start)
    return reply


def pool_node(cluster: ClusterCoordinator, node: ClusterNode, now: Optional[float] = None) -> rendezvous_pb2.PoolNode:
    now = cluster.clock() if now is None else now
    reply = rendezvous_pb2.PoolNode(
        node_id=node.node_id,
        state=pool_state_message(cluster.state.pool_state(node, now)),
        hostname=node.hostname,
        slots=node.slots,
        slot_kind=node.slot_kind,
        labels=node.labels,
        job_id=node.job_id,
        cordoned=node.cordon,
        quarantined=node.quarantine,
        unhealthy=node.unhealthy,
        failures=len(cluster.state.recent_failures(node, now)),
        uncordon_asked=f"by {node.uncordon_asked.by or '(anonymous)'}" if node.uncordon_asked else "",
    )
    if math.isfinite(node.last_seen):  # a drained node's is -inf: never seen since it left
        _stamp(reply.last_seen, node.last_seen)
        reply.silent_s = cluster.state.silent_for(node.last_seen, now)
    _stamp(reply.joined_at, node.joined_at)
    hardware = cluster.hardware.of.get(node.node_id)
    if hardware is not None:
        reply.hardware.CopyFrom(hardware)
        reply.hardware_shared = shared_with(cluster.hardware, live_in(cluster.state, now), node.node_id)
    version = cluster.node_versions.get(node.node_id)
    if version is not None:
        reply.agent_release, reply.agent_wire = version.release, max(version.wire, 0)
    engine = cluster.engines.get(node.job_id) if node.job_id else None
    in_job = engine.state.nodes.get(node.node_id) if engine is not None else None
    if in_job is not None:  # what `job show` says of it: one read model
        reply.job_node_state = node_state_message(in_job.state)
    return reply


def node_list(cluster: ClusterCoordinator, request: rendezvous_pb2.ListNodesRequest) -> rendezvous_pb2.NodeList:
    """One page of the pool in node id order (stable however nodes join: the token names
    the last node shown, and the next page starts after it), bounded in rows and bytes."""
    if not 0 <= request.page_size <= MAX_PAGE_SIZE:
        raise RendezvousError(Code.INVALID_ARGUMENT, f"page_size {request.page_size} is not in [0, {MAX_PAGE_SIZE}]")
    after = _token_value(request.page_token, _NODES_TOKEN_PREFIX, "NodeList") if request.page_token else ""
    nodes, now = sorted(list(cluster.state.nodes.values()), key=lambda n: n.node_id), cluster.clock()
    start = bisect.bisect_right([n.node_id for n in nodes], after) if after else 0
    rows = ((node.node_id, pool_node(cluster, node, now)) for node in nodes[start:])
    page, left_out = bounded_page(rows, request.page_size or DEFAULT_PAGE_SIZE)
    reply = rendezvous_pb2.NodeList(nodes=page, total=len(nodes))
    if left_out is not None:
        reply.next_page_token = _token(_NODES_TOKEN_PREFIX, page[-1].node_id)
    return reply


MAX_QUEUE_SHOWN = 100


def _quota(owner: str, limits: Limits) -> rendezvous_pb2.SubmitterQuota:
    return rendezvous_pb2.SubmitterQuota(owner=owner, **asdict(limits))


def job_counts(state: ClusterState) -> dict[JobState, int]:
    """Every job by state, the forgotten ones too (so a count never goes back)."""
    jobs = {s: state.forgotten.by_state[s] for s in JobState}
    for job in list(state.jobs.values()):
        jobs[job.state] += 1
    return jobs


def cluster_status(cluster: ClusterCoordinator) -> rendezvous_pb2.ClusterStatus:
    """The cluster at a glance: every job state and pool state counted (zeros included, so
    a reader sees the whole vocabulary), and the oldest PENDING jobs with why each waits."""
    state, now = cluster.state, cluster.clock()
    jobs = job_counts(state)
    nodes = {s: 0 for s in PoolState}
    for node in list(state.nodes.values()):
        nodes[state.pool_state(node, now)] += 1
    pending = list(state.pending.values())
    reply = rendezvous_pb2.ClusterStatus(
        jobs=[
            rendezvous_pb2.JobStateCount(state=rendezvous_pb2.JobState.Value(s.value), count=n) for s, n in jobs.items()
        ],
        nodes=[rendezvous_pb2.PoolStateCount(state=pool_state_message(s), count=n) for s, n in nodes.items()],
        queue_more=max(len(pending) - MAX_QUEUE_SHOWN, 0),
        declared_job_id=next(iter(cluster.declared)) if len(cluster.declared) == 1 else "",
        quotas=[_quota("", state.quotas.default)] + [_quota(o, q) for o, q in state.quotas.owners.items()],
        quota_admins_exempt=state.quotas.admins_exempt,
    )
    held = sorted((n for n in list(state.nodes.values()) if hold(n)), key=lambda n: n.node_id)
    reply.held.extend(pool_node(cluster, n, now) for n in held[:MAX_QUEUE_SHOWN])
    reply.held_more = max(len(held) - MAX_QUEUE_SHOWN, 0)
    reasons = QueueReasons(state, now)
    for job in pending[:MAX_QUEUE_SHOWN]:
        queued = reply.queue.add(job_id=job.spec.job_id, owner=job.owner, reason=reasons.reason(job))
        _stamp(queued.submitted_at, job.submitted_at)
    return reply


# Pool states a node alert names the node in (meshgate_node_out): one series per node in
# trouble, so the series stay as few as the nodes out of service.
OUT_OF_SERVICE = frozenset(
    {PoolState.LEFT, PoolState.DRAINING, PoolState.CORDONED, PoolState.QUARANTINED, PoolState.UNHEALTHY}
)


def gauges(cluster: "ClusterCoordinator | None") -> "CoordinatorGauges | None":
    """What /metrics shows: the cluster's jobs and nodes by state (the pool's states, and the
    states of the declared job's nodes, which join it and not the pool: one vocabulary each,
    counted together where they share a word), and the rendezvous of every RUNNING job, by
    id (an ended job's series are gone at the next scrape); None on a standby."""
    if cluster is None:
        return None
    state, now = cluster.state, cluster.clock()
    jobs = {s.value: float(n) for s, n in job_counts(state).items()}
    nodes = {s.value: 0.0 for s in PoolState}
    out = []
    for node in list(state.nodes.values()):
        pool_state = state.pool_state(node, now)
        nodes[pool_state.value] += 1
        if pool_state in OUT_OF_SERVICE:
            out.append((node.node_id, pool_state.value))
    running, progress = {}, {}
    for job_id, engine in list(cluster.engines.items()):
        job = state.jobs.get(job_id)
        if job is not None and job.state is JobState.RUNNING:
            rendezvous = engine.state
            running[job_id] = JobGauges(
                ranks_registered=rendezvous.registered_now,
                ranks_expected=rendezvous.world_size,
                generation=rendezvous.generation,
                opened_at=rendezvous.opened_at,
            )
            reported = cluster.progress.message(job_id, [])
            if reported is not None:  # only a job whose workers report: no series for one that never does
                progress[job_id] = ProgressGauges(
                    step=reported.step,
                    steps_per_s=reported.steps_per_s,
                    step_age_s=now - reported.last_step_at.ToNanoseconds() / 1e9,
                    straggler=reported.straggler,
                    straggler_ratio=reported.straggler_ratio,
                )
    for job_id in cluster.declared:
        if job_id in cluster.engines:
            for node_state in NodeState:
                nodes.setdefault(node_state.value, 0.0)
            for node in list(cluster.engines[job_id].state.nodes.values()):
                nodes[node.state.value] += 1
    versions: dict[tuple[str, str], float] = {}
    for version in list(cluster.node_versions.values()):
        key = (version.release, str(version.wire))
        versions[key] = versions.get(key, 0.0) + 1
    ended = recently_ended(dict(state.jobs), now)
    return CoordinatorGauges(
        nodes=nodes, jobs=jobs, running=running, progress=progress, agent_versions=versions, ended=ended, out=tuple(out)
    )


__all__ = [
    "cluster_status",
    "ended_exit",
    "ended_heartbeat",
    "gauges",
    "job_info",
    "job_list",
    "job_status",
    "named_status",
    "node_list",
    "page_start",
    "page_token",
    "node_state_message",
    "pool_node",
    "pool_state_message",
    "status",
    "summary",
    "timeline",
]
