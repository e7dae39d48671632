"""torchrun --rdzv-backend=meshgate on real processes: a coordinator (mTLS, dev CA, vouches
required) and four agents on loopback with distinct node ids and rack labels, each started
as its shipped systemd unit starts it (tests/shipped.py), and real torchrun (``python -m
torch.distributed.run``) on each node as the node's torchrun user, gloo workers started
through the bootstrap (``-m meshgate.torchrun``).

The entry point is checked first: torch only logs a warning when a handler fails to load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import shipped
from conftest import REPO, worker_env
from meshgate.agent.vouch_socket import ExternalExits, LocalNode, VouchSocket
from meshgate.agent_socket import SHIPPED_STATE_DIR
from meshgate import admin
from meshgate.plan import ParallelPlan
from meshgate.v1 import rendezvous_pb2 as pb
from shipped import ShippedCluster
from test_store_socket import listening_on, squat

shipped_host = shipped.shipped_host  # the fixture: users, interpreter, delegated cgroup

# One switch, three racks: meshgate orders nodes by (switch, rack, node id), so the job's
# nodes are nd-b, nd-d, nd-c (node ranks 0, 1, 2) and nd-a is its spare: neither the
# node ids' order nor the hostname's (every node is this host).
NODES = ("nd-a", "nd-b", "nd-c", "nd-d")
LABELS = {
    "nd-a": {"switch": "s1", "rack": "r3"},
    "nd-b": {"switch": "s1", "rack": "r1"},
    "nd-c": {"switch": "s1", "rack": "r2"},
    "nd-d": {"switch": "s1", "rack": "r1"},
}
TOPOLOGY_ORDER = ["nd-b", "nd-d", "nd-c"]
WORKER = str(REPO / "tests" / "workers" / "torchrun_worker.py")


def test_the_entry_point_is_found_by_torch_and_makes_a_meshgate_handler(monkeypatch):
    """Installed, torch's registry finds "meshgate" (a failing import would only be a
    warning in torch's log) and its own create_handler makes our handler."""
    from importlib.metadata import entry_points

    assert [e.value for e in entry_points(group="torchrun.handlers") if e.name == "meshgate"] == [
        "meshgate.torchrun:handler_creator"
    ]
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    monkeypatch.setenv("MESHGATE_AGENT_SOCKET", "/nonexistent/vouch.sock")
    handler = rendezvous_handler_registry.create_handler(RendezvousParameters("meshgate", "h:1", "job-7", 2, 2))
    assert (handler.get_backend(), handler.get_run_id(), handler.use_agent_store) == ("meshgate", "job-7", False)
    with pytest.raises(ConnectionError, match=r"cannot reach the meshgate agent at /nonexistent/vouch.sock"):
        handler.num_nodes_waiting()
    with pytest.raises(RendezvousError, match="--rdzv-id must name the meshgate job"):
        rendezvous_handler_registry.create_handler(RendezvousParameters("meshgate", "", "none", 1, 1))
    # Told nothing, on a host without an agent: it looks where the shipped agent serves its
    # socket, and says so when nothing answers there.
    monkeypatch.delenv("MESHGATE_AGENT_SOCKET")
    monkeypatch.setenv("MESHGATE_AGENT_CONFIG", "/nonexistent/agent.toml")
    untold = rendezvous_handler_registry.create_handler(RendezvousParameters("meshgate", "", "job-7", 1, 1))
    with pytest.raises(ConnectionError, match=r"at /var/lib/meshgate-agent/vouch.sock.*or set MESHGATE_AGENT_SOCKET"):
        untold.num_nodes_waiting()


def test_find_agent_socket_reads_the_agents_own_config_as_the_agent_does(tmp_path):
    """The environment wins; else [agent] vouch_socket of the agent's config (relative to
    its folder, default <state_dir>/vouch.sock), the very path the agent serves; else the
    shipped default. The agent's own reading of its config agrees (AgentConfig)."""
    from meshgate.agent.config import AgentConfig
    from meshgate.agent_socket import find_agent_socket

    config = tmp_path / "agent.toml"
    assert find_agent_socket({"MESHGATE_AGENT_SOCKET": "/s"}) == ("/s", "MESHGATE_AGENT_SOCKET")
    missing = {"MESHGATE_AGENT_CONFIG": str(config)}
    assert find_agent_socket(missing) == ("/var/lib/meshgate-agent/vouch.sock", "the shipped agent's default")
    for table, wanted in (
        ('state_dir = "/srv/mg"', "/srv/mg/vouch.sock"),
        ('state_dir = "st"', str(tmp_path / "st" / "vouch.sock")),
        ('vouch_socket = "run/a.sock"', str(tmp_path / "run" / "a.sock")),
    ):
        keys = 'coordinator = "h:1"\njob = "j"\njoin_token = "t"\nnode_id = "n"\ninsecure = true'
        config.write_text(f"[agent]\n{keys}\n{table}\n")
        assert find_agent_socket(missing) == (wanted, f"[agent] vouch_socket of {config}")
        assert str(AgentConfig.load(config).vouch_socket) == wanted
    config.write_text("[agent\n")  # not TOML: the shipped default, never a crash
    assert find_agent_socket(missing)[0] == "/var/lib/meshgate-agent/vouch.sock"


class ScriptedAgent:
    """The agent's real socket server (VouchSocket) in a thread, answering whoami from
    ``self.node`` and recording the exits reported to it: the handler's side of the
    protocol, step by step, with no coordinator."""

    def __init__(self, path: Path, node: LocalNode) -> None:
        import asyncio
        import threading

        self.node, self.exits = node, []
        self.loop = asyncio.new_event_loop()

        async def report(exits: ExternalExits) -> int:
            self.exits.append(exits)
            if exits.exit_code:  # the coordinator's answer: the next generation
                self.node = dataclasses.replace(self.node, generation=exits.generation + 1)
            return self.node.generation

        self.server = VouchSocket(path, lambda *a: b"", lambda: self.node, report_exits=report)
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)


