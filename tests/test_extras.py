"""Optional dependencies: each extra says what it is for, and a feature whose extra is
missing says, in one line and without a traceback, which one to install. The missing
package is simulated in a fresh interpreter whose import system refuses it."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, worker_env, write_config
from meshgate import extras

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

# Prepended to every child: a finder that makes the named top-level packages unimportable,
# as if they were not installed (find_spec and import both fail).
_BLOCKER = textwrap.dedent(
    """
    import sys
    BLOCKED = set(sys.argv[1].split(","))
    del sys.argv[1]

    class _NotInstalled:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NotInstalled)
    """
)


def run_without(blocked: str, code: str, *args: str, cwd: Path = REPO, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _BLOCKER + textwrap.dedent(code), blocked, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=env or worker_env(),
    )


def assert_one_line(stderr: str, extra: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, stderr
    assert f"(meshgate's [{extra}] extra; " in lines[0] and ": pip install '" in lines[0], lines[0]
    return lines[0]


# ---- the declaration ---------------------------------------------------------------------


def test_every_extra_is_declared_and_all_covers_them():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = project["optional-dependencies"]
    assert set(declared) == set(extras.EXTRAS) | {"all", "dev", "bench"}  # dev, bench: a checkout's tools
    (everything,) = declared["all"]
    assert everything == f"meshgate[{','.join(extras.EXTRAS)}]"
    for extra, requirements in declared.items():
        for requirement in requirements:  # every pin is a range, never open-ended upwards
            assert "<" in requirement or requirement.startswith("meshgate[") or extra == "dev", requirement


def test_install_hint_and_missing_extra():
    assert extras.install_hint("torch") == (
        "pip install 'torch<3,>=2.6' 'numpy<3,>=1.26' (meshgate's [torch] extra; "
        "or, where its wheel is: pip install 'meshgate-0.2.0-py3-none-any.whl[torch]')"
    )
    with pytest.raises(ValueError, match="unknown extra 'cuda'"):
        extras.install_hint("cuda")
    with pytest.raises(extras.MissingExtra) as caught:
        extras.require("meshgate_no_such_module", extra="metrics", feature="a test")
    assert isinstance(caught.value, ImportError) and caught.value.extra == "metrics"
    assert str(caught.value) == ("a test needs meshgate_no_such_module: " + extras.install_hint("metrics"))
    assert "'prometheus-client<1,>=0.20'" in str(caught.value)
    with pytest.raises(extras.MissingExtra):
        extras.check("meshgate_no_such_module.sub", extra="torch", feature="a test")
    extras.check("json", extra="torch", feature="a test")  # present: nothing raised
    assert extras.require("json", extra="torch", feature="a test").__name__ == "json"


def test_every_hint_installs_packages_that_exist():
    """A hint names what the extra brings, pinned as meshgate declares it, never the
    meshgate distribution (no index has it): each package is one pip found for this
    checkout's venv (requirements/ci.txt), in a version the pin allows."""
    from importlib.metadata import version

    from packaging.requirements import Requirement

    for extra in extras.EXTRAS:
        hint = extras.install_hint(extra)
        assert hint.startswith("pip install '") and "'meshgate[" not in hint, hint
        packages, wheel = hint.split(" (", 1)
        assert wheel.endswith(f"pip install 'meshgate-0.2.0-py3-none-any.whl[{extra}]')"), (
            hint
        )  # what `pip wheel` builds
        named = [Requirement(req) for req in re.findall(r"'([^']+)'", packages)]
        assert named, hint
        for requirement in named:
            assert requirement.specifier.contains(version(requirement.name), prereleases=True), (hint, requirement)


# ---- each place that needs an extra ------------------------------------------------------


