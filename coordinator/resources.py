"""What the coordinator process has left of what it cannot work without: file
descriptors and memory. A job's log takes about four descriptors (the database, its WAL
and -shm, the mark) and each client connection one; running out of either breaks
whatever needs one next, so the health turns NOT_SERVING while fewer than
DESCRIPTOR_RESERVE descriptors or MEMORY_RESERVE bytes are left, before anything fails.
Memory left is the least of what the address-space limit (RLIMIT_AS), the process's
memory cgroup (v2 or v1) and the machine (MemAvailable) leave. (Disk space is the
store's own check, store/sqlite.py MIN_FREE_BYTES.)
"""

from __future__ import annotations

import errno
import os
import resource

DESCRIPTOR_RESERVE = 64
MEMORY_RESERVE = 32 << 20
_UNLIMITED = 1 << 62  # cgroup v1 says "no limit" with a number near 2^63
# After an open failed, fewer than this many free descriptors means it failed for want of
# them (SQLite says only "unable to open database file").
DESCRIPTORS_EXHAUSTED = 8
# Errors that say "out of resources", not "damaged": too many open files (the process's
# or the system's), out of memory.
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})


def descriptors_free() -> int | None:
    """Descriptors this process may still open, or None where that cannot be told."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        # Linux >= 6.2 gives the count as the directory's size: O(1), where listing costs
        # ~13 µs per descriptor (40 ms a check at 3,000 agent connections, every second).
        used = os.stat("/proc/self/fd").st_size or len(os.listdir("/proc/self/fd")) - 1  # less listdir's own
    except FileNotFoundError:
        return None  # no /proc: cannot tell
    except OSError:
        return 0  # could not even open the directory: none left
    return soft - used


def exhausted(exc: BaseException) -> bool:
    """Did ``exc`` come from running out of descriptors or memory, not from what was being
    opened? Errors do not always say: SQLite says "unable to open database file", tempfile
    "No usable temporary directory found", so too few free descriptors decides too."""
    if isinstance(exc, MemoryError) or getattr(exc, "errno", None) in RESOURCE_ERRNOS:
        return True
    if "out of memory" in str(exc).lower():
        return True
    free = descriptors_free()
    return free is not None and free < DESCRIPTORS_EXHAUSTED


def descriptors_short(reserve: int = DESCRIPTOR_RESERVE) -> str:
    """Why the process is short of descriptors, or "" when it is not."""
    free = descriptors_free()
    if free is None or free >= reserve:
        return ""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return f"{max(free, 0)} of {soft} file descriptors left (RLIMIT_NOFILE); NOT_SERVING below {reserve}"


def _read(path: str) -> str:
    with open(path) as handle:
        return handle.read()


def _address_space_left() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    return soft - int(_read("/proc/self/statm").split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _cgroup_memory_left() -> int | None:
    """memory.max - memory.current (v2), or limit_in_bytes - usage_in_bytes (v1), of the
    process's own memory cgroup; None when it has no limit."""
    mounts = [line.split() for line in _read("/proc/self/mounts").splitlines()]
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            roots = [m[1] for m in mounts if m[2] == "cgroup2"]
            files = ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            roots = [m[1] for m in mounts if m[2] == "cgroup" and "memory" in m[3].split(",")]
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        for root in roots:
            directory = os.path.join(root, path.lstrip("/"))
            try:
                limit, used = (_read(os.path.join(directory, name)).strip() for name in files)
            except OSError:
                continue
            if limit != "max" and int(limit) < _UNLIMITED:
                return int(limit) - int(used)
    return None


def _machine_memory_left() -> int | None:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def memory_free() -> int | None:
    """Bytes this process may still allocate, or None where that cannot be told."""
    known = []
    for source in (_address_space_left, _cgroup_memory_left, _machine_memory_left):
        try:
            left = source()
        except (OSError, ValueError):
            left = None
        if left is not None:
            known.append(left)
    return min(known) if known else None


def memory_short(reserve: int = MEMORY_RESERVE) -> str:
    """Why the process is short of memory, or "" when it is not."""
    free = memory_free()
    if free is None or free >= reserve:
        return ""
    return f"{max(free, 0) >> 20} MiB of memory left; NOT_SERVING below {reserve >> 20} MiB"
