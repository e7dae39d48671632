"""torchrun on meshgate: ``torchrun --rdzv-backend=meshgate --rdzv-id=JOB ...``.

A rendezvous backend (entry point ``torchrun.handlers``: ``meshgate``) and a worker bootstrap
(``torchrun ... -m meshgate.torchrun train.py ARGS``), for a job submitted beforehand in
claimed mode with no command (``meshgate job submit --mode claimed --nodes N ...``): its
nodes are the ones meshgate allocated (or was given), their agents follow it, and torchrun,
started on each of those nodes, starts the workers.

The handler asks the node's own agent (its Unix socket: ``--rdzv-conf agent_socket=PATH``,
else MESHGATE_AGENT_SOCKET, else where the shipped agent serves it: the vouch_socket of
/etc/meshgate/agent.toml or MESHGATE_AGENT_CONFIG, default /var/lib/meshgate-agent/vouch.sock)
where this node stands in job JOB: its node rank in the job's topology order, the job's
nodes and slots, node rank 0's master, the generation, whether it is a hot spare, whether
the job is over. It never calls the coordinator itself.
- ``next_rendezvous()``: node rank and node count from the agent; the store is a TCPStore
  that node rank 0's handler hosts at the job's master (the endpoint node rank 0's agent
  offered and the coordinator hands out: MasterOffered) for the whole run, one key prefix
  per generation. The workers get a store of their own in each generation (worker rank 0
  hosts it on the master's address, at a port node rank 0 picks; ``use_agent_store`` is
  False), so no worker reads keys an earlier generation's world left. Same node, same node
  rank, in every generation.
- A restart (torchrun calls ``next_rendezvous()`` again) is a new meshgate generation: the
  handler reports a failed worker to the agent for the generation it formed (unless that
  generation is over already), and waits until the agent has rejoined the next one.
- ``num_nodes_waiting()`` is 1 once the agent's generation moved past the one formed (a
  worker failed elsewhere, a node was lost) or the job ended, so torchrun's monitor loop
  restarts its workers; it answers from a view at most ``poll_s`` old.
- A hot spare waits in ``next_rendezvous()`` until it takes over a lost node's rank, or
  once the job is over exits 0 (SystemExit: torch 2.13 mishandles its own
  RendezvousGracefulExitError, see ``_not_needed``); a job that is over (cancelled, failed)
  closes the rendezvous (RendezvousClosedError, ``is_closed()``).
- ``shutdown()`` reports this node's workers as exited: 0 after torchrun's run succeeded,
  so the job is SUCCEEDED once every node's torchrun finished; 1 after it failed.

Workers inherit torchrun's environment, so the handler exports what ``meshgate.register()``
reads: MESHGATE_JOB, MESHGATE_AGENT_SOCKET, MESHGATE_NODE_ID, MESHGATE_TRUST_BUNDLE (the
agent's, unless set), GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME (the interface the agent
advertises, unless set: gloo would otherwise pick the address the host name resolves to),
MESHGATE_COORDINATOR (``--rdzv-endpoint``, when given; else the
environment or the client config, as for every meshgate client) and
MESHGATE_TORCHRUN_GENERATION. The bootstrap registers the worker's RANK as a claimed rank
(vouched for by the agent), checks the signed attestation against torchrun's RANK,
GROUP_RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE (which must be the node's slots),
and stops a worker that disagrees before it runs ``train.py`` (so before any collective).

This module imports torch and grpc only when a handler is made or a worker attests.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from meshgate.agent_socket import IFNAME_ENVS, SOCKET_ENV, find_agent_socket

if TYPE_CHECKING:  # pragma: no cover
    from meshgate.agent_socket import LocalNode
    from meshgate.attestation import VerifiedAttestation

BACKEND = "meshgate"
GENERATION_ENV = "MESHGATE_TORCHRUN_GENERATION"
DEFAULT_JOIN_TIMEOUT_S = 600.0


class TorchrunRankError(RuntimeError):
    """torchrun's placement of this worker differs from meshgate's signed one."""


def handler_creator() -> Callable[[Any], Any]:
    """The ``torchrun.handlers`` entry point: torch calls it for the handler factory."""
    return create_handler


def create_handler(params: Any) -> Any:
    """A MeshgateRendezvousHandler for torchrun's RendezvousParameters."""
    return _handler_class()(params)