def params(socket_path: Path, nnodes: int = 3, job: str = "tr"):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    return RendezvousParameters("meshgate", "", job, nnodes, nnodes, agent_socket=str(socket_path), join_timeout=5)


PLACED = dict(joined_generation=0, node_rank=1, nodes=3, slots=2, master_addr="127.0.0.1", trust_bundle="/b.json")


def test_the_handler_follows_the_agent_restart_generation_spare_and_end(tmp_path, monkeypatch, capsys):
    """Against a real agent socket: node rank 1 of 3 forms, a moved generation makes
    num_nodes_waiting 1, a restart reports the formed generation's failure once and waits
    for the next; a spare waits, then exits gracefully when the job is over; a job over
    closes the rendezvous; a node count other than --nnodes is refused, naming both."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousError,
        RendezvousTimeoutError,
    )

    from meshgate.torchrun import create_handler

    exported = ("JOB", "NODE_ID", "TRUST_BUNDLE", "TORCHRUN_GENERATION", "AGENT_SOCKET", "COORDINATOR")
    for name in exported:  # what the handler exports is undone after the test (set, then restored)
        monkeypatch.setenv(f"MESHGATE_{name}", "")
    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # node rank 0's store
    path = tmp_path / "vouch.sock"
    agent = ScriptedAgent(path, LocalNode("nd-d", "tr", 0, master_port=host.port, **PLACED))
    try:
        handler = create_handler(params(path))
        assert handler.num_nodes_waiting() == 0
        host.set("torchelastic/meshgate/tr/0/MASTER_ADDR", "127.0.0.1")  # node rank 0 picked the workers' port
        host.set("torchelastic/meshgate/tr/0/MASTER_PORT", "29999")
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (1, 3)
        assert (info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port) == ("127.0.0.1", 29999)
        assert os.environ["MESHGATE_JOB"] == "tr" and os.environ["MESHGATE_NODE_ID"] == "nd-d"
        assert os.environ["MESHGATE_TORCHRUN_GENERATION"] == "0" and os.environ["MESHGATE_TRUST_BUNDLE"] == "/b.json"
        # Another node's worker failed: the agent moved on; torchrun's monitor sees it.
        agent.node = dataclasses.replace(agent.node, generation=1)
        handler.viewed_at = float("-inf")
        assert handler.num_nodes_waiting() == 1
        agent.node = dataclasses.replace(agent.node, joined_generation=1)
        host.set("torchelastic/meshgate/tr/1/MASTER_ADDR", "127.0.0.1")
        host.set("torchelastic/meshgate/tr/1/MASTER_PORT", "29998")
        assert handler.next_rendezvous().rank == 1 and agent.exits == []  # over already: nothing to report
        # This node's worker failed: the restart ends generation 1, once, and waits for 2.
        with pytest.raises(RendezvousTimeoutError, match="was not placed in a new generation of job 'tr'"):
            handler.next_rendezvous()
        assert [(e.generation, e.local_ranks, e.exit_code) for e in agent.exits] == [(1, (0,), 1)]
        # The job is over: the rendezvous is closed.
        agent.node = dataclasses.replace(agent.node, ended_job="tr", ended="job tr CANCELLED")
        handler.viewed_at = float("-inf")
        assert handler.num_nodes_waiting() == 1 and handler.is_closed()  # torchrun's monitor restarts
        with pytest.raises(RendezvousClosedError, match="job 'tr' is over: job tr CANCELLED"):
            handler.next_rendezvous()
        assert handler.is_closed()
        # A hot spare waits; the job over, it was not needed.
        agent.node = LocalNode("nd-a", "tr", 0, joined_generation=0, spare=True)
        spare = create_handler(params(path))
        agent.node = dataclasses.replace(agent.node, ended_job="tr", ended="job tr SUCCEEDED")
        with pytest.raises(SystemExit) as exited:  # torch 2.13 mishandles RendezvousGracefulExitError
            spare.next_rendezvous()
        assert exited.value.code == 0
        assert (
            "node 'nd-a' was a hot spare of job 'tr' and was not needed (job tr SUCCEEDED)" in capsys.readouterr().err
        )
        # The job's nodes and torchrun's --nnodes differ.
        agent.node = LocalNode("nd-d", "tr", 0, master_port=host.port, **PLACED)
        with pytest.raises(RendezvousError, match=r"job 'tr' runs on 3 nodes; torchrun was started with --nnodes=2"):
            create_handler(params(path, nnodes=2)).next_rendezvous()
        # The agent serves another job: the wait says what to do.
        agent.node = LocalNode("nd-d", "other", 0)
        with pytest.raises(
            RendezvousTimeoutError, match=r"serves job 'other', not job 'tr'.*meshgate job submit --id tr"
        ):
            create_handler(params(path)).next_rendezvous()
    finally:
        agent.close()


def test_an_untold_handler_finds_the_agent_from_its_config_and_hands_workers_its_interface(tmp_path, monkeypatch):
    """No MESHGATE_AGENT_SOCKET, no --rdzv-conf agent_socket: the handler finds the agent
    from its config; the workers get the interface the agent advertises for gloo and NCCL,
    unless the operator named one; torchrun started from an admin's shell (an sbatch from the
    head) hands its workers neither the admin's certificate nor its token."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from meshgate.tls import init_dev_ca
    from meshgate.torchrun import create_handler

    ca = init_dev_ca(tmp_path / "tls")
    monkeypatch.setenv("MESHGATE_TLS_CERT", str(ca.admin.cert))
    monkeypatch.setenv("MESHGATE_TLS_KEY", str(ca.admin.key))
    monkeypatch.setenv("MESHGATE_ADMIN_TOKEN", "admin-secret")

    for name in ("JOB", "NODE_ID", "TRUST_BUNDLE", "TORCHRUN_GENERATION", "AGENT_SOCKET", "COORDINATOR"):
        monkeypatch.setenv(f"MESHGATE_{name}", "")
    monkeypatch.delenv("MESHGATE_AGENT_SOCKET")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")  # the operator's choice stays
    config = tmp_path / "agent.toml"
    config.write_text(f'[agent]\nstate_dir = "{tmp_path / "state"}"\n')
    monkeypatch.setenv("MESHGATE_AGENT_CONFIG", str(config))
    (tmp_path / "state").mkdir()
    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    node = LocalNode("nd-d", "tr", 0, master_port=host.port, interface="lo", **PLACED)
    agent = ScriptedAgent(tmp_path / "state" / "vouch.sock", node)
    try:
        handler = create_handler(RendezvousParameters("meshgate", "", "tr", 3, 3, join_timeout=5))
        host.set("torchelastic/meshgate/tr/0/MASTER_ADDR", "127.0.0.1")
        host.set("torchelastic/meshgate/tr/0/MASTER_PORT", "29999")
        assert handler.next_rendezvous().rank == 1
        assert os.environ["MESHGATE_AGENT_SOCKET"] == str(tmp_path / "state" / "vouch.sock")
        assert (os.environ["GLOO_SOCKET_IFNAME"], os.environ["NCCL_SOCKET_IFNAME"]) == ("lo", "ib0")
        held = {k for k in ("MESHGATE_TLS_CERT", "MESHGATE_TLS_KEY", "MESHGATE_ADMIN_TOKEN") if k in os.environ}
        assert held == set(), held  # what torchrun's workers inherit
    finally:
        agent.close()


