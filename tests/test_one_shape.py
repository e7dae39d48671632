"""One coordinator shape (issue #22, part 1): a config with [job] + [plan] is a cluster with
that one job declared at start, served through the same code as a job submitted to a
config that declares none; a single-job state directory of the old layout is refused by
name by both configs, left as found, or taken over on purpose with --migrate-state.

Real coordinator processes; nodes and workers are real gRPC clients.
"""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from conftest import REPO, start_coordinator, worker_env, write_config
from test_crash import message, register_retrying
from test_integrity import ranks_served, start
from meshgate import admin
from meshgate.attestation import SigningKey, TrustBundle, verify_attestation
from meshgate.plan import ParallelPlan
from meshgate.v1 import nodes_pb2, nodes_pb2_grpc
from meshgate.v1 import rendezvous_pb2 as pb
from meshgate.v1 import rendezvous_pb2_grpc

PLAN = ParallelPlan(dp_shard=4)  # 4 ranks: 2 nodes of 2 slots
JOB = "same"
WORKERS = [(node, local) for node in (0, 1) for local in (0, 1)]
SLOW_BEATS = {"heartbeat_interval_s": 60, "heartbeat_misses": 5}  # no node is lost while the test runs


def admin_stub(channel) -> rendezvous_pb2_grpc.AdminStub:
    return rendezvous_pb2_grpc.AdminStub(channel)


def join_job(address: str, node: int, credential: bytes = b"", token: str = "") -> nodes_pb2.JoinResponse:
    """A node's agent joins the job by name, as an agent with [agent] job = ... does."""
    with grpc.insecure_channel(address) as channel:
        return nodes_pb2_grpc.NodesStub(channel).Join(
            nodes_pb2.JoinRequest(
                job_id=JOB,
                node_id=f"n{node}",
                hostname=f"n{node}",
                slots=2,
                slot_kind="cpu",
                join_token=token,
                node_credential=credential,
                node_public_key=SigningKey.generate().public_raw,
            ),
            timeout=30,
        )


def answers(address: str, bundle: TrustBundle, status_job_id: str = JOB) -> dict:
    """What the job's workers and its operator are told: each worker's attestation, the
    world, the status (timestamps and the key that signed left out: they differ by nature)."""

    async def register_all() -> list:
        attested = []
        for node, local in WORKERS:
            m = message(JOB, node, local)
            reply = await register_retrying(address, m)
            a = verify_attestation(reply.attestation, bundle, job_id=JOB, nonce=m.nonce)
            fields = a.as_dict()
            for differs in ("key_id", "issued_at", "expires_at"):  # each coordinator's own key and clock
                fields.pop(differs)
            attested.append(fields)
        return attested

    attested = asyncio.run(register_all())
    with grpc.insecure_channel(address) as channel:
        world = rendezvous_pb2_grpc.RendezvousStub(channel).AwaitWorld(
            pb.AwaitWorldRequest(job_id=JOB, generation=0, timeout_ms=30_000, include_members=True), timeout=40
        )
        status = admin_stub(channel).GetStatus(pb.GetStatusRequest(job_id=status_job_id), timeout=30)
        job = admin_stub(channel).GetJob(pb.GetJobRequest(job_id=JOB), timeout=30)
    for entry in status.nodes:
        entry.ClearField("last_seen")
    status.ClearField("opened_at")
    job.status.CopyFrom(status)
    return {
        "attested": attested,
        "world": (
            world.job_id,
            world.generation,
            world.world_size,
            world.plan_digest,
            [(m.rank, m.node_id, m.node_rank, m.worker_id) for m in world.members],
        ),
        "status": status,
        "job": (job.state, job.spec.job_id, job.spec.plan, job.spec.slots_per_node, job.plan_digest, job.status),
    }