def _ask(socket_path: str, request: dict, timeout: float = 10.0) -> dict:
    from meshgate.client import RendezvousRefused, _ask_agent

    try:
        return _ask_agent(socket_path, request, timeout)
    except RendezvousRefused as exc:  # no socket there, or it refuses this uid: the message says what to set
        raise ConnectionError(
            f"cannot reach the meshgate agent at {socket_path}: {exc} (or pass --rdzv-conf agent_socket=PATH)"
        ) from None
    except OSError as exc:
        raise ConnectionError(
            f"cannot reach the meshgate agent at {socket_path} ({exc.strerror or exc}): is an agent running on "
            f"this node? Set {SOCKET_ENV} or --rdzv-conf agent_socket=PATH to its vouch_socket"
        ) from None


def local_node(socket_path: str, launcher: bool = False) -> "LocalNode":
    """What the node's agent says about this node (its "whoami" answer). ``launcher``: the
    caller is torchrun's handler, which the agent adopts (agent/adopted.py)."""
    from meshgate.agent_socket import LocalNode

    answer = _ask(socket_path, {"whoami": True, "launcher": True} if launcher else {"whoami": True})
    if "error" in answer or "node_id" not in answer:
        raise ConnectionError(f"the meshgate agent at {socket_path} refused: {str(answer.get('error'))[:300]}")
    known = {f.name for f in dataclasses.fields(LocalNode)}
    return LocalNode(**{k: v for k, v in answer.items() if k in known})


def report_exits(socket_path: str, generation: int, local_ranks: list[int], exit_code: int, detail: str) -> int:
    """Tell the agent that these workers of ``generation`` exited; the generation after it."""
    exited = {"generation": generation, "local_ranks": local_ranks, "exit_code": exit_code, "detail": detail}
    answer = _ask(socket_path, {"exited": exited}, timeout=120.0)
    if "error" in answer:
        raise ConnectionError(f"the meshgate agent at {socket_path} refused the exits: {str(answer['error'])[:300]}")
    return int(answer["generation"])


def _handler_class() -> type:
    """Made on first use: the base class is torch's, imported only then."""
    global MeshgateRendezvousHandler
    if "MeshgateRendezvousHandler" in globals():
        return MeshgateRendezvousHandler
    from torch.distributed.elastic.rendezvous import api

    MeshgateRendezvousHandler = type(
        "MeshgateRendezvousHandler", (_Handler, api.RendezvousHandler), {"__module__": __name__}
    )
    return MeshgateRendezvousHandler


