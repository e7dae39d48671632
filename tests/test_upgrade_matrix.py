"""This release against earlier ones, each in its own install (issue 35): an earlier
release is built once per machine from its commit (git archive, pip install --no-deps
--target into a cache directory keyed by the commit, shared by every test here; its
dependencies are this venv's, which pyproject has not changed since) and run as its own
process with that directory first on PYTHONPATH and its working directory outside the
checkout.

The cells:
- this release's CLI against the coordinator of 91c899c (outside the policy), which reads
  JobSpec's enum fields (numbered 14-16 since) as unset and says nothing: the CLI finds the
  fields missing from the job the coordinator recorded, cancels it and says which fields
  and which side to upgrade;
- a running mTLS cluster of the previous landed release (7736840) upgraded to this one as
  docs/operating.md "Upgrading" says: the coordinator first with a job running and a hot
  spare, then agent by agent (a stop, a kill -9 each way), the coordinator rolled back and
  forth, each job ending truthfully and every Register answer checked for one holder per
  (generation, rank); then a drain of a 0.1.0 agent's node (the spare takes its block) and the
  rollback's limit: 0.1.0 exits naming the event kind NodeDrained, leaves the state as found,
  and this release serves it again;
- every value of every enum field of JobSpec across the skew, both ways (this CLI against
  0.1.0's coordinator, 0.1.0's client against this coordinator);
- `meshgate job logs` of a 91c899c agent under this coordinator: named at once, exit 1.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Optional

import grpc
import pytest

from conftest import REPO, worker_env
from test_jobs_cluster import LIGHT, Cluster
from meshgate import admin, wire
from meshgate.connection import Connection, RendezvousRefused
from meshgate.plan import ParallelPlan
from meshgate.tls import secure_channel
from meshgate.v1 import rendezvous_pb2 as pb
from meshgate.v1 import rendezvous_pb2_grpc

pytestmark = pytest.mark.slow

BEFORE_ENUMS = "91c899c"  # JobSpec's mode, topology_policy and restart_policy were strings
PREVIOUS = "7736840"  # the release landed before this one (0.1.0, "stop 36"): it sends no version


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


def plain_coordinator(base: Path, site: Optional[Path]):
    """A jobs-mode coordinator (plaintext, SQLite) of the release installed at ``site``, or
    of this checkout (None); yields its Connection."""
    config = base / "coordinator.toml"
    config.write_text(
        '[cluster]\nheartbeat_interval_s = 5.0\n[server]\nlisten = "127.0.0.1:0"\ninsecure = true\n'
        f'[keys]\ndir = "{base}/keys"\n[store]\nkind = "sqlite"\ndir = "{base}/state"\n'
    )
    port_file, log = base / "addr", open(base / "log", "wb")
    env = worker_env(PYTHONPATH=str(site)) if site is not None else worker_env()
    process = subprocess.Popen(
        [sys.executable, "-m", "meshgate.coordinator", "--config", config, "--port-file", port_file],
        cwd=base if site is not None else REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while not port_file.exists():
        assert process.poll() is None and time.monotonic() < deadline, (base / "log").read_text()
        time.sleep(0.05)
    connection = Connection(port_file.read_text().strip(), None)
    yield connection
    connection.close()
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def old_coordinator(tmp_path_factory):
    yield from plain_coordinator(tmp_path_factory.mktemp("old-coordinator"), release_install(BEFORE_ENUMS))


@pytest.fixture(scope="module")
def previous_coordinator(tmp_path_factory):
    yield from plain_coordinator(tmp_path_factory.mktemp("previous-coordinator"), release_install(PREVIOUS))


@pytest.fixture(scope="module")
def this_coordinator(tmp_path_factory):
    yield from plain_coordinator(tmp_path_factory.mktemp("this-coordinator"), None)


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


# ---- inside the policy, every enum field of JobSpec across the skew, both ways --------------------

JOBSPEC_ENUM_VALUES = [
    (f.name, number)
    for f in pb.JobSpec.DESCRIPTOR.fields
    if f.enum_type is not None
    for number in sorted(f.enum_type.values_by_number)[1:]  # UNSPECIFIED is the default
]


def enum_spec(job_id: str, field: str, value: int) -> pb.JobSpec:
    sent = spec(job_id, **{field: value})
    if field == "mode" and value == pb.RANK_MODE_CLAIMED:
        sent.ClearField("command")  # a claimed job's workers are the framework's
    return sent


def job_id_for(field: str, value: int) -> str:
    return f"{field.replace('_', '-')}-{value}"


@pytest.fixture(scope="module")
def previous_jobspec_enums() -> frozenset[str]:
    """The enum fields of JobSpec the previous release's own proto has."""
    listed = subprocess.run(
        [
            sys.executable,
            "-c",
            "from meshgate.v1 import rendezvous_pb2 as pb; "
            "print(' '.join(f.name for f in pb.JobSpec.DESCRIPTOR.fields if f.enum_type is not None))",
        ],
        env=worker_env(PYTHONPATH=str(release_install(PREVIOUS))),
        cwd=release_install(PREVIOUS),
        capture_output=True,
        text=True,
        check=True,
    )
    return frozenset(listed.stdout.split())


