"""A job without a command whose launchers never come (issue #32): torchrun, Ray or a batch
script start its workers, not meshgate, so a launcher that is never started would leave the
job RUNNING with nobody registered, and `meshgate job wait` waiting for good. Past its
launch deadline such a job ends FAILED naming the nodes that never came
(coordinator/cluster_state/ends.py, decide_launch_deadlines). Pure: no sockets; the run on
real agents and a real torchrun is in tests/test_torchrun.py."""

from __future__ import annotations

import pytest

from conftest import REPO
from meshgate.coordinator.jobs import JobEnded, JobState
from meshgate.coordinator.jobspec import DEFAULT_LAUNCH_DEADLINE_S, JobSpec
from meshgate.coordinator.rendezvous import Code, JoinAuth, RegisterInput, RendezvousError, RendezvousState
from meshgate.job_cli import spec_message
from meshgate.plan import ParallelPlan
from test_jobs import pool, spec, submit


def claimed_job(state, job_id: str, nodes: int = 3, **kwargs):
    """A claimed job without a command (torchrun's) of ``nodes`` nodes of 2 slots, allocated at t=10."""
    job = spec(job_id, plan=ParallelPlan(dp_shard=2 * nodes), num_nodes=nodes, command=(), mode="claimed", **kwargs)
    submit(state, job, 10.0)
    return state.jobs[job_id]


def rendezvous_of(job) -> RendezvousState:
    return RendezvousState(job.spec.rendezvous_config(node_order=job.nodes, require_vouch=False))


def come(rendezvous: RendezvousState, node_id: str, ranks: range) -> None:
    """``node_id``'s launcher came: its agent joined and its workers registered ``ranks``."""
    auth = JoinAuth(admitted=True, public_key=bytes(32), new_credential_hash="h")
    _, events = rendezvous.decide_join(rendezvous.config.job_id, node_id, node_id, 2, "cpu", 11.0, auth)
    rendezvous.apply_all(events)
    for local_rank, rank in enumerate(ranks):
        worker = RegisterInput(rendezvous.config.job_id, f"w{rank}", bytes(32), node_id, local_rank, rank)
        rendezvous.apply_all(rendezvous.decide_register(worker, 12.0).events)


def test_a_job_whose_launchers_never_all_came_fails_at_its_deadline_naming_the_nodes_and_once():
    state = pool(*((f"n{i}", {}) for i in range(5)))
    job = claimed_job(state, "tr", launch_deadline_s=120)
    commanded = spec("cmd", num_nodes=2)  # its agents start its workers: no launch deadline
    submit(state, commanded, 10.0)
    rendezvous = rendezvous_of(job)
    first, second, third = job.nodes
    come(rendezvous, first, range(0, 2))
    come(rendezvous, second, range(2, 3))  # one of its two workers only
    waiting = {"tr": rendezvous.launchers_missing(job.nodes), "cmd": ("n3", "n4")}
    assert waiting["tr"] == (second, third)
    assert state.decide_launch_deadlines(waiting, 129.9) == ()
    reason = (
        f"launch deadline 2m reached: no launcher registered all workers of node(s) {second}, {third} "
        "(start torchrun, Ray or the batch script there, or raise --launch-deadline)"
    )
    assert state.decide_launch_deadlines(waiting, 130.0) == (JobEnded("tr", JobState.FAILED, reason, 130.0),)
    state.apply_all(state.decide_launch_deadlines(waiting, 130.0))
    assert state.jobs["tr"].state is JobState.FAILED
    assert state.decide_launch_deadlines(waiting, 1e12) == ()  # once


def test_a_per_node_job_whose_launcher_never_registers_its_workers_fails_at_its_deadline():
    """A per-node job's launcher is the agents' to start, but its workers are the launcher's
    to register (ft_launcher on its own c10d rendezvous never does): the deadline holds it
    too, and the reason says the launcher ran. A per-slot job's agents start every worker."""
    state = pool(*((f"n{i}", {}) for i in range(3)))
    per_node = spec("pn", plan=ParallelPlan(dp_shard=4), command=("ft_launcher", "train.py"), launch="per-node")
    assert per_node.launchers_register and not spec("ps").launchers_register
    recorded = per_node.with_launch_deadline(600)
    assert recorded.launch_deadline_s == 600.0 and spec("ps").with_launch_deadline(600).launch_deadline_s == 0.0
    submit(state, recorded, 10.0)
    job = state.jobs["pn"]
    rendezvous = rendezvous_of(job)
    come(rendezvous, job.nodes[0], range(0, 2))
    waiting = {"pn": rendezvous.launchers_missing(job.nodes)}
    assert waiting["pn"] == (job.nodes[1],)
    assert state.decide_launch_deadlines(waiting, 609.9) == ()
    (ended,) = state.decide_launch_deadlines(waiting, 610.0)
    assert ended.state is JobState.FAILED and ended.reason == (
        f"launch deadline 10m reached: no launcher registered all workers of node(s) {job.nodes[1]} "
        "(its launcher runs there but registered no worker through meshgate (meshgate job logs), "
        "or raise --launch-deadline)"
    )


