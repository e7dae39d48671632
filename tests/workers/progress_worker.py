"""A worker that trains at a pace and reports it (tests/test_progress.py): no torch, no Register.

Steps every PROGRESS_STEP_S seconds (rank PROGRESS_SLOW_RANK takes PROGRESS_SLOW_S
instead), calling meshgate.report(step, loss=..., step_time_s=...) after each, until the
path PROGRESS_UNTIL exists; then exits 0. With PROGRESS_STALL_AFTER=N it stops stepping
after step N (and keeps waiting), as a hung job would. Needs only the node agent's socket
(MESHGATE_AGENT_SOCKET, set by the agent)."""

import os
import sys
import time

import meshgate

rank = int(os.environ["MESHGATE_RANK_BLOCK"].split("-")[0]) + int(os.environ["LOCAL_RANK"])
pace = float(
    os.environ["PROGRESS_SLOW_S"]
    if rank == int(os.environ.get("PROGRESS_SLOW_RANK", "-1"))
    else os.environ["PROGRESS_STEP_S"]
)
stall_after = int(os.environ.get("PROGRESS_STALL_AFTER", "0"))
release = os.environ["PROGRESS_UNTIL"]
step = 0
while not os.path.exists(release):
    if stall_after and step >= stall_after:
        time.sleep(0.1)
        continue
    time.sleep(pace)
    step += 1
    meshgate.report(step, loss=10.0 / step, samples_per_s=32 / pace, step_time_s=pace)
print(f"rank {rank} stopped at step {step}", flush=True)
sys.exit(0)
