"""Each node's hardware on the wire (issue #33): the agent's inventory (agent/inventory.py)
rides on its Join, and on a heartbeat when a restarted coordinator asks; the coordinator
checks it, keeps it in memory, shows it in `meshgate nodes`, and refuses a Join that
presents another live node's GPU or machine-id (coordinator/hardware.py). The pure
decisions first, then agents as shipped."""

from __future__ import annotations

import json
import secrets
import tempfile
import time
from pathlib import Path

import grpc
import pytest

import shipped
from meshgate import admin, wire
from meshgate.agent.inventory import read_nics
from meshgate.attestation import (
    AttestationTemplate,
    BadSignature,
    SigningKey,
    TrustBundle,
    hardware_field,
    verify_attestation,
)
from meshgate.cli import main as meshgate_main
from meshgate.coordinator.cluster_state.backfill import local_group
from meshgate.coordinator.cluster_state.replacement import choose, nearness
from meshgate.coordinator.hardware import (
    MAX_DEVICES,
    HardwareBook,
    check_hardware,
    hardware_clash,
    hardware_words,
    shared_with,
    worker_hardware,
)
from meshgate.launchers.mesh import DeviceMismatchError, check_device, device_mismatch, device_mesh_from
from meshgate.plan import ParallelPlan
from meshgate.coordinator.jobs import ClusterNode
from meshgate.coordinator.rendezvous import Code, RendezvousError
from meshgate.v1 import attestation_pb2, nodes_pb2, nodes_pb2_grpc
from meshgate.v1 import rendezvous_pb2 as pb
from shipped import ShippedCluster
from test_containment import wait_for
from test_jobs_cluster import LIGHT

shipped_host = shipped.shipped_host

MACHINE_A, MACHINE_B, MACHINE_C = "a" * 32, "b" * 32, "c" * 32


def hardware(machine_id: str = MACHINE_A, *uuids: str) -> pb.NodeHardware:
    return pb.NodeHardware(
        machine_id=machine_id,
        gpus=[pb.GpuDevice(index=i, uuid=u, pci_bus_id=f"00000000:0{i}:00.0") for i, u in enumerate(uuids)],
    )


# ---- the decisions ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, named",
    [
        (pb.NodeHardware(machine_id="uninitialized"), "JoinRequest.hardware.machine_id = 'uninitialized'"),
        (pb.NodeHardware(machine_id="A" * 32), "not 32 lower-case hex digits"),
        (
            hardware(MACHINE_A, *[f"GPU-{i}" for i in range(MAX_DEVICES + 1)]),
            f"gpus = '65 entries': at most {MAX_DEVICES}",
        ),
        (hardware(MACHINE_A, "GPU-1", "GPU-1"), "JoinRequest.hardware.gpus = 'GPU-1': the same GPU UUID listed twice"),
        (hardware(MACHINE_A, ""), "gpus[0].uuid = '': empty"),
        (pb.NodeHardware(nics=[pb.NicDevice(name="x" * 500)]), "nics[0].name = 'xxxx"),
    ],
)
def test_bad_hardware_is_refused_naming_the_field_and_a_bounded_value(bad, named):
    with pytest.raises(RendezvousError) as refused:
        check_hardware(bad, "JoinRequest.hardware")
    assert refused.value.code is Code.INVALID_ARGUMENT and named in str(refused.value), str(refused.value)
    assert len(str(refused.value)) < 400


def test_good_hardware_passes():
    check_hardware(hardware(MACHINE_A, "GPU-1", "GPU-2"), "JoinRequest.hardware")
    check_hardware(pb.NodeHardware(), "JoinRequest.hardware")  # a CPU node that knows nothing of itself


def book_of(**nodes: pb.NodeHardware) -> HardwareBook:
    book = HardwareBook()
    for node_id, hardware in nodes.items():
        book.note(node_id, hardware)
    return book


def live(*node_ids: str):
    return lambda node_id: node_id in node_ids


