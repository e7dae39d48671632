"""The seams of the decisions by concern: every event type has its apply handler, states
are enums, and the event codec carries enums and tuples as themselves while still
reading the logs the old codec wrote (comma-joined lists, JSON text, state strings).
Pure: no sockets, no files."""

from __future__ import annotations

import ast
import base64
import dataclasses
import json
from pathlib import Path

import pytest

from meshgate.attestation import secret_hash
from meshgate.coordinator import jobs, readmodel, rendezvous
from meshgate.coordinator.cluster_state import apply as cluster_apply
from meshgate.coordinator.jobs import (
    ClusterNodeJoined,
    ClusterState,
    Job,
    JobAllocated,
    JobEnded,
    JobSpec,
    JobState,
    PoolState,
)
from meshgate.coordinator.rendezvous import (
    GenerationBumped,
    JoinAuth,
    NodeJoined,
    NodeReplaced,
    NodeState,
    NodeStateChanged,
    RankAssigned,
    RendezvousConfig,
    RendezvousState,
)
from meshgate.coordinator.rendezvous import apply as rendezvous_apply
from meshgate.coordinator.store import StoreError, codec
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2

ROOT = Path(__file__).resolve().parent.parent
CONFIG = RendezvousConfig(job_id="j", plan=ParallelPlan(dp_shard=4), slots_per_node=2)


# ---- the handler tables ----------------------------------------------------------------------


def test_every_rendezvous_event_type_has_exactly_one_apply_handler():
    assert set(rendezvous_apply.HANDLERS) == set(rendezvous.EVENT_TYPES)
    assert len(rendezvous.EVENT_TYPES) == len(set(rendezvous.EVENT_TYPES)) == 12


def test_every_cluster_event_type_has_exactly_one_apply_handler():
    assert set(cluster_apply.HANDLERS) == set(jobs.CLUSTER_EVENT_TYPES)
    assert len(jobs.CLUSTER_EVENT_TYPES) == 14


def test_the_codec_knows_every_event_type_of_both_logs():
    assert set(codec.EVENT_TYPES.values()) == set(rendezvous.EVENT_TYPES) | set(jobs.CLUSTER_EVENT_TYPES)


def test_an_object_that_is_no_event_is_refused_by_apply_not_folded_in():
    @dataclasses.dataclass(frozen=True)
    class NodeJoinedLookalike:
        node_id: str

    state = RendezvousState(CONFIG)
    with pytest.raises(KeyError):
        state.apply(NodeJoinedLookalike("n0"))
    with pytest.raises(KeyError):
        ClusterState().apply(NodeJoinedLookalike("n0"))
    assert state.nodes == {}


def _classes(paths):
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                yield f"{path.relative_to(ROOT)}:{node.name}", node.end_lineno - node.lineno + 1


def test_no_class_of_the_decisions_is_longer_than_300_lines():
    coordinator = ROOT / "coordinator"
    paths = [
        *(coordinator / "rendezvous").glob("*.py"),
        *(coordinator / "cluster_state").glob("*.py"),
        coordinator / "jobs.py",
    ]
    sizes = dict(_classes(paths))
    assert sizes["coordinator/rendezvous/state.py:RendezvousState"] <= 300
    assert sizes["coordinator/jobs.py:ClusterState"] <= 300
    assert max(sizes.values()) <= 300, sizes


def test_apply_dispatches_through_the_table_not_an_isinstance_chain():
    for path in (ROOT / "coordinator" / "rendezvous" / "state.py", ROOT / "coordinator" / "jobs.py"):
        tree = ast.parse(path.read_text())
        (apply,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "apply"]
        calls = [n for n in ast.walk(apply) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "isinstance"]
        assert calls == [], path


# ---- states are enums ---------------------------------------------------------------------------


def test_node_states_are_enums_in_the_state_the_events_and_the_proto():
    state = RendezvousState(CONFIG)
    state.apply_all(
        (
            NodeJoined("a", 0, 0.0, "a", 2, "cpu"),
            NodeJoined("b", 1, 0.0, "b", 2, "cpu"),
            NodeJoined("s", -1, 0.0, "s", 2, "cpu"),
        )
    )
    assert {n.node_id: n.state for n in state.nodes.values()} == {
        "a": NodeState.ACTIVE,
        "b": NodeState.ACTIVE,
        "s": NodeState.SPARE,
    }
    events = state.decide_lost(100.0, 15.0)
    assert [e.state for e in events if isinstance(e, NodeStateChanged)] == [NodeState.LOST] * 3
    status = readmodel.status(type("Engine", (), {"state": state, "config": CONFIG})())
    assert [n.state for n in status.nodes] == [
        rendezvous_pb2.NODE_STATE_SPARE,
        rendezvous_pb2.NODE_STATE_ACTIVE,
        rendezvous_pb2.NODE_STATE_ACTIVE,
    ]
    # every Python state has its proto value, and the names line up one to one
    assert {readmodel.node_state_message(s) for s in NodeState} == set(rendezvous_pb2.NodeState.values()) - {0}
    assert {readmodel.pool_state_message(s) for s in PoolState} == set(rendezvous_pb2.PoolState.values()) - {0}


