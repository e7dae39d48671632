"""One spelling of a job (issue 22, part 5): the proto message meshgate.v1.JobSpec is the
schema. Its enums are the Python enums member for member and the job file's words; one
converter (coordinator/jobspec.py) reads every field the message sets, whatever the
field; the wire has a plan file's defaults; the log keeps the proto's JSON and still
replays the JSON form written before.

Pure tests first, then one real coordinator in jobs mode whose log already holds a job
of the old form, submitted to through a client that knows nothing but what the
server's reflection tells it (what grpcurl does): JSON in, the proto's JSON out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import fields as dataclass_fields
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from conftest import REPO, _spawn, _wait_for_address, write_config
from meshgate.coordinator.jobs import ClusterState, JobSpec, JobState, JobSubmitted
from meshgate.coordinator.jobspec import PY_ENUMS, PY_NAMES, RankMode, RestartPolicy, TopologyPolicy, enum_prefix
from meshgate.coordinator.rendezvous import Code, RendezvousError
from meshgate.job_cli import JOB_KEYS, JobCliError, file_spelling, load_job_file, spec_from_args, spec_message
from meshgate.plan import DEFAULT_ORDER, SIZE_FIELDS, ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb

# A record as the coordinator wrote it before the proto was the schema (JobSpec.to_json
# of that version, byte for byte): JobSpec.build's keywords, lower-case policies.
OLD_RECORD = (
    '{"command":["python","train.py"],"env":{"HF_TOKEN":"s3cret"},"job_id":"old-1","lost_node_timeout_s":60.0,'
    '"max_restarts":3,"mode":"claimed","node_ids":[],"num_nodes":2,"plan":{"cp":1,"dp_replicate":1,"dp_shard":2,'
    '"ep":1,"etp":1,"gradient_accumulation_steps":1,"microbatches":1,"order":["tp","cp","dp_shard","dp_replicate",'
    '"pp"],"pp":1,"tp":2},"restart_policy":"on-failure","slots_per_node":2,"spares":1,"topology_policy":"refuse"}'
)
OLD_SPEC = JobSpec.build(
    job_id="old-1",
    plan=ParallelPlan(tp=2, dp_shard=2),
    num_nodes=2,
    command=("python", "train.py"),
    env={"HF_TOKEN": "s3cret"},
    mode=RankMode.CLAIMED,
    topology_policy=TopologyPolicy.REFUSE,
    spares=1,
    restart_policy=RestartPolicy.ON_FAILURE,
    lost_node_timeout_s=60,
)


def string_field(number: int, text: bytes) -> bytes:
    """Field ``number`` as a length-delimited (string) field on the wire."""
    out, tag = bytearray(), number << 3 | 2
    while tag >= 0x80:
        out.append(tag & 0x7F | 0x80)
        tag >>= 7
    return bytes(out) + bytes([tag, len(text)]) + text


def refused(call, *needles: str) -> RendezvousError:
    with pytest.raises(RendezvousError) as caught:
        call()
    assert caught.value.code is Code.INVALID_ARGUMENT, caught.value
    for needle in needles:
        assert needle in caught.value.message, caught.value.message
    return caught.value


# ---- the schema is the proto --------------------------------------------------------------------


@pytest.mark.parametrize("field_name", ["mode", "topology_policy", "restart_policy"])
def test_each_proto_enum_is_a_python_enum_member_for_member_and_the_job_files_words(field_name):
    enum_type = pb.JobSpec.DESCRIPTOR.fields_by_name[field_name].enum_type
    python = PY_ENUMS[enum_type.name]
    prefix = enum_prefix(enum_type)
    named = [v for v in enum_type.values if v.number != 0]
    assert enum_type.values_by_number[0].name == prefix + "UNSPECIFIED"
    assert [v.name.removeprefix(prefix) for v in named] == [m.name for m in python]
    assert [file_spelling(field_name, v.number) for v in named] == [m.value for m in python]


def test_every_proto_field_is_a_jobspec_field_and_no_other():
    proto = {PY_NAMES.get(f.name, f.name) for f in pb.JobSpec.DESCRIPTOR.fields}
    assert proto == {f.name for f in dataclass_fields(JobSpec)}
    assert JOB_KEYS == {f.name for f in pb.JobSpec.DESCRIPTOR.fields} - {"plan", "job_id"} | {"id"}


def test_a_spec_is_a_fixed_point_of_its_one_converter():
    spec = OLD_SPEC
    message = spec.to_proto()
    assert (message.mode, message.topology_policy, message.restart_policy) == (
        pb.RANK_MODE_CLAIMED,
        pb.TOPOLOGY_POLICY_REFUSE,
        pb.RESTART_POLICY_ON_FAILURE,
    )
    assert message.nodes == 2 and message.HasField("max_restarts") and message.max_restarts == 3
    assert JobSpec.from_proto(message) == spec
    assert JobSpec.from_json(spec.to_json()) == spec
    assert json.loads(spec.to_json()) == json_format.MessageToDict(message, preserving_proto_field_name=True)
    message.command.append("changed")  # a fresh message each time: the spec's own stays as it was
    assert spec.to_proto().command == ["python", "train.py"]


def test_an_unset_field_takes_its_documented_default():
    spec = JobSpec.from_proto(pb.JobSpec(plan=pb.JobSpec().plan, command=["x"]), "chosen")
    assert (spec.job_id, spec.mode, spec.topology_policy, spec.restart_policy) == (
        "chosen",
        RankMode.ASSIGNED,
        TopologyPolicy.WARN,
        RestartPolicy.NEVER,
    )
    assert (spec.num_nodes, spec.slots_per_node, spec.max_restarts, spec.lost_node_timeout_s) == (1, 1, 0, 300.0)
    assert spec.plan == ParallelPlan()
    on_failure = JobSpec.from_proto(
        pb.JobSpec(plan={}, command=["x"], restart_policy=pb.RESTART_POLICY_ON_FAILURE), "j"
    )
    assert on_failure.max_restarts == 3  # unset max_restarts: 3 with ON_FAILURE
    explicit = pb.JobSpec(plan={}, command=["x"], restart_policy=pb.RESTART_POLICY_ON_FAILURE, max_restarts=0)
    assert JobSpec.from_proto(explicit, "j").max_restarts == 0  # set to 0: no restart
    refused(lambda: JobSpec.from_proto(pb.JobSpec(plan={}, command=["x"])), "job_id must be a non-empty string")


def test_the_wire_plan_has_a_plan_files_defaults_and_a_full_plan_digests_as_before():
    plan = ParallelPlan.from_wire(pb.JobSpec(plan={"tp": 2}).plan)
    assert plan == ParallelPlan(tp=2) == ParallelPlan.from_toml_text("[plan]\ntp = 2\n")
    assert plan.order == DEFAULT_ORDER
    sizes = dict(zip(SIZE_FIELDS, (2, 2, 2, 1, 1, 1, 1, 4, 8)))
    no_order = ParallelPlan.from_wire(pb.JobSpec(plan=sizes).plan)
    assert no_order.order == DEFAULT_ORDER and no_order.digest() == ParallelPlan(**sizes).digest()
    full = ParallelPlan(tp=2, dp_shard=2, order=("cp", "tp", "dp_shard", "dp_replicate", "pp"))
    assert ParallelPlan.from_wire(full.to_proto()).digest() == ParallelPlan.from_proto(full.to_proto()).digest()
    assert ParallelPlan.from_wire(full.to_proto()).canonical_bytes() == full.canonical_bytes()
    with pytest.raises(ValueError, match="must be >= 1"):  # attestations: a plan meshgate wrote is whole
        ParallelPlan.from_proto(pb.JobSpec(plan={"tp": 2}).plan)


@pytest.mark.parametrize(
    "message, needles",
    [
        (pb.JobSpec(command=["x"]), ("spec.plan must be set",)),
        (pb.JobSpec(plan={"tp": 3}, nodes=2, command=["x"]), ("nodes 2 does not divide the plan's world size 3",)),
        (pb.JobSpec(plan={"order": ["tp"]}, command=["x"]), ("spec.plan: order must be a permutation",)),
        (pb.JobSpec(plan={}, mode=7, command=["x"]), ("spec.mode: 7 is not a RankMode", "RANK_MODE_CLAIMED")),
        (pb.JobSpec(plan={}, restart_policy=9, command=["x"]), ("spec.restart_policy: 9 is not a RestartPolicy",)),
        (pb.JobSpec(plan={}, command=["x" * 40_000, "y" * 40_000]), ("command: at most 64 KiB",)),
        (pb.JobSpec(plan={}, command=["x"], env={f"V{i}": "" for i in range(300)}), ("env: at most 256 variables",)),
    ],
)
def test_a_bad_message_is_refused_naming_the_field(message, needles):
    assert len(refused(lambda: JobSpec.from_proto(message, "j"), *needles).message) < 400


@pytest.mark.parametrize(
    "number, text, was",
    [
        (6, b"claimed", "mode"),
        (7, b"refuse", "topology_policy"),
        (11, b"on-failure", "restart_policy"),
        (99, b"new", None),
    ],
)
def test_an_old_clients_string_field_is_refused_by_number_never_dropped(number, text, was):
    """A client built before the enums sends mode "claimed" as field 6: the coordinator
    would run an assigned-mode job if it dropped it."""
    raw = pb.JobSpec(plan={}, command=["x"]).SerializeToString() + string_field(number, text)
    error = refused(lambda: JobSpec.from_proto(pb.JobSpec.FromString(raw), "j"), f"spec field {number} is not known")
    if was:
        new = pb.JobSpec.DESCRIPTOR.fields_by_name[was].number
        assert f"it was the string {was}, now the enum field {was} ({new})" in error.message


def test_a_plan_field_this_coordinator_does_not_know_is_refused_too():
    """A newer client's plan field would change the plan its workers expect (and its digest)."""
    message = pb.JobSpec(plan={"tp": 2}, command=["x"])
    message.plan.MergeFromString(string_field(42, b"x"))
    refused(lambda: JobSpec.from_proto(message, "j"), "spec.plan field 42 is not known to this coordinator")