def test_a_single_job_config_and_a_submitted_job_give_the_same_answers(tmp_path):
    """The same job (id, plan, slots, nodes n0 and n1 at node ranks 0 and 1): declared by a
    config with [job] + [plan] to one coordinator, submitted through the Jobs API to one whose
    config declares none. Its workers, its world, its status and its job view are the same;
    the single-job one is a cluster too (the Jobs API lists its job, its log says so)."""
    single = start_coordinator(
        tmp_path / "single",
        PLAN,
        JOB,
        2,
        job={"node_order": ["n0", "n1"], "join_token": "static-dev-token", **SLOW_BEATS},
    )
    jobs_dir = tmp_path / "jobs"
    jobs_dir.mkdir()
    config = write_config(
        jobs_dir / "coordinator.toml",
        {
            "server": {"listen": "127.0.0.1:0", "insecure": True},
            "keys": {"dir": str(jobs_dir / "keys")},
            "store": {"dir": str(jobs_dir / "state")},
            "cluster": SLOW_BEATS,
        },
    )
    process, port_file = start(config)
    try:
        assert process.poll() is None, (jobs_dir / "log").read_text()
        jobs_address = port_file.read_text().strip()
        credentials = {}
        for node in (0, 1):  # nodes join the cluster, then (as agents do) the job they are given
            token = admin.create_join_token(jobs_address, "", node_id=f"n{node}", tls=False).token
            with grpc.insecure_channel(jobs_address) as channel:
                joined = nodes_pb2_grpc.NodesStub(channel).Join(
                    nodes_pb2.JoinRequest(
                        node_id=f"n{node}",
                        hostname=f"n{node}",
                        slots=2,
                        slot_kind="cpu",
                        join_token=token,
                        node_public_key=SigningKey.generate().public_raw,
                    ),
                    timeout=30,
                )
            credentials[node] = joined.node_credential
        spec = pb.JobSpec(job_id=JOB, plan=PLAN.to_proto(), slots_per_node=2, node_ids=["n0", "n1"], command=["true"])
        assert admin.submit_job(jobs_address, spec, tls=False).state == pb.RUNNING
        for node in (0, 1):
            assert join_job(jobs_address, node, credential=credentials[node]).node_rank == node
            assert join_job(single.address, node, token="static-dev-token").node_rank == node

        submitted = answers(jobs_address, TrustBundle.load(jobs_dir / "keys" / "trust-bundle.json"))
        declared = answers(single.address, TrustBundle.load(single.trust_bundle_path))
        # `meshgate status` names no job: the one the config declares answers.
        assert (
            answers(single.address, TrustBundle.load(single.trust_bundle_path), status_job_id="")["status"]
            == declared["status"]
        )
        listed = admin.list_jobs(single.address, tls=False).jobs
    finally:
        process.terminate()
        process.wait(timeout=30)
        single.stop()
    assert declared == submitted
    assert [a["rank"] for a in declared["attested"]] == [0, 1, 2, 3]
    assert declared["status"].registered == 4 and [n.node_id for n in declared["status"].nodes] == ["n0", "n1"]
    assert [(j.spec.job_id, j.state) for j in listed] == [(JOB, pb.RUNNING)]
    log = single.log_path.read_text()
    assert "serving jobs: 1 known" in log and f"serving job {JOB}" in log and "declared by the config" in log


# ---- a single-job state directory of the old layout -------------------------------------------


LEGACY = "legacy"


def write_legacy_state(root: Path, plan: ParallelPlan = PLAN) -> dict[str, int]:
    """A single-job coordinator's state of the old layout: its log in <state>/state.sqlite3
    pinned to its job and plan, its high-water mark in <keys>/durable-mark, its keys with a
    bundle naming the job; written by the store and engine code that coordinator ran, with
    four ranks given. Returns each worker's rank."""
    from meshgate.coordinator.engine import Coordinator
    from meshgate.coordinator.keys import KeyRing
    from meshgate.coordinator.rendezvous import RendezvousConfig
    from meshgate.coordinator.service import register_input
    from meshgate.coordinator.store import open_store
    from meshgate.coordinator.store.codec import job_pin
    from meshgate.coordinator.store.mark import DurableMark

    config = RendezvousConfig(LEGACY, plan, slots_per_node=2)
    keys = KeyRing(root / "keys", job_id=LEGACY)

    async def register() -> dict[str, int]:
        store = open_store(
            "sqlite",
            state_dir=root / "state",
            job_id=LEGACY,
            pin=job_pin(config),
            mark=DurableMark(root / "keys" / "durable-mark", LEGACY),
        )
        engine = Coordinator(config, store, keys, attestation_ttl_s=600)
        ranks = {}
        for node, local in WORKERS:
            m = message(LEGACY, node, local)
            signed, _ = await engine.register(register_input(m))
            ranks[m.worker_id] = verify_attestation(signed, keys.bundle, job_id=LEGACY, nonce=m.nonce).rank
        store.close()
        return ranks

    ranks = asyncio.run(register())
    assert (root / "state" / "state.sqlite3").exists() and (root / "keys" / "durable-mark").exists()
    return ranks


def digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.suffix != ".toml"
    }