def test_a_pool_node_is_in_exactly_one_pool_state():
    state = ClusterState(heartbeat_timeout_s=15.0)
    for node_id in ("n0", "n1"):
        state.apply_all(state.decide_create_token(secret_hash(f"t-{node_id}"), 600, node_id, 0.0))
        state.apply_all(
            state.decide_join(
                node_id,
                node_id,
                2,
                "cpu",
                {},
                JoinAuth(f"t-{node_id}", public_key=bytes(32), new_credential_hash=secret_hash(b"c")),
                0.0,
            )
        )
    assert [state.pool_state(n, 1.0) for n in state.nodes.values()] == [PoolState.IDLE, PoolState.IDLE]
    state.apply_all(
        state.decide_submit(
            JobSpec.build(job_id="a", plan=ParallelPlan(dp_shard=2), num_nodes=1, command=("true",)), 1.0
        )
    )
    state.apply_all(state.decide_allocate(1.0))
    assert state.pool_state(state.nodes["n0"], 1.0) is PoolState.SERVING
    state.apply_all(state.decide_end("a", JobState.SUCCEEDED, "done", 2.0))
    assert state.pool_state(state.nodes["n0"], 2.0) is PoolState.CLEARING  # until its units show empty
    state.note_units("n0", [])
    assert state.pool_state(state.nodes["n0"], 2.0) is PoolState.IDLE
    state.leave("n1")
    assert state.pool_state(state.nodes["n1"], 2.0) is PoolState.LEFT
    assert state.pool_state(state.nodes["n0"], 100.0) is PoolState.LEFT  # silent past the timeout


# ---- the codec ----------------------------------------------------------------------------------


NEW_FORMS = [
    NodeStateChanged("node-b", NodeState.LOST, 12.5, "no heartbeat"),
    NodeReplaced("s", "b", 1, 13.0),
    JobAllocated("A", ("n0", "n1"), ("n2",), 1.0),
    JobAllocated("B", (), (), 1.0),
    JobEnded("A", JobState.CANCELLED, "make room", 2.0),
    ClusterNodeJoined("n0", "n0", 2, "cpu", (("rack", "r1"), ("switch", "s1")), "c", "00" * 32, "", 0.0),
]


@pytest.mark.parametrize("event", NEW_FORMS, ids=lambda e: type(e).__name__)
def test_enums_and_tuples_round_trip_as_themselves(event):
    text = codec.encode(event)
    back = codec.decode(text, "test")
    assert back == event
    for field in dataclasses.fields(back):
        assert type(getattr(back, field.name)) is type(getattr(event, field.name)), field.name


def test_enums_are_written_as_their_values_and_tuples_as_arrays():
    assert json.loads(codec.encode(NodeStateChanged("b", NodeState.LEFT, 1.0)))["state"] == "left"
    body = json.loads(codec.encode(NEW_FORMS[-1]))
    assert body["labels"] == [["rack", "r1"], ["switch", "s1"]]
    assert json.loads(codec.encode(NEW_FORMS[2]))["nodes"] == ["n0", "n1"]


@pytest.mark.parametrize(
    "text, fragment",
    [
        ('{"kind":"NodeStateChanged","node_id":"b","state":"gone","at":1.0}', "NodeStateChanged.state = 'gone'"),
        ('{"kind":"NodeStateChanged","node_id":"b","state":["lost"],"at":1.0}', "NodeStateChanged.state"),
        ('{"kind":"JobEnded","job_id":"a","state":"DONE","reason":"","at":1.0}', "JobEnded.state = 'DONE'"),
        ('{"kind":"JobAllocated","job_id":"a","nodes":["n0",1],"spares":[],"at":1.0}', "JobAllocated.nodes"),
        ('{"kind":"JobAllocated","job_id":"a","nodes":{"n0":1},"spares":[],"at":1.0}', "JobAllocated.nodes"),
        (
            '{"kind":"ClusterNodeJoined","node_id":"n","hostname":"n","slots":1,"slot_kind":"cpu","labels":[["a"]],'
            '"credential_hash":"","public_key":"","token_hash":"","at":0}',
            "ClusterNodeJoined.labels",
        ),
        (
            '{"kind":"ClusterNodeJoined","node_id":"n","hostname":"n","slots":1,"slot_kind":"cpu","labels":"[1]",'
            '"credential_hash":"","public_key":"","token_hash":"","at":0}',
            "ClusterNodeJoined.labels",
        ),
        ('{"kind":"NodeJoined","node_id":"n","node_rank":true,"at":0}', "NodeJoined.node_rank = True"),
    ],
)
def test_a_field_that_does_not_fit_its_annotation_is_refused_naming_it(text, fragment):
    with pytest.raises(StoreError) as refused:
        codec.decode(text, "log, record 7")
    assert "log, record 7" in str(refused.value) and fragment in str(refused.value), refused.value


