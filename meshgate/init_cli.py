"""``meshgate init``: write the commented example configs and systemd units to a folder.

    meshgate init coordinator [--dir D] [--systemd] [--force]        D/coordinator.toml
    meshgate init agent [--dir D] [--systemd] [--force]              D/agent.toml, D/join-token (0600, empty)
        [--coordinator HOST:PORT] [--node-id ID ...] [--certs CA_DIR]
    meshgate init systemd [--dir D] [--force]       D/meshgate-coordinator.service, D/meshgate-agent.service
    meshgate init examples [--dir D] [--force]      D/plan-4.toml ... D/slurm/meshgate-job.sbatch (examples/)

The files come from the package (meshgate.data), so they match this version of meshgate.
The configs name their secret files (keys, join token) as files next to them, for a daemon
started by hand; ``--systemd`` names them where the units' LoadCredential= lines put them
instead (/run/credentials/<unit>/<id>). ``init agent`` fills [agent] coordinator and node_id
when given; with ``--node-id`` (one or several) it writes one folder per node (D/<node>/), and
``--certs`` copies each node's certificates from a ``meshgate certs init`` folder into
its tls/ (keys stay 0600), so a node's folder is complete but for its join token
(``meshgate token create --node-id ID --node-dirs D``); its hints are the commands to run
on the node.
The units' ExecStart= names the folder holding this meshgate's entry points when both are
there (a virtualenv's bin/), else the shipped /usr/local/bin.
Existing files are refused, all of them named, and nothing is written, unless --force.
"""

from __future__ import annotations

import json
import os
import re
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

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
    """The files ``meshgate init WHAT`` writes with no options but ``--systemd`` (pure: reads
    only the bundled templates); the units' ExecStart= runs the entry points in ``bin_dir``."""
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
    if what == "examples":
        return example_outputs()
    raise ValueError(f"init what must be coordinator, agent, systemd or examples, got {what!r}")


def example_outputs() -> tuple[Output, ...]:
    """examples/ as the wheel carries it (plans, job file, the Fabric and Ray scripts, the
    health check, the sbatch file), scripts with a #! line executable as in the checkout."""
    found: list[Output] = []

    def walk(folder, prefix: PurePosixPath) -> None:
        for entry in sorted(folder.iterdir(), key=lambda e: e.name):
            if entry.name.startswith((".", "__")):  # __init__.py, __pycache__: packaging's, not examples
                continue
            if entry.is_dir():
                walk(entry, prefix / entry.name)
            else:
                text = entry.read_text()
                found.append(Output(str(prefix / entry.name), text, 0o755 if text.startswith("#!") else PUBLIC_MODE))

    walk(data.directory(data.EXAMPLES), PurePosixPath())
    return tuple(found)


@dataclass(frozen=True)
class ConfigChoices:
    """What ``init coordinator`` / ``init agent`` fill in beyond the template."""

    systemd: bool = False  # secret files as the units' credentials, else the files themselves
    coordinator: str = ""  # [agent] coordinator
    node_id: str = ""  # [agent] node_id
    certs: Path | None = None  # a `meshgate certs init` folder to copy the node's certificates from


CONFIG_UNIT = {data.COORDINATOR_CONFIG: data.UNITS[0], data.AGENT_CONFIG: data.UNITS[1]}
CONFIG_DIR = PurePosixPath("/etc/meshgate")  # where the units read the configs and credential sources
_LOAD_CREDENTIAL = re.compile(r"^#?LoadCredential=([^:\s]+):(\S+)$", re.M)
_ADDRESS = re.compile(r"[A-Za-z0-9._:\[\]-]+(,[A-Za-z0-9._:\[\]-]+)*")


def config_outputs(what: str, choices: ConfigChoices = ConfigChoices()) -> tuple[Output, ...]:
    """The files ``meshgate init coordinator|agent`` writes for ``choices`` (pure but for
    reading the certificates ``choices.certs`` names)."""
    files = outputs(what)
    config = files[0]
    text = config.text
    if not choices.systemd:
        text = secret_paths_as_files(text, CONFIG_UNIT[config.name])
        if what == "coordinator":
            # Run by hand, it writes to a terminal; the unit's journal takes the JSON lines.
            text = _set_key(text, "log_format", json.dumps("text"))
    if what == "agent":
        text = _agent_settings(text, choices)
    copied = _certificates(choices) if what == "agent" and choices.certs is not None else ()
    return (Output(config.name, text, config.mode), *files[1:], *copied)


def secret_paths_as_files(config: str, unit: str) -> str:
    """``config`` with each /run/credentials/<unit>/<id> path replaced by the file the unit's
    LoadCredential= line copies it from, relative to the config's folder (tls/agent.key):
    a daemon started by hand reads the files themselves."""
    for ident, source in _LOAD_CREDENTIAL.findall(data.template(unit)):
        relative = PurePosixPath(source).relative_to(CONFIG_DIR)
        config = config.replace(f'"/run/credentials/{unit}/{ident}"', json.dumps(str(relative)))
    return config


