"""The two servers under test, each in its own process.

``python -m bench.servers coordinator --world N --dir D [--store memory|sqlite] [--tls]``:
the real coordinator, built as ``meshgate-coordinator`` builds it from the coordinator.toml
written to D (bench.variants.write_config, read with the daemon's own parser): the store
the config names, opened with the daemon's helpers (its pin and durable high-water mark
for SQLite), a KeyRing in D/keys, meshgate.coordinator.service.build_server with the
daemon's AccessPolicy, bound plaintext or mTLS (a dev CA in D/tls) as the config says.

``python -m bench.servers echo --world N --dir D [--tls]``: the physical limit. A bare
grpc.aio server with one generic handler (bytes in, bytes out: no stubs, no protoc) that
answers every call with the same bytes: one real RegisterResponse for a world of N,
signed by a KeyRing in D, so the client harness can parse and verify it exactly as it
verifies the coordinator's answers. Same grpc.aio server options as build_server, and
the same transport as the coordinator of its variant (mTLS: the same kind of
certificates, the same handshake).

Each prints one JSON line on stdout once serving ({"port", "pid", "client_tls", ...})
and serves until SIGTERM. ServerProcess is the parent's handle on such a process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from meshgate.tls import TLSConfig, secure_channel, server_credentials

from bench.common import (
    ECHO_METHOD,
    ECHO_NONCE,
    ECHO_SERVICE,
    SERVER_OPTIONS,
    SLOTS_PER_NODE,
    TRUST_METHOD,
    proc_cpu_s,
    proc_status,
    register_request,
)
from bench.variants import MEMORY_PLAINTEXT, Deployment, Variant, write_config

REPO = Path(__file__).resolve().parent.parent
# Set to a path, the server profiles itself with pyinstrument and writes collapsed stacks
# there on exit (bench.profile uses this where py-spy is not installed).
PYINSTRUMENT_ENV = "BENCH_PYINSTRUMENT"


def _keys(config):
    """The signing keys and their trust bundle; made first, as the daemon makes them: the
    store's high-water mark lives beside them."""
    from meshgate.coordinator.keys import KeyRing

    keys = KeyRing(config.keys_dir)  # the cluster's, as the daemon's
    keys.write_bundle()
    return keys


def _coordinator(config, keys, store):
    """The daemon's single-job Coordinator (leadership.serve_term builds the same)."""
    from meshgate.coordinator.engine import Coordinator

    return Coordinator(config.rendezvous, store, keys, attestation_ttl_s=config.attestation_ttl_s,
                       heartbeat_timeout_s=config.heartbeat_timeout_s)


def _open_store(config):
    """The declared job's log, opened as the daemon opens it (leadership.job_store_opener):
    for SQLite under jobs/<id>/ with the job's pin and its durable high-water mark beside the keys."""
    from meshgate.coordinator.leadership import job_store_opener

    return job_store_opener(config)(config.rendezvous)


def _bind(server, config) -> int:
    """Bind the config's listen address as the daemon does: mTLS or plaintext."""
    if config.tls is None:
        return server.add_insecure_port(config.listen)
    return server.add_secure_port(config.listen, server_credentials(config.tls))


def _client_tls(deployment: Deployment) -> dict:
    """The worker's TLS settings as a TOML-style table (TLSConfig.from_mapping reads it
    back; ``insecure = true`` for plaintext)."""
    tls = deployment.worker_tls()
    if tls is None:
        return {"insecure": True}
    return {"ca_file": str(tls.ca_file), "cert_file": str(tls.cert_file), "key_file": str(tls.key_file)}


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def _announce(**fields) -> None:
    sys.stdout.write(json.dumps({"pid": os.getpid(), **fields}) + "\n")
    sys.stdout.flush()


async def serve_coordinator(deployment: Deployment) -> None:
    from meshgate.coordinator.config import CoordinatorConfig
    from meshgate.coordinator.service import AccessPolicy, build_server, mark_serving

    config = CoordinatorConfig.load(deployment.config_path)
    keys = _keys(config)
    store = _open_store(config)
    coordinator = _coordinator(config, keys, store)
    # What coordinator/__main__.serve builds: under mTLS the agent and admin roles are checked.
    policy = AccessPolicy(secure=config.tls is not None and config.tls.require_client_cert,
                          admin_token_hash=config.admin_token_hash)
    server, health_servicer = build_server(
        coordinator, policy=policy, max_await_s=config.max_await_s,
        max_pending_requests=config.max_pending_requests, launch=config.launch,
        heartbeat_interval_s=config.heartbeat_interval_s,
    )
    port = _bind(server, config)
    await server.start()
    await mark_serving(health_servicer)
    _announce(
        kind="coordinator",
        port=port,
        world=config.rendezvous.plan.world_size,
        bundle=str(coordinator.keys.bundle_path),
        client_tls=_client_tls(deployment),
        probe_method=TRUST_METHOD,
    )
    await _until_signalled()
    await server.stop(None)
    store.close()


async def sample_response(config) -> tuple[bytes, bytes, Path]:
    """One real (request, RegisterResponse) pair for a worker in the middle of the world."""
    from meshgate.coordinator.service import register_input
    from meshgate.coordinator.store import MemoryStore
    from meshgate.v1 import rendezvous_pb2

    coordinator = _coordinator(config, _keys(config), MemoryStore())  # to sign it: the echo stores nothing
    world, slots = config.rendezvous.plan.world_size, config.rendezvous.slots_per_node
    i = world // 2 + slots // 2
    request = register_request(i, ECHO_NONCE, coordinator.config.plan.digest(), slots)
    signed, secret = await coordinator.register(register_input(request))
    response = rendezvous_pb2.RegisterResponse(attestation=signed, heartbeat_secret=secret)
    return request.SerializeToString(), response.SerializeToString(), coordinator.keys.bundle_path


