"""``meshgate demo``: a real coordinator, node agents, N local workers, a verified world.

It starts ``meshgate-coordinator`` as its own process on 127.0.0.1 and one
``meshgate-agent`` per simulated node (``--nodes``); each agent joins, receives its
rank block and launches its workers with launchers/local.py (``--direct`` skips the
agents and launches the workers itself). Each worker registers, verifies its
attestation, joins gloo with the attested rank, builds its DeviceMesh from the
attestation and checks every dimension.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, TextIO

from meshgate.launchers.local import LocalLauncher, WorkerSpec, python_command
from meshgate.admin import create_join_token
from meshgate.extras import check
from meshgate.plan import ParallelPlan
from meshgate.tls import TLSConfig, init_dev_ca

DEFAULT_PLAN = ParallelPlan(dp_shard=2, tp=2)
DEMO_JOB = "demo"


def _toml_list(items) -> str:
    return "[" + ", ".join(json.dumps(str(i)) for i in items) + "]"


def _write_coordinator_config(
    directory: Path,
    plan: ParallelPlan,
    slots_per_node: int,
    command: list[str],
    *,
    secure: bool,
    join_token: str = "",
    node_order: list[str] = (),
) -> Path:
    plan_lines = [f"{k} = {v}" for k, v in plan.to_dict().items() if k != "order"]
    order = ", ".join(f'"{a}"' for a in plan.order)
    if secure:  # mTLS with the dev CA: every client shows a certificate; workers need vouches
        server = ['ca_file = "tls/ca.pem"', 'cert_file = "tls/coordinator.pem"',
                  'key_file = "tls/coordinator.key"', "require_client_cert = true"]
        job = ["require_vouch = true"]
    else:
        server = ["insecure = true"]
        job = [f'join_token = "{join_token}"'] if join_token else []
    text = "\n".join(
        [
            "[job]",
            f'id = "{DEMO_JOB}"',
            f"slots_per_node = {slots_per_node}",
            f"node_order = {_toml_list(node_order)}",  # rank 0 on demo-node-0, whoever joins first
            "heartbeat_interval_s = 1.0",
            *job,
            "",
            "[plan]",
            *plan_lines,
            f"order = [{order}]",
            "",
            "[server]",
            'listen = "127.0.0.1:0"',
            *server,
            "",
            "[keys]",
            'dir = "keys"',
            "",
            "[launch]",
            f"command = {_toml_list(command)}",
        ]
    )
    path = directory / "coordinator.toml"
    path.write_text(text + "\n")
    return path


def _write_agent_config(
    directory: Path, address: str, node_id: str, slots: int, token: str, *, secure: bool
) -> Path:
    if secure:
        transport = ['ca_file = "tls/ca.pem"', f'cert_file = "tls/agent-{node_id}.pem"',
                     f'key_file = "tls/agent-{node_id}.key"', 'worker_cert_file = "tls/worker.pem"',
                     'worker_key_file = "tls/worker.key"']
    else:
        transport = ["insecure = true"]
    path = directory / f"{node_id}.toml"
    path.write_text(
        "\n".join(
            [
                "[agent]",
                f'coordinator = "{address}"',
                f'job = "{DEMO_JOB}"',
                f'node_id = "{node_id}"',
                f'join_token = "{token}"',
                f"slots = {slots}",
                f'state_dir = "{node_id}-state"',
                "exit_when_done = true",
                *transport,
            ]
        )
        + "\n"
    )
    return path


def _start_coordinator(directory: Path, config: Path, timeout: float = 30.0):
    port_file = directory / "coordinator.addr"
    log = open(directory / "coordinator.log", "wb")
    process = subprocess.Popen(
        python_command("meshgate.coordinator", "--config", str(config), "--port-file", str(port_file)),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(
                "coordinator did not start:\n" + (directory / "coordinator.log").read_text()
            )
        time.sleep(0.05)
    return process, port_file.read_text().strip()


def run_demo(
    plan: Optional[ParallelPlan] = None,
    *,
    nodes: int = 1,
    megatron: bool = False,
    direct: bool = False,
    insecure: bool = False,
    timeout: float = 300.0,
    out: TextIO = sys.stdout,
    keep: bool = False,
) -> int:
    # The workers import torch (and megatron-core): find out here, before any process starts.
    check("torch", extra="torch", feature="meshgate demo")
    if megatron:
        check("megatron.core", extra="megatron", feature="meshgate demo --megatron")
    plan = plan or DEFAULT_PLAN
    world = plan.world_size
    if nodes < 1 or world % nodes:
        raise ValueError(f"--nodes {nodes} must divide world_size {world}")
    slots = world // nodes
    started = time.monotonic()
    directory = Path(tempfile.mkdtemp(prefix="meshgate-demo-"))
    results_dir = directory / "results"
    results_dir.mkdir()
    print(f"plan: {plan.describe()}, digest {plan.digest().hex()[:16]}", file=out)
    command = python_command("meshgate.launchers.demo_worker", "--out", str(results_dir))
    if megatron:
        command.append("--megatron")
    secure = not (insecure or direct)
    node_ids = [f"demo-node-{node}" for node in range(nodes)]
    static_token = "" if secure else secrets.token_urlsafe(24)
    if secure:
        init_dev_ca(directory / "tls", agent_names=node_ids)
    config = _write_coordinator_config(
        directory, plan, slots, [] if direct else command, secure=secure, join_token=static_token,
        node_order=node_ids,
    )
    coordinator, address = _start_coordinator(directory, config)
    transport = "mTLS with a dev CA; workers vouched for by their agents" if secure else "PLAINTEXT"
    print(f"coordinator: {address}, {transport} (log {directory / 'coordinator.log'})", file=out)
    if not direct:
        try:
            if secure:  # a single-use token per agent, minted through the Admin API
                admin = TLSConfig(directory / "tls" / "ca.pem", directory / "tls" / "admin.pem", directory / "tls" / "admin.key")
                tokens = [create_join_token(address, DEMO_JOB, node_id=n, tls=admin).token for n in node_ids]
            else:
                tokens = [static_token] * nodes
            ok = _run_agents(directory, address, node_ids, slots, tokens, timeout, out, secure=secure)
        finally:
            coordinator.terminate()
            coordinator.wait(timeout=15)
        return _report(plan, directory, results_dir, started, out, keep or not ok)
    launchers = []
    try:
        for node in range(nodes):
            spec = WorkerSpec(
                command=command,
                nprocs=slots,
                coordinator=address,
                job_id=DEMO_JOB,
                node_id=f"demo-node-{node}",
                trust_bundle=str(directory / "keys" / "trust-bundle.json"),
                env={"MESHGATE_INSECURE": "1"},
            )
            launcher = LocalLauncher(spec)
            launcher.start(stdout=subprocess.DEVNULL, stderr=open(directory / f"node{node}.err", "wb"))
            launchers.append(launcher)
        deadline = time.monotonic() + timeout
        exits = []
        for launcher in launchers:
            exits += launcher.wait(timeout=max(deadline - time.monotonic(), 1.0))
        if any(e.returncode != 0 for e in exits):
            for launcher in launchers:
                launcher.stop()
    finally:
        coordinator.terminate()
        coordinator.wait(timeout=15)
    return _report(plan, directory, results_dir, started, out, keep)


def _run_agents(
    directory: Path, address: str, node_ids: list[str], slots: int, tokens: list[str], timeout: float, out, *, secure: bool
) -> bool:
    agents = []
    nodes = len(node_ids)
    for node, (node_id, token) in enumerate(zip(node_ids, tokens)):
        config = _write_agent_config(directory, address, node_id, slots, token, secure=secure)
        log = open(directory / f"node{node}.err", "wb")
        agents.append(
            subprocess.Popen(python_command("meshgate.agent", "--config", str(config)), stdout=log, stderr=subprocess.STDOUT)
        )
    print(f"agents: {nodes} (node ids demo-node-0..{nodes - 1}), {slots} workers each", file=out)
    deadline = time.monotonic() + timeout
    codes = []
    for agent in agents:
        try:
            codes.append(agent.wait(timeout=max(deadline - time.monotonic(), 1.0)))
        except subprocess.TimeoutExpired:
            for other in agents:
                other.terminate()
            codes.append(agent.wait(timeout=30))
    return all(c == 0 for c in codes)


def _report(plan: ParallelPlan, directory: Path, results_dir: Path, started: float, out, keep: bool) -> int:
    world = plan.world_size
    results = [json.loads(p.read_text()) for p in sorted(results_dir.glob("*.json"))]
    results.sort(key=lambda r: (r.get("rank", 1 << 30), r.get("node", ""), r.get("local_rank", 0)))
    ok = [r for r in results if r.get("check") == "ok"]
    print(_table(plan, results), file=out)
    elapsed = time.monotonic() - started
    generation = ok[0]["generation"] if ok else "?"
    verified = len(ok) == world and sorted(r["rank"] for r in ok) == list(range(world))
    print(
        f"world {'verified' if verified else 'NOT verified'}: {len(ok)}/{world} ranks, "
        f"generation {generation} ({elapsed:.1f}s)",
        file=out,
    )
    if not verified:
        for err in sorted(directory.glob("node*.err")):
            text = err.read_text(errors="replace").strip()
            if text:
                print(f"--- {err.name} ---\n{text[-3000:]}", file=out)
    if not keep and verified:
        shutil.rmtree(directory, ignore_errors=True)
    return 0 if verified else 1


def _table(plan: ParallelPlan, results: list[dict]) -> str:
    axes = [a for a in reversed(plan.order)]  # outermost first, as DeviceMesh prints
    header = ["rank", "node", *axes, "check"]
    rows = []
    for r in results:
        coordinate = r.get("coordinate", {})
        check = r.get("check", "?")
        if check == "ok" and r.get("checked_axes"):
            check = "ok: " + ",".join(r["checked_axes"])
        if r.get("megatron") == "ok":
            check += " +megatron"
        rows.append(
            [str(r.get("rank", "?")), f"{r.get('node', '?')}", *(str(coordinate.get(a, "?")) for a in axes), check]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)