def test_a_gpu_another_live_node_presents_refuses_the_join_naming_both_and_the_device():
    book = book_of(n0=hardware(MACHINE_A, "GPU-1", "GPU-2"), n2=hardware(MACHINE_B, "GPU-9"))
    why = hardware_clash(book, live("n0", "n1", "n2"), "n1", hardware(MACHINE_C, "GPU-2", "GPU-1"))
    assert why is not None and why.startswith(
        "node 'n1' presents GPU GPU-1, which node 'n0' presents too (2 GPU(s) in common)"
    ), why
    assert hardware_clash(book, live("n1", "n2"), "n1", hardware(MACHINE_C, "GPU-1")) is None  # n0 is not live
    assert hardware_clash(book, live("n0", "n1"), "n0", hardware(MACHINE_A, "GPU-1")) is None  # its own record
    # n0 sends other hardware (a Join after its GPUs changed): GPU-1 is no longer its.
    book.note("n0", hardware(MACHINE_A, "GPU-7"))
    assert hardware_clash(book, live("n0", "n1"), "n1", hardware(MACHINE_C, "GPU-1")) is None
    assert hardware_clash(book, live("n0", "n1"), "n1", hardware(MACHINE_C, "GPU-7")) is not None


def test_a_machine_id_another_live_node_presents_refuses_the_join_and_an_unknown_one_never():
    book = book_of(n0=hardware(MACHINE_A, "GPU-1"), n2=hardware(MACHINE_B))
    why = hardware_clash(book, live("n0", "n1", "n2"), "n1", hardware(MACHINE_B, "GPU-5"))
    assert why is not None and why.startswith(
        f"node 'n1' presents machine-id {MACHINE_B}, which node 'n2' presents too: a second agent on one host"
    ), why
    assert "[agent] machine_id_file" in why
    # A GPU in common is named before the host: it is what would hand out the same ranks.
    why = hardware_clash(book, live("n0", "n1", "n2"), "n1", hardware(MACHINE_A, "GPU-1"))
    assert why is not None and why.startswith("node 'n1' presents GPU GPU-1, which node 'n0' presents too"), why
    assert hardware_clash(book, live("n0", "n1"), "n1", hardware(MACHINE_B)) is None  # n2 is not live
    assert hardware_clash(book, live("n0", "n2"), "n2", hardware(MACHINE_B)) is None  # its own record
    unknown = book_of(n0=hardware(""), n2=hardware(""))  # containers with no machine-id: unknown
    assert hardware_clash(unknown, live("n0", "n1", "n2"), "n1", hardware("")) is None
    # n2 renamed to n3 once n2's agent stopped (its heartbeats gone): no longer refused.
    assert hardware_clash(book, live("n0", "n3"), "n3", hardware(MACHINE_B)) is None


def test_a_timeline_line_names_the_machine_its_gpus_domain_and_rails():
    node = hardware(MACHINE_A, "GPU-1", "GPU-2")
    assert hardware_words(node) == f"machine-id {MACHINE_A}; 2 GPU"
    node.nvlink_domain = "5f1c3a2b-9d8e-4f60-a1b2-c3d4e5f60718/7"
    node.nics.extend(pb.NicDevice(name=f"mlx5_{i}", kind="infiniband") for i in range(10))
    node.nics.append(pb.NicDevice(name="eth0", kind="ethernet"))
    assert hardware_words(node) == (
        f"machine-id {MACHINE_A}; 2 GPU, NVLink 5f1c3a2b-9d8e-4f60-a1b2-c3d4e5f60718/7; "
        "rails mlx5_0, mlx5_1, mlx5_2, mlx5_3, mlx5_4, mlx5_5, mlx5_6, mlx5_7 and 2 more"
    )
    assert hardware_words(pb.NodeHardware()) == "machine-id unknown; 0 GPU"


def test_what_a_node_shares_with_another_live_node_is_named():
    book = book_of(n0=hardware(MACHINE_A, "GPU-1"), n1=hardware(MACHINE_A), n2=hardware(MACHINE_B, "GPU-1"))
    assert shared_with(book, live("n0", "n1", "n2"), "n1") == "machine-id shared with node 'n0'"
    assert shared_with(book, live("n0", "n1", "n2"), "n2") == "GPU GPU-1 shared with node 'n0'"
    assert shared_with(book, live("n2"), "n2") == ""
    assert shared_with(book, live("n0", "n3"), "n3") == ""  # unknown hardware shares nothing


# ---- agents as shipped ------------------------------------------------------------------------


def nodes_json(cluster: ShippedCluster, capsys) -> dict[str, dict]:
    capsys.readouterr()
    assert meshgate_main(["nodes", "--coordinator", cluster.address, "--json"]) == 0
    return {n["node_id"]: n for n in json.loads(capsys.readouterr().out)["nodes"]}


