"""The coordinator's TOML config (tomllib), validated into one frozen object."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Optional

from meshgate.coordinator.cluster_state.admission import QuarantinePolicy
from meshgate.coordinator.cluster_state.forgotten import DEFAULT_ENDED_JOBS_KEPT, MAX_ENDED_JOBS_KEPT
from meshgate.coordinator.cluster_state.quotas import Quotas
from meshgate.coordinator.jobs import CLUSTER_LOG_ID, DEFAULT_RETENTION_S, JobSpec
from meshgate.coordinator.jobspec import DEFAULT_LAUNCH_DEADLINE_S
from meshgate.coordinator.rendezvous import RankMode, RendezvousConfig, RendezvousError
from meshgate.attestation import secret_hash
from meshgate.durations import DurationError, parse_duration
from meshgate.endpoints import AddressError, split_host_port
from meshgate.secret_files import SecretFileError, read_secret
from meshgate.staged import FUTURE, staged, unstaged
from meshgate.tls import TLS_KEYS, TLSConfig, TLSConfigError
from meshgate.plan import ParallelPlan, PlanError

log = logging.getLogger("meshgate.coordinator")

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_TTL_S = 24 * 3600.0


class ConfigError(ValueError):
    """A config that cannot run; the message names the file and the key."""


@dataclass(frozen=True)
class LaunchConfig:
    """What agents run on their node: the workers of its rank block."""

    command: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    restart_policy: str = "never"
    max_restarts: int = 0
    per_node: bool = False  # the command is one launcher per node (JobSpec.launch)

    @classmethod
    def from_mapping(cls, table: Mapping[str, Any]) -> "LaunchConfig":
        _refuse_unknown("launch", table, {"command", "env", "restart_policy", "max_restarts"})
        command = table.get("command", [])
        if not isinstance(command, list) or not all(isinstance(c, str) for c in command):
            raise ConfigError(f"[launch] command must be a list of strings, got {command!r}")
        env = table.get("env", {})
        if not isinstance(env, Mapping) or not all(isinstance(v, str) for v in env.values()):
            raise ConfigError(f"[launch] env must be a table of strings, got {env!r}")
        policy = table.get("restart_policy", "never")
        if policy not in ("never", "on-failure"):
            raise ConfigError(f"[launch] restart_policy must be 'never' or 'on-failure', got {policy!r}")
        max_restarts = table.get("max_restarts", 3 if policy == "on-failure" else 0)
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ConfigError(f"[launch] max_restarts must be an integer >= 0, got {max_restarts!r}")
        return cls(tuple(command), tuple(sorted(env.items())), policy, max_restarts)


@dataclass(frozen=True)
class CoordinatorConfig:
    # The job a config with [job] + [plan] declares: the cluster serves it from its start,
    # beside any job submitted through the Admin API (meshgate job submit). None: a config
    # that declares no job.
    rendezvous: Optional[RendezvousConfig]
    listen: str = "127.0.0.1:7443"
    insecure: bool = False
    tls: Optional[TLSConfig] = None  # None: plaintext, only with insecure = true
    admin_token_hash: str = ""
    keys_dir: Path = Path("state/keys")
    store_kind: str = "sqlite"
    state_dir: Path = Path("state")
    etcd_endpoints: tuple[str, ...] = ()
    lease_ttl_s: int = 5
    advertise: str = ""
    attestation_ttl_s: float = DEFAULT_TTL_S
    max_await_s: float = 3600.0
    max_pending_requests: int = 1_000_000
    heartbeat_interval_s: float = 5.0
    heartbeat_misses: int = 3
    launch: LaunchConfig = LaunchConfig()
    metrics_listen: str = ""  # [server] metrics_listen HOST:PORT serves /metrics; empty: off
    log_format: str = "text"  # [server] log_format: "text" or "json"
    require_vouch: bool = True  # [cluster] require_vouch ([job] require_vouch for the declared job)
    retention_s: float = DEFAULT_RETENTION_S  # [cluster] retention, how long an ended job's log is kept
    # [cluster] launch_deadline: what a job without a command that names none gets.
    launch_deadline_s: float = DEFAULT_LAUNCH_DEADLINE_S
    quotas: Quotas = Quotas()  # [cluster.quota]: what one submitter's unended jobs may take
    quarantine: QuarantinePolicy = QuarantinePolicy()  # [cluster] quarantine_after, quarantine_window
    ended_jobs_kept: int = DEFAULT_ENDED_JOBS_KEPT  # [cluster] ended_jobs_kept: the rest are forgotten

    @property
    def log_id(self) -> str:
        """Whose log ``<state>/cluster`` holds: the cluster's, whatever the config declares."""
        return CLUSTER_LOG_ID

    @property
    def declared(self) -> tuple[tuple[JobSpec, RendezvousConfig], ...]:
        """The job the config declares, as the cluster takes it (none without [job])."""
        if self.rendezvous is None:
            return ()
        return ((declared_spec(self.rendezvous, self.launch), self.rendezvous),)

    @property
    def heartbeat_timeout_s(self) -> float:
        return self.heartbeat_interval_s * self.heartbeat_misses

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CoordinatorConfig":
        path = Path(path)
        try:
            document = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"{path}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
        try:
            return cls.from_mapping(document, base_dir=path.parent)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from exc

    @classmethod
    def from_mapping(cls, document: Mapping[str, Any], base_dir: Path = Path(".")) -> "CoordinatorConfig":
        known = {"job", "plan", "server", "keys", "store", "launch", "cluster", FUTURE}
        # [future.X]: keys staged for a later release (meshgate/staged.py), X's keys here.
        future = _table(document, FUTURE)
        document = {**document, **{name: _staged(document, name) for name in SECTION_KEYS if name in future}}
        unstaged(document, set(SECTION_KEYS))
        unknown = sorted(set(document) - known)
        if unknown:
            raise ConfigError(f"unknown section(s) {unknown}; known: {sorted(known)}")
        # A config that declares a job ([job] + [plan]) holds the cluster's timings in [job];
        # one that declares none holds them in [cluster]. Either is served as a cluster.
        declares_job = "job" in document or "plan" in document
        if not declares_job and "launch" in document:
            raise ConfigError(
                "[launch] belongs to a single-job config; in jobs mode each job names its command "
                "(meshgate job submit ... -- COMMAND)"
            )
        if declares_job and "cluster" in document:
            raise ConfigError(
                "[cluster] is for jobs mode (a config with no [job] and no [plan]); "
                "this config names a job: put those keys in [job]"
            )
        job = _table(document, "job" if declares_job else "cluster")
        server = _table(document, "server")
        keys = _table(document, "keys")
        store = _table(document, "store")
        _refuse_unknown("job" if declares_job else "cluster", job, SECTION_KEYS["job" if declares_job else "cluster"])
        for name, table in (("server", server), ("keys", keys), ("store", store)):
            _refuse_unknown(name, table, SECTION_KEYS[name])
        insecure = server.get("insecure", False)
        if not isinstance(insecure, bool):
            raise ConfigError(f"[server] insecure must be true or false, got {insecure!r}")
        serves_tls = "ca_file" in server or "cert_file" in server or "key_file" in server
        if serves_tls and job.get("join_token"):
            raise ConfigError(
                "[job] join_token: a static join token is never spent, so it is refused whenever "
                "TLS is on; mint single-use tokens bound to a node (meshgate token create --node-id)"
            )
        require_vouch = _bool(job, "require_vouch", not insecure)
        mode = job.get("mode", "assigned" if require_vouch else None)
        if mode is not None and mode not in ("assigned", "claimed"):
            raise ConfigError(f'[job] mode must be "assigned" or "claimed", got {mode!r}')
        rendezvous: Optional[RendezvousConfig] = None
        if declares_job:
            rendezvous = _single_job(document, job, require_vouch, mode)
        keys_dir = Path(keys.get("dir", "state/keys"))
        if not keys_dir.is_absolute():
            keys_dir = base_dir / keys_dir
        state_dir = Path(store.get("dir", "state"))
        if not state_dir.is_absolute():
            state_dir = base_dir / state_dir
        kind = store.get("kind", "sqlite")
        if kind not in ("memory", "sqlite", "etcd"):
            raise ConfigError(f"[store] kind must be memory, sqlite or etcd, got {kind!r}")
        endpoints = _addresses(store)
        if kind == "etcd" and not endpoints:
            raise ConfigError('[store] kind = "etcd" needs endpoints = ["host:2379", ...]')
        lease_ttl = store.get("lease_ttl_s", 5)
        if isinstance(lease_ttl, bool) or not isinstance(lease_ttl, int) or lease_ttl < 1:
            raise ConfigError(f"[store] lease_ttl_s must be an integer >= 1, got {lease_ttl!r}")
        lost_timeout = job.get("lost_node_timeout_s", 300.0)
        if isinstance(lost_timeout, bool) or not isinstance(lost_timeout, (int, float)) or lost_timeout <= 0:
            raise ConfigError(f"[job] lost_node_timeout_s must be a positive number, got {lost_timeout!r}")
        ttl = job.get("attestation_ttl_s", DEFAULT_TTL_S)
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or ttl <= 0:
            raise ConfigError(f"[job] attestation_ttl_s must be a positive number, got {ttl!r}")
        interval = job.get("heartbeat_interval_s", 5.0)
        misses = job.get("heartbeat_misses", 3)
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval <= 0:
            raise ConfigError(f"[job] heartbeat_interval_s must be a positive number, got {interval!r}")
        if isinstance(misses, bool) or not isinstance(misses, int) or misses < 1:
            raise ConfigError(f"[job] heartbeat_misses must be an integer >= 1, got {misses!r}")
        try:
            tls = _server_tls(server, insecure, base_dir)
        except TLSConfigError as exc:
            raise ConfigError(str(exc)) from None
        admin_token_hash = ""
        if server.get("admin_token_file"):
            token_path = Path(server["admin_token_file"])
            token_path = token_path if token_path.is_absolute() else base_dir / token_path
            try:
                admin_token_hash = secret_hash(read_secret(token_path, "[server] admin_token_file").strip())
            except SecretFileError as exc:
                raise ConfigError(str(exc)) from None
        launch = LaunchConfig.from_mapping(_table(document, "launch"))
        if rendezvous is not None:
            # A worker failure restarts the whole job's generation, as often as the launch allows.
            rendezvous = replace(
                rendezvous, max_restarts=launch.max_restarts if launch.restart_policy == "on-failure" else 0
            )
            try:  # the job the cluster declares from it, held to a job's rules
                declared_spec(rendezvous, launch)
            except RendezvousError as exc:
                raise ConfigError(f"[job]/[launch]: {exc.message}") from None
        if not declares_job and "quarantine_after" not in job:
            log.warning(QUARANTINE_DEFAULT_CHANGED)
        return cls(
            rendezvous=rendezvous,
            listen=_listen(server),
            insecure=insecure,
            tls=tls,
            admin_token_hash=admin_token_hash,
            keys_dir=keys_dir,
            store_kind=kind,
            state_dir=state_dir,
            etcd_endpoints=tuple(endpoints),
            lease_ttl_s=lease_ttl,
            advertise=str(store.get("advertise", "")),
            attestation_ttl_s=float(ttl),
            max_await_s=float(job.get("max_await_s", 3600.0)),
            max_pending_requests=int(server.get("max_pending_requests", 1_000_000)),
            heartbeat_interval_s=float(interval),
            heartbeat_misses=misses,
            launch=launch,
            require_vouch=require_vouch,
            retention_s=_duration(job, "retention", DEFAULT_RETENTION_S),
            launch_deadline_s=_duration(job, "launch_deadline", DEFAULT_LAUNCH_DEADLINE_S),
            quotas=_quotas(job),
            quarantine=_quarantine(job),
            ended_jobs_kept=_ended_jobs_kept(job),
            **_operations(server),
        )


