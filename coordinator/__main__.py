"""meshgate-coordinator --config FILE: serve one job's rendezvous."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from meshgate.coordinator.config import ConfigError, CoordinatorConfig
from meshgate.coordinator.engine import Coordinator
from meshgate.coordinator.health import Operations
from meshgate.coordinator.keys import KeyRing
from meshgate.coordinator.service import (
    AccessPolicy,
    CoordinatorSlot,
    build_server,
    mark_not_serving,
    mark_serving,
)
from meshgate.coordinator.store import StoreError, open_store
from meshgate import logs
from meshgate.attestation import KeyFileError
from meshgate.secret_files import SecretFileError
from meshgate.tls import TLSError, server_credentials, warn_insecure

log = logging.getLogger("meshgate.coordinator")


async def _connect_store(config: CoordinatorConfig, slot: CoordinatorSlot, address: str):
    """Open the store; for etcd, connect and learn the current leader, so that a
    standby names it from its very first answer."""
    job_id = config.rendezvous.job_id
    if config.store_kind != "etcd":
        return open_store(config.store_kind, state_dir=config.state_dir, job_id=job_id)
    from meshgate.coordinator.store.etcd import EtcdStore

    store = EtcdStore(config.etcd_endpoints, job_id, config.advertise or address, config.lease_ttl_s)
    await store.connect()
    slot.leader_hint = await store.current_leader()
    return store


async def _lead(config: CoordinatorConfig, slot: CoordinatorSlot, store, stop: asyncio.Event):
    """The store, once this process may write it: at once for sqlite and memory; for
    etcd only after winning the election (until then the server answers as a standby)."""
    if not hasattr(store, "campaign"):
        return store
    job_id = config.rendezvous.job_id

    async def follow_leader() -> None:
        while True:
            slot.leader_hint = await store.current_leader()
            await asyncio.sleep(max(config.lease_ttl_s / 4, 0.2))

    follower = asyncio.create_task(follow_leader())
    try:
        log.info("standby for job %s; leader is %s", job_id, await store.current_leader() or "none yet")
        if not await store.campaign(stop):
            return None
    finally:
        follower.cancel()
    return store


async def serve(config: CoordinatorConfig, port_file: Path | None = None) -> None:
    keys = KeyRing(config.keys_dir, job_id=config.rendezvous.job_id)
    bundle_path = keys.write_bundle()
    stop = asyncio.Event()
    failure: list[BaseException] = []
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def store_failed(exc: BaseException) -> None:
        failure.append(exc)
        stop.set()

    slot = CoordinatorSlot()
    policy = AccessPolicy(
        secure=config.tls is not None and config.tls.require_client_cert,
        admin_token_hash=config.admin_token_hash,
    )
    server, health_servicer = build_server(
        slot,
        policy=policy,
        max_await_s=config.max_await_s,
        max_pending_requests=config.max_pending_requests,
        launch=config.launch,
        heartbeat_interval_s=config.heartbeat_interval_s,
    )
    if config.tls is None:
        warn_insecure(log, f"coordinator on {config.listen}: anyone who can reach it can register")
        port = server.add_insecure_port(config.listen)
    elif not config.tls.require_client_cert:
        log.warning(
            "INSECURE: coordinator on %s serves TLS WITHOUT client certificates "
            "(require_client_cert = false, insecure = true): no caller is authenticated; anyone "
            "who can reach it can join as a node, register and call Admin RPCs. Development only.",
            config.listen,
        )
        port = server.add_secure_port(config.listen, server_credentials(config.tls))
    else:
        port = server.add_secure_port(config.listen, server_credentials(config.tls))
    if port == 0:
        raise ConfigError(f"[server] listen: cannot bind {config.listen!r}")
    await server.start()
    await mark_not_serving(health_servicer)
    host = config.listen.rsplit(":", 1)[0]
    address = f"{host}:{port}"
    connected = await _connect_store(config, slot, address)
    if port_file is not None:
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(f"{address}\n")
        tmp.replace(port_file)

    store = await _lead(config, slot, connected, stop)
    if store is None:  # stopped while standing by
        await server.stop(grace=1)
        return
    lost_leadership = getattr(store, "lost_leadership", None)
    coordinator = Coordinator(
        config.rendezvous,
        store,
        keys,
        attestation_ttl_s=config.attestation_ttl_s,
        heartbeat_timeout_s=config.heartbeat_timeout_s,
        on_store_failure=store_failed,
    )
    slot.coordinator = coordinator
    operations = Operations(coordinator, health_servicer, metrics_listen=config.metrics_listen)
    await mark_serving(health_servicer)
    await operations.start()  # health follows the store and keys from here on
    log.info(
        "serving job %s (%s) on %s; trust bundle %s",
        config.rendezvous.job_id, config.rendezvous.plan.describe(), address, bundle_path,
    )
    sweeper = asyncio.create_task(coordinator.run_sweeper(config.heartbeat_interval_s / 2))
    watchers = [asyncio.create_task(stop.wait())]
    if lost_leadership is not None:
        watchers.append(asyncio.create_task(lost_leadership.wait()))
    await asyncio.wait(watchers, return_when=asyncio.FIRST_COMPLETED)
    for watcher in watchers:
        watcher.cancel()
    if lost_leadership is not None and lost_leadership.is_set():
        failure.append(StoreError("lost the etcd leadership"))
    log.info("stopping: draining in-flight RPCs")
    sweeper.cancel()
    operations.close()
    await server.stop(grace=0 if failure else 5)
    if hasattr(store, "aclose"):
        await store.aclose()
    store.close()
    if failure:
        raise StoreError(f"stopped after a store failure: {failure[0]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshgate-coordinator", description=__doc__)
    parser.add_argument("--config", required=True, type=Path, help="coordinator TOML file")
    parser.add_argument("--listen", help="override [server] listen, e.g. 127.0.0.1:0")
    parser.add_argument("--port-file", type=Path, help="write HOST:PORT here once serving")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", choices=logs.FORMATS, help="override [server] log_format")
    args = parser.parse_args(argv)
    logs.setup(args.log_level, args.log_format or "text")
    try:
        config = CoordinatorConfig.load(args.config)
        logs.add_secret(config.rendezvous.join_token)
        if (args.log_format or config.log_format) != "text":
            logs.setup(args.log_level, args.log_format or config.log_format)
        if args.listen:
            config = type(config)(**{**config.__dict__, "listen": args.listen})
        asyncio.run(serve(config, args.port_file))
    except (ConfigError, KeyFileError, SecretFileError, StoreError, TLSError) as exc:
        log.error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
