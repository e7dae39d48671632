"""State that cannot be trusted is refused before serving, and never touched (issue #12).

A real coordinator builds three snapshots of one job's state: A (kill -9 after node 0
registered: database + WAL), B (kill -9 after node 1 too) and C (a clean stop after B:
the WAL checkpointed away). Each case damages a copy of one of them (or the config) and
starts ``python -m meshgate.coordinator`` on it. Refused: exit 2, the state file named,
and every state file (the high-water mark too) byte-for-byte as found. Served (only
where the damage is harmless): every worker gets the rank it had.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import meshgate
from conftest import REPO, worker_env
from meshgate.coordinator.store.codec import RECORD_SCHEMA, chain_sum
from test_crash import PLAN, message, register_retrying
from meshgate.attestation import TrustBundle, verify_attestation

pytestmark = pytest.mark.slow

JOB = "integrity"
LOG = Path("state") / "jobs" / JOB  # the declared job's own log (the cluster's is state/cluster)
MARK = Path("keys") / "marks" / JOB
WORKERS = [(node, local) for node in (0, 1) for local in range(8)]


def snapshot(coordinator_dir: Path, to: Path) -> Path:
    shutil.copytree(coordinator_dir / "state", to / "state")
    shutil.copytree(coordinator_dir / "keys", to / "keys")
    return to


def digests(case: Path) -> dict[str, str]:
    files = sorted(p for p in (case / "state").rglob("*") if p.is_file())
    files += sorted(p for p in (case / "keys" / "marks").rglob("*") if p.is_file())
    return {str(p.relative_to(case)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files if p.exists()}


def write_config(case: Path, original: Path, job_id: str = JOB, plan: str | None = None) -> Path:
    text = original.read_text().replace(str(original.parent / "keys"), str(case / "keys"))
    text = text.replace(f'id = "{JOB}"', f'id = "{job_id}"')
    if plan is not None:
        head, _, rest = text.partition("[plan]\n")
        text = head + "[plan]\n" + plan + "\n" + rest[rest.index("[server]") :]
    config = case / "coordinator.toml"
    config.write_text(text)
    return config


def start(config: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    port_file = config.parent / "addr"
    log = open(config.parent / "log", "wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshgate.coordinator",
            "--config",
            str(config),
            "--port-file",
            str(port_file),
            "--listen",
            "127.0.0.1:0",
            *extra,
        ],
        cwd=REPO,
        env=worker_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while process.poll() is None and not port_file.exists():
        assert time.monotonic() < deadline, (config.parent / "log").read_text()
        time.sleep(0.05)
    return process, port_file


async def ranks_served(address: str, bundle: TrustBundle, job_id: str = JOB, workers=WORKERS) -> dict[str, int]:
    got = {}
    for node, local in workers:
        m = message(job_id, node, local)
        reply = await register_retrying(address, m)
        got[m.worker_id] = verify_attestation(reply.attestation, bundle, job_id=job_id, nonce=m.nonce).rank
    return got


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    from conftest import start_coordinator

    base = tmp_path_factory.mktemp("integrity")
    c = start_coordinator(base / "coordinator", PLAN, JOB, 8)
    bundle = TrustBundle.load(c.trust_bundle_path)

    async def register(nodes):
        ranks = {}
        for node in nodes:
            for local in range(8):
                m = message(JOB, node, local)
                reply = await register_retrying(c.address, m)
                ranks[m.worker_id] = verify_attestation(reply.attestation, bundle, job_id=JOB, nonce=m.nonce).rank
        return ranks

    asyncio.run(register([0]))
    c.kill()
    a = snapshot(base / "coordinator", base / "A")
    assert (a / LOG / "state.sqlite3-wal").exists()
    c.restart()
    expected = asyncio.run(register([1, 0]))
    c.kill()
    b = snapshot(base / "coordinator", base / "B")
    c.restart()
    c.stop()
    cc = snapshot(base / "coordinator", base / "C")
    assert not (cc / LOG / "state.sqlite3-wal").exists()
    return {"A": a, "B": b, "C": cc, "config": c.config_path, "expected": expected, "bundle": bundle}


def _flip_bit_in_wal(state: Path) -> None:
    wal = state / "state.sqlite3-wal"
    data = bytearray(wal.read_bytes())
    data[len(data) - 100] ^= 0x04  # inside the last frame's page
    wal.write_bytes(bytes(data))


def _edit_event_body(state: Path) -> None:
    with sqlite3.connect(state / "state.sqlite3") as db:
        seq, body = db.execute("SELECT seq, body FROM events WHERE body LIKE '%\"rank\":3,%'").fetchone()
        db.execute("UPDATE events SET body = ? WHERE seq = ?", (body.replace('"rank":3,', '"rank":7,'), seq))
    db.close()


def _old_schema(state: Path) -> None:
    with sqlite3.connect(state / "state.sqlite3") as db:
        db.execute("UPDATE meta SET value = '1' WHERE key = 'schema'")
    db.close()


def _truncate(state: Path) -> None:
    db = state / "state.sqlite3"
    db.write_bytes(db.read_bytes()[: db.stat().st_size // 3])


# name: (snapshot, damage(case_dir, snapshots), config edits, what it must say)
CASES = {
    "zero_byte_db": ("C", lambda c, s: (c / LOG / "state.sqlite3").write_bytes(b""), {}, "0 bytes"),
    "db_deleted_wal_kept": ("B", lambda c, s: (c / LOG / "state.sqlite3").unlink(), {}, "write-ahead log"),
    "state_deleted_mark_kept": ("C", lambda c, s: shutil.rmtree(c / LOG), {}, "acknowledged"),
    "stale_wal_over_newer_db": (
        "C",
        lambda c, s: [shutil.copy(s["A"] / LOG / n, c / LOG / n) for n in ("state.sqlite3-wal", "state.sqlite3-shm")],
        {},
        "",
    ),
    "bit_flipped_in_wal": ("B", lambda c, s: _flip_bit_in_wal(c / LOG), {}, ""),
    "edited_event_body": ("C", lambda c, s: _edit_event_body(c / LOG), {}, "checksum does not match"),
    "truncated_db": ("C", lambda c, s: _truncate(c / LOG), {}, ""),
    "mark_deleted": ("C", lambda c, s: (c / MARK).unlink(), {}, "high-water mark"),
    "old_format": ("C", lambda c, s: _old_schema(c / LOG), {}, "older meshgate"),
    # The cluster's log holds job 'integrity', RUNNING, declared by a config that named it.
    "wrong_job": ("C", lambda c, s: None, {"job_id": "other-job"}, "job 'integrity', declared by"),
    "changed_plan": ("C", lambda c, s: None, {"plan": "tp = 4\ndp_shard = 4"}, "pinned to plan"),
}
NAMED = {"wrong_job": Path("state") / "cluster"}  # the file a refusal names, when not the job's log
HARMLESS = {
    "intact_after_kill": ("B", lambda c, s: None),
    "intact_after_clean_stop": ("C", lambda c, s: None),
    "newer_wal_over_older_db": (
        "A",
        lambda c, s: [shutil.copy(s["B"] / LOG / n, c / LOG / n) for n in ("state.sqlite3-wal", "state.sqlite3-shm")],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_untrusted_state_is_refused_and_left_as_found(snapshots, tmp_path, case):
    source, damage, edits, says = CASES[case]
    case_dir = snapshot(snapshots[source], tmp_path / case)
    damage(case_dir, snapshots)
    config = write_config(case_dir, snapshots["config"], **edits)
    before = digests(case_dir)
    process, _ = start(config)
    try:
        rc = process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    out = (case_dir / "log").read_text()
    assert rc == 2, f"{case}: served a state it should refuse:\n{out}"
    assert str(case_dir / NAMED.get(case, LOG / "state.sqlite3")) in out, out
    assert says in out and "--reset-state" in out, out
    assert digests(case_dir) == before, f"{case}: a refused state was modified"


@pytest.mark.parametrize("case", sorted(HARMLESS))
def test_harmless_state_serves_every_rank_it_had(snapshots, tmp_path, case):
    source, damage = HARMLESS[case]
    case_dir = snapshot(snapshots[source], tmp_path / case)
    damage(case_dir, snapshots)
    config = write_config(case_dir, snapshots["config"])
    process, port_file = start(config)
    try:
        assert process.poll() is None, (case_dir / "log").read_text()
        got = asyncio.run(ranks_served(port_file.read_text().strip(), snapshots["bundle"]))
    finally:
        process.terminate()
        process.wait(timeout=30)
    expected = snapshots["expected"]
    if source == "A":  # node 0 only was acknowledged in A; the newer WAL carries node 1 too
        assert {w: r for w, r in got.items() if w.startswith("n0/")} == {
            w: r for w, r in expected.items() if w.startswith("n0/")
        }
    assert got == expected


def _append_newer_record(state: Path, body: str) -> None:
    """A record a newer release wrote after this one's: chained as it would chain it."""
    with sqlite3.connect(state / "state.sqlite3") as db:
        seq, last = db.execute("SELECT seq, body FROM events ORDER BY seq DESC LIMIT 1").fetchone()
        prev = last.split(" ", 2)[1]
        db.execute(
            "INSERT INTO events (seq, body) VALUES (?, ?)",
            (seq + 1, f"{prev} {chain_sum(prev, seq + 1, body)} {body}"),
        )
    db.close()