def test_an_event_field_the_codec_could_not_carry_is_refused_when_its_type_is_registered():
    @dataclasses.dataclass(frozen=True)
    class Labelled:
        labels: dict[str, str]
        at: float

    with pytest.raises(TypeError, match=r"Labelled fields \['labels'\]"):
        codec._field_hints(Labelled)


# ---- logs the old codec wrote --------------------------------------------------------------------

# Records as the codec before enums and tuples wrote them (byte for byte).
OLD_RECORDS = {
    '{"at":1.0,"job_id":"A","kind":"JobAllocated","nodes":"n0,n1","spares":"n2"}': JobAllocated(
        "A", ("n0", "n1"), ("n2",), 1.0
    ),
    '{"at":1.0,"job_id":"B","kind":"JobAllocated","nodes":"n3","spares":""}': JobAllocated("B", ("n3",), (), 1.0),
    '{"at":2.0,"job_id":"A","kind":"JobEnded","reason":"make room","state":"CANCELLED"}': JobEnded(
        "A", JobState.CANCELLED, "make room", 2.0
    ),
    '{"at":0.0,"credential_hash":"c","hostname":"n0","kind":"ClusterNodeJoined",'
    '"labels":"{\\"rack\\":\\"r1\\",\\"switch\\":\\"s1\\"}","node_id":"n0","public_key":"00",'
    '"slot_kind":"cpu","slots":2,"token_hash":""}': ClusterNodeJoined(
        "n0", "n0", 2, "cpu", (("rack", "r1"), ("switch", "s1")), "c", "00", "", 0.0
    ),
    '{"at":12.5,"kind":"NodeStateChanged","node_id":"node-b","reason":"no heartbeat","state":"lost"}': NodeStateChanged(
        "node-b", NodeState.LOST, 12.5, "no heartbeat"
    ),
}


@pytest.mark.parametrize("text", list(OLD_RECORDS), ids=lambda t: json.loads(t)["kind"])
def test_an_old_record_decodes_to_the_same_event(text):
    assert codec.decode(text, "old log") == OLD_RECORDS[text]


def test_records_whose_fields_did_not_change_form_are_written_byte_for_byte_as_before():
    text = '{"at":12.5,"kind":"NodeStateChanged","node_id":"node-b","reason":"no heartbeat","state":"lost"}'
    assert codec.encode(OLD_RECORDS[text]) == text


def _old_encode(event) -> str:
    """The old codec's rules: str/int/float/bool fields only, so lists were comma-joined,
    labels JSON text and states their strings."""
    body = {}
    for field in dataclasses.fields(event):
        value = getattr(event, field.name)
        if field.name == "labels":
            value = json.dumps(dict(value), separators=(",", ":"), sort_keys=True)
        elif isinstance(value, tuple):
            value = ",".join(value)
        elif hasattr(value, "value"):
            value = value.value
        body[field.name] = value
    body["kind"] = type(event).__name__
    return json.dumps(body, separators=(",", ":"), sort_keys=True)


def _chain(pin: codec.JobPinned, bodies: list[str]) -> list[tuple[int, str]]:
    """Stored records as the store writes them: a hash chain over the stored text."""
    rows, prev = [], codec.GENESIS
    pin_body = json.dumps({**dataclasses.asdict(pin), "kind": "JobPinned"}, separators=(",", ":"), sort_keys=True)
    for seq, body in enumerate([pin_body, *bodies], start=1):
        total = codec.chain_sum(prev, seq, body)
        rows.append((seq, f"{prev} {total} {body}"))
        prev = total
    return rows


def _cluster_history() -> tuple[ClusterState, list]:
    state, log = ClusterState(heartbeat_timeout_s=15.0), []

    def step(events):
        state.apply_all(events)
        log.extend(events)

    for node_id, labels in (("n0", {"switch": "s1", "rack": "r1"}), ("n1", {"switch": "s1"}), ("n2", {})):
        step(state.decide_create_token(secret_hash(f"t-{node_id}"), 600, node_id, 0.0))
        step(
            state.decide_join(
                node_id,
                node_id,
                2,
                "cpu",
                labels,
                JoinAuth(f"t-{node_id}", public_key=bytes(32), new_credential_hash=secret_hash(node_id.encode())),
                0.0,
            )
        )
    for job_id, nodes, spares in (("a", 2, 1), ("b", 1, 0)):
        step(
            state.decide_submit(
                JobSpec.build(
                    job_id=job_id,
                    plan=ParallelPlan(dp_shard=2 * nodes),
                    num_nodes=nodes,
                    spares=spares,
                    command=("true",),
                ),
                1.0,
            )
        )
    step(state.decide_allocate(1.0))
    step(state.decide_end("a", JobState.FAILED, "worker exited 1", 2.0))
    step(state.decide_summarize("a", "c3VtbWFyeQ==", 2.0))
    step(state.decide_cancel("b", "no room", 3.0))
    return state, log


