"""An ended job costs (almost) nothing (issue 21, item 5): its engine and log are closed
when it ends, every later read comes from the summary in the cluster's log (after a
restart too, never by reopening its log), its log is deleted after the retention, and a
cluster log written before summaries still loads and answers.

In process: the ClusterCoordinator over real SQLite logs (the daemon's own opener). Real
processes (slow): >= 100 jobs, part of them run by real agents, through one coordinator
whose RLIMIT_NOFILE is 128."""

from __future__ import annotations

import asyncio
import base64
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, simulated_machine_id, worker_env, write_config
from meshgate.coordinator import readmodel
from meshgate.coordinator.cluster import ClusterCoordinator
from meshgate.coordinator.config import ConfigError, CoordinatorConfig
from meshgate.coordinator.jobs import JobSpec, JobState, JobSummarized
from meshgate.coordinator.keys import KeyRing
from meshgate.coordinator.leadership import job_store_dropper, job_store_opener
from meshgate.coordinator.rendezvous import RendezvousError
from meshgate.coordinator.store import MemoryStore
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb

LIGHT = [sys.executable, str(REPO / "tests" / "light_worker.py")]


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def config_for(tmp_path: Path, **cluster) -> CoordinatorConfig:
    return CoordinatorConfig.from_mapping(
        {
            "server": {"insecure": True},
            "keys": {"dir": str(tmp_path / "keys")},
            "store": {"dir": str(tmp_path / "state")},
            "cluster": cluster,
        }
    )


def cluster_over(config: CoordinatorConfig, store, clock: Clock) -> ClusterCoordinator:
    return ClusterCoordinator(
        store,
        KeyRing(config.keys_dir),
        job_store_opener(config),
        attestation_ttl_s=60,
        heartbeat_timeout_s=1e9,
        require_vouch=False,
        clock=clock,
        drop_job_store=job_store_dropper(config),
        retention_s=config.retention_s,
        ended_jobs_kept=config.ended_jobs_kept,
    )


async def joined(cluster: ClusterCoordinator, node_id: str) -> bytes:
    """The node's credential."""
    token, _ = await cluster.pool.create_join_token(600, node_id)
    _, credential = await cluster.pool.join(node_id, node_id, 2, "cpu", {}, token, public_key=bytes(32))
    return credential


def claimed(job_id: str, node_id: str) -> JobSpec:
    return JobSpec.build(job_id=job_id, plan=ParallelPlan(dp_shard=2), node_ids=(node_id,), mode="claimed")


def open_job_logs(cluster: ClusterCoordinator) -> set[str]:
    return set(cluster.job_engines.stores)


def test_an_ended_job_is_closed_and_read_from_its_summary_then_its_log_is_deleted_after_retention(tmp_path):
    async def scenario():
        config = config_for(tmp_path, retention="1h")
        assert config.retention_s == 3600
        clock, cluster_log = Clock(), MemoryStore()
        cluster = cluster_over(config, cluster_log, clock)
        credential = await joined(cluster, "n0")
        other = await joined(cluster, "n1")
        job = await cluster.submit(claimed("a", "n0"))
        assert job.state is JobState.RUNNING and open_job_logs(cluster) == {"a"}
        running = readmodel.job_info(cluster, job)
        await cluster.finish("a", True, "done")
        assert open_job_logs(cluster) == set() and cluster.engines == {}  # closed at the end
        (summary,) = [e for e in cluster_log.events if isinstance(e, JobSummarized)]
        final = pb.Status.FromString(base64.b64decode(summary.status))
        assert (final.job_id, final.world_size, [n.node_id for n in final.nodes]) == ("a", 2, ["n0"])
        assert len(summary.status) < 1024  # a few hundred bytes per ended job
        info = readmodel.job_info(cluster, cluster.job("a"))
        assert info.state == pb.SUCCEEDED and info.status == final
        assert info.status.nodes[0].state == running.status.nodes[0].state == pb.NODE_STATE_ACTIVE
        with pytest.raises(RendezvousError, match="is SUCCEEDED"):
            cluster.engine("a")  # nothing reopens it
        # its node, still following it, learns the end from the summary; no other node may ask
        assert cluster.retired("a")
        assert cluster.pool.job_engine("n0", credential, "a") is None
        beat = readmodel.ended_heartbeat(cluster, cluster.job("a"), "n0")
        assert (beat.job_state, beat.node_state, beat.generation) == (pb.SUCCEEDED, pb.NODE_STATE_ACTIVE, 0)
        assert readmodel.ended_exit(cluster, cluster.job("a")).job_failure == ""
        with pytest.raises(RendezvousError, match="does not belong"):
            cluster.pool.job_engine("n0", b"not its credential", "a")
        with pytest.raises(RendezvousError, match="does not serve job"):
            cluster.pool.job_engine("n1", other, "a")
        log_dir, mark = tmp_path / "state" / "jobs" / "a", tmp_path / "keys" / "marks" / "a"
        assert log_dir.exists() and mark.exists()
        cluster.close()

        # a restart: the summary answers; the log is not opened (it is garbage now, so an
        # open would be refused) and is deleted once the retention has passed
        (log_dir / "state.sqlite3").write_bytes(b"not a database" * 100)
        restarted = cluster_over(config, cluster_log, clock)
        await restarted.start()
        assert readmodel.job_info(restarted, restarted.job("a")).status == final
        clock.now += 3599
        await restarted.prune()
        assert log_dir.exists()
        clock.now += 2
        await restarted.prune()
        assert not log_dir.exists() and not mark.exists()
        assert restarted.job("a").log_pruned and readmodel.job_info(restarted, restarted.job("a")).status == final
        with pytest.raises(RendezvousError, match="never reused"):
            await restarted.submit(claimed("a", "n0"))
        # the node got its job back once its agent shows no live unit: the next one runs
        restarted.pool.heartbeat("n0", credential, live_units=())
        assert (await restarted.submit(claimed("b", "n0"))).state is JobState.RUNNING
        restarted.close()

    asyncio.run(scenario())


