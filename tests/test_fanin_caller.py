"""The fan-in checks its caller as the vouch socket does: each connection to the public
socket is let through to the gRPC server only if the agent's check_caller(pid, uid)
allows the process that connected (SO_PEERCRED, from the kernel), so a vouch stolen from
another job's /proc is no use from outside that job. Real sockets and client processes;
the coordinator behind the fan-in is a recording stand-in, as in test_fanin_worlds.py."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import REPO, worker_env
from meshgate.agent.fanin import private_dir_for, serve_fan_in
from meshgate.agent.peer_front import PeerCheckedFront
from meshgate.attestation import SigningKey, sign_vouch
from meshgate.v1 import attestation_pb2, nodes_pb2, rendezvous_pb2

# A worker on this host: Register then AwaitWorld ("register"), N channels one after the
# other, each its own connection, with one AwaitWorld each ("many"), or N raw connections
# that send a few bytes and read until the front closes them ("raw"). Prints JSON.
CLIENT = r"""
import asyncio, json, os, socket, sys
import grpc
from meshgate.v1 import rendezvous_pb2 as pb, rendezvous_pb2_grpc
path, what, arg = sys.argv[1:4]
OPTIONS = [("grpc.use_local_subchannel_pool", 1)]  # no connection shared between channels

async def main():
    out = {"pid": os.getpid(), "uid": os.getuid()}
    if what == "register":
        async with grpc.aio.insecure_channel(f"unix:{path}", options=OPTIONS) as channel:
            stub = rendezvous_pb2_grpc.RendezvousStub(channel)
            request = pb.RegisterRequest(job_id="job-a", worker_id="w0", nonce=b"n" * 32, node_id="node-a")
            request.assigned.local_rank = 0
            request.vouch.ParseFromString(bytes.fromhex(arg))
            try:
                reply = await stub.Register(request, timeout=20)
                world = await stub.AwaitWorld(pb.AwaitWorldRequest(job_id="job-a", generation=0), timeout=20)
                out.update(payload=reply.attestation.payload.decode(), batch=reply.attestation.batch.decode(),
                           world=world.job_id)
            except grpc.aio.AioRpcError as exc:
                out.update(code=exc.code().name, details=exc.details())
    elif what == "many":
        codes = {}
        for _ in range(int(arg)):
            async with grpc.aio.insecure_channel(f"unix:{path}", options=OPTIONS) as channel:
                stub = rendezvous_pb2_grpc.RendezvousStub(channel)
                try:
                    await stub.AwaitWorld(pb.AwaitWorldRequest(job_id="job-a", generation=0), timeout=20)
                    code = "OK"
                except grpc.aio.AioRpcError as exc:
                    code = exc.code().name
            codes[code] = codes.get(code, 0) + 1
        out["codes"] = codes
    elif what == "raw":
        ends = {}
        for _ in range(int(arg)):
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
                try:
                    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                    end = "eof" if s.recv(4096) == b"" else "data"
                except OSError as exc:
                    end = type(exc).__name__
            ends[end] = ends.get(end, 0) + 1
        out["ends"] = ends
    print(json.dumps(out))

asyncio.run(main())
"""


class Coordinator:
    """Stands in for the agent's coordinator stubs (nodes and rendezvous): records calls."""

    def __init__(self):
        self.batches = []
        self.worlds = 0

    async def RegisterBatch(self, message, timeout=None):
        self.batches.append(message)
        results = [
            nodes_pb2.RegisterResult(attestation=attestation_pb2.SignedAttestation(payload=r.worker_id.encode()))
            for r in message.requests
        ]
        return nodes_pb2.RegisterBatchResponse(results=results, batch=b"signed-once")

    async def AwaitWorld(self, request, timeout=None):
        self.worlds += 1
        return rendezvous_pb2.World(job_id=request.job_id, generation=request.generation)


class Caller:
    """The agent's check_caller: records every (pid, uid) it is asked about."""

    def __init__(self, refusal=None):
        self.seen = []
        self.refusal = refusal

    def __call__(self, pid, uid):
        self.seen.append((pid, uid))
        return self.refusal


@pytest.fixture
async def fan_in(tmp_path):
    key = SigningKey.generate()
    coordinator = Coordinator()
    agent = SimpleNamespace(
        config=SimpleNamespace(node_id="node-a"),
        identity=SimpleNamespace(public_key=key.public_raw),
        job_id="job-a",
        generation=0,
        credential=b"credential",
        nodes=coordinator,
        rendezvous=coordinator,
    )
    caller = Caller()
    path = tmp_path / "state" / "rendezvous.sock"
    path.parent.mkdir(mode=0o700)
    server, servicer = await serve_fan_in(agent, path, check_caller=caller)
    vouch = sign_vouch(key, job_id="job-a", node_id="node-a", generation=0, local_rank=0, expires_at=time.time() + 60)
    try:
        yield SimpleNamespace(
            path=path, server=server, servicer=servicer, coordinator=coordinator, caller=caller, vouch=vouch
        )
    finally:
        await server.stop(None)


