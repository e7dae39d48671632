"""Profile a server process with py-spy (sampling, out of process) and summarise it.

``Spy(pid, path)`` starts ``py-spy record --format raw`` on the server; ``stop()`` ends it
(SIGINT, so it writes its file) and ``summarise(path)`` turns the collapsed stacks into
the shares of CPU samples by function (inclusive and self) and by area (coordinator,
meshgate, grpc, protobuf, crypto, asyncio, ...). py-spy is optional: where it is missing
or may not attach (ptrace), the benchmark says so and goes on.
"""

from __future__ import annotations

import collections
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def py_spy() -> Optional[str]:
    found = shutil.which("py-spy")
    if found:
        return found
    candidate = Path(sys.executable).with_name("py-spy")
    return str(candidate) if candidate.exists() else None


class Spy:
    def __init__(self, pid: int, output: Path, rate: int = 250) -> None:
        self.output = output
        self.error: Optional[str] = None
        self.native = False
        self.process: Optional[subprocess.Popen] = None
        exe = py_spy()
        if exe is None:
            self.error = "py-spy is not installed (pip install py-spy)"
            return
        self._log = output.with_suffix(".log")
        # Native frames show grpc's Cython and C-core time; they need blocking samples.
        # Where native unwinding is not available, fall back to Python frames only.
        for native in (True, False):
            cmd = [
                exe,
                "record",
                "--pid",
                str(pid),
                "--format",
                "raw",
                "--output",
                str(output),
                "--rate",
                str(rate),
                "--nolineno",
            ]
            cmd += ["--native"] if native else ["--nonblocking"]
            with open(self._log, "wb") as log:
                self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            time.sleep(1.0)  # let it attach before the load starts
            if self.process.poll() is None:
                self.native = native
                self.error = None
                return
            self.error = f"py-spy exited at once: {self._log.read_text()[-300:]}"
            self.process = None

    def stop(self) -> Optional[Path]:
        if self.process is None:
            return None
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if not self.output.exists():
            self.error = f"py-spy wrote no profile: {self._log.read_text()[-300:]}"
            return None
        return self.output


def _short_path(path: str) -> str:
    for marker in ("/site-packages/", "/lib/python3."):
        if marker in path:
            tail = path.split(marker, 1)[1]
            return tail.split("/", 1)[1] if marker == "/lib/python3." and "/" in tail else tail
    repo = str(Path(__file__).resolve().parent.parent) + "/"
    return path[len(repo) :] if path.startswith(repo) else path


def write_collapsed(session, path: Path) -> None:
    """A pyinstrument Session as collapsed stacks in py-spy's raw format, weighted in µs,
    so summarise() reads both profilers' output."""
    weights: collections.Counter = collections.Counter()
    for stack, seconds in session.frame_records:
        frames = []
        for ident in stack:
            func, _, rest = ident.partition("\x00")
            file, _, rest = rest.partition("\x00")
            if file == "<thread>":
                continue
            cls = ""
            for attr in rest.split("\x01")[1:]:
                if attr.startswith("c"):
                    cls = attr[1:] + "."
            frames.append(f"{cls}{func} ({_short_path(file)})")
        if sum(f.startswith("<module> ") for f in frames) > 1:
            continue  # an import, not serving
        if frames:
            weights[";".join(frames)] += int(round(seconds * 1e6))
    path.write_text("".join(f"{stack} {n}\n" for stack, n in weights.items() if n))


def _parse(frame: str) -> tuple[str, str]:
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip(), ""
    return m.group("func"), m.group("file")


IDLE_LEAVES = {
    "epoll_wait",
    "epoll_pwait",
    "poll",
    "ppoll",
    "select",
    "clock_nanosleep",
    "nanosleep",
    "pthread_cond_wait",
    "pthread_cond_timedwait",
    "futex",
    "sem_wait",
    # pyinstrument's view of the same wait (it sees Python frames only)
    "EpollSelector.select",
}

# Where a busy sample of the event loop's thread goes: the first rule whose needle is in
# the stack (meshgate's own code first, as grpc's frames sit below it).
CATEGORIES = (
    ("Ed25519 sign (cryptography)", ("SigningKey.sign",)),
    (
        "attestation: build + serialize (protobuf)",
        ("build_attestation", "sign_attestation", "AttestationTemplate.sign"),
    ),
    ("state machine (coordinator/rendezvous/)", ("coordinator/rendezvous/",)),
    ("store (coordinator/store)", ("coordinator/store/",)),
    ("engine, rest (coordinator/engine.py)", ("coordinator/engine.py",)),
    ("servicer, rest (coordinator/service.py)", ("coordinator/service.py",)),
    ("garbage collector", ("gc_collect_main",)),
    ("protobuf (upb), called by grpc: parse request / serialize reply", ("_message.abi3.so", "upb_")),
    ("grpc: sendmsg", ("sendmsg",)),
    ("grpc: eventfd wake-ups", ("eventfd_write", "eventfd_read")),
    ("grpc: recv/read", ("recvmsg", "recv", "read")),
    ("grpc aio: Cython + C-core, rest", ("cygrpc",)),
)


