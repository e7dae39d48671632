"""A job for workers that no agent launches (Ray Train, or Fabric started by hand), on a
coordinator in jobs mode: submit a claimed-mode job with no command for the plan, wait until
its nodes are allocated, hand its id to the launcher, and finish it when the run is over.

    with claimed_job(plan, coordinator="head:7443", node_ids=["gpu-node-00"]) as job_id:
        RayTrainLauncher(plan, job_id=job_id, train_loop_per_worker=loop, ...).fit()

The nodes must be the meshgate nodes the framework places its workers on (their agents
vouch for them and say which node they are); the submitter needs the admin or submitter
role (MESHGATE_TLS_CERT / MESHGATE_TLS_KEY, or MESHGATE_ADMIN_TOKEN). ``job_id`` names the
job (default: the coordinator chooses one). To attach to a job that exists already, pass
its id to the launcher (``RayTrainLauncher(plan, job_id=...)``) instead.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Optional, Sequence

from meshgate.plan import ParallelPlan


class JobNotRunning(RuntimeError):
    """The submitted job did not start (it ended, or waited past the timeout); says why."""


@contextlib.contextmanager
def claimed_job(
    plan: ParallelPlan,
    *,
    coordinator: str,
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
    from meshgate.job_cli import spec_message
    from meshgate.v1 import rendezvous_pb2 as pb

    spec = spec_message({
        "id": job_id, "plan": plan, "nodes": nodes, "node_ids": list(node_ids), "slots_per_node": slots_per_node,
        "mode": "claimed", "topology_policy": topology_policy,
    })
    connection = {"tls": tls, "admin_token": admin_token}
    info = admin.submit_job(coordinator, spec, **connection)
    job_id = info.spec.job_id
    deadline = time.monotonic() + start_timeout
    while info.state == pb.PENDING:
        if time.monotonic() > deadline:
            admin.cancel_job(coordinator, job_id, f"not started after {start_timeout:g}s", **connection)
            raise JobNotRunning(f"job {job_id} still PENDING after {start_timeout:g}s: {info.reason}")
        time.sleep(0.2)
        info = admin.get_job(coordinator, job_id, **connection)
    if info.state != pb.RUNNING:
        raise JobNotRunning(f"job {job_id} is {pb.JobState.Name(info.state)}: {info.reason}")
    try:
        yield job_id
    except BaseException as exc:
        admin.finish_job(coordinator, job_id, False, f"{type(exc).__name__}: {str(exc)[:150]}", **connection)
        raise
    admin.finish_job(coordinator, job_id, True, "the run returned", **connection)


__all__ = ["JobNotRunning", "claimed_job"]