def _cluster_view(state: ClusterState):
    return (
        {n.node_id: (n.labels, n.job_id, n.units_clear, n.credential_hash) for n in state.nodes.values()},
        {j.spec.job_id: (j.state, j.nodes, j.spares, j.reason, j.summary, j.ended_at) for j in state.jobs.values()},
        {h: (t.node_id, t.used_by) for h, t in state.tokens.items()},
        list(state.pending),
        list(state.unpruned),
    )


def test_a_cluster_log_written_by_the_old_codec_replays_to_the_same_state():
    state, log = _cluster_history()
    kinds = {type(e) for e in log}
    assert {ClusterNodeJoined, JobAllocated, JobEnded} <= kinds
    assert any(isinstance(e, JobAllocated) and e.spares for e in log)  # a non-empty and an empty list
    old_bodies = [_old_encode(e) for e in log]
    assert any('"nodes":"n1,n0"' in b for b in old_bodies) and any('"labels":"{}"' in b for b in old_bodies)
    verified = codec.verify_records(_chain(codec.cluster_pin(), old_bodies), "cluster log", codec.cluster_pin())
    assert verified.events == tuple(log)
    replayed = ClusterState(heartbeat_timeout_s=15.0)
    replayed.apply_all(verified.events)
    assert _cluster_view(replayed) == _cluster_view(state)
    # a log that goes on in the new form after its old records reads as one history
    new_bodies = [codec.encode(e) for e in log]
    mixed = old_bodies[: len(log) // 2] + new_bodies[len(log) // 2 :]
    again = codec.verify_records(_chain(codec.cluster_pin(), mixed), "cluster log", codec.cluster_pin())
    assert again.events == tuple(log)


def test_a_job_log_written_by_the_old_codec_replays_to_the_same_state():
    config = RendezvousConfig(job_id="j", plan=ParallelPlan(dp_shard=4), slots_per_node=2)
    state, log = RendezvousState(config), []
    for events in (
        (
            NodeJoined("a", 0, 0.0, "a", 2, "cpu"),
            NodeJoined("b", 1, 0.0, "b", 2, "cpu"),
            NodeJoined("s", -1, 0.0, "s", 2, "cpu"),
        ),
        tuple(RankAssigned(f"w{r}", r, "ab"[r // 2], r % 2, 1.0) for r in range(4)),
    ):
        state.apply_all(events)
        log.extend(events)
    state.touch_node("a", 50.0)
    state.touch_node("s", 50.0)
    lost = state.decide_lost(60.0, 15.0)  # b is lost, the spare takes its block
    assert {type(e) for e in lost} == {NodeStateChanged, NodeReplaced, GenerationBumped}
    state.apply_all(lost)
    log.extend(lost)
    pin = codec.job_pin(config)
    verified = codec.verify_records(_chain(pin, [_old_encode(e) for e in log]), "job log", pin)
    assert verified.events == tuple(log)
    replayed = RendezvousState(config)
    replayed.apply_all(verified.events)
    view = lambda s: (
        {n.node_id: (n.state, n.node_rank) for n in s.nodes.values()},
        s.generation,
        s.by_rank,
        s.lost_since,
    )
    assert view(replayed) == view(state)
    assert replayed.nodes["b"].state is NodeState.REPLACED and replayed.nodes["s"].state is NodeState.ACTIVE


def test_a_summary_kept_before_node_states_were_enums_shows_its_states():
    # NodeStatus{node_id=1:"n0", state=3:"lost"} inside Status{job_id=1:"j", nodes=7:[...]}, as the
    # string field wrote it before NodeState.
    node = b"\x0a\x02n0" + b"\x1a\x04lost"
    old = b"\x0a\x01j" + b"\x3a" + bytes([len(node)]) + node
    job = Job(
        JobSpec.build(job_id="j", plan=ParallelPlan(dp_shard=2), num_nodes=1, command=("true",)),
        0.0,
        state=JobState.FAILED,
        summary=base64.b64encode(old).decode(),
    )
    final = readmodel.job_status(None, job)
    assert [(n.node_id, n.state) for n in final.nodes] == [("n0", rendezvous_pb2.NODE_STATE_LOST)]
