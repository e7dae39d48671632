"""meshgate-agent --config FILE: the per-node daemon (a systemd Type=notify service)."""

import sys

from meshgate import grpc_fork

grpc_fork.disable()  # first: the agent forks its workers while gRPC runs (meshgate/grpc_fork.py)

from meshgate.agent.cli import main  # noqa: E402 - loads grpc, so only after grpc_fork.disable()

if __name__ == "__main__":
    sys.exit(main())
