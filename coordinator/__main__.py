"""meshgate-coordinator --config FILE: serve a cluster's jobs (and the one job a config
with [job] + [plan] declares).

--reset-state: start the state afresh, deliberately, with a new signing key. The state
files (and the high-water marks) are moved aside under a timestamped name, never
deleted. --reset-state --job ID: that job's files only; it is not served again.
--migrate-state: take over a single-job state directory of the old layout
(<state>/state.sqlite3 and <keys>/durable-mark) as the log of the job the config declares."""

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
from meshgate.coordinator.leadership import RESET_SUFFIX, StateRefused, etcd_reset, job_path, legacy_state
from meshgate.coordinator.rendezvous import RendezvousError, check_id
from meshgate.coordinator.store import StoreError, open_store
from meshgate.coordinator.store.atomic import fsync_dir
from meshgate.coordinator.store.codec import job_pin
from meshgate.coordinator.store.mark import FILE_NAME as MARK_FILE
from meshgate.coordinator.store.mark import DurableMark
from meshgate import logs
from meshgate.attestation import KeyFileError
from meshgate.secret_files import SecretFileError
from meshgate.tls import TLSError

log = logging.getLogger("meshgate.coordinator")


def reset_state(config: CoordinatorConfig, job_id: str = "") -> list[Path]:
    """Move state aside (``<name>.reset-<time>``), never delete it; returns what moved.

    ``job_id``: that job's log and mark only (a declared job's too); the moved-aside mark
    stays beside the others as the witness that the job is never served again under its
    id. Otherwise the whole state (and a single-job state of the old layout), and the
    signing key's ``active`` pointer and trust bundle too: the next start signs with a new
    key that no earlier attestation names, so a job id that is used again after the reset
    never has two valid attestations for one rank."""
    if config.store_kind == "etcd":
        raise StoreError(f"--reset-state does not reset etcd: {etcd_reset(config, job_id)}")
    stamp = time.strftime("%Y%m%dT%H%M%S")
    keys = (config.keys_dir / ACTIVE_FILE, config.keys_dir / BUNDLE_FILE)
    if job_id:
        paths = _job_paths(config, job_id)
    else:  # the cluster's log, every job's log, their marks (and an old single-job state)
        paths = (
            config.state_dir / "cluster",
            config.state_dir / "jobs",
            config.keys_dir / "marks",
            *legacy_state(config),
            *keys,
        )
    moved = []
    for path in paths:
        if path.exists():
            aside = path.with_name(f"{path.name}{RESET_SUFFIX}{stamp}")
            path.rename(aside)
            moved.append(aside)
    what = (
        f"job {job_id}: it is not served again"
        if job_id
        else "the cluster starts with NO jobs (its config's job afresh, with no ranks) and no nodes, and a "
        "NEW signing key"
    )
    for aside in moved:
        log.warning("--reset-state: MOVED %s ASIDE to %s; %s", aside.name.rsplit(RESET_SUFFIX, 1)[0], aside, what)
    if not moved:
        log.warning("--reset-state: %s had no state to move aside", job_id or config.log_id)
    return moved


def _job_paths(config: CoordinatorConfig, job_id: str) -> tuple[Path, ...]:
    try:
        check_id("--job", job_id)
    except RendezvousError as exc:
        raise ConfigError(exc.message) from None
    if any(part in (".", "..") for part in job_id.split("/")):
        raise ConfigError(f"--job {job_id!r}: not a job id")
    return (config.state_dir / "jobs" / job_id, config.keys_dir / "marks" / job_id)


