"""Jobs mode on etcd, in process against a real etcd: one session (client, lease, leader
key) holds the cluster's log and every job's log under one root, every write fenced on the
leader key. A deposed leader writes to no job's log; a new leader reads the cluster's log
and the logs of the jobs it will reopen; a pruned job's prefix is deleted.

The real-process HA tests of jobs mode (kill -9 of the leader, etcd stopped and restarted,
with two jobs running) are in tests/test_etcd_ha_jobs.py."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import pytest

from meshgate.coordinator.jobs import JobAllocated, JobEnded, JobState, JobSubmitted, JobSummarized
from meshgate.coordinator.__main__ import reset_state
from meshgate.coordinator.config import CoordinatorConfig
from meshgate.coordinator.leadership import StateRefused, job_logs_in_use, job_store_dropper, job_store_opener
from meshgate.coordinator.rendezvous import GenerationBumped, RendezvousConfig, RendezvousError
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb
from meshgate.coordinator.store import StoreError
from meshgate.coordinator.store.codec import JobPinned, cluster_pin
from meshgate.coordinator.store.etcd import EtcdJobLogs, EtcdLog, EtcdSession, LogNotReadYet
from meshgate.coordinator.store.mark import DurableMark

pytestmark = pytest.mark.slow


def pin(job_id: str) -> JobPinned:
    return JobPinned(job_id, "0" * 64, "{}")


def bump(n: int) -> GenerationBumped:
    return GenerationBumped(n, f"test {n}")


async def leader(etcd_server, root: str, ttl: int = 30) -> EtcdSession:
    session = EtcdSession([etcd_server.endpoint], root, f"coordinator-{secrets.token_hex(2)}", ttl)
    await session.connect()
    assert await session.campaign(asyncio.Event(), poll_s=0.05)
    return session


async def keys_under(session: EtcdSession, prefix: str) -> dict[str, bytes]:
    return {kv.key.decode(): kv.value for kv in await session.read_prefix(prefix)}


def test_a_deposed_leader_writes_to_no_jobs_log_and_the_new_leader_reads_what_was_acknowledged(etcd_server, tmp_path):
    """A leads and writes the cluster's log and job j1's log; its lease is revoked (as when
    it expires in a partition) and B wins. A's next appends to j1's log and to the
    cluster's log are refused (fenced), nothing of them lands in etcd, and A's term is over;
    B reads both logs as A had them acknowledged."""
    root = f"/meshgate/t{secrets.token_hex(3)}/"

    async def scenario():
        a = await leader(etcd_server, root)
        cluster_a = EtcdLog(a, root, cluster_pin(), DurableMark(tmp_path / "a-cluster", "cluster"))
        await cluster_a.read()
        acknowledged = [JobSubmitted("j1", "{}", 1.0), JobAllocated("j1", ("n0",), (), 2.0)]
        await cluster_a.append(acknowledged)
        logs_a = EtcdJobLogs(a, ())  # j1 was allocated in this term: its log is new
        j1_a = logs_a.open(pin("j1"), DurableMark(tmp_path / "a-j1", "j1"))
        await j1_a.append([bump(1), bump(2)])
        layout = await keys_under(a, root)
        assert sorted(layout) == [
            f"{root}events/000000000001",
            f"{root}events/000000000002",
            f"{root}events/000000000003",
            f"{root}jobs/j1/events/000000000001",
            f"{root}jobs/j1/events/000000000002",
            f"{root}jobs/j1/events/000000000003",
            f"{root}jobs/j1/meta",
            f"{root}leader",
            f"{root}meta",
        ]

        await a.client.revoke_lease(a.lease.id)  # A's lease is gone: its leader key with it
        b = await leader(etcd_server, root)
        before = await keys_under(b, root + "jobs/")
        with pytest.raises(StoreError, match="fenced"):
            await j1_a.append([bump(3)])
        assert a.lost_leadership.is_set() and not j1_a.healthy()
        with pytest.raises(StoreError):
            await cluster_a.append([JobEnded("j1", "CANCELLED", "deposed", 3.0)])
        assert await keys_under(b, root + "jobs/") == before, "a deposed leader wrote to a job's log"

        cluster_b = EtcdLog(b, root, cluster_pin(), DurableMark(tmp_path / "b-cluster", "cluster"))
        await cluster_b.read()
        assert cluster_b.load() == acknowledged
        logs_b = EtcdJobLogs(b, job_logs_in_use(cluster_b.load()))
        await logs_b.prefetch()
        j1_b = logs_b.open(pin("j1"), DurableMark(tmp_path / "b-j1", "j1"))
        assert j1_b.load() == [bump(1), bump(2)]
        await j1_b.append([bump(3)])  # the new leader writes on from there
        for session in (a, b):
            await session.aclose()

    asyncio.run(scenario())


def test_a_job_log_behind_its_mark_is_refused_and_a_new_job_never_writes_over_a_log(etcd_server, tmp_path):
    """The same high-water marks as jobs mode on SQLite (``<keys>/marks/<id>``): a job's log
    in etcd shorter than its mark is refused naming both. A job allocated during the term
    gets a new log, whose first write is refused if a log is there already."""
    root = f"/meshgate/t{secrets.token_hex(3)}/"

    async def scenario():
        a = await leader(etcd_server, root)
        logs = EtcdJobLogs(a, ())
        j2 = logs.open(pin("j2"), DurableMark(tmp_path / "j2", "j2"))  # allocated in this term: new
        await j2.append([bump(1), bump(2)])
        await a.client.delete(f"{root}jobs/j2/events/000000000003".encode())  # etcd lost an acknowledged record
        again = EtcdJobLogs(a, ("j2",))
        await again.prefetch()
        with pytest.raises(StoreError, match=r"holds 2 records, but 3 were acknowledged.*high-water mark"):
            again.open(pin("j2"), DurableMark(tmp_path / "j2", "j2"))

        over = EtcdJobLogs(a, ()).open(pin("j2"), DurableMark(tmp_path / "j2-elsewhere", "j2"))
        with pytest.raises(StoreError, match="jobs/j2/meta exists already"):
            await over.append([bump(9)])
        await a.aclose()

    asyncio.run(scenario())


def test_a_job_log_opened_again_is_read_in_the_background_and_pruning_deletes_its_prefix(etcd_server, tmp_path):
    """A log already opened once this term (a replay of an ended job) is read from etcd
    again without blocking: LogNotReadYet (the cluster retries), then it opens. Pruning
    deletes the job's prefix and its mark, and nothing else."""
    root = f"/meshgate/t{secrets.token_hex(3)}/"
    config = CoordinatorConfig.from_mapping(
        {
            "server": {"insecure": True},
            "keys": {"dir": str(tmp_path / "keys")},
            "store": {"kind": "etcd", "endpoints": [etcd_server.endpoint]},
        }
    )

    async def scenario():
        a = await leader(etcd_server, root)
        logs = EtcdJobLogs(a, ())
        marks = Path(config.keys_dir) / "marks"
        marks.mkdir(parents=True)
        for job_id in ("j3", "j30"):
            store = logs.open(pin(job_id), DurableMark(marks / job_id, job_id))
            await store.append([bump(1)])
            store.close()
        with pytest.raises(LogNotReadYet):
            logs.open(pin("j3"), None)
        deadline = asyncio.get_running_loop().time() + 30
        while True:
            try:
                assert logs.open(pin("j3"), None).load() == [bump(1)]
                break
            except LogNotReadYet:
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.05)

        drop = job_store_dropper(config, logs)
        await asyncio.to_thread(drop, "j3")
        assert await keys_under(a, f"{root}jobs/j3/") == {}
        assert not (marks / "j3").exists() and (marks / "j30").exists()
        assert len(await keys_under(a, f"{root}jobs/j30/")) == 3  # a job whose id starts alike is kept

        await a.client.revoke_lease(a.lease.id)
        b = await leader(etcd_server, root)
        with pytest.raises(RendezvousError, match="not deleted"):
            await asyncio.to_thread(drop, "j30")  # deposed: refused, and A's term ends
        assert a.lost_leadership.is_set() and len(await keys_under(b, f"{root}jobs/j30/")) == 3
        for session in (a, b):
            await session.aclose()

    asyncio.run(scenario())