def single_job_config(root: Path, plan: ParallelPlan = PLAN, name: str = "single.toml", job_id: str = LEGACY) -> Path:
    return write_config(
        root / name,
        {
            "job": {"id": job_id, "slots_per_node": 2},
            "plan": plan.to_dict(),
            "server": {"listen": "127.0.0.1:0", "insecure": True},
            "keys": {"dir": str(root / "keys")},
            "store": {"dir": str(root / "state")},
        },
    )


def run(config: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshgate.coordinator", "--config", str(config), *extra],
        cwd=REPO,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("declares", ["its job", "no job"])
def test_an_old_single_job_state_is_refused_by_name_and_left_as_found(tmp_path, declares):
    """Whatever the config declares (its own job, or none), the old layout is never read as
    something else: exit 2, one line naming the file, what wrote it and the remedies."""
    write_legacy_state(tmp_path)
    if declares == "its job":
        config = single_job_config(tmp_path)
    else:
        config = write_config(
            tmp_path / "jobs.toml",
            {
                "server": {"listen": "127.0.0.1:0", "insecure": True},
                "keys": {"dir": str(tmp_path / "keys")},
                "store": {"dir": str(tmp_path / "state")},
            },
        )
    before = digests(tmp_path)
    result = run(config)
    assert result.returncode == 2, result.stderr
    refusal = [line for line in result.stderr.splitlines() if "old layout" in line]
    assert len(refusal) == 1, result.stderr
    assert str(tmp_path / "state" / "state.sqlite3") in refusal[0]
    assert "single-job coordinator" in refusal[0] and "--migrate-state" in refusal[0] and "--reset-state" in refusal[0]
    assert "Traceback" not in result.stderr
    assert digests(tmp_path) == before


def test_migrate_state_takes_the_old_log_over_as_the_declared_jobs_and_every_rank_stays(tmp_path):
    """--migrate-state with a config of another plan refuses and moves nothing; with the
    config that wrote it, the log and its mark move to the job's place in the one layout and
    the job resumes: every worker gets the rank it had, signed by the same key."""
    ranks = write_legacy_state(tmp_path)
    bundle = TrustBundle.load(tmp_path / "keys" / "trust-bundle.json")
    before = digests(tmp_path)
    other_plan = single_job_config(tmp_path, ParallelPlan(dp_shard=2, tp=2), name="other.toml")
    result = run(other_plan, "--migrate-state")
    assert result.returncode == 2 and "moved nothing" in result.stderr and "pinned to plan" in result.stderr, (
        result.stderr
    )
    assert digests(tmp_path) == before

    process, port_file = start(single_job_config(tmp_path), "--migrate-state")
    try:
        assert process.poll() is None, (tmp_path / "log").read_text()
        address = port_file.read_text().strip()
        assert asyncio.run(ranks_served(address, bundle, LEGACY, WORKERS)) == ranks
        listed = admin.list_jobs(address, tls=False).jobs
        assert [(j.spec.job_id, j.state) for j in listed] == [(LEGACY, pb.RUNNING)]
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert not (tmp_path / "state" / "state.sqlite3").exists() and not (tmp_path / "keys" / "durable-mark").exists()
    assert (tmp_path / "state" / "jobs" / LEGACY / "state.sqlite3").exists()
    assert (tmp_path / "keys" / "marks" / LEGACY).exists()
    assert "--migrate-state: moved" in (tmp_path / "log").read_text()
    # A restart with the plain config serves it from its new place.
    port_file.unlink()
    process, port_file = start(single_job_config(tmp_path))
    try:
        assert process.poll() is None, (tmp_path / "log").read_text()
        assert asyncio.run(register_retrying(port_file.read_text().strip(), message(LEGACY, 1, 1))).attestation
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_reset_state_job_of_the_declared_job_ends_it_and_a_new_id_serves(tmp_path):
    """--reset-state --job works for the job a config declares as for any job: its log and
    mark are moved aside and it is not served again under its id (the config that still
    declares it is refused, naming why); a config with a new [job] id then serves, and the
    old job shows FAILED, saying why."""
    config = single_job_config(tmp_path)
    process, port_file = start(config)
    try:
        assert process.poll() is None, (tmp_path / "log").read_text()
        asyncio.run(register_retrying(port_file.read_text().strip(), message(LEGACY, 0, 0)))
    finally:
        process.terminate()
        assert process.wait(timeout=30) == 0
    port_file.unlink()
    result = run(config, "--reset-state", "--job", LEGACY)
    assert result.returncode == 2, result.stderr
    assert "moved aside by --reset-state --job" in result.stderr and "not served again" in result.stderr
    assert list((tmp_path / "state" / "jobs").glob(f"{LEGACY}.reset-*"))
    assert list((tmp_path / "keys" / "marks").glob(f"{LEGACY}.reset-*"))
    assert not (tmp_path / "state" / "jobs" / LEGACY).exists()

    process, port_file = start(single_job_config(tmp_path, job_id="fresh"))
    try:
        assert process.poll() is None, (tmp_path / "log").read_text()
        address = port_file.read_text().strip()
        asyncio.run(register_retrying(address, message("fresh", 0, 0)))
        jobs = {j.spec.job_id: j for j in admin.list_jobs(address, tls=False).jobs}
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert jobs["fresh"].state == pb.RUNNING
    assert jobs[LEGACY].state == pb.FAILED and "moved aside by --reset-state --job" in jobs[LEGACY].reason


# ---- the declaration, pure ---------------------------------------------------------------------


def declared(plan: ParallelPlan = PLAN, command: tuple[str, ...] = ()):
    from meshgate.coordinator.config import LaunchConfig, declared_spec
    from meshgate.coordinator.rendezvous import RendezvousConfig

    return declared_spec(RendezvousConfig(JOB, plan, slots_per_node=2), LaunchConfig(command=command))


def test_a_declaration_is_written_once_recorded_when_its_launch_changes_and_refused_for_another_plan():
    from meshgate.coordinator.jobs import ClusterState, JobState, JobSubmitted
    from meshgate.coordinator.rendezvous import Code, RendezvousError

    state = ClusterState()
    first = state.decide_declare(declared(), 1.0)
    assert [type(e) for e in first] == [JobSubmitted] and first[0].declared
    state.apply_all(first)
    job = state.jobs[JOB]
    assert job.declared and job.state is JobState.RUNNING and not job.nodes and JOB not in state.pending
    assert state.decide_declare(declared(), 2.0) == ()  # a restart with the same config adds nothing
    relaunched = state.decide_declare(declared(command=("python", "train.py")), 3.0)
    state.apply_all(relaunched)
    assert state.jobs[JOB].spec.command == ("python", "train.py") and state.jobs[JOB].state is JobState.RUNNING
    with pytest.raises(RendezvousError) as refused:
        state.decide_declare(declared(ParallelPlan(dp_shard=2, tp=2)), 4.0)
    assert refused.value.code is Code.FAILED_PRECONDITION
    assert PLAN.digest().hex() in refused.value.message  # both digests named
    assert ParallelPlan(dp_shard=2, tp=2).digest().hex() in refused.value.message
    # An id a submitted job holds is not the config's to declare.
    other = ClusterState()
    other.apply_all((JobSubmitted(JOB, declared(command=("true",)).to_json(), 1.0),))
    with pytest.raises(RendezvousError) as taken:
        other.decide_declare(declared(), 2.0)
    assert taken.value.code is Code.ALREADY_EXISTS and "Jobs API" in taken.value.message


def test_a_running_declared_job_the_config_no_longer_declares_refuses_until_it_ends():
    from meshgate.coordinator.jobs import ClusterState, JobState
    from meshgate.coordinator.rendezvous import Code, RendezvousError

    state = ClusterState()
    state.apply_all(state.decide_declare(declared(), 1.0))
    assert state.undeclared_running([JOB]) == []
    assert state.undeclared_running([]) == [JOB]
    with pytest.raises(RendezvousError) as refused:
        state.check_undeclared(["another"])
    assert refused.value.code is Code.FAILED_PRECONDITION
    assert f"job {JOB!r}" in refused.value.message and "'another'" in refused.value.message
    state.apply_all(state.decide_end(JOB, JobState.SUCCEEDED, "every worker exited 0", 2.0))
    state.check_undeclared(["another"])  # ended: a new [job] id may run


def test_a_config_whose_job_breaks_a_jobs_rules_is_refused_at_load_naming_the_key():
    from meshgate.coordinator.config import ConfigError, CoordinatorConfig

    document = {
        "job": {"id": JOB, "slots_per_node": 2},
        "plan": PLAN.to_dict(),
        "server": {"insecure": True},
        "launch": {"command": ["true"], "restart_policy": "on-failure", "max_restarts": 5000},
    }
    with pytest.raises(ConfigError, match=r"\[job\]/\[launch\]: max_restarts must be in \[0, 1000\]"):
        CoordinatorConfig.from_mapping(document)
    document["launch"]["max_restarts"] = 2
    ((spec, rendezvous),) = CoordinatorConfig.from_mapping(document).declared
    assert (spec.job_id, spec.max_restarts, spec.command, rendezvous.max_restarts) == (JOB, 2, ("true",), 2)
