"""Logging for meshgate's daemons: text or JSON lines, one event per state change,
and never a secret.

    from meshgate import logs
    logs.setup("INFO", "json")              # once, at startup (again to switch format)
    logs.add_secret(config.join_token)      # once the config is read
    log.info("node %s lost", node_id, extra=logs.event_fields(event))

``RedactingFilter`` sits on the handler that ``setup`` installs, so it sees every
record of every logger (grpc's included) before it is formatted. It redacts:

- the values of known secret fields, written as ``join_token=...``, ``join_token: "..."``,
  ``'join_token': b'...'`` or JSON ``"join_token": "..."`` in a message, or passed as
  ``extra={"join_token": ...}``;
- ``Bearer ...`` credentials and PEM private-key blocks;
- any occurrence of a registered secret value (the configured join token), wherever it
  appears: message, arguments, extra fields, exception text.

JSON lines carry ``ts``, ``level``, ``logger``, ``msg`` and every ``extra`` field; the
coordinator's state changes add ``event`` (``node_joined``, ``node_lost``,
``rank_assigned``, ``generation_bumped``, ...) and the event's own fields.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import json
import logging
import re
import sys
import threading
import time
from typing import Any, Iterable, Mapping, Optional, TextIO

REDACTED = "[REDACTED]"
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Field names whose values are secrets (case-insensitive, matched as whole names or as
# the end of one: join_token, access_token, node_credential, db_password, ...).
_SECRET_NAME = (
    r"[A-Za-z0-9_\-]*(?:token|credential|credentials|password|passwd|secret|private_key"
    r"|api_key|apikey|authorization)"
)
_SECRET_NAME_RE = re.compile(rf"^{_SECRET_NAME}$", re.IGNORECASE)
# name, optional closing quote, ':' or '=', then a quoted (maybe bytes) or bare value.
_FIELD_RE = re.compile(
    rf"""(?P<key>(?<![A-Za-z0-9_\-]){_SECRET_NAME}["']?\s*[:=]\s*)"""
    r"""(?!\[REDACTED\])(?P<value>b?"(?:[^"\\]|\\.)*"|b?'(?:[^'\\]|\\.)*'|[^\s,;)}\]]+)""",
    re.IGNORECASE,
)
_BEARER_RE = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=\-]{4,}")
_PEM_RE = re.compile(
    r"-----BEGIN ([A-Z0-9 ]*)PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|$)",
    re.DOTALL,
)
# What any of the three patterns above needs in a text to match (a name's ':' or '=', a
# PEM header, a scheme word): most log fields (ids, numbers) have none, and skip the three.
_MAY_MATCH_RE = re.compile(r"[:=]|-----BEGIN|bearer|basic", re.IGNORECASE)
MIN_SECRET_LEN = 4

# Attributes every LogRecord has; anything else on a record came in through ``extra``.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None))) | {
    "message",
    "asctime",
    "taskName",
}


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME_RE.match(name))


