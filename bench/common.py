"""Shared pieces of the benchmark: the plan, worker identities, requests, /proc readings."""

from __future__ import annotations

import math
import os
import platform
import sys
from importlib import metadata
from typing import Iterable, Sequence

JOB = "bench"
SLOTS_PER_NODE = 8
# Where a worker claims to serve torch.distributed's store; a Register carries it (the
# real client fills it in), so the request has its real size. Nothing listens there.
ENDPOINT_HOST = "127.0.0.1"
ENDPOINT_PORT = 29500
# The nonce of the one real attestation the echo server hands back to everyone.
ECHO_NONCE = bytes(range(32))

REGISTER_METHOD = "/meshgate.v1.Rendezvous/Register"
AWAIT_METHOD = "/meshgate.v1.Rendezvous/AwaitWorld"
TRUST_METHOD = "/meshgate.v1.Rendezvous/GetTrustBundle"
ECHO_SERVICE = "bench.Echo"
ECHO_METHOD = f"/{ECHO_SERVICE}/Call"

# The grpc.aio server options of meshgate.coordinator.service.build_server, used by the echo
# server too, so both servers run the same transport settings.
SERVER_OPTIONS = [
    ("grpc.server.max_pending_requests", 1_000_000),
    ("grpc.so_reuseport", 0),
]


def plan_for(world: int, slots: int = SLOTS_PER_NODE):
    """The benchmark's plan: TP inside each node, DP across nodes."""
    from meshgate.plan import ParallelPlan

    if world % slots:
        raise ValueError(f"world {world} must be a multiple of slots_per_node {slots}")
    return ParallelPlan(tp=slots, dp_shard=world // slots)


def round_world(n: int, slots: int = SLOTS_PER_NODE) -> int:
    """The nearest multiple of ``slots`` not below ``n``."""
    return max(slots, -(-n // slots) * slots)


def node_id(i: int, slots: int = SLOTS_PER_NODE) -> str:
    return f"node-{i // slots:06d}"


def worker_id(i: int, slots: int = SLOTS_PER_NODE) -> str:
    return f"{node_id(i, slots)}/local{i % slots}"


def register_request(i: int, nonce: bytes, digest: bytes, slots: int = SLOTS_PER_NODE):
    """What meshgate.client.register sends for simulated worker ``i`` (assigned mode)."""
    from meshgate.v1 import rendezvous_pb2

    request = rendezvous_pb2.RegisterRequest(
        job_id=JOB,
        worker_id=worker_id(i, slots),
        nonce=nonce,
        node_id=node_id(i, slots),
        plan_digest=digest,
        generation=0,
        endpoint_host=ENDPOINT_HOST,
        endpoint_port=ENDPOINT_PORT,
    )
    request.assigned.local_rank = i % slots
    return request


# ---- /proc -----------------------------------------------------------------------------

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (KiB) and Threads of ``pid``."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "Threads"):
                out[key] = int(value.split()[0])
    return out


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    # fields[0] is the state (field 3); utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def reset_peak_rss(pid: int) -> bool:
    """Reset VmHWM to the current RSS (Linux clear_refs 5); False where not allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def raise_fd_limit(needed: int) -> int:
    """Raise this process's soft limit on open files to at least ``needed`` (the processes
    it starts inherit it); RuntimeError naming the limits where the hard one is lower."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if needed <= soft:
        return soft
    if hard != resource.RLIM_INFINITY and needed > hard:
        raise RuntimeError(
            f"needs {needed} open files, but the hard limit (ulimit -Hn) is {hard} "
            f"(soft {soft}); raise it (limits.conf, LimitNOFILE=) and run again"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    return needed


# ---- statistics --------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (q in [0, 100])."""
    if not sorted_values:
        return math.nan
    k = max(0, min(len(sorted_values) - 1, math.ceil(q / 100 * len(sorted_values)) - 1))
    return sorted_values[k]


def median(values: Iterable[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if not numerator or not denominator or math.isnan(numerator) or math.isnan(denominator):
        return None
    return numerator / denominator


# ---- the machine ---------------------------------------------------------------------------


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine() -> dict:
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_kib = 0
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    mem_kib = int(line.split()[1])
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count() or 0
    return {
        "nproc": usable,
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "mem_total_gib": round(mem_kib / 2**20, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "grpcio": _version("grpcio"),
        "protobuf": _version("protobuf"),
        "cryptography": _version("cryptography"),
        "torch": _version("torch"),
        "loadavg_at_start": list(os.getloadavg()),
        "executable": sys.executable,
    }


def describe_machine(m: dict) -> str:
    return (
        f"{m['nproc']} cores ({m['cpu_model']}), {m['mem_total_gib']} GiB, Linux {m['kernel']}; "
        f"Python {m['python']}, grpcio {m['grpcio']}, protobuf {m['protobuf']}, "
        f"cryptography {m['cryptography']}, torch {m['torch']}; "
        f"load average at start {m['loadavg_at_start'][0]:.2f}"
    )
