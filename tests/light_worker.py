"""A worker without torch: register, verify, await the world, report as JSON.

Env: LIGHT_OUT (directory for results), LIGHT_SLEEP (seconds to linger, for drain tests),
LIGHT_FAIL_ONCE (a marker path: exit 3 the first time, succeed after),
LIGHT_FAIL_RANK (the worker holding this rank exits 1 once the world formed: every time,
or with LIGHT_FAIL_MARKER only the first time), LIGHT_LINGER_GENERATION (linger only
in this generation), LIGHT_EXIT_1_WHEN (a path: while lingering, exit 1 as soon as it
exists, as a worker whose collective broke), LIGHT_EXIT_0_WHEN (a path: while lingering,
exit 0 as soon as it exists, as a worker whose training finished), LIGHT_HEARTBEAT
(seconds: while lingering, heartbeat at this interval; <node>-<local>.hb is written
once the coordinator says the generation is over). Results go to
<node>-<local>.json (the latest generation's); with
LIGHT_KEEP_GENERATIONS also to <node>-<local>.g<generation>.result.
"""

import json
import os
import signal
import sys
import time

from meshgate.client import await_world, heartbeat, register


def _write_whole(path: str, result: dict) -> None:
    """Written under another name and renamed: a test that sees the file reads all of it
    (a reader that globbed a file still being written read '' under load)."""
    with open(path + ".partial", "w") as handle:
        json.dump(result, handle)
    os.replace(path + ".partial", path)


def main() -> int:
    fail_marker = os.environ.get("LIGHT_FAIL_ONCE")
    if fail_marker and not os.path.exists(fail_marker):
        open(fail_marker, "w").close()
        return 3
    att = register()
    world = await_world(generation=att.generation, timeout=60)
    result = {
        "rank": att.rank,
        "node_id": att.node_id,
        "node_rank": att.node_rank,
        "local_rank": att.local_rank,
        "coordinate": dict(att.coordinate),
        "world_size": world.world_size,
        "master": [world.master_addr, world.master_port],
        "rank_block": os.environ.get("MESHGATE_RANK_BLOCK"),
        "pid": os.getpid(),
        "generation": att.generation,
        "signed": att.signed.SerializeToString().hex(),
        "nonce": att.nonce.hex(),
        "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER"),  # the agent's: cuda:i is NVML's GPU i
    }
    out = os.environ["LIGHT_OUT"]
    _write_whole(os.path.join(out, f"{att.node_id}-{att.local_rank}.json"), result)
    if os.environ.get("LIGHT_KEEP_GENERATIONS"):  # one more file per generation, kept
        _write_whole(os.path.join(out, f"{att.node_id}-{att.local_rank}.g{att.generation}.result"), result)
    fail_rank, marker = os.environ.get("LIGHT_FAIL_RANK"), os.environ.get("LIGHT_FAIL_MARKER")
    if fail_rank and att.rank == int(fail_rank) and not (marker and os.path.exists(marker)):
        if marker:
            open(marker, "w").close()
        return 1
    linger = float(os.environ.get("LIGHT_SLEEP", "0"))
    only = os.environ.get("LIGHT_LINGER_GENERATION")
    if only is not None and att.generation != int(only):
        linger = 0
    if linger:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        if os.environ.get("LIGHT_HEARTBEAT"):
            beats = os.path.join(out, f"{att.node_id}-{att.local_rank}.hb")
            heartbeat(  # a daemon thread: it beats until the process ends
                att,
                interval=float(os.environ["LIGHT_HEARTBEAT"]),
                on_generation_over=lambda refusal: _write_whole(beats, {"over": refusal.details}),
            )
        broken, finished = os.environ.get("LIGHT_EXIT_1_WHEN"), os.environ.get("LIGHT_EXIT_0_WHEN")
        deadline = time.monotonic() + linger
        while time.monotonic() < deadline:
            if broken and os.path.exists(broken):
                return 1
            if finished and os.path.exists(finished):
                return 0
            time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
