"""The node agent started exactly as its shipped systemd unit deploys it, for tests.

``deploy/systemd/meshgate-agent.service`` is read, never copied: every key of its
[Service] section is either reproduced here (``REPRODUCED``: what stands in for it) or
listed in ``NOT_REPRODUCED`` with the reason; any other key fails the fixture with a
message naming it (``UnitDrift``), so the unit and these tests cannot drift apart.

What a test gets (a real root-only set-up, skipped only where it cannot be had):

* ``ShippedHost`` (module scope, fixture ``shipped_host``): real users made with useradd
  (the agent user stands in for ``User=``, the job user for agent.toml's ``run_as``, both
  with random names), the unit's missing ``SupplementaryGroups=`` made with groupadd, an
  interpreter those users can execute (Debian's python3.11 in a venv whose .pth adds the
  project venv's packages) with the ``meshgate-agent`` entry point in its bin/, and a
  cgroup v2 directory under the test process's own cgroup. All removed after, whatever
  happens.
* ``ShippedCluster(host, nodes=("n0",))`` (fixture ``shipped_cluster``): a plaintext
  jobs-mode coordinator and one agent
  per node, each started as the unit starts it: its own mount namespace
  (``unshare --mount --propagation private``) with the unit's read-only mounts, placed in
  a delegated cgroup before it execs, ``umask``, then ``setpriv`` to the unit's uid, gid,
  groups and capabilities with no_new_privs, running ``<entry point> --config
  <agent.toml>``, with systemd's environment only, and waited for until it says READY=1
  on its NOTIFY_SOCKET (Type=notify). Each node has a directory standing in for its
  root file system: the unit's /etc/meshgate, /var/lib/<StateDirectory> and
  /run/credentials/<unit> are re-rooted there (``ShippedAgent.host_path``), and its own
  /etc/machine-id is bound over this host's (``ShippedAgent.machine_id_path``).

The agent.toml written for a node is deploy/systemd/agent.toml's [agent] table, its paths
under those directories re-rooted, with only ``agent_overrides`` changed.

``ShippedCluster(host, nodes, tls=True)``: the coordinator under mTLS (a dev CA,
``cluster.ca``; the admin's client TLS, ``cluster.admin_tls``) and agents that keep the
shipped agent.toml's TLS keys, their files staged where it names them (the keys through
LoadCredential=). The coordinator serves metrics at ``cluster.metrics_url`` either way.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import pwd
import grp
import secrets
import shlex
import shutil
import socket
import struct
import subprocess
import sysconfig
import tempfile
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

from conftest import REPO, RunningCoordinator, _spawn, _wait_for_address, free_port, write_config

UNIT = REPO / "deploy" / "systemd" / "meshgate-agent.service"
AGENT_TOML = REPO / "deploy" / "systemd" / "agent.toml"
SYSTEM_PYTHON = "/usr/bin/python3.11"

# ---- the unit's [Service] keys: reproduced, or not and why ------------------------------------

# What stands in for each key this module reproduces (``ShippedUnit`` reads each of them).
REPRODUCED = {
    "Type": "notify: start_agent waits for READY=1 on a NOTIFY_SOCKET of its own (abstract namespace)",
    "NotifyAccess": "main: a notification counts only from the main pid (SCM_CREDENTIALS)",
    "ExecStart": "the same argv, its entry point swapped for the one in an interpreter the agent user can run",
    "KillMode": "mixed: SIGTERM to the main process, then whatever is left in its cgroup is killed (cgroup.kill)",
    "TimeoutStopSec": "how long stop() waits after SIGTERM before the kill",
    "Delegate": "a cgroup v2 directory under the test's own, chowned to the agent user as systemd delegates",
    "User": "a user made with useradd (random name)",
    "Group": "the user's own group (when it names the User=), else an existing group or one made with groupadd",
    "SupplementaryGroups": "the named groups (made with groupadd when missing, removed after) and the user's own",
    "AmbientCapabilities": "setpriv --inh-caps and --ambient-caps",
    "CapabilityBoundingSet": "setpriv --bounding-set",
    "LoadCredential": "each source (re-rooted) copied into the node's credentials dir, 0400, the agent user's",
    "StateDirectory": "a directory re-rooted in the node's root, the agent user's (state_dir in agent.toml)",
    "StateDirectoryMode": "that directory's mode",
    "ConfigurationDirectory": "a directory re-rooted in the node's root, holding agent.toml",
    "UMask": "umask in the wrapper before it execs",
    "NoNewPrivileges": "setpriv --no-new-privs",
    "ProtectSystem": "read-only bind mounts in the agent's mount namespace (yes, full, strict)",
    "ReadWritePaths": "left writable under ProtectSystem=strict (re-rooted paths, '-' for optional)",
    "ProtectHome": "read-only (read-only), or empty inaccessible (yes) / read-only (tmpfs) tmpfs mounts",
    "PrivateTmp": "a private tmpfs on /tmp and /var/tmp in the agent's mount namespace",
    "ProtectKernelTunables": "read-only /proc/sys, /sys and kin; the cgroup mounts stay writable, as in systemd",
    "Environment": "added to the agent's environment (systemd's own variables otherwise, nothing inherited)",
}

# Keys of the unit these tests do not reproduce, and why. ONE table: a key the unit gains
# must be added to REPRODUCED (and reproduced) or here, or the fixture fails.
NOT_REPRODUCED = {
    "Restart": "a test wants to see the agent's exit, never a restart behind its back; it calls start_agent again",
    "RestartSec": "no restarts (Restart=)",
    "LimitNOFILE": "root here lacks CAP_SYS_RESOURCE: prlimit cannot raise the hard limit "
    "('failed to set the NOFILE resource limit: Operation not permitted')",
    "LimitMEMLOCK": "as LimitNOFILE: raising a hard limit needs CAP_SYS_RESOURCE",
    "ProtectKernelModules": "a seccomp filter and inaccessible module dirs; CapabilityBoundingSet already "
    "drops CAP_SYS_MODULE",
    "RestrictNamespaces": "a seccomp filter (setpriv sets none)",
    "LockPersonality": "a seccomp filter (setpriv sets none)",
}


class UnitDrift(AssertionError):
    """The unit has a key (or a value) these tests neither reproduce nor list as not reproduced."""


def parse_service(path: Path = UNIT) -> dict[str, list[str]]:
    """The [Service] section: key -> its values in order (a repeated key accumulates; an
    empty assignment resets it, as systemd reads list settings)."""
    section, service = None, {}
    lines = path.read_text(encoding="utf-8").splitlines()
    joined, pending = [], ""
    for line in lines:
        stripped = line.strip()
        if not pending and (not stripped or stripped[0] in "#;"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        joined.append(pending + stripped)
        pending = ""
    for line in joined:
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        if "=" not in line:
            raise UnitDrift(f"{path}: cannot read the line {line!r}")
        key, value = (part.strip() for part in line.split("=", 1))
        if section != "Service":
            continue
        if value == "":
            service[key] = []
        else:
            service.setdefault(key, []).append(value)
    return service


def check_keys(service: dict[str, list[str]], path: Path = UNIT) -> None:
    unknown = sorted(set(service) - set(REPRODUCED) - set(NOT_REPRODUCED))
    if unknown:
        raise UnitDrift(
            f"{path} [Service] has key(s) {unknown} that tests/shipped.py neither reproduces (REPRODUCED) "
            "nor lists in NOT_REPRODUCED with the reason: reproduce each or list it there"
        )


# The kernel's capability numbers (linux/capability.h), by setpriv's names.
CAPABILITIES = (
    "chown dac_override dac_read_search fowner fsetid kill setgid setuid setpcap linux_immutable "
    "net_bind_service net_broadcast net_admin net_raw ipc_lock ipc_owner sys_module sys_rawio sys_chroot "
    "sys_ptrace sys_pacct sys_admin sys_boot sys_nice sys_resource sys_time sys_tty_config mknod lease "
    "audit_write audit_control setfcap mac_override mac_admin syslog wake_alarm block_suspend audit_read "
    "perfmon bpf checkpoint_restore"
).split()


def cap_mask(names: tuple[str, ...]) -> int:
    return sum(1 << CAPABILITIES.index(name) for name in names)


def _bool(key: str, value: str) -> bool:
    if value.lower() in ("yes", "true", "on", "1"):
        return True
    if value.lower() in ("no", "false", "off", "0"):
        return False
    raise UnitDrift(f"[Service] {key}={value}: not a boolean these tests understand")


def _one(service: dict[str, list[str]], key: str, default: Optional[str] = None) -> Optional[str]:
    values = service.get(key) or ([] if default is None else [default])
    return values[-1] if values else None


def _caps(key: str, values: list[str]) -> tuple[str, ...]:
    names: list[str] = []
    for value in values:
        for word in value.split():
            if word.startswith("~") or not word.upper().startswith("CAP_"):
                raise UnitDrift(f"[Service] {key}={value}: only a plain list of CAP_* is reproduced")
            name = word[4:].lower()
            if name not in CAPABILITIES:
                raise UnitDrift(f"[Service] {key}: unknown capability {word}")
            if name not in names:
                names.append(name)
    return tuple(names)


def _seconds(key: str, value: str) -> float:
    units = {"ms": 0.001, "s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "": 1.0}
    number = value.rstrip("abcdefghijklmnopqrstuvwxyz")
    suffix = value[len(number) :]
    if suffix not in units:
        raise UnitDrift(f"[Service] {key}={value}: a time these tests cannot read")
    return float(number) * units[suffix]


@dataclass(frozen=True)
class ShippedUnit:
    """What the agent's unit says, read from the file (never hard-coded here)."""

    path: Path
    name: str
    service: dict
    exec_start: tuple[str, ...]
    type: str
    notify_access: str
    kill_mode: str
    timeout_stop_s: float
    delegate: bool
    user: str
    group: str
    supplementary_groups: tuple[str, ...]
    ambient_caps: tuple[str, ...]
    bounding_caps: Optional[tuple[str, ...]]  # None: the full set (the key is absent)
    credentials: tuple[tuple[str, str], ...]  # (id, source path)
    state_directory: str
    state_directory_mode: int
    configuration_directory: str
    umask: int
    no_new_privileges: bool
    protect_system: str
    read_write_paths: tuple[str, ...]
    protect_home: str
    private_tmp: bool
    protect_kernel_tunables: bool
    environment: tuple[tuple[str, str], ...]

    @classmethod
    def load(cls, path: Path = UNIT) -> "ShippedUnit":
        service = parse_service(path)
        check_keys(service, path)
        exec_start = _one(service, "ExecStart")
        if not exec_start or exec_start[0] in "-@:+!|":
            raise UnitDrift(f"[Service] ExecStart={exec_start}: one plain command line is reproduced")
        kind = _one(service, "Type", "simple")
        if kind not in ("simple", "exec", "notify"):
            raise UnitDrift(f"[Service] Type={kind}: not reproduced (simple, exec, notify are)")
        notify_access = _one(service, "NotifyAccess", "main" if kind == "notify" else "none")
        if notify_access not in ("none", "main", "all"):
            raise UnitDrift(f"[Service] NotifyAccess={notify_access}: not reproduced")
        kill_mode = _one(service, "KillMode", "control-group")
        if kill_mode not in ("control-group", "mixed", "process"):
            raise UnitDrift(f"[Service] KillMode={kill_mode}: not reproduced")
        credentials = []
        for value in service.get("LoadCredential", []):
            ident, _, source = value.partition(":")
            if not source.startswith("/"):
                raise UnitDrift(f"[Service] LoadCredential={value}: only ID:/absolute/path is reproduced")
            credentials.append((ident, source))
        state = service.get("StateDirectory", [])
        if len(state) > 1 or (state and len(state[0].split()) != 1):
            raise UnitDrift(f"[Service] StateDirectory={state}: one directory is reproduced")
        config_dir = service.get("ConfigurationDirectory", [])
        if len(config_dir) > 1 or (config_dir and len(config_dir[0].split()) != 1):
            raise UnitDrift(f"[Service] ConfigurationDirectory={config_dir}: one directory is reproduced")
        protect_system = _one(service, "ProtectSystem", "no")
        protect_system = {"true": "yes", "false": "no"}.get(protect_system, protect_system)
        if protect_system not in ("no", "yes", "full", "strict"):
            raise UnitDrift(f"[Service] ProtectSystem={protect_system}: not reproduced")
        protect_home = _one(service, "ProtectHome", "no")
        protect_home = {"true": "yes", "false": "no"}.get(protect_home, protect_home)
        if protect_home not in ("no", "yes", "read-only", "tmpfs"):
            raise UnitDrift(f"[Service] ProtectHome={protect_home}: not reproduced")
        environment = []
        for value in service.get("Environment", []):
            for word in shlex.split(value):
                name, _, val = word.partition("=")
                environment.append((name, val))
        user = _one(service, "User")
        if not user:
            raise UnitDrift("[Service] User= is missing: the agent runs as a named user, never root")
        return cls(
            path=path,
            name=path.name,
            service=service,
            exec_start=tuple(shlex.split(exec_start)),
            type=kind,
            notify_access=notify_access,
            kill_mode=kill_mode,
            timeout_stop_s=_seconds("TimeoutStopSec", _one(service, "TimeoutStopSec", "90s")),
            delegate=_bool("Delegate", _one(service, "Delegate", "no")),
            user=user,
            group=_one(service, "Group", user),
            supplementary_groups=tuple(w for v in service.get("SupplementaryGroups", []) for w in v.split()),
            ambient_caps=_caps("AmbientCapabilities", service.get("AmbientCapabilities", [])),
            bounding_caps=(
                _caps("CapabilityBoundingSet", service["CapabilityBoundingSet"])
                if "CapabilityBoundingSet" in service
                else None
            ),
            credentials=tuple(credentials),
            state_directory=state[0] if state else "",
            state_directory_mode=int(_one(service, "StateDirectoryMode", "0755"), 8),
            configuration_directory=config_dir[0] if config_dir else "",
            umask=int(_one(service, "UMask", "0022"), 8),
            no_new_privileges=_bool("NoNewPrivileges", _one(service, "NoNewPrivileges", "no")),
            protect_system=protect_system,
            read_write_paths=tuple(w for v in service.get("ReadWritePaths", []) for w in v.split()),
            protect_home=protect_home,
            private_tmp=_bool("PrivateTmp", _one(service, "PrivateTmp", "no")),
            protect_kernel_tunables=_bool("ProtectKernelTunables", _one(service, "ProtectKernelTunables", "no")),
            environment=tuple(environment),
        )

    @property
    def credentials_dir(self) -> str:
        return f"/run/credentials/{self.name}"

    @property
    def state_path(self) -> str:
        return f"/var/lib/{self.state_directory}" if self.state_directory else ""

    def rerooted_prefixes(self) -> tuple[str, ...]:
        """The unit's own directories: a node's test root stands in for each."""
        found = [self.credentials_dir]
        if self.state_directory:
            found.append(self.state_path)
        if self.configuration_directory:
            found.append(f"/etc/{self.configuration_directory}")
        return tuple(found)