@pytest.mark.parametrize("field, value", JOBSPEC_ENUM_VALUES)
def test_this_cli_against_the_previous_coordinator_records_each_enum_value_or_refuses_it_by_name(
    previous_coordinator, previous_jobspec_enums, field, value
):
    """Every value of every enum field this CLI can send: recorded as sent by the previous
    release's coordinator where that release has the field; where it has not (`launch`,
    new in 0.2.0), refused naming the field, its value and what to upgrade, nothing recorded
    (that release refuses a field it does not know by its number only)."""
    job_id = job_id_for(field, value)
    sent = enum_spec(job_id, field, value)
    if field in previous_jobspec_enums:
        recorded = admin.submit_job(previous_coordinator, sent, wait_for_nodes=True)
        assert getattr(recorded.spec, field) == value, recorded.spec
        assert getattr(admin.get_job(previous_coordinator, job_id).spec, field) == value
        return
    with pytest.raises(RendezvousRefused) as refused:
        admin.submit_job(previous_coordinator, sent, wait_for_nodes=True)
    name = pb.JobSpec.DESCRIPTOR.fields_by_name[field].enum_type.values_by_number[value].name
    message = refused.value.details
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION, message
    assert f"refused spec.{field} = {name} (field " in message, message
    assert f"release {wire.RELEASE}, wire {wire.WIRE_VERSION}" in message and "Upgrade the coordinator" in message
    with pytest.raises(RendezvousRefused) as unknown:
        admin.get_job(previous_coordinator, job_id)
    assert unknown.value.code == grpc.StatusCode.NOT_FOUND


PREVIOUS_CLIENT_SUBMITS = """
import sys
from meshgate import admin
from meshgate.v1 import rendezvous_pb2 as pb
address = sys.argv[1]
for argument in sys.argv[2:]:
    field, value = argument.split("=")
    job_id = field.replace("_", "-") + "-" + value
    spec = pb.JobSpec(job_id=job_id, nodes=1, command=["true"], **{field: int(value)})
    spec.plan.dp_shard = 2
    if field == "mode" and int(value) == pb.RANK_MODE_CLAIMED:
        spec.ClearField("command")
    admin.submit_job(address, spec, wait_for_nodes=True)
    print(job_id)
"""