def declared_spec(rendezvous: RendezvousConfig, launch: LaunchConfig) -> JobSpec:
    """The job a config's [job], [plan] and [launch] declare, as a job of the cluster. Its
    node_order stays the rendezvous's own (it may pin only the first nodes)."""
    return JobSpec.build(
        job_id=rendezvous.job_id,
        plan=rendezvous.plan,
        slots_per_node=rendezvous.slots_per_node,
        mode=(rendezvous.mode or RankMode.ASSIGNED).value,
        topology_policy=rendezvous.topology_policy,
        command=launch.command,
        env=launch.env,
        restart_policy=launch.restart_policy,
        max_restarts=launch.max_restarts,
        lost_node_timeout_s=rendezvous.lost_node_timeout_s,
        submitted=False,
        declared=True,
    )


def _single_job(
    document: Mapping[str, Any], job: Mapping[str, Any], require_vouch: bool, mode: Optional[str]
) -> RendezvousConfig:
    """The rendezvous of a single-job config ([job] + [plan])."""
    try:
        plan = ParallelPlan.from_mapping(_table(document, "plan"))
    except PlanError as exc:
        raise ConfigError(f"[plan]: {exc}") from exc
    try:
        return RendezvousConfig(
            job_id=job.get("id", ""),
            plan=plan,
            slots_per_node=job.get("slots_per_node", plan.world_size),
            node_order=tuple(job.get("node_order", ())),
            topology_policy=job.get("topology_policy", "warn"),
            join_token=str(job.get("join_token", "")),
            lost_node_timeout_s=float(job.get("lost_node_timeout_s", 300.0)),
            # Secure setups refuse workers no agent vouched for; plaintext dev ones may not.
            require_vouch=require_vouch,
            # Unset only where nothing is enforced (no vouches): then either mode is taken.
            mode=None if mode is None else RankMode(mode),
        )
    except (ValueError, RendezvousError) as exc:
        raise ConfigError(f"[job]: {exc}") from exc