def test_bad_exit_reports_are_refused_naming_the_field():
    for request, message in (
        ([1], "exited must be a JSON object"),
        ({"generation": 0, "local_ranks": [], "exit_code": 1}, "local_ranks must be a list of 1 to 1024"),
        ({"generation": -1, "local_ranks": [0], "exit_code": 1}, "generation '-1' out of range"),
        ({"generation": 0, "local_ranks": [99], "exit_code": 1}, "local_rank '99' out of range"),
        ({"generation": 0, "local_ranks": [0], "exit_code": 300}, "exit_code '300' out of range"),
        ({"generation": 0, "local_ranks": [0], "exit_code": True}, "exit_code 'True' out of range"),
        ({"generation": 0, "local_ranks": [0], "exit_code": 1, "detail": 5}, "detail must be a string"),
    ):
        with pytest.raises((TypeError, ValueError), match=message):
            ExternalExits.parse(request, max_local_rank=8)
    assert ExternalExits.parse({"generation": 3, "local_ranks": [0, 1], "exit_code": 0}, 8) == ExternalExits(
        3, (0, 1), 0
    )


class TorchrunCluster(ShippedCluster):
    """Four agents as shipped (mTLS), each with its labels and 2 slots, and the user who
    runs torchrun beside them.

    Who runs torchrun: a user of the node's own, ``trainer``, listed in each agent's
    ``vouch_socket_uids``: what a real deployment does (docs/launchers.md, torchrun: "the
    user running torchrun must be one the agent's socket admits (vouch_socket_uids)";
    SECURITY.md, "Agent vouching": workers the agent does not start "run as a uid of
    vouch_socket_uids"). Not the node's job user: the agent admits that uid only from
    inside a job run it started itself, and a claimed job without a command has none
    (``check_vouch_caller``: "uid N is the job user and this node runs no job's workers
    now"). Not the agent's own uid either: its workers could then read the agent's keys.
    The trainer holds its own copy of the worker certificate, as an operator gives it one
    (MESHGATE_TLS_*), and a home of its own."""

    def __init__(self, host, nodes) -> None:
        super().__init__(host, nodes, start=False, tls=True)
        try:
            self.trainer = host.add_user("mgtrain")
            uid, gid = self.trainer.pw_uid, self.trainer.pw_gid
            self.trainer_home = Path(tempfile.mkdtemp(prefix="trainer-", dir=self.root))
            for pair in (self.ca.ca, self.ca.worker.cert, self.ca.worker.key):
                copy = self.trainer_home / pair.name
                copy.write_bytes(pair.read_bytes())
                copy.chmod(0o600)
                os.chown(copy, uid, gid)
            os.chown(self.trainer_home, uid, gid)
            self.trainer_home.chmod(0o700)
            for node_id in nodes:
                self.start_agent(node_id)
        except BaseException:
            self.close()
            raise

    def start_agent(self, node_id: str, extra=None):
        table = {"labels": LABELS[node_id], "slots": 2, "vouch_socket_uids": [self.trainer.pw_uid], **(extra or {})}
        return super().start_agent(node_id, extra=table)

    def submit_spec(self, job_id: str, plan: ParallelPlan, nodes: int, command: list[str], **spec) -> pb.JobInfo:
        """``spec``: more [job] keys, as a job file spells them (mode="claimed", spares=1)."""
        from meshgate.job_cli import spec_message

        message = spec_message({"id": job_id, "plan": plan, "nodes": nodes, "command": command, **spec})
        return admin.submit_job(self.address, message, tls=self.admin_tls)

    def scratch(self) -> Path:
        """A directory the trainer (and its workers) write results to; the test reads them."""
        path = Path(tempfile.mkdtemp(prefix="out-", dir=self.root))
        path.chmod(0o1777)
        return path


@pytest.fixture(scope="module")
def cluster(shipped_host):
    with TorchrunCluster(shipped_host, NODES) as running:
        yield running