def test_the_previous_release_s_client_against_this_coordinator_records_each_enum_value_as_sent(
    this_coordinator, previous_jobspec_enums
):
    """The other way: the previous release's own admin.submit_job (its CLI's and launchers'
    call), each value of each enum field its JobSpec has, read back from this coordinator."""
    sent = [(f, v) for f, v in JOBSPEC_ENUM_VALUES if f in previous_jobspec_enums]
    submitted = subprocess.run(
        [sys.executable, "-c", PREVIOUS_CLIENT_SUBMITS, this_coordinator.coordinator]
        + [f"{field}={value}" for field, value in sent],
        env=worker_env(PYTHONPATH=str(release_install(PREVIOUS))),
        cwd=release_install(PREVIOUS),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert submitted.returncode == 0, submitted.stderr
    assert submitted.stdout.split() == [job_id_for(f, v) for f, v in sent]
    for field, value in sent:
        assert getattr(admin.get_job(this_coordinator, job_id_for(field, value)).spec, field) == value, (field, value)


def test_a_call_the_older_coordinator_does_not_have_names_it_and_what_to_upgrade(old_coordinator):
    """Not gRPC's bare "UNIMPLEMENTED: Method not found!" (ListNodes came after 91c899c)."""
    with pytest.raises(RendezvousRefused) as refused:
        admin.list_nodes(old_coordinator)
    assert refused.value.code.name == "UNIMPLEMENTED"
    assert refused.value.details.startswith("ListNodes: the coordinator has no such call: it is older than this client")
    assert "upgrade the coordinator" in refused.value.details


# ---- a running cluster upgraded from the previous landed release --------------------------------


class MixedCluster(Cluster):
    """tests/test_jobs_cluster.py's mTLS cluster whose daemons each run this release or the
    previous one (``previous``: "coordinator" and node ids), switched by a restart on the
    same config and state. A process of the previous release runs outside the checkout (its
    working directory is the cluster's root, so the checkout's meshgate is not first on its
    path) with that release's install first on PYTHONPATH; its workers inherit it."""

    def __init__(self, root: Path, site: Path, previous: set[str]) -> None:
        self.site, self.previous = site, set(previous)
        # 15 s (30 heartbeats of 0.5 s) before a node is lost: an agent restarted at once is
        # back well inside it even on a loaded machine, so a kill -9 and a restart is a
        # rejoin, never a loss (a loss is a stop here: the agent leaves, and nothing waits).
        super().__init__(
            root,
            nodes=("n0", "n1", "n2"),
            labels={n: {"switch": "s1"} for n in ("n0", "n1", "n2")},
            cluster={"heartbeat_misses": 30},
        )

    def agent_sections(self, table: dict) -> dict[str, dict]:
        """The simulated host's own machine-id staged for this release (docs/operating.md,
        "Upgrading"): the previous release knows no such key and ignores [future.agent];
        it sends no hardware, so its agents clash with nothing."""
        return {
            "agent": {k: v for k, v in table.items() if k != "machine_id_file"},
            "future.agent": {"machine_id_file": table["machine_id_file"]},
        }

    def spawn(self, daemon, argv, log_path, env):
        if daemon not in self.previous:
            return super().spawn(daemon, argv, log_path, env)
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                [sys.executable, *argv],
                cwd=self.root,
                env=worker_env(**env, PYTHONPATH=str(self.site)),
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def restart_coordinator(self, release: str) -> None:
        """SIGTERM, then the same config and state under ``release`` ("previous" or "this")."""
        assert self.coordinator.stop() == 0, self.coordinator.log()[-3000:]
        self.runs("coordinator", release)
        self.coordinator = self._start()

    def restart_agent(self, node_id: str, release: str, kill: bool = False) -> None:
        """kill -9 (``kill``) or SIGTERM of the node's agent, then ``release``'s at once."""
        process = self.agents[node_id]
        if kill:
            process.kill()
        else:
            process.terminate()
        process.wait(timeout=30)
        self.runs(node_id, release)
        self.start_agent(node_id)

    def runs(self, daemon: str, release: str) -> None:
        assert release in ("previous", "this"), release
        if release == "previous":
            self.previous.add(daemon)
        else:
            self.previous.discard(daemon)


@pytest.fixture(scope="module")
def mixed_cluster(tmp_path_factory):
    """The previous release everywhere: coordinator and agents n0, n1, n2."""
    cluster = MixedCluster(
        tmp_path_factory.mktemp("upgrade"), release_install(PREVIOUS), {"coordinator", "n0", "n1", "n2"}
    )
    try:
        cluster.wait_joined()
        yield cluster
    finally:
        cluster.close()


def lingering_job(cluster: MixedCluster, job_id: str, out: Path, release: Path, members: list[str]) -> pb.JobInfo:
    """``members`` pinned, the third node its hot spare; every worker keeps a result per
    generation (each Register answer it got) and lingers, heartbeating, until ``release``."""
    job = cluster.submit(
        job_id,
        ParallelPlan(dp_shard=4),
        2,
        LIGHT,
        node_ids=members,
        spares=1,
        restart_policy="on-failure",
        max_restarts=10,
        lost_node_timeout_s=60.0,
        env={
            "LIGHT_OUT": str(out),
            "LIGHT_SLEEP": "300",
            "LIGHT_EXIT_0_WHEN": str(release),
            "LIGHT_HEARTBEAT": "0.2",
            "LIGHT_KEEP_GENERATIONS": "1",
        },
    )
    deadline = time.monotonic() + 30
    while job.state == pb.PENDING:  # a restarted coordinator hears from each node afresh
        assert time.monotonic() < deadline, (job, cluster.logs())
        time.sleep(0.1)
        job = cluster.job(job_id)
    assert list(job.nodes) == members and len(job.spare_nodes) == 1, job
    return job


def held_in(out: Path, generation: int, cluster: MixedCluster, timeout: float = 60) -> dict[int, str]:
    """Generation ``generation``'s four Register answers: rank -> node."""
    deadline = time.monotonic() + timeout
    while len(list(out.glob(f"*.g{generation}.result"))) < 4:
        assert time.monotonic() < deadline, f"generation {generation} never formed\n{cluster.logs()}"
        time.sleep(0.1)
    answers = [json.loads(p.read_text()) for p in out.glob(f"*.g{generation}.result")]
    return {a["rank"]: a["node_id"] for a in answers}


def one_holder_each(out: Path) -> list[tuple[int, int]]:
    """Every Register answer any worker got, one result per worker and generation: no
    (generation, rank) has two holders."""
    holders = [(a["generation"], a["rank"]) for a in map(json.loads, (p.read_text() for p in out.glob("*.result")))]
    assert sorted(holders) == sorted(set(holders)), sorted(holders)
    return sorted(holders)


def agent_versions(cluster: MixedCluster, expected: dict[str, str]) -> dict[str, str]:
    """Each node's agent release as ``meshgate nodes`` shows it, once it is ``expected`` (a
    restarted coordinator learns each from the agent's next heartbeat)."""
    deadline = time.monotonic() + 10
    while True:
        shown = {n.node_id: n.agent_release for n in admin.list_nodes(cluster.address, tls=cluster.admin_tls).nodes}
        if shown == expected or time.monotonic() > deadline:
            return shown
        time.sleep(0.1)


def workers_alive(out: Path) -> list[str]:
    """The workers that got a Register answer and still run (zombies aside), by node,
    local rank and generation."""
    alive = []
    for answer in (json.loads(p.read_text()) for p in out.glob("*.result")):
        status = Path(f"/proc/{answer['pid']}/status")
        if status.exists() and "\nState:\tZ" not in status.read_text():
            alive.append(f"{answer['node_id']}/{answer['local_rank']} g{answer['generation']} pid {answer['pid']}")
    return sorted(alive)


def only_generation_runs(out: Path, generation: int) -> bool:
    """The workers alive are exactly ``generation``'s four: none of an earlier one lingers
    beside them (a kill -9'd agent's orphans included)."""
    alive = workers_alive(out)
    assert len(alive) == 4 and all(f" g{generation} " in w for w in alive), alive
    return True


def checks_versions(cluster: MixedCluster) -> bool:
    """Whether the coordinator now serving is this release: it refuses a client outside the
    skew policy, where the previous release (which reads no versions) serves it."""
    channel = secure_channel(cluster.address, cluster.admin_tls)
    try:
        stub = rendezvous_pb2_grpc.AdminStub(channel)
        stub.ListJobs(pb.ListJobsRequest(), metadata=(("meshgate-wire", "99"),), timeout=10)
        return False
    except grpc.RpcError as refused:
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION, refused
        return True
    finally:
        channel.close()


def test_a_running_cluster_upgraded_from_the_previous_release_keeps_one_holder_per_rank(mixed_cluster, tmp_path):
    """The issue's "Done when", step by step: the coordinator first with a job running, then
    agents one by one (a stop and a kill -9 each way), a hot spare promoted in both
    directions (an old spare under this coordinator; this release's spare under the previous
    coordinator, rolled back to), every job ending truthfully."""
    cluster = mixed_cluster
    out, release = tmp_path / "A", tmp_path / "A.release"
    out.mkdir()
    lingering_job(cluster, "A", out, release, ["n0", "n1"])
    assert held_in(out, 0, cluster) == {0: "n0", 1: "n0", 2: "n1", 3: "n1"}
    assert not checks_versions(cluster)  # the previous release's coordinator

    # 1. The coordinator first: the running job keeps its generation and its workers.
    cluster.restart_coordinator("this")
    assert checks_versions(cluster)
    info = cluster.job("A")
    assert (info.state, info.status.generation, list(info.spare_nodes)) == (pb.RUNNING, 0, ["n2"]), info
    unversioned = {n: wire.UNVERSIONED_RELEASE for n in cluster.nodes}
    assert agent_versions(cluster, unversioned) == unversioned
    # `job logs` through this coordinator from the previous release's agents: answered.
    logs = subprocess.run(
        [sys.executable, "-c", "import sys; from meshgate.cli import main; sys.exit(main(sys.argv[1:]))"]
        + cluster.cli("logs", "A", "--tail", "1"),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert logs.returncode == 0 and logs.stderr == "", logs
    assert sorted(line.split("]")[0] for line in logs.stdout.splitlines()) == [f"[rank {r}" for r in range(4)], logs

    # 2. kill -9 of an old agent, this release's back at once (inside the loss timeout):
    # its Join ends the generation (it cannot show it is the old instance), the old one's
    # ranks are not handed to new workers in the same generation.
    cluster.restart_agent("n0", "this", kill=True)
    assert held_in(out, 1, cluster) == {0: "n0", 1: "n0", 2: "n1", 3: "n1"}
    assert only_generation_runs(out, 1)  # the old agent's orphans were killed before the Join

    # 3. An old agent stopped (it leaves the job): the old hot spare takes its block.
    cluster.restart_agent("n1", "this")
    assert held_in(out, 2, cluster) == {0: "n0", 1: "n0", 2: "n2", 3: "n2"}
    assert only_generation_runs(out, 2)

    # 4. The other direction: this release's agent killed -9, the previous one back at once.
    cluster.restart_agent("n0", "previous", kill=True)
    assert held_in(out, 3, cluster) == {0: "n0", 1: "n0", 2: "n2", 3: "n2"}
    assert only_generation_runs(out, 3)

    release.touch()
    ended = cluster.wait_ended("A")
    assert ended.state == pb.SUCCEEDED and ended.status.generation == 3, (ended, cluster.logs())
    cluster.wait_idle()
    assert one_holder_each(out) == [(g, r) for g in range(4) for r in range(4)]
    assert workers_alive(out) == []

    # 5. The coordinator rolled back (no drain, no replacement from the pool yet): this
    # release's agent n1 is the hot spare of a job of the previous coordinator.
    cluster.restart_coordinator("previous")
    assert not checks_versions(cluster)
    out_b, release_b = tmp_path / "B", tmp_path / "B.release"
    out_b.mkdir()
    lingering_job(cluster, "B", out_b, release_b, ["n0", "n2"])
    assert held_in(out_b, 0, cluster) == {0: "n0", 1: "n0", 2: "n2", 3: "n2"}
    cluster.restart_agent("n2", "this")
    assert held_in(out_b, 1, cluster) == {0: "n0", 1: "n0", 2: "n1", 3: "n1"}
    cancelled = admin.cancel_job(cluster.address, "B", tls=cluster.admin_tls)
    cluster.wait_idle()
    assert cluster.job("B").state == pb.CANCELLED, cancelled
    assert one_holder_each(out_b) == [(g, r) for g in range(2) for r in range(4)]
    assert workers_alive(out_b) == []

    # 6. Upgraded whole: the coordinator again, then the last old agent.
    cluster.restart_coordinator("this")
    cluster.restart_agent("n0", "this")
    cluster.wait_idle()
    upgraded = {n: wire.RELEASE for n in cluster.nodes}
    assert agent_versions(cluster, upgraded) == upgraded


def pool_state(cluster: MixedCluster, node_id: str, wanted: int, timeout: float = 30) -> pb.PoolNode:
    deadline = time.monotonic() + timeout
    while True:
        node = {n.node_id: n for n in admin.list_nodes(cluster.address, tls=cluster.admin_tls).nodes}[node_id]
        if node.state == wanted:
            return node
        assert time.monotonic() < deadline, (node, cluster.logs())
        time.sleep(0.1)


def test_a_drained_old_agent_hands_its_block_to_the_spare_and_then_rollback_is_refused_as_found(
    mixed_cluster, tmp_path
):
    """A drain (new in 0.2.0) of a node whose agent is 0.1.0, serving a job under this
    coordinator: the spare takes its block, the old agent stops its workers and the node ends
    cordoned. Then the guide's limit of a coordinator rollback: 0.1.0 cannot read the
    NodeDrained now in the log, exits naming it and changes nothing on disk; this release
    started again serves the same state."""
    cluster = mixed_cluster
    if "coordinator" in cluster.previous:  # run alone: the fixture starts at the previous release
        cluster.restart_coordinator("this")
    if "n1" not in cluster.previous:
        cluster.restart_agent("n1", "previous")
    out, release = tmp_path / "D", tmp_path / "D.release"
    out.mkdir()
    lingering_job(cluster, "D", out, release, ["n0", "n1"])
    assert held_in(out, 0, cluster) == {0: "n0", 1: "n0", 2: "n1", 3: "n1"}
    admin.cordon_node(cluster.address, "n1", "upgrade", drain=True, tls=cluster.admin_tls)
    assert held_in(out, 1, cluster) == {0: "n0", 1: "n0", 2: "n2", 3: "n2"}
    assert pool_state(cluster, "n1", pb.POOL_STATE_CORDONED).agent_release == wire.UNVERSIONED_RELEASE
    assert only_generation_runs(out, 1)  # the drained old agent's workers are gone
    release.touch()
    assert cluster.wait_ended("D").state == pb.SUCCEEDED
    assert one_holder_each(out) == [(g, r) for g in range(2) for r in range(4)]

    assert cluster.coordinator.stop() == 0
    state = cluster.root / "state"
    before = {p.name: p.read_bytes() for p in state.iterdir() if p.is_file()}
    cluster.runs("coordinator", "previous")
    with pytest.raises(RuntimeError, match="coordinator exited") as refused:
        cluster.coordinator = cluster._start()
    assert "unknown event kind 'NodeDrained'" in str(refused.value), refused.value
    assert {p.name: p.read_bytes() for p in state.iterdir() if p.is_file()} == before

    cluster.runs("coordinator", "this")
    cluster.coordinator = cluster._start()
    assert pool_state(cluster, "n1", pb.POOL_STATE_CORDONED).cordoned
    admin.cordon_node(cluster.address, "n1", "", uncordon=True, tls=cluster.admin_tls)
    cluster.restart_agent("n1", "this")
    cluster.wait_idle()


def test_job_logs_of_a_91c899c_agent_names_it_at_once_and_exits_1(tmp_path):
    """The issue's `job logs` on an agent of 91c899c (outside the policy, before agent
    instances and before job logs): it ignores the request, so this coordinator waited for it
    20 s and the CLI exited 0. Now the node is named at once with its version."""
    (tmp_path / "coordinator").mkdir()
    for coordinator in plain_coordinator(tmp_path / "coordinator", None):
        address = coordinator.coordinator
        config = tmp_path / "agent.toml"
        token = admin.create_join_token(address, "", node_id="n0").token
        config.write_text(
            f'[agent]\ncoordinator = "{address}"\nnode_id = "n0"\njoin_token = "{token}"\nslots = 1\n'
            f'state_dir = "{tmp_path}/agent-state"\ninsecure = true\ndrain_grace_s = 2\n'
        )
        with open(tmp_path / "agent.log", "wb") as log:
            agent = subprocess.Popen(
                [sys.executable, "-m", "meshgate.agent", "--config", config],
                cwd=tmp_path,
                env=worker_env(PYTHONPATH=str(release_install(BEFORE_ENUMS))),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            sleeper = pb.JobSpec(job_id="quiet", nodes=1, plan=ParallelPlan(dp_shard=1).to_proto())
            sleeper.command.extend([sys.executable, "-c", "print('hello', flush=True); import time; time.sleep(60)"])
            assert admin.submit_job(coordinator, sleeper, wait_for_nodes=True).spec.job_id == "quiet"
            deadline = time.monotonic() + 60
            while admin.get_job(coordinator, "quiet").state != pb.RUNNING:
                assert time.monotonic() < deadline, (tmp_path / "agent.log").read_text()
                time.sleep(0.1)
            started = time.monotonic()
            logs = subprocess.run(
                [sys.executable, "-c", "import sys; from meshgate.cli import main; sys.exit(main(sys.argv[1:]))"]
                + ["job", "logs", "quiet", "--coordinator", address],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=REPO,
                env=worker_env(),
            )
            took = time.monotonic() - started
            assert logs.returncode == 1 and took < 10, (took, logs)
            assert f"node n0's agent is {wire.PRE_INSTANCES.described}, which has no job logs" in logs.stderr, logs
            admin.cancel_job(coordinator, "quiet")
        finally:
            agent.terminate()
            agent.wait(timeout=30)