def test_a_new_term_reads_the_logs_of_running_jobs_and_of_ended_ones_not_yet_summarized():
    events = [
        JobSubmitted("run", "{}", 1),
        JobAllocated("run", ("n0",), (), 2),
        JobSubmitted("pending", "{}", 3),
        JobSubmitted("ended", "{}", 4),
        JobAllocated("ended", ("n1",), (), 5),
        JobEnded("ended", JobState.SUCCEEDED, "", 6),
        JobSubmitted("done", "{}", 7),
        JobAllocated("done", ("n2",), (), 8),
        JobEnded("done", JobState.FAILED, "", 9),
        JobSummarized("done", "", 10),
        JobSubmitted("never", "{}", 11),
        JobEnded("never", "CANCELLED", "", 12),
    ]
    assert job_logs_in_use(events) == {"run", "ended"}


def etcd_config(tmp_path: Path, endpoint: str = "127.0.0.1:2379") -> CoordinatorConfig:
    """Jobs mode (no [job]) on etcd: accepted."""
    return CoordinatorConfig.from_mapping(
        {
            "server": {"insecure": True},
            "keys": {"dir": str(tmp_path / "keys")},
            "store": {"kind": "etcd", "endpoints": [endpoint]},
        }
    )


def test_garbage_in_a_jobs_log_in_etcd_refuses_that_job_naming_the_key(etcd_server, tmp_path):
    root = f"/meshgate/t{secrets.token_hex(3)}/"
    config = etcd_config(tmp_path, etcd_server.endpoint)
    job = RendezvousConfig(job_id="bad", plan=ParallelPlan(dp_shard=2), slots_per_node=2)
    config.keys_dir.mkdir()  # as the daemon's key ring leaves it

    async def scenario():
        a = await leader(etcd_server, root)
        await a.client.put(f"{root}jobs/bad/meta".encode(), b'{"schema": 2, "job_id": "bad"}')
        await a.client.put(f"{root}jobs/bad/events/000000000001".encode(), b"\x00 not json")
        logs = EtcdJobLogs(a, ("bad",))
        await logs.prefetch()
        with pytest.raises(StateRefused, match=f"etcd key {root}jobs/bad/events/000000000001"):
            job_store_opener(config, logs)(job)
        await a.aclose()

    asyncio.run(scenario())


