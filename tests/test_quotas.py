"""Quotas per submitter (coordinator/cluster_state/quotas.py) and pages bounded in bytes
(coordinator/pages.py), as pure decisions: no sockets. The real coordinator's flood, its
memory and `meshgate job list` after it are in test_quota_flood.py."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from meshgate.coordinator.cluster_state.quotas import Limits, QuotaExceeded, Quotas, spec_bytes, use_of
from meshgate.coordinator.config import ConfigError, CoordinatorConfig
from meshgate.coordinator.jobs import Caller, ClusterState, JobSpec
from meshgate.coordinator.pages import bounded_page
from meshgate.coordinator.cluster_state.scheduling import QueueReasons
from meshgate import views
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb

from test_jobs import joined

ALICE, BOB = Caller("submitter:alice", admin=False), Caller("submitter:bob", admin=False)
ADMIN = Caller("admin:root", admin=True)


def spec(job_id: str, nodes: int = 1, env_bytes: int = 0, **kwargs) -> JobSpec:
    env = (("BLOB", "x" * env_bytes),) if env_bytes else ()
    return JobSpec.build(
        job_id=job_id, plan=ParallelPlan(dp_shard=2 * nodes), num_nodes=nodes, command=("train",), env=env, **kwargs
    )


def submit(state: ClusterState, job: JobSpec, caller: Caller, now: float = 1.0) -> None:
    state.apply_all(state.decide_submit(job, now, caller, wait_for_nodes=True))


def refused(state: ClusterState, job: JobSpec, caller: Caller) -> QuotaExceeded:
    with pytest.raises(QuotaExceeded) as caught:
        state.decide_submit(job, 1.0, caller, wait_for_nodes=True)
    assert caught.value.code.value == "RESOURCE_EXHAUSTED"
    assert job.job_id not in state.jobs
    return caught.value


def test_a_flood_of_one_submitter_is_refused_at_the_default_waiting_quota_and_no_one_else_is():
    state = ClusterState()
    for i in range(100):
        submit(state, spec(f"a{i}", env_bytes=60_000), ALICE)
    error = refused(state, spec("a100"), ALICE)
    assert error.quota == "waiting_jobs"
    assert "quota waiting_jobs = 100 of 'submitter:alice' is reached: 100 job(s) waiting" in error.message
    submit(state, spec("b0", env_bytes=60_000), BOB)  # bob's quota is his own
    submit(state, spec("root0", env_bytes=60_000), ADMIN)  # admins are exempt by default
    assert use_of(state, "submitter:alice").waiting_jobs == 100 and use_of(state, "submitter:bob").waiting_jobs == 1


def test_spec_bytes_per_job_and_in_all_count_command_and_env_in_utf8():
    assert (
        spec_bytes(JobSpec.build(job_id="j", plan=ParallelPlan(dp_shard=2), command=("é", "ab"), env={"K": "vé"}))
        == 2 + 2 + 1 + 3
    )
    state = ClusterState(quotas=Quotas(Limits(spec_bytes_per_job=1000, spec_bytes=2500)))
    error = refused(state, spec("big", env_bytes=1000), ALICE)
    assert error.quota == "spec_bytes_per_job" and "quota spec_bytes_per_job = 1000" in error.message
    assert "job 'big' has 1009" in error.message  # "train" + "BLOB" + 1000
    submit(state, spec("a", env_bytes=900), ALICE)
    submit(state, spec("b", env_bytes=900), ALICE)
    error = refused(state, spec("c", env_bytes=900), ALICE)
    assert error.quota == "spec_bytes" and "1818 bytes of command and env held, and this job has 909" in error.message


def test_jobs_and_nodes_quotas_count_running_and_waiting_jobs_and_an_ended_job_frees_its_share():
    state = ClusterState(quotas=Quotas(Limits(jobs=2, nodes=3)))
    for node in ("n0", "n1", "n2"):
        joined(state, node)
    submit(state, spec("run", nodes=2), ALICE)
    state.apply_all(state.decide_allocate(1.0))
    assert state.jobs["run"].state.value == "RUNNING"
    error = refused(state, spec("wide", nodes=2), ALICE)
    assert error.quota == "nodes" and "2 node(s) held or asked for, and this job asks 2" in error.message
    submit(state, spec("one", nodes=1), ALICE)
    error = refused(state, spec("third", nodes=1), ALICE)  # past both: the first reached is named
    assert error.quota == "jobs" and "2 job(s) waiting or running" in error.message
    state.quotas = Quotas(Limits(nodes=3))
    assert refused(state, spec("third", nodes=1), ALICE).quota == "nodes"  # 3 held or asked for
    state.apply_all(state.decide_cancel("run", "done", 2.0))
    submit(state, spec("third", nodes=1), ALICE)  # an ended job takes no share


def test_an_owners_own_limits_override_the_default_and_admins_may_be_held_to_them():
    quotas = Quotas(Limits(waiting_jobs=1), {"submitter:alice": Limits(waiting_jobs=3)}, admins_exempt=False)
    state = ClusterState(quotas=quotas)
    for i in range(3):
        submit(state, spec(f"a{i}"), ALICE)
    submit(state, spec("b0"), BOB)
    assert refused(state, spec("b1"), BOB).quota == "waiting_jobs"
    submit(state, spec("r0"), ADMIN)
    assert "of 'admin:root'" in refused(state, spec("r1"), ADMIN).message


def test_quota_config_takes_defaults_owners_and_refuses_bad_values_naming_the_key():
    def load(quota) -> CoordinatorConfig:
        return CoordinatorConfig.from_mapping({"server": {"insecure": True}, "cluster": {"quota": quota}})

    assert CoordinatorConfig.from_mapping({"server": {"insecure": True}}).quotas == Quotas()
    loaded = load({"waiting_jobs": 10, "admins_exempt": False, "owners": {"submitter:alice": {"jobs": 4}}}).quotas
    assert loaded.default == Limits(waiting_jobs=10) and not loaded.admins_exempt
    assert loaded.owners["submitter:alice"] == Limits(waiting_jobs=10, jobs=4)  # the rest from the default
    for bad, message in [
        (3, "[cluster] quota must be a table"),
        ({"waiting": 1}, "[cluster.quota] unknown key(s) ['waiting']"),
        ({"nodes": -1}, "[cluster.quota] nodes must be an integer >= 0 (0: no limit), got -1"),
        ({"spec_bytes": "16MiB"}, "[cluster.quota] spec_bytes must be an integer >= 0"),
        ({"owners": {"submitter:x": {"jobs": True}}}, "[cluster.quota.owners.'submitter:x'] jobs must be an integer"),
        ({"owners": {"submitter:x": 3}}, "[cluster.quota] owners must hold one table per owner"),
        ({"admins_exempt": 1}, "[cluster.quota] admins_exempt must be true or false, got 1"),
    ]:
        with pytest.raises(ConfigError) as caught:
            load(bad)
        assert message in str(caught.value), caught.value


def _rows(sizes):
    return ((i, pb.JobInfo(reason="x" * size)) for i, size in enumerate(sizes))


def test_a_page_stops_before_its_byte_budget_says_where_to_go_on_and_always_makes_progress():
    page, next_at = bounded_page(_rows([400] * 10), page_size=100, budget=1000)
    assert len(page) == 2 and next_at == 2  # a third 400-byte row would pass 1000 bytes
    assert pb.JobList(jobs=page).ByteSize() <= 1000
    page, next_at = bounded_page(_rows([5000, 10]), page_size=100, budget=1000)
    assert len(page) == 1 and next_at == 1  # one row over the budget alone still goes
    page, next_at = bounded_page(_rows([10] * 5), page_size=3, budget=1000)
    assert len(page) == 3 and next_at == 3
    page, next_at = bounded_page(_rows([10] * 3), page_size=3, budget=1000)
    assert len(page) == 3 and next_at is None


def _reason(state: ClusterState, job_id: str, now: float = 1.0) -> str:
    return state.pending_reason(state.jobs[job_id], now)


def _started(state: ClusterState, now: float = 1.0) -> list[str]:
    return [e.job_id for e in state.decide_allocate(now)]


def test_past_a_running_quota_a_job_is_accepted_and_waits_holding_nothing_and_starts_when_its_share_frees():
    state = ClusterState(quotas=Quotas(Limits(running_jobs=1)))
    for node in ("n0", "n1", "n2"):
        joined(state, node)
    submit(state, spec("a1"), ALICE)
    submit(state, spec("a2"), ALICE)  # accepted: running_jobs is not checked at submit
    submit(state, spec("b1"), BOB)
    assert _started(state) == ["a1", "b1"]  # a2 waits; it holds back nobody behind it
    state.apply_all(state.decide_allocate(1.0))
    reason = _reason(state, "a2")
    assert "quota running_jobs = 1 of 'submitter:alice' is reached: 1 job(s) running" in reason
    assert "holds no node meanwhile" in reason and "first in line" not in reason
    assert QueueReasons(state, 1.0).reason(state.jobs["a2"]) == reason  # one pass per page says the same
    submit(state, spec("r1"), ADMIN)  # admins are exempt
    assert _started(state) == ["r1"]
    state.apply_all(state.decide_allocate(1.0))
    state.apply_all(state.decide_cancel("a1", "done", 2.0))
    state.note_units("n0", ())  # its agent shows a1's processes gone: n0 is idle again
    assert _started(state, 2.0) == ["a2"]


def test_a_running_nodes_quota_counts_members_and_spares_and_the_pass_own_allocations():
    state = ClusterState(quotas=Quotas(Limits(), {"submitter:alice": Limits(running_nodes=3)}))
    for node in ("n0", "n1", "n2", "n3", "n4"):
        joined(state, node)
    submit(state, spec("a1", nodes=2), ALICE)
    submit(state, spec("a2", nodes=1, spares=1), ALICE)  # 2 + 2 > 3, though 3 nodes are idle after a1
    submit(state, spec("a3", nodes=1), ALICE)  # 2 + 1 fits: it starts, passing a2 (which holds nothing)
    submit(state, spec("b1", nodes=2), BOB)  # bob is held to the default (no running limit)
    assert _started(state) == ["a1", "a3", "b1"]
    state.apply_all(state.decide_allocate(1.0))
    assert (
        "quota running_nodes = 3 of 'submitter:alice' is reached: its running jobs hold 3 node(s) and this job asks 2"
        in _reason(state, "a2")
    )


def test_running_quotas_load_from_the_config_and_show_in_the_cluster_status():
    loaded = CoordinatorConfig.from_mapping(
        {"server": {"insecure": True}, "cluster": {"quota": {"running_jobs": 2, "running_nodes": 16}}}
    ).quotas
    assert loaded.default == Limits(running_jobs=2, running_nodes=16) and loaded.bound_running
    assert not Quotas().bound_running
    shown = pb.SubmitterQuota(owner="", **asdict(loaded.default))
    assert (shown.running_jobs, shown.running_nodes) == (2, 16)
    row = {"owner": "", **{key: getattr(shown, key) for key in views.QUOTA_KEYS}}
    lines = "\n".join(views._quota_lines({"quotas": [row], "quota_admins_exempt": True}))
    assert "RUNNING JOBS" in lines and "RUNNING NODES" in lines
