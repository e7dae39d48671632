"""The agent's TOML config."""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from meshgate.agent.health import HealthCheckConfig, HealthConfigError
from meshgate.agent_socket import configured_socket
from meshgate.endpoints import AddressError, split_host_port
from meshgate.secret_files import SecretFileError, read_secret
from meshgate.staged import staged, unstaged
from meshgate.tls import TLS_KEYS, TLSConfig, TLSConfigError

log = logging.getLogger("meshgate.agent")

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class AgentConfigError(ValueError):
    pass


_KEYS = {
    "coordinator",
    "job",
    "node_id",
    "join_token",
    "join_token_file",
    "slots",
    "cpu_slots",
    "state_dir",
    "exit_when_done",
    "insecure",
    "join_timeout_s",
    "drain_grace_s",
    "metrics_listen",
    "log_format",
    "worker_cert_file",
    "worker_key_file",
    "vouch_ttl_s",
    "vouch_socket",
    "vouch_socket_uids",
    "bundle_refresh_s",
    "fan_in",
    "advertise_address",
    "interface",
    "labels",
    "run_as",
    "cgroup_dir",
    "run_jobs_as_agent",
    "worker_log_bytes",
    "worker_log_jobs",
    "ray_labels_file",
    "job_paths",
    "health_check",
    "machine_id_file",
} | set(TLS_KEYS)


