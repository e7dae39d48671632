"""``meshgate demo``: a real coordinator, node agents, N local workers, verified worlds.

It starts ``meshgate-coordinator`` in jobs mode as its own process on 127.0.0.1 and one
``meshgate-agent`` per simulated node (``--nodes``); each agent joins the cluster once.
Then it submits two jobs back to back through the Admin API (the plan given, then a
pure data-parallel plan of the same world size; ``--jobs 1`` for only the first), and
the same agents launch the workers of each with launchers/local.py. ``--direct``
skips the agents (a single-job coordinator; the demo launches the workers itself).
Each worker registers, verifies its attestation, joins gloo with the attested rank,
builds its DeviceMesh from the attestation and checks every dimension.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, TextIO

from meshgate.launchers.local import LocalLauncher, WorkerSpec, python_command
from meshgate import admin as admin_api
from meshgate.admin import create_join_token
from meshgate.connection import Connection, poll
from meshgate.extras import check
from meshgate.plan import ParallelPlan
from meshgate.tls import TLSConfig, init_dev_ca

DEFAULT_PLAN = ParallelPlan(dp_shard=2, tp=2)
DEMO_JOB = "demo"


def _toml_list(items) -> str:
    return "[" + ", ".join(json.dumps(str(i)) for i in items) + "]"


def _write_direct_config(directory: Path, plan: ParallelPlan, slots_per_node: int, node_order: list[str]) -> Path:
    """--direct: a plaintext single-job coordinator; the demo launches the workers itself."""
    plan_lines = [f"{k} = {v}" for k, v in plan.to_dict().items() if k != "order"]
    order = ", ".join(f'"{a}"' for a in plan.order)
    text = "\n".join(
        [
            "[job]",
            f'id = "{DEMO_JOB}"',
            f"slots_per_node = {slots_per_node}",
            f"node_order = {_toml_list(node_order)}",  # rank 0 on demo-node-0, whoever joins first
            "heartbeat_interval_s = 1.0",
            "",
            "[plan]",
            *plan_lines,
            f"order = [{order}]",
            "",
            "[server]",
            'listen = "127.0.0.1:0"',
            "insecure = true",
            "",
            "[keys]",
            'dir = "keys"',
        ]
    )
    path = directory / "coordinator.toml"
    path.write_text(text + "\n")
    return path


def _write_cluster_config(directory: Path, *, secure: bool) -> Path:
    """A jobs-mode coordinator: no [job], no [plan]; jobs arrive through the Admin API."""
    if secure:
        server = [
            'ca_file = "tls/ca.pem"',
            'cert_file = "tls/coordinator.pem"',
            'key_file = "tls/coordinator.key"',
            "require_client_cert = true",
        ]
    else:
        server = ["insecure = true"]
    text = "\n".join(
        [
            "[cluster]",
            "heartbeat_interval_s = 1.0",
            "",
            "[server]",
            'listen = "127.0.0.1:0"',
            *server,
            "",
            "[keys]",
            'dir = "keys"',
        ]
    )
    path = directory / "coordinator.toml"
    path.write_text(text + "\n")
    return path


def _write_agent_config(
    directory: Path, address: str, node_id: str, slots: int, token: str, *, secure: bool, simulated: bool
) -> Path:
    if secure:
        transport = [
            'ca_file = "tls/ca.pem"',
            f'cert_file = "tls/agent-{node_id}.pem"',
            f'key_file = "tls/agent-{node_id}.key"',
            'worker_cert_file = "tls/worker.pem"',
            'worker_key_file = "tls/worker.key"',
        ]
    else:
        transport = ["insecure = true"]
    identity = []
    if simulated:
        # Several simulated nodes on this one machine: each its own machine-id, as separate
        # hosts have (the coordinator refuses one that another live node presents).
        (directory / f"{node_id}.machine-id").write_text(secrets.token_hex(16) + "\n")
        identity = [f'machine_id_file = "{node_id}.machine-id"']
    path = directory / f"{node_id}.toml"
    path.write_text(
        "\n".join(
            [
                "[agent]",
                f'coordinator = "{address}"',
                f'node_id = "{node_id}"',
                f'join_token = "{token}"',
                f"slots = {slots}",
                f'state_dir = "{node_id}-state"',
                *identity,
                # The demo's workers import torch from this venv, which a separate job user may
                # not be able to read: they run as the demo's own user, and the agent says so.
                "run_jobs_as_agent = true",
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
            raise RuntimeError("coordinator did not start:\n" + (directory / "coordinator.log").read_text())
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
    jobs: int = 2,
) -> int:
    # The workers import torch (and megatron-core): find out here, before any process starts.
    check("torch", extra="torch", feature="meshgate demo")
    if megatron:
        check("megatron.core", extra="megatron", feature="meshgate demo --megatron")
    plan = plan or DEFAULT_PLAN
    world = plan.world_size
    if nodes < 1 or world % nodes:
        raise ValueError(f"--nodes {nodes} must divide world_size {world}")
    if jobs not in (1, 2):
        raise ValueError(f"--jobs {jobs} must be 1 or 2")
    slots = world // nodes
    started = time.monotonic()
    directory = Path(tempfile.mkdtemp(prefix="meshgate-demo-"))
    if direct:
        return _run_direct(plan, directory, nodes, slots, megatron, timeout, out, keep, started)
    secure = not insecure
    node_ids = [f"demo-node-{node}" for node in range(nodes)]
    if secure:
        init_dev_ca(directory / "tls", agent_names=node_ids)
    if os.geteuid() == 0:
        print(
            "AS ROOT: the demo's agents run its workers as root, with no [agent] run_as: they import "
            f"torch from {sys.executable}, which another user may not be able to run (under /root, say). "
            "A deployment names an unprivileged job user (run_as) and gives it an interpreter it can "
            'read: docs/deploying.md, SECURITY.md "Jobs"',
            file=out,
        )
    coordinator, address = _start_coordinator(directory, _write_cluster_config(directory, secure=secure))
    transport = "mTLS with a dev CA; workers vouched for by their agents" if secure else "PLAINTEXT"
    print(f"coordinator: {address} (jobs mode), {transport} (log {directory / 'coordinator.log'})", file=out)
    tls = (
        TLSConfig(directory / "tls" / "ca.pem", directory / "tls" / "admin.pem", directory / "tls" / "admin.key")
        if secure
        else None
    )
    connection = Connection(address, tls)  # the demo's own settings, never the environment's
    agents: list[subprocess.Popen] = []
    verified = True
    try:
        # a single-use token per node, minted through the Admin API; each agent joins once
        tokens = [create_join_token(connection, "", node_id=n).token for n in node_ids]
        agents = _start_agents(directory, address, node_ids, slots, tokens, secure=secure)
        print(f"agents: {nodes} (node ids demo-node-0..{nodes - 1}), {slots} slots each, joined once", file=out)
        plans = [plan, ParallelPlan(dp_shard=world)][:jobs]
        for index, job_plan in enumerate(plans, 1):
            job_started = time.monotonic()
            results_dir = directory / f"results-{index}"
            results_dir.mkdir()
            command = python_command("meshgate.launchers.demo_worker", "--out", str(results_dir))
            if megatron:
                command.append("--megatron")
            spec = admin_api.pb.JobSpec(
                job_id=f"{DEMO_JOB}-{index}",
                plan=job_plan.to_proto(),
                node_ids=node_ids,
                command=command,
            )
            info = admin_api.submit_job(connection, spec, wait_for_nodes=True)  # agents may still be joining
            print(
                f"\njob {info.spec.job_id} submitted ({admin_api.pb.JobState.Name(info.state)}): "
                f"plan {job_plan.describe()}, digest {job_plan.digest().hex()[:16]}",
                file=out,
            )
            ended = _wait_job(connection, info.spec.job_id, timeout)
            print(
                f"job {info.spec.job_id}: {admin_api.pb.JobState.Name(ended.state)}"
                + (f" ({ended.reason})" if ended.reason else ""),
                file=out,
            )
            verified = _report(job_plan, directory, results_dir, job_started, out) and verified
            if not verified:
                break
    finally:
        for agent in agents:
            agent.terminate()
        for agent in agents:
            try:
                agent.wait(timeout=30)
            except subprocess.TimeoutExpired:
                agent.kill()
        coordinator.terminate()
        coordinator.wait(timeout=15)
    print(
        f"\n{jobs} job{'s' * (jobs > 1)} through one coordinator and {nodes} agent{'s' * (nodes > 1)}: "
        f"{'all verified' if verified else 'NOT verified'} ({time.monotonic() - started:.1f}s)",
        file=out,
    )
    _cleanup(directory, keep or not verified)
    return 0 if verified else 1


def _wait_job(connection: Connection, job_id: str, timeout: float):
    for info in poll(lambda: admin_api.get_job(connection, job_id), every_s=0.2, for_s=timeout):
        if info.state in (admin_api.pb.SUCCEEDED, admin_api.pb.FAILED, admin_api.pb.CANCELLED):
            return info
    admin_api.cancel_job(connection, job_id, f"meshgate demo: not done after {timeout:g}s")
    return admin_api.get_job(connection, job_id)


def _run_direct(plan, directory, nodes, slots, megatron, timeout, out, keep, started) -> int:
    """--direct: a single-job plaintext coordinator; the demo launches the workers itself."""
    results_dir = directory / "results"
    results_dir.mkdir()
    print(f"plan: {plan.describe()}, digest {plan.digest().hex()[:16]}", file=out)
    command = python_command("meshgate.launchers.demo_worker", "--out", str(results_dir))
    if megatron:
        command.append("--megatron")
    node_ids = [f"demo-node-{node}" for node in range(nodes)]
    config = _write_direct_config(directory, plan, slots, node_ids)
    coordinator, address = _start_coordinator(directory, config)
    print(f"coordinator: {address}, PLAINTEXT (log {directory / 'coordinator.log'})", file=out)
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
    verified = _report(plan, directory, results_dir, started, out)
    _cleanup(directory, keep or not verified)
    return 0 if verified else 1


def _start_agents(
    directory: Path, address: str, node_ids: list[str], slots: int, tokens: list[str], *, secure: bool
) -> list[subprocess.Popen]:
    agents = []
    for node, (node_id, token) in enumerate(zip(node_ids, tokens)):
        config = _write_agent_config(
            directory, address, node_id, slots, token, secure=secure, simulated=len(node_ids) > 1
        )
        log = open(directory / f"node{node}.err", "ab")
        agents.append(
            subprocess.Popen(
                python_command("meshgate.agent", "--config", str(config)), stdout=log, stderr=subprocess.STDOUT
            )
        )
    return agents


def _cleanup(directory: Path, keep: bool) -> None:
    if not keep:
        shutil.rmtree(directory, ignore_errors=True)


def _report(plan: ParallelPlan, directory: Path, results_dir: Path, started: float, out) -> bool:
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
    return verified


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