async def serve_echo(deployment: Deployment) -> None:
    import grpc

    from meshgate.coordinator.config import CoordinatorConfig

    config = CoordinatorConfig.load(deployment.config_path)
    request, response, bundle = await sample_response(config)

    async def call(_request: bytes, _context) -> bytes:
        return response

    # No serializers: the handler sees and returns raw bytes.
    handler = grpc.method_handlers_generic_handler(
        ECHO_SERVICE, {"Call": grpc.unary_unary_rpc_method_handler(call)}
    )
    server = grpc.aio.server(options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = _bind(server, config)
    await server.start()
    _announce(
        kind="echo",
        port=port,
        world=config.rendezvous.plan.world_size,
        bundle=str(bundle),
        method=ECHO_METHOD,
        request_bytes=len(request),
        response_bytes=len(response),
        client_tls=_client_tls(deployment),
        probe_method=ECHO_METHOD,
    )
    await _until_signalled()
    await server.stop(None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.servers")
    parser.add_argument("kind", choices=("coordinator", "echo"))
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--slots", type=int, default=SLOTS_PER_NODE)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--store", choices=("memory", "sqlite"), default="memory",
                        help="the coordinator's [store] kind (the echo server stores nothing)")
    parser.add_argument("--tls", action="store_true", help="mTLS with a dev CA in DIR/tls, else plaintext")
    args = parser.parse_args(argv)
    # What the daemon does (coordinator/__main__.py): INFO to stderr.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.dir.mkdir(parents=True, exist_ok=True)
    deployment = write_config(args.dir, args.world, args.slots, Variant(args.store, args.tls))
    serve = serve_coordinator if args.kind == "coordinator" else serve_echo
    profile_to = os.environ.get(PYINSTRUMENT_ENV)
    if not profile_to:
        asyncio.run(serve(deployment))
        return 0
    # The fallback profiler (bench/profile.py): pyinstrument in process, main thread only.
    from pyinstrument import Profiler

    import meshgate.coordinator.engine  # noqa: F401 - imported before the profile starts
    import meshgate.coordinator.service  # noqa: F401

    profiler = Profiler(interval=0.001, async_mode="disabled")
    profiler.start()
    try:
        asyncio.run(serve(deployment))
    finally:
        from bench.profile import write_collapsed

        write_collapsed(profiler.stop(), Path(profile_to))
    return 0


# ---- the parent's handle -------------------------------------------------------------------


def transport_check(address: str, client_tls: Optional[TLSConfig], method: str) -> dict[str, str]:
    """What the server at ``address`` answers ("OK", or the status code) to a plaintext
    client and, when it serves TLS, to a TLS client without a certificate and to a worker
    with one: proof, from outside, of the transport that served a run."""
    clients: dict[str, Optional[TLSConfig]] = {"plaintext": None}
    if client_tls is not None:
        clients["TLS, no client certificate"] = TLSConfig(client_tls.ca_file)
        clients["mTLS, worker certificate"] = client_tls
    return {name: _probe(address, tls, method) for name, tls in clients.items()}


def _probe(address: str, tls: Optional[TLSConfig], method: str) -> str:
    """One call of ``method`` with an empty request (raw bytes, no stubs) over ``tls``."""
    import grpc

    with secure_channel(address, tls) as channel:
        try:
            channel.unary_unary(method)(b"", timeout=10)
        except grpc.RpcError as exc:
            return exc.code().name
    return "OK"


class ServerProcess:
    """A server started with ``python -m bench.servers``; a context manager. ``client_tls``
    is what a worker presents to it (None: plaintext); ``transport`` what it answered to
    each kind of client right after it started."""

    def __init__(self, kind: str, world: int, directory: Path, variant: Variant = MEMORY_PLAINTEXT,
                 slots: int = SLOTS_PER_NODE, start_timeout: float = 60.0,
                 env_extra: dict | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.kind = kind
        self.log_path = directory / f"{kind}.log"
        env = dict(os.environ)
        env.update(env_extra or {})
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "bench.servers", kind, "--world", str(world),
                 "--slots", str(slots), "--dir", str(directory), "--store", variant.store,
                 *(["--tls"] if variant.mtls else [])],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log,
            )
        self.info = self._read_announcement(start_timeout)
        self.pid: int = self.process.pid
        self.address = f"127.0.0.1:{self.info['port']}"
        self.bundle_path = self.info["bundle"]
        self.client_tls = TLSConfig.from_mapping(self.info["client_tls"], section="client_tls")
        self.transport = transport_check(self.address, self.client_tls, self.info["probe_method"])

    def _read_announcement(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        assert self.process.stdout is not None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.process.stdout], [], [], 0.1)
            if ready:
                line = self.process.stdout.readline()
                if line:
                    return json.loads(line)
            if self.process.poll() is not None:
                break
        self.stop()
        raise RuntimeError(
            f"{self.kind} server did not start in {timeout:g}s:\n{self.log_path.read_text()}"
        )

    def status(self) -> dict[str, int]:
        return proc_status(self.pid)

    def cpu_s(self) -> float:
        return proc_cpu_s(self.pid)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    sys.exit(main())
