"""The agent's TOML config."""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class AgentConfigError(ValueError):
    pass


_KEYS = {
    "coordinator", "job", "node_id", "join_token", "join_token_file", "slots", "cpu_slots",
    "state_dir", "exit_when_done", "insecure", "join_timeout_s", "drain_grace_s",
}


@dataclass(frozen=True)
class AgentConfig:
    coordinator: str
    job: str
    node_id: str
    join_token: str
    slots: Optional[int]  # None: detect GPUs, else cpu_slots
    cpu_slots: int
    state_dir: Path
    exit_when_done: bool = False
    insecure: bool = False
    join_timeout_s: float = 300.0
    drain_grace_s: float = 10.0

    @classmethod
    def load(cls, path: str | Path) -> "AgentConfig":
        path = Path(path)
        try:
            document = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise AgentConfigError(f"{path}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise AgentConfigError(f"{path}: invalid TOML: {exc}") from exc
        try:
            return cls.from_mapping(document.get("agent", {}), base_dir=path.parent)
        except AgentConfigError as exc:
            raise AgentConfigError(f"{path}: {exc}") from exc

    @classmethod
    def from_mapping(cls, table: Mapping[str, Any], base_dir: Path = Path(".")) -> "AgentConfig":
        unknown = sorted(set(table) - _KEYS)
        if unknown:
            raise AgentConfigError(f"[agent] unknown key(s) {unknown}; known: {sorted(_KEYS)}")
        for key in ("coordinator", "job"):
            if not isinstance(table.get(key), str) or not table[key]:
                raise AgentConfigError(f"[agent] {key} must be a non-empty string")
        token = table.get("join_token", "")
        token_file = table.get("join_token_file")
        if token_file:
            token_path = Path(token_file)
            if not token_path.is_absolute():
                token_path = base_dir / token_path
            try:
                token = token_path.read_text().strip()
            except OSError as exc:
                raise AgentConfigError(f"[agent] join_token_file {token_path}: {exc.strerror}") from exc
        slots = table.get("slots", "auto")
        if slots != "auto" and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 1):
            raise AgentConfigError(f"[agent] slots must be \"auto\" or an integer >= 1, got {slots!r}")
        cpu_slots = table.get("cpu_slots", 1)
        if isinstance(cpu_slots, bool) or not isinstance(cpu_slots, int) or cpu_slots < 1:
            raise AgentConfigError(f"[agent] cpu_slots must be an integer >= 1, got {cpu_slots!r}")
        state_dir = Path(table.get("state_dir", "state/agent"))
        if not state_dir.is_absolute():
            state_dir = base_dir / state_dir
        return cls(
            coordinator=table["coordinator"],
            job=table["job"],
            node_id=str(table.get("node_id") or socket.gethostname()),
            join_token=str(token),
            slots=None if slots == "auto" else slots,
            cpu_slots=cpu_slots,
            state_dir=state_dir,
            exit_when_done=bool(table.get("exit_when_done", False)),
            insecure=bool(table.get("insecure", False)),
            join_timeout_s=float(table.get("join_timeout_s", 300.0)),
            drain_grace_s=float(table.get("drain_grace_s", 10.0)),
        )
