"""The two servers under test, each in its own process.

``python -m bench.servers coordinator --world N --dir D``: the real coordinator
(meshgate.coordinator.engine.Coordinator with a MemoryStore, a KeyRing in D, served by
meshgate.coordinator.service.build_server), the same objects ``meshgate-coordinator`` builds.

``python -m bench.servers echo --world N --dir D``: the physical limit. A bare grpc.aio
server with one generic handler (bytes in, bytes out: no stubs, no protoc) that answers
every call with the same bytes: one real RegisterResponse for a world of N, signed by a
KeyRing in D, so the client harness can parse and verify it exactly as it verifies the
coordinator's answers. Same grpc.aio server options as build_server.

Each prints one JSON line on stdout once serving ({"port", "pid", ...}) and serves until
SIGTERM. ServerProcess is the parent's handle on such a process.
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

from bench.common import (
    ECHO_METHOD,
    ECHO_NONCE,
    ECHO_SERVICE,
    JOB,
    SERVER_OPTIONS,
    SLOTS_PER_NODE,
    plan_for,
    proc_cpu_s,
    proc_status,
    register_request,
)

REPO = Path(__file__).resolve().parent.parent
# Set to a path, the server profiles itself with pyinstrument and writes collapsed stacks
# there on exit (bench.profile uses this where py-spy is not installed).
PYINSTRUMENT_ENV = "BENCH_PYINSTRUMENT"


def _coordinator(world: int, slots: int, keys_dir: Path):
    from meshgate.coordinator.engine import Coordinator
    from meshgate.coordinator.keys import KeyRing
    from meshgate.coordinator.rendezvous import RendezvousConfig
    from meshgate.coordinator.store import MemoryStore

    keys = KeyRing(keys_dir, job_id=JOB)
    keys.write_bundle()
    config = RendezvousConfig(job_id=JOB, plan=plan_for(world, slots), slots_per_node=slots)
    return Coordinator(config, MemoryStore(), keys, attestation_ttl_s=3600.0)


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def _announce(**fields) -> None:
    sys.stdout.write(json.dumps({"pid": os.getpid(), **fields}) + "\n")
    sys.stdout.flush()


async def serve_coordinator(world: int, slots: int, directory: Path) -> None:
    from meshgate.coordinator.service import build_server, mark_serving

    coordinator = _coordinator(world, slots, directory / "keys")
    server, health_servicer = build_server(coordinator)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await mark_serving(health_servicer)
    _announce(
        kind="coordinator",
        port=port,
        world=world,
        bundle=str(coordinator.keys.bundle_path),
    )
    await _until_signalled()
    await server.stop(None)


async def sample_response(world: int, slots: int, directory: Path) -> tuple[bytes, bytes, Path]:
    """One real (request, RegisterResponse) pair for a worker in the middle of the world."""
    from meshgate.coordinator.service import register_input
    from meshgate.v1 import rendezvous_pb2

    coordinator = _coordinator(world, slots, directory / "keys")
    i = world // 2 + slots // 2
    request = register_request(i, ECHO_NONCE, coordinator.config.plan.digest(), slots)
    signed, secret = await coordinator.register(register_input(request))
    response = rendezvous_pb2.RegisterResponse(attestation=signed, heartbeat_secret=secret)
    return request.SerializeToString(), response.SerializeToString(), coordinator.keys.bundle_path


async def serve_echo(world: int, slots: int, directory: Path) -> None:
    import grpc

    request, response, bundle = await sample_response(world, slots, directory)

    async def call(_request: bytes, _context) -> bytes:
        return response

    # No serializers: the handler sees and returns raw bytes.
    handler = grpc.method_handlers_generic_handler(
        ECHO_SERVICE, {"Call": grpc.unary_unary_rpc_method_handler(call)}
    )
    server = grpc.aio.server(options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    _announce(
        kind="echo",
        port=port,
        world=world,
        bundle=str(bundle),
        method=ECHO_METHOD,
        request_bytes=len(request),
        response_bytes=len(response),
    )
    await _until_signalled()
    await server.stop(None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.servers")
    parser.add_argument("kind", choices=("coordinator", "echo"))
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--slots", type=int, default=SLOTS_PER_NODE)
    parser.add_argument("--dir", type=Path, required=True)
    args = parser.parse_args(argv)
    # What the daemon does (coordinator/__main__.py): INFO to stderr.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.dir.mkdir(parents=True, exist_ok=True)
    serve = serve_coordinator if args.kind == "coordinator" else serve_echo
    profile_to = os.environ.get(PYINSTRUMENT_ENV)
    if not profile_to:
        asyncio.run(serve(args.world, args.slots, args.dir))
        return 0
    # The fallback profiler (bench/profile.py): pyinstrument in process, main thread only.
    from pyinstrument import Profiler

    import meshgate.coordinator.engine  # noqa: F401 - imported before the profile starts
    import meshgate.coordinator.service  # noqa: F401

    profiler = Profiler(interval=0.001, async_mode="disabled")
    profiler.start()
    try:
        asyncio.run(serve(args.world, args.slots, args.dir))
    finally:
        from bench.profile import write_collapsed

        write_collapsed(profiler.stop(), Path(profile_to))
    return 0


# ---- the parent's handle -------------------------------------------------------------------


class ServerProcess:
    """A server started with ``python -m bench.servers``; a context manager."""

    def __init__(self, kind: str, world: int, directory: Path, slots: int = SLOTS_PER_NODE,
                 start_timeout: float = 60.0, env_extra: dict | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.kind = kind
        self.log_path = directory / f"{kind}.log"
        env = dict(os.environ)
        env.update(env_extra or {})
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "bench.servers", kind, "--world", str(world),
                 "--slots", str(slots), "--dir", str(directory)],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log,
            )
        self.info = self._read_announcement(start_timeout)
        self.pid: int = self.process.pid
        self.address = f"127.0.0.1:{self.info['port']}"
        self.bundle_path = self.info["bundle"]

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