async def client(path: Path, what: str, arg: str, **options) -> tuple[int, dict]:
    """Runs CLIENT in its own process; its pid and what it printed."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CLIENT,
        str(path),
        what,
        arg,
        cwd=REPO,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **options,
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, err.decode()[-3000:]
    return process.pid, json.loads(out.decode().splitlines()[-1])


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


async def test_an_allowed_caller_registers_and_awaits_its_world_through_the_front(fan_in):
    pid, out = await client(fan_in.path, "register", fan_in.vouch.SerializeToString().hex())
    assert out == {"pid": pid, "uid": os.getuid(), "payload": "w0", "batch": "signed-once", "world": "job-a"}, out
    # The check saw the client process itself, from the kernel: its real pid and uid.
    assert fan_in.caller.seen and set(fan_in.caller.seen) == {(pid, os.getuid())}, (fan_in.caller.seen, pid)
    assert [list(b.requests) for b in fan_in.coordinator.batches] != [] and fan_in.coordinator.worlds == 1
    assert fan_in.servicer.forwarded == 1
    assert oct(fan_in.path.stat().st_mode & 0o777) == "0o660"


async def test_a_caller_the_agent_refuses_never_reaches_grpc_even_with_a_good_vouch(fan_in, caplog):
    # The attack: a process outside the job run (here: every caller) holds a real vouch
    # it read from a worker's /proc/PID/environ.
    fan_in.caller.refusal = "pid is not a process of job 'job-a' generation 0"
    with caplog.at_level(logging.WARNING, logger="meshgate.agent"):
        pid, out = await client(fan_in.path, "register", fan_in.vouch.SerializeToString().hex())
    assert out["code"] == "UNAVAILABLE", out
    assert fan_in.coordinator.batches == [] and fan_in.coordinator.worlds == 0 and fan_in.servicer.forwarded == 0
    assert set(fan_in.caller.seen) == {(pid, os.getuid())}
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert refusals and {r.levelno for r in refusals} == {logging.WARNING}
    assert {r.getMessage() for r in refusals} == {
        f"fan-in refused to pid {pid} uid {os.getuid()}: pid is not a process of job 'job-a' generation 0"
    }
    assert fan_in.server.front.refused == len(refusals) and fan_in.server.front.accepted == 0


async def test_a_check_that_raises_refuses(fan_in, caplog):
    def broken(pid, uid):
        raise FileNotFoundError(f"/proc/{pid}/cgroup")

    fan_in.server.front.check_caller = broken
    with caplog.at_level(logging.WARNING, logger="meshgate.agent"):
        pid, out = await client(fan_in.path, "raw", "1")
    assert out["ends"] != {"data": 1}, out
    assert any(
        f"fan-in refused to pid {pid}" in r.getMessage() and "check failed" in r.getMessage() for r in caplog.records
    )


async def test_many_connections_leave_no_fd_or_task_behind(fan_in):
    await client(fan_in.path, "many", "2")  # gRPC's own lazily made fds and threads, before counting
    front = fan_in.server.front
    fds, tasks = open_fds(), len(asyncio.all_tasks())
    allowed_before = front.accepted

    started = time.perf_counter()
    _, out = await client(fan_in.path, "many", "200")
    elapsed = time.perf_counter() - started
    assert out["codes"] == {"OK": 200}, out
    assert front.accepted - allowed_before == 200
    fan_in.caller.refusal = "not a process of the job run"
    _, out = await client(fan_in.path, "raw", "200")
    assert "data" not in out["ends"] and sum(out["ends"].values()) == 200, out
    assert front.refused == 200

    deadline = time.monotonic() + 10
    while (front.open_connections or open_fds() - fds) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert front.open_connections == 0 and not front._connecting
    assert open_fds() - fds == set(), {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in open_fds() - fds}
    assert len(asyncio.all_tasks()) <= tasks
    print(f"200 connections through the front, one AwaitWorld each: {elapsed:.2f} s")


async def test_the_front_passes_bytes_both_ways_with_flow_control_and_a_half_close(tmp_path):
    """A generic check of the splice: 8 MiB each way at once through an echo server, then
    the caller's EOF reaches the server, whose answer after it still reaches the caller."""

    async def echo(reader, writer):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.write(b"after your EOF")  # the half-closed caller still reads
        await writer.drain()
        writer.close()

    upstream = tmp_path / "echo.sock"
    server = await asyncio.start_unix_server(echo, path=str(upstream))
    front = PeerCheckedFront(tmp_path / "front.sock", upstream, Caller())
    await front.start()
    fds = open_fds()
    try:
        reader, writer = await asyncio.open_unix_connection(str(tmp_path / "front.sock"))
        payload = os.urandom(8 << 20)

        async def send():
            for i in range(0, len(payload), 1 << 20):
                writer.write(payload[i : i + (1 << 20)])
                await writer.drain()
            writer.write_eof()

        sending = asyncio.ensure_future(send())
        received = await asyncio.wait_for(reader.read(-1), 30)  # until the front passes the EOF on
        await sending
        assert received == payload + b"after your EOF"
        writer.close()
        await writer.wait_closed()
        deadline = time.monotonic() + 5
        while (front.open_connections or open_fds() - fds) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert front.open_connections == 0 and open_fds() - fds == set()
    finally:
        front.close()
        server.close()


