"""A job for workers that no agent launches (Ray Train, or Fabric started by hand), on a
coordinator in jobs mode: submit a claimed-mode job with no command for the plan, wait until
its nodes are allocated, hand its id to the launcher, and finish it when the run is over.

    with claimed_job(plan, coordinator="head:7443", node_ids=["gpu-node-00"]) as job_id:
        ...  # the workers register in job_id

``RayTrainLauncher.fit()`` does this itself when it is given no job.

The nodes must be the meshgate nodes the framework places its workers on (their agents
vouch for them and say which node they are); the submitter needs the admin or submitter
role (MESHGATE_TLS_CERT / MESHGATE_TLS_KEY, or MESHGATE_ADMIN_TOKEN). ``coordinator``, ``tls``
and ``admin_token`` left unset come from the environment, then the client config file, as for
every meshgate client (meshgate/connection.py); an HA list fails over. ``job_id`` names the
job (default: the coordinator chooses one). To attach to a job that exists already, pass
its id to the launcher (``RayTrainLauncher(plan, job_id=...)``) instead.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

from meshgate.plan import ParallelPlan


class JobNotRunning(RuntimeError):
    """The submitted job did not start (it ended, or waited past the timeout); says why."""


@contextlib.contextmanager
def claimed_job(
    plan: ParallelPlan,
    *,
    coordinator: Optional[str] = None,
    node_ids: Sequence[str] = (),
    nodes: int = 0,
    slots_per_node: int = 0,
    topology_policy: str = "warn",
    job_id: str = "",
    tls=None,
    admin_token: Optional[str] = None,
    start_timeout: float = 300.0,
) -> Iterator[str]:
    from meshgate import admin
    from meshgate.connection import connect, poll
    from meshgate.job_cli import spec_message
    from meshgate.v1 import rendezvous_pb2 as pb

    spec = spec_message(
        {
            "id": job_id,
            "plan": plan,
            "nodes": nodes,
            "node_ids": list(node_ids),
            "slots_per_node": slots_per_node,
            "mode": "claimed",
            "topology_policy": topology_policy,
        }
    )
    given = {"tls": tls, "admin_token": admin_token}
    connection = connect(coordinator, admin=True, **{k: v for k, v in given.items() if v is not None})
    info = admin.submit_job(connection, spec)
    job_id = info.spec.job_id
    if info.state == pb.PENDING:
        for info in poll(lambda: admin.get_job(connection, job_id), every_s=0.2, for_s=start_timeout):
            if info.state != pb.PENDING:
                break
        else:
            admin.cancel_job(connection, job_id, f"not started after {start_timeout:g}s")
            raise JobNotRunning(f"job {job_id} still PENDING after {start_timeout:g}s: {info.reason}")
    if info.state != pb.RUNNING:
        raise JobNotRunning(f"job {job_id} is {pb.JobState.Name(info.state)}: {info.reason}")
    try:
        yield job_id
    except BaseException as exc:
        admin.finish_job(connection, job_id, False, f"{type(exc).__name__}: {str(exc)[:150]}")
        raise
    admin.finish_job(connection, job_id, True, "the run returned")


__all__ = ["JobNotRunning", "claimed_job"]
