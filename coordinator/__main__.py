"""meshgate-coordinator --config FILE: serve one job's rendezvous, or (jobs mode) a cluster's.

--reset-state: start the state afresh, deliberately, with a new signing key. The state
files (and the high-water marks) are moved aside under a timestamped name, never
deleted. --reset-state --job ID (jobs mode): that job's files only."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from pathlib import Path

from meshgate.coordinator.assembly import serve
from meshgate.coordinator.config import ConfigError, CoordinatorConfig
from meshgate.coordinator.keys import ACTIVE_FILE, BUNDLE_FILE
from meshgate.coordinator.leadership import RESET_SUFFIX, etcd_reset
from meshgate.coordinator.rendezvous import RendezvousError, check_id
from meshgate.coordinator.store import StoreError
from meshgate.coordinator.store.mark import FILE_NAME as MARK_FILE
from meshgate import logs
from meshgate.attestation import KeyFileError
from meshgate.secret_files import SecretFileError
from meshgate.tls import TLSError

log = logging.getLogger("meshgate.coordinator")


def reset_state(config: CoordinatorConfig, job_id: str = "") -> list[Path]:
    """Move state aside (``<name>.reset-<time>``), never delete it; returns what moved.

    ``job_id`` (jobs mode): that job's log and mark only; the moved-aside mark stays beside
    the others as the witness that the job is never served again under its id. Otherwise
    the whole state, and the signing key's ``active`` pointer and trust bundle too: the
    next start signs with a new key that no earlier attestation names, so a job id that
    is used again after the reset never has two valid attestations for one rank."""
    if config.store_kind == "etcd":
        raise StoreError(f"--reset-state does not reset etcd: {etcd_reset(config, job_id)}")
    stamp = time.strftime("%Y%m%dT%H%M%S")
    state = config.state_dir / "state.sqlite3"
    keys = (config.keys_dir / ACTIVE_FILE, config.keys_dir / BUNDLE_FILE)
    if job_id:
        paths = _job_paths(config, job_id)
    elif config.jobs_mode:  # the cluster's log, every job's log, and their marks
        paths = (config.state_dir / "cluster", config.state_dir / "jobs", config.keys_dir / "marks") + keys
    else:
        paths = (state, state.with_name(state.name + "-wal"), state.with_name(state.name + "-shm"),
                 config.keys_dir / MARK_FILE) + keys
    moved = []
    for path in paths:
        if path.exists():
            aside = path.with_name(f"{path.name}{RESET_SUFFIX}{stamp}")
            path.rename(aside)
            moved.append(aside)
    what = (f"job {job_id}: it is not served again" if job_id else
            f"{config.log_id} starts with NO {'jobs and no nodes' if config.jobs_mode else 'ranks'} "
            "and a NEW signing key")
    for aside in moved:
        log.warning("--reset-state: MOVED %s ASIDE to %s; %s", aside.name.rsplit(RESET_SUFFIX, 1)[0], aside, what)
    if not moved:
        log.warning("--reset-state: %s had no state to move aside", job_id or config.log_id)
    return moved


def _job_paths(config: CoordinatorConfig, job_id: str) -> tuple[Path, ...]:
    if not config.jobs_mode:
        raise ConfigError("--reset-state --job needs a jobs-mode config (no [job] and no [plan])")
    try:
        check_id("--job", job_id)
    except RendezvousError as exc:
        raise ConfigError(exc.message) from None
    if any(part in (".", "..") for part in job_id.split("/")):
        raise ConfigError(f"--job {job_id!r}: not a job id")
    return (config.state_dir / "jobs" / job_id, config.keys_dir / "marks" / job_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshgate-coordinator", description=__doc__)
    parser.add_argument("--config", required=True, type=Path, help="coordinator TOML file")
    parser.add_argument("--listen", help="override [server] listen, e.g. 127.0.0.1:0")
    parser.add_argument("--port-file", type=Path, help="write HOST:PORT here once serving")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", choices=logs.FORMATS, help="override [server] log_format")
    parser.add_argument("--reset-state", action="store_true",
                        help="move the state and high-water marks aside (kept, timestamped) and start afresh "
                             "with a new signing key")
    parser.add_argument("--job", default="", metavar="ID",
                        help="with --reset-state (jobs mode): move only this job's log and mark aside; "
                             "the job is not served again")
    args = parser.parse_args(argv)
    logs.setup(args.log_level, args.log_format or "text")
    try:
        config = CoordinatorConfig.load(args.config)
        if config.rendezvous is not None:
            logs.add_secret(config.rendezvous.join_token)
        if (args.log_format or config.log_format) != "text":
            logs.setup(args.log_level, args.log_format or config.log_format)
        if args.listen:
            config = type(config)(**{**config.__dict__, "listen": args.listen})
        if args.job and not args.reset_state:
            raise ConfigError("--job is used with --reset-state only")
        if args.reset_state:
            reset_state(config, args.job)
        asyncio.run(serve(config, args.port_file, args.config))
    except (ConfigError, KeyFileError, SecretFileError, StoreError, TLSError) as exc:
        log.error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
