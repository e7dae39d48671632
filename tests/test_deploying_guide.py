"""docs/deploying.md, run as written (issue #24): it cannot drift from what meshgate does.

The guide's commands are the lines of its ```console blocks that start with a host prompt,
``head# ``, ``host-a# `` or ``host-b# `` (root on that host); the lines under one are what
it printed. This test extracts them in order and runs each on its host:

- a host is a network namespace (head 10.77.0.1, host-a .2, host-b .3 on one bridge, as in
  tests/test_netns.py) plus a mount namespace whose /etc, /var/lib and /opt are overlays of
  this machine's, so each host has its own /etc/meshgate, /etc/passwd (its own `useradd`),
  /var/lib/meshgate-agent; nothing is written to the real ones. /opt/meshgate is the
  guide's "Before you start" run as written (once, outside the hosts: their network reaches
  no index) into a fresh venv of Debian's python3.11: the wheel built from this checkout,
  PyPI's packages from PyPI (pip's cache), PyTorch's CPU index stood in for by this
  machine's copy of its torch wheel. Nothing comes from the development venv; root's PATH
  on each host has /opt/meshgate/bin.
- each host's commands run in one shell session: ``sh -c`` in that host, starting from the
  folder and exported variables the previous command on that host left (so ``cd`` and
  ``export`` work as typed);
- the two conventions for what a namespace cannot do, which the guide states too:
  a line running ``meshgate-coordinator`` or ``meshgate-agent`` is a service, started in the
  background and waited for (the coordinator's "health: SERVING", the agent's "joined the
  cluster"), as systemd would keep it; ``scp -rp SRC root@ADDRESS:DST`` (no sshd here) is a
  copy of SRC from this host's files to the host at ADDRESS, modes kept.

Every command must exit 0 and the first ``meshgate job submit --wait`` must end SUCCEEDED:
its workers (meshgate's demo worker, as the job user) register, verify their attestations,
and all_reduce over every mesh axis across the two hosts. The guide reaches that job in at
most 15 commands (test_guide_reaches_the_first_job_in_at_most_15_commands, no root needed).

MESHGATE_GUIDE_TRANSCRIPT=FILE writes every command and its output to FILE, for pasting.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from test_netns import _cluster, _netns_permitted

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "deploying.md"
HOSTS = {"head": "10.77.0.1", "host-a": "10.77.0.2", "host-b": "10.77.0.3"}
NAMESPACE_ROLE = {"head": "coordinator", "host-a": "host-a", "host-b": "host-b"}  # test_netns's names
MAX_COMMANDS_TO_FIRST_JOB = 15
SERVICES = {"meshgate-coordinator": "health: SERVING", "meshgate-agent": "joined the cluster as node"}
OVERLAID = ("etc", "var/lib", "opt")
SYSTEM_PYTHON = "/usr/bin/python3.11"
JOB_PYTHON_DIR = "/opt/meshgate"  # where the guide's "Before you start" installs meshgate for jobs
TORCH_CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"
# This machine's copy of PyTorch's CPU wheels (the CI lock's torch), standing in for its index.
TORCH_WHEELS = os.environ.get("PIP_FIND_LINKS", "/opt/wheels")
_PROMPT = re.compile(r"^(" + "|".join(map(re.escape, HOSTS)) + r")# (.*)$")
_SCP = re.compile(r"^scp -rp (\S+) root@([\d.]+):(\S+)$")
_STEP_TIMEOUT_S = 240.0


@dataclass
class Step:
    host: str
    command: str
    printed: list[str] = field(default_factory=list)


def guide_steps(text: str) -> list[Step]:
    """The prompted lines of every ```console block, in order, with the lines printed under them."""
    steps: list[Step] = []
    in_console = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_console = line.strip() == "```console"
            continue
        if not in_console:
            continue
        prompt = _PROMPT.match(line)
        if prompt:
            steps.append(Step(prompt[1], prompt[2].strip()))
        elif steps:
            steps[-1].printed.append(line)
    return steps


