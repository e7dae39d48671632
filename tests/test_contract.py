"""The committed stubs are exactly what proto/ generates, and the layout's arrows hold."""

from __future__ import annotations

import ast
import filecmp
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_fresh(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run([str(REPO / "scripts" / "gen_protos.sh"), str(tmp_path)], check=True, env=env)
    generated = sorted(p.relative_to(tmp_path) for p in (tmp_path / "meshgate" / "v1").glob("*.py*"))
    assert generated, "protoc generated nothing"
    stale = [
        str(rel) for rel in generated if not filecmp.cmp(tmp_path / rel, REPO / rel, shallow=False)
    ]
    assert not stale, f"stale stubs, run `make protos`: {stale}"
    committed = sorted(
        p.relative_to(REPO) for p in (REPO / "meshgate" / "v1").glob("*_pb2*.py*")
    )
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
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
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
