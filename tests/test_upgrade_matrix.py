"""This release against an earlier one, each in its own install (issue 35): the earlier
release is built once per machine from its commit (git archive, pip install --no-deps
--target into a cache directory keyed by the commit; its dependencies are this venv's) and
run as its own process with that directory first on PYTHONPATH.

The cell here: this release's CLI against the coordinator of 91c899c, the release the
issue's upgrade test started from, which reads JobSpec's enum fields (numbered 14-16 since)
as unset and says nothing. The CLI finds the fields missing from the job the coordinator
recorded, cancels it and says which fields and which side to upgrade: the job never runs
otherwise than submitted.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from conftest import REPO, worker_env
from meshgate import admin, wire
from meshgate.connection import Connection, RendezvousRefused
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb

pytestmark = pytest.mark.slow

BEFORE_ENUMS = "91c899c"  # JobSpec's mode, topology_policy and restart_policy were strings


def release_install(commit: str) -> Path:
    """The release of ``commit`` installed under a cache directory (built once per machine)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshgate-tests" / commit
    if (cache / "site" / "meshgate" / "__init__.py").exists():
        return cache / "site"
    archive = subprocess.run(["git", "archive", commit], cwd=REPO, capture_output=True, check=False)
    if archive.returncode != 0:
        pytest.skip(f"this checkout has no commit {commit} (a shallow clone): {archive.stderr.decode().strip()}")
    source = cache / "source"
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(source, filter="data")
    built = cache / "site.new"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", built, source],
        check=True,
        capture_output=True,
    )
    built.rename(cache / "site")
    return cache / "site"


@pytest.fixture(scope="module")
def old_coordinator(tmp_path_factory):
    site = release_install(BEFORE_ENUMS)
    base = tmp_path_factory.mktemp("old-coordinator")
    config = base / "coordinator.toml"
    config.write_text(
        '[cluster]\nheartbeat_interval_s = 5.0\n[server]\nlisten = "127.0.0.1:0"\ninsecure = true\n'
        f'[keys]\ndir = "{base}/keys"\n[store]\nkind = "sqlite"\ndir = "{base}/state"\n'
    )
    port_file, log = base / "addr", open(base / "log", "wb")
    env = {**worker_env(), "PYTHONPATH": str(site)}
    process = subprocess.Popen(
        [sys.executable, "-m", "meshgate.coordinator", "--config", config, "--port-file", port_file],
        cwd=base,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while not port_file.exists():
        assert process.poll() is None and time.monotonic() < deadline, (base / "log").read_text()
        time.sleep(0.05)
    yield Connection(port_file.read_text().strip(), None)
    process.terminate()
    process.wait(timeout=30)


def spec(job_id: str, **fields) -> pb.JobSpec:
    """Every plan size spelled: that release had no plan-file defaults on the wire."""
    return pb.JobSpec(job_id=job_id, nodes=1, command=["true"], plan=ParallelPlan(dp_shard=2).to_proto(), **fields)


@pytest.mark.parametrize(
    "field, value",
    [
        ("mode", pb.RANK_MODE_CLAIMED),
        ("restart_policy", pb.RESTART_POLICY_ON_FAILURE),
        ("topology_policy", pb.TOPOLOGY_POLICY_REFUSE),
    ],
)
def test_this_cli_against_a_coordinator_before_the_enums_never_runs_a_job_without_a_field(
    old_coordinator, field, value
):
    job_id = f"old-{field.replace('_', '-')}"
    sent = spec(job_id, **{field: value})
    with pytest.raises(RendezvousRefused) as refused:
        admin.submit_job(old_coordinator, sent)
    name = pb.JobSpec.DESCRIPTOR.fields_by_name[field].enum_type.values_by_number[value].name
    message = refused.value.details
    assert f"{field} = {name} (recorded: unset)" in message, message
    assert f"release {wire.RELEASE}, wire {wire.WIRE_VERSION}" in message and "Upgrade the coordinator" in message
    assert "it was cancelled" in message, message
    assert admin.get_job(old_coordinator, job_id).state == pb.CANCELLED


def test_this_cli_against_a_coordinator_before_the_enums_submits_what_it_knows(old_coordinator):
    """A job that sets none of those fields runs there as submitted: no false alarm."""
    info = admin.submit_job(old_coordinator, spec("old-plain"))
    assert info.spec.job_id == "old-plain" and info.state in (pb.PENDING, pb.RUNNING)


def test_a_call_the_older_coordinator_does_not_have_names_it_and_what_to_upgrade(old_coordinator):
    """Not gRPC's bare "UNIMPLEMENTED: Method not found!" (ListNodes came after 91c899c)."""
    with pytest.raises(RendezvousRefused) as refused:
        admin.list_nodes(old_coordinator)
    assert refused.value.code.name == "UNIMPLEMENTED"
    assert refused.value.details.startswith("ListNodes: the coordinator has no such call: it is older than this client")
    assert "upgrade the coordinator" in refused.value.details
