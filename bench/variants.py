"""How the coordinator under test is deployed: a variant is its store and its transport.

``memory+plaintext`` is the lightest coordinator there is (the in-memory store, no TLS).
``sqlite+mtls`` is the daemon's defaults: the SQLite store (group commit, fsync, the
durable high-water mark) and mTLS with real certificates from a dev CA
(meshgate.tls.init_dev_ca, what ``meshgate certs init`` writes). ``sqlite+plaintext``
and ``memory+mtls`` are accepted too, to tell the two costs apart.

Every server of a variant is configured the way the daemon is: a coordinator.toml
(write_config) that the server reads with the daemon's own parser
(CoordinatorConfig.load). Vouches: under mTLS the daemon requires one per Register
(``require_vouch``, its default unless insecure), and agents sign them, so a world served
through agents (section 5) in an mTLS variant carries them and the coordinator checks
each one. Workers without agents (sections 1-3) cannot get one: there the config says
``require_vouch = false``, as a deployment without agents must.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from meshgate.tls import ROLE_AGENT, DevCA, TLSConfig, init_dev_ca, issue_cert

from bench.common import JOB, SLOTS_PER_NODE, plan_for

STORES = ("memory", "sqlite")
TRANSPORTS = ("plaintext", "mtls")
CONFIG_NAME = "coordinator.toml"
TLS_DIR = "tls"


@dataclass(frozen=True)
class Variant:
    store: str  # [store] kind
    mtls: bool  # mTLS with the dev CA's certificates, else plaintext

    @property
    def name(self) -> str:
        return f"{self.store}+{'mtls' if self.mtls else 'plaintext'}"

    @property
    def description(self) -> str:
        store = (
            "the SQLite store (group commit, fsync, durable mark)" if self.store == "sqlite" else "the in-memory store"
        )
        return f"{store}, {'mTLS with real certificates' if self.mtls else 'plaintext'}"

    def requires_vouch(self, agents: bool) -> bool:
        """The daemon's default (a vouch per Register under TLS), where agents can give one."""
        return self.mtls and agents

    @classmethod
    def parse(cls, name: str) -> "Variant":
        store, _, transport = name.strip().partition("+")
        if store not in STORES or transport not in TRANSPORTS:
            raise ValueError(
                f"variant {name!r}: want STORE+TRANSPORT, STORE one of {STORES}, TRANSPORT one of {TRANSPORTS}"
            )
        return cls(store, transport == "mtls")


MEMORY_PLAINTEXT = Variant("memory", False)
SQLITE_MTLS = Variant("sqlite", True)
DEFAULT_VARIANTS = (MEMORY_PLAINTEXT, SQLITE_MTLS)


def parse_variants(text: str) -> list[Variant]:
    variants = [Variant.parse(name) for name in text.split(",") if name.strip()]
    if not variants or len(set(variants)) != len(variants):
        raise ValueError(f"--variants {text!r}: name each variant once")
    return variants


@dataclass(frozen=True)
class Deployment:
    """One server's files: its coordinator.toml and, under mTLS, its dev CA; and the world
    that config serves (``world`` workers, ``slots`` per node: bench.common.plan_for)."""

    config_path: Path
    ca: Optional[DevCA]  # None: plaintext
    world: int
    slots: int

    def worker_tls(self) -> Optional[TLSConfig]:
        """A worker's client settings: the CA and the worker certificate (OU=worker), as
        an agent hands them to the workers it launches (MESHGATE_TLS_CERT/KEY)."""
        return None if self.ca is None else self.ca.client_tls(self.ca.worker)

    def admin_tls(self) -> Optional[TLSConfig]:
        """The operator's: an admin certificate mints the nodes' join tokens."""
        return None if self.ca is None else self.ca.client_tls(self.ca.admin)

    def agent_tls(self, node: str) -> Optional[TLSConfig]:
        """A new agent certificate naming ``node`` (what `meshgate certs issue --role agent
        --node-id NODE` writes): under mTLS each Nodes call must come from it."""
        if self.ca is None:
            return None
        return self.ca.client_tls(issue_cert(self.ca.directory, ROLE_AGENT, node))


def write_config(directory: Path, world: int, slots: int, variant: Variant, agents: bool = False) -> Deployment:
    """The daemon config that serves the bench's job in ``variant`` (the shape of
    deploy/systemd/coordinator.toml with a [job] and a [plan]), and the CA it names.
    ``agents``: the workers come through agents, which vouch for them (under mTLS)."""
    plan = plan_for(world, slots)
    declared = {
        # No liveness sweeps during a run (nothing here heartbeats).
        "job": {
            "id": JOB,
            "slots_per_node": slots,
            "require_vouch": variant.requires_vouch(agents),
            "heartbeat_interval_s": 3600,
        },
        "plan": {k: v for k, v in plan.to_dict().items() if k != "order"},
    }
    return _write(directory, variant, declared, world, slots)


def write_cluster_config(directory: Path, variant: Variant, heartbeat_interval_s: float, misses: int) -> Deployment:
    """A jobs-mode daemon config (no [job]: jobs come by SubmitJob) in ``variant``, with the
    daemon's default vouches (required under TLS) and the agents' heartbeat interval."""
    cluster = {"cluster": {"heartbeat_interval_s": heartbeat_interval_s, "heartbeat_misses": misses}}
    return _write(directory, variant, cluster, 0, SLOTS_PER_NODE)


def _write(directory: Path, variant: Variant, tables: dict, world: int, slots: int) -> Deployment:
    directory.mkdir(parents=True, exist_ok=True)
    # A coordinator certificate for 127.0.0.1, a worker and an admin certificate; agent
    # certificates are issued one per node as agents need them (Deployment.agent_tls).
    ca = init_dev_ca(directory / TLS_DIR, hosts=("127.0.0.1",), agent_names=()) if variant.mtls else None
    document = {
        **tables,
        "server": {"listen": "127.0.0.1:0", **_transport(ca)},
        "keys": {"dir": "keys"},
        "store": {"kind": variant.store, "dir": "state"},
    }
    path = directory / CONFIG_NAME
    path.write_text(toml_text(document))
    return Deployment(path, ca, world, slots)


def _transport(ca: Optional[DevCA]) -> dict:
    """[server]'s transport keys: mTLS with the CA's coordinator certificate, or plaintext."""
    if ca is None:
        return {"insecure": True}  # the daemon then warns loudly, as it should
    return {
        "ca_file": str(ca.ca),
        "cert_file": str(ca.server.cert),
        "key_file": str(ca.server.key),
        "require_client_cert": True,
    }


def toml_text(document: Mapping[str, Mapping[str, object]]) -> str:
    """TOML for tables of strings, numbers, booleans and inline tables (all the configs here need)."""
    lines = []
    for name, table in document.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


def _toml_value(value: object) -> str:
    if isinstance(value, Mapping):  # an inline table (an agent's labels)
        return "{" + ", ".join(f"{key} = {_toml_value(v)}" for key, v in value.items()) + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a TOML basic string
