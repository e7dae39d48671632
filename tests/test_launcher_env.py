"""The signed rank reaches every launcher's workers (issue 32, item 4): whatever started a
worker (torchrun, ft_launcher, dlrover-run, Ray, the agent), the RANK, LOCAL_RANK,
WORLD_SIZE and GROUP_RANK its launcher set must equal its attestation; register() stops a
worker that disagrees before it returns, so before its first collective. A real
coordinator process; the worker side is this process's register()."""

from __future__ import annotations

import pytest

from meshgate.client import LauncherRankMismatch, register
from meshgate.plan import ParallelPlan

PLAN = ParallelPlan(dp_shard=4)


@pytest.fixture
def coordinator(coordinator_factory, monkeypatch):
    running = coordinator_factory(PLAN, slots_per_node=2)
    monkeypatch.setenv("MESHGATE_INSECURE", "1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "MESHGATE_RANK", "MESHGATE_VOUCH"):
        monkeypatch.delenv(name, raising=False)
    return running


def worker(coordinator, node_id: str, local_rank: int):
    return register(
        coordinator=coordinator.address,
        job_id=coordinator.job_id,
        trust_bundle=str(coordinator.trust_bundle_path),
        node_id=node_id,
        local_rank=local_rank,
        worker_id=f"{node_id}/{local_rank}",
    )


def test_a_launcher_that_agrees_with_the_attestation_passes(coordinator, monkeypatch):
    first = worker(coordinator, "n0", 0)  # node rank 0: ranks 0-1
    for name, value in {"RANK": 1, "LOCAL_RANK": 1, "WORLD_SIZE": 4, "GROUP_RANK": 0}.items():
        monkeypatch.setenv(name, str(value))
    second = worker(coordinator, "n0", 1)
    assert (first.rank, second.rank, second.node_rank, second.world_size) == (0, 1, 0, 4)


@pytest.mark.parametrize(
    "name, value, field",
    [("RANK", "3", "rank"), ("GROUP_RANK", "1", "node_rank"), ("WORLD_SIZE", "8", "world_size"), ("RANK", "x", "rank")],
)
def test_a_launcher_that_placed_the_worker_elsewhere_stops_it_naming_the_variable(
    coordinator, monkeypatch, name, value, field
):
    monkeypatch.setenv(name, value)
    with pytest.raises(LauncherRankMismatch) as caught:
        worker(coordinator, "n0", 0)
    message = str(caught.value)
    assert f"{name}={value!r}" in message and f"signed {field}" in message, message
    assert "before its first collective" in message