def test_agents_as_shipped_show_their_hardware_a_cloned_host_and_a_stolen_gpu_are_refused(shipped_host, capsys):
    """Three simulated hosts, each with its own /etc/machine-id (tests/shipped.py binds it in
    the agent's mount namespace). n0 and n1 show their own machine-ids, no GPU (NVML finds
    no driver) and their NICs, sharing nothing. n2's host is a clone of n0's (n0's
    machine-id): its Join is refused FAILED_PRECONDITION naming both nodes and the
    machine-id, its agent exits saying so, the coordinator keeps nothing of it, and its
    join token is still good: the host given its own machine-id joins with it. A
    coordinator restarted knows nothing of the nodes' hardware until its first heartbeat
    answers ask (send_hardware). Then, as n0's agent, the test says n0 holds GPU-test-0;
    n1's Join presenting it is refused naming both, and n1 is left as it was."""
    with ShippedCluster(shipped_host, ("n0", "n1", "n2"), start=False) as cluster:
        for node_id in ("n0", "n1"):
            cluster.start_agent(node_id)
        machine_ids = {n: cluster.agents[n].machine_id_path.read_text().strip() for n in ("n0", "n1")}
        assert machine_ids["n0"] != machine_ids["n1"] != Path("/etc/machine-id").read_text().strip()
        nics = [{"name": n.name, "kind": n.kind, "address": n.address, "state": n.state} for n in read_nics()]

        def shown() -> dict[str, dict]:
            return nodes_json(cluster, capsys)

        wait_for(lambda: len(shown()) == 2 and all(n["hardware"] for n in shown().values()), 30, cluster.logs)
        for node_id in ("n0", "n1"):
            node = shown()[node_id]
            seen = node["hardware"]
            assert seen["machine_id"] == machine_ids[node_id] and seen["gpus"] == [] and seen["nics"] == nics, node
            assert seen["gpu_source"].startswith("NVML: "), seen
            assert not node.get("hardware_shared"), node
        capsys.readouterr()
        assert meshgate_main(["nodes", "--coordinator", cluster.address]) == 0
        table = capsys.readouterr().out
        assert "HARDWARE" in table and f"0 GPU, {len(nics)} NIC" in table and "shared" not in table, table

        # A restarted coordinator keeps no hardware: it asks each node on its first heartbeat.
        cluster.coordinator.restart()
        cluster.address = cluster.coordinator.address
        wait_for(lambda: all(n["hardware"] for n in shown().values()), 30, cluster.logs)
        assert shown()["n0"]["hardware"]["machine_id"] == machine_ids["n0"]

        # A job's workers: each attestation states its node's hardware, signed, verified offline.
        out = Path(tempfile.mkdtemp(prefix="hw-", dir=cluster.root))
        out.chmod(0o1777)
        cluster.submit("hw", [shipped_host.python, LIGHT[1]], env={"LIGHT_OUT": str(out)}, nodes=2)
        assert cluster.wait_ended("hw").state == pb.SUCCEEDED, cluster.logs()
        bundle = TrustBundle.load(cluster.coordinator.trust_bundle_path)
        seen = {}
        for result in sorted(out.glob("*.json")):
            worker = json.loads(result.read_text())
            assert worker["cuda_device_order"] == "PCI_BUS_ID", worker  # set by the agent for its workers
            signed = attestation_pb2.SignedAttestation.FromString(bytes.fromhex(worker["signed"]))
            verified = verify_attestation(signed, bundle, job_id="hw", nonce=bytes.fromhex(worker["nonce"]), now=0)
            seen[verified.node_id] = verified.hardware
        assert set(seen) == {"n0", "n1"}, seen
        for node_id, claim in seen.items():
            assert claim is not None and (claim.machine_id, claim.gpu_uuid) == (machine_ids[node_id], ""), claim
        # The timeline names each joined node's machine: the one to drain after a hang.
        joined = {
            e.node_id: e.detail
            for e in admin.get_job_timeline(cluster.address, "hw").entries
            if e.moment == pb.TIMELINE_NODE_JOINED
        }
        for node_id in ("n0", "n1"):
            assert f"hardware now: machine-id {machine_ids[node_id]}; 0 GPU" in joined[node_id], joined

        # n0 holds a GPU (the test speaks for its agent, with its credential): n1 may not present it.
        credential = {n: (cluster.agents[n].state_dir / "node.credential").read_bytes() for n in ("n0", "n1")}
        gpu = hardware(machine_ids["n0"], "GPU-test-0")
        with grpc.insecure_channel(cluster.address) as channel:
            nodes = nodes_pb2_grpc.NodesStub(channel)
            nodes.NodeHeartbeat(
                nodes_pb2.NodeHeartbeatRequest(node_id="n0", node_credential=credential["n0"], hardware=gpu),
                metadata=wire.metadata(),
                timeout=10,
            )
            assert [g["uuid"] for g in shown()["n0"]["hardware"]["gpus"]] == ["GPU-test-0"]
            before = shown()["n1"]
            with pytest.raises(grpc.RpcError) as refused:
                nodes.Join(
                    nodes_pb2.JoinRequest(
                        node_id="n1",
                        node_credential=credential["n1"],
                        slots=1,
                        slot_kind="cpu",
                        hardware=hardware(machine_ids["n1"], "GPU-test-0"),
                    ),
                    metadata=wire.metadata(),
                    timeout=10,
                )
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value
            assert refused.value.details().startswith(
                "node 'n1' presents GPU GPU-test-0, which node 'n0' presents too"
            ), refused.value.details()
            after = shown()["n1"]
            assert (after["state"], after["hardware"], after["slots"]) == (
                before["state"],
                before["hardware"],
                before["slots"],
            )
            # A heartbeat with bad hardware is refused naming the field, and changes nothing.
            with pytest.raises(grpc.RpcError) as bad:
                nodes.NodeHeartbeat(
                    nodes_pb2.NodeHeartbeatRequest(
                        node_id="n0", node_credential=credential["n0"], hardware=pb.NodeHardware(machine_id="x")
                    ),
                    metadata=wire.metadata(),
                    timeout=10,
                )
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "NodeHeartbeatRequest.hardware.machine_id = 'x'" in bad.value.details()
        assert [g["uuid"] for g in shown()["n0"]["hardware"]["gpus"]] == ["GPU-test-0"]
        # n2: a clone of n0's host. Refused before its Join changes anything (the last: a job
        # fails while an agent of the cluster is stopped).
        clone = cluster.agents["n2"]
        token = admin.create_join_token(cluster.address, "", node_id="n2").token
        clone.machine_id_path.parent.mkdir(parents=True, exist_ok=True)
        clone.machine_id_path.write_text(machine_ids["n0"] + "\n")
        with pytest.raises(shipped.AgentExited) as exited:
            clone.start(cluster.address, token)
        said = (
            f"join refused: FAILED_PRECONDITION: node 'n2' presents machine-id {machine_ids['n0']}, "
            "which node 'n0' presents too: a second agent on one host"
        )
        assert said in str(exited.value), str(exited.value)[-3000:]
        assert clone.process.returncode != 0
        assert set(shown()) == {"n0", "n1"}
        assert "give each agent its own [agent] machine_id_file" in clone.log()
        # The host given its own identity (systemd-machine-id-setup): the same token joins it.
        clone.machine_id_path.write_text(secrets.token_hex(16) + "\n")
        clone.start(cluster.address, token)
        wait_for(lambda: shown().get("n2", {}).get("hardware"), 30, cluster.logs)
        assert not shown()["n2"].get("hardware_shared") and not shown()["n0"].get("hardware_shared")
        assert clone.stop() == 0

        assert admin.list_nodes(cluster.address).total == 3  # n0, n1, and n2 (stopped)