def commands_to_first_job(steps: list[Step]) -> list[Step]:
    for index, step in enumerate(steps):
        if step.command.startswith("meshgate job submit"):
            return steps[: index + 1]
    raise AssertionError("the guide never runs `meshgate job submit`")


_VARYING = re.compile(r"[0-9a-f]*[0-9][0-9a-f]*")  # numbers, hex: times, fingerprints, pids, ports


def _shape(line: str) -> str:
    """A printed line without what changes from run to run: numbers, hex and spacing."""
    return " ".join(_VARYING.sub("#", line).split())


def unmatched(printed: list[str], actual: str) -> list[str]:
    """The guide's pasted lines that the real output does not have (in shape). A pasted line
    with ``…`` matches a real line holding each of its parts; a line of just ``…`` stands for
    lines left out."""
    real = [_shape(re.sub(rf"\b{re.escape(socket.gethostname())}\b", "vm", line)) for line in actual.splitlines()]
    missing = []
    for line in printed:
        parts = [_shape(part) for part in line.split("…") if part.strip()]
        if not parts:
            continue
        if "…" in line:
            found = any(all(part in candidate for part in parts) for candidate in real)
        else:
            found = parts[0] in real
        if not found:
            missing.append(line)
    return missing


def test_pasted_lines_are_checked_in_shape():
    actual = "  sha256 2eed0c33ba9baa71ed28\nwalk-1: RUNNING, generation 0, 3/4 ranks\nhost-a  0     vm    active"
    assert (
        unmatched(["  sha256 65fcbe91…", "walk-1: RUNNING, generation 0, 2/4 ranks", "host-a 0 vm active"], actual)
        == []
    )
    assert unmatched(["walk-1: FAILED, generation 0, 2/4 ranks", "  sha256 65fcbe91… (0600)"], actual) == [
        "walk-1: FAILED, generation 0, 2/4 ranks",
        "  sha256 65fcbe91… (0600)",
    ]


def test_guide_reaches_the_first_job_in_at_most_15_commands():
    steps = guide_steps(GUIDE.read_text())
    first = commands_to_first_job(steps)
    listing = "\n".join(f"{s.host}# {s.command}" for s in first)
    assert len(first) <= MAX_COMMANDS_TO_FIRST_JOB, f"{len(first)} commands to the first job:\n{listing}"
    # the count the guide and the README state is the guide's own
    assert re.search(rf"\b{len(first)} commands reach the\s+first verified job", GUIDE.read_text())
    assert re.search(
        rf"\({len(first)} commands to the\s+first verified two-host job\)", (REPO / "README.md").read_text()
    )
    assert {s.host for s in first} == set(HOSTS), listing  # the job spans both worker hosts
    assert "--wait" in first[-1].command.split(), "the first job's submit must wait for its outcome"
    # a second job after the first, from the same guide
    assert sum(s.command.startswith("meshgate job submit") for s in steps) >= 2
    # Security stays on: no insecure flag or setting anywhere in the guide's commands.
    for step in steps:
        assert "--insecure" not in step.command and "INSECURE" not in step.command, step.command
        assert "run_jobs_as_agent" not in step.command, step.command


# ---- the hosts ----------------------------------------------------------------------------------


def install_lines(text: str) -> list[str]:
    """The commands of "Before you start": the lines of its first plain ``` block."""
    section = text.split("### Before you start", 1)[1].split("\n### ", 1)[0]
    block = section.split("\n```\n", 2)[1]
    return [line for line in block.splitlines() if line.strip()]


def test_before_you_start_installs_the_wheel_with_the_extras_the_configs_need():
    lines = install_lines(GUIDE.read_text())
    assert lines[0] == f"python3 -m venv {JOB_PYTHON_DIR}"
    assert any(TORCH_CPU_INDEX in line and "'torch==" in line for line in lines)  # the CPU build, pinned
    (install,) = [line for line in lines if ".whl[" in line]
    assert "[torch,metrics]" in install and "meshgate[" not in install.replace(".whl[", "")