def _category(funcs: list[str], files: list[str]) -> str:
    leaf = funcs[-1] if funcs else ""
    text = ";".join(f"{f} ({p})" for f, p in zip(funcs, files))
    for name, needles in CATEGORIES:
        for needle in needles:
            if needle in ("sendmsg", "recvmsg", "recv", "read", "eventfd_write", "eventfd_read"):
                if leaf == needle or (needle.startswith("eventfd") and needle in funcs):
                    return name
            elif needle in text:
                return name
    return "asyncio loop + interpreter, rest"


def summarise(path: Path, top: int = 15) -> dict:
    """Shares of the coordinator's busy samples, from a raw py-spy file (--nolineno)."""
    own: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    categories: collections.Counter = collections.Counter()
    total = idle = main_busy = other_busy = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [_parse(f) for f in stack.split(";") if f]
        funcs = [f for f, _ in frames]
        files = [p for _, p in frames]
        leaf = funcs[-1] if funcs else "?"
        main = any("run_forever" in f for f in funcs)
        if leaf in IDLE_LEAVES or (leaf == "syscall" and not main):
            idle += n
            continue
        if not main:
            other_busy += n
            continue
        main_busy += n
        categories[_category(funcs, files)] += n
        own[f"{leaf} ({files[-1]})" if files[-1] else leaf] += n
        for key in {f"{f} ({p})" for f, p in frames if "coordinator/" in p or "meshgate/" in p}:
            inclusive[key] += n

    def pct(counter: collections.Counter, k: Optional[int] = None) -> list[tuple[str, float]]:
        return [(name, round(100 * c / main_busy, 1)) for name, c in counter.most_common(k)]

    if not main_busy:
        return {"samples": total, "main_busy": 0}
    return {
        "samples": total,
        "idle": idle,
        "main_busy": main_busy,
        "other_threads_busy": other_busy,
        "categories_pct": dict(pct(categories)),
        "meshgate_inclusive_pct": pct(inclusive, top),
        "top_self_pct": pct(own, top),
    }


def render(summary: dict, limit: int = 12, unit: str = "samples") -> str:
    if not summary.get("main_busy"):
        return "(no busy samples)"
    s = summary
    lines = [
        f"{s['samples']} {unit}: {s['main_busy']} busy on the event loop's thread, "
        f"{s['other_threads_busy']} busy on grpc's other threads, {s['idle']} idle. "
        "Shares below are of the event loop's busy samples:",
    ]
    lines += [f"  {v:5.1f}%  {k}" for k, v in s["categories_pct"].items()]
    lines.append("meshgate's own functions (inclusive):")
    lines += [f"  {v:5.1f}%  {k}" for k, v in s["meshgate_inclusive_pct"][:limit]]
    lines.append("hottest leaf functions (self):")
    lines += [f"  {v:5.1f}%  {k}" for k, v in s["top_self_pct"][:limit]]
    return "\n".join(lines)


def render_comparison(echo: dict, coordinator: dict, tool: str = "py-spy") -> str:
    """Each category's share of the event loop's busy samples, turned into µs per call
    with the server's measured CPU per call, for the echo server and the coordinator."""
    es, cs = echo["summary"], coordinator["summary"]
    if not es.get("main_busy") or not cs.get("main_busy"):
        return "(no busy samples)"
    e_us, c_us = echo["server_cpu_per_call_us"], coordinator["server_cpu_per_call_us"]
    names = list(cs["categories_pct"]) + [k for k in es["categories_pct"] if k not in cs["categories_pct"]]
    rows = []
    for name in names:
        e = es["categories_pct"].get(name, 0.0) * e_us / 100
        c = cs["categories_pct"].get(name, 0.0) * c_us / 100
        rows.append(f"| {name} | {e:.0f} | {c:.0f} | {c - e:+.0f} |")
    if tool == "py-spy":
        how = f"py-spy{' --native' if coordinator.get('native') else ''}"
    else:
        how = (
            "pyinstrument, Python frames only: grpc's Cython and C-core time shows up "
            "under 'asyncio loop + interpreter, rest'"
        )
    lines = [
        f"server CPU per call: echo {e_us:.0f} µs, coordinator {c_us:.0f} µs "
        f"(both profiled with {how}; the event loop's busy samples split by the rules in "
        "bench/profile.py and scaled to µs/call)",
        "",
        "| where the event loop's time goes | echo µs/call | coordinator µs/call | difference |",
        "|---|---|---|---|",
        *rows,
        "",
        "coordinator: " + render(cs, unit="samples" if tool == "py-spy" else "µs sampled"),
    ]
    return "\n".join(lines)