def test_once_the_world_formed_the_deadline_is_over():
    state = pool(*((f"n{i}", {}) for i in range(2)))
    job = claimed_job(state, "tr", nodes=2)
    rendezvous = rendezvous_of(job)
    for node_rank, node_id in enumerate(job.nodes):
        come(rendezvous, node_id, range(2 * node_rank, 2 * node_rank + 2))
    assert rendezvous.complete and rendezvous.launchers_missing(job.nodes) == ()
    assert state.decide_launch_deadlines({"tr": ()}, 1e12) == ()


def test_a_job_that_names_no_deadline_gets_the_coordinators_and_one_logged_before_deadlines_has_none():
    state = pool(("n0", {}))
    plan = ParallelPlan(dp_shard=2)
    untold = JobSpec.build(job_id="tr", plan=plan, mode="claimed")
    assert untold.launch_deadline_s == 0.0  # not given: the coordinator records its own at submission
    assert untold.with_launch_deadline(DEFAULT_LAUNCH_DEADLINE_S).launch_deadline_s == 600.0
    assert untold.with_launch_deadline(600).to_proto().launch_deadline_s == 600.0  # what job show reads
    told = JobSpec.build(job_id="tr", plan=plan, mode="claimed", launch_deadline_s=30)
    assert told.with_launch_deadline(600).launch_deadline_s == 30.0
    commanded = JobSpec.build(job_id="c", plan=plan, command=("true",))
    assert commanded.with_launch_deadline(600).launch_deadline_s == 0.0
    # A job from a log written before deadlines (0 recorded) is never ended by one.
    submit(state, untold, 10.0)
    assert state.decide_launch_deadlines({"tr": ("n0",)}, 1e12) == ()


def test_the_deadline_is_a_flag_a_job_file_key_and_a_field_refused_by_name():
    from meshgate.cli import build_parser
    from meshgate.job_cli import spec_from_args

    parser = build_parser()
    argv = ["job", "submit", "--plan", str(REPO / "examples" / "plan-4.toml"), "--nodes", "2", "--mode", "claimed"]
    flagged = spec_from_args(parser.parse_args([*argv, "--launch-deadline", "5m"]))
    assert flagged.launch_deadline_s == 300 and JobSpec.from_proto(flagged, "j").launch_deadline_s == 300.0
    with pytest.raises(SystemExit):
        parser.parse_args([*argv, "--launch-deadline", "0"])
    unset = spec_message({"plan": {"dp_shard": 4}, "mode": "claimed"})
    assert JobSpec.from_proto(unset, "j").launch_deadline_s == 0.0  # an older client's spec: the coordinator's
    filed = spec_message({"plan": {"dp_shard": 4}, "mode": "claimed", "launch_deadline_s": 90})
    assert JobSpec.from_proto(filed, "j").launch_deadline_s == 90.0
    for bad in (-1.0, float("nan"), 1e12):
        with pytest.raises(RendezvousError) as caught:
            JobSpec.build(job_id="j", plan=ParallelPlan(dp_shard=2), mode="claimed", launch_deadline_s=bad)
        assert caught.value.code is Code.INVALID_ARGUMENT and caught.value.message.startswith("launch_deadline_s")


def test_job_show_gives_the_deadline_of_a_job_whose_launchers_register_its_workers_only():
    from meshgate.v1 import rendezvous_pb2 as pb
    from meshgate.views import job_dict, render_job

    claimed = JobSpec.build(job_id="tr", plan=ParallelPlan(dp_shard=2), mode="claimed", launch_deadline_s=90)
    commanded = JobSpec.build(job_id="cmd", plan=ParallelPlan(dp_shard=2), command=("true",))
    shown = {s.job_id: render_job(job_dict(pb.JobInfo(spec=s.to_proto()))) for s in (claimed, commanded)}
    assert "launch deadline 90s" in shown["tr"], shown["tr"]
    assert "launch deadline" not in shown["cmd"], shown["cmd"]
    per_node = JobSpec.build(
        job_id="pn", plan=ParallelPlan(dp_shard=2), command=("torchrun",), launch="per-node", launch_deadline_s=60
    )
    assert "launch deadline 60s" in render_job(job_dict(pb.JobInfo(spec=per_node.to_proto())))
