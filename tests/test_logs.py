"""Structured logs: JSON lines with event fields, and no token or key material, ever."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO, worker_env, write_config
from meshgate import logs
from meshgate.plan import ParallelPlan

TOKEN = "tok-Secret-5b0e7c1d"


@pytest.fixture
def capture():
    """A fresh root handler through logs.setup on a StringIO; the old state comes back."""
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    saved_secrets = logs.redaction_filter()._secrets
    stream = io.StringIO()

    def make(fmt="text", secrets=(), level="DEBUG"):
        logs.setup(level, fmt, secrets=secrets, stream=stream)
        return stream

    yield make
    for handler in list(root.handlers):
        if handler not in saved_handlers:
            root.removeHandler(handler)
    for handler in saved_handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(saved_level)
    logs.redaction_filter()._secrets = saved_secrets


@dataclass(frozen=True)
class FakeConfig:
    job_id: str
    join_token: str


def test_redacts_secret_fields_in_every_spelling():
    f = logs.RedactingFilter()
    cases = [
        "join_token=abc123def",
        "join_token = 'abc123def'",
        'join_token: "abc123def"',
        '{"join_token": "abc123def", "job": "x"}',
        "FakeConfig(job_id='x', join_token='abc123def')",
        "node_credential=b'abc123def'",
        "Authorization: Bearer abc123def",
        "api_key=abc123def; password=abc123def",
    ]
    for text in cases:
        out = f.redact(text)
        assert "abc123def" not in out, (text, out)
        assert logs.REDACTED in out
        assert f.redact(out) == out, "redaction must be idempotent"
    # Words that merely mention a secret's name, and public key ids, stay.
    for text in ("join_token for node_id 'n1' is not valid", "key_id=ed25519:0123abcd", "tokens used 3"):
        assert f.redact(text) == text


def test_redacts_pem_private_keys():
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    pem = (
        Ed25519PrivateKey.generate()
        .private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        .decode()
    )
    body = pem.splitlines()[1]
    out = logs.RedactingFilter().redact(f"loaded {pem} ok")
    assert body not in out and "PRIVATE KEY-----" in out and out.endswith("ok")


def test_literal_secrets_args_extras_and_tracebacks(capture):
    stream = capture("text", secrets=[TOKEN])
    log = logging.getLogger("meshgate.test")
    log.info("config %s", FakeConfig("job", TOKEN))
    log.info("raw %s in the middle", TOKEN)
    log.info("extra", extra={"join_token": TOKEN, "note": f"has {TOKEN}", "nested": {"secret": "x1y2z3w4"}})
    try:
        raise ValueError(f"bad token {TOKEN}")
    except ValueError:
        log.exception("failed")
    text = stream.getvalue()
    assert TOKEN not in text
    assert "x1y2z3w4" not in text
    assert text.count(logs.REDACTED) >= 3
    assert "ValueError: bad token [REDACTED]" in text  # the traceback stays, redacted


def test_byte_secrets_are_redacted_in_every_spelling():
    import base64

    credential = bytes(range(200, 232))
    f = logs.RedactingFilter([credential])
    for spelled in (credential.hex(), base64.b64encode(credential).decode()):
        assert spelled not in f.redact(f"node credential {spelled} issued")


def test_short_values_are_not_treated_as_secrets():
    f = logs.RedactingFilter(["ab", ""])
    assert f.redact("a cab stand") == "a cab stand"


def test_json_lines_carry_event_fields(capture):
    stream = capture("json", secrets=[TOKEN])
    log = logging.getLogger("meshgate.coordinator")

    @dataclass(frozen=True)
    class NodeStateChanged:
        node_id: str
        state: str
        at: float
        reason: str = ""

    event = NodeStateChanged("node-b", "lost", 12.5, "no heartbeat for 1.2s")
    log.warning("event %s", event, extra=logs.event_fields(event))
    log.info("joined", extra=logs.event_fields(name="node_joined", node_id="n", msg="clash", join_token=TOKEN))
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert lines[0]["event"] == "node_lost"
    assert lines[0]["node_id"] == "node-b" and lines[0]["reason"].startswith("no heartbeat")
    assert lines[0]["level"] == "WARNING" and lines[0]["logger"] == "meshgate.coordinator"
    assert lines[0]["ts"].endswith("Z")
    assert lines[1]["event"] == "node_joined" and lines[1]["event_msg"] == "clash"
    assert lines[1]["join_token"] == logs.REDACTED


def test_event_names():
    @dataclass
    class GenerationBumped:
        generation: int

    @dataclass
    class RankAssigned:
        rank: int

    assert logs.event_name(GenerationBumped(2)) == "generation_bumped"
    assert logs.event_name(RankAssigned(0)) == "rank_assigned"


def test_setup_again_replaces_its_handler(capture):
    stream = capture("text")
    count = len(logging.getLogger().handlers)
    logs.setup("INFO", "json")  # keeps the stream it had
    assert len(logging.getLogger().handlers) == count
    logging.getLogger("x").info("hello")
    assert json.loads(stream.getvalue().splitlines()[-1])["msg"] == "hello"
    with pytest.raises(ValueError):
        logs.setup("INFO", "xml")


def test_engine_events_are_logged_once_each_with_fields(capture):
    """The coordinator logs one structured record per state change; per-rank at DEBUG."""
    import asyncio
    import secrets as pysecrets

    from meshgate.coordinator.engine import Coordinator
    from meshgate.coordinator.keys import KeyRing
    from meshgate.coordinator.rendezvous import RegisterInput, RendezvousConfig
    from meshgate.coordinator.store import MemoryStore

    stream = capture("json", secrets=[TOKEN])

    async def go(tmp: Path):
        config = RendezvousConfig(job_id="j", plan=ParallelPlan(tp=2), slots_per_node=2, join_token=TOKEN)
        coordinator = Coordinator(config, MemoryStore(), KeyRing(tmp, job_id="j"), attestation_ttl_s=60)
        await coordinator.join("j", "n1", "host1", 2, "cpu", TOKEN)
        for local in range(2):
            await coordinator.register(RegisterInput("j", f"w{local}", pysecrets.token_bytes(16), "n1", local, None))

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(go(Path(tmp)))
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    events = [r for r in records if "event" in r]
    names = [e["event"] for e in events]
    assert names[0] == "node_joined" and names.count("node_joined") == 1
    assert names.count("rank_assigned") == 2
    assert events[0]["level"] == "INFO" and events[0]["node_id"] == "n1"
    assert {e["level"] for e in events if e["event"] == "rank_assigned"} == {"DEBUG"}
    assert TOKEN not in stream.getvalue()


# ---- real processes -------------------------------------------------------------------------


@pytest.mark.slow
def test_failed_join_logs_no_token_or_key(coordinator_factory, tmp_path):
    """A coordinator and an agent with the wrong token, both at DEBUG and in JSON: neither
    log holds either token, nor the signing key."""
    good, wrong = "Good-Join-Token-9f8e7d", "Wrong-Join-Token-1a2b3c"
    running = coordinator_factory(
        ParallelPlan(tp=2),
        slots_per_node=2,
        job={"join_token": good},
        server={"log_format": "json"},
    )
    # The fixture starts at INFO; restart at DEBUG so per-rank and gRPC records are in too.
    running.stop()
    log_path = tmp_path / "coordinator-debug.log"
    port_file = tmp_path / "debug.addr"
    with open(log_path, "wb") as out:
        coordinator = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "meshgate.coordinator",
                "--config",
                str(running.config_path),
                "--port-file",
                str(port_file),
                "--log-level",
                "DEBUG",
            ],
            cwd=REPO,
            env=worker_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert coordinator.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        address = port_file.read_text().strip()
        agent_config = write_config(
            tmp_path / "agent.toml",
            {
                "agent": {
                    "coordinator": address,
                    "job": "test",
                    "node_id": "n1",
                    "join_token": wrong,
                    "slots": 2,
                    "state_dir": str(tmp_path / "agent-state"),
                    "insecure": True,
                    "log_format": "json",
                }
            },
        )
        agent = subprocess.run(
            [sys.executable, "-m", "meshgate.agent", "--config", str(agent_config), "--log-level", "DEBUG"],
            cwd=REPO,
            env=worker_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert agent.returncode == 2, agent.stderr
        assert "join refused: UNAUTHENTICATED" in agent.stderr
    finally:
        coordinator.send_signal(signal.SIGTERM)
        coordinator.wait(timeout=15)
    coordinator_log = log_path.read_text()
    agent_log = agent.stdout + agent.stderr
    keys = list((running.config_path.parent / "keys").glob("*.pem"))
    assert keys
    key_lines = [line for k in keys for line in k.read_text().splitlines() if "-----" not in line]
    for text in (coordinator_log, agent_log, running.log()):
        for secret in [good, wrong] + key_lines:
            assert secret not in text
    # Every line is a JSON object (the format is machine-readable end to end).
    for text in (coordinator_log, agent.stderr):
        for line in text.splitlines():
            json.loads(line)
    refusal = [json.loads(line) for line in agent.stderr.splitlines() if "join refused" in line]
    assert refusal and refusal[0]["level"] == "ERROR"
    # The coordinator did log the refusal (so the path was exercised), as an event.
    refused = [json.loads(line) for line in coordinator_log.splitlines() if "UNAUTHENTICATED" in line]
    assert refused and refused[0]["level"] == "WARNING" and refused[0]["event"] == "refused"
    assert refused[0]["method"] == "Join" and "n1" in refused[0]["msg"]
    assert os.path.getsize(log_path) > 0
