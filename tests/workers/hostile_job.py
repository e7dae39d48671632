"""A hostile job's worker (stdlib only, so the job user's /usr/bin/python3.11 runs it):
it ignores SIGTERM, forks a daemon in a session of its own, tries to read the agent's
secret files, lists the job user's processes alive when it starts, and asks the agent's
vouch socket for a vouch. It records all of it in HOSTILE_OUT/<its cgroup's name (the
containment unit: job-<job>-g<generation>)>-<local rank>.json.

Env: HOSTILE_OUT, HOSTILE_SECRETS (paths, ":"-separated), HOSTILE_EXIT ("1": exit 0
after recording, leaving the daemon behind; else linger until killed), HOSTILE_FAIL_ONCE
(a marker path: local rank 0 exits 1 after recording the first time, so the job restarts
into a new generation).
"""

import json
import os
import signal
import socket
import sys
import time


def user_processes() -> list[int]:
    uid, found = os.getuid(), []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/status") as handle:
                status = handle.read()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("State", "").strip().startswith("Z"):
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            found.append(int(entry))
    return sorted(found)


def ask_vouch(local_rank: int) -> dict:
    path = os.environ.get("MESHGATE_AGENT_SOCKET", "")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(path)
            sock.sendall(json.dumps({"local_rank": local_rank}).encode() + b"\n")
            return json.loads(sock.makefile().readline())
    except OSError as exc:
        return {"error": f"socket: {exc}"}


def main() -> int:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    started = user_processes()
    local_rank = int(os.environ["LOCAL_RANK"])
    reads = {}
    for path in filter(None, os.environ.get("HOSTILE_SECRETS", "").split(":")):
        try:
            with open(path, "rb") as handle:
                handle.read(1)
            reads[path] = "read"
        except OSError as exc:
            reads[path] = type(exc).__name__
    ready_r, ready_w = os.pipe()
    if os.fork() == 0:  # the daemon: a new session, SIGTERM ignored, outlives its parent
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            os.write(ready_w, str(os.getpid()).encode())
            os.close(ready_w)
            while True:
                time.sleep(60)
        os._exit(0)
    os.close(ready_w)
    daemon = int(os.read(ready_r, 32))
    record = {
        "pid": os.getpid(),
        "uid": os.getuid(),
        "daemon": daemon,
        "reads": reads,
        "alive_at_start": started,
        "vouch": ask_vouch(local_rank),
        "cgroup": open("/proc/self/cgroup").read().strip().splitlines()[-1],
        "job": os.environ.get("MESHGATE_JOB", ""),
        "cwd": os.getcwd(),
        "home": os.environ.get("HOME", ""),
        # the job's plan, as the agent wrote it for its workers (meshgate.current_plan() reads it)
        "plan_file": os.environ.get("MESHGATE_PLAN_FILE", ""),
        "plan_text": open(os.environ["MESHGATE_PLAN_FILE"]).read() if os.environ.get("MESHGATE_PLAN_FILE") else "",
        # modules an earlier job planted where this one's `python -c` looks first (its cwd)
        "plants_seen": sorted(
            f
            for f in os.listdir(".")
            if f.startswith("plant_") and f != f"plant_{os.environ.get('MESHGATE_JOB', '')}.py"
        ),
    }
    with open(f"plant_{record['job']}.py", "w") as plant:
        plant.write("STOLEN = True\n")
    unit = record["cgroup"].rsplit("/", 1)[-1]
    out = os.path.join(os.environ["HOSTILE_OUT"], f"{unit}-{local_rank}.json")
    with open(out + ".tmp", "w") as handle:
        json.dump(record, handle)
    os.rename(out + ".tmp", out)
    if os.environ.get("HOSTILE_EXIT") == "1":
        return 0
    marker = os.environ.get("HOSTILE_FAIL_ONCE")
    if marker and local_rank == 0 and not os.path.exists(marker):
        open(marker, "w").close()
        return 1
    while True:
        time.sleep(60)


if __name__ == "__main__":
    sys.exit(main())