# ---- the hardware in the attestation ------------------------------------------------------------


def test_a_workers_claim_is_its_local_ranks_gpu_and_its_nodes_identity_and_rails():
    node = pb.NodeHardware(
        machine_id=MACHINE_A,
        gpus=[pb.GpuDevice(index=i, uuid=f"GPU-{i}", pci_bus_id=f"00000000:0{i}:00.0") for i in range(2)],
        nics=[
            pb.NicDevice(name="mlx5_0", kind="infiniband"),
            pb.NicDevice(name="eth0", kind="net"),
            pb.NicDevice(name="mlx5_1", kind="infiniband"),
        ],
        nvlink_domain="d/1",
    )
    claim = worker_hardware(node, 1)
    assert (claim.machine_id, claim.gpu_uuid, claim.gpu_pci_bus_id, claim.nvlink_domain) == (
        MACHINE_A,
        "GPU-1",
        "00000000:01:00.0",
        "d/1",
    )
    assert list(claim.rail_nics) == ["mlx5_0", "mlx5_1"]  # the rails: InfiniBand/RoCE, not the management NIC
    past = worker_hardware(node, 2)  # a slot past the node's GPUs (slots set by hand) names none
    assert (past.gpu_uuid, past.machine_id) == ("", MACHINE_A)