def _newer_schema(state: Path) -> None:
    with sqlite3.connect(state / "state.sqlite3") as db:
        db.execute("UPDATE meta SET value = '3' WHERE key = 'schema'")
    db.close()


CLUSTER_LOG = Path("state") / "cluster"
# A rollback past a change of the state format (issue 35): name: (damage, the file it names, what it says).
NEWER = {
    "newer_event_kind_in_the_cluster_log": (
        lambda c: _append_newer_record(c / CLUSTER_LOG, '{"job_id":"integrity","kind":"JobArchived"}'),
        CLUSTER_LOG,
        "event kind 'JobArchived' is unknown to this release",
    ),
    "newer_event_field_in_the_job_log": (
        lambda c: _append_newer_record(
            c / LOG, '{"at":5.0,"generation":1,"kind":"GenerationBumped","reason":"x","why_code":7}'
        ),
        LOG,
        "GenerationBumped has fields ['why_code'] unknown to this release",
    ),
    "newer_schema": (lambda c: _newer_schema(c / LOG), LOG, "schema 3"),
}


@pytest.mark.parametrize("case", sorted(NEWER))
def test_a_newer_release_s_state_is_refused_naming_both_versions_and_the_way_back_never_a_reset(
    snapshots, tmp_path, case
):
    damage, named, says = NEWER[case]
    case_dir = snapshot(snapshots["C"], tmp_path / case)
    damage(case_dir)
    config = write_config(case_dir, snapshots["config"])
    before = digests(case_dir)
    process, _ = start(config)
    try:
        rc = process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    out = (case_dir / "log").read_text()
    assert rc == 2, f"{case}: served a newer release's state:\n{out}"
    assert str(case_dir / named / "state.sqlite3") in out and says in out, out
    assert "written by a newer meshgate release" in out and f"release {meshgate.__version__}" in out, out
    assert f"state schema {RECORD_SCHEMA}" in out and "start the release that wrote it again" in out, out
    assert "--reset-state (moves" not in out and "Not --reset-state" in out, out
    assert digests(case_dir) == before, f"{case}: a refused state was modified"