@pytest.mark.parametrize("then_eof", [False, True], ids=["more-after", "eof-at-once"])
async def test_what_a_caller_sends_before_the_server_is_reached_is_passed_on_in_order(tmp_path, monkeypatch, then_eof):
    """Debian's Python 3.11 (the shipped agent's interpreter in the tests) starts reading an
    accepted connection right after connection_made, whatever was paused there (newer
    asyncio checks is_reading() first), so a caller's first bytes (gRPC's preface) can
    arrive while the front is still connecting to the server. Held at that seam, they must
    wait and then reach the server first, in order, with the EOF after them (CI saw them
    hit a None transport: the caller was cut off and a worker's Register failed with
    'Socket closed'). The transport here behaves as Debian's does, whichever Python runs."""
    from asyncio import selector_events

    def add_reader_as_debian_3_11(self, fd, callback, *args):
        if self._closing:
            return
        self._loop._add_reader(fd, callback, *args)

    monkeypatch.setattr(selector_events._SelectorTransport, "_add_reader", add_reader_as_debian_3_11)

    async def echo(reader, writer):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.close()

    upstream = tmp_path / "echo.sock"
    server = await asyncio.start_unix_server(echo, path=str(upstream))
    loop = asyncio.get_running_loop()
    connect, reached, release = loop.create_unix_connection, asyncio.Event(), asyncio.Event()

    async def held_connect(factory, path=None, **kwargs):
        if path == str(upstream):  # the front's connect; the test's own caller goes straight
            reached.set()
            await release.wait()
        return await connect(factory, path, **kwargs)

    monkeypatch.setattr(loop, "create_unix_connection", held_connect)
    front = PeerCheckedFront(tmp_path / "front.sock", upstream, Caller())
    await front.start()
    try:
        reader, writer = await asyncio.open_unix_connection(str(tmp_path / "front.sock"))
        first = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + os.urandom(300_000)  # more than one read
        writer.write(first)
        if then_eof:
            writer.write_eof()
        await asyncio.wait_for(reached.wait(), 5)  # no drain yet: the front holds what it read
        await asyncio.sleep(0.2)  # the loop runs the front's reads while the connect is held
        release.set()
        later = b"" if then_eof else os.urandom(1000)
        if later:
            writer.write(later)
            writer.write_eof()
        await writer.drain()
        received = await asyncio.wait_for(reader.read(-1), 10)
        assert received == first + later
        writer.close()
        await writer.wait_closed()
    finally:
        front.close()
        server.close()


async def test_a_stop_closes_the_open_connections_and_removes_the_sockets(fan_in):
    with socket.socket(socket.AF_UNIX) as held:
        held.connect(str(fan_in.path))
        deadline = time.monotonic() + 5
        while not fan_in.server.front.open_connections and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert fan_in.server.front.open_connections == 1
        await fan_in.server.stop(0)
        assert fan_in.server.front.open_connections == 0
        held.setblocking(False)
        loop = asyncio.get_running_loop()
        while await asyncio.wait_for(loop.sock_recv(held, 4096), 5):  # gRPC's SETTINGS, then the close
            pass
    assert not fan_in.path.exists() and not private_dir_for(fan_in.path).exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another uid")
async def test_only_the_agent_can_reach_the_grpc_server_behind_the_front():
    # Under /tmp with a passable (0711) directory, as the agent's state dir is for its job
    # user: the other uid may reach the public socket but not the private one.
    directory = Path(tempfile.mkdtemp(prefix="fanin-"))
    os.chmod(directory, 0o711)
    caller = Caller()
    agent = SimpleNamespace(config=SimpleNamespace(node_id="node-a"), job_id="job-a")
    server, _ = await serve_fan_in(agent, directory / "rendezvous.sock", check_caller=caller)
    try:
        os.chmod(directory / "rendezvous.sock", 0o666)  # as if the other uid were in the job group
        private = private_dir_for(directory / "rendezvous.sock")
        assert private.stat().st_uid == os.geteuid() and oct(private.stat().st_mode & 0o777) == "0o700"
        probe = (
            "import json, socket, sys\n"
            "out = {}\n"
            "for name in sys.argv[1:]:\n"
            "    s = socket.socket(socket.AF_UNIX)\n"
            "    try:\n"
            "        s.connect(name); out[name] = 'connected'\n"
            "    except OSError as exc:\n"
            "        out[name] = type(exc).__name__\n"
            "print(json.dumps(out))\n"
        )
        public, hidden = str(directory / "rendezvous.sock"), str(private / "grpc")
        process = await asyncio.create_subprocess_exec(
            "/usr/bin/python3.11", "-I", "-c", probe, public, hidden, user=65534, group=65534, stdout=subprocess.PIPE
        )
        out, _ = await process.communicate()
        assert json.loads(out) == {public: "connected", hidden: "PermissionError"}
        deadline = time.monotonic() + 5
        while not caller.seen and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert caller.seen == [(process.pid, 65534)]  # and the public one asked the agent's check
    finally:
        await server.stop(None)
        os.rmdir(directory)
