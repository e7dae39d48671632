"""Admin calls (an admin credential is required): join tokens, key rotation, status, jobs.

TLS settings come from the same MESHGATE_TLS_* environment as workers, with the admin
certificate (OU=admin) as MESHGATE_TLS_CERT / MESHGATE_TLS_KEY; or an admin bearer
token in MESHGATE_ADMIN_TOKEN (the coordinator's [server] admin_token_file).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator, Optional

import grpc

from meshgate.client import RendezvousRefused, tls_from_env
from meshgate.tls import TLSConfig, secure_channel
from meshgate.v1 import attestation_pb2
from meshgate.v1 import rendezvous_pb2 as pb
from meshgate.v1 import rendezvous_pb2_grpc


@dataclass(frozen=True)
class IssuedToken:
    token: str
    expires_at: float
    node_id: str


def _metadata(admin_token: Optional[str]):
    admin_token = admin_token or os.environ.get("MESHGATE_ADMIN_TOKEN")
    return (("authorization", f"Bearer {admin_token}"),) if admin_token else ()


def _call(coordinator: str, tls, method: str, request, admin_token: Optional[str], timeout: float):
    tls = tls_from_env() if tls is None else tls
    tls = None if tls is False else tls
    address = coordinator.split(",")[0].strip()
    with secure_channel(address, tls) as channel:
        try:
            return getattr(rendezvous_pb2_grpc.AdminStub(channel), method)(
                request, metadata=_metadata(admin_token), timeout=timeout
            )
        except grpc.RpcError as exc:
            raise RendezvousRefused(exc.code(), exc.details() or "") from None


def create_join_token(
    coordinator: str,
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
        coordinator, tls, "CreateJoinToken",
        pb.CreateJoinTokenRequest(job_id=job_id, ttl_s=ttl_s, node_id=node_id, any_node=any_node),
        admin_token, timeout,
    )
    return IssuedToken(reply.token, reply.expires_at.ToNanoseconds() / 1e9, reply.node_id)


def rotate_key(
    coordinator: str,
    job_id: str,
    *,
    tls: TLSConfig | None | bool = None,
    admin_token: Optional[str] = None,
    timeout: float = 10.0,
) -> attestation_pb2.SignedTrustBundle:
    return _call(coordinator, tls, "RotateKey", pb.RotateKeyRequest(job_id=job_id), admin_token, timeout)


# ---- jobs (a coordinator in jobs mode) -------------------------------------------------------


def submit_job(
    coordinator: str, spec: pb.JobSpec, *, tls: TLSConfig | None | bool = None,
    admin_token: Optional[str] = None, timeout: float = 10.0, wait_for_nodes: bool = False,
) -> pb.JobInfo:
    request = pb.SubmitJobRequest(spec=spec, wait_for_nodes=wait_for_nodes)
    return _call(coordinator, tls, "SubmitJob", request, admin_token, timeout)


def list_jobs(
    coordinator: str, *, tls: TLSConfig | None | bool = None, admin_token: Optional[str] = None,
    timeout: float = 10.0, page_size: int = 0, page_token: str = "", state: str = "", owner: str = "",
) -> pb.JobList:
    """One page of jobs, oldest first (``page_size`` 0: the coordinator's default, 100);
    ``state`` ("RUNNING", ...) and ``owner`` filter. Pass ``next_page_token`` on for the next."""
    request = pb.ListJobsRequest(
        page_size=page_size, page_token=page_token, state=pb.JobState.Value(state) if state else 0, owner=owner
    )
    return _call(coordinator, tls, "ListJobs", request, admin_token, timeout)


def all_jobs(coordinator: str, **kwargs) -> Iterator[pb.JobInfo]:
    """Every job list_jobs(**kwargs) matches, page after page."""
    token = ""
    while True:
        page = list_jobs(coordinator, page_token=token, **kwargs)
        yield from page.jobs
        token = page.next_page_token
        if not token:
            return


def get_job(
    coordinator: str, job_id: str, *, tls: TLSConfig | None | bool = None,
    admin_token: Optional[str] = None, timeout: float = 10.0,
) -> pb.JobInfo:
    return _call(coordinator, tls, "GetJob", pb.GetJobRequest(job_id=job_id), admin_token, timeout)


def cancel_job(
    coordinator: str, job_id: str, reason: str = "", *, tls: TLSConfig | None | bool = None,
    admin_token: Optional[str] = None, timeout: float = 10.0,
) -> pb.JobInfo:
    return _call(coordinator, tls, "CancelJob", pb.CancelJobRequest(job_id=job_id, reason=reason), admin_token, timeout)


def finish_job(
    coordinator: str, job_id: str, succeeded: bool, reason: str = "", *, tls: TLSConfig | None | bool = None,
    admin_token: Optional[str] = None, timeout: float = 10.0,
) -> pb.JobInfo:
    """End a RUNNING job of external workers (no command): SUCCEEDED or FAILED."""
    request = pb.FinishJobRequest(job_id=job_id, succeeded=succeeded, reason=reason)
    return _call(coordinator, tls, "FinishJob", request, admin_token, timeout)
