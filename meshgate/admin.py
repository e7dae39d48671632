"""Admin calls (an admin credential is required): join tokens, key rotation, status, jobs.

Each call takes ``coordinator``: a meshgate.connection.Connection (what the CLI and the
launchers build once), or an address (or HA list) with ``tls=`` (a TLSConfig, or False for
plaintext) and ``admin_token=`` as the caller's arguments; what they leave unset comes from
the environment, then the client config file, as for every meshgate client: the admin
certificate (OU=admin) as MESHGATE_TLS_CERT / MESHGATE_TLS_KEY, or an admin bearer token in
MESHGATE_ADMIN_TOKEN / MESHGATE_ADMIN_TOKEN_FILE (the coordinator's [server] admin_token_file).
Every call fails over across an HA list; one that is not safe to repeat (a submit, a key
rotation, a token, a cancel or finish) moves on only when the first coordinator did not act.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import grpc

from meshgate import wire
from meshgate.connection import Connection, RendezvousRefused, connect
from meshgate.tls import TLSConfig
from meshgate.v1 import attestation_pb2
from meshgate.v1 import rendezvous_pb2 as pb
from meshgate.v1 import rendezvous_pb2_grpc


@dataclass(frozen=True)
class IssuedToken:
    token: str
    expires_at: float
    node_id: str


Coordinator = Union[Connection, str]
# Admin calls a retry elsewhere cannot repeat by mistake: they read, or name what they set.
_IDEMPOTENT = frozenset({"GetStatus", "GetJob", "ListJobs", "ListNodes", "GetCluster"})


def _call(coordinator: Coordinator, tls, method: str, request, admin_token: Optional[str], timeout: float):
    given = {"tls": tls, "admin_token": admin_token}
    connection = connect(coordinator, admin=True, **{k: v for k, v in given.items() if v is not None})
    return connection.call(
        rendezvous_pb2_grpc.AdminStub,
        method,
        request,
        timeout=timeout,
        idempotent=method in _IDEMPOTENT,
        metadata=connection.admin_metadata,
    )


def create_join_token(
    coordinator: Coordinator,
    job_id: str,
    *,
    ttl_s: int = 600,
    node_id: str = "",
    any_node: bool = False,
    tls: TLSConfig | None | bool = None,
    admin_token: Optional[str] = None,
    timeout: float = 10.0,
) -> IssuedToken:
    """A single-use join token for ``node_id`` (or, with ``any_node``, for whichever node
    spends it first); ``tls=False`` for a plaintext dev coordinator."""
    reply = _call(
        coordinator,
        tls,
        "CreateJoinToken",
        pb.CreateJoinTokenRequest(job_id=job_id, ttl_s=ttl_s, node_id=node_id, any_node=any_node),
        admin_token,
        timeout,
    )
    return IssuedToken(reply.token, reply.expires_at.ToNanoseconds() / 1e9, reply.node_id)


def rotate_key(
    coordinator: Coordinator,
    job_id: str,
    *,
    tls: TLSConfig | None | bool = None,
    admin_token: Optional[str] = None,
    timeout: float = 10.0,
) -> attestation_pb2.SignedTrustBundle:
    return _call(coordinator, tls, "RotateKey", pb.RotateKeyRequest(job_id=job_id), admin_token, timeout)


def get_status(
    coordinator: Coordinator,
    job_id: str = "",
    *,
    tls: TLSConfig | None | bool = None,
    admin_token: Optional[str] = None,
    timeout: float = 10.0,
) -> pb.Status:
    """The rendezvous of ``job_id`` (a single-job coordinator's own job when "") as the coordinator sees it."""
    return _call(coordinator, tls, "GetStatus", pb.GetStatusRequest(job_id=job_id), admin_token, timeout)


def get_cluster(
    coordinator: Coordinator,
    *,
    tls: TLSConfig | None | bool = None,
    admin_token: Optional[str] = None,
    timeout: float = 10.0,
) -> pb.ClusterStatus:
    """The cluster at a glance: jobs and nodes by state, the queue and why each job waits."""
    return _call(coordinator, tls, "GetCluster", pb.GetClusterRequest(), admin_token, timeout)


def cordon_node(
    coordinator: Coordinator,
    node_id: str,
    reason: str,
    *,
    uncordon: bool = False,
    drain: bool = False,
    tls: TLSConfig | None | bool = None,
    admin_token: Optional[str] = None,
    timeout: float = 10.0,
) -> pb.PoolNode:
    """Take ``node_id`` out of allocation (``drain``: and out of the job it serves, whose
    block goes to a replacement; ``uncordon``: return it); the node as it is now."""
    request = pb.CordonNodeRequest(node_id=node_id, reason=reason, drain=drain)
    return _call(coordinator, tls, "UncordonNode" if uncordon else "CordonNode", request, admin_token, timeout)


def list_nodes(
    coordinator: Coordinator,
    *,
    tls: TLSConfig | None | bool = None,
    admin_token: Optional[str] = None,
    timeout: float = 10.0,
    page_size: int = 0,
    page_token: str = "",
) -> pb.NodeList:
    """One page of the cluster's nodes in node id order (``page_size`` 0: the coordinator's
    default, 100). Pass ``next_page_token`` on for the next."""
    request = pb.ListNodesRequest(page_size=page_size, page_token=page_token)
    return _call(coordinator, tls, "ListNodes", request, admin_token, timeout)


# ---- jobs (a coordinator in jobs mode) -------------------------------------------------------


def submit_job(
    coordinator: Coordinator,
    spec: pb.JobSpec,
    *,
    tls: TLSConfig | None | bool = None,
    admin_token: Optional[str] = None,
    timeout: float = 10.0,
    wait_for_nodes: bool = False,
) -> pb.JobInfo:
    """Submit ``spec``; the job as the coordinator recorded it. A coordinator of a release
    before wire versions reads a field it does not know as unset and says nothing: such a
    job is cancelled at once and RendezvousRefused names the field (never run otherwise
    than submitted)."""
    request = pb.SubmitJobRequest(spec=spec, wait_for_nodes=wait_for_nodes)
    try:
        info = _call(coordinator, tls, "SubmitJob", request, admin_token, timeout)
    except RendezvousRefused as refusal:
        raise unknown_field_refusal(refusal, spec) or refusal from None
    dropped = dropped_fields(spec, info.spec)
    if dropped:
        try:
            cancel_job(
                coordinator,
                info.spec.job_id,
                f"submitted with {dropped}, which the coordinator dropped",
                tls=tls,
                admin_token=admin_token,
                timeout=timeout,
            )
            done = "it was cancelled"
        except RendezvousRefused as exc:
            done = f"cancel it (meshgate job cancel {info.spec.job_id}): the cancel failed: {exc}"
        raise RendezvousRefused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"the coordinator recorded job {info.spec.job_id!r} without {dropped} as submitted: it is older than "
            f"this client (release {wire.RELEASE}, wire {wire.WIRE_VERSION}) and does not know the field; {done}. "
            "Upgrade the coordinator first (docs/operating.md, Upgrading)",
        )
    return info


