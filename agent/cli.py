"""meshgate-agent --config FILE: the per-node daemon (a systemd Type=notify service).

Started through meshgate.agent.__main__, which sets gRPC up for a forking process first."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from meshgate.agent.config import AgentConfig, AgentConfigError
from meshgate.agent.daemon import Agent
from meshgate.agent.session import AgentError, AgentStopped
from meshgate.attestation import KeyFileError
from meshgate.secret_files import SecretFileError
from meshgate.tls import TLSError, warn_insecure
from meshgate import logs, metrics

log = logging.getLogger("meshgate.agent")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshgate-agent", description=__doc__)
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", choices=logs.FORMATS, help="override [agent] log_format")
    args = parser.parse_args(argv)
    logs.setup(args.log_level, args.log_format or "text")
    try:
        config = AgentConfig.load(args.config)
        logs.add_secret(config.join_token)
        if (args.log_format or config.log_format) != "text":
            logs.setup(args.log_level, args.log_format or config.log_format)
        if config.tls is None:
            warn_insecure(log, f"agent to {config.coordinator}")
        agent = Agent(config)
        if config.metrics_listen:
            metrics.start("agent", config.metrics_listen, agent)
        return asyncio.run(agent.run())
    except AgentStopped as exc:
        log.info("%s", exc)
        return 0
    except (AgentConfigError, AgentError, TLSError, KeyFileError, SecretFileError, metrics.MetricsError) as exc:
        log.error("%s", exc)
        return 2
