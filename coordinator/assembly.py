"""The coordinator daemon, built from its config in one place.

``serve(config)`` is the daemon: ``meshgate-coordinator`` (coordinator/__main__.py) runs it,
and so does the benchmark's coordinator (bench/servers.py), so what the bench measures is
what operators run. It builds, in this order:

1. the signing keys and their trust bundle (the store's high-water marks live beside them);
2. the coordinator slot the servicers read (empty until a term starts: every call is then
   answered UNAVAILABLE, naming the leader if one is known);
3. the access policy ([server] TLS and admin token) and the grpc.aio server with its
   servicers, health and reflection, bound plaintext, TLS or mTLS on [server] listen;
4. the operator endpoints (health checks, /metrics);
5. the term loop the store needs: one term for SQLite and memory
   (leadership.serve_embedded), elections and standby for etcd (leadership.serve_ha).

This module is the one place that asks which kind of store a config names; the term
loops and everything they build are the same for every config.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import grpc

from meshgate.coordinator.config import ConfigError, CoordinatorConfig
from meshgate.coordinator.health import Operations
from meshgate.coordinator.keys import KeyRing
from meshgate.coordinator.leadership import StateRefused, etcd_reset, serve_embedded, serve_ha
from meshgate.coordinator.service import AccessPolicy, CoordinatorSlot, build_server, mark_not_serving
from meshgate.coordinator.store import StoreError
from meshgate.coordinator.store.codec import NEWER_STATE
from meshgate.endpoints import join_host_port, split_host_port
from meshgate.tls import server_credentials, warn_insecure

log = logging.getLogger("meshgate.coordinator")


@dataclass
class Daemon:
    """A coordinator daemon, built and bound but not yet started (``build``)."""

    config: CoordinatorConfig
    keys: KeyRing
    bundle_path: Path  # the trust bundle workers verify attestations against
    slot: CoordinatorSlot  # what the servicers serve; filled while a term runs
    server: grpc.aio.Server
    health_servicer: object
    port: int  # the port bound ([server] listen may ask for 0)

    @property
    def address(self) -> str:
        """HOST:PORT, the host of [server] listen and the port bound."""
        listen = self.config.listen
        if listen.startswith("unix:"):
            return listen
        return join_host_port(split_host_port(listen, "[server] listen", listen=True)[0], self.port)


def access_policy(config: CoordinatorConfig) -> AccessPolicy:
    """Under mTLS the callers' certificate roles are checked; the admin token admits Admin calls."""
    return AccessPolicy(
        secure=config.tls is not None and config.tls.require_client_cert,
        admin_token_hash=config.admin_token_hash,
    )


def build(config: CoordinatorConfig) -> Daemon:
    """Keys, slot, access policy and the server with its servicers, bound on [server] listen."""
    keys = KeyRing(config.keys_dir)  # the cluster's keys and trust bundle: attestations name their job
    bundle_path = keys.write_bundle()
    slot = CoordinatorSlot()
    server, health_servicer = build_server(
        slot,
        policy=access_policy(config),
        max_await_s=config.max_await_s,
        max_pending_requests=config.max_pending_requests,
        launch=config.launch,
        heartbeat_interval_s=config.heartbeat_interval_s,
    )
    return Daemon(config, keys, bundle_path, slot, server, health_servicer, _bind(server, config))


def _bind(server: grpc.aio.Server, config: CoordinatorConfig) -> int:
    """Bind [server] listen: mTLS, or (loudly) TLS without client certificates or plaintext."""
    if config.tls is None:
        warn_insecure(log, f"coordinator on {config.listen}: anyone who can reach it can register")
    elif not config.tls.require_client_cert:
        log.warning(
            "INSECURE: coordinator on %s serves TLS WITHOUT client certificates "
            "(require_client_cert = false, insecure = true): no caller is authenticated; anyone "
            "who can reach it can join as a node, register and call Admin RPCs. Development only.",
            config.listen,
        )
    try:
        if config.tls is None:
            port = server.add_insecure_port(config.listen)
        else:
            port = server.add_secure_port(config.listen, server_credentials(config.tls))
    except RuntimeError:  # grpc's "Failed to bind": in use, or not an address of this host
        port = 0
    if port == 0:
        raise ConfigError(f"[server] listen: cannot bind {config.listen!r} (in use, or not an address of this host)")
    return port


def _until_signalled() -> asyncio.Event:
    """An event SIGTERM or SIGINT sets: the daemon then drains and stops."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def serve(
    config: CoordinatorConfig,
    port_file: Optional[Path] = None,
    config_path: Path = Path("?"),
    *,
    stop: Optional[asyncio.Event] = None,
    on_serving: Optional[Callable[[Daemon], None]] = None,
) -> None:
    """Build the daemon and serve until ``stop`` (default: SIGTERM or SIGINT).

    ``port_file``: HOST:PORT is written there once the store answered (for etcd: once the
    leader is known, so that a standby names it from its first answer). ``on_serving`` is
    called once, when the first term starts serving (the slot holds its coordinator)."""
    stop = stop if stop is not None else _until_signalled()
    daemon = build(config)
    server = daemon.server
    # Metrics first: a config they refuse (prometheus-client missing, a port taken) stops the
    # daemon before it serves, so the reason is the last thing it says, not "draining".
    # Health follows the slot from here on: NOT_SERVING while standing by or stepped down.
    operations = Operations(daemon.slot, daemon.health_servicer, metrics_listen=config.metrics_listen)
    try:
        await server.start()
    except BaseException:
        operations.close()
        raise
    try:
        await mark_not_serving(daemon.health_servicer)

        def connected() -> None:
            if port_file is not None and not port_file.exists():
                tmp = port_file.with_suffix(".tmp")
                tmp.write_text(f"{daemon.address}\n")
                tmp.replace(port_file)

        await operations.start()
        health_update = _announcing(operations.monitor.update, daemon, on_serving)
        log.info("listening on %s; trust bundle %s", daemon.address, daemon.bundle_path)
        if config.store_kind == "etcd":
            await serve_ha(config, daemon.slot, daemon.keys, stop, daemon.address, connected, health_update)
        else:
            await serve_embedded(config, daemon.slot, daemon.keys, stop, connected, health_update)
    except StateRefused as exc:
        raise _refused(config, exc, config_path) from None
    finally:
        log.info("stopping: draining in-flight RPCs")
        operations.close()
        await server.stop(grace=5 if stop.is_set() else 0)


def _announcing(update, daemon: Daemon, on_serving: Optional[Callable[[Daemon], None]]):
    """The term loop's health update, which also tells ``on_serving`` (once) that a term serves."""
    if on_serving is None:
        return update
    told = False

    async def update_and_announce():
        nonlocal told
        result = await update()
        if not told and daemon.slot.coordinator is not None:
            told = True
            on_serving(daemon)
        return result

    return update_and_announce


def _refused(config: CoordinatorConfig, exc: StoreError, config_path: Path) -> StoreError:
    """A refused state, with how to start afresh on purpose for the store the config names;
    a newer release's state names the way back instead (its message), never a reset."""
    if NEWER_STATE in str(exc):
        return StoreError(f"refusing the state, left as found: {exc}")
    if config.store_kind == "etcd":
        how = etcd_reset(config)
    else:
        how = (
            f"meshgate-coordinator --config {config_path} --reset-state (moves the files aside, keeps them; "
            "starts with a new signing key)"
        )
    return StoreError(f"refusing the job's state, left as found: {exc}. To start this job afresh deliberately: {how}")


__all__ = ["Daemon", "access_policy", "build", "serve"]