@pytest.fixture(scope="module")
def job_python_venv(built_wheel, tmp_path_factory):
    """The guide's "Before you start", run as written (once: the hosts share /opt/meshgate)
    into a fresh venv of Debian's python3, the built wheel in the folder it runs in; only
    PyTorch's CPU index is stood in for by this machine's copy of its wheels."""
    if not os.path.exists(SYSTEM_PYTHON):
        pytest.skip(f"{SYSTEM_PYTHON} is not installed (the job user's interpreter)")
    lines = install_lines(GUIDE.read_text())
    named = {Path(word.strip("'").split("[")[0]).name for line in lines for word in line.split() if ".whl" in word}
    assert named == {built_wheel.name}, f"the guide installs {named}, the checkout builds {built_wheel.name}"
    root = Path(tempfile.mkdtemp(prefix="mg-guide-venv-", dir="/tmp"))
    root.rmdir()  # `python3 -m venv` makes it
    work = tmp_path_factory.mktemp("before-you-start")
    shutil.copy(built_wheel, work / built_wheel.name)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = "/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin"  # python3: Debian's, not this venv's
    try:
        for line in lines:
            command = line.replace(JOB_PYTHON_DIR, str(root)).replace(TORCH_CPU_INDEX, f"--find-links {TORCH_WHEELS}")
            done = subprocess.run(["sh", "-c", command], cwd=work, env=env, capture_output=True, text=True, timeout=900)
            assert done.returncode == 0, f"`{line}` exit {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}"
        root.chmod(0o755)
        installed = subprocess.run(
            [
                root / "bin" / "python",
                "-c",
                "import meshgate, torch, numpy, prometheus_client; print(meshgate.__file__)",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=work,  # not the checkout: `-c` puts the folder it runs in first on sys.path
        )
        assert installed.returncode == 0 and installed.stdout.startswith(str(root)), installed.stderr[-2000:]
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


class Host:
    """One simulated machine: a holder process in the host's network namespace whose mount
    namespace has this host's overlays (its /etc with its own machine-id); every command
    enters both with nsenter."""

    def __init__(self, name: str, namespace: str, base: Path, job_venv: Path) -> None:
        self.name = name
        self.base = base
        base.mkdir(parents=True)
        mounts = []
        for folder in OVERLAID:
            upper, work = base / f"{folder.replace('/', '-')}.upper", base / f"{folder.replace('/', '-')}.work"
            upper.mkdir()
            work.mkdir()
            if folder == "etc":  # each host its own machine-id, as separate hosts have
                (upper / "machine-id").write_text(secrets.token_hex(16) + "\n")
            mounts.append(f"mount -t overlay overlay -o lowerdir=/{folder},upperdir={upper},workdir={work} /{folder}")
        if any(line.split()[2] == "cgroup2" for line in open("/proc/self/mounts")):
            # `ip netns exec` mounts a fresh /sys, without the machine's cgroup2: mount it
            # again, so the agents contain each job in a cgroup as on a real host.
            mounts.append("mount -t cgroup2 cgroup2 /sys/fs/cgroup")
        setup = "\n".join(
            [
                "set -e",
                *mounts,
                f"mkdir -p {JOB_PYTHON_DIR}",
                f"mount --bind {job_venv} {JOB_PYTHON_DIR}",
                "echo ready",
                "exec sleep 100000",
            ]
        )
        self.holder = subprocess.Popen(
            ["ip", "netns", "exec", namespace, "sh", "-c", setup], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        line = self.holder.stdout.readline()
        if line.strip() != b"ready":
            self.holder.kill()
            raise AssertionError(f"{name}: could not make its mounts: {self.holder.stderr.read().decode()[-2000:]}")
        self.home = base / "home"
        self.home.mkdir()
        self.state = base / "shell-state"  # the session's exported variables, as `export -p` writes them
        self.cwd = base / "cwd"
        self.cwd.write_text(f"{self.home}\n")
        env = {  # /opt/meshgate/bin on root's PATH, as "Before you start" says: the wheel's install
            "PATH": f"{JOB_PYTHON_DIR}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": str(self.home),
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "RES_OPTIONS": "timeout:1 attempts:1",
        }
        self.state.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()))
        self.services: list[subprocess.Popen] = []

    def root(self) -> Path:
        """This host's files as seen from outside it."""
        return Path(f"/proc/{self.holder.pid}/root")

    def _argv(self, script: str) -> list[str]:
        return ["nsenter", "-t", str(self.holder.pid), "-m", "-n", "--", "env", "-i", "sh", "-c", script]

    def _prelude(self) -> str:
        return f'. {self.state}\ncd "$(cat {self.cwd})"\n'

    def run(self, command: str) -> subprocess.CompletedProcess:
        script = (
            self._prelude()
            + command
            + f"\nrc=$?\npwd > {self.cwd}\nexport -p > {self.state}.new && mv {self.state}.new {self.state}\nexit $rc\n"
        )
        return subprocess.run(
            self._argv(script), capture_output=True, text=True, timeout=_STEP_TIMEOUT_S, stdin=subprocess.DEVNULL
        )

    def start_service(self, command: str, ready: str, log: Path) -> subprocess.Popen:
        process = subprocess.Popen(
            self._argv(self._prelude() + "exec " + command),
            stdout=open(log, "wb"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        self.services.append(process)
        deadline = time.monotonic() + 90
        while ready not in log.read_text(errors="replace"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: `{command}` never said {ready!r}:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        return process

    def close(self) -> None:
        for process in self.services:
            if process.poll() is None:
                process.terminate()
        for process in self.services:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        self.holder.kill()
        self.holder.wait(timeout=5)


# The pack's target hosts (deploy/prometheus/prometheus.yml) that this deployment has, seen
# from the head, where a Prometheus reaches the coordinator's shipped 127.0.0.1:9464.
PACK_HOSTS = {"coordinator-1": "127.0.0.1", "host-a": HOSTS["host-a"], "host-b": HOSTS["host-b"]}


def pack_targets(head: Host, root: Path) -> list[str]:
    """A real Prometheus on the head with the pack's prometheus.yml and alerts.yml, its
    targets the pack's own at the pack's ports, named by this deployment's addresses (its
    coordinator-2 and host-c: hosts this deployment lacks); the health of each target once
    every one was scraped (at most 60 s)."""
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus is not installed (Debian: apt-get install --no-install-recommends prometheus)")
    import yaml

    pack = REPO / "deploy" / "prometheus"
    config = yaml.safe_load((pack / "prometheus.yml").read_text())
    dropped = set()
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            kept = []
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                if host in PACK_HOSTS:
                    kept.append(f"{PACK_HOSTS[host]}:{port}")
                else:
                    dropped.add(host)
            static["targets"] = kept
    assert dropped == {"coordinator-2", "host-c"}, dropped
    config["global"].update(scrape_interval="1s", evaluation_interval="1s", scrape_timeout="1s")
    root.mkdir()
    shutil.copy(pack / "alerts.yml", root / "alerts.yml")
    (root / "prometheus.yml").write_text(yaml.safe_dump(config))
    server = subprocess.Popen(
        head._argv(
            f"exec {prometheus} --config.file={root / 'prometheus.yml'} --storage.tsdb.path={root / 'data'} "
            "--web.listen-address=127.0.0.1:9090"
        ),
        stdout=open(root / "prometheus.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    ask = (
        "/usr/bin/python3 -c 'import json, urllib.request; "
        'd = json.load(urllib.request.urlopen("http://127.0.0.1:9090/api/v1/targets", timeout=5)); '
        'print(json.dumps([t["health"] for t in d["data"]["activeTargets"]]))\''
    )
    health: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            answer = head.run(ask)
            health = json.loads(answer.stdout) if answer.returncode == 0 else []
            if health == ["up"] * 3:
                break
            time.sleep(1)
    finally:
        server.terminate()
        server.wait(timeout=30)
    return health


def _copy_between(hosts: dict[str, Host], source: Host, step: Step) -> str:
    """``scp -rp SRC root@ADDRESS:DST`` onto a host without DST: SRC becomes DST, modes kept."""
    match = _SCP.match(step.command)
    assert match, f"only `scp -rp SRC root@ADDRESS:DST` is understood here, got {step.command!r}"
    src, address, dst = match.groups()
    target = next(h for name, h in hosts.items() if HOSTS[name] == address)
    cwd = Path(next(iter(source.cwd.read_text().splitlines())))
    src_path = source.root() / (cwd / src).relative_to("/")
    dst_path = target.root() / Path(dst).relative_to("/")
    assert src_path.is_dir(), f"{step.command}: no folder {cwd / src} on {source.name}"
    assert not dst_path.exists(), f"{step.command}: {dst} exists on {target.name} (scp would copy into it)"
    shutil.copytree(src_path, dst_path, copy_function=shutil.copy2)
    return ""


@pytest.mark.slow
def test_the_deployment_guide_runs_as_written(tmp_path, job_python_venv):
    reason = _netns_permitted()
    if reason:
        pytest.skip(reason)
    if shutil.which("nsenter") is None:
        pytest.skip("util-linux's nsenter is not installed")
    steps = guide_steps(GUIDE.read_text())
    first_job = len(commands_to_first_job(steps))
    transcript: list[str] = []
    started = time.monotonic()
    hosts: dict[str, Host] = {}
    with _cluster() as namespaces:
        try:
            for name in HOSTS:
                hosts[name] = Host(name, namespaces[NAMESPACE_ROLE[name]], tmp_path / name, job_python_venv)
            submits = []
            outputs: list[tuple[int, Step, str | Path]] = []  # what each step printed (a service: its log)
            for number, step in enumerate(steps, 1):
                host = hosts[step.host]
                program = shlex.split(step.command)[0]
                t0 = time.monotonic()
                if program in SERVICES:
                    log = tmp_path / f"{number:02d}-{step.host}-{program}.log"
                    host.start_service(step.command, SERVICES[program], log)
                    printed = log.read_text(errors="replace")
                    outputs.append((number, step, log))
                elif program == "scp":
                    printed = _copy_between(hosts, host, step)
                else:
                    done = host.run(step.command)
                    printed = done.stdout + done.stderr
                    assert done.returncode == 0, (
                        f"step {number} on {step.host} `{step.command}` exit {done.returncode}:\n{printed[-4000:]}"
                    )
                    outputs.append((number, step, printed))
                    if step.command.startswith("meshgate job submit"):
                        submits.append(printed)
                        assert "SUCCEEDED" in printed, printed
                transcript.append(f"{step.host}# {step.command}   [{time.monotonic() - t0:.1f}s]\n{printed}")
                if number == first_job:
                    transcript.append(
                        f"--- first verified job after {first_job} commands, {time.monotonic() - started:.0f}s ---\n"
                    )
            assert len(submits) >= 2
            drift = [
                f"step {number} `{step.host}# {step.command}`: {line!r}"
                for number, step, printed in outputs
                for line in unmatched(step.printed, printed.read_text() if isinstance(printed, Path) else printed)
            ]
            assert not drift, "the guide shows output this run did not print:\n" + "\n".join(drift)
            # The Prometheus pack against what the guide deployed: every target up.
            assert pack_targets(hosts["head"], tmp_path / "prometheus") == ["up"] * 3
        finally:
            for host in hosts.values():
                host.close()
            out = os.environ.get("MESHGATE_GUIDE_TRANSCRIPT")
            if out:
                Path(out).write_text("\n".join(transcript))