# JobSpec fields a coordinator of an earlier release may not know: the enums, and every
# field added since the first release (14 on; time_limit_s, launch_deadline_s, launch ...):
# what submit_job checks in the job it recorded.
_CHECKED_ON_SUBMIT = tuple(f.name for f in pb.JobSpec.DESCRIPTOR.fields if f.enum_type is not None or f.number >= 14)


# How a coordinator of an earlier release (0.1.0) refuses a JobSpec field it does not know,
# by number only; a retired field's refusal goes on to say what it was, and is left alone.
_UNKNOWN_FIELD = re.compile(r"(spec|spec\.plan) field (\d+) is not known to this coordinator")


def unknown_field_refusal(refusal: RendezvousRefused, spec: pb.JobSpec) -> Optional[RendezvousRefused]:
    """An earlier coordinator's refusal of a field this client sent, as one naming the field,
    its value and which side to upgrade; None for any other refusal."""
    known = _UNKNOWN_FIELD.fullmatch(refusal.details or "")
    if refusal.code != grpc.StatusCode.INVALID_ARGUMENT or known is None:
        return None
    message = spec if known.group(1) == "spec" else spec.plan
    field = message.DESCRIPTOR.fields_by_number.get(int(known.group(2)))
    if field is None:
        return None
    value = getattr(message, field.name)
    shown = field.enum_type.values_by_number[value].name if field.enum_type is not None else value
    return RendezvousRefused(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"the coordinator refused {known.group(1)}.{field.name} = {shown} (field {field.number}), which it does "
        f"not know: it is older than this client (release {wire.RELEASE}, wire {wire.WIRE_VERSION}); nothing was "
        "recorded. Upgrade the coordinator first (docs/operating.md, Upgrading)",
        refusal.address,
    )


