"""A coordinator kill -9 loop with jobs in flight: every job ends, with the truthful state;
0 stuck, 0 run twice, 0 double holders, and the coordinator starts after every kill.

Real coordinator (SQLite, mTLS with a dev CA, vouches required) and three agents. A
background job holds one node for the whole loop; every kill lands while it runs. Each
kill is placed at a seam by the store's test hooks, never by a sleep: every group commit
waits while the hold file exists (and says so with "<hold>.held"), a number in the file
lets that many commits through first, and a round is run again with every commit slowed
(MESHGATE_TEST_COMMIT_DELAY_MS). The seams, per round:

- submit: SubmitJob blocks on its acceptance, then the kill; never acknowledged;
- allocation: the acceptance is durable, the allocation (then the admission of the job's
  nodes) is not;
- a Register burst: four workers wait at a gate, the gate opens with commits held;
- exit reports: four workers that formed their world exit 0 with commits held.

Every worker (tests/workers/ledger_worker.py) records its job, generation, rank, pid,
attestation and when it held the rank; every SubmitJob answer is kept. The last test
checks the invariants over all of them and prints a one-line summary.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest

from conftest import REPO
from meshgate import admin
from meshgate.attestation import TrustBundle, verify_attestation
from meshgate.client import RendezvousRefused
from meshgate.coordinator.store import COMMIT_DELAY_ENV, HOLD_COMMITS_ENV
from meshgate.plan import ParallelPlan
from meshgate.v1 import attestation_pb2
from meshgate.v1 import rendezvous_pb2 as pb
from test_job_ends import wait_for
from test_jobs_cluster import NODES, Cluster

pytestmark = pytest.mark.slow

WORKER = [sys.executable, str(REPO / "tests" / "workers" / "ledger_worker.py")]
ENDED = (pb.SUCCEEDED, pb.FAILED, pb.CANCELLED)


class Loop:
    """The cluster, its hold file and everything seen: each SubmitJob's answer, each kill."""

    def __init__(self, root: Path) -> None:
        self.root, self.out = root, root / "ledger"
        self.out.mkdir()
        self.hold = root / "hold"
        self.held = root / "hold.held"
        self.cluster = Cluster(root, **{HOLD_COMMITS_ENV: str(self.hold)})
        self.answers: dict[str, str] = {}  # job -> "acknowledged" or the refusal's code
        self.kills: list[str] = []  # the seam of each kill
        self.restart_s: list[float] = []

    def hold_commits(self, let_through: int = 0) -> None:
        self.held.unlink(missing_ok=True)
        partial = self.root / "hold.partial"
        partial.write_text(str(let_through) if let_through else "")
        partial.rename(self.hold)  # whole: the coordinator reads the count as it appears

    def kill_at_held_commit(self, seam: str) -> None:
        """Once a commit waits on the hold: kill -9, let commits go, start the same config,
        and see it serve."""
        wait_for(self.held.exists, 60, self.cluster, f"a commit held ({seam})")
        self.kill_and_restart(seam)

    def kill_and_restart(self, seam: str) -> None:
        self.cluster.coordinator.kill()
        self.kills.append(seam)
        self.hold.unlink(missing_ok=True)
        self.held.unlink(missing_ok=True)
        started = time.monotonic()
        self.cluster.coordinator = self.cluster._start()  # raises if it exits or never binds
        wait_for(self.serves, 30, self.cluster, f"serving after the kill at {seam}")
        self.restart_s.append(time.monotonic() - started)

    def serves(self) -> bool:
        try:
            self.cluster.job("bg")
            return True
        except RendezvousRefused:
            return False

    def submit(self, job_id: str, nodes: int, **env: str) -> pb.JobInfo:
        info = self.cluster.submit(
            job_id, ParallelPlan(dp_shard=2 * nodes), nodes, WORKER, env={"LEDGER_OUT": str(self.out), **env}
        )
        self.answers[job_id] = "acknowledged"
        return info

    def submit_in_background(self, job_id: str, nodes: int) -> threading.Thread:
        def call() -> None:
            try:
                self.submit(job_id, nodes)
            except RendezvousRefused as exc:
                self.answers[job_id] = exc.code.name

        thread = threading.Thread(target=call)
        thread.start()
        return thread

    def started(self, job_id: str) -> int:
        return len(list(self.out.glob(f"{job_id}.g*.json")))

    def settle(self, job_id: str) -> bool:
        """The job ended and its summary is durable, or (never acknowledged) it does not
        exist: nothing of it is left to commit, so the next seam's hold counts only its own
        commits. Returns whether the job exists."""
        try:
            info = self.cluster.wait_ended(job_id, timeout=120)
        except RendezvousRefused as exc:
            assert exc.code.name == "NOT_FOUND", exc
            # a restarted coordinator gives a node a job only once its agent showed no live
            # unit: wait for that too, so the next seam's job is allocated within its SubmitJob
            wait_for(self.none_clearing, 60, self.cluster, "every node back in the pool after the restart")
            return False
        assert info.state in ENDED
        wait_for(
            lambda: f"job {job_id} closed" in self.cluster.coordinator.log(),
            60,
            self.cluster,
            f"{job_id}'s summary durable",
        )
        # and its nodes are back in the pool (their agents showed its units empty), so the
        # next seam's job is allocated within its own SubmitJob
        wait_for(self.none_clearing, 60, self.cluster, f"{job_id}'s nodes back in the pool")
        return True

    def none_clearing(self) -> bool:
        with urllib.request.urlopen(self.cluster.metrics_url, timeout=5) as response:
            return 'meshgate_nodes{state="clearing"} 0.0' in response.read().decode()

    def resends(self) -> int:
        return sum(self.cluster.agent_log(n).count("acknowledged on resend") for n in NODES)


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    loop = Loop(tmp_path_factory.mktemp("killloop"))
    try:
        wait_for(lambda: all("joined the cluster" in loop.cluster.agent_log(n) for n in NODES), 60, loop.cluster)
        # in flight across every kill: one node's two workers hold their ranks until the end
        loop.submit("bg", 1, LEDGER_RELEASE=str(loop.root / "bg.release"))
        wait_for(lambda: loop.started("bg") == 2, 60, loop.cluster, "bg's world formed")
        yield loop
    finally:
        loop.hold.unlink(missing_ok=True)
        (loop.root / "bg.release").touch()
        loop.cluster.close()


