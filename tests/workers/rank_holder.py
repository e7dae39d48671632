"""A worker that registers (its agent's vouch in MESHGATE_VOUCH), records its
attestation with the job user's processes alive at that moment, and holds its rank
until killed. Run by the job user's interpreter (tests/test_containment.py)."""

import json
import os
import time

from meshgate.client import register


def alive() -> list[int]:
    uid, found = os.getuid(), []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/status") as handle:
                status = dict(line.split(":", 1) for line in handle.read().splitlines() if ":" in line)
        except OSError:
            continue
        if int(status["Uid"].split()[0]) == uid and not status["State"].strip().startswith("Z"):
            found.append(int(entry))
    return sorted(found)


att = register()
record = {
    "pid": os.getpid(),
    "rank": att.rank,
    "generation": att.generation,
    "worker_id": att.worker_id,
    "alive_at_register": alive(),
}
out = os.path.join(os.environ["HOLDER_OUT"], f"g{att.generation}-r{att.rank}-{os.getpid()}.json")
with open(out + ".tmp", "w") as handle:
    json.dump(record, handle)
os.rename(out + ".tmp", out)
while True:
    time.sleep(60)