def test_demo_without_torch_fails_once_before_starting_anything(tmp_path):
    code = """
        import sys
        from meshgate.cli import main
        sys.exit(main(sys.argv[1:]))
    """
    env = worker_env(TMPDIR=str(tmp_path))
    result = run_without("torch", code, "demo", env=env)
    assert result.returncode == 2, result.stderr
    line = assert_one_line(result.stderr, "torch")
    assert line == "error: meshgate demo needs torch: " + extras.install_hint("torch")
    assert list(tmp_path.iterdir()) == []  # no demo directory, so no coordinator, no agent

    result = run_without("megatron", code, "demo", "--megatron", env=env)
    assert result.returncode == 2
    assert "meshgate demo --megatron needs megatron.core" in assert_one_line(result.stderr, "megatron")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "blocked, module, extra, call",
    [
        ("torch", "meshgate.launchers.mesh", "torch", "_import_torch()"),
        ("megatron", "meshgate.launchers.megatron", "megatron", "_import_parallel_state()"),
    ],
)
def test_launchers_name_their_extra(blocked, module, extra, call):
    result = run_without(
        blocked,
        f"""
        import {module} as m  # importing the module needs only meshgate
        from meshgate.extras import MissingExtra
        try:
            m.{call}
        except MissingExtra as exc:
            print(exc)
    """,
    )
    assert result.returncode == 0, result.stderr
    assert extras.install_hint(extra) in result.stdout


def _coordinator_config(tmp_path: Path, **sections) -> Path:
    base = {
        "job": {"id": "extras", "slots_per_node": 1},
        "plan": {"dp_shard": 1},
        "server": {"listen": "127.0.0.1:0", "insecure": True},
        "keys": {"dir": str(tmp_path / "keys")},
        "store": {"kind": "memory"},
    }
    for name, table in sections.items():
        base[name] = {**base[name], **table}
    return write_config(tmp_path / "coordinator.toml", base)


def _error_lines(result: subprocess.CompletedProcess) -> list[str]:
    # the daemons log "<time> ERROR <logger>: <message>"; the insecure warning is expected
    return [line for line in result.stderr.splitlines() if " ERROR " in line]


_COORDINATOR = """
    import sys
    from meshgate.coordinator.__main__ import main
    sys.exit(main(["--config", sys.argv[1]]))
"""


@pytest.mark.parametrize(
    "blocked, extra, sections, says",
    [
        (
            "aetcd",
            "etcd",
            {"store": {"kind": "etcd", "endpoints": ["127.0.0.1:1"]}},
            '[store] kind = "etcd" needs aetcd',
        ),
        (
            "prometheus_client",
            "metrics",
            {"server": {"metrics_listen": "127.0.0.1:0"}},
            "[server] metrics_listen needs prometheus_client",
        ),
    ],
)
def test_coordinator_names_the_missing_extra(tmp_path, blocked, extra, sections, says):
    result = run_without(blocked, _COORDINATOR, str(_coordinator_config(tmp_path, **sections)))
    assert result.returncode == 2, result.stderr
    (line,) = _error_lines(result)
    assert line.endswith(f"{says}: {extras.install_hint(extra)}"), line


def test_coordinator_startup_error_is_one_line_without_traceback(tmp_path):
    config = _coordinator_config(tmp_path, server={"metrics_listen": "127.0.0.1:0"})
    result = run_without("prometheus_client", _COORDINATOR, str(config))
    assert "Traceback" not in result.stderr, result.stderr
    # The reason is the last thing it says, never after a "stopping: draining" that reads
    # like a stop asked for (issue #34): it stops before it serves.
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "metrics_listen needs prometheus_client" in lines[-1], result.stderr
    assert not any("draining" in line for line in lines), result.stderr


def test_agent_metrics_without_prometheus_client(tmp_path):
    config = write_config(
        tmp_path / "agent.toml",
        {
            "agent": {
                "coordinator": "127.0.0.1:1",
                "job": "extras",
                "node_id": "n0",
                "join_token": "t0k3n-for-test",
                "slots": 1,
                "insecure": True,
                "state_dir": str(tmp_path / "state"),
                "metrics_listen": "127.0.0.1:0",
            }
        },
    )
    result = run_without(
        "prometheus_client",
        """
        import sys
        from meshgate.agent.__main__ import main
        sys.exit(main(["--config", sys.argv[1]]))
    """,
        str(config),
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    (line,) = _error_lines(result)
    assert line.endswith("metrics_listen needs prometheus_client: " + extras.install_hint("metrics")), line
