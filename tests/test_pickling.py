"""Every meshgate exception a worker can raise survives pickling (Ray and Fabric send a
worker's exception to the driver pickled): same class, same message, same attributes.

The classes are discovered, not listed, so a new exception class is covered the day it
is added: one that cannot be built from a single message must get a sample below (and a
``__reduce__`` if its constructor takes more than the message).
"""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil

import grpc
import pytest

import meshgate.launchers
from meshgate.client import RendezvousRefused
from meshgate.coordinator.rendezvous import Code, RendezvousError
from meshgate.launchers.mesh import MeshMismatchError

MODULES = [
    "meshgate.client",
    "meshgate.connection",
    "meshgate.attestation",
    "meshgate.plan",
    "meshgate.coordinator.rendezvous.errors",
] + [f"meshgate.launchers.{m.name}" for m in pkgutil.iter_modules(meshgate.launchers.__path__)]

# Classes whose constructor needs more than a message: one realistic instance each.
SAMPLES = {
    RendezvousRefused: lambda: RendezvousRefused(
        grpc.StatusCode.PERMISSION_DENIED, "node_id 'n1' has no joined agent to vouch for worker_id 'w'"
    ),
    RendezvousError: lambda: RendezvousError(Code.FAILED_PRECONDITION, "generation 1 is over"),
    MeshMismatchError: lambda: MeshMismatchError(
        "tp",
        rank=3,
        attested_coordinate=1,
        actual_coordinate=0,
        attested_members=[2, 3],
        actual_members=[3, 2],
        framework="ray",
        detail="group order",
    ),
}


def exception_classes() -> list[type]:
    found = []
    for name in MODULES:
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == module.__name__:
                found.append(cls)
    return found


def test_discovery_finds_the_classes_workers_raise():
    found = set(exception_classes())
    assert {RendezvousRefused, MeshMismatchError, RendezvousError} <= found
    assert len(found) >= 20  # attestation refusals, launcher argument errors, topology errors


@pytest.mark.parametrize("cls", exception_classes(), ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_exception_round_trips_through_pickle(cls):
    if cls in SAMPLES:
        original = SAMPLES[cls]()
    else:
        try:
            original = cls("a refusal that names the field 'x'")
        except TypeError as exc:  # pragma: no cover - the failure this test exists for
            pytest.fail(f"{cls.__qualname__} needs more than a message ({exc}): add a SAMPLES entry and a __reduce__")
    clone = pickle.loads(pickle.dumps(original))
    assert type(clone) is cls
    assert str(clone) == str(original)
    assert clone.args == original.args
    assert vars(clone) == vars(original)


def test_refusal_keeps_its_grpc_code_and_details():
    refused = RendezvousRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, "world is full: all 4 ranks are held")
    clone = pickle.loads(pickle.dumps(refused))
    assert clone.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert clone.details == "world is full: all 4 ranks are held"
    assert str(clone) == "RESOURCE_EXHAUSTED: world is full: all 4 ranks are held"
