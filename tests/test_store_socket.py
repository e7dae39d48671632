"""The store's listening socket is handed over, never released (issue 32, item 2): the
agent's master reservation listens on the attested address from the start; node rank 0's
store host takes a copy over the agent's Unix socket (SCM_RIGHTS, a real VouchSocket and a
real second process) and serves torch's TCPStore on it. A local process that tries to take
the port before, during and after the hand-over fails every time, and the port listens
only on the attested address (/proc/net/tcp)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, worker_env
from workers import store_worker
from meshgate.agent.netif import MasterReservation
from meshgate.agent.vouch_socket import LocalNode, VouchSocket
from meshgate.store_socket import MasterSocketRefused, receive_master_socket

ATTESTED = "127.0.0.2"  # a loopback address that is not the wildcard nor 127.0.0.1

STORE_HOST = """
import sys
from meshgate.store_socket import receive_master_socket, tcp_store_on
listener = receive_master_socket(sys.argv[1])
print("received", flush=True)
sys.stdin.readline()  # the test squats while the host holds the socket, before the store
store = tcp_store_on(listener, 30)
store.set("k", "v")
print("serving", flush=True)
sys.stdin.readline()
"""


def squat(port: int, attested: str = ATTESTED) -> list[str]:
    """Every bind a local process could try on ``port`` (TCPStore's own way: SO_REUSEADDR),
    on the attested address and the wildcard; those that succeeded (the same attempt the
    per-slot workers of tests/test_store_host.py make from inside a job)."""
    return store_worker.squat(attested, port)


def listening_on(port: int) -> set[str]:
    """The local addresses that listen on ``port`` (/proc/net/tcp and tcp6: state 0A)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]) if len(address) == 8 else address)
    return found


def test_the_store_socket_is_handed_over_never_free_and_listens_on_the_attested_address(tmp_path):
    reservation = MasterReservation.reserve(ATTESTED, {})
    port, path = reservation.port, tmp_path / "agent.sock"
    assert squat(port) == [] and listening_on(port) == {ATTESTED}  # before: held, listening

    async def scenario() -> None:
        served = VouchSocket(
            path,
            lambda local_rank, rank: b"",
            lambda: LocalNode("n0", "j", 0),
            master_socket=lambda: reservation.listener,
        )
        await served.start()
        host = subprocess.Popen(
            [sys.executable, "-c", STORE_HOST, str(path)],
            cwd=REPO,
            env=worker_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert await asyncio.to_thread(host.stdout.readline) == "received\n"
            assert squat(port) == []  # during: the agent and the store host hold it
            host.stdin.write("\n")
            host.stdin.flush()
            assert await asyncio.to_thread(host.stdout.readline) == "serving\n"
            reservation.release()  # the agent's copy gone: the store host's still listens
            assert squat(port) == []  # after
            assert listening_on(port) == {ATTESTED}
            from torch.distributed import TCPStore

            from datetime import timedelta

            client = await asyncio.to_thread(TCPStore, ATTESTED, port, None, False, timedelta(seconds=10))
            assert client.get("k") == b"v"
        finally:
            host.kill()
            host.wait()
            served.close()

    asyncio.run(scenario())


def test_a_caller_the_agent_will_not_hand_the_socket_gets_a_refusal_and_no_descriptor(tmp_path):
    path = tmp_path / "agent.sock"

    async def scenario() -> None:
        from meshgate.agent.vouch_socket import Refused

        def not_rank_0():
            raise Refused("node 'n1' is not node rank 0 of a running job: it hosts no master's store")

        served = VouchSocket(path, lambda *a: b"", lambda: LocalNode("n1", "j", 0), master_socket=not_rank_0)
        await served.start()
        try:
            with pytest.raises(MasterSocketRefused, match="not node rank 0"):
                await asyncio.to_thread(receive_master_socket, str(path))
        finally:
            served.close()

    asyncio.run(scenario())
