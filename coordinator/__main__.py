"""meshgate-coordinator --config FILE: serve one job's rendezvous."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from coordinator.config import ConfigError, CoordinatorConfig
from coordinator.engine import Coordinator
from coordinator.keys import KeyRing
from coordinator.service import build_server, mark_serving
from coordinator.store import StoreError, open_store
from meshgate.attestation import KeyFileError

log = logging.getLogger("meshgate.coordinator")


async def serve(config: CoordinatorConfig, port_file: Path | None = None) -> None:
    keys = KeyRing(config.keys_dir, job_id=config.rendezvous.job_id)
    bundle_path = keys.write_bundle()
    store = open_store(config.store_kind, state_dir=config.state_dir, job_id=config.rendezvous.job_id)
    stop = asyncio.Event()
    failure: list[BaseException] = []

    def store_failed(exc: BaseException) -> None:
        failure.append(exc)
        stop.set()

    coordinator = Coordinator(
        config.rendezvous,
        store,
        keys,
        attestation_ttl_s=config.attestation_ttl_s,
        heartbeat_timeout_s=config.heartbeat_timeout_s,
        on_store_failure=store_failed,
    )
    server, health_servicer = build_server(
        coordinator,
        max_await_s=config.max_await_s,
        max_pending_requests=config.max_pending_requests,
        launch=config.launch,
        heartbeat_interval_s=config.heartbeat_interval_s,
    )
    if not config.insecure:
        raise ConfigError(
            "TLS is not configured yet; set [server] insecure = true to serve plaintext"
        )
    log.warning(
        "INSECURE: serving plaintext gRPC on %s; anyone who can reach it can register",
        config.listen,
    )
    port = server.add_insecure_port(config.listen)
    if port == 0:
        raise ConfigError(f"[server] listen: cannot bind {config.listen!r}")
    await server.start()
    await mark_serving(health_servicer)
    host = config.listen.rsplit(":", 1)[0]
    address = f"{host}:{port}"
    log.info(
        "serving job %s (%s) on %s; trust bundle %s",
        config.rendezvous.job_id, config.rendezvous.plan.describe(), address, bundle_path,
    )
    if port_file is not None:
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(f"{address}\n")
        tmp.replace(port_file)

    sweeper = asyncio.create_task(coordinator.run_sweeper(config.heartbeat_interval_s / 2))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping: draining in-flight RPCs")
    sweeper.cancel()
    await server.stop(grace=0 if failure else 5)
    store.close()
    if failure:
        raise StoreError(f"stopped after a store failure: {failure[0]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshgate-coordinator", description=__doc__)
    parser.add_argument("--config", required=True, type=Path, help="coordinator TOML file")
    parser.add_argument("--listen", help="override [server] listen, e.g. 127.0.0.1:0")
    parser.add_argument("--port-file", type=Path, help="write HOST:PORT here once serving")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = CoordinatorConfig.load(args.config)
        if args.listen:
            config = type(config)(**{**config.__dict__, "listen": args.listen})
        asyncio.run(serve(config, args.port_file))
    except (ConfigError, KeyFileError, StoreError) as exc:
        log.error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