def test_claims_are_cached_per_node_until_the_node_sends_its_hardware_again():
    book = book_of(n0=hardware(MACHINE_A, "GPU-0"))
    first = book.claim("n0", 0)
    assert first == hardware_field(worker_hardware(book.of["n0"], 0)) and book.claim("n0", 0) is first
    assert book.claim("n9", 0) == b""  # not heard: no claim
    book.note("n0", hardware(MACHINE_A, "GPU-7"))  # a Join with other hardware replaces the record
    parsed = attestation_pb2.Attestation.FromString(book.claim("n0", 0))
    assert parsed.hardware.gpu_uuid == "GPU-7"


def _signed(hardware_claim: attestation_pb2.WorkerHardware | None):
    """A real attestation, signed with the claim and verified offline."""
    key = SigningKey.generate()
    plan = ParallelPlan(dp_shard=2)
    template = AttestationTemplate(job_id="hw", generation=0, plan=plan, key=key)
    signed = template.sign(
        rank=1,
        local_rank=1,
        node_rank=0,
        node_id="n0",
        worker_id="w1",
        nonce=b"n" * 16,
        issued_at=time.time(),
        ttl_s=60,
        hardware=hardware_field(hardware_claim),
    )
    bundle = TrustBundle.of(key)
    return verify_attestation(signed, bundle, job_id="hw", nonce=b"n" * 16), signed, bundle


def test_the_claim_is_signed_verified_offline_and_a_changed_claim_fails_the_signature():
    claim = attestation_pb2.WorkerHardware(machine_id=MACHINE_A, gpu_uuid="GPU-1", gpu_pci_bus_id="00000000:01:00.0")
    verified, signed, bundle = _signed(claim)
    assert verified.hardware == claim and verified.as_dict()["hardware"]["gpu_uuid"] == "GPU-1"
    assert verified.describe().endswith(" gpu GPU-1")
    forged = attestation_pb2.SignedAttestation()
    forged.CopyFrom(signed)
    forged.payload = signed.payload.replace(b"GPU-1", b"GPU-2")
    with pytest.raises(BadSignature):
        verify_attestation(forged, bundle, job_id="hw", nonce=b"n" * 16)
    assert _signed(None)[0].hardware is None


@pytest.mark.parametrize(
    "attested, opened, index, said",
    [
        (None, "", -1, None),  # nothing attested (an unheard node)
        (attestation_pb2.WorkerHardware(machine_id=MACHINE_A), "", -1, None),  # a CPU node's claim
        (attestation_pb2.WorkerHardware(gpu_uuid="GPU-8F3C-01"), "8f3c-01", 0, None),  # torch spells it bare
        (
            attestation_pb2.WorkerHardware(gpu_uuid="GPU-8f3c-01", gpu_pci_bus_id="00000000:4f:00.0"),
            "77aa-02",
            3,
            "this worker opened cuda:3 = GPU-77aa-02, its attestation names GPU-8f3c-01 (PCI 00000000:4f:00.0)",
        ),
        (
            attestation_pb2.WorkerHardware(gpu_uuid="GPU-8f3c-01"),
            "",
            -1,
            "the attestation names GPU GPU-8f3c-01 (PCI unknown), but this worker has no CUDA device open",
        ),
    ],
)
def test_the_opened_gpu_must_be_the_attested_one(attested, opened, index, said):
    why = device_mismatch(attested, opened, index)
    assert (why is None) if said is None else (why is not None and why.startswith(said)), why


def test_a_worker_attested_to_a_gpu_on_a_host_without_cuda_stops_before_its_first_collective():
    """This host has no CUDA: a verified attestation naming a GPU stops the worker in
    check_device, as device_mesh_from and Megatron's builders call it, before any
    collective (torch.distributed is never started here)."""
    import torch.distributed as dist

    verified, _, _ = _signed(attestation_pb2.WorkerHardware(gpu_uuid="GPU-8f3c-01"))
    with pytest.raises(DeviceMismatchError, match=r"rank 1 \(local 1\): the attestation names GPU GPU-8f3c-01"):
        device_mesh_from(verified)
    assert not dist.is_initialized()
    check_device(_signed(attestation_pb2.WorkerHardware(machine_id=MACHINE_A))[0])  # a CPU claim: nothing to check


