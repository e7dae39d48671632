"""``meshgate init``: write the commented example configs and systemd units to a folder.

    meshgate init coordinator [--dir D] [--force]   D/coordinator.toml
    meshgate init agent [--dir D] [--force]         D/agent.toml, D/join-token (0600, empty)
    meshgate init systemd [--dir D] [--force]       D/meshgate-coordinator.service, D/meshgate-agent.service

The files come from the package (meshgate.data), so they match this version of meshgate.
Existing files are refused, all of them named, and nothing is written, unless --force.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from meshgate import data

PUBLIC_MODE = 0o644
SECRET_MODE = 0o600
JOIN_TOKEN_FILE = "join-token"  # what the example agent.toml's join_token_file names


@dataclass(frozen=True)
class Output:
    name: str
    text: str
    mode: int


def outputs(what: str) -> tuple[Output, ...]:
    """The files ``meshgate init WHAT`` writes (pure: reads only the bundled templates)."""
    if what == "coordinator":
        return (Output(data.COORDINATOR_CONFIG, data.template(data.COORDINATOR_CONFIG), PUBLIC_MODE),)
    if what == "agent":
        return (
            Output(data.AGENT_CONFIG, data.template(data.AGENT_CONFIG), PUBLIC_MODE),
            # Paste the token from `meshgate token create` here: the file is a secret.
            Output(JOIN_TOKEN_FILE, "", SECRET_MODE),
        )
    if what == "systemd":
        return tuple(Output(unit, data.template(unit), PUBLIC_MODE) for unit in data.UNITS)
    raise ValueError(f"init what must be coordinator, agent or systemd, got {what!r}")


class InitRefused(RuntimeError):
    """Files exist and --force was not given."""


def write_outputs(directory: Path, files: tuple[Output, ...], *, force: bool) -> list[Path]:
    """Write every file or none: existing ones are refused (all named) unless ``force``."""
    targets = [directory / f.name for f in files]
    existing = [str(t) for t in targets if t.exists() or t.is_symlink()]
    if existing and not force:
        raise InitRefused(f"refusing to overwrite {', '.join(existing)} (use --force)")
    directory.mkdir(parents=True, exist_ok=True)
    for target, output in zip(targets, files):
        _write_atomic(target, output.text, output.mode)
    return targets


def _write_atomic(target: Path, text: str, mode: int) -> None:
    # A temp file born with the final mode, renamed over the target: a secret is never
    # readable by others, not even for a moment, and an overwrite never leaves half a file.
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        os.fchmod(fd, mode & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


_NEXT_STEPS = {
    "coordinator": "edit [job], [plan] and the TLS paths; `meshgate certs init DIR` makes a development CA",
    "agent": f"put the token from `meshgate token create` into {JOIN_TOKEN_FILE} (mode 0600); edit coordinator and job",
    "systemd": "copy the units to /etc/systemd/system/ and the configs to /etc/meshgate/",
}


def cmd_init(args) -> int:
    directory = Path(args.dir)
    try:
        written = write_outputs(directory, outputs(args.what), force=args.force)
    except (InitRefused, data.DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"error: {exc.filename or directory}: {exc.strerror}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path} (mode {oct(path.stat().st_mode & 0o777)[2:]})")
    print(f"next: {_NEXT_STEPS[args.what]}")
    return 0


def add_parser(sub) -> None:
    init = sub.add_parser("init", help="write example configs or systemd units to a folder")
    init.add_argument("what", choices=("coordinator", "agent", "systemd"), help="which files")
    init.add_argument("--dir", default=".", help="where to write them (default: the current folder)")
    init.add_argument("--force", action="store_true", help="overwrite files that exist")
    init.set_defaults(func=cmd_init)
