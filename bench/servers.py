"""The two servers under test, each in its own process.

``python -m bench.servers coordinator --world N --dir D [--store memory|sqlite] [--tls]``:
the real coordinator: the daemon's own assembly (meshgate.coordinator.assembly.serve,
what ``meshgate-coordinator`` runs) from the coordinator.toml written to D
(bench.variants.write_config, read with the daemon's own parser): the store the config
names, its keys in D/keys, its access policy, servicers and health, bound plaintext or
mTLS (a dev CA in D/tls) as the config says. It announces itself once it serves.

``python -m bench.servers echo --world N --dir D [--tls]``: the physical limit. A bare
grpc.aio server with one generic handler (bytes in, bytes out: no stubs, no protoc) that
answers every call with the same bytes: one real RegisterResponse for a world of N,
answered by the daemon (on the in-memory store) before the echo starts and signed by its
keys in D, so the client harness can parse and verify it exactly as it
verifies the coordinator's answers. Same grpc.aio server options as build_server, and
the same transport as the coordinator of its variant (mTLS: the same kind of
certificates, the same handshake).

Each prints one JSON line on stdout once serving ({"port", "pid", "client_tls", ...})
and serves until SIGTERM. ServerProcess is the parent's handle on such a process.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import replace
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
    plan_for,
    proc_cpu_s,
    proc_status,
    register_request,
)
from bench.variants import MEMORY_PLAINTEXT, Deployment, Variant, write_config

REPO = Path(__file__).resolve().parent.parent
# Set to a path, the server profiles itself with pyinstrument and writes collapsed stacks
# there on exit (bench.profile uses this where py-spy is not installed).
PYINSTRUMENT_ENV = "BENCH_PYINSTRUMENT"


def _bind(server, config) -> int:
    """Bind the config's listen address as the daemon binds its own: mTLS or plaintext."""
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
    """The daemon itself (meshgate.coordinator.assembly.serve), announced once it serves."""
    from meshgate.coordinator import assembly
    from meshgate.coordinator.config import CoordinatorConfig

    def announce(daemon) -> None:
        _announce(
            kind="coordinator",
            port=daemon.port,
            world=deployment.world,
            bundle=str(daemon.bundle_path),
            client_tls=_client_tls(deployment),
            probe_method=TRUST_METHOD,
        )

    await assembly.serve(CoordinatorConfig.load(deployment.config_path), on_serving=announce)


async def sample_response(deployment: Deployment) -> tuple[bytes, bytes, Path]:
    """One real (request, RegisterResponse) pair for a worker in the middle of the world,
    answered by the daemon itself (assembly.serve, on the in-memory store and a port of its
    own, stopped again before the echo serves) and signed by its keys in D/keys."""
    from meshgate.coordinator import assembly
    from meshgate.coordinator.config import CoordinatorConfig

    config = replace(CoordinatorConfig.load(deployment.config_path), store_kind="memory", listen="127.0.0.1:0")
    stop = asyncio.Event()
    serving: asyncio.Future = asyncio.get_running_loop().create_future()
    daemon = asyncio.create_task(assembly.serve(config, stop=stop, on_serving=serving.set_result))
    try:
        await asyncio.wait({daemon, serving}, return_when=asyncio.FIRST_COMPLETED)
        if not serving.done():
            daemon.result()  # raises what stopped it
            raise RuntimeError("the coordinator ended before it served")
        world, slots = deployment.world, deployment.slots
        i = world // 2 + slots // 2
        request = register_request(i, ECHO_NONCE, plan_for(world, slots).digest(), slots)
        response = await asyncio.to_thread(_register, serving.result().address, deployment.worker_tls(), request)
        return request.SerializeToString(), response.SerializeToString(), serving.result().bundle_path
    finally:
        stop.set()
        await daemon


def _register(address: str, tls: Optional[TLSConfig], request):
    from meshgate.v1 import rendezvous_pb2_grpc

    with secure_channel(address, tls) as channel:
        return rendezvous_pb2_grpc.RendezvousStub(channel).Register(request, timeout=60)


async def serve_echo(deployment: Deployment) -> None:
    import grpc

    from meshgate.coordinator.config import CoordinatorConfig

    config = CoordinatorConfig.load(deployment.config_path)
    request, response, bundle = await sample_response(deployment)

    async def call(_request: bytes, _context) -> bytes:
        return response

    # No serializers: the handler sees and returns raw bytes.
    handler = grpc.method_handlers_generic_handler(ECHO_SERVICE, {"Call": grpc.unary_unary_rpc_method_handler(call)})
    server = grpc.aio.server(options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = _bind(server, config)
    await server.start()
    _announce(
        kind="echo",
        port=port,
        world=deployment.world,
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
    parser.add_argument(
        "--store",
        choices=("memory", "sqlite"),
        default="memory",
        help="the coordinator's [store] kind (the echo server stores nothing)",
    )
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

    # The daemon's modules, imported before the profile starts: it shows serving, not importing.
    importlib.import_module("meshgate.coordinator.assembly")

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

    def __init__(
        self,
        kind: str,
        world: int,
        directory: Path,
        variant: Variant = MEMORY_PLAINTEXT,
        slots: int = SLOTS_PER_NODE,
        start_timeout: float = 60.0,
        env_extra: dict | None = None,
    ) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.kind = kind
        self.log_path = directory / f"{kind}.log"
        env = dict(os.environ)
        env.update(env_extra or {})
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.servers",
                    kind,
                    "--world",
                    str(world),
                    "--slots",
                    str(slots),
                    "--dir",
                    str(directory),
                    "--store",
                    variant.store,
                    *(["--tls"] if variant.mtls else []),
                ],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=log,
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
        raise RuntimeError(f"{self.kind} server did not start in {timeout:g}s:\n{self.log_path.read_text()}")

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