def test_a_cluster_log_from_before_summaries_loads_and_its_ended_jobs_are_read_from_their_own_logs(tmp_path):
    async def scenario():
        config = config_for(tmp_path)
        clock, cluster_log = Clock(), MemoryStore()
        cluster = cluster_over(config, cluster_log, clock)
        await joined(cluster, "n0")
        await cluster.submit(claimed("old", "n0"))
        await cluster.finish("old", False, "it broke")
        expected = readmodel.job_info(cluster, cluster.job("old"))
        cluster.close()
        old_log = MemoryStore()
        old_log.events = [e for e in cluster_log.events if not isinstance(e, JobSummarized)]
        legacy = cluster_over(config, old_log, clock)
        await legacy.start()
        job = legacy.job("old")
        assert (job.state, job.summary) == (JobState.FAILED, "")
        info = readmodel.job_info(legacy, job)  # replayed from its own log, which is closed again
        assert (
            [(n.node_id, n.state, n.slots) for n in info.status.nodes]
            == [(n.node_id, n.state, n.slots) for n in expected.status.nodes]
            == [("n0", pb.NODE_STATE_ACTIVE, 2)]
        )
        assert info.reason == "it broke"
        assert open_job_logs(legacy) == set()
        await legacy.prune()
        assert (tmp_path / "state" / "jobs" / "old").exists()  # no summary: its log is where it is read
        legacy.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("value, seconds", [("3d", 259200.0), ("12h", 43200.0), ("90s", 90.0), (600, 600.0)])
def test_cluster_retention_takes_seconds_or_a_duration(tmp_path, value, seconds):
    assert config_for(tmp_path, retention=value).retention_s == seconds


@pytest.mark.parametrize("value", ["soon", "-1d", 0, True, "3w"])
def test_a_bad_cluster_retention_is_refused_naming_it(tmp_path, value):
    with pytest.raises(ConfigError, match="retention must be a positive number of seconds"):
        config_for(tmp_path, retention=value)


# ---- real processes -------------------------------------------------------------------------------


