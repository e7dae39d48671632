"""A per-node launch (issue 32, item 1): pure tests of the spec's validation and the
proto's round trip, the `job submit --launch` flag, and what the agent hands a per-node
launcher (its env, and the local ranks a launcher's exit stands for). The launcher run
for real (torchrun under three shipped agents) is tests/test_torchrun.py."""

from __future__ import annotations

import argparse

import pytest

from meshgate.agent.launch import Launch, master_env, per_node_env
from meshgate.coordinator.jobspec import JobSpec, LaunchMode, RankMode
from meshgate.coordinator.rendezvous import Code, RendezvousError
from meshgate.job_cli import add_parser, spec_from_args
from meshgate.launchers.local import LocalLauncher, WorkerSpec
from meshgate.plan import ParallelPlan
from meshgate.v1 import nodes_pb2
from meshgate.v1 import rendezvous_pb2 as pb

PLAN = ParallelPlan(dp_shard=3, tp=2)
TORCHRUN = ("torchrun", "--rdzv-backend=meshgate", "--rdzv-id=j", "train.py")


def build(**kwargs) -> JobSpec:
    kwargs.setdefault("command", TORCHRUN)
    return JobSpec.build(job_id="j", plan=PLAN, num_nodes=3, **kwargs)


def test_per_node_defaults_to_claimed_and_round_trips_through_the_proto_and_the_log():
    spec = build(launch="per-node")
    assert (spec.launch, spec.mode) == (LaunchMode.PER_NODE, RankMode.CLAIMED)
    message = spec.to_proto()
    assert (message.launch, message.mode) == (pb.LAUNCH_MODE_PER_NODE, pb.RANK_MODE_CLAIMED)
    assert JobSpec.from_proto(message) == spec == JobSpec.from_json(spec.to_json())
    plain = build()  # unset: one worker per slot, assigned ranks, as before
    assert (plain.launch, plain.mode) == (LaunchMode.PER_SLOT, RankMode.ASSIGNED)


@pytest.mark.parametrize(
    "kwargs, needles",
    [
        ({"launch": "per-node", "mode": "assigned"}, ("mode 'assigned' with launch 'per-node'", "claimed")),
        ({"launch": "per-node", "command": ()}, ("command is empty", "per-node")),
        ({"launch": "per-host"}, ("launch must be per-slot or per-node", "per-host")),
    ],
)
def test_a_per_node_spec_that_cannot_run_is_invalid_argument_naming_the_field(kwargs, needles):
    with pytest.raises(RendezvousError) as caught:
        build(**kwargs)
    assert caught.value.code is Code.INVALID_ARGUMENT
    for needle in needles:
        assert needle in caught.value.message, caught.value.message


def test_the_submit_flag_sets_the_spec_field(tmp_path):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["job", "submit", "--plan", "plan-4", "--nodes", "2", "--launch", "per-node", "--", "x"])
    assert spec_from_args(args).launch == pb.LAUNCH_MODE_PER_NODE


def joined(node_rank: int = 1) -> nodes_pb2.JoinResponse:
    reply = nodes_pb2.JoinResponse(node_rank=node_rank)
    reply.assignment.CopyFrom(
        nodes_pb2.LaunchAssignment(
            command=list(TORCHRUN), nprocs=2, first_rank=2, world_size=6, master_addr="10.0.0.5", master_port=29400
        )
    )
    reply.assignment.per_node = True
    return reply


def test_a_per_node_launcher_gets_its_place_and_no_worker_variables(monkeypatch):
    for name in ("NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    reply = joined()
    env = {**master_env(reply), **per_node_env(reply)}
    assert {k: env[k] for k in ("NODE_RANK", "GROUP_RANK", "NNODES", "NPROC_PER_NODE")} == {
        "NODE_RANK": "1",
        "GROUP_RANK": "1",
        "NNODES": "3",
        "NPROC_PER_NODE": "2",
    }
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.5", "29400")
    spec = WorkerSpec(TORCHRUN, 1, "c:1", "j", "n1", "/b", env=env, first_rank=2, per_node_slots=2)
    launched = spec.env_for(0)
    # torchrun gives its workers LOCAL_RANK; the launcher itself is no worker.
    assert "LOCAL_RANK" not in launched and "LOCAL_WORLD_SIZE" not in launched
    assert launched["MESHGATE_RANK_BLOCK"] == "2-3"


def test_a_per_node_launchers_exit_is_every_slots_exit():
    per_node = Launch(LocalLauncher(WorkerSpec(TORCHRUN, 1, "c:1", "j", "n1", "/b", per_node_slots=4)))
    assert list(per_node.local_ranks(0)) == [0, 1, 2, 3]
    per_slot = Launch(LocalLauncher(WorkerSpec(TORCHRUN, 4, "c:1", "j", "n1", "/b")))
    assert list(per_slot.local_ranks(2)) == [2]