@dataclass(frozen=True)
class AgentConfig:
    coordinator: str
    # The one job of a single-job coordinator; "" (jobs mode): the node joins the cluster
    # and serves whatever job the coordinator gives it, job after job.
    job: str
    node_id: str
    join_token: str
    slots: Optional[int]  # None: detect GPUs, else cpu_slots
    cpu_slots: int
    state_dir: Path
    exit_when_done: bool = False
    insecure: bool = False
    tls: Optional[TLSConfig] = None  # None: plaintext (only with insecure = true)
    # Handed to workers for strict mTLS coordinators (client certs for workers too).
    worker_cert_file: Optional[Path] = None
    worker_key_file: Optional[Path] = None
    vouch_ttl_s: float = 600.0
    # Node-local Unix socket for workers the agent did not spawn (Ray); "" turns it off.
    vouch_socket: Optional[Path] = None
    vouch_socket_uids: tuple[int, ...] = ()
    bundle_refresh_s: float = 60.0
    # Serve Register to this node's workers on state_dir/rendezvous.sock and forward batches.
    fan_in: bool = False
    join_timeout_s: float = 300.0
    drain_grace_s: float = 10.0
    metrics_listen: str = ""  # HOST:PORT serves /metrics; empty: off
    log_format: str = "text"  # "text" or "json"
    # The workers' address and interface (agent/netif.py); empty: the route to the coordinator.
    advertise_address: str = ""
    interface: str = ""
    # Where the node sits, e.g. {switch = "s1", rack = "r4"}: the coordinator keeps a job's
    # nodes under one switch when it can.
    labels: tuple[tuple[str, str], ...] = ()
    # The unprivileged user every worker runs as (agent/job_user.py); "": the agent's own.
    run_as: str = ""
    # Jobs mode without a job user: every submitted job runs as the agent's own uid and can
    # read what the agent holds. Refused unless set explicitly, and said loudly at start.
    run_jobs_as_agent: bool = False
    # The cgroup v2 directory holding this agent's containment units; None: a
    # meshgate/<node_id>-<state dir digest> directory under the agent's own cgroup (agent/containment.py).
    cgroup_dir: Optional[Path] = None
    # Workers' output kept on this node (agent/worker_logs.py): bytes per file (a rank keeps
    # two: the current and one rotated) and how many jobs' output (the most recent).
    worker_log_bytes: int = 8 << 20
    worker_log_jobs: int = 20
    # Where the agent writes this node's Ray labels for `ray start --labels-file`
    # (launchers/ray_labels.py); None: not written.
    ray_labels_file: Optional[Path] = None
    # Directories a job's workers write to (checkpoints, datasets, caches): checked at start
    # to be writable by the job user, handed to workers as MESHGATE_JOB_PATHS.
    job_paths: tuple[Path, ...] = ()
    # [agent.health_check] (agent/health.py): the node's check; None: it runs none.
    health_check: Optional[HealthCheckConfig] = None
    # Where the host's machine-id is read (agent/inventory.py); None: /etc/machine-id. An
    # agent in a container names the host's (mounted in), since the image's is the same on
    # every node and the coordinator refuses a machine-id another live node presents.
    machine_id_file: Optional[Path] = None

    @property
    def jobs_mode(self) -> bool:
        return not self.job

    @classmethod
    def load(cls, path: str | Path) -> "AgentConfig":
        # Absolute: every path derived from it is handed to workers, whose cwd is not ours.
        path = Path(path).absolute()
        try:
            document = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise AgentConfigError(f"{path}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise AgentConfigError(f"{path}: invalid TOML: {exc}") from exc
        try:
            # [future.agent]: keys staged for a later release (meshgate/staged.py).
            def warn(line: str) -> None:
                log.warning("%s: %s", path, line)

            table = staged(document, "agent", _KEYS.__contains__, AgentConfigError, warn)
            unstaged(document, {"agent"}, warn)
            return cls.from_mapping(table, base_dir=path.parent)
        except AgentConfigError as exc:
            raise AgentConfigError(f"{path}: {exc}") from exc

    @classmethod
    def from_mapping(cls, table: Mapping[str, Any], base_dir: Path = Path(".")) -> "AgentConfig":
        base_dir = Path(base_dir).absolute()  # every path handed to a worker is absolute
        unknown = sorted(set(table) - _KEYS)
        if unknown:
            raise AgentConfigError(f"[agent] unknown key(s) {unknown}; known: {sorted(_KEYS)}")
        if not isinstance(table.get("coordinator"), str) or not table["coordinator"]:
            raise AgentConfigError('[agent] coordinator must be a non-empty string, e.g. coordinator = "head:7443"')
        _check_coordinator(table["coordinator"])
        job = table.get("job", "")
        if not isinstance(job, str):
            raise AgentConfigError(f"[agent] job must be a string (or left out: jobs mode), got {job!r}")
        if not job and table.get("exit_when_done"):
            raise AgentConfigError("[agent] exit_when_done needs a job: in jobs mode the agent serves job after job")
        labels = table.get("labels", {})
        if not isinstance(labels, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) and k and v for k, v in labels.items()
        ):
            raise AgentConfigError(
                f'[agent] labels must be a table of non-empty strings, e.g. {{switch = "s1"}}, got {labels!r}'
            )
        token = table.get("join_token", "")
        token_file = table.get("join_token_file")
        if token_file:
            token_path = Path(token_file)
            if not token_path.is_absolute():
                token_path = base_dir / token_path
            try:
                token = read_secret(token_path, "[agent] join_token_file").decode().strip()
            except (SecretFileError, UnicodeDecodeError) as exc:
                raise AgentConfigError(str(exc)) from None
        slots = table.get("slots", "auto")
        if slots != "auto" and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 1):
            raise AgentConfigError(f'[agent] slots must be "auto" or an integer >= 1, got {slots!r}')
        cpu_slots = table.get("cpu_slots", 1)
        if isinstance(cpu_slots, bool) or not isinstance(cpu_slots, int) or cpu_slots < 1:
            raise AgentConfigError(f"[agent] cpu_slots must be an integer >= 1, got {cpu_slots!r}")
        state_dir = Path(table.get("state_dir", "state/agent"))
        if not state_dir.is_absolute():
            state_dir = base_dir / state_dir
        return cls(
            coordinator=table["coordinator"],
            job=job,
            labels=tuple(sorted(labels.items())),
            node_id=str(table.get("node_id") or socket.gethostname()),
            join_token=str(token),
            slots=None if slots == "auto" else slots,
            cpu_slots=cpu_slots,
            state_dir=state_dir,
            exit_when_done=bool(table.get("exit_when_done", False)),
            insecure=bool(table.get("insecure", False)),
            tls=_tls(table, base_dir),
            worker_cert_file=_path(table, "worker_cert_file", base_dir),
            worker_key_file=_path(table, "worker_key_file", base_dir),
            vouch_ttl_s=float(table.get("vouch_ttl_s", 600.0)),
            vouch_socket=_path(table, "vouch_socket", base_dir) if table.get("vouch_socket", "x") else None,
            vouch_socket_uids=tuple(int(u) for u in table.get("vouch_socket_uids", ())),
            bundle_refresh_s=float(table.get("bundle_refresh_s", 60.0)),
            fan_in=table.get("fan_in", False) is True,
            join_timeout_s=float(table.get("join_timeout_s", 300.0)),
            drain_grace_s=float(table.get("drain_grace_s", 10.0)),
            run_as=_run_as(table, job),
            run_jobs_as_agent=table.get("run_jobs_as_agent", False) is True,
            cgroup_dir=_path(table, "cgroup_dir", base_dir),
            ray_labels_file=_path(table, "ray_labels_file", base_dir),
            job_paths=_job_paths(table),
            health_check=_health_check(table),
            machine_id_file=_path(table, "machine_id_file", base_dir),
            **_operations(table),
            **_network(table),
            **_worker_logs(table),
        )


def _health_check(table: Mapping[str, Any]) -> Optional[HealthCheckConfig]:
    if "health_check" not in table:
        return None
    try:
        return HealthCheckConfig.from_mapping(table["health_check"])
    except HealthConfigError as exc:
        raise AgentConfigError(str(exc)) from None


