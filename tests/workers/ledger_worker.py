"""A worker that keeps a ledger of what it was given, for the coordinator kill loop.

It registers, awaits its world and writes <job>.g<generation>.r<rank>.p<pid>.json under
LEDGER_OUT: job, generation, rank, node, pid, its attestation (and the digest of it), the
nonce, and when it started holding the rank; at exit it adds when it stopped, then exits 0.
LEDGER_GATE (a path): say "<job>.<pid>.ready" under LEDGER_OUT and wait for the
path before registering, so a test can hold every Register of a job at once.
LEDGER_RELEASE (a path): hold the rank until the path exists, so a test can hold every exit.
"""

import hashlib
import json
import os
import sys
import time
from pathlib import Path

from meshgate.client import await_world, register


def wait_for(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.02)


def write(path: Path, record: dict) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record))
    partial.rename(path)  # whole or not at all: the test reads these while workers run


def main() -> int:
    out, job = Path(os.environ["LEDGER_OUT"]), os.environ["MESHGATE_JOB"]
    gate, release = os.environ.get("LEDGER_GATE"), os.environ.get("LEDGER_RELEASE")
    if gate:
        (out / f"{job}.{os.getpid()}.ready").touch()
        wait_for(gate)
    att = register(timeout=60)
    await_world(generation=att.generation, timeout=60)
    signed = att.signed.SerializeToString()
    record = {
        "job": att.job_id,
        "generation": att.generation,
        "rank": att.rank,
        "node": att.node_id,
        "pid": os.getpid(),
        "signed": signed.hex(),
        "digest": hashlib.sha256(signed).hexdigest(),
        "nonce": att.nonce.hex(),
        "start": time.time(),
        "end": None,
    }
    path = out / f"{att.job_id}.g{att.generation}.r{att.rank}.p{os.getpid()}.json"
    write(path, record)
    if release:
        wait_for(release)
    write(path, {**record, "end": time.time()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