def migrate_state(config: CoordinatorConfig) -> list[Path]:
    """Make a single-job state directory of the old layout the log of the job the config
    declares: ``<state>/state.sqlite3`` (with its -wal and -shm) moves to
    ``<state>/jobs/<id>/`` and ``<keys>/durable-mark`` to ``<keys>/marks/<id>``; both stay
    pinned to the same job and plan, so the job resumes with every rank it had. The old
    log is checked first against the config's job (id, plan, slots, node_order) and its
    mark: a mismatch refuses, naming both, and moves nothing. The mark moves first and the
    log last, so a crash in between leaves a state this command finishes when run again.
    Returns where each file went."""
    rendezvous = config.rendezvous
    if config.store_kind != "sqlite":
        raise ConfigError(
            f"--migrate-state takes over a sqlite state directory; this config's [store] is {config.store_kind!r}"
        )
    if rendezvous is None:
        raise ConfigError(
            "--migrate-state needs the config that wrote the old state: its [job] id and [plan] "
            "name the job whose log it is"
        )
    legacy = legacy_state(config)
    if not legacy:
        raise ConfigError(
            f"--migrate-state: no single-job state of the old layout ({config.state_dir}/state.sqlite3 "
            f"or {config.keys_dir / MARK_FILE}) to take over"
        )
    try:
        job_dir = job_path(config.state_dir / "jobs", rendezvous.job_id)
        mark_to = job_path(config.keys_dir / "marks", rendezvous.job_id)
    except StateRefused as exc:
        raise ConfigError(f"--migrate-state: {exc}") from None
    log_file, mark_file = config.state_dir / "state.sqlite3", config.keys_dir / MARK_FILE
    taken = [path for path in (job_dir / log_file.name, mark_to) if path.exists()]
    if taken and mark_file.exists():
        raise ConfigError(
            f"--migrate-state: {taken[0]} exists already; job {rendezvous.job_id!r} has a log of the "
            "new layout, and the old one is left as found"
        )
    mark_now = mark_file if mark_file.exists() else mark_to  # a run cut short after the mark moved
    try:  # the old log must verify as this job's, up to its mark, before anything moves
        open_store(
            "sqlite",
            state_dir=config.state_dir,
            job_id=rendezvous.job_id,
            pin=job_pin(rendezvous),
            mark=DurableMark(mark_now, rendezvous.job_id),
        ).close()
    except StoreError as exc:
        raise StoreError(
            f"--migrate-state: {log_file} is not the log of this config's job, moved nothing: {exc}"
        ) from None
    job_dir.mkdir(parents=True, mode=0o700, exist_ok=True)
    mark_to.parent.mkdir(mode=0o700, exist_ok=True)
    moves = [(mark_file, mark_to)] + [
        (log_file.with_name(log_file.name + suffix), job_dir / (log_file.name + suffix))
        for suffix in ("-wal", "-shm", "")
    ]
    moved = []
    for source, target in moves:
        if source.exists():
            source.rename(target)
            fsync_dir(target.parent)
            moved.append(target)
            log.warning("--migrate-state: moved %s to %s", source, target)
    fsync_dir(config.state_dir)
    fsync_dir(config.keys_dir)
    return moved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshgate-coordinator", description=__doc__)
    parser.add_argument("--config", required=True, type=Path, help="coordinator TOML file")
    parser.add_argument("--listen", help="override [server] listen, e.g. 127.0.0.1:0")
    parser.add_argument("--port-file", type=Path, help="write HOST:PORT here once serving")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", choices=logs.FORMATS, help="override [server] log_format")
    parser.add_argument(
        "--reset-state",
        action="store_true",
        help="move the state and high-water marks aside (kept, timestamped) and start afresh with a new signing key",
    )
    parser.add_argument(
        "--job",
        default="",
        metavar="ID",
        help="with --reset-state: move only this job's log and mark aside; the job is not served again",
    )
    parser.add_argument(
        "--migrate-state",
        action="store_true",
        help="take over a single-job state directory of the old layout (state.sqlite3, "
        "durable-mark) as the log of the job this config declares, then serve",
    )
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
        if args.reset_state and args.migrate_state:
            raise ConfigError("--reset-state and --migrate-state: choose one")
        if args.reset_state:
            reset_state(config, args.job)
        if args.migrate_state:
            migrate_state(config)
        asyncio.run(serve(config, args.port_file, args.config))
    except (ConfigError, KeyFileError, SecretFileError, StoreError, TLSError) as exc:
        log.error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
