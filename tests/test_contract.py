"""The committed stubs are exactly what proto/ generates, and the layout's arrows hold."""

from __future__ import annotations

import ast
import filecmp
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_fresh(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run([str(REPO / "scripts" / "gen_protos.sh"), str(tmp_path)], check=True, env=env)
    generated = sorted(p.relative_to(tmp_path) for p in (tmp_path / "meshgate" / "v1").glob("*.py*"))
    assert generated, "protoc generated nothing"
    stale = [str(rel) for rel in generated if not filecmp.cmp(tmp_path / rel, REPO / rel, shallow=False)]
    assert not stale, f"stale stubs, run `make protos`: {stale}"
    committed = sorted(p.relative_to(REPO) for p in (REPO / "meshgate" / "v1").glob("*_pb2*.py*"))
    assert committed == generated


ROOMS = ("coordinator", "agent", "launchers")


def _room(module: str) -> str:
    """The room a module lives in: ``meshgate.coordinator.engine`` -> ``coordinator``."""
    parts = module.split(".")
    if parts[0] == "meshgate" and len(parts) > 1 and parts[1] in ROOMS:
        return parts[1]
    return parts[0]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {_room(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(_room(node.module))
            if node.module == "meshgate":
                names |= {alias.name for alias in node.names if alias.name in ROOMS}
    return names


def test_no_top_level_room_imports():
    """Every room is imported as ``meshgate.<room>``; a bare ``coordinator`` is someone else's."""
    offenders = []
    for path in sorted(REPO.glob("*/**/*.py")):
        if path.parts[len(REPO.parts)] in (".venv", "build"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            modules = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            )
            offenders += [f"{path.relative_to(REPO)}: {m}" for m in modules if m.split(".")[0] in ROOMS]
    assert not offenders, offenders


def test_arrows_point_one_way():
    """coordinator -> meshgate; agent -> meshgate, launchers; launchers -> meshgate."""
    forbidden = {
        "meshgate": {"coordinator", "agent"},
        "launchers": {"coordinator", "agent"},
        "agent": {"coordinator"},
        "coordinator": {"agent", "launchers"},
    }
    offenders = []
    for room, banned in forbidden.items():
        for path in (REPO / room).rglob("*.py"):
            bad = _imports(path) & banned
            if bad and not (room == "meshgate" and path.name == "cli.py" and bad <= {"launchers"}):
                offenders.append(f"{path.relative_to(REPO)} imports {sorted(bad)}")
    assert not offenders, offenders


# The daemon is built in one place (coordinator/assembly.py): its parts are made nowhere else
# outside the modules that define them (tests build what they test by hand).
DAEMON_PARTS = {
    "KeyRing": "coordinator/keys.py",
    "AccessPolicy": "coordinator/service.py",
    "build_server": "coordinator/service.py",
    "Operations": "coordinator/health.py",
    "serve_embedded": "coordinator/leadership.py",
    "serve_ha": "coordinator/leadership.py",
}
ASSEMBLY = "coordinator/assembly.py"


def _calls(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            names.add(func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else "")
    return names


def _source_files() -> list[Path]:
    return [path for room in ("meshgate", *ROOMS, "bench") for path in sorted((REPO / room).rglob("*.py"))]


def test_the_daemon_is_assembled_in_one_place():
    offenders = []
    for path in _source_files():
        rel = path.relative_to(REPO).as_posix()
        made = {name for name in _calls(path) & set(DAEMON_PARTS) if rel not in (ASSEMBLY, DAEMON_PARTS[name])}
        offenders += [f"{rel} makes {name}" for name in sorted(made)]
    assert not offenders, offenders
    assert set(DAEMON_PARTS) <= _calls(REPO / ASSEMBLY)


def test_the_bench_runs_the_daemons_assembly():
    """The bench's coordinator is the daemon (assembly.serve), not a copy of its wiring."""
    reached = set()
    for path in sorted((REPO / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "meshgate.coordinator":
                reached |= {f"meshgate.coordinator.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("meshgate.coordinator."):
                reached.add(node.module)
            elif isinstance(node, ast.Import):
                reached |= {a.name for a in node.names if a.name.startswith("meshgate.coordinator")}
    assert reached <= {"meshgate.coordinator.assembly", "meshgate.coordinator.config"}, sorted(reached)
    assert "meshgate.coordinator.assembly" in reached


def test_the_claimed_mode_handshake_is_written_once():
    """Ray and Fabric register, cross-check and await the world through launchers/claimed.py only."""
    for name in ("ray.py", "fabric.py"):
        calls = _calls(REPO / "launchers" / name)
        assert "attest_claimed" in calls and "claimed_settings" in calls, name
        again = calls & {"register", "await_world", "load_trust_bundle"}
        assert not again, f"launchers/{name} calls {sorted(again)} itself"


# The pure decisions: no sockets, grpc, event loop, files, processes or clock ("now" is passed in).
DECISIONS = (
    "coordinator/rendezvous",
    "coordinator/cluster_state",
    "coordinator/jobs.py",
    "coordinator/jobspec.py",
    "agent/decide.py",
)
IMPURE = {"asyncio", "grpc", "os", "pathlib", "shutil", "socket", "sqlite3", "subprocess", "threading", "time"}


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_the_decisions_are_pure():
    paths = [p for d in DECISIONS for p in ([REPO / d] if d.endswith(".py") else sorted((REPO / d).glob("*.py")))]
    assert len(paths) > 10, paths
    offenders = {p.relative_to(REPO).as_posix(): sorted(_top_level_imports(p) & IMPURE) for p in paths}
    assert not {k: v for k, v in offenders.items() if v}


def test_no_module_asks_which_kind_of_config_it_serves():
    """One house: nothing in the coordinator, the contract or the launchers asks for a mode or
    dispatches on the coordinator's class; the config says what it declares, and the cluster
    serves it through the same code (the assembly alone picks the store's term loop)."""
    offenders = []
    for room in ("coordinator", "meshgate", "launchers"):
        for path in sorted((REPO / room).rglob("*.py")):
            if path.relative_to(REPO).parts[:2] == ("meshgate", "v1"):
                continue
            text = path.read_text()
            offenders += [f"{path.relative_to(REPO)}: jobs_mode" for _ in [0] if "jobs_mode" in text]
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance":
                    shown = ast.unparse(node.args[1])
                    if "ClusterCoordinator" in shown:
                        offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: isinstance(..., {shown})")
    assert not offenders, offenders


def _class_sizes(room: str) -> dict[str, int]:
    sizes = {}
    for path in sorted((REPO / room).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                sizes[f"{path.relative_to(REPO)}:{node.name}"] = node.end_lineno - node.lineno + 1
    return sizes


@pytest.mark.parametrize("room", ["coordinator", "agent"])
def test_no_class_of_the_daemons_is_longer_than_300_lines(room):
    sizes = _class_sizes(room)
    assert sizes and max(sizes.values()) <= 300, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