# ---- the agent.toml a test node gets -------------------------------------------------------------

TLS_ONLY_KEYS = ("ca_file", "cert_file", "key_file", "require_client_cert", "server_name")


def agent_overrides(
    coordinator: str, node_id: str, job_user: str, extra: Optional[dict] = None, tls: bool = False
) -> tuple[dict, tuple[str, ...]]:
    """THE list of what a test node's agent.toml changes from deploy/systemd/agent.toml
    (besides re-rooting the unit's directories into the node's root): (set, removed).

    * coordinator: the test's coordinator; node_id: the test's node; run_as: the job user
      made for the test (the shipped "meshgate-job" is no user here);
    * insecure = true, and the TLS keys removed (a TLS key beside insecure is refused): the
      test coordinator is plaintext. worker_cert_file/worker_key_file stay: a plaintext agent
      never reads them. With ``tls`` (an mTLS coordinator: ``ShippedCluster(tls=True)``)
      neither: the TLS keys stay as shipped, their files staged where they name
      (``ShippedAgent.stage_tls``);
    * the join token is not here: it comes, as shipped, through LoadCredential= from the
      node's (re-rooted) /etc/meshgate/join-token;
    * metrics_listen = "127.0.0.1:0": the shipped port, once per host, would collide between
      a cluster's nodes;
    * ``extra``: what one test needs on top (empty by default)."""
    values = {"coordinator": coordinator, "node_id": node_id, "run_as": job_user}
    # metrics_listen: any free port on loopback, not the shipped ":9465": several test nodes
    # share this host (tests/test_shipped_configs.py checks the shipped one against the pack).
    values["metrics_listen"] = "127.0.0.1:0"
    if not tls:
        values["insecure"] = True
    values.update(extra or {})
    return values, () if tls else TLS_ONLY_KEYS