def kill_round(loop: Loop, tag: str) -> None:
    # submit: its acceptance never becomes durable, so it is never acknowledged and never exists
    job = f"{tag}-submit"
    loop.hold_commits()
    thread = loop.submit_in_background(job, 2)
    loop.kill_at_held_commit("submit")
    thread.join(30)
    assert loop.answers[job] != "acknowledged" and not loop.settle(job), loop.answers[job]

    # allocation: its acceptance is durable, so it exists and runs; killed before its
    # allocation (1 commit let through) or the admission of its nodes to its own new log (2)
    # is durable. The first is never acknowledged; the second may be, when the coordinator's
    # own loop allocated the job first (the answer waits for the allocation, which is
    # durable, and the restarted coordinator admits the nodes again): the last test checks
    # that every acknowledged job exists and ran once.
    for let_through, seam in ((1, "allocation"), (2, "admission")):
        job = f"{tag}-{seam}"
        loop.hold_commits(let_through)
        thread = loop.submit_in_background(job, 2)
        loop.kill_at_held_commit(seam)
        thread.join(30)
        assert loop.settle(job), loop.answers[job]
        assert seam == "admission" or loop.answers[job] != "acknowledged"

    # a Register burst: four workers launched and waiting at the gate; open it with commits held
    job, gate = f"{tag}-register", loop.root / f"{tag}-register.gate"
    loop.submit(job, 2, LEDGER_GATE=str(gate))
    wait_for(lambda: len(list(loop.out.glob(f"{job}.*.ready"))) == 4, 60, loop.cluster, "4 workers at the gate")
    loop.hold_commits()
    gate.touch()
    loop.kill_at_held_commit("register burst")
    assert loop.settle(job)

    # exit reports: four workers formed their world; let them exit 0 with commits held. The
    # report being committed is lost with the process: its agent must send it again.
    job, release = f"{tag}-exits", loop.root / f"{tag}-exits.release"
    loop.submit(job, 2, LEDGER_RELEASE=str(release))
    wait_for(lambda: loop.started(job) == 4, 60, loop.cluster, "4 workers hold their ranks")
    resent = loop.resends()
    loop.hold_commits()
    release.touch()
    loop.kill_at_held_commit("exit reports")
    assert loop.settle(job)
    assert loop.resends() > resent, loop.cluster.logs()


ROUNDS = 2  # per test: the second round's coordinator replays every job of the first


def test_kill_loop_at_every_seam(loop):
    for n in range(ROUNDS):
        kill_round(loop, f"plain{n}")


