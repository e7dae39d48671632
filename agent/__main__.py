"""meshgate-agent --config FILE: the per-node daemon (a systemd Type=notify service)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from agent.config import AgentConfig, AgentConfigError
from agent.daemon import Agent, AgentError

log = logging.getLogger("meshgate.agent")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshgate-agent", description=__doc__)
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = AgentConfig.load(args.config)
        if not config.insecure:
            raise AgentConfigError("TLS is not configured yet; set [agent] insecure = true")
        log.warning("INSECURE: plaintext gRPC to %s", config.coordinator)
        return asyncio.run(Agent(config).run())
    except (AgentConfigError, AgentError) as exc:
        log.error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
