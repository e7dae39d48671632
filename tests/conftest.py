"""Shared fixtures: a real coordinator process on a free loopback port."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from meshgate.plan import ParallelPlan

REPO = Path(__file__).resolve().parent.parent

# Worker processes that start torch.distributed: TCPStore does a reverse-DNS lookup of
# each client, which here sometimes stalls 5 s; cap the resolver instead.
WORKER_ENV = {
    "RES_OPTIONS": "timeout:1 attempts:1",
    # Plaintext test coordinators; the TLS tests set MESHGATE_TLS_* themselves.
    "MESHGATE_INSECURE": "1",
    "OMP_NUM_THREADS": "1",
    "GLOO_SOCKET_IFNAME": "lo",
    "PYTHONPATH": str(REPO),
}


os.environ.setdefault("MESHGATE_INSECURE", "1")  # for clients run inside pytest itself


def worker_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(WORKER_ENV)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def toml_value(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_config(path: Path, sections: dict[str, dict]) -> Path:
    lines = []
    for name, table in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in table.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def _spawn(config: Path, port_file: Path, log_path: Path, **env: str) -> subprocess.Popen:
    """The coordinator with ``config``; ``env`` adds to its environment (a test hook)."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "meshgate.coordinator", "--config", str(config), "--port-file", str(port_file)],
            cwd=REPO,
            env=worker_env(**env),
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _wait_for_address(process: subprocess.Popen, port_file: Path, log_path: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if process.poll() is not None:
            raise RuntimeError(f"coordinator exited {process.returncode}:\n{log_path.read_text()}")
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"coordinator did not start in {timeout}s:\n{log_path.read_text()}")
        time.sleep(0.05)
    return port_file.read_text().strip()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningCoordinator:
    address: str
    job_id: str
    plan: ParallelPlan
    trust_bundle_path: Path
    config_path: Path
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def restart(self, timeout: float = 30.0) -> "RunningCoordinator":
        """Start the same config again (same state, keys and port) after a stop or kill."""
        self.stop()
        port_file = self.config_path.parent / "coordinator.addr"
        port_file.unlink(missing_ok=True)
        self.process = _spawn(self.config_path, port_file, self.log_path)
        self.address = _wait_for_address(self.process, port_file, self.log_path, timeout)
        return self

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def stop(self, sig: int = 15) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_coordinator(
    tmp: Path,
    plan: ParallelPlan,
    job_id: str = "test",
    slots_per_node: Optional[int] = None,
    job: Optional[dict] = None,
    server: Optional[dict] = None,
    launch: Optional[dict] = None,
    store: Optional[dict] = None,
    keys_dir: Optional[Path] = None,
    timeout: float = 30.0,
) -> RunningCoordinator:
    tmp.mkdir(parents=True, exist_ok=True)
    job_table = {"id": job_id, "slots_per_node": slots_per_node or plan.world_size}
    job_table.update(job or {})
    server_table = {"listen": "127.0.0.1:0", "insecure": True}
    server_table.update(server or {})
    keys_dir = keys_dir or tmp / "keys"
    sections = {"job": job_table, "plan": plan.to_dict(), "server": server_table, "keys": {"dir": str(keys_dir)}}
    if launch:
        sections["launch"] = launch
    if store:
        sections["store"] = store
    config = write_config(tmp / "coordinator.toml", sections)
    port_file = tmp / "coordinator.addr"
    log_path = tmp / "coordinator.log"
    process = _spawn(config, port_file, log_path)
    return RunningCoordinator(
        address=_wait_for_address(process, port_file, log_path, timeout),
        job_id=job_id,
        plan=plan,
        trust_bundle_path=keys_dir / "trust-bundle.json",
        config_path=config,
        process=process,
        log_path=log_path,
    )


def simulated_machine_id(directory: Path, node_id: str) -> str:
    """A machine-id file of its own for the simulated host of ``node_id`` (its agent's
    ``[agent] machine_id_file``), made once and kept across the agent's restarts: several
    agents on this one machine would otherwise present one machine-id, which the
    coordinator refuses (coordinator/hardware.py)."""
    path = directory / f"{node_id}.machine-id"
    if not path.exists():
        path.write_text(secrets.token_hex(16) + "\n")
    return str(path)