# ---- the host: users, groups, interpreter, cgroup ------------------------------------------------


def _as_user(user: pwd.struct_passwd, argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, user=user.pw_uid, group=user.pw_gid, extra_groups=[], cwd="/", capture_output=True, text=True, timeout=60
    )


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")


def cgroup2_mount() -> Optional[Path]:
    """Where cgroup2 is mounted, from /proc/self/mounts (never assumed)."""
    with open("/proc/self/mounts", encoding="utf-8") as handle:
        for line in handle:
            fields = line.split()
            if len(fields) > 2 and fields[2] == "cgroup2":
                return Path(fields[1].replace("\\040", " "))
    return None


def own_cgroup() -> Optional[str]:
    with open("/proc/self/cgroup", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("0::"):
                return line[3:].strip()
    return None


# What systemd hands a delegated service (the directory and these files), where present.
DELEGATED_FILES = ("cgroup.procs", "cgroup.threads", "cgroup.subtree_control", "memory.oom.group", "memory.reclaim")


def delegate_cgroup(path: Path, uid: int, gid: int) -> Path:
    path.mkdir()
    os.chown(path, uid, gid)
    for name in DELEGATED_FILES:
        if (path / name).exists():
            os.chown(path / name, uid, gid)
    return path


def remove_cgroup_tree(path: Path, timeout: float = 30.0) -> None:
    """Kill every process under ``path`` and remove it, deepest first."""
    if not path.exists():
        return
    if (path / "cgroup.kill").exists():
        (path / "cgroup.kill").write_text("1")
    deadline = time.monotonic() + timeout
    while "populated 1" in (path / "cgroup.events").read_text():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} still holds processes {timeout}s after cgroup.kill")
        time.sleep(0.02)
    for sub in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        sub.rmdir()
    path.rmdir()