def _agent_settings(text: str, choices: ConfigChoices) -> str:
    if choices.coordinator:
        if not _ADDRESS.fullmatch(choices.coordinator):
            raise ValueError(f"--coordinator must be HOST:PORT[,HOST:PORT...], got {choices.coordinator[:80]!r}")
        text = _set_key(text, "coordinator", json.dumps(choices.coordinator))
    if choices.node_id:
        from meshgate.tls import leaf_pair

        leaf_pair(".", "agent", choices.node_id)  # the node id an agent certificate can carry
        text = _set_key(text, "node_id", json.dumps(choices.node_id))
        # The template's labels are an example; a named node's real ones are the operator's.
        text = _set_key(text, "labels", None)
    return text


def _set_key(text: str, key: str, value: str | None) -> str:
    """The first ``key = ...`` line (live or commented out) set to ``value``, or commented
    out when ``value`` is None."""
    line = re.compile(rf"^#?\s*{re.escape(key)}\s*=.*$", re.M)
    match = line.search(text)
    if match is None:
        raise data.DataError(f"the bundled config has no {key} line")
    setting = f"{key} = {value}" if value is not None else "# " + match.group(0).lstrip("# ")
    return text[: match.start()] + setting + text[match.end() :]


def _certificates(choices: ConfigChoices) -> tuple[Output, ...]:
    """The node's certificates from a `meshgate certs init` folder, named as agent.toml's
    [agent] ca_file, cert_file, key_file, worker_cert_file and worker_key_file name them."""
    from meshgate.secret_files import read_secret
    from meshgate.tls import leaf_pair

    certs = Path(choices.certs)
    agent = leaf_pair(certs, "agent", choices.node_id)
    worker = leaf_pair(certs, "worker")
    copies = (
        ("tls/ca.pem", certs / "ca.pem"),
        ("tls/agent.pem", agent.cert),
        ("tls/agent.key", agent.key),
        ("tls/worker.pem", worker.cert),
        ("tls/worker.key", worker.key),
    )
    missing = [str(source) for _, source in copies if not source.is_file()]
    if missing:
        raise InitRefused(
            f"--certs {certs}: no {', '.join(missing)} (`meshgate certs init` or `certs issue` makes them)"
        )
    return tuple(
        Output(name, read_secret(source, "key").decode(), SECRET_MODE)
        if name.endswith(".key")
        else Output(name, source.read_text(), PUBLIC_MODE)
        for name, source in copies
    )


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
    for target, output in zip(targets, files):
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, output.text, output.mode)
    return targets


def write_atomic(target: Path, text: str, mode: int) -> None:
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


def next_steps(what: str, written: list[Path], choices: ConfigChoices, per_node: bool = False) -> list[str]:
    """What is left to do after ``init WHAT`` wrote ``written``: each step names a section and
    key, a file or a command of the files just written (tests/test_cli.py checks they exist).
    ``per_node``: ``init agent --node-id ...`` wrote one folder per node (DIR/ID/)."""
    if what == "examples":
        return [
            "a plan by its file: meshgate demo --plan plan-4.toml; meshgate plan show plan-8-tp-pp-hsdp.toml",
            "the launchers' scripts and the health check: docs/launchers.md and docs/operating.md "
            "(fabric_train.py, ray_train.py, slurm/meshgate-job.sbatch, health/cpu_check.py)",
        ]
    if what == "systemd":
        return [
            "copy the units to /etc/systemd/system/ and the configs to /etc/meshgate/, written with "
            "`meshgate init coordinator --systemd` / `meshgate init agent --systemd`: their secret files "
            "stay root-owned 0600 in /etc/meshgate and come in through the units' LoadCredential= lines"
        ]
    configs = [path for path in written if path.name in CONFIG_UNIT]
    if what == "coordinator":
        config = configs[0]
        server = _settings(config)["server"]
        files = [server[key] for key in ("ca_file", "cert_file", "key_file")]
        missing = [name for name in files if not (config.parent / name).is_file()]
        found = (
            f"missing {', '.join(missing)}: `meshgate certs init {config.parent / 'tls'} --host ADDRESS_AGENTS_DIAL` "
            "writes them"
            if missing
            else "all present"
        )
        steps = [f"[server] ca_file, cert_file and key_file: {', '.join(files)} next to {config.name} ({found})"]
        if choices.systemd:
            return steps + ["run it with the unit `meshgate init systemd` writes"]
        return steps + [f"start it: meshgate-coordinator --config {config}"]
    steps = []
    for config in configs:
        agent = _settings(config)["agent"]
        where = f"{config.parent}/" if per_node else ""
        if not choices.coordinator:
            steps.append(f"{where}{config.name}: set [agent] coordinator to the coordinator's HOST:PORT")
        if not choices.node_id:
            steps.append(f"{where}{config.name}: [agent] node_id is the hostname unless set (--node-id)")
        if choices.certs is None:
            keys = ("ca_file", "cert_file", "key_file", "worker_cert_file", "worker_key_file")
            steps.append(
                f"{where}{config.name}: [agent] {', '.join(keys)} name {', '.join(agent[key] for key in keys)}: "
                "--certs CA_DIR copies them from a `meshgate certs init` folder"
            )
    nodes = [_settings(config)["agent"].get("node_id", "NODE") for config in configs]
    if per_node:
        # Folders made on the head for the nodes: the token goes into each, the folder to its
        # node, and the rest are the commands to type there (never paths of the head's).
        ids = " ".join(f"--node-id {node}" for node in nodes)
        steps.append(f"meshgate token create {ids} --node-dirs {configs[0].parent.parent}   ([agent] join_token_file)")
        node = "NODE" if len(nodes) > 1 else nodes[0]
        steps.append(
            f"copy {'each' if len(nodes) > 1 else 'the'} node's folder to that node as {CONFIG_DIR} "
            f"(scp -rp {node} root@{node}:{CONFIG_DIR}, onto a node without one)"
        )
        on = "on each node" if len(nodes) > 1 else f"on {nodes[0]}"
        config = CONFIG_DIR / data.AGENT_CONFIG
    else:
        token = configs[0].parent / JOIN_TOKEN_FILE
        steps.append(f"meshgate token create --node-id {nodes[0]} --out {token}   ([agent] join_token_file)")
        on, config = "on the node", configs[0]
    agent = _settings(configs[0])["agent"]
    steps.append(
        f"{on}, the [agent] run_as user: "
        f"useradd --system --create-home --home-dir /var/lib/{agent['run_as']} {agent['run_as']}"
    )
    steps.append(
        f"{on}, run it with the unit `meshgate init systemd` writes"
        if choices.systemd
        else f"{on}, start it: meshgate-agent --config {config}"
    )
    return steps