def test_reset_state_moves_the_refused_files_aside_and_starts_fresh(snapshots, tmp_path):
    case_dir = snapshot(snapshots["C"], tmp_path / "reset")
    _edit_event_body(case_dir / LOG)
    config = write_config(case_dir, snapshots["config"])
    before = digests(case_dir)
    process, port_file = start(config, "--reset-state")
    try:
        assert process.poll() is None, (case_dir / "log").read_text()
        new_bundle = TrustBundle.load(case_dir / "keys" / "trust-bundle.json")
        fresh = asyncio.run(ranks_served(port_file.read_text().strip(), new_bundle))
        # The reset rotated the signing key: what it signs now does not verify under the old
        # bundle, and what the old key signed does not verify under the new one.
        assert not set(new_bundle.keys) & set(snapshots["bundle"].keys)
        with pytest.raises(Exception, match="key"):
            asyncio.run(ranks_served(port_file.read_text().strip(), snapshots["bundle"]))
    finally:
        process.terminate()
        process.wait(timeout=30)
    out = (case_dir / "log").read_text()
    assert "MOVED" in out and "NO jobs" in out and "NEW signing key" in out, out
    assert sorted(fresh.values()) == list(range(PLAN.world_size))
    aside = {}
    for name, digest in before.items():
        top = Path(*Path(name).parts[:2])  # state/cluster, state/jobs or keys/marks: moved aside whole
        moved = list((case_dir / top.parent).glob(top.name + ".reset-*"))
        assert len(moved) == 1, f"{name} was not moved aside: {list((case_dir / top.parent).iterdir())}"
        aside[name] = hashlib.sha256((moved[0] / Path(name).relative_to(top)).read_bytes()).hexdigest()
    assert aside == before, "the files moved aside must be exactly the old ones"