@dataclass
class ShippedHost:
    """What one test module shares: the users, groups, interpreter and cgroup (all made here)."""

    unit: ShippedUnit
    root: Path
    agent_user: pwd.struct_passwd
    job_user: pwd.struct_passwd
    group_gid: int
    supplementary_gids: tuple[int, ...]
    python: str
    entry_point: str
    cgroup: Optional[Path]
    created_users: list[str] = field(default_factory=list)
    created_groups: list[str] = field(default_factory=list)

    @property
    def groups(self) -> tuple[int, ...]:
        """The agent's groups as systemd sets them: the user's own (initgroups) and SupplementaryGroups=."""
        own = os.getgrouplist(self.agent_user.pw_name, self.group_gid)
        return tuple(dict.fromkeys([*own, *self.supplementary_gids]))

    @classmethod
    @contextlib.contextmanager
    def create(cls, unit_path: Path = UNIT):
        """Skips where it truly cannot run; removes everything it made, whatever happens."""
        unit = ShippedUnit.load(unit_path)  # a drifted unit fails here, before any skip
        if os.geteuid() != 0:
            pytest.skip("the shipped agent fixture needs root (useradd, setpriv, mounts, cgroups)")
        missing = [
            t for t in ("useradd", "userdel", "groupadd", "groupdel", "setpriv", "unshare") if not shutil.which(t)
        ]
        if missing:
            pytest.skip(f"the shipped agent fixture needs {missing}")
        if not os.path.exists(SYSTEM_PYTHON):
            pytest.skip(f"{SYSTEM_PYTHON} is not installed (an interpreter other users can execute)")
        cgroup = None
        if unit.delegate:
            mount, own = cgroup2_mount(), own_cgroup()
            if mount is None or own is None:
                pytest.skip("no cgroup2 mounted (/proc/self/mounts) or this process is in none: Delegate=yes")
            cgroup = mount / own.lstrip("/") / f"mg-shipped-{secrets.token_hex(4)}"
            try:
                cgroup.mkdir()
            except OSError as exc:
                pytest.skip(f"cgroup v2 at {cgroup.parent} is not writable: {exc}")
            if not (cgroup / "cgroup.kill").exists():
                cgroup.rmdir()
                pytest.skip("cgroup v2 has no cgroup.kill (kernel older than 5.14): the agent needs it")
        # Not under /tmp: PrivateTmp= would hide it from the agent. 0755: users traverse it.
        root = Path(tempfile.mkdtemp(prefix="mg-shipped-", dir="/var/lib"))
        root.chmod(0o755)
        made_users: list[str] = []
        made_groups: list[str] = []
        try:
            tag = secrets.token_hex(3)
            for name in (f"mgagent{tag}", f"mgjob{tag}"):
                _run(
                    [
                        "useradd",
                        "--system",
                        "--user-group",
                        "--no-create-home",
                        "--home-dir",
                        "/nonexistent",
                        "--shell",
                        "/usr/sbin/nologin",
                        name,
                    ]
                )
                made_users.append(name)
            agent_user, job_user = pwd.getpwnam(made_users[0]), pwd.getpwnam(made_users[1])
            if unit.group == unit.user:
                group_gid = agent_user.pw_gid
            else:
                group_gid = cls._group(unit.group, made_groups)
            supplementary = tuple(cls._group(name, made_groups) for name in unit.supplementary_groups)
            python, entry_point = cls._interpreter(root, agent_user, unit)
            host = cls(unit, root, agent_user, job_user, group_gid, supplementary, python, entry_point, cgroup)
            host.created_users, host.created_groups = made_users, made_groups
            yield host
        finally:
            errors = []
            if cgroup is not None:
                try:
                    remove_cgroup_tree(cgroup)
                except (OSError, RuntimeError) as exc:
                    errors.append(str(exc))
            for name in made_users:
                if subprocess.run(["userdel", "--force", name], capture_output=True).returncode != 0:
                    errors.append(f"userdel {name} failed")
            for name in made_groups:
                if subprocess.run(["groupdel", name], capture_output=True).returncode != 0:
                    errors.append(f"groupdel {name} failed")
            shutil.rmtree(root, ignore_errors=True)
            if errors:
                raise RuntimeError("the shipped host was not cleaned up: " + "; ".join(errors))

    def as_agent_user(self, argv: list[str]) -> subprocess.CompletedProcess:
        """``argv`` as the agent's user (no capabilities): what any process of that uid may do."""
        return _as_user(self.agent_user, argv)

    def add_job_user(self) -> pwd.struct_passwd:
        """Another job user (removed with the host): for a second agent on this host."""
        name = f"mgjob{secrets.token_hex(3)}"
        _run(["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent", name])
        self.created_users.append(name)
        return pwd.getpwnam(name)

    def add_user(self, prefix: str = "mguser", groups: tuple[int, ...] = ()) -> pwd.struct_passwd:
        """Another system user (removed with the host), in ``groups`` (gids) besides its own:
        neither the agent's nor a job user, one who runs something beside the agents by hand
        (Ray's nodes, torchrun)."""
        name = f"{prefix}{secrets.token_hex(3)}"
        argv = ["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent"]
        if groups:
            argv += ["--groups", ",".join(str(g) for g in groups)]
        _run(argv + [name])
        self.created_users.append(name)
        return pwd.getpwnam(name)

    @staticmethod
    def _group(name: str, made: list[str]) -> int:
        try:
            return grp.getgrnam(name).gr_gid
        except KeyError:
            pass
        _run(["groupadd", "--system", name])
        made.append(name)
        return grp.getgrnam(name).gr_gid

    @staticmethod
    def _interpreter(root: Path, agent_user: pwd.struct_passwd, unit: ShippedUnit) -> tuple[str, str]:
        """Debian's python3.11 in a venv that reads the project venv's packages, and
        ExecStart's entry point in its bin/ (as pip writes one: the interpreter swapped)."""
        venv = root / "python"
        _run([SYSTEM_PYTHON, "-m", "venv", "--without-pip", str(venv)])
        site = Path(sysconfig.get_paths()["purelib"])
        (next(venv.glob("lib/python3*/site-packages")) / "meshgate-venv.pth").write_text(
            f"import site; site.addsitedir({str(site)!r})\n"
        )
        python = str(venv / "bin" / "python")
        name = Path(unit.exec_start[0]).name
        scripts = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == name]
        if not scripts:
            raise UnitDrift(f"[Service] ExecStart={unit.exec_start[0]}: no console script {name!r} is installed")
        module, _, function = scripts[0].value.partition(":")
        entry = venv / "bin" / name
        entry.write_text(
            f"#!{python}\nimport sys\nfrom {module} import {function}\n"
            f"if __name__ == '__main__':\n    sys.exit({function}())\n"
        )
        entry.chmod(0o755)
        probe = _as_user(agent_user, [python, "-c", f"import {module}"])
        if probe.returncode != 0:
            pytest.skip(f"the agent user cannot import {module} with {python}: {probe.stderr[-400:]}")
        return python, str(entry)


