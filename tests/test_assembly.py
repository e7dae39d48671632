"""The daemon's one assembly (coordinator/assembly.py), served in process over real gRPC:
a single-job config and a jobs-mode config start through the same function, say where
they listen once the store answered, serve health and the trust bundle, and stop on
``stop``; a state it cannot trust is refused by name and left as found."""

from __future__ import annotations

import asyncio
import secrets
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshgate.attestation import TrustBundle, accept_trust_bundle, verify_attestation
from meshgate.coordinator import assembly
from meshgate.coordinator.config import ConfigError, CoordinatorConfig
from meshgate.coordinator.store import StoreError
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb
from meshgate.v1 import rendezvous_pb2_grpc

from conftest import write_config

PLAN = ParallelPlan(tp=2, dp_shard=2)
SERVER = {"listen": "127.0.0.1:0", "insecure": True}
SINGLE_JOB = {"job": {"id": "job-1", "slots_per_node": 2}, "plan": {"tp": 2, "dp_shard": 2}}


def load(tmp_path, sections: dict, store: str = "memory") -> CoordinatorConfig:
    document = {**sections, "server": SERVER, "keys": {"dir": "keys"}, "store": {"kind": store, "dir": "state"}}
    return CoordinatorConfig.load(write_config(tmp_path / "coordinator.toml", document))


async def start(config: CoordinatorConfig, port_file=None):
    """assembly.serve in a task; returns it, its stop event and the Daemon once it serves."""
    stop = asyncio.Event()
    serving = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(assembly.serve(config, port_file, stop=stop, on_serving=serving.set_result))
    await asyncio.wait({task, serving}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()
    assert serving.done(), "the daemon did not serve within 30 s"
    return task, stop, serving.result()


@pytest.mark.parametrize("sections", [SINGLE_JOB, {}], ids=["single-job", "jobs-mode"])
async def test_both_configs_serve_through_the_one_assembly(tmp_path, sections):
    config = load(tmp_path, sections)
    port_file = tmp_path / "port"
    task, stop, daemon = await start(config, port_file)
    try:
        assert port_file.read_text().strip() == daemon.address == f"127.0.0.1:{daemon.port}"
        assert daemon.bundle_path == config.keys_dir / "trust-bundle.json" and daemon.bundle_path.exists()
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            signed = await rendezvous_pb2_grpc.RendezvousStub(channel).GetTrustBundle(
                pb.GetTrustBundleRequest(), timeout=10
            )
        on_disk = TrustBundle.load(daemon.bundle_path)
        assert set(accept_trust_bundle(signed, on_disk).keys) == set(on_disk.keys)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)
    with socket.socket() as probe:  # stopped: nothing listens there any more
        assert probe.connect_ex(("127.0.0.1", daemon.port)) != 0


async def test_a_single_job_daemon_answers_register_with_a_verifiable_attestation(tmp_path):
    config = load(tmp_path, SINGLE_JOB, store="sqlite")
    task, stop, daemon = await start(config)
    try:
        nonce = secrets.token_bytes(32)
        request = pb.RegisterRequest(
            job_id="job-1", worker_id="w0", nonce=nonce, node_id="node-a", plan_digest=PLAN.digest()
        )
        request.assigned.local_rank = 1
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            answer = await rendezvous_pb2_grpc.RendezvousStub(channel).Register(request, timeout=10)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)
    attestation = verify_attestation(
        answer.attestation, TrustBundle.load(daemon.bundle_path), job_id="job-1", nonce=nonce, generation=0, plan=PLAN
    )
    assert (attestation.rank, attestation.job_id) == (1, "job-1")
    assert (config.state_dir / "jobs" / "job-1" / "state.sqlite3").exists()  # the declared job's log, as any job's


async def test_a_state_it_cannot_trust_is_refused_by_name_and_left_as_found(tmp_path):
    config = load(tmp_path, SINGLE_JOB, store="sqlite")
    config.state_dir.mkdir()
    state = config.state_dir / "state.sqlite3"
    state.write_bytes(b"not a database, but somebody's bytes" * 100)
    before = state.read_bytes()
    with pytest.raises(StoreError, match=r"refusing the job's state, left as found: .*--reset-state"):
        await asyncio.wait_for(
            assembly.serve(config, config_path=tmp_path / "coordinator.toml", stop=asyncio.Event()), timeout=30
        )
    assert state.read_bytes() == before


async def test_a_listen_address_it_cannot_bind_is_a_config_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        host, port = taken.getsockname()
        config = load(tmp_path, SINGLE_JOB)
        config = type(config)(**{**config.__dict__, "listen": f"{host}:{port}"})
        with pytest.raises(ConfigError, match=rf"\[server\] listen: cannot bind '127.0.0.1:{port}'"):
            assembly.build(config)
