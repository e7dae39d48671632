"""Two jobs on one host, on two agents with job users of their own (stdlib only: the job
users' /usr/bin/python3.11 runs it).

CROSS_ROLE=victim: record pid, cwd and uid to CROSS_OUT/victim.json, then linger (its
environment holds CROSS_SECRET and its MESHGATE_VOUCH).
CROSS_ROLE=thief: wait for victim.json, then try everything against the victim and the
victim's agent: read its /proc environ, signal it, ptrace-attach to it, write into its
work directory, dial the victim agent's vouch and fan-in sockets (CROSS_SOCKETS,
":"-separated). Records each outcome in CROSS_OUT/thief.json, then exits 0.
"""

import ctypes
import json
import os
import signal
import socket
import sys
import time

PTRACE_ATTACH, PTRACE_DETACH = 16, 17


def outcome(action) -> str:
    try:
        result = action()
        return f"done: {str(result)[:4000]}"
    except OSError as exc:
        return type(exc).__name__


def ptrace(pid: int) -> str:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.ptrace(PTRACE_ATTACH, pid, 0, 0) == 0:
        libc.ptrace(PTRACE_DETACH, pid, 0, 0)
        return "done: attached"
    return os.strerror(ctypes.get_errno())


def ask(path: str) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(b'{"local_rank": 0}\n')
        return sock.makefile().readline()


def write_into(directory: str) -> str:
    with open(os.path.join(directory, "planted-by-thief.py"), "w") as handle:
        handle.write("STOLEN = True\n")
    return "written"


def main() -> int:
    out = os.environ["CROSS_OUT"]
    if os.environ.get("LOCAL_RANK") != "0":
        return 0
    if os.environ["CROSS_ROLE"] == "victim":
        record = {"pid": os.getpid(), "cwd": os.getcwd(), "uid": os.getuid()}
        with open(os.path.join(out, "victim.json.tmp"), "w") as handle:
            json.dump(record, handle)
        os.chmod(os.path.join(out, "victim.json.tmp"), 0o644)  # the unit's UMask=0077 keeps it from the thief
        os.rename(os.path.join(out, "victim.json.tmp"), os.path.join(out, "victim.json"))
        while True:
            time.sleep(60)
    path = os.path.join(out, "victim.json")
    while not os.path.exists(path):
        time.sleep(0.1)
    victim = json.load(open(path))
    pid = victim["pid"]
    tries = {
        "environ": outcome(lambda: open(f"/proc/{pid}/environ", "rb").read()),
        "signal 0": outcome(lambda: os.kill(pid, 0)),
        "SIGTERM": outcome(lambda: os.kill(pid, signal.SIGTERM)),
        "ptrace": ptrace(pid),
        "write work": outcome(lambda: write_into(victim["cwd"])),
        "list work": outcome(lambda: os.listdir(victim["cwd"])),
    }
    for sock in filter(None, os.environ.get("CROSS_SOCKETS", "").split(":")):
        tries[f"dial {os.path.basename(sock)}"] = outcome(lambda: ask(sock))
    record = {"uid": os.getuid(), "victim": victim, "tries": tries}
    with open(os.path.join(out, "thief.json.tmp"), "w") as handle:
        json.dump(record, handle)
    os.rename(os.path.join(out, "thief.json.tmp"), os.path.join(out, "thief.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