def _server_tls(server: Mapping[str, Any], insecure: bool, base_dir: Path) -> Optional[TLSConfig]:
    """TLS, mTLS or plaintext. TLS without client certificates authenticates no caller,
    so, like plaintext, it needs ``insecure = true`` to say so (and the daemon then
    warns loudly); otherwise it is refused."""
    if server.get("require_client_cert", True) is not False:
        return TLSConfig.from_mapping(server, section="server", base_dir=base_dir, server=True)
    if not insecure:
        raise ConfigError(
            "[server] require_client_cert = false lets any TLS client call every RPC unauthenticated; "
            "set insecure = true to say so (development only), or remove it for mTLS"
        )
    table = {k: v for k, v in server.items() if k != "insecure"}
    return TLSConfig.from_mapping(table, section="server", base_dir=base_dir, server=True)


def _operations(server: Mapping[str, Any]) -> dict[str, str]:
    """[server] metrics_listen and log_format (issue #8)."""
    from meshgate.metrics import parse_listen

    listen = server.get("metrics_listen", "")
    if listen:
        try:
            parse_listen(listen)
        except ValueError as exc:
            raise ConfigError(f"[server] {exc}") from None
    log_format = server.get("log_format", "text")
    if log_format not in ("text", "json"):
        raise ConfigError(f"[server] log_format must be 'text' or 'json', got {log_format!r}")
    return {"metrics_listen": str(listen or ""), "log_format": log_format}