class RedactingFilter(logging.Filter):
    """Rewrites each record so that no secret reaches a formatter. Never drops a record."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._secrets: tuple[str, ...] = ()
        self.add_secrets(secrets)

    def add_secrets(self, secrets: Iterable[Any]) -> None:
        fresh = set(self._secrets)
        forms: list[Any] = []
        for secret in secrets:
            if isinstance(secret, (bytes, bytearray)):
                # Raw bytes reach logs as hex, base64 or text: redact every spelling.
                raw = bytes(secret)
                forms += [raw.hex(), base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode()]
                try:
                    forms.append(raw.decode("utf-8"))
                except UnicodeDecodeError:
                    pass
            else:
                forms.append(secret)
        for secret in forms:
            if isinstance(secret, str) and len(secret.strip()) >= MIN_SECRET_LEN:
                fresh.add(secret.strip())
        with self._lock:
            # Longest first, so a secret that contains another is replaced whole.
            self._secrets = tuple(sorted(fresh, key=len, reverse=True))

    def redact(self, text: str) -> str:
        if not text:
            return text
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, REDACTED)
        if not _MAY_MATCH_RE.search(text):
            return text
        text = _PEM_RE.sub(lambda m: f"-----BEGIN {m.group(1)}PRIVATE KEY----- {REDACTED}", text)
        text = _BEARER_RE.sub(lambda m: f"{m.group(1)} {REDACTED}", text)
        return _FIELD_RE.sub(lambda m: m.group("key") + REDACTED, text)

    def redact_value(self, value: Any, name: str = "") -> Any:
        if name and is_secret_name(name):
            return REDACTED if value not in (None, "", b"") else value
        if isinstance(value, str):
            return self.redact(value)
        if isinstance(value, (bytes, bytearray)):
            text = self.redact(bytes(value).decode("utf-8", "replace"))
            return text if REDACTED in text else value
        if isinstance(value, Mapping):
            return {k: self.redact_value(v, str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.redact_value(v) for v in value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return self.redact(repr(value))
        return value

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string must not hide the record
            message = f"{record.msg!r} % {record.args!r}"
        record.msg, record.args = self.redact(message), None
        for name in list(vars(record)):
            if name not in _STANDARD_ATTRS:
                setattr(record, name, self.redact_value(getattr(record, name), name))
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.redact(record.exc_text)
            # The formatter prefers exc_text when it is set; drop the live exception so
            # nothing re-renders it unredacted.
            record.exc_info = None
        if record.stack_info:
            record.stack_info = self.redact(record.stack_info)
        return True


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD_ATTRS and not k.startswith("_")}


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):  # a state: as the event log and metrics spell it
        return value.value
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).hex()
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, ms), level, logger, msg, extra fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in extra_fields(record).items():
            out.setdefault(key, _jsonable(value))
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = record.stack_info
        return json.dumps(out, ensure_ascii=False, separators=(",", ":"))


# ---- process-wide setup -------------------------------------------------------------------

_FILTER = RedactingFilter()
_HANDLER_MARK = "_meshgate_handler"


def redaction_filter() -> RedactingFilter:
    """The process's filter (on the handler ``setup`` installs)."""
    return _FILTER


def add_secret(*values: Any) -> None:
    """Redact these values (e.g. the configured join token) from every later record."""
    _FILTER.add_secrets(values)


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


def setup(
    level: str | int = "INFO",
    fmt: str = "text",
    *,
    secrets: Iterable[Any] = (),
    stream: Optional[TextIO] = None,
) -> logging.Handler:
    """Route the root logger to one redacting handler on ``stream`` (stderr). Calling it
    again replaces the handler it installed (e.g. once the config names the format)."""
    check_format(fmt)
    add_secret(*secrets)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, _HANDLER_MARK, False):
            root.removeHandler(handler)
            if stream is None:
                stream = getattr(handler, "stream", None)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    setattr(handler, _HANDLER_MARK, True)
    handler.addFilter(_FILTER)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    return handler


# ---- events ---------------------------------------------------------------------------------

_CAMEL_RE = re.compile(r"(?<!^)(?=[A-Z])")


def event_name(event: Any) -> str:
    """NodeJoined -> node_joined; NodeStateChanged(state="lost") -> node_lost."""
    state = getattr(event, "state", None)
    state = state.value if isinstance(state, enum.Enum) else state
    name = type(event).__name__
    if name == "NodeStateChanged" and isinstance(state, str):
        return f"node_{state}"
    return _CAMEL_RE.sub("_", name).lower()


def event_fields(event: Any = None, /, name: str = "", **fields: Any) -> dict[str, Any]:
    """``extra=`` for one state-change record: ``{"event": name, **fields}``. A dataclass
    event contributes its own fields; names a LogRecord reserves get an ``event_`` prefix."""
    out: dict[str, Any] = {"event": name or (event_name(event) if event is not None else "event")}
    if event is not None and dataclasses.is_dataclass(event) and not isinstance(event, type):
        fields = {**{f.name: getattr(event, f.name) for f in dataclasses.fields(event)}, **fields}
    for key, value in fields.items():
        out[f"event_{key}" if key in _STANDARD_ATTRS else key] = value
    return out


# How a cancelled job's end reads wherever it is told (the engine's end, the agents' heartbeat
# and exit replies): a cancel is someone's decision, logged at INFO, never as a failure.
CANCELLED_BY = "job cancelled by "


def cancelled(reason: str) -> bool:
    return reason.startswith(CANCELLED_BY)


__all__ = [
    "CANCELLED_BY",
    "cancelled",
    "REDACTED",
    "JsonFormatter",
    "RedactingFilter",
    "add_secret",
    "event_fields",
    "event_name",
    "redaction_filter",
    "setup",
]