def test_kill_loop_at_every_seam_with_slowed_commits(loop):
    loop.cluster.coordinator_env[COMMIT_DELAY_ENV] = "150"
    loop.kill_and_restart("slowed (bg in flight)")  # from here every commit takes 150 ms
    assert f"{COMMIT_DELAY_ENV}=150" in loop.cluster.coordinator.log()
    for n in range(ROUNDS):
        kill_round(loop, f"slow{n}")


def test_every_job_ended_once_truthfully_and_no_rank_had_two_holders(loop, capsys):
    (loop.root / "bg.release").touch()
    loop.cluster.wait_ended("bg")
    loop.cluster.wait_idle(60)
    cluster = loop.cluster
    records = [json.loads(p.read_text()) for p in loop.out.glob("*.json")]
    by_job: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_job[r["job"]].append(r)
    listed = {j.spec.job_id: j for j in cluster_jobs(cluster)}

    stuck = [j for j, info in listed.items() if info.state not in ENDED]
    untruthful, absent = [], []
    for job_id, answer in loop.answers.items():
        if job_id not in listed:  # never became durable: it must never have been acknowledged, nor run
            absent.append(job_id)
            if answer == "acknowledged" or by_job.get(job_id):
                untruthful.append((job_id, answer, "absent", len(by_job.get(job_id, []))))
            continue
        info = listed[job_id]
        truthful = (pb.SUCCEEDED, 0, "every worker of generation 0 exited 0")
        if (info.state, info.status.generation, info.reason) != truthful:
            untruthful.append((job_id, answer, pb.JobState.Name(info.state), info.status.generation, info.reason))
    assert set(listed) <= set(loop.answers), "a job nobody submitted"

    # run twice: a generation past 0 (no node was lost here), or a (job, generation, rank)
    # started by two processes; every rank of each job's generation 0 ran
    holders: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        holders[(r["job"], r["generation"], r["rank"])].append(r)
    run_twice = [k for k, rs in holders.items() if len({r["pid"] for r in rs}) > 1 or k[1] > 0]
    for job_id, info in listed.items():
        ranks = sorted(r for (j, g, r) in holders if j == job_id and g == 0)
        assert ranks == list(range(2 * info.spec.nodes)), (job_id, ranks)  # two slots a node
        assert all(r["end"] is not None for r in by_job[job_id]), f"{job_id}: a worker never finished"

    # double holders: two processes holding one (job, generation, rank) at overlapping
    # times, each with a valid attestation for it
    bundle = TrustBundle.load(cluster.coordinator.trust_bundle_path)
    double = []
    for (job_id, generation, rank), rs in holders.items():
        for r in rs:
            signed = attestation_pb2.SignedAttestation.FromString(bytes.fromhex(r["signed"]))
            att = verify_attestation(
                signed, bundle, job_id=job_id, nonce=bytes.fromhex(r["nonce"]), generation=generation, now=r["start"]
            )
            assert (att.rank, att.generation, att.job_id) == (rank, generation, job_id)
        double += [
            (job_id, generation, rank, a["pid"], b["pid"])
            for a in rs
            for b in rs
            if a["pid"] < b["pid"] and overlap(a, b)
        ]

    seams = ", ".join(f"{s} {loop.kills.count(s)}" for s in dict.fromkeys(loop.kills))
    summary = (
        f"kill loop: {len(loop.kills)} kills ({seams}); {len(loop.answers)} jobs "
        f"({sum(a == 'acknowledged' for a in loop.answers.values())} acknowledged, {len(absent)} never "
        f"acknowledged and absent, {len(listed)} ran); {len(stuck)} stuck, {len(run_twice)} run twice, "
        f"{len(double)} double holders, {len(untruthful)} untruthful; the coordinator started and served "
        f"after {len(loop.restart_s)}/{len(loop.kills)} kills (slowest {max(loop.restart_s):.1f}s); "
        f"{len(records)} workers, {len({r['digest'] for r in records})} attestations"
    )
    with capsys.disabled():
        print("\n" + summary)
    assert (stuck, run_twice, double, untruthful) == ([], [], [], []), summary + "\n" + cluster.logs()
    assert len(loop.restart_s) == len(loop.kills) == 2 * ROUNDS * 5 + 1  # 5 seams a round, and the slowing


def overlap(a: dict, b: dict) -> bool:
    """Did two workers hold their ranks at the same time? One still running holds it still."""
    forever = float("inf")
    return a["start"] <= (b["end"] or forever) and b["start"] <= (a["end"] or forever)


def cluster_jobs(cluster: Cluster) -> list[pb.JobInfo]:
    return list(admin.all_jobs(cluster.address, tls=cluster.admin_tls))