def dropped_fields(sent: pb.JobSpec, recorded: pb.JobSpec) -> str:
    """The checked fields ``sent`` sets that ``recorded`` does not hold as sent ("" when none),
    as `mode = RANK_MODE_CLAIMED (recorded: unset)`."""
    out = []
    for name in _CHECKED_ON_SUBMIT:
        field, value, got = pb.JobSpec.DESCRIPTOR.fields_by_name[name], getattr(sent, name), getattr(recorded, name)
        if value and value != got:
            shown = field.enum_type.values_by_number[value].name if field.enum_type is not None else value
            out.append(f"{name} = {shown} (recorded: {got or 'unset'})")
    return ", ".join(out)


def list_jobs(
    coordinator: Coordinator,
    *,
    tls: TLSConfig | None | bool = None,
    admin_token: Optional[str] = None,
    timeout: float = 10.0,
    page_size: int = 0,
    page_token: str = "",
    state: str = "",
    owner: str = "",
) -> pb.JobList:
    """One page of jobs, oldest first (``page_size`` 0: the coordinator's default, 100);
    ``state`` ("RUNNING", ...) and ``owner`` filter. Pass ``next_page_token`` on for the next."""
    request = pb.ListJobsRequest(
        page_size=page_size, page_token=page_token, state=pb.JobState.Value(state) if state else 0, owner=owner
    )
    return _call(coordinator, tls, "ListJobs", request, admin_token, timeout)


def all_jobs(coordinator: Coordinator, **kwargs) -> Iterator[pb.JobInfo]:
    """Every job list_jobs(**kwargs) matches, page after page."""
    token = ""
    while True:
        page = list_jobs(coordinator, page_token=token, **kwargs)
        yield from page.jobs
        token = page.next_page_token
        if not token:
            return


def get_job(
    coordinator: Coordinator,
    job_id: str,
    *,
    tls: TLSConfig | None | bool = None,
    admin_token: Optional[str] = None,
    timeout: float = 10.0,
) -> pb.JobInfo:
    return _call(coordinator, tls, "GetJob", pb.GetJobRequest(job_id=job_id), admin_token, timeout)


def get_job_timeline(
    coordinator: Coordinator,
    job_id: str,
    *,
    tls: TLSConfig | None | bool = None,
    admin_token: Optional[str] = None,
    timeout: float = 10.0,
) -> pb.JobTimeline:
    return _call(coordinator, tls, "GetJobTimeline", pb.GetJobTimelineRequest(job_id=job_id), admin_token, timeout)


def cancel_job(
    coordinator: Coordinator,
    job_id: str,
    reason: str = "",
    *,
    tls: TLSConfig | None | bool = None,
    admin_token: Optional[str] = None,
    timeout: float = 60.0,  # it answers once the job's nodes showed its processes gone
) -> pb.JobInfo:
    return _call(coordinator, tls, "CancelJob", pb.CancelJobRequest(job_id=job_id, reason=reason), admin_token, timeout)


def job_logs(
    coordinator: Coordinator,
    job_id: str,
    *,
    rank: Optional[int] = None,
    node_id: str = "",
    follow: bool = False,
    tail_lines: int = 0,
    tls: TLSConfig | None | bool = None,
    admin_token: Optional[str] = None,
    timeout: Optional[float] = 60.0,
) -> Iterator[pb.JobLogsChunk]:
    """A job's workers' output as its agents relay it (the job's owner or an admin):
    one rank's, one node's ranks', or every rank's; ``follow``: then new output until the
    job ends (pass ``timeout=None``). Chunks with a ``notice`` say why a node sent nothing."""
    request = pb.JobLogsRequest(job_id=job_id, node_id=node_id, follow=follow, tail_lines=tail_lines)
    if rank is not None:
        request.rank = rank
    given = {"tls": tls, "admin_token": admin_token}
    connection = connect(coordinator, admin=True, **{k: v for k, v in given.items() if v is not None})
    yield from connection.stream(
        rendezvous_pb2_grpc.AdminStub, "JobLogs", request, timeout=timeout, metadata=connection.admin_metadata
    )


def finish_job(
    coordinator: Coordinator,
    job_id: str,
    succeeded: bool,
    reason: str = "",
    *,
    tls: TLSConfig | None | bool = None,
    admin_token: Optional[str] = None,
    timeout: float = 10.0,
) -> pb.JobInfo:
    """End a RUNNING job of external workers (no command): SUCCEEDED or FAILED."""
    request = pb.FinishJobRequest(job_id=job_id, succeeded=succeeded, reason=reason)
    return _call(coordinator, tls, "FinishJob", request, admin_token, timeout)
