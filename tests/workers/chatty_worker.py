"""A worker that only talks (tests/test_job_logs.py): no torch, no Register.

Prints "hello from rank R" (R from MESHGATE_RANK_BLOCK and LOCAL_RANK). Then
CHATTY_FAIL_RANK: that rank raises (a traceback on stderr, exit 1), the others wait to
be stopped; CHATTY_TICK_UNTIL (a path): every rank prints "tick N" every 0.1 s until the
path exists, then "rank R done" and exits 0.
"""

import os
import sys
import time

rank = int(os.environ["MESHGATE_RANK_BLOCK"].split("-")[0]) + int(os.environ["LOCAL_RANK"])
print(f"hello from rank {rank}", flush=True)
release = os.environ.get("CHATTY_TICK_UNTIL")
if release:
    tick = 0
    while not os.path.exists(release):
        print(f"tick {tick}", flush=True)
        tick += 1
        time.sleep(0.1)
    print(f"rank {rank} done", flush=True)
    sys.exit(0)
if rank == int(os.environ.get("CHATTY_FAIL_RANK", "-1")):
    print("about to fail", file=sys.stderr, flush=True)
    raise RuntimeError(f"rank {rank} fails on purpose")
time.sleep(120)