class _Handler:
    """torchrun's RendezvousHandler over the node's meshgate agent (see the module's doc)."""

    def __init__(self, params: Any, clock: Callable[[], float] = time.monotonic) -> None:
        from torch.distributed.elastic.rendezvous.api import RendezvousError

        self.job_id = str(params.run_id or "")
        if not self.job_id or self.job_id == "none":
            raise RendezvousError("--rdzv-id must name the meshgate job (meshgate job submit --id JOB ...)")
        self.min_nodes, self.max_nodes = int(params.min_nodes), int(params.max_nodes)
        self.endpoint = str(params.endpoint or "")
        # Where a shipped agent serves its socket unless told (meshgate/agent_socket.py).
        self.socket_path = str(params.get("agent_socket") or find_agent_socket()[0])
        self.join_timeout_s = float(params.get("join_timeout", params.get("timeout", DEFAULT_JOIN_TIMEOUT_S)))
        self.poll_s = float(params.get("poll_s", 1.0))
        self.clock = clock
        self.generation: Optional[int] = None  # the generation formed last
        self.node: Optional["LocalNode"] = None  # the agent's view it was formed from
        self.view: Optional["LocalNode"] = None  # the latest view, for num_nodes_waiting
        self.viewed_at = float("-inf")
        self.closed = False
        self.server: Any = None  # node rank 0: the TCPStore it hosts
        self.store: Any = None
        self.store_at: tuple[str, int, bool] = ("", 0, False)
        self.listener: Any = None  # node rank 0: the master socket its agent handed over

    # ---- torch's interface ------------------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND

    def get_run_id(self) -> str:
        return self.job_id

    @property
    def use_agent_store(self) -> bool:
        # The workers' store is their own, fresh in each generation (worker rank 0 hosts it):
        # keys a world of an earlier generation left (gloo's addresses) must never be read.
        return False

    def next_rendezvous(self) -> Any:
        from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

        if self.generation is not None:
            self._restart_is_the_jobs()
            self._end_formed_generation("torchrun restarted its workers (a worker failed, or the world changed)")
        node = self._await_place()
        self.generation, self.node = node.joined_generation, node
        from torch.distributed import PrefixStore

        store = PrefixStore(f"torchelastic/meshgate/{self.job_id}/{node.joined_generation}", self._store_at(node))
        # Node rank 0 picks a free port on the master's address for worker rank 0's store.
        workers_store = RendezvousStoreInfo.build(node.node_rank, store, local_addr=node.master_addr)
        self._export(node)
        return RendezvousInfo(store, node.node_rank, node.nodes, workers_store)

    def is_closed(self) -> bool:
        return self.closed or self._viewed().ended_job == self.job_id

    def set_closed(self) -> None:
        self.closed = True

    def num_nodes_waiting(self) -> int:
        view = self._viewed()
        moved_on = self.generation is not None and view.generation > self.generation
        return 1 if moved_on or view.ended_job == self.job_id else 0

    def shutdown(self) -> bool:
        """torchrun's launcher calls this in a ``finally``: an exception on its way out
        (ChildFailedError) means this node's workers failed."""
        failed = sys.exc_info()[1] is not None
        agent_reports = self.node is not None and self.node.agent_started  # it sees this process exit
        if self.generation is not None and self.node is not None and not self.closed and not agent_reports:
            code = 1 if failed else 0
            detail = f"torchrun on node {self.node.node_id!r} gave up" if failed else ""
            try:
                report_exits(self.socket_path, self.generation, list(range(self.node.slots)), code, detail)
            except ConnectionError as exc:
                print(f"meshgate: could not report this node's workers' exits: {exc}", file=sys.stderr)
        self.closed = True
        return True

    # ---- the agent's view ---------------------------------------------------------------------

    def _viewed(self) -> "LocalNode":
        """The agent's view, asked again once it is ``poll_s`` old (torchrun polls often)."""
        if self.view is None or self.clock() - self.viewed_at >= self.poll_s:
            self.view, self.viewed_at = local_node(self.socket_path, launcher=True), self.clock()
        return self.view

    def _fresh(self) -> "LocalNode":
        self.viewed_at = float("-inf")
        return self._viewed()

    def _restart_is_the_jobs(self) -> None:
        """A torchrun the agent started (a per-node job) never restarts its workers itself:
        it exits, the agent reports its node's exit, and the job restarts every node's
        launcher into the next generation (or fails) by its restart policy."""
        from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

        if self.node is not None and self.node.agent_started:
            self.closed = True
            raise RendezvousClosedError(
                f"job {self.job_id!r} runs torchrun per node under the meshgate agent: its workers restart with "
                "the job (its restart policy), not with torchrun's --max-restarts; this torchrun exits"
            )

    def _end_formed_generation(self, why: str) -> None:
        """A restart: end the generation formed last, unless it is over already."""
        view = self._fresh()
        if view.job_id == self.job_id and view.generation == self.generation and not view.ended:
            report_exits(self.socket_path, self.generation, [0], 1, f"{why} on node {view.node_id!r}")

    def _await_place(self) -> "LocalNode":
        """Wait until the agent holds this node's place in a generation after the one
        formed: joined, given a node rank, with the job's master known. A hot spare waits
        as long as it stays one; a job that is over closes the rendezvous."""
        from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousTimeoutError

        deadline = self.clock() + self.join_timeout_s
        while True:
            view = self._fresh()
            if view.ended_job == self.job_id:
                self.closed = True
                if view.spare or (self.generation is None and view.node_rank < 0):
                    self._not_needed(view)
                raise RendezvousClosedError(f"job {self.job_id!r} is over: {view.ended}")
            serving = view.job_id == self.job_id
            if serving and view.spare:
                deadline = self.clock() + self.join_timeout_s  # a spare waits as long as it is one
            elif serving and self._placed(view):
                self._check_nodes(view)
                return view
            if self.clock() > deadline:
                raise RendezvousTimeoutError(self._why_waiting(view))
            time.sleep(0.1)

    @staticmethod
    def _not_needed(view: "LocalNode") -> None:
        """A spare the job ended without: this torchrun's work is done, exit 0. Not through
        RendezvousGracefulExitError, torch's way: torch 2.13's agent swallows it and returns
        None, and its launcher then fails on ``None.is_failed()`` (exit 1, AttributeError)."""
        print(
            f"meshgate: node {view.node_id!r} was a hot spare of job {view.ended_job!r} and was not needed "
            f"({view.ended}); torchrun exits 0",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(0)

    def _placed(self, view: "LocalNode") -> bool:
        after = -1 if self.generation is None else self.generation
        return (
            view.joined_generation > after
            and view.joined_generation == view.generation
            and view.node_rank >= 0
            and bool(view.master_addr)
        )

    def _check_nodes(self, view: "LocalNode") -> None:
        from torch.distributed.elastic.rendezvous.api import RendezvousError

        if not self.min_nodes <= view.nodes <= self.max_nodes:
            raise RendezvousError(
                f"job {self.job_id!r} runs on {view.nodes} nodes; torchrun was started with --nnodes="
                f"{self.min_nodes}" + (f":{self.max_nodes}" if self.max_nodes != self.min_nodes else "")
            )

    def _why_waiting(self, view: "LocalNode") -> str:
        where = f"the meshgate agent of node {view.node_id!r} ({self.socket_path})"
        if view.job_id != self.job_id:
            serving = f"job {view.job_id!r}" if view.job_id else "no job (idle in the pool)"
            return (
                f"{where} serves {serving}, not job {self.job_id!r}, after {self.join_timeout_s:g}s: submit the job "
                f"beforehand (meshgate job submit --id {self.job_id} --mode claimed ...) and run torchrun on its nodes"
            )
        if not view.master_addr:
            return (
                f"{where} has no master for job {self.job_id!r} after {self.join_timeout_s:g}s: node rank 0 not joined"
            )
        return f"{where} was not placed in a new generation of job {self.job_id!r} after {self.join_timeout_s:g}s"

    # ---- the store and the workers' environment ---------------------------------------------

    def _store_at(self, node: "LocalNode") -> Any:
        """The job's store: node rank 0 hosts it at the master, the others dial it; kept
        while the master and this node's part stay the same."""
        from datetime import timedelta

        from torch.distributed import TCPStore

        wanted = (node.master_addr, node.master_port, node.node_rank == 0)
        if self.store is None or self.store_at != wanted:
            timeout = timedelta(seconds=self.join_timeout_s)
            if node.node_rank == 0:
                self.server = self._host_store(node, timeout)
                self.store = self.server
            else:
                self.server = None
                self.store = TCPStore(node.master_addr, node.master_port, is_master=False, timeout=timeout)
            self.store_at = wanted
        return self.store

    def _host_store(self, node: "LocalNode", timeout: Any) -> Any:
        """Node rank 0's store, served on the listening socket its agent hands over (the
        port was never free: agent/netif.py); bound here only where the agent holds none
        (an operator's MASTER_ADDR / MASTER_PORT)."""
        from torch.distributed import TCPStore

        from meshgate.store_socket import MasterSocketRefused, receive_master_socket, tcp_store_on

        try:
            listener = receive_master_socket(self.socket_path)
        except MasterSocketRefused as exc:
            print(
                f"meshgate: the agent hands over no master socket ({exc}); binding {node.master_port}", file=sys.stderr
            )
            return TCPStore(node.master_addr, node.master_port, is_master=True, multi_tenant=True, timeout=timeout)
        if listener.getsockname()[1] != node.master_port:
            listener.close()
            raise ConnectionError(f"the agent's master socket is not the job's master port {node.master_port}")
        self.listener = listener  # open as long as the store serves on it
        return tcp_store_on(listener, timeout.total_seconds())

    def _export(self, node: "LocalNode") -> None:
        """What meshgate.register() reads in the workers (they inherit this environment), and
        nothing of whoever started torchrun's credentials (an sbatch from an admin's shell)."""
        from meshgate.worker_credentials import drop_for_workers

        for name, why in drop_for_workers(os.environ).items():
            print(f"meshgate: torchrun's workers do not get {name}: {why}", file=sys.stderr)
        os.environ["MESHGATE_JOB"] = self.job_id
        os.environ[SOCKET_ENV] = self.socket_path
        os.environ["MESHGATE_NODE_ID"] = node.node_id
        for name in IFNAME_ENVS:  # the agent's advertised interface, unless the operator chose one
            if node.interface and not os.environ.get(name):
                os.environ[name] = node.interface
        os.environ[GENERATION_ENV] = str(node.joined_generation)
        if node.trust_bundle and not os.environ.get("MESHGATE_TRUST_BUNDLE"):
            os.environ["MESHGATE_TRUST_BUNDLE"] = node.trust_bundle
        if self.endpoint:
            os.environ["MESHGATE_COORDINATOR"] = self.endpoint


# ---- the worker's side ---------------------------------------------------------------------


def _env_int(name: str) -> int:
    value = os.environ.get(name, "")
    if not value.isdigit():
        raise TorchrunRankError(f"{name}={value[:32]!r}: not started by torchrun (torchrun sets {name})")
    return int(value)


_ATTESTED: list["VerifiedAttestation"] = []


def attest_worker(timeout: float = 60.0) -> "VerifiedAttestation":
    """Register this torchrun worker's RANK with meshgate (a claimed rank, vouched for by
    the node's agent), verify the signed attestation and check that it is torchrun's
    placement: RANK, GROUP_RANK (the node rank), WORLD_SIZE, LOCAL_RANK, and
    LOCAL_WORLD_SIZE equal to the node's slots. TorchrunRankError names what differs."""
    from meshgate.client import register
    from meshgate.launchers.claimed import cross_check

    rank, local_rank = _env_int("RANK"), _env_int("LOCAL_RANK")
    world_size, local_world_size, group_rank = (
        _env_int("WORLD_SIZE"),
        _env_int("LOCAL_WORLD_SIZE"),
        _env_int("GROUP_RANK"),
    )
    node = local_node(find_agent_socket()[0])
    if local_world_size != node.slots:
        raise TorchrunRankError(
            f"torchrun runs {local_world_size} workers on node {node.node_id!r} (--nproc-per-node), but the node has "
            f"{node.slots} slots in job {node.job_id!r}: run torchrun --nproc-per-node={node.slots}"
        )
    generation = os.environ.get(GENERATION_ENV)
    attestation = register(
        node_id=node.node_id,
        local_rank=local_rank,
        rank=rank,
        generation=int(generation) if generation and generation.isdigit() else None,
        timeout=timeout,
    )
    cross_check(
        attestation,
        framework="torchrun",
        error=TorchrunRankError,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        node_id=node.node_id,
        node_rank=group_rank,
    )
    _ATTESTED[:] = [attestation]
    return attestation


def attestation() -> "VerifiedAttestation":
    """The attestation the bootstrap got for this worker (``-m meshgate.torchrun``)."""
    if not _ATTESTED:
        raise TorchrunRankError("no attestation: start the worker with torchrun ... -m meshgate.torchrun SCRIPT")
    return _ATTESTED[0]


USAGE = (
    "usage: torchrun --rdzv-backend=meshgate --rdzv-id=JOB ... -m meshgate.torchrun SCRIPT [ARGS] | -m MODULE [ARGS]"
)


def main(argv: Optional[list[str]] = None) -> int:
    """``-m meshgate.torchrun SCRIPT [ARGS]``: attest, then run SCRIPT as ``__main__``
    (``-m MODULE`` runs a module); a worker torchrun placed elsewhere than meshgate did
    stops here, before the script's first collective."""
    import runpy

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        print(USAGE, file=sys.stderr)
        return 2
    from meshgate.client import LauncherRankMismatch

    try:
        attest_worker()
    except (TorchrunRankError, LauncherRankMismatch) as exc:
        print(f"meshgate: {exc}", file=sys.stderr)
        return 3
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    # Run as a script, this file is __main__: the script it runs imports meshgate.torchrun,
    # so the attestation lives in that module, not in this copy.
    from meshgate import torchrun as _module

    sys.exit(_module.main())