# ---- the log ------------------------------------------------------------------------------------


def test_a_record_of_the_old_form_still_replays():
    state = ClusterState()
    state.apply(JobSubmitted("old-1", OLD_RECORD, 5.0, owner="submitter:alice"))
    assert state.jobs["old-1"].spec == OLD_SPEC and state.jobs["old-1"].state is JobState.PENDING
    # an older record still, before node_ids, restart_policy and lost_node_timeout_s were kept
    older = json.loads(OLD_RECORD)
    for key in ("node_ids", "restart_policy", "max_restarts", "lost_node_timeout_s"):
        del older[key]
    spec = JobSpec.from_json(json.dumps(older))
    assert (spec.restart_policy, spec.max_restarts, spec.lost_node_timeout_s) == (RestartPolicy.NEVER, 0, 300.0)


def test_the_record_is_the_protos_json_read_back_as_it_was_accepted():
    record = json.loads(OLD_SPEC.to_json())
    assert record["mode"] == "RANK_MODE_CLAIMED" and record["nodes"] == 2 and "num_nodes" not in record
    assert record["plan"] == json_format.MessageToDict(OLD_SPEC.plan.to_proto(), preserving_proto_field_name=True)
    # read back without validating again: a record is what was accepted then
    record["job_id"] = "team:a/run"
    assert JobSpec.from_json(json.dumps(record)).job_id == "team:a/run"
    for damaged in ('{"job_id": "j"}', "[]", '{"job_id": "j", "plan": {"tp": 3}, "nodes": "x"}'):
        with pytest.raises(ValueError, match="not a job spec"):
            JobSpec.from_json(damaged)


