"""``meshgate init``: write the commented example configs and systemd units to a folder.

    meshgate init coordinator [--dir D] [--force]   D/coordinator.toml
    meshgate init agent [--dir D] [--force]         D/agent.toml, D/join-token (0600, empty)
    meshgate init systemd [--dir D] [--force]       D/meshgate-coordinator.service, D/meshgate-agent.service

The files come from the package (meshgate.data), so they match this version of meshgate.
The units' ExecStart= names the folder holding this meshgate's entry points when both are
there (a virtualenv's bin/), else the shipped /usr/local/bin.
Existing files are refused, all of them named, and nothing is written, unless --force.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from meshgate import data

PUBLIC_MODE = 0o644
SECRET_MODE = 0o600
JOIN_TOKEN_FILE = "join-token"  # what the example agent.toml's join_token_file names
SHIPPED_BIN_DIR = Path("/usr/local/bin")  # where the shipped units' ExecStart= looks
ENTRY_POINTS = ("meshgate-coordinator", "meshgate-agent")
# A folder systemd takes in ExecStart= as it is: no quoting, no specifier (%) or $ expansion.
_PLAIN_PATH = re.compile(r"/[A-Za-z0-9/._+-]*")


@dataclass(frozen=True)
class Output:
    name: str
    text: str
    mode: int


def outputs(what: str, bin_dir: Path = SHIPPED_BIN_DIR) -> tuple[Output, ...]:
    """The files ``meshgate init WHAT`` writes (pure: reads only the bundled templates);
    the units' ExecStart= runs the entry points in ``bin_dir``."""
    if what == "coordinator":
        return (Output(data.COORDINATOR_CONFIG, data.template(data.COORDINATOR_CONFIG), PUBLIC_MODE),)
    if what == "agent":
        return (
            Output(data.AGENT_CONFIG, data.template(data.AGENT_CONFIG), PUBLIC_MODE),
            # Paste the token from `meshgate token create` here: the file is a secret.
            Output(JOIN_TOKEN_FILE, "", SECRET_MODE),
        )
    if what == "systemd":
        return tuple(Output(unit, _with_bin_dir(data.template(unit), bin_dir), PUBLIC_MODE) for unit in data.UNITS)
    raise ValueError(f"init what must be coordinator, agent or systemd, got {what!r}")


def _with_bin_dir(unit: str, bin_dir: Path) -> str:
    if not _PLAIN_PATH.fullmatch(str(bin_dir)):
        raise ValueError(f"bin_dir must be an absolute path systemd needs no quoting for, got {str(bin_dir)!r}")
    for name in ENTRY_POINTS:
        unit = unit.replace(f"ExecStart={SHIPPED_BIN_DIR / name} ", f"ExecStart={bin_dir / name} ")
    return unit


def entry_point_dir(scripts: Path | None = None) -> Path:
    """The folder the units should run meshgate from: this interpreter's scripts folder
    when both entry points are in it and systemd can take its name as it is, else the
    shipped /usr/local/bin (then ExecStart= may need editing)."""
    scripts = Path(scripts or sysconfig.get_path("scripts"))
    if _PLAIN_PATH.fullmatch(str(scripts)) and all((scripts / name).is_file() for name in ENTRY_POINTS):
        return scripts
    return SHIPPED_BIN_DIR


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
    "systemd": "copy the units to /etc/systemd/system/ and the configs to /etc/meshgate/; "
    "secret files stay root-owned 0600 in /etc/meshgate (the units' LoadCredential= lines)",
}


def cmd_init(args) -> int:
    directory = Path(args.dir)
    try:
        bin_dir = entry_point_dir() if args.what == "systemd" else SHIPPED_BIN_DIR
        written = write_outputs(directory, outputs(args.what, bin_dir), force=args.force)
    except (InitRefused, data.DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"error: {exc.filename or directory}: {exc.strerror}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path} (mode {oct(path.stat().st_mode & 0o777)[2:]})")
    if args.what == "systemd":
        runs = f"ExecStart= runs {bin_dir / ENTRY_POINTS[0]} and {bin_dir / ENTRY_POINTS[1]}"
        if not all((bin_dir / name).is_file() for name in ENTRY_POINTS):
            runs += " (not there on this host: edit ExecStart=)"
        print(runs)
    print(f"next: {_NEXT_STEPS[args.what]}")
    return 0


def add_parser(sub) -> None:
    init = sub.add_parser("init", help="write example configs or systemd units to a folder")
    init.add_argument("what", choices=("coordinator", "agent", "systemd"), help="which files")
    init.add_argument("--dir", default=".", help="where to write them (default: the current folder)")
    init.add_argument("--force", action="store_true", help="overwrite files that exist")
    init.set_defaults(func=cmd_init)
