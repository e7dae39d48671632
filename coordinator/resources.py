"""What the coordinator process has left of what it cannot work without: file
descriptors. A job's log takes about four (the database, its WAL and -shm, the mark)
and each client connection one; running out breaks whatever opens a file next, so the
health turns NOT_SERVING while fewer than DESCRIPTOR_RESERVE are left, before anything
fails. (Disk space is the store's own check, store/sqlite.py MIN_FREE_BYTES.)
"""

from __future__ import annotations

import os
import resource

DESCRIPTOR_RESERVE = 64
# After an open failed, fewer than this many free descriptors means it failed for want of
# them (SQLite says only "unable to open database file").
DESCRIPTORS_EXHAUSTED = 8


def descriptors_free() -> int | None:
    """Descriptors this process may still open, or None where that cannot be told."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        used = len(os.listdir("/proc/self/fd")) - 1  # less the one listdir itself held
    except FileNotFoundError:
        return None  # no /proc: cannot tell
    except OSError:
        return 0  # could not even open the directory: none left
    return soft - used


def descriptors_short(reserve: int = DESCRIPTOR_RESERVE) -> str:
    """Why the process is short of descriptors, or "" when it is not."""
    free = descriptors_free()
    if free is None or free >= reserve:
        return ""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return f"{max(free, 0)} of {soft} file descriptors left (RLIMIT_NOFILE); NOT_SERVING below {reserve}"
