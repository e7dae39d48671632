"""A job's id and content are checked at submit (issue 20, item 6): ids are short
DNS-label-like names that are safe as one path component; no NUL byte in the command or
env; the env may not set the agent's MESHGATE_* variables. Pure tests of JobSpec.build and
the paths derived from ids, then one real coordinator process fed every hostile id: each
is INVALID_ARGUMENT and the coordinator's state and key directories are byte-identical."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from conftest import _spawn, _wait_for_address, write_config
from meshgate import admin
from meshgate.client import RendezvousRefused
from meshgate.coordinator.jobs import (
    ENV_WITHHELD,
    MAX_JOB_ID_LEN,
    ClusterState,
    JobSpec,
    JobSubmitted,
    check_job_id,
    loggable,
)
from meshgate.coordinator.leadership import StateRefused, job_path
from meshgate.coordinator.rendezvous import Code, RendezvousError
from meshgate.coordinator.store import codec
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb

PLAN = ParallelPlan(dp_shard=2)
HOSTILE_IDS = [
    "../x",
    "/abs",
    ".",
    "..",
    "a/b",
    "-rf",
    "x" * 300,
    "../../keys/active",
    "a..b",
    ".hidden",
    "a\x00b",
    "a b",
    "job:1",
    "ü",
    "",
]


def build(**kwargs) -> JobSpec:
    kwargs.setdefault("job_id", "j")
    kwargs.setdefault("command", ("python", "train.py"))
    return JobSpec.build(plan=PLAN, num_nodes=1, **kwargs)


def refused(code: Code, call, *needles: str) -> RendezvousError:
    with pytest.raises(RendezvousError) as caught:
        call()
    assert caught.value.code is code, caught.value
    for needle in needles:
        assert needle in caught.value.message, caught.value.message
    return caught.value


# ---- ids ------------------------------------------------------------------------------------


@pytest.mark.parametrize("job_id", HOSTILE_IDS)
def test_every_hostile_id_is_invalid_argument_naming_a_bounded_id(job_id):
    error = refused(Code.INVALID_ARGUMENT, lambda: build(job_id=job_id), "job_id")
    assert len(error.message) < 300, error.message
    if job_id:
        assert repr(job_id[:16])[:-1] in error.message, error.message  # names (a prefix of) the id


@pytest.mark.parametrize("job_id", ["a", "train-7", "Run_2.3", "9", "a.b-c_d", "x" * MAX_JOB_ID_LEN])
def test_dns_label_like_ids_pass(job_id):
    assert build(job_id=job_id).job_id == job_id


@pytest.mark.parametrize("job_id", HOSTILE_IDS[:8])
def test_no_hostile_id_becomes_a_path(tmp_path, job_id):
    with pytest.raises(StateRefused, match="cannot have files under"):
        job_path(tmp_path / "jobs", job_id)
    assert job_path(tmp_path / "jobs", "ok-1") == tmp_path / "jobs" / "ok-1"
    assert list(tmp_path.iterdir()) == []  # nothing created either way


def test_an_old_record_with_an_id_of_the_old_rule_still_loads():
    """Ids accepted before the rule stay readable (the log must replay); their paths are
    refused on use (job_path) instead."""
    old = build(job_id="ok").to_json().replace('"job_id":"ok"', '"job_id":"team:a/run"')
    assert JobSpec.from_json(old).job_id == "team:a/run"
    with pytest.raises(RendezvousError):
        check_job_id("team:a/run")


# ---- content --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"command": ("python", "-c", "print(1)\x00rm -rf /")}, "command"),
        ({"env": {"A": "x\x00y"}}, "env"),
        ({"env": {"A\x00B": "x"}}, "env"),
    ],
)
def test_a_nul_byte_anywhere_is_refused(kwargs, needle):
    refused(Code.INVALID_ARGUMENT, lambda: build(**kwargs), needle, "NUL")


@pytest.mark.parametrize(
    "name",
    [
        "MESHGATE_INSECURE",
        "MESHGATE_COORDINATOR",
        "MESHGATE_TRUST_BUNDLE",
        "MESHGATE_TLS_CA",
        "MESHGATE_TLS_CERT",
        "MESHGATE_TLS_KEY",
        "MESHGATE_AGENT_SOCKET",
        "MESHGATE_VOUCH",
        "MESHGATE_ANYTHING",
    ],
)
def test_the_env_may_not_set_the_agents_variables(name):
    refused(Code.INVALID_ARGUMENT, lambda: build(env={"OK": "1", name: "x"}), f"env {name!r}", "MESHGATE_*")


def test_other_env_and_owner_round_trip_through_the_log():
    spec = build(env={"HF_TOKEN": "s3cret", "OMP_NUM_THREADS": "4"})
    event = ClusterState().decide_submit(spec, 5.0, wait_for_nodes=True)[0]  # no nodes have joined
    assert event.owner == ""  # the operator (an insecure dev coordinator)
    record = JobSubmitted("j", spec.to_json(), 5.0, owner="submitter:alice")
    again = codec.decode(codec.encode(record), "here")
    assert again == record
    # a record written before owners were kept has no owner field, and still decodes
    body = json.loads(codec.encode(record))
    del body["owner"]
    old = codec.decode(json.dumps(body), "here")
    assert old.owner == "" and old.spec == record.spec
    state = ClusterState()
    state.apply(old)
    assert state.jobs["j"].owner == "" and state.jobs["j"].spec.env == (
        ("HF_TOKEN", "s3cret"),
        ("OMP_NUM_THREADS", "4"),
    )


def test_logs_see_env_names_never_values():
    record = JobSubmitted("j", build(env={"HF_TOKEN": "s3cret"}).to_json(), 5.0, owner="submitter:alice")
    shown = loggable(record)
    assert "s3cret" not in str(shown) and "s3cret" not in repr(shown) and "HF_TOKEN" in str(shown)
    assert json.loads(shown.spec)["env"] == {"HF_TOKEN": ENV_WITHHELD}
    assert "s3cret" in record.spec  # the log keeps the value; only what is printed withholds it


# ---- a real coordinator: hostile submits change nothing ---------------------------------------


def tree_digest(*roots: Path) -> dict[str, str]:
    """Every file under ``roots``, by path, with the sha256 of its bytes."""
    return {
        str(path): hashlib.sha256(path.read_bytes()).hexdigest()
        for root in roots
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


@pytest.mark.slow
def test_hostile_submits_leave_the_coordinators_state_byte_identical(tmp_path):
    config = write_config(
        tmp_path / "coordinator.toml",
        {
            "server": {"listen": "127.0.0.1:0", "insecure": True},
            "keys": {"dir": str(tmp_path / "keys")},
            "store": {"dir": str(tmp_path / "state")},
        },
    )
    port_file, log_path = tmp_path / "coordinator.addr", tmp_path / "coordinator.log"
    process = _spawn(config, port_file, log_path)
    try:
        address = _wait_for_address(process, port_file, log_path, 60)

        def submit(job_id: str, **spec) -> pb.JobInfo:
            spec.setdefault("command", ["true"])
            message = pb.JobSpec(job_id=job_id, plan=PLAN.to_proto(), nodes=1, **spec)
            return admin.submit_job(address, message, tls=False, wait_for_nodes=True)  # no node joins here

        assert submit("first").state == pb.PENDING  # the state exists and holds one job
        before = tree_digest(tmp_path / "state", tmp_path / "keys")
        assert before
        answers = []
        hostile = [(job_id, {}) for job_id in HOSTILE_IDS if job_id] + [
            ("nul", {"command": ["true\x00", "x"]}),
            ("nul-env", {"env": {"A": "x\x00"}}),
            ("insecure", {"env": {"MESHGATE_INSECURE": "1"}}),
            ("elsewhere", {"env": {"MESHGATE_COORDINATOR": "evil:1"}}),
            ("bundle", {"env": {"MESHGATE_TRUST_BUNDLE": "/tmp/mine.json"}}),
        ]
        for job_id, spec in hostile:
            with pytest.raises(RendezvousRefused) as caught:
                submit(job_id, **spec)
            answers.append((job_id, caught.value.code.name, caught.value.details))
        assert all(code == "INVALID_ARGUMENT" for _, code, _ in answers), answers
        assert all(len(details) < 400 for _, _, details in answers), answers
        # every refusal names the id or the field
        for job_id, _, details in answers[: len(HOSTILE_IDS) - 1]:
            assert "job_id" in details, (job_id, details)
        assert tree_digest(tmp_path / "state", tmp_path / "keys") == before
        assert not (tmp_path / "x").exists() and not (tmp_path / "abs").exists()
        assert process.poll() is None  # the daemon never crashes on input
        assert [j.spec.job_id for j in admin.list_jobs(address, tls=False).jobs] == ["first"]
    finally:
        process.terminate()
        process.wait(timeout=30)
