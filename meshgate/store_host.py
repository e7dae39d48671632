"""``python -m meshgate.store_host --fd N``: the store of a per-slot job's generation,
served on the listening socket node rank 0's agent holds (issue 32, item 2).

The agent (agent/store_activation.py) starts it as the job user in the generation's
containment unit, with the master's LISTENING socket inherited as descriptor N, when the
first worker connects; every worker is a TCPStore client of it (the agent exports
``TORCHELASTIC_USE_AGENT_STORE=True``, so torch's ``env://`` and ``tcp://`` rendezvous
never try to host the store themselves). It serves until the unit is killed with the
generation's workers: each generation gets a fresh store, so no keys of an earlier world
are read. The port itself is never released: the agent keeps its copy of the socket for
the job's life, and connections queue in its backlog while no store host accepts.

This process, not the agent, imports torch (the agent never does: tests/test_agent_footprint.py).
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys

STORE_TIMEOUT_S = 300.0  # the server's own wait (it waits for no worker count: world_size is None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshgate.store_host", description=__doc__.split("\n\n")[0])
    parser.add_argument("--fd", type=int, required=True, help="the inherited listening socket")
    args = parser.parse_args(argv)
    try:
        listener = socket.socket(fileno=args.fd)
    except OSError as exc:
        print(f"meshgate store host: descriptor {args.fd} is not a socket: {exc.strerror}", file=sys.stderr)
        return 2
    listener.set_inheritable(False)
    if listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) != 1:
        print(f"meshgate store host: descriptor {args.fd} is not a listening socket", file=sys.stderr)
        return 2
    try:
        from meshgate.store_socket import tcp_store_on

        store = tcp_store_on(listener, STORE_TIMEOUT_S)
    except ImportError as exc:
        print(
            f"meshgate store host: torch is not importable by {sys.executable} ({exc}); a per-slot job's "
            "store is served by the agent's interpreter: install meshgate[torch] beside the agent",
            file=sys.stderr,
        )
        return 3
    host, port = listener.getsockname()[:2]
    print(f"meshgate store host: serving the job's store on {host}:{port}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            signal.pause()
    finally:
        del store


if __name__ == "__main__":
    sys.exit(main())