def _job_paths(table: Mapping[str, Any]) -> tuple[Path, ...]:
    """[agent] job_paths: absolute directories (a relative one would depend on a cwd)."""
    paths = table.get("job_paths", [])
    if not isinstance(paths, list) or len(paths) > 64:
        raise AgentConfigError(
            f'[agent] job_paths must be a list of directories, e.g. ["/data/ckpt"], got {paths!r:.120}'
        )
    for path in paths:
        if not isinstance(path, str) or not path.startswith("/") or ":" in path or "\0" in path:
            raise AgentConfigError(f"[agent] job_paths: each must be an absolute path without ':', got {path!r:.120}")
    return tuple(Path(p) for p in paths)


def _worker_logs(table: Mapping[str, Any]) -> dict[str, int]:
    """[agent] worker_log_bytes (at least 64 KiB) and worker_log_jobs (at least 1)."""
    values = {}
    for key, default, least in (("worker_log_bytes", 8 << 20, 64 << 10), ("worker_log_jobs", 20, 1)):
        value = table.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise AgentConfigError(f"[agent] {key} must be an integer >= {least}, got {value!r}")
        values[key] = value
    return values


def _run_as(table: Mapping[str, Any], job: str) -> str:
    """[agent] run_as: a user name, checked against the system when the agent starts.
    Jobs mode needs one: a submitted job never runs as the agent (nor as root), unless
    run_jobs_as_agent = true says so on purpose."""
    name = table.get("run_as", "")
    if not job and not name and table.get("run_jobs_as_agent", False) is not True:
        raise AgentConfigError(
            "[agent] run_as is required in jobs mode: name an unprivileged job user (e.g. run_as = "
            '"meshgate-job"), so that no submitted job runs as the agent or as root and reads the node\'s '
            "credential and keys; run_jobs_as_agent = true runs them as the agent's own user instead (INSECURE)"
        )
    if not isinstance(name, str) or len(name) > 64 or any(c in name for c in "/:\n\0 "):
        raise AgentConfigError(f"[agent] run_as must be a user name, got {str(name)[:64]!r}")
    return name


def _operations(table: Mapping[str, Any]) -> dict[str, str]:
    """[agent] metrics_listen and log_format (issue #8)."""
    from meshgate.metrics import parse_listen

    listen = table.get("metrics_listen", "")
    if listen:
        try:
            parse_listen(listen)
        except ValueError as exc:
            raise AgentConfigError(f"[agent] {exc}") from None
    log_format = table.get("log_format", "text")
    if log_format not in ("text", "json"):
        raise AgentConfigError(f"[agent] log_format must be 'text' or 'json', got {log_format!r}")
    return {"metrics_listen": str(listen or ""), "log_format": log_format}


def _network(table: Mapping[str, Any]) -> dict[str, str]:
    """[agent] advertise_address (an IP address) and interface (a name, e.g. "eth1")."""
    address = table.get("advertise_address", "")
    if not isinstance(address, str):
        raise AgentConfigError(f"[agent] advertise_address must be an IP address, got {address!r}")
    if address:
        try:
            parsed = ipaddress.ip_address(address)
        except ValueError:
            raise AgentConfigError(f"[agent] advertise_address must be an IP address, got {address[:64]!r}") from None
        if parsed.is_unspecified:
            raise AgentConfigError(f"[agent] advertise_address {address} is not an address peers can reach")
    interface = table.get("interface", "")
    if not isinstance(interface, str) or len(interface) > 15 or any(c in interface for c in "/ \t\n"):
        raise AgentConfigError(
            f"[agent] interface must be an interface name (at most 15 characters), got {str(interface)[:64]!r}"
        )
    return {"advertise_address": address, "interface": interface}


def _tls(table: Mapping[str, Any], base_dir: Path) -> Optional[TLSConfig]:
    try:
        return TLSConfig.from_mapping(table, section="agent", base_dir=base_dir, server=False)
    except TLSConfigError as exc:
        raise AgentConfigError(str(exc)) from None


# Paths that default to a file in the state directory ("" turns them off).
_IN_STATE_DIR = {"vouch_socket": "vouch.sock", "ray_labels_file": "ray-labels.yaml"}


def _path(table: Mapping[str, Any], key: str, base_dir: Path) -> Optional[Path]:
    if key == "vouch_socket":
        return configured_socket(table, base_dir)  # as torchrun's handler finds it (meshgate/agent_socket.py)
    value = table.get(key)
    if key in _IN_STATE_DIR and value is None:
        value = str(Path(table.get("state_dir", "state/agent")) / _IN_STATE_DIR[key])
    if not value:
        return None
    path = Path(value)
    return path if path.is_absolute() else base_dir / path


def _check_coordinator(spec: str) -> None:
    """Each address of [agent] coordinator (an HA list "a:7443,b:7443", or a unix: socket)
    read as every client reads HOST:PORT (meshgate/endpoints.py): a bad one is refused now,
    naming the key, not at the first dial."""
    for address in (part.strip() for part in spec.split(",")):
        if not address or address.startswith("unix:"):  # (an empty item is skipped, as clients skip it)
            continue
        try:
            split_host_port(address, "[agent] coordinator")
        except AddressError as exc:
            raise AgentConfigError(str(exc)) from None