# ---- one agent, started as the unit starts it -------------------------------------------------------


class AgentExited(AssertionError):
    """The agent's process exited while a test waited on it (its log's tail in the message)."""


def _mountpoints() -> list[str]:
    points = []
    with open("/proc/self/mountinfo", encoding="utf-8") as handle:
        for line in handle:
            points.append(line.split()[4].replace("\\040", " "))
    return list(dict.fromkeys(points))


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix.rstrip("/") + "/")


API_FILE_SYSTEMS = ("/dev", "/proc", "/sys")
KERNEL_TUNABLES = (
    "/proc/sys",
    "/proc/sysrq-trigger",
    "/proc/latency_stats",
    "/proc/acpi",
    "/proc/timer_stats",
    "/proc/asound",
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/sys",
)


def mount_commands(unit: ShippedUnit, writable: list[str]) -> list[str]:
    """The shell commands (run as root in the agent's fresh mount namespace) for the unit's
    ProtectSystem=, ReadWritePaths=, ProtectHome=, PrivateTmp=, ProtectKernelTunables=."""
    q = shlex.quote
    mountpoints = _mountpoints()
    commands: list[str] = []

    def read_only(path: str) -> None:
        if not os.path.lexists(path):
            return
        if path not in mountpoints:  # a bind of itself first (recursive: keeps what is mounted below)
            commands.append(f"mount --rbind {q(path)} {q(path)}")
        commands.append(f"mount -o remount,bind,ro {q(path)}")

    if unit.protect_system == "strict":
        for path in writable:
            commands.append(f"mount --bind {q(path)} {q(path)}")
        for point in mountpoints:
            if any(_under(point, api) for api in API_FILE_SYSTEMS) or any(_under(point, w) for w in writable):
                continue
            commands.append(f"mount -o remount,bind,ro {q(point)}")
    elif unit.protect_system in ("yes", "full"):
        for path in ("/usr", "/boot", "/efi") + (("/etc",) if unit.protect_system == "full" else ()):
            read_only(path)
    for path in ("/home", "/root", "/run/user"):
        if not os.path.isdir(path) or unit.protect_home == "no":
            continue
        if unit.protect_home == "read-only":
            read_only(path)
        else:  # yes: inaccessible; tmpfs: empty and read-only
            mode = "000" if unit.protect_home == "yes" else "755"
            commands.append(f"mount -t tmpfs -o ro,nosuid,nodev,mode={mode} tmpfs {q(path)}")
    if unit.protect_kernel_tunables:
        cgroups = [p for p in mountpoints if _under(p, "/sys/fs/cgroup")]
        for path in KERNEL_TUNABLES:
            if path == "/sys":
                for point in mountpoints:
                    if _under(point, "/sys") and not any(_under(point, c) for c in cgroups):
                        commands.append(f"mount -o remount,bind,ro {q(point)}")
            else:
                read_only(path)
    if unit.private_tmp:
        for path in ("/tmp", "/var/tmp"):
            commands.append(f"mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs {q(path)}")
    return commands