def _addresses(store: Mapping[str, Any]) -> list[str]:
    """[store] endpoints (etcd's; a bare host takes port 2379) and advertise, each read as
    the store and the standbys will read it (meshgate/endpoints.py), so a bad one is refused
    here, naming it, not when the store opens."""
    from meshgate.coordinator.store.etcd import etcd_endpoint

    endpoints = store.get("endpoints", [])
    if not isinstance(endpoints, list):
        raise ConfigError(f"[store] endpoints must be a list of HOST:PORT strings, got {str(endpoints)[:100]!r}")
    try:
        for endpoint in endpoints:
            etcd_endpoint(endpoint)
        if store.get("advertise"):
            split_host_port(store["advertise"], "[store] advertise")
    except AddressError as exc:
        raise ConfigError(str(exc)) from None
    return endpoints


def _listen(server: Mapping[str, Any]) -> str:
    """[server] listen: HOST:PORT (port 0: the kernel picks one), or a unix: socket path."""
    listen = server.get("listen", "127.0.0.1:7443")
    if isinstance(listen, str) and listen.startswith("unix:"):
        return listen
    try:
        split_host_port(listen, "[server] listen", listen=True)
    except AddressError as exc:
        raise ConfigError(str(exc)) from None
    return listen


def _duration(table: Mapping[str, Any], key: str, default: float) -> float:
    """Seconds, or a duration string as the CLI's flags take it (meshgate/durations.py)."""
    try:
        return parse_duration(table.get(key, default), f"[cluster] {key}")
    except DurationError as exc:
        raise ConfigError(str(exc)) from None