# ---- the job file -------------------------------------------------------------------------------


def submit_args(**given) -> argparse.Namespace:
    """``meshgate job submit``'s arguments with nothing given but ``given``."""
    args = dict(
        file=None,
        plan=None,
        id="",
        nodes=None,
        node=[],
        node_list=None,
        nodes_from_slurm=False,
        slots_per_node=None,
        mode=None,
        topology_policy=None,
        spares=None,
        restart_policy=None,
        max_restarts=None,
        env=None,
        command=[],
    )
    return argparse.Namespace(**{**args, **given})


def test_the_example_job_file_maps_onto_the_proto_by_name():
    path = str(REPO / "examples" / "job-llama.toml")
    message = spec_from_args(submit_args(file=path))
    assert (message.nodes, message.slots_per_node, message.spares, message.max_restarts) == (2, 8, 1, 3)
    assert (message.mode, message.topology_policy, message.restart_policy) == (
        pb.RANK_MODE_ASSIGNED,
        pb.TOPOLOGY_POLICY_REFUSE,
        pb.RESTART_POLICY_ON_FAILURE,
    )
    assert message.lost_node_timeout_s == 300 and dict(message.env) == {"NCCL_DEBUG": "WARN"}
    assert ParallelPlan.from_proto(message.plan) == ParallelPlan.from_mapping(load_job_file(path)["plan"])
    spec = JobSpec.from_proto(message, "llama")  # what the coordinator makes of it
    assert (spec.mode, spec.restart_policy, spec.num_nodes) == (RankMode.ASSIGNED, RestartPolicy.ON_FAILURE, 2)
    # flags given override the file; those not given leave it
    flagged = spec_from_args(
        submit_args(
            file=path, mode="claimed", spares=0, max_restarts=0, nodes=None, env=["A=1"], command=["--", "true"]
        )
    )
    assert (flagged.mode, flagged.spares, flagged.max_restarts, flagged.nodes) == (pb.RANK_MODE_CLAIMED, 0, 0, 2)
    assert dict(flagged.env) == {"NCCL_DEBUG": "WARN", "A": "1"} and list(flagged.command) == ["true"]