def test_reset_state_on_etcd_is_refused_naming_the_clusters_prefix(tmp_path):
    config = etcd_config(tmp_path)
    with pytest.raises(
        StoreError, match=r"etcdctl del --prefix /meshgate/cluster/\), move .*/keys/marks aside and provision a new"
    ):
        reset_state(config)
    with pytest.raises(StoreError, match="delete etcd prefix /meshgate/cluster/jobs/j1/"):
        reset_state(config, "j1")
    assert not (tmp_path / "keys").exists()


def test_a_cluster_on_etcd_reopens_its_running_job_after_a_takeover_and_prunes_an_ended_jobs_prefix(
    etcd_server, tmp_path
):
    """In process, the daemon's own pieces (leadership._read_logs, the etcd opener and
    dropper) under a ClusterCoordinator: A runs jobs a and b, a ends; A is deposed and B
    leads. B reads b's log (running) but not a's (summarized), serves b as A left it, and
    once the retention has passed deletes a's prefix and mark, and nothing of b's."""
    from test_job_lifecycle_cost import Clock, claimed, joined

    from meshgate.coordinator import readmodel
    from meshgate.coordinator.cluster import ClusterCoordinator
    from meshgate.coordinator.keys import KeyRing
    from meshgate.coordinator.leadership import _read_logs, durable_mark, etcd_root, log_pin

    config = CoordinatorConfig.from_mapping(
        {
            "server": {"insecure": True},
            "keys": {"dir": str(tmp_path / "keys")},
            "store": {"kind": "etcd", "endpoints": [etcd_server.endpoint]},
            "cluster": {"retention": "1h"},
        }
    )
    root, clock = etcd_root(config), Clock()
    keys = KeyRing(config.keys_dir)

    async def term() -> tuple[EtcdSession, ClusterCoordinator, EtcdJobLogs]:
        session = await leader(etcd_server, root)
        own_log = EtcdLog(session, root, log_pin(config), durable_mark(config))
        job_logs = await _read_logs(config, session, own_log)
        cluster = ClusterCoordinator(
            own_log,
            keys,
            job_store_opener(config, job_logs),
            attestation_ttl_s=60,
            heartbeat_timeout_s=1e9,
            require_vouch=False,
            clock=clock,
            drop_job_store=job_store_dropper(config, job_logs),
            retention_s=config.retention_s,
        )
        await cluster.start()
        return session, cluster, job_logs

    async def scenario():
        a, first, _ = await term()
        await joined(first, "n0")
        await joined(first, "n1")
        await first.submit(claimed("a", "n0"))
        await first.submit(claimed("b", "n1"))
        await first.finish("a", True, "done")
        running = readmodel.job_info(first, first.job("b"))
        logs_kept = await keys_under(a, f"{root}jobs/")
        assert {key.split("/")[4] for key in logs_kept} == {"a", "b"}
        assert f"{root}jobs/a/meta" in logs_kept and f"{root}jobs/b/meta" in logs_kept
        first.close()
        await a.client.revoke_lease(a.lease.id)

        b, second, job_logs = await term()
        assert job_logs.known == {"b"}  # a is read from its summary
        again = readmodel.job_info(second, second.job("b"))
        assert set(second.engines) == {"b"} and again.state == running.state == pb.RUNNING
        assert [(n.node_id, n.node_rank, n.first_rank, n.state) for n in again.status.nodes] == [
            (n.node_id, n.node_rank, n.first_rank, n.state) for n in running.status.nodes
        ] and again.status.generation == running.status.generation
        assert readmodel.job_info(second, second.job("a")).state == pb.SUCCEEDED
        b_log = await keys_under(b, f"{root}jobs/b/")
        clock.now += 3601
        await second.prune()
        assert await keys_under(b, f"{root}jobs/a/") == {} and await keys_under(b, f"{root}jobs/b/") == b_log
        assert not (config.keys_dir / "marks" / "a").exists() and (config.keys_dir / "marks" / "b").exists()
        assert second.job("a").log_pruned
        second.close()
        job_logs.close()
        for session in (a, b):
            await session.aclose()

    asyncio.run(scenario())