def start_agent(root: Path, address: str, node_id: str, token: str):
    import subprocess

    config = write_config(
        root / f"{node_id}.toml",
        {
            "agent": {
                "coordinator": address,
                "node_id": node_id,
                "slots": 2,
                "state_dir": str(root / f"{node_id}-state"),
                "machine_id_file": simulated_machine_id(root, node_id),
                "insecure": True,
                "join_token": token,
                "drain_grace_s": 3,
                "run_jobs_as_agent": True,
            }
        },
    )
    log = open(root / f"{node_id}.log", "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "meshgate.agent", "--config", str(config)],
        cwd=REPO,
        env=worker_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def wait_ended(client, job_id: str, timeout: float = 120) -> pb.JobInfo:
    deadline = time.monotonic() + timeout
    while True:
        info = client.admin.GetJob(pb.GetJobRequest(job_id=job_id))
        if info.state in (pb.SUCCEEDED, pb.FAILED, pb.CANCELLED):
            return info
        assert time.monotonic() < deadline, f"job {job_id} did not end: {info}"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_hundred_jobs_under_128_descriptors_keep_them_flat_and_a_restart_reads_old_jobs_from_summaries(
    tmp_path,
    capsys,
):
    if str(REPO) not in sys.path:  # bench/ is not installed: found from the repo root (as `python -m pytest` has it)
        sys.path.insert(0, str(REPO))
    from bench.soak import Client, SoakCoordinator, fd_targets, open_fds, rss_kib, run_jobs
    from meshgate.cli import main as meshgate_main

    coordinator = SoakCoordinator(tmp_path / "c", nofile=128, heartbeat_interval_s=0.5, heartbeat_misses=20)
    coordinator.start()
    client = Client(coordinator.address)
    agents = []
    try:
        fake = ["sim-0", "sim-1"]
        client.join(fake)
        tokens = {
            n: client.admin.CreateJoinToken(pb.CreateJoinTokenRequest(node_id=n, ttl_s=600)).token for n in ("a0", "a1")
        }
        agents = [start_agent(tmp_path, coordinator.address, n, t) for n, t in tokens.items()]
        deadline = time.monotonic() + 60
        while not all("joined the cluster" in (tmp_path / f"{n}.log").read_text() for n in tokens):
            assert time.monotonic() < deadline, "agents did not join"
            time.sleep(0.1)

        def agent_jobs(first: int, pairs: int) -> list[pb.JobInfo]:
            ended = []
            client.heartbeat()  # the simulated nodes stay in the pool
            for p in range(pairs):  # both agents at once, one 2-worker job each
                ids = [f"real-{first + 2 * p + k:03d}" for k in (0, 1)]
                for job_id, node in zip(ids, ("a0", "a1")):
                    (tmp_path / "out" / job_id).mkdir(parents=True)
                    client.admin.SubmitJob(
                        pb.SubmitJobRequest(
                            spec=pb.JobSpec(
                                job_id=job_id,
                                plan=ParallelPlan(dp_shard=2).to_proto(),
                                node_ids=[node],
                                command=LIGHT,
                                env={"LIGHT_OUT": str(tmp_path / "out" / job_id)},
                            )
                        )
                    )
                ended += [wait_ended(client, job_id) for job_id in ids]
                client.heartbeat()
            return ended

        # warm up (imports, grpc's first connections, SQLite's first pages), then the baseline
        run_jobs(client, 0, 5, fake, prefix="warm")
        warm = agent_jobs(0, 1)
        pid = coordinator.pid
        base_fds, base_rss = open_fds(pid), rss_kib(pid)
        real = agent_jobs(2, 3)
        run_jobs(client, 0, 100, fake, prefix="claimed")
        real += agent_jobs(8, 1)
        assert [pb.JobState.Name(j.state) for j in warm + real] == ["SUCCEEDED"] * 10, [j.reason for j in real]
        assert all(len(j.status.nodes) == 1 and j.status.world_size == 2 for j in real)
        jobs = len(real) + 100
        fds, rss = open_fds(pid), rss_kib(pid)
        still_open = [t for t in fd_targets(pid) if "/jobs/" in t]
        with capsys.disabled():  # the figures, in the test's output (pytest -s)
            print(
                f"\n{jobs} jobs: descriptors {base_fds} -> {fds}; RSS {base_rss} -> {rss} KiB, "
                f"{(rss - base_rss) / jobs:.1f} KiB per finished job"
            )
        assert still_open == []  # every ended job's log is closed
        assert fds <= base_fds + 4, (base_fds, fds, fd_targets(pid))
        assert (rss - base_rss) / jobs < 64, "RSS grows by more than a few KiB per finished job"

        # a restart with every job in the log; an old job's log is garbage from here on, so
        # answering `job show` proves it is read from the summary, not by reopening its log
        (coordinator.root / "state" / "jobs" / "real-002" / "state.sqlite3").write_bytes(b"\0garbage" * 512)
        client.close()
        coordinator.stop()
        restart_s = coordinator.start()
        client = Client(coordinator.address)
        with capsys.disabled():
            print(f"restart with {jobs + 7} ended jobs in the cluster's log: {restart_s:.2f}s to serve")
        pid = coordinator.pid
        # files only: the agents' channels reconnect after the restart at their own pace
        files_before_show = sorted(t for t in fd_targets(pid) if not t.startswith("socket:"))
        capsys.readouterr()
        assert meshgate_main(["job", "show", "real-002", "--coordinator", coordinator.address, "--json"]) == 0
        shown = capsys.readouterr().out
        assert '"SUCCEEDED"' in shown and '"a0"' in shown, shown
        status = client.admin.GetStatus(pb.GetStatusRequest(job_id="real-002"))
        assert (status.world_size, status.nodes[0].node_id, status.nodes[0].state) == (2, "a0", pb.NODE_STATE_ACTIVE)
        files = sorted(t for t in fd_targets(pid) if not t.startswith("socket:"))
        assert files == files_before_show and not [t for t in files if "/jobs/" in t], (files_before_show, files)
        assert restart_s < 30
        # and the agents still get jobs after the restart
        assert [j.state for j in agent_jobs(10, 1)] == [pb.SUCCEEDED, pb.SUCCEEDED]
    finally:
        for agent in agents:
            agent.terminate()
        for agent in agents:
            agent.wait(timeout=30)
        client.close()
        coordinator.stop()