def _settings(config: Path) -> dict:
    import tomllib

    return tomllib.loads(config.read_text())


def cmd_init(args) -> int:
    directory = Path(args.dir)
    node_ids = args.node_id or [""]
    agent_only = [
        flag
        for flag, given in (("--coordinator", args.coordinator), ("--node-id", args.node_id), ("--certs", args.certs))
        if given
    ]
    if args.what != "agent" and agent_only:
        print(f"error: {', '.join(agent_only)}: only for `meshgate init agent`", file=sys.stderr)
        return 2
    if args.what in ("systemd", "examples") and args.systemd:
        print(
            "error: --systemd is for the configs (init coordinator|agent)",
            file=sys.stderr,
        )
        return 2
    try:
        if args.what == "examples":
            written, choices = write_outputs(directory, example_outputs(), force=args.force), ConfigChoices()
        elif args.what == "systemd":
            bin_dir = entry_point_dir()
            written = write_outputs(directory, outputs("systemd", bin_dir), force=args.force)
            choices = ConfigChoices()
        else:
            files, choices = [], ConfigChoices()
            for node in node_ids:
                choices = ConfigChoices(
                    systemd=args.systemd,
                    coordinator=args.coordinator or "",
                    node_id=node,
                    certs=Path(args.certs) if args.certs else None,
                )
                # One folder per node whenever ids are given, one id or many: files made on
                # the head for a node never land beside the head's own (its tls/ca.pem ...).
                folder = node
                files += [
                    Output(str(PurePosixPath(folder, f.name)), f.text, f.mode)
                    for f in config_outputs(args.what, choices)
                ]
            written = write_outputs(directory, tuple(files), force=args.force)
    except (InitRefused, data.DataError, ValueError) as exc:
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
    steps = next_steps(args.what, written, choices, per_node=bool(args.node_id))
    print("next:" + "".join(f"\n  {number}. {step}" for number, step in enumerate(steps, 1)))
    return 0


def add_parser(sub) -> None:
    init = sub.add_parser("init", help="write example configs, systemd units or the examples to a folder")
    init.add_argument("what", choices=("coordinator", "agent", "systemd", "examples"), help="which files")
    init.add_argument("--dir", default=".", help="where to write them (default: the current folder)")
    init.add_argument("--force", action="store_true", help="overwrite files that exist")
    init.add_argument(
        "--systemd",
        action="store_true",
        help="configs: name the secret files where the units' LoadCredential= puts them (default: the files)",
    )
    init.add_argument("--coordinator", help="agent: [agent] coordinator, HOST:PORT (or an HA list a:7443,b:7443)")
    init.add_argument(
        "--node-id",
        action="append",
        metavar="ID",
        help="agent: [agent] node_id; repeat for one folder per node (DIR/ID/)",
    )
    init.add_argument(
        "--certs", metavar="CA_DIR", help="agent: copy the node's certificates from this `certs init` folder"
    )
    init.set_defaults(func=cmd_init)
