"""The wheel works on its own: one top-level package, the data the CLI hands out inside
it, and an install in a fresh virtualenv outside the repository that runs the demo.

The fresh venv gets the wheel with --no-deps; its third-party packages (grpc, torch, ...)
come from this interpreter's site-packages through a .pth file. A folder added by a .pth
file does not have its own .pth files processed, so an editable meshgate finder living
there is never installed: meshgate itself can only come from the wheel (checked below).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from conftest import REPO
from meshgate import data


@pytest.fixture(scope="module")
def wheel(built_wheel) -> Path:
    return built_wheel  # conftest.py: built once per session, shared with the guide's test


def test_wheel_has_one_top_level_package_and_the_cli_data(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        recorded = [line.split(",")[0] for line in archive.read(record).decode().splitlines() if line]
        top_level = archive.read(record.replace("RECORD", "top_level.txt")).decode().split()
    assert sorted(recorded) == sorted(names)
    assert {n.split("/")[0] for n in names} == {"meshgate", wheel.name.split("-py3")[0] + ".dist-info"}
    assert top_level == ["meshgate"]
    for room in (
        "coordinator",
        "coordinator/rendezvous",
        "coordinator/cluster_state",
        "coordinator/store",
        "agent",
        "launchers",
        "v1",
    ):
        assert f"meshgate/{room}/__init__.py" in names
    shipped = {n for n in names if n.startswith("meshgate/data/")}
    # examples/ whole (issue #34): the plans, the Fabric and Ray scripts, the health check, the sbatch file
    examples = {p.relative_to(REPO / "examples").as_posix() for p in (REPO / "examples").rglob("*") if p.is_file()}
    assert {"fabric_train.py", "ray_train.py", "slurm/meshgate-job.sbatch", "health/cpu_check.py"} <= examples
    assert {f"meshgate/data/examples/{name}" for name in examples} <= shipped
    assert {f"meshgate/data/systemd/{p.name}" for p in (REPO / "deploy" / "systemd").iterdir()} <= shipped
    assert "meshgate/data/examples/plan-8-tp-pp-hsdp.toml" in shipped
    assert {f"meshgate/data/systemd/{n}" for n in (*data.UNITS, data.AGENT_CONFIG, data.COORDINATOR_CONFIG)} <= shipped


def _third_party_site_packages() -> list[str]:
    """The site-packages folders this interpreter loads meshgate's dependencies from."""
    needed = ["grpc", "google.protobuf", "cryptography", "torch"]
    folders = []
    for name in needed:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin, name
        folder = Path(spec.origin).parents[len(name.split("."))]
        if str(folder) not in folders:
            folders.append(str(folder))
    return folders


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_runs_the_demo_from_root(wheel, tmp_path):
    pytest.importorskip("torch")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
        check=True,
        timeout=300,
    )
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    assert site != Path(sysconfig.get_paths()["purelib"])
    (site / "third_party.pth").write_text("\n".join(_third_party_site_packages()) + "\n")

    # A user's shell: no checkout on the path, none of the test session's MESHGATE_* settings
    # (conftest sets MESHGATE_INSECURE=1, which would send the demo's workers in plaintext).
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("MESHGATE_")
    }
    env.update(
        RES_OPTIONS="timeout:1 attempts:1",
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
    )

    def run(*argv: str) -> str:
        result = subprocess.run(list(argv), cwd="/", env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    where = run(
        str(python),
        "-c",
        "import meshgate, meshgate.coordinator, meshgate.agent, meshgate.launchers.mesh;"
        "print(meshgate.coordinator.__file__); print(meshgate.launchers.mesh.__file__)",
    )
    for line in where.split():
        assert Path(line).is_relative_to(site), where  # from the wheel, not the checkout
    assert run(str(venv / "bin" / "meshgate"), "--version").strip() == f"meshgate {data_version()}"
    assert "world verified: 4/4 ranks" in run(str(venv / "bin" / "meshgate"), "demo")
    assert "world verified: 8/8 ranks" in run(
        str(venv / "bin" / "meshgate"), "demo", "--plan", "plan-8-tp-pp-hsdp", "--jobs", "1"
    )


def data_version() -> str:
    import meshgate

    return meshgate.__version__