class NotifySocket:
    """systemd's end of sd_notify for one service: an abstract datagram socket, open for the
    service's whole life and drained (a full queue would block the agent's notify), each
    message kept with its sender's pid (SCM_CREDENTIALS)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        name = f"mg-shipped-{secrets.token_hex(6)}"
        self.sock.bind("\0" + name)
        self.sock.settimeout(0.1)
        self.address = "@" + name
        self.received: list[tuple[Optional[int], str]] = []
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self._drain, name=f"notify {name}", daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        while not self.closing.is_set():
            try:
                data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except (socket.timeout, BlockingIOError):
                continue
            except OSError:
                return
            sender = None
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    sender = struct.unpack("3i", payload[:12])[0]
            self.received.append((sender, data.decode(errors="replace")))

    def close(self) -> None:
        self.closing.set()
        self.thread.join(timeout=5)
        self.sock.close()


@dataclass
class ShippedAgent:
    host: ShippedHost
    node_id: str
    root: Path  # stands in for the node's /
    process: Optional[subprocess.Popen] = None
    cgroup: Optional[Path] = None
    config_path: Optional[Path] = None
    log_path: Optional[Path] = None
    notify: Optional["NotifySocket"] = None
    # A job user serves one agent (the agent refuses to share one): None, the host's.
    job_user: Optional[pwd.struct_passwd] = None
    # The shipped TLS keys kept (an mTLS coordinator; stage_tls puts the files in place).
    tls: bool = False

    @property
    def run_as(self) -> pwd.struct_passwd:
        return self.job_user or self.host.job_user

    def host_path(self, unit_path: str) -> Path:
        """A path the unit or agent.toml names, on this test host: the unit's directories
        (/etc/<ConfigurationDirectory>, /var/lib/<StateDirectory>, /run/credentials/<unit>)
        re-rooted under the node's root; any other path as it is."""
        if any(_under(unit_path, prefix) for prefix in self.host.unit.rerooted_prefixes()):
            return self.root / unit_path.lstrip("/")
        return Path(unit_path)

    @property
    def state_dir(self) -> Path:
        return self.host_path(self.host.unit.state_path)

    @property
    def credentials_dir(self) -> Path:
        return self.host_path(self.host.unit.credentials_dir)

    @property
    def config_dir(self) -> Path:
        unit = self.host.unit
        return self.host_path(f"/etc/{unit.configuration_directory}") if unit.configuration_directory else self.root

    def write_config(self, coordinator: str, extra: Optional[dict] = None) -> Path:
        """deploy/systemd/agent.toml's [agent] table, its unit paths re-rooted, with
        ``agent_overrides`` applied; written where ExecStart's --config names it."""
        document = tomllib.loads(AGENT_TOML.read_text(encoding="utf-8"))
        unknown = sorted(set(document) - {"agent"})
        if unknown:
            raise UnitDrift(f"{AGENT_TOML} has table(s) {unknown}: tests/shipped.py writes [agent] only")
        table = {}
        for key, value in document["agent"].items():
            if isinstance(value, str) and value.startswith("/"):
                value = str(self.host_path(value))
            table[key] = value
        values, removed = agent_overrides(coordinator, self.node_id, self.run_as.pw_name, extra, tls=self.tls)
        for key in removed:
            table.pop(key, None)
        table.update(values)
        argv = self.host.unit.exec_start
        if "--config" not in argv:
            raise UnitDrift(f"[Service] ExecStart={' '.join(argv)}: no --config FILE")
        path = self.host_path(argv[argv.index("--config") + 1])
        path.parent.mkdir(parents=True, exist_ok=True)
        write_config(path, {"agent": table})
        self.config_path = path
        return path

    @property
    def machine_id_path(self) -> Path:
        """The node's /etc/machine-id: its own, as a separate host has (a test may write
        another node's there: a cloned image)."""
        return self.root / "etc" / "machine-id"

    def stage(self, credential_sources: dict[str, bytes]) -> None:
        """What systemd makes before ExecStart: the configuration and state directories,
        and the credentials (each source must exist: a missing one fails the start). And
        what the node's host has of its own: a machine-id (kept across restarts)."""
        unit, uid, gid = self.host.unit, self.host.agent_user.pw_uid, self.host.group_gid
        self.root.mkdir(mode=0o755, exist_ok=True)
        if not self.machine_id_path.exists():
            self.machine_id_path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            self.machine_id_path.write_text(secrets.token_hex(16) + "\n")
            self.machine_id_path.chmod(0o444)
        for ident, content in credential_sources.items():
            source = self.host_path(dict(unit.credentials)[ident])
            source.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            source.write_bytes(content)
            source.chmod(0o600)  # root's, as in /etc/meshgate
        if unit.state_directory:
            self.state_dir.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            self.state_dir.mkdir(exist_ok=True)
            os.chown(self.state_dir, uid, gid)
            self.state_dir.chmod(unit.state_directory_mode)
        if unit.credentials:
            creds = self.credentials_dir
            if creds.exists():
                shutil.rmtree(creds)
            creds.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            creds.mkdir(mode=0o700)
            for ident, source in unit.credentials:
                origin = self.host_path(source)
                if not origin.exists():
                    raise FileNotFoundError(f"LoadCredential={ident}:{source}: {origin} is missing (the start fails)")
                shutil.copyfile(origin, creds / ident)
                os.chown(creds / ident, uid, gid)
                (creds / ident).chmod(0o400)
            os.chown(creds, uid, gid)
            creds.chmod(0o500)

    def stage_tls(self, files: dict[str, Path]) -> None:
        """The TLS files where the shipped agent.toml names them: ``files`` maps its keys
        (ca_file, cert_file, key_file, worker_cert_file, worker_key_file) to the files to
        copy. A key naming /run/credentials/<unit>/<id> is written to that credential's
        LoadCredential= source (root's, 0600, re-rooted; start() loads it as systemd does);
        any other path (relative: to agent.toml) as an operator installs it, root's, 0644."""
        table = tomllib.loads(AGENT_TOML.read_text(encoding="utf-8"))["agent"]
        argv = self.host.unit.exec_start
        config_dir = self.host_path(argv[argv.index("--config") + 1]).parent
        prefix = self.host.unit.credentials_dir + "/"
        for key, origin in files.items():
            named = table.get(key)
            if not named:
                raise UnitDrift(f"{AGENT_TOML} has no {key}: tests/shipped.py cannot stage it")
            if named.startswith(prefix):
                ident = named[len(prefix) :]
                if ident not in dict(self.host.unit.credentials):
                    raise UnitDrift(f"{AGENT_TOML} {key} = {named!r} is no LoadCredential= of {self.host.unit.name}")
                target, mode = self.host_path(dict(self.host.unit.credentials)[ident]), 0o600
            else:
                target, mode = (self.host_path(named) if named.startswith("/") else config_dir / named), 0o644
            target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            target.write_bytes(Path(origin).read_bytes())
            target.chmod(mode)

    def join_token_credential(self) -> str:
        """The credential id agent.toml's join_token_file names (/run/credentials/<unit>/<id>)."""
        named = tomllib.loads(AGENT_TOML.read_text(encoding="utf-8")).get("agent", {}).get("join_token_file", "")
        prefix = self.host.unit.credentials_dir + "/"
        if not named.startswith(prefix) or named[len(prefix) :] not in dict(self.host.unit.credentials):
            raise UnitDrift(f"{AGENT_TOML} join_token_file = {named!r} is no LoadCredential= of {self.host.unit.name}")
        return named[len(prefix) :]

    def argv(self) -> list[str]:
        """ExecStart's argv, its entry point the host's and its paths re-rooted."""
        first, *rest = self.host.unit.exec_start
        return [self.host.entry_point] + [str(self.host_path(a)) if a.startswith("/") else a for a in rest]

    def environment(self, notify_socket: str) -> dict[str, str]:
        """systemd's environment for the service: nothing inherited from the test."""
        unit, user = self.host.unit, self.host.agent_user
        env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin",
            "HOME": user.pw_dir,
            "USER": user.pw_name,
            "LOGNAME": user.pw_name,
            "SHELL": user.pw_shell,
            "INVOCATION_ID": secrets.token_hex(16),
        }
        if unit.type == "notify":
            env["NOTIFY_SOCKET"] = notify_socket
        if unit.state_directory:
            env["STATE_DIRECTORY"] = str(self.state_dir)
        if unit.configuration_directory:
            env["CONFIGURATION_DIRECTORY"] = str(self.config_dir)
        if unit.credentials:
            env["CREDENTIALS_DIRECTORY"] = str(self.credentials_dir)
        env.update(dict(unit.environment))
        return env

    def wrapper(self) -> list[str]:
        """unshare + sh: the mounts, the cgroup, the umask, then setpriv execs "$@"."""
        unit, host = self.host.unit, self.host
        writable = [
            str(self.host_path(p.lstrip("-")))
            for p in unit.read_write_paths
            if os.path.exists(self.host_path(p.lstrip("-"))) or not p.startswith("-")
        ]
        if unit.state_directory:
            writable.append(str(self.state_dir))
        lines = ["set -e"]
        if self.cgroup is not None:
            lines.append(f"echo $$ > {shlex.quote(str(self.cgroup / 'cgroup.procs'))}")
        lines += mount_commands(unit, list(dict.fromkeys(writable)))
        if self.machine_id_path.exists() and Path("/etc/machine-id").exists():
            # Each simulated host has its own identity, where the shipped agent reads it
            # (the coordinator refuses a machine-id another live node presents).
            lines.append(f"mount --bind {shlex.quote(str(self.machine_id_path))} /etc/machine-id")
        # The unit's own directories stand in re-rooted, outside /etc and /run: read-only
        # as the real ones are (systemd mounts the credentials read-only; ProtectSystem=full
        # and strict make /etc so).
        rerooted_ro = [self.credentials_dir] if unit.credentials else []
        if unit.configuration_directory and unit.protect_system in ("full", "strict"):
            rerooted_ro.append(self.config_dir)
        for path in rerooted_ro:
            lines += [
                f"mount --bind {shlex.quote(str(path))} {shlex.quote(str(path))}",
                f"mount -o remount,bind,ro {shlex.quote(str(path))}",
            ]
        lines.append(f"umask {unit.umask:04o}")
        caps = ",".join(["-all"] + [f"+{c}" for c in unit.ambient_caps])
        setpriv = [
            "setpriv",
            f"--reuid={host.agent_user.pw_uid}",
            f"--regid={host.group_gid}",
            f"--groups={','.join(str(g) for g in host.groups)}",
            f"--inh-caps={caps}",
            f"--ambient-caps={caps}",
        ]
        if unit.bounding_caps is not None:
            setpriv.append("--bounding-set=" + ",".join(["-all"] + [f"+{c}" for c in unit.bounding_caps]))
        if unit.no_new_privileges:
            setpriv.append("--no-new-privs")
        lines.append("exec " + " ".join(setpriv) + ' -- "$@"')
        return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", "\n".join(lines), "sh"]

    def probe(self, command: list[str]) -> subprocess.CompletedProcess:
        """``command`` run the way the agent is (same namespace set-up, cgroup, umask,
        setpriv): what the unit hands the program it execs, before the agent changes any."""
        return subprocess.run(
            self.wrapper() + command, env=self.environment(""), cwd="/", capture_output=True, text=True, timeout=60
        )

    def start(self, coordinator: str, join_token: str = "", extra: Optional[dict] = None) -> subprocess.Popen:
        unit, host = self.host.unit, self.host
        token_id = self.join_token_credential()
        sources = {}
        for ident, source in unit.credentials:
            if ident == token_id and join_token:
                sources[ident] = join_token.encode() + b"\n"
            elif not self.host_path(source).exists():  # else kept from an earlier start
                sources[ident] = b"placeholder: this test cluster is plaintext, its TLS keys are unused\n"
        self.stage(sources)
        self.write_config(coordinator, extra)
        if host.cgroup is not None and self.cgroup is None:
            self.cgroup = delegate_cgroup(
                host.cgroup / f"{self.node_id}-{unit.name}", host.agent_user.pw_uid, host.group_gid
            )
        self.log_path = self.root / "agent.log"
        if self.notify is not None:
            self.notify.close()
        self.notify = NotifySocket() if unit.type == "notify" else None
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.wrapper() + self.argv(),
                env=self.environment(self.notify.address if self.notify is not None else ""),
                cwd="/",
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        if self.notify is not None:
            self.wait_notified("READY=1", timeout=90.0)  # systemd's DefaultTimeoutStartSec
        return self.process

    def notifications(self) -> list[str]:
        """What the agent said on its NOTIFY_SOCKET, as systemd takes it (NotifyAccess=)."""
        if self.notify is None or self.process is None or self.host.unit.notify_access == "none":
            return []
        main = self.host.unit.notify_access == "main"
        return [
            line
            for pid, text in list(self.notify.received)
            if not main or pid == self.process.pid
            for line in text.splitlines()
        ]

    def wait_notified(self, line: str, timeout: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while line not in self.notifications():
            if self.process.poll() is not None:
                raise AgentExited(f"agent {self.node_id} exited {self.process.returncode} before {line}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise AgentExited(f"agent {self.node_id} sent no {line} in {timeout}s:\n{self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def status(self) -> dict[str, str]:
        """The running agent's /proc/<pid>/status."""
        assert self.process is not None
        with open(f"/proc/{self.process.pid}/status", encoding="utf-8") as handle:
            return dict(line.rstrip("\n").split(":\t", 1) for line in handle if ":\t" in line)

    def stop(self) -> Optional[int]:
        """KillMode=: SIGTERM to the main process (mixed, process) or to all (control-group),
        TimeoutStopSec= to exit, then SIGKILL to whatever is left in its cgroup."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            if self.host.unit.kill_mode == "control-group" and self.cgroup is not None:
                for pid in (self.cgroup / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), 15)
            else:
                self.process.terminate()
            try:
                self.process.wait(timeout=self.host.unit.timeout_stop_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.cgroup is not None and self.host.unit.kill_mode != "process":
            remove_cgroup_tree(self.cgroup)
            self.cgroup = None
        if self.notify is not None:
            self.notify.close()
            self.notify = None
        return self.process.returncode


# ---- a jobs-mode cluster of shipped agents ---------------------------------------------------------


class ShippedCluster:
    """A plaintext jobs-mode coordinator and one agent per node, each started as shipped."""

    def __init__(
        self,
        host: ShippedHost,
        nodes: tuple[str, ...] = ("n0",),
        start: bool = True,
        own_job_users: bool = False,
        tls: bool = False,
    ) -> None:
        """``tls``: an mTLS coordinator (a dev CA in ``self.ca``, the admin's client TLS in
        ``self.admin_tls``), and agents that keep the shipped agent.toml's TLS keys, their
        files staged as an operator installs them (``ShippedAgent.stage_tls``)."""
        from meshgate.plan import ParallelPlan
        from meshgate.tls import init_dev_ca

        self.host, self.nodes = host, nodes
        self.root = Path(tempfile.mkdtemp(prefix="cluster-", dir=host.root))
        self.root.chmod(0o755)
        # The first node's agent runs jobs as the host's job user (unless another cluster of
        # the host holds it: own_job_users), every other one as its own.
        self.agents: dict[str, ShippedAgent] = {
            n: ShippedAgent(
                host,
                n,
                self.root / n,
                job_user=None if i == 0 and not own_job_users else host.add_job_user(),
                tls=tls,
            )
            for i, n in enumerate(nodes)
        }
        self.coordinator: Optional[RunningCoordinator] = None
        self.ca = init_dev_ca(self.root / "tls", agent_names=nodes) if tls else None
        self.admin_tls = self.ca.client_tls(self.ca.admin) if self.ca is not None else None
        try:
            port, metrics_port = free_port(), free_port()
            self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
            server = {"listen": f"127.0.0.1:{port}", "metrics_listen": f"127.0.0.1:{metrics_port}"}
            if self.ca is not None:
                server.update(
                    ca_file=str(self.ca.ca),
                    cert_file=str(self.ca.server.cert),
                    key_file=str(self.ca.server.key),
                    require_client_cert=True,
                )
            else:
                server["insecure"] = True
            config = write_config(
                self.root / "coordinator.toml",
                {
                    "server": server,
                    "keys": {"dir": str(self.root / "keys")},
                    "store": {"dir": str(self.root / "state")},
                    "cluster": {"heartbeat_interval_s": 0.5, "heartbeat_misses": 4, "require_vouch": True},
                },
            )
            port_file, log_path = self.root / "coordinator.addr", self.root / "coordinator.log"
            process = _spawn(config, port_file, log_path)
            self.coordinator = RunningCoordinator(
                address=_wait_for_address(process, port_file, log_path, 30),
                job_id="",
                plan=ParallelPlan(),
                trust_bundle_path=self.root / "keys" / "trust-bundle.json",
                config_path=config,
                process=process,
                log_path=log_path,
            )
            self.address = self.coordinator.address
            if start:
                for node_id in nodes:
                    self.start_agent(node_id)
        except BaseException:
            self.close()
            raise

    def start_agent(self, node_id: str, extra: Optional[dict] = None) -> ShippedAgent:
        """Start (or start again) ``node_id``'s agent; returns once it said READY=1 (joined)."""
        from meshgate import admin

        agent = self.agents[node_id]
        if self.ca is not None:
            pair = self.ca.agent(node_id)
            agent.stage_tls(
                {
                    "ca_file": self.ca.ca,
                    "cert_file": pair.cert,
                    "key_file": pair.key,
                    "worker_cert_file": self.ca.worker.cert,
                    "worker_key_file": self.ca.worker.key,
                }
            )
        token = ""
        if not (agent.state_dir / "node.credential").exists():
            token = admin.create_join_token(self.address, "", node_id=node_id, tls=self.admin_tls).token
        agent.start(self.address, token, extra)
        return agent

    def agent_log(self, node_id: str) -> str:
        return self.agents[node_id].log()

    def logs(self) -> str:
        parts = [f"--- {n} ---\n{self.agent_log(n)[-4000:]}" for n in self.nodes]
        if self.coordinator is not None:
            parts.append(f"--- coordinator ---\n{self.coordinator.log()[-4000:]}")
        return "\n".join(parts)

    def submit(self, job_id: str, command: list[str], env: Optional[dict] = None, nodes: int = 1, procs: int = 1):
        from meshgate import admin
        from meshgate.plan import ParallelPlan
        from meshgate.v1 import rendezvous_pb2 as pb

        spec = pb.JobSpec(
            job_id=job_id,
            plan=ParallelPlan(dp_shard=procs * nodes).to_proto(),
            nodes=nodes,
            command=command,
            env=env or {},
        )
        return admin.submit_job(self.address, spec, tls=self.admin_tls)

    def job(self, job_id: str):
        from meshgate import admin

        return admin.get_job(self.address, job_id, tls=self.admin_tls)

    def wait_ended(self, job_id: str, timeout: float = 90):
        """The job once it ended; AgentExited as soon as an agent's process exits meanwhile."""
        from meshgate.v1 import rendezvous_pb2 as pb

        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.state in (pb.SUCCEEDED, pb.FAILED, pb.CANCELLED):
                return info
            for node_id, agent in self.agents.items():
                if agent.process is not None and agent.process.poll() is not None:
                    raise AgentExited(
                        f"agent {node_id} exited {agent.process.returncode} while job {job_id} ran:\n"
                        f"{agent.log()[-3000:]}"
                    )
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} did not end in {timeout}s\n{self.logs()}")
            time.sleep(0.1)

    def __enter__(self) -> "ShippedCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Every agent stopped as systemd stops it (its cgroup emptied and removed), then the coordinator."""
        errors = []
        for agent in self.agents.values():
            try:
                agent.stop()
            except (OSError, RuntimeError) as exc:
                errors.append(f"{agent.node_id}: {exc}")
        if self.coordinator is not None:
            self.coordinator.stop()
        if errors:
            raise RuntimeError("shipped cluster not cleaned up: " + "; ".join(errors))


# ---- fixtures (import them into a test module, or into conftest.py) -------------------------------


@pytest.fixture(scope="module")
def shipped_host():
    with ShippedHost.create() as host:
        yield host


@pytest.fixture
def shipped_cluster(shipped_host):
    cluster = ShippedCluster(shipped_host, ("n0",))
    try:
        yield cluster
    finally:
        cluster.close()


__all__ = [
    "AgentExited",
    "NOT_REPRODUCED",
    "REPRODUCED",
    "ShippedAgent",
    "ShippedCluster",
    "ShippedHost",
    "ShippedUnit",
    "UnitDrift",
    "agent_overrides",
    "cap_mask",
    "check_keys",
    "parse_service",
    "shipped_cluster",
    "shipped_host",
]
