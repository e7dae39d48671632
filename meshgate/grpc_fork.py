"""A process that forks workers while gRPC runs sets gRPC's fork support off before gRPC loads.

Why: with it on (gRPC's default on Linux), ``fork()`` runs gRPC's at-fork handlers, and the
child's handler restarts gRPC's event-engine threads inside the forked child. A worker is forked
only to exec its command; between the fork and the exec the child closes the descriptors it does
not pass on (Popen's ``close_fds``), the restarted poller's epoll descriptor among them, and a
poller that wakes in that window fails on it and aborts the child (exit -6) before its command
runs. Popen forks (it cannot vfork) whenever it switches users, so every worker of a job user met
the race; CI met it about once in a thousand starts.

The setting is the forking process's alone: a worker gets the environment the operator gave,
with the variable as it was (``worker_environ``).
"""

from __future__ import annotations

import os
import sys
from typing import Mapping, MutableMapping

VARIABLE = "GRPC_ENABLE_FORK_SUPPORT"
# What the operator had set before this process changed it ("" when it was unset), for workers.
OPERATOR_VALUE = "MESHGATE_OPERATOR_GRPC_ENABLE_FORK_SUPPORT"
UNSET = ""


def disable(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Turn gRPC's fork support off for this process, if gRPC has not loaded yet (it reads the
    variable once, when it loads; a test that runs the agent's main in its own process has)."""
    if "grpc" in sys.modules:
        return False
    if OPERATOR_VALUE not in environ:
        environ[OPERATOR_VALUE] = environ.get(VARIABLE, UNSET)
    environ[VARIABLE] = "0"
    return True


def worker_environ(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment a worker starts from: this process's, with gRPC's fork support as the
    operator left it."""
    env = dict(environ)
    if OPERATOR_VALUE in env:
        operator = env.pop(OPERATOR_VALUE)
        if operator == UNSET:
            env.pop(VARIABLE, None)
        else:
            env[VARIABLE] = operator
    return env