def start_agent(
    tmp: Path,
    address: str,
    node_id: str,
    *,
    job: str = "test",
    join_token: str = "",
    env: Optional[dict] = None,
    **agent,
) -> subprocess.Popen:
    """A real node agent process (plaintext, loopback), logging to tmp/<node_id>.log."""
    table = {
        "coordinator": address,
        "job": job,
        "node_id": node_id,
        "join_token": join_token,
        "slots": 2,
        "state_dir": str(tmp / f"{node_id}-state"),
        "machine_id_file": simulated_machine_id(tmp, node_id),
        "insecure": True,
        "drain_grace_s": 5,
    }
    if not job:  # jobs mode: the workers import meshgate from the test venv, no job user could
        table["run_jobs_as_agent"] = True
    table.update(agent)
    config = write_config(tmp / f"{node_id}.toml", {"agent": table})
    log = open(tmp / f"{node_id}.log", "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "meshgate.agent", "--config", str(config)],
        cwd=REPO,
        env=worker_env(**(env or {})),
        stdout=log,
        stderr=subprocess.STDOUT,
    )


@pytest.fixture
def coordinator_factory(tmp_path):
    """coordinator_factory(plan, job_id="test", slots_per_node=None, job=..., server=...)."""
    started: list[RunningCoordinator] = []

    def factory(plan: ParallelPlan, job_id: str = "test", slots_per_node=None, **kwargs):
        running = start_coordinator(tmp_path / f"coordinator{len(started)}", plan, job_id, slots_per_node, **kwargs)
        started.append(running)
        return running

    yield factory
    for running in started:
        running.stop()


class EtcdServer:
    """A real etcd process; ``stop()`` and ``start()`` take it down and bring it back on
    the same ports and data directory (an outage, as when etcd is restarted)."""

    def __init__(self, argv: list[str], client_port: int, log_path: Path) -> None:
        self.argv, self.client_port, self.log_path = argv, client_port, log_path
        self.endpoint = f"127.0.0.1:{client_port}"
        self.process: subprocess.Popen = None  # type: ignore[assignment]
        self.start()

    def start(self, timeout: float = 30.0) -> None:
        """Start etcd and return once it serves requests (``/health`` says true), not merely
        once its port is open: a restarted etcd replays its log and elects itself first."""
        import urllib.request

        self.process = subprocess.Popen(self.argv, stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=0.5) as reply:
                    if b'"true"' in reply.read():
                        return
                raise OSError("etcd not healthy yet")
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.process.kill()
                    raise RuntimeError("etcd did not start: " + self.log_path.read_text()[-2000:])
                time.sleep(0.05)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=15)


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory):
    """A real etcd (Debian's etcd-server) on free loopback ports, for one test module."""
    import shutil

    binary = shutil.which("etcd")
    if binary is None:
        message = "etcd is not installed (apt-get install etcd-server; .ci/run does)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    data = tmp_path_factory.mktemp("etcd")
    client, peer = free_port(), free_port()
    server = EtcdServer(
        [
            binary,
            "--name",
            "test",
            "--data-dir",
            str(data / "data"),
            "--listen-client-urls",  # IPv6 loopback too: an endpoint "[::1]:PORT" must reach it
            f"http://127.0.0.1:{client},http://[::1]:{client}",
            "--advertise-client-urls",
            f"http://127.0.0.1:{client}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"test=http://127.0.0.1:{peer}",
        ],
        client,
        data / "etcd.log",
    )
    yield server
    if server.process.poll() is None:
        server.stop()


# what `git ls-files` would give, without needing git: the sources, not build output
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", "state", ".demo"
)


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory) -> Path:
    """meshgate's wheel, built once per session as README's "Install" builds it
    (``pip wheel --no-deps . -w dist``) from a copy of the sources (no build output lands
    in the checkout)."""
    source = tmp_path_factory.mktemp("src") / "meshgate"
    shutil.copytree(REPO, source, ignore=_NOT_SOURCE)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", ".", "-w", str(out)],
        check=True,
        timeout=300,
        cwd=source,
    )
    (built,) = out.glob("meshgate-*.whl")
    return built
