"""A worker that only talks (tests/test_job_logs.py): no torch, no Register.

Prints "hello from rank R" (R from MESHGATE_RANK_BLOCK and LOCAL_RANK). Then
CHATTY_FAIL_RANK: that rank raises (a traceback on stderr, exit 1), every time or, with
CHATTY_FAIL_MARKER (a path), only while the marker does not exist (it creates it);
CHATTY_TICK_UNTIL (a path): every other rank prints "tick N" every 0.1 s until the path
exists, then "rank R done" and exits 0; else it waits to be stopped.
"""

import os
import sys
import time

rank = int(os.environ["MESHGATE_RANK_BLOCK"].split("-")[0]) + int(os.environ["LOCAL_RANK"])
print(f"hello from rank {rank}", flush=True)
marker = os.environ.get("CHATTY_FAIL_MARKER")
if rank == int(os.environ.get("CHATTY_FAIL_RANK", "-1")) and not (marker and os.path.exists(marker)):
    if marker:
        open(marker, "w").close()
    print("about to fail", file=sys.stderr, flush=True)
    raise RuntimeError(f"rank {rank} fails on purpose")
release = os.environ.get("CHATTY_TICK_UNTIL")
if release:
    tick = 0
    while not os.path.exists(release):
        print(f"tick {tick}", flush=True)
        tick += 1
        time.sleep(0.1)
    print(f"rank {rank} done", flush=True)
    sys.exit(0)
time.sleep(120)
