"""Quotas per submitter (coordinator/cluster_state/quotas.py) and pages bounded in bytes
(coordinator/pages.py), as pure decisions: no sockets. The real coordinator's flood, its
memory and `meshgate job list` after it are in test_quota_flood.py."""

from __future__ import annotations

import pytest

from meshgate.coordinator.cluster_state.quotas import Limits, QuotaExceeded, Quotas, spec_bytes, use_of
from meshgate.coordinator.config import ConfigError, CoordinatorConfig
from meshgate.coordinator.jobs import Caller, ClusterState, JobSpec
from meshgate.coordinator.pages import bounded_page
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