@pytest.mark.parametrize(
    "table, needle",
    [
        ({"mode": "sideways"}, "job.toml: [job] mode: 'sideways' is not one of assigned, claimed"),
        ({"restart_policy": "always"}, "[job] restart_policy: 'always' is not one of never, on-failure"),
        ({"topology_policy": "unspecified"}, "[job] topology_policy: 'unspecified' is not one of warn, refuse, allow"),
        ({"nodes": -1}, "job.toml: [job] nodes: -1 does not fit the field"),
        ({"env": {"A": 1}}, "[job] env: {'A': 1} does not fit the field"),
        ({"gpus": 8}, "[job] unknown key 'gpus'"),
        ({"plan": {"tp": 0}}, "job.toml: [plan] tp must be >= 1"),
    ],
)
def test_a_bad_job_file_value_is_refused_naming_the_files_key(table, needle):
    with pytest.raises(JobCliError) as caught:
        spec_message({"plan": {"tp": 2}, **table}, "job.toml: ")
    assert needle in str(caught.value), str(caught.value)


# ---- a real coordinator, through reflection -------------------------------------------------------


class ReflectedAdmin:
    """What grpcurl does: the schema from the server's reflection, each request from JSON,
    each reply to JSON; none of meshgate's generated stubs."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(self.channel))
        self.service = self.pool.FindServiceByName("meshgate.v1.Admin")

    def request(self, method: str, body: dict):
        input_type = self.service.FindMethodByName(method).input_type
        return json_format.ParseDict(body, message_factory.GetMessageClass(input_type)())

    def call(self, method: str, body: dict | object) -> dict:
        request = self.request(method, body) if isinstance(body, dict) else body
        reply_class = message_factory.GetMessageClass(self.service.FindMethodByName(method).output_type)
        stub = self.channel.unary_unary(
            f"/meshgate.v1.Admin/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=reply_class.FromString,
        )
        return json_format.MessageToDict(stub(request, timeout=60), preserving_proto_field_name=True)

    def refused(self, body: dict | object) -> str:
        with pytest.raises(grpc.RpcError) as caught:
            self.call("SubmitJob", body)
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT, caught.value
        assert len(caught.value.details()) < 400
        return caught.value.details()


def write_old_record(config_path: Path) -> None:
    """The cluster's log as a coordinator of the version before would have left it: one
    job of the old form appended, through the store the daemon opens."""
    from meshgate.coordinator.config import CoordinatorConfig
    from meshgate.coordinator.leadership import durable_mark, log_pin, store_dir
    from meshgate.coordinator.store import open_store

    config = CoordinatorConfig.load(config_path)
    store = open_store(
        config.store_kind,
        state_dir=store_dir(config),
        job_id=config.log_id,
        pin=log_pin(config),
        mark=durable_mark(config),
    )

    async def append() -> None:
        await store.append([JobSubmitted("old-1", OLD_RECORD, 5.0, owner="")])
        await store.aclose()

    asyncio.run(append())


@pytest.fixture(scope="module")
def reflected(tmp_path_factory):
    root = tmp_path_factory.mktemp("spelling")
    config = write_config(
        root / "coordinator.toml",
        {
            "server": {"listen": "127.0.0.1:0", "insecure": True},
            "keys": {"dir": str(root / "keys")},
            "store": {"dir": str(root / "state")},
        },
    )
    port_file, log_path = root / "coordinator.addr", root / "coordinator.log"
    first = _spawn(config, port_file, log_path)  # makes its keys, state and log
    try:
        _wait_for_address(first, port_file, log_path, 90)
    finally:
        first.terminate()
        assert first.wait(timeout=30) == 0, log_path.read_text()
    port_file.unlink()
    write_old_record(config)
    process = _spawn(config, port_file, log_path)
    try:
        client = ReflectedAdmin(_wait_for_address(process, port_file, log_path, 90))
        yield client
        assert process.poll() is None, log_path.read_text()  # never crashed on input
    finally:
        process.terminate()
        process.wait(timeout=30)


def submitted(client: ReflectedAdmin, spec: dict) -> dict:
    return client.call("SubmitJob", {"spec": {"command": ["true"], **spec}, "wait_for_nodes": True})


@pytest.mark.slow
def test_a_log_written_before_replays_in_a_real_coordinator(reflected):
    job = reflected.call("GetJob", {"job_id": "old-1"})
    assert job["state"] == "PENDING"
    assert job["spec"] == json.loads(OLD_SPEC.to_json())  # the proto's JSON, enums by name
    assert job["plan_digest"] == json_format.MessageToDict(pb.JobInfo(plan_digest=OLD_SPEC.plan.digest()))["planDigest"]


@pytest.mark.slow
def test_an_unset_plan_axis_is_1_and_an_empty_order_the_default_order(reflected):
    only_tp = submitted(reflected, {"job_id": "tp2", "plan": {"tp": 2}})
    assert only_tp["state"] == "PENDING"
    assert only_tp["spec"]["plan"] == {**{name: 1 for name in SIZE_FIELDS}, "tp": 2, "order": list(DEFAULT_ORDER)}
    assert only_tp["spec"]["slots_per_node"] == 2 and only_tp["spec"]["nodes"] == 1
    sizes = dict(zip(SIZE_FIELDS, (2, 2, 2, 1, 1, 1, 1, 4, 8)))
    nine = submitted(reflected, {"job_id": "nine", "plan": sizes, "nodes": 2})
    assert nine["spec"]["plan"] == {**sizes, "order": list(DEFAULT_ORDER)}
    digest = json_format.MessageToDict(pb.JobInfo(plan_digest=ParallelPlan(**sizes).digest()))["planDigest"]
    assert nine["plan_digest"] == digest  # the digest of the whole plan, as a plan file gives it


@pytest.mark.slow
def test_enums_are_given_by_name(reflected):
    job = submitted(
        reflected,
        {
            "job_id": "by-name",
            "plan": {"dp_shard": 2},
            "mode": "RANK_MODE_CLAIMED",
            "topology_policy": "TOPOLOGY_POLICY_REFUSE",
            "restart_policy": "RESTART_POLICY_ON_FAILURE",
        },
    )
    spec = job["spec"]
    assert (spec["mode"], spec["topology_policy"], spec["restart_policy"], spec["max_restarts"]) == (
        "RANK_MODE_CLAIMED",
        "TOPOLOGY_POLICY_REFUSE",
        "RESTART_POLICY_ON_FAILURE",
        3,
    )
    plain = submitted(reflected, {"job_id": "defaults", "plan": {}})  # UNSPECIFIED: the documented defaults
    assert (plain["spec"]["mode"], plain["spec"]["topology_policy"], plain["spec"]["restart_policy"]) == (
        "RANK_MODE_ASSIGNED",
        "TOPOLOGY_POLICY_WARN",
        "RESTART_POLICY_NEVER",
    )
    assert reflected.call("GetJob", {"job_id": "by-name"})["spec"] == spec


@pytest.mark.slow
def test_refusals_name_the_field_and_create_nothing(reflected):
    before = reflected.call("ListJobs", {}).get("jobs", [])
    answers = {
        "divide": reflected.refused({"spec": {"plan": {"tp": 3}, "nodes": 2, "command": ["true"]}}),
        "order": reflected.refused({"spec": {"plan": {"order": ["tp", "tp"]}, "command": ["true"]}}),
        "mode": reflected.refused({"spec": {"plan": {}, "mode": 7, "command": ["true"]}}),
        "id": reflected.refused({"spec": {"job_id": "../" + "x" * 5000, "plan": {}, "command": ["true"]}}),
    }
    old_client = reflected.request("SubmitJob", {"spec": {"plan": {}, "command": ["true"]}})
    old_client.spec.MergeFromString(string_field(6, b"claimed"))  # the old string mode
    answers["old"] = reflected.refused(old_client)
    assert "nodes 2 does not divide the plan's world size 3" in answers["divide"], answers
    assert "spec.plan: order must be a permutation" in answers["order"], answers
    assert "spec.mode: 7 is not a RankMode" in answers["mode"], answers
    assert "job_id '../xxxx" in answers["id"], answers
    assert "spec field 6 is not known to this coordinator: it was the string mode" in answers["old"], answers
    assert reflected.call("ListJobs", {}).get("jobs", []) == before


def test_a_time_limit_is_given_as_a_duration_flag_or_the_files_seconds_and_an_old_spec_has_none():
    from meshgate.cli import build_parser

    parser = build_parser()
    argv = ["job", "submit", "--plan", str(REPO / "examples" / "plan-4.toml"), "--nodes", "2"]
    flagged = spec_from_args(parser.parse_args([*argv, "--time-limit", "2h", "--", "true"]))
    assert flagged.time_limit_s == 7200 and JobSpec.from_proto(flagged, "j").time_limit_s == 7200.0
    with pytest.raises(SystemExit):  # argparse: "argument --time-limit: '2x': use seconds, ..."
        parser.parse_args([*argv, "--time-limit", "2x", "--", "true"])
    assert spec_message({"plan": {"dp_shard": 4}, "time_limit_s": 90}).time_limit_s == 90
    # an older client's spec (and the log's older records) carry none: no limit
    assert JobSpec.from_proto(spec_message({"plan": {"dp_shard": 4}, "command": ["x"]}), "j").time_limit_s == 0.0