def torchrun(
    cluster: TorchrunCluster,
    node_id: str,
    job_id: str,
    log: Path,
    nproc: int = 2,
    nnodes: int = 3,
    restarts: int = 3,
    untold: bool = False,
    **env: str,
) -> subprocess.Popen:
    """torchrun on ``node_id`` as the cluster's trainer: its agent's socket, the workers'
    mTLS certificate (the trainer's copy), the fixture's interpreter (the trainer can run it).
    ``untold``: as a new user starts it by hand, told neither the agent's socket nor an
    interface; the node's /var/lib/meshgate-agent is its agent's (a mount namespace binds it
    there: ``shipped_state_mountpoint``), so the shipped agent's socket is where the unit puts it."""
    argv = [
        cluster.host.python,
        "-m",
        "torch.distributed.run",
        "--rdzv-backend=meshgate",
        f"--rdzv-endpoint={cluster.address}",
        f"--rdzv-id={job_id}",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={restarts}",
        "--monitor-interval=0.5",
        f"--rdzv-conf=agent_socket={cluster.agents[node_id].state_dir / 'vouch.sock'}",
        "-m",
        "meshgate.torchrun",
        WORKER,
    ]
    home, trainer = cluster.trainer_home, cluster.trainer
    run_as: dict = dict(user=trainer.pw_uid, group=trainer.pw_gid, extra_groups=[])
    if untold:
        del argv[argv.index(next(a for a in argv if a.startswith("--rdzv-conf=agent_socket=")))]
        state_dir = cluster.agents[node_id].state_dir  # the node's /var/lib/meshgate-agent (StateDirectory=)
        user = f"--reuid={trainer.pw_uid} --regid={trainer.pw_gid} --clear-groups"
        script = f'mount --bind "$0" {SHIPPED_STATE_DIR} && exec setpriv {user} -- "$@"'
        argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, str(state_dir), *argv]
        run_as = {}  # root until the namespace is made; setpriv then drops to the trainer
    tls = {
        "MESHGATE_INSECURE": "0",
        "MESHGATE_TLS_CA": str(home / cluster.ca.ca.name),
        "MESHGATE_TLS_CERT": str(home / cluster.ca.worker.cert.name),
        "MESHGATE_TLS_KEY": str(home / cluster.ca.worker.key.name),
    }
    user = {"HOME": str(home), "USER": trainer.pw_name, "LOGNAME": trainer.pw_name, "TMPDIR": str(home)}
    environment = worker_env(**tls, **user, **env)
    if untold:
        for name in ("MESHGATE_AGENT_SOCKET", "MESHGATE_AGENT_CONFIG", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            environment.pop(name, None)
    return subprocess.Popen(
        argv,
        cwd=REPO,
        env=environment,
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        **run_as,  # in no job user's group: the agent's uid check admits it (vouch_socket_uids)
    )


@contextlib.contextmanager
def shipped_state_mountpoint():
    """/var/lib/meshgate-agent on this host, for a node's state directory to be bound there
    in a mount namespace of its own (made here if missing, and removed after)."""
    made = not SHIPPED_STATE_DIR.exists()
    SHIPPED_STATE_DIR.mkdir(mode=0o755, exist_ok=True)
    try:
        yield
    finally:
        if made:
            SHIPPED_STATE_DIR.rmdir()


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_bytes()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(b")") + 2 :].split()[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(process: subprocess.Popen) -> None:
    for pid in [process.pid, *descendants(process.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def results(out: Path, generation: int) -> dict[int, dict]:
    found = (json.loads(p.read_text()) for p in out.glob(f"g{generation}-r*.json"))
    return {r["rank"]: r for r in found}


def wait_for(what, timeout: float, explain) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, explain()
        time.sleep(0.2)


def check_world(world: dict[int, dict], order: list[str], generation: int, size: int = 6) -> None:
    """Every worker's RANK is its signed rank, node rank = place in ``order``, its
    DeviceMesh coordinate is the attested one, and the world all-reduced."""
    assert sorted(world) == list(range(size)), sorted(world)
    for rank, r in world.items():
        node_rank = order.index(r["node_id"])
        assert int(r["env"]["RANK"]) == rank == r["dist_rank"] == node_rank * 2 + r["local_rank"], r
        assert int(r["env"]["GROUP_RANK"]) == r["node_rank"] == node_rank, r
        assert (int(r["env"]["WORLD_SIZE"]), r["world_size"], r["generation"]) == (size, size, generation), r
        assert r["mesh_coordinate"] == {k: v for k, v in r["coordinate"].items() if k in r["mesh_coordinate"]}, r
        assert r["sum"] == size * (size - 1) // 2, r
    assert len({tuple(r["master"]) for r in world.values()}) == 1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_torchrun_forms_meshgates_world_restarts_into_the_next_generation_and_a_spare_takes_a_lost_node(
    cluster, tmp_path
):
    out = cluster.scratch()
    plan = ParallelPlan(dp_shard=3, tp=2)
    job = cluster.submit_spec(
        "tr",
        plan,
        3,
        [],
        mode="claimed",
        spares=1,
        topology_policy="refuse",
        restart_policy="on-failure",
        max_restarts=3,
    )
    assert list(job.nodes) == TOPOLOGY_ORDER and list(job.spare_nodes) == ["nd-a"], job
    env = {"TR_OUT": str(out), "TR_FAIL_GENERATION": "0", "TR_FAIL_RANK": "4", "TR_HOLD_GENERATION": "1"}
    runs = {n: torchrun(cluster, n, "tr", cluster.root / f"torchrun-{n}.log", **env) for n in NODES}

    def explain() -> str:
        logs = "\n".join(
            f"--- torchrun {n} ---\n{(cluster.root / f'torchrun-{n}.log').read_text()[-4000:]}" for n in NODES
        )
        return f"{logs}\n{cluster.logs()}"

    try:
        # Generation 0: meshgate's world, in topology order; rank 4 (nd-c) then fails.
        wait_for(lambda: len(results(out, 0)) == 6, 300, explain)
        first = results(out, 0)
        check_world(first, TOPOLOGY_ORDER, 0)
        # torchrun restarts every node's workers: generation 1, every rank where it was.
        wait_for(lambda: len(results(out, 1)) == 6, 300, explain)
        second = results(out, 1)
        check_world(second, TOPOLOGY_ORDER, 1)
        assert {r: w["node_id"] for r, w in second.items()} == {r: w["node_id"] for r, w in first.items()}
        assert cluster.job("tr").status.generation == 1
        # nd-b, node rank 0 and the host of torchrun's store, is lost (agent and torchrun):
        # the spare nd-a takes node rank 0 and hosts the store at its own master.
        kill_tree(runs["nd-b"])
        cluster.agents["nd-b"].process.kill()
        cluster.agents["nd-b"].process.wait()
        wait_for(lambda: len(results(out, 2)) == 6, 300, explain)
        third = results(out, 2)
        check_world(third, ["nd-a", "nd-d", "nd-c"], 2)
        ended = (pb.SUCCEEDED, pb.FAILED, pb.CANCELLED)  # not wait_ended: it fails on nd-b's agent, gone
        wait_for(lambda: cluster.job("tr").state in ended, 120, explain)
        info = cluster.job("tr")
        assert info.state == pb.SUCCEEDED, (info, explain())
        for node_id in ("nd-a", "nd-c", "nd-d"):
            assert runs[node_id].wait(timeout=120) == 0, explain()
        cluster.start_agent("nd-b")  # back, with its credential: the pool is whole again
    finally:
        for process in runs.values():
            if process.poll() is None:
                kill_tree(process)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_unneeded_spare_exits_a_wrong_nproc_per_node_is_stopped_and_a_cancel_closes_the_rendezvous(
    cluster, tmp_path
):
    """A job of 2 nodes and a spare, torchrun on all three: the world forms on the two, the
    job SUCCEEDED, and the spare's torchrun ends without starting a worker. Then a job of one
    node started with --nproc-per-node=1 on a node of 2 slots: the bootstrap stops the worker
    naming the flag to use, and the job fails (no restarts asked). Then a job cancelled while
    its workers run: torchrun stops them and exits non-zero (the rendezvous is closed)."""
    out = cluster.scratch()
    job = cluster.submit_spec("tr2", ParallelPlan(dp_shard=2, tp=2), 2, [], mode="claimed", spares=1)
    order, spare = list(job.nodes), job.spare_nodes[0]
    logs = {n: tmp_path / f"torchrun-{n}.log" for n in [*order, spare]}
    runs = {n: torchrun(cluster, n, "tr2", logs[n], nnodes=2, TR_OUT=str(out)) for n in logs}
    explain = lambda: "\n".join(f"--- {n} ---\n{p.read_text()[-3000:]}" for n, p in logs.items()) + cluster.logs()
    try:
        info = cluster.wait_ended("tr2", timeout=300)
        assert info.state == pb.SUCCEEDED, (info, explain())
        check_world(results(out, 0), order, 0, size=4)
        for node_id in order:
            assert runs[node_id].wait(timeout=120) == 0, explain()
        assert runs[spare].wait(timeout=120) == 0, explain()
        assert f"node {spare!r} was a hot spare of job 'tr2' and was not needed" in logs[spare].read_text(), explain()
        assert not any(r["node_id"] == spare for r in results(out, 0).values())
    finally:
        for process in runs.values():
            if process.poll() is None:
                kill_tree(process)
    cluster.submit_spec("tr3", ParallelPlan(dp_shard=2), 1, [], mode="claimed")
    wait_for(lambda: cluster.job("tr3").state == pb.RUNNING, 60, cluster.logs)  # once a node is back in the pool
    job = cluster.job("tr3")
    node_id, log, out3 = job.nodes[0], tmp_path / "torchrun-tr3.log", cluster.scratch()
    run = torchrun(cluster, node_id, "tr3", log, nproc=1, nnodes=1, restarts=0, TR_OUT=str(out3))
    try:
        assert run.wait(timeout=300) != 0
        text = log.read_text()
        assert (
            f"torchrun runs 1 workers on node {node_id!r} (--nproc-per-node), but the node has 2 slots in job "
            "'tr3': run torchrun --nproc-per-node=2" in text
        ), text
        assert list(out3.iterdir()) == []  # train.py never ran
        info = cluster.wait_ended("tr3", timeout=120)
        assert info.state == pb.FAILED and node_id in info.reason, info
    finally:
        if run.poll() is None:
            kill_tree(run)
    # A cancelled job closes the rendezvous: torchrun stops its workers and exits non-zero.
    cluster.submit_spec("tr4", ParallelPlan(dp_shard=2), 1, [], mode="claimed")
    wait_for(lambda: cluster.job("tr4").state == pb.RUNNING, 60, cluster.logs)
    node_id, log, out4 = cluster.job("tr4").nodes[0], tmp_path / "torchrun-tr4.log", cluster.scratch()
    run = torchrun(cluster, node_id, "tr4", log, nnodes=1, TR_OUT=str(out4), TR_HOLD_GENERATION="0")
    try:
        wait_for(lambda: len(results(out4, 0)) == 2, 300, lambda: log.read_text()[-3000:] + cluster.logs())
        pids = [r["pid"] for r in results(out4, 0).values()]
        admin.cancel_job(cluster.address, "tr4", "test", tls=cluster.admin_tls)
        assert run.wait(timeout=120) != 0
        assert "job 'tr4' is over" in log.read_text(), log.read_text()[-3000:]
        assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()], pids
        assert cluster.job("tr4").state == pb.CANCELLED
    finally:
        if run.poll() is None:
            kill_tree(run)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_untold_hand_started_torchrun_succeeds_and_a_job_nobody_launches_fails_at_its_deadline(cluster, tmp_path):
    """Two jobs side by side. One, torchrun started by hand on each of its nodes as a new
    user would, from a shell that also holds an admin token, with no MESHGATE_AGENT_SOCKET,
    no --rdzv-conf agent_socket and no GLOO_SOCKET_IFNAME: each finds its node's shipped
    agent, its workers get the interface the agent advertises and no token, and the job
    SUCCEEDED. The other, a claimed job whose launchers never come: `meshgate job wait`
    returns FAILED at its launch deadline, naming both nodes."""
    out = cluster.scratch()
    job = cluster.submit_spec("tr-untold", ParallelPlan(dp_shard=2, tp=2), 2, [], mode="claimed")
    order = list(job.nodes)
    nobody = cluster.submit_spec("tr-nobody", ParallelPlan(dp_shard=4), 2, [], mode="claimed", launch_deadline_s=8)
    assert nobody.state == pb.RUNNING and nobody.spec.launch_deadline_s == 8.0, nobody
    logs = {n: tmp_path / f"torchrun-{n}.log" for n in order}
    env = {"TR_OUT": str(out), "MESHGATE_ADMIN_TOKEN": "admin-secret"}
    mountpoint = contextlib.ExitStack()
    mountpoint.enter_context(shipped_state_mountpoint())
    runs = {n: torchrun(cluster, n, "tr-untold", logs[n], nnodes=2, untold=True, **env) for n in order}
    explain = lambda: "\n".join(f"--- {n} ---\n{p.read_text()[-3000:]}" for n, p in logs.items()) + cluster.logs()
    cli_env = dict(
        os.environ,
        MESHGATE_COORDINATOR=cluster.address,
        MESHGATE_INSECURE="0",
        MESHGATE_TLS_CA=str(cluster.ca.ca),
        MESHGATE_TLS_CERT=str(cluster.ca.admin.cert),
        MESHGATE_TLS_KEY=str(cluster.ca.admin.key),
    )
    try:
        started = time.monotonic()
        wait = subprocess.run(
            [sys.executable, "-m", "meshgate.cli", "job", "wait", "tr-nobody", "--wait-timeout", "120"],
            env=cli_env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        waited = time.monotonic() - started
        assert wait.returncode == 1, (wait.stdout, wait.stderr)
        failed = cluster.job("tr-nobody")
        assert failed.state == pb.FAILED and "launch deadline 8s reached" in failed.reason, failed
        assert all(node in failed.reason for node in nobody.nodes), failed.reason
        assert waited < 60, waited  # the deadline, not the wait's own timeout
        wait_for(lambda: len(results(out, 0)) == 4, 300, explain)
        ended = (pb.SUCCEEDED, pb.FAILED, pb.CANCELLED)
        wait_for(lambda: cluster.job("tr-untold").state in ended, 120, explain)
        info = cluster.job("tr-untold")
        assert info.state == pb.SUCCEEDED, (info, explain())
        world = results(out, 0)
        check_world(world, order, 0, size=4)
        for node_id in order:
            assert runs[node_id].wait(timeout=120) == 0, explain()
        for rank, seen in world.items():
            # The agents here reach the coordinator over loopback: they advertise lo.
            assert seen["exported"]["GLOO_SOCKET_IFNAME"] == seen["exported"]["NCCL_SOCKET_IFNAME"] == "lo", seen
            assert seen["exported"]["MESHGATE_AGENT_SOCKET"] == "/var/lib/meshgate-agent/vouch.sock", seen
            assert seen["exported"]["MESHGATE_ADMIN_TOKEN"] is None, seen
    finally:
        for process in runs.values():
            if process.poll() is None:
                kill_tree(process)
        mountpoint.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_section_7_forms_both_worlds_on_the_same_nodes(tmp_path):
    """make bench's section 7 cannot rot: at 2 nodes and 1 round, the three backends form
    the world (hand-started torchrun on meshgate's and on c10d's, and the agents starting
    torchrun per node), meshgate's in its rack order with every rank signed and its jobs
    SUCCEEDED."""
    env = dict(os.environ, RES_OPTIONS="timeout:1 attempts:1", PYTHONPATH=str(REPO))
    argv = [
        sys.executable,
        "-m",
        "bench",
        "--smoke",
        "--sections",
        "7",
        "--torchrun-nodes",
        "2",
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=560)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    path = Path(next(line for line in done.stdout.splitlines() if line.startswith("JSON: "))[len("JSON: ") :])
    section = json.loads(path.read_text())["torchrun"]
    runs = {run["backend"]: run for run in section["runs"]}
    assert runs["meshgate"]["workers"] == runs["c10d"]["workers"] == 4, section
    assert runs["meshgate"]["formed_s"] > 0 and runs["c10d"]["formed_s"] > 0, section
    assert runs["meshgate"]["node_order"] == runs["meshgate"]["meshgate_order"] == ["node-1", "node-0"], section
    assert runs["meshgate"]["ranks_signed"] is True and runs["meshgate"]["job_state"] == "SUCCEEDED", section
    per_node = runs["meshgate-per-node"]
    assert per_node["workers"] == 4 and per_node["formed_s"] > 0, section
    assert per_node["node_order"] == per_node["meshgate_order"] == ["node-1", "node-0"], section
    assert per_node["ranks_signed"] is True and per_node["job_state"] == "SUCCEEDED", section
    assert section["per_node_vs_hand_started"] > 0, section
    report = path.with_suffix(".txt").read_text()
    assert "7. torchrun: --rdzv-backend=meshgate against c10d" in report
    assert "median per-node/hand-started = " in report


# ---- per-node launch: the agent starts torchrun itself --------------------------------------


def per_node_command(python: str, job_id: str, nnodes: int = 3, nproc: int = 2) -> list[str]:
    """torchrun as a per-node job's command: no agent socket, endpoint or node rank given;
    the agent starts it in the job's unit as the job user, with its socket in the env."""
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--rdzv-backend=meshgate",
        f"--rdzv-id={job_id}",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        "--monitor-interval=0.5",
        "-m",
        "meshgate.torchrun",
        WORKER,
    ]


def per_node_logs(cluster: TorchrunCluster, job_id: str) -> str:
    """The agents' and coordinator's logs, and each node's torchrun output (its rank block's
    first rank's log, where the agent keeps it)."""
    outputs = []
    for node_id, agent in cluster.agents.items():
        for path in sorted(agent.state_dir.glob(f"worker-logs/*{job_id}*/rank-*.log")):
            outputs.append(f"--- {node_id} {path.name} ---\n{path.read_text(errors='replace')[-3000:]}")
    return "\n".join(outputs) + "\n" + cluster.logs()


def alive(pids) -> list[int]:
    """Those of ``pids`` still running (a zombie is dead: it runs nothing)."""
    found = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            continue
        if state[state.rindex(b")") + 2 :].split()[0] != b"Z":
            found.append(pid)
    return found


def launcher_of(pid: int) -> int:
    """The torchrun that started worker ``pid`` (its parent), checked to be torchrun."""
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    parent = int(stat[stat.rindex(b")") + 2 :].split()[1])
    assert b"torch.distributed.run" in Path(f"/proc/{parent}/cmdline").read_bytes(), parent
    return parent


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_per_node_torchrun_runs_under_the_agent_and_a_killed_torchrun_restarts_the_job(cluster):
    """A per-node job whose command is torchrun: each of its three agents starts torchrun
    once, in topology order (NODE_RANK / GROUP_RANK), and every worker's RANK is its signed
    rank with the DeviceMesh cross-checked. kill -9 of one node's torchrun (its workers
    orphaned, holding): the job restarts by its policy, every process of generation 0 is
    gone, and generation 1 runs to SUCCEEDED."""
    out = cluster.scratch()
    command = per_node_command(cluster.host.python, "pn")
    env = {"TR_OUT": str(out), "TR_HOLD_GENERATION": "0"}
    job = cluster.submit_spec(
        "pn",
        ParallelPlan(dp_shard=3, tp=2),
        3,
        command,
        env=env,
        launch="per-node",
        restart_policy="on-failure",
        max_restarts=1,
    )
    assert job.spec.mode == pb.RANK_MODE_CLAIMED and job.spec.launch == pb.LAUNCH_MODE_PER_NODE, job.spec
    order = list(job.nodes)
    assert order == TOPOLOGY_ORDER, job
    explain = lambda: per_node_logs(cluster, "pn")
    wait_for(lambda: len(results(out, 0)) == 6, 300, explain)
    first = results(out, 0)
    check_world(first, order, 0)
    # Node rank 0's store serves on the socket its agent handed over: nobody can take the
    # port, and it listens on the attested address alone (tests/test_store_socket.py).
    master = cluster.job("pn").status
    assert squat(master.master_port, master.master_addr) == [], master
    assert listening_on(master.master_port) == {master.master_addr}, listening_on(master.master_port)
    launchers = {r["node_id"]: launcher_of(r["pid"]) for r in first.values()}
    assert len(set(launchers.values())) == 3, launchers  # one torchrun per node
    generation0 = [*launchers.values(), *(r["pid"] for r in first.values())]
    os.kill(launchers["nd-c"], signal.SIGKILL)  # its two workers hold on, orphaned in the unit
    wait_for(lambda: len(results(out, 1)) == 6, 300, explain)
    assert alive(generation0) == [], (alive(generation0), explain())
    check_world(results(out, 1), order, 1)
    info = cluster.wait_ended("pn", timeout=120)
    assert info.state == pb.SUCCEEDED and info.status.generation == 1, (info, explain())


@pytest.mark.slow
def test_a_per_node_launcher_that_never_registers_its_workers_fails_the_job_at_its_deadline(cluster):
    """ft_launcher on its own c10d rendezvous, say: the agents start it, it runs, but no
    worker of it ever registers through meshgate. The job does not stay RUNNING: at its
    launch deadline it ends FAILED naming the nodes and saying the launcher ran, and every
    launcher process is gone (each agent killed its unit)."""
    out = cluster.scratch()
    sleeper = (
        "import os, sys, time; "
        "open(os.path.join(sys.argv[1], os.environ['MESHGATE_NODE_ID']), 'w').write(str(os.getpid())); "
        "time.sleep(600)"
    )
    command = [cluster.host.python, "-c", sleeper, str(out)]
    job = cluster.submit_spec("pn-late", ParallelPlan(dp_shard=6), 3, command, launch="per-node", launch_deadline_s=4)
    assert job.spec.launch_deadline_s == 4.0, job.spec
    wait_for(lambda: len(list(out.iterdir())) == 3, 60, lambda: per_node_logs(cluster, "pn-late"))
    pids = [int(path.read_text()) for path in out.iterdir()]
    assert len(alive(pids)) == 3
    info = cluster.wait_ended("pn-late", timeout=60)
    assert info.state == pb.FAILED, info
    assert info.reason.startswith("launch deadline 4s reached: no launcher registered all workers of node(s) "), info
    assert "its launcher runs there but registered no worker through meshgate" in info.reason, info.reason
    wait_for(lambda: alive(pids) == [], 30, lambda: per_node_logs(cluster, "pn-late"))


def unit_pids(pid: int) -> list[int]:
    """Every process of the containment unit (cgroup) that holds ``pid``."""
    (line,) = [entry for entry in Path(f"/proc/{pid}/cgroup").read_text().splitlines() if entry.startswith("0::")]
    return [int(p) for p in (shipped.cgroup2_mount() / line[3:].lstrip("/") / "cgroup.procs").read_text().split()]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_cancel_of_a_per_node_job_answers_cancelled_only_once_every_process_of_it_is_gone(cluster):
    """A per-node torchrun job on three agents, cancelled while its workers hold: when
    CancelJob answers CANCELLED, no process of any of its three containment units is alive
    (every pid in them before the cancel, each torchrun and its workers among them). Before,
    CANCELLED was answered as soon as the end was durable, before any agent had heard of it."""
    out = cluster.scratch()
    command = per_node_command(cluster.host.python, "pn2")
    env = {"TR_OUT": str(out), "TR_HOLD_GENERATION": "0"}
    cluster.submit_spec("pn2", ParallelPlan(dp_shard=3, tp=2), 3, command, env=env, launch="per-node")
    explain = lambda: per_node_logs(cluster, "pn2")
    wait_for(lambda: len(results(out, 0)) == 6, 300, explain)
    held = results(out, 0)
    launchers = {launcher_of(r["pid"]) for r in held.values()}
    pids = sorted({p for r in held.values() for p in unit_pids(r["pid"])})
    assert len(launchers) == 3 and launchers | {r["pid"] for r in held.values()} <= set(pids), (launchers, pids)
    assert alive(pids) == pids, pids
    started = time.monotonic()
    cancelled = admin.cancel_job(cluster.address, "pn2", "test", tls=cluster.admin_tls, timeout=60)
    took = time.monotonic() - started
    assert cancelled.state == pb.CANCELLED, cancelled
    assert alive(pids) == [], f"alive when CANCELLED was answered: {alive(pids)}\n{explain()}"
    print(f"cancel answered after {took:.2f}s, {len(pids)} processes of 3 units gone")


def idle(cluster: TorchrunCluster, node_ids) -> bool:
    """Every one of ``node_ids`` is back in the pool: its agent showed no live unit (nor an
    adopted process alive) on a heartbeat after the job's end."""
    states = {n.node_id: n.state for n in admin.list_nodes(cluster.address, tls=cluster.admin_tls).nodes}
    return all(states.get(node_id) == pb.POOL_STATE_IDLE for node_id in node_ids)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_hand_started_torchrun_killed_mid_job_ends_it_and_nothing_it_started_outlives_the_end_or_a_cancel(cluster):
    """Hand-started torchrun on three agents (a claimed job without a command; restart
    policy never): each agent adopts its node's torchrun and workers when they reach its
    socket (SO_PEERCRED pid, held by a pidfd). kill -9 of one torchrun while its workers
    hold: its agent sees the death at once and reports its slots exited, so the job ends
    FAILED within the liveness bound (heartbeat interval x misses), naming the launcher;
    once the nodes are back in the pool no torchrun or worker of the job is alive (by pid).
    Then a second such job cancelled: CANCELLED is answered only once none of its
    torchruns or workers is alive. Before, the job stayed RUNNING with its torchrun dead."""
    bound = 0.5 * 4  # the cluster's heartbeat_interval_s x heartbeat_misses
    for job_id, ending in (("hk", "kill"), ("hc", "cancel")):
        out = cluster.scratch()
        job = cluster.submit_spec(job_id, ParallelPlan(dp_shard=3, tp=2), 3, [], mode="claimed")
        order = list(job.nodes)
        env = {"TR_OUT": str(out), "TR_HOLD_GENERATION": "0"}
        logs = {n: cluster.root / f"torchrun-{job_id}-{n}.log" for n in order}
        runs = {n: torchrun(cluster, n, job_id, logs[n], restarts=0, **env) for n in order}

        def explain() -> str:
            text = "\n".join(f"--- torchrun {n} ---\n{logs[n].read_text()[-3000:]}" for n in order)
            return f"{text}\n{cluster.logs()}"

        try:
            wait_for(lambda: len(results(out, 0)) == 6, 300, explain)
            held = results(out, 0)
            launchers = {r["node_id"]: launcher_of(r["pid"]) for r in held.values()}
            assert launchers == {n: runs[n].pid for n in order}, launchers
            pids = [*launchers.values(), *(r["pid"] for r in held.values())]
            assert alive(pids) == pids, pids
            if ending == "kill":
                victim = launchers[order[2]]
                killed_at = time.monotonic()
                os.kill(victim, signal.SIGKILL)
                wait_for(lambda: cluster.job(job_id).state != pb.RUNNING, 60, explain)
                took = time.monotonic() - killed_at
                info = cluster.job(job_id)
                assert info.state == pb.FAILED and f"node {order[2]!r} exited 1" in info.reason, (info, explain())
                agent_log = cluster.agent_log(order[2])
                assert f"adopted the launcher pid {victim} (hand-started)" in agent_log, explain()
                assert f"its launcher pid {victim} (hand-started) is gone" in agent_log, explain()
                assert took <= bound, (took, explain())
                wait_for(lambda: idle(cluster, order), 60, explain)
                assert alive(pids) == [], f"alive after the end: {alive(pids)}\n{explain()}"
                print(f"killed torchrun: job FAILED {took:.2f}s after the kill (bound {bound}s)")
            else:
                started = time.monotonic()
                cancelled = admin.cancel_job(cluster.address, job_id, "test", tls=cluster.admin_tls, timeout=60)
                took = time.monotonic() - started
                assert cancelled.state == pb.CANCELLED, cancelled
                assert alive(pids) == [], f"alive when CANCELLED was answered: {alive(pids)}\n{explain()}"
                print(f"cancel of hand-started torchruns answered after {took:.2f}s, {len(pids)} pids gone")
        finally:
            for process in runs.values():
                if process.poll() is None:
                    kill_tree(process)
                else:
                    process.wait()