def _quotas(cluster: Mapping[str, Any]) -> Quotas:
    """[cluster.quota] (cluster_state/quotas.py); its defaults without one."""
    table = cluster.get("quota", {})
    if not isinstance(table, Mapping):
        raise ConfigError(f"[cluster] quota must be a table ([cluster.quota]), got {table!r}")
    try:
        return Quotas.from_mapping(table)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


# A default that changed (docs/operating.md, "Upgrading"): said once at start while the
# config relies on it, so that a config of a release before it starts, and says so.
QUARANTINE_DEFAULT_CHANGED = (
    "DEFAULT CHANGED: [cluster] quarantine_after is not set, so a node with 3 failures attributed to it "
    "within quarantine_window (1h) is quarantined, which releases before a4683cf (#30) never did; set "
    "quarantine_after (0: never) to keep this line quiet"
)


def _quarantine(cluster: Mapping[str, Any]) -> QuarantinePolicy:
    """[cluster] quarantine_after (a count; 0 never quarantines) and quarantine_window."""
    default = QuarantinePolicy()
    after = cluster.get("quarantine_after", default.after)
    if isinstance(after, bool) or not isinstance(after, int) or not 0 <= after <= 1000:
        raise ConfigError(f"[cluster] quarantine_after must be a whole number in [0, 1000] (0: never), got {after!r}")
    return QuarantinePolicy(after, _duration(cluster, "quarantine_window", default.window_s))


def _ended_jobs_kept(cluster: Mapping[str, Any]) -> int:
    """[cluster] ended_jobs_kept: how many ended jobs the coordinator remembers (the
    oldest beyond are forgotten, their ids kept taken: cluster_state/forgotten.py)."""
    kept = cluster.get("ended_jobs_kept", DEFAULT_ENDED_JOBS_KEPT)
    if isinstance(kept, bool) or not isinstance(kept, int) or not 1 <= kept <= MAX_ENDED_JOBS_KEPT:
        raise ConfigError(
            f"[cluster] ended_jobs_kept must be a whole number in [1, {MAX_ENDED_JOBS_KEPT}], got {kept!r}"
        )
    return kept


def _bool(table: Mapping[str, Any], key: str, default: bool) -> bool:
    value = table.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    return value


_TIMING_KEYS = {"attestation_ttl_s", "max_await_s", "heartbeat_interval_s", "heartbeat_misses", "require_vouch"}
# The keys of each section this module checks: what it refuses beyond them, and what
# [future.<section>] may stage for it.
SECTION_KEYS: dict[str, set[str]] = {
    "cluster": _TIMING_KEYS
    | {"retention", "launch_deadline", "quota", "quarantine_after", "quarantine_window", "ended_jobs_kept"},
    "job": _TIMING_KEYS
    | {"id", "slots_per_node", "node_order", "topology_policy", "join_token", "lost_node_timeout_s", "mode"},
    "server": {"listen", "max_pending_requests", "metrics_listen", "log_format", "admin_token_file"} | set(TLS_KEYS),
    "keys": {"dir"},
    "store": {"kind", "dir", "endpoints", "lease_ttl_s", "advertise"},
}


def _staged(document: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    return staged(document, name, SECTION_KEYS[name].__contains__, ConfigError)


def _table(document: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = document.get(name, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"[{name}] must be a table, got {type(value).__name__}")
    return value


def _refuse_unknown(name: str, table: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(f"[{name}] unknown key(s) {unknown}; known: {sorted(allowed)}")