def test_a_job_log_larger_than_grpcs_default_reply_is_read_at_takeover(etcd_server, tmp_path):
    """A large world's log is over 4 MiB (gRPC's default largest reply): a new leader still
    reads it whole."""
    root = f"/meshgate/t{secrets.token_hex(3)}/"
    events = [GenerationBumped(n, "x" * 400) for n in range(12_000)]  # about 8 MiB as stored

    async def scenario():
        a = await leader(etcd_server, root)
        await EtcdJobLogs(a, ()).open(pin("big"), None).append(events)
        await a.client.revoke_lease(a.lease.id)
        b = await leader(etcd_server, root)
        logs = EtcdJobLogs(b, ("big",))
        await logs.prefetch()
        assert logs.open(pin("big"), None).load() == events
        for session in (a, b):
            await session.aclose()

    asyncio.run(scenario())


def test_one_commit_larger_than_etcds_largest_request_is_written_in_several(etcd_server, tmp_path):
    """etcd takes requests up to 1.5 MiB: a group commit of larger records (2 MiB here) is
    cut into transactions it takes, each fenced, and reads back whole."""
    root = f"/meshgate/t{secrets.token_hex(3)}/"
    events = [GenerationBumped(n, "x" * 40_000) for n in range(50)]

    async def scenario():
        a = await leader(etcd_server, root)
        await EtcdJobLogs(a, ()).open(pin("wide"), None).append(events)
        logs = EtcdJobLogs(a, ("wide",))
        await logs.prefetch()
        assert logs.open(pin("wide"), None).load() == events
        await a.aclose()

    asyncio.run(scenario())


def test_an_ipv6_endpoint_in_brackets_reaches_etcd(etcd_server):
    """``[store] endpoints = ["[::1]:PORT"]`` is taken at load and reaches etcd over IPv6: the
    session leads (a bare host's default port: tests/test_one_spelling.py)."""
    endpoint = f"[::1]:{etcd_server.client_port}"
    assert etcd_config(Path("/nonexistent"), endpoint).etcd_endpoints == (endpoint,)

    async def scenario():
        session = EtcdSession([endpoint], f"/meshgate/t{secrets.token_hex(3)}/", "coordinator-v6", 30)
        await session.connect()
        try:
            assert await session.campaign(asyncio.Event(), poll_s=0.05)
        finally:
            await session.aclose()

    asyncio.run(scenario())
