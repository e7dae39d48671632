"""Who serves a job's data-plane store on this node's master, and, for per-slot jobs, the
store host node rank 0's agent starts on the first connection (issue 32, item 2).

The agent listens on the job's master (agent/netif.py ``MasterReservation``) from its first
Join and never releases the port while the job runs here, whoever serves the store:

* ``HANDED_OVER``: a meshgate handler hosts it (torchrun's, started per node by the agent or
  by hand), taking a copy of the socket over the agent's Unix socket (``master_socket``); a
  job with no command (Ray, external workers) may do the same.
* ``AGENT``: per-slot workers (one process per slot). Every worker gets
  ``TORCHELASTIC_USE_AGENT_STORE=True``, so torch's ``env://`` and ``tcp://`` rendezvous make
  every rank, rank 0 included, a TCPStore client of MASTER_ADDR:MASTER_PORT; on node rank 0
  the agent starts ``python -m meshgate.store_host`` (agent/launcher.py
  ``Launcher.start_store_host``: the job user, the generation's unit, the socket inherited)
  which serves the store on the held socket. Worker rank 0 could not take a descriptor
  through ``env://``, and a port released for it to bind could be taken by anyone first.
* ``WORKERS``: the operator set MASTER_ADDR and MASTER_PORT in the agent's environment, so
  nothing is held: worker rank 0's own ``init_process_group`` hosts the store, as torch's
  default does.

Why socket activation, not a store host started with the workers: a job that never uses
torch.distributed (or uses its own port) pays nothing, not even a torch import; the agent
watches the held socket for readability (``loop.add_reader``; it accepts nothing while a
store host may serve) and starts the store host only once a connection is pending, which
then accepts it from the backlog.
Why one store host per generation, killed with that generation's workers (it lives in their
containment unit): a new world never reads keys an earlier world left (torch's elastic agent
makes a fresh store per restart for the same reason). Between generations the socket stays
with the agent: connections that arrive meanwhile wait in its backlog (netif.py BACKLOG)
for the next generation's store host.
"""

from __future__ import annotations

import asyncio
import enum
import importlib.util
import logging
import select
import socket
import subprocess
import sys
import threading
from typing import Callable, Optional

log = logging.getLogger("meshgate.agent")

AGENT_STORE_ENV = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
OUTPUT_LIMIT = 8192  # what of a store host's output reaches the agent's log


class StoreHost(enum.Enum):
    """Who serves the job's store on this node's master (see the module docstring)."""

    HANDED_OVER = "a meshgate handler, on the socket the agent hands over"
    AGENT = "the agent's store host, on the socket the agent holds"
    WORKERS = "worker rank 0's own init_process_group (operator-set master)"


def store_host_for(has_command: bool, per_node: bool, agent_holds_listener: bool) -> StoreHost:
    """Who serves the store for a launch (pure)."""
    if not has_command or per_node:
        return StoreHost.HANDED_OVER
    return StoreHost.AGENT if agent_holds_listener else StoreHost.WORKERS


def store_host_missing(find_spec: Callable[[str], object] = importlib.util.find_spec) -> Optional[str]:
    """Why this agent's interpreter cannot serve a per-slot job's store (torch is not
    beside it), said once at the agent's start rather than at a job's first connection;
    None where it can. Looks torch up without importing it (the agent never loads it)."""
    if find_spec("torch") is not None:
        return None
    return (
        f"torch is not importable by the agent's interpreter ({sys.executable}): node rank 0 of a "
        "per-slot job serves the job's store with it (python -m meshgate.store_host), so the "
        "workers of such jobs that use torch.distributed will fail to meet here; install "
        "meshgate[torch] beside the agent (docs/deploying.md)"
    )


def store_env(host: StoreHost) -> dict[str, str]:
    """What per-slot workers need to be clients of the agent's store (nothing otherwise)."""
    return dict(AGENT_STORE_ENV) if host is StoreHost.AGENT else {}


class StoreActivation:
    """One generation's store host on node rank 0: armed when its workers start, started
    once at the first pending connection, closed when the generation's unit closes (the
    store host dies with the unit). A store host that ends by itself (torch missing, a
    crash) leaves connections queued that nothing would ever answer: from then on the agent
    accepts and closes each, so the workers' rendezvous fails at once, naming the connection
    (their restart policy decides), rather than at its timeout."""

    def __init__(self, listener: socket.socket, start: Callable[[], subprocess.Popen], what: str) -> None:
        self.listener = listener
        self.start = start  # agent/launcher.py Launcher.start_store_host, bound to this generation
        self.what = what  # "job J generation G", for the log
        self.process: Optional[subprocess.Popen] = None
        self.closed = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    def arm(self) -> None:
        self._watch(self._pending)

    def close(self) -> None:
        """Before the unit is killed and before the socket is closed (an fd watched by the
        loop must never be closed under it)."""
        self.closed = True
        self._unwatch()

    def _watch(self, callback: Callable[[], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.listener.fileno(), callback)

    def _unwatch(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.listener.fileno())
            self._loop = None

    def _pending(self) -> None:
        self._unwatch()  # once per generation: from now on the store host accepts
        try:
            process = self.start()
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            log.error("%s: cannot start the store host: %s; its workers cannot meet", self.what, exc)
            self._watch(self._refuse)
            return
        self.process = process
        log.info("%s: a worker connected to the master; store host pid %d serves it", self.what, process.pid)
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._follow, args=(process, loop), name="store-host", daemon=True).start()

    def _refuse(self) -> None:
        """A connection nobody will serve: accepted and closed (the socket stays listening)."""
        ready = select.poll()  # the socket is blocking (its mode is shared with the store hosts)
        ready.register(self.listener.fileno(), select.POLLIN)
        if not ready.poll(0):
            return
        try:
            connection, _ = self.listener.accept()  # in the queue: accept does not wait
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.warning("%s: cannot refuse a connection to the master: %s", self.what, exc)
            return
        connection.close()

    def _ended_by_itself(self) -> None:
        if not self.closed:
            log.error("%s: the store host is gone; connections to the master are refused", self.what)
            self._watch(self._refuse)

    def _follow(self, process: subprocess.Popen, loop: asyncio.AbstractEventLoop) -> None:
        """Reap the store host (an unreaped one would keep its unit from emptying) and log
        what it said when it ended by itself."""
        said = process.stdout.read(OUTPUT_LIMIT) if process.stdout is not None else b""
        if process.stdout is not None:
            while process.stdout.read(65536):
                pass  # the rest, unread: its pipe must not fill
            process.stdout.close()
        code = process.wait()
        if code in (-9, -15):  # killed with its generation's unit: it served until then
            log.info("%s: store host pid %d ended (%d)", self.what, process.pid, code)
            return
        log.error(
            "%s: store host pid %d exited %d: %s", self.what, process.pid, code, said.decode(errors="replace")[-2000:]
        )
        try:
            loop.call_soon_threadsafe(self._ended_by_itself)
        except RuntimeError:  # the loop is closed: the agent is gone
            pass
