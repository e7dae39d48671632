"""meshgate: signed mesh coordinates for distributed training.

A worker calls ``meshgate.register(...)`` for a verified attestation of its rank and
coordinate, then ``meshgate.await_world(...)`` for the barrier and the master address.
"""

__version__ = "0.2.0"

_LAZY = {
    "register": "meshgate.client",
    "await_world": "meshgate.client",
    "heartbeat": "meshgate.client",
    "report": "meshgate.progress",
    "World": "meshgate.client",
    "RendezvousRefused": "meshgate.client",
    "ParallelPlan": "meshgate.plan",
    "current_plan": "meshgate.plan",
    "VerifiedAttestation": "meshgate.attestation",
    "TrustBundle": "meshgate.attestation",
}


def __getattr__(name: str):
    # Lazy, so `import meshgate.plan` stays cheap and free of grpc.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'meshgate' has no attribute {name!r}")