def test_meshgate_verify_prints_the_signed_hardware(tmp_path, capsys):
    claim = attestation_pb2.WorkerHardware(
        machine_id=MACHINE_A, gpu_uuid="GPU-1", gpu_pci_bus_id="00000000:01:00.0", rail_nics=["mlx5_0"]
    )
    _, signed, bundle = _signed(claim)
    (tmp_path / "att.bin").write_bytes(signed.SerializeToString())
    bundle.save(tmp_path / "bundle.json")
    capsys.readouterr()
    assert meshgate_main(["verify", str(tmp_path / "att.bin"), "--trust-bundle", str(tmp_path / "bundle.json")]) == 0
    out = capsys.readouterr().out
    assert (
        f"  hardware      GPU GPU-1 (PCI 00000000:01:00.0); machine-id {MACHINE_A}; NVLink unknown; rails mlx5_0" in out
    ), out


# ---- placement by the discovered NVLink domain (pure decisions, hardware claims as input) -----


def placed(node_id: str, domain: str = "", **labels: str) -> ClusterNode:
    found = ClusterNode(node_id, node_id, 4, "gpu", dict(labels), "h", bytes(32), 0.0, 0.0)
    found.nvlink_domain = domain
    return found


def test_a_replacement_comes_from_the_lost_nodes_nvlink_domain_before_its_switch():
    lost = placed("n1", "d/1", switch="s1", rack="r1")
    candidates = [placed("a-switch", "d/2", switch="s1", rack="r1"), placed("b-domain", "d/1", switch="s9")]
    chosen = choose(lost, candidates)
    assert chosen is not None and chosen.node_id == "b-domain"
    assert nearness(lost, chosen) == (0, "same NVLink domain d/1")
    assert nearness(lost, candidates[0]) == (1, "same switch s1")
    # A domain unknown on either side is near nothing by it: the labels decide.
    assert nearness(placed("n2", "", switch="s1"), placed("c", "", switch="s1")) == (1, "same switch s1")


def test_a_job_is_allocated_inside_one_nvlink_domain_where_one_holds_it():
    """Labels say one switch for all; the domains split them: two nodes of d/2 are given
    together rather than one of each (the smallest domain that holds the job)."""
    idle = [
        placed("n0", "d/1", switch="s1"),
        placed("n1", "d/2", switch="s1"),
        placed("n2", "d/1", switch="s1"),
        placed("n3", "d/2", switch="s1"),
        placed("n4", "d/1", switch="s1"),
    ]
    assert [n.node_id for n in local_group(idle, 2)] == ["n1", "n3"]
    assert {n.nvlink_domain for n in local_group(idle, 3)} == {"d/1"}
    # Without domains the switch decides, as before.
    bare = [placed(n.node_id, "", switch=n.labels["switch"]) for n in idle]
    assert [n.node_id for n in local_group(bare, 2)] == ["n0", "n1"]


def test_a_tp_group_may_span_nodes_of_one_known_nvlink_domain_under_refuse():
    from test_rendezvous import make_state, refused, register, req

    plan = ParallelPlan(tp=4, dp_shard=2)  # tp groups of 4 on nodes of 2 slots: each group spans two nodes
    state = make_state(plan, topology_policy="refuse")
    state.nvlink_domains.update({"node-a": "d/1", "node-b": "d/1", "node-c": "d/2"})
    register(state, req("w0", "node-a", 0, claimed=0))
    register(state, req("w1", "node-a", 1, claimed=1))
    assert register(state, req("w2", "node-b", 0, claimed=2)).warnings == ()  # one NVLink fabric
    error = refused(state, req("w3", "node-c", 0, claimed=3), Code.FAILED_PRECONDITION, "tp group [0, 1, 2, 3]")
    assert "would straddle nodes" in error.message and (
        "outside one NVLink domain ('node-a' in d/1, 'node-b' in d/1, 'node-c' in d/2)" in error.message
    ), error.message
    unknown = make_state(plan, topology_policy="refuse")  # no domain known: a node boundary is the limit
    register(unknown, req("w0", "node-a", 0, claimed=0))
    error = refused(unknown, req("w2", "node-b", 0, claimed=2), Code.FAILED_PRECONDITION, "would straddle nodes")
    assert "NVLink" not in error.message
