"""Workers' output, kept by the agent per job and rank, and read back only through it.

Each worker's stdout and stderr go, merged in the order written, into one pipe the agent
opened; a thread drains it into ``<state_dir>/worker-logs/<job>/rank-<R>.log`` (0600 in a
0700 directory, the agent's own): the worker never gets a path, so the job user can
neither read another job's output nor point the agent at a file of its choosing. A file
past ``max_bytes`` is rotated once (``rank-<R>.log.1``), so a rank keeps at most twice
that; the output of the ``keep_jobs`` most recent jobs is kept on a node, older jobs'
directories go when a new job's capture starts. A pipe is drained whatever happens to the
disk, so a worker never blocks on its own output.

Readers come through the coordinator (``meshgate job logs``): a heartbeat answer carries
a LogRequest, ``serve`` answers it with PushLogs calls of at most ``CHUNK_BYTES`` each.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import BinaryIO, Callable, Optional
from urllib.parse import quote

import grpc

from meshgate.v1 import nodes_pb2

log = logging.getLogger("meshgate.agent")

DEFAULT_MAX_BYTES = 8 << 20  # per file; a rank keeps at most twice this (one rotation)
MIN_MAX_BYTES = 64 << 10
DEFAULT_KEEP_JOBS = 20
CHUNK_BYTES = 64 << 10  # one PushLogs message at most: the coordinator refuses more
EXIT_TAIL_LINES = 20  # what an exit report quotes of a failed worker
EXIT_TAIL_BYTES = 4096
# Log requests answered at once by one agent; more are told to retry. Twice what the coordinator
# hands a node (log_relay.MAX_OPEN_PER_NODE): a reader that left is forgotten there at once, and
# here only at its next push, so its slot must not shut out the request that replaces it.
MAX_SERVING = 16
FOLLOW_POLL_S = 0.2
KEEPALIVE_S = 2.0  # a follow with nothing new still asks whether its reader is there


class RankLog:
    """One rank's file, written by one capture thread, rotated past ``max_bytes``."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path, self.max_bytes = path, max_bytes
        self.handle = self._open()
        self.size = self.handle.seek(0, os.SEEK_END)
        self.dropped = 0  # bytes lost to a failing disk (the pipe is drained regardless)

    def _open(self):
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        return os.fdopen(fd, "ab", buffering=0)

    def write(self, data: bytes) -> None:
        try:
            if self.size and self.size + len(data) > self.max_bytes:
                self.handle.close()
                os.replace(self.path, rotated(self.path))
                self.handle, self.size = self._open(), 0
            self.handle.write(data)
            self.size += len(data)
        except OSError as exc:
            if not self.dropped:
                log.error("worker output %s: %s; dropping it until the disk takes it again", self.path, exc)
            self.dropped += len(data)

    def close(self) -> None:
        try:
            self.handle.close()
        except OSError:
            pass


def rotated(path: Path) -> Path:
    return path.with_name(path.name + ".1")


def _open_or_none(path: Path) -> Optional[BinaryIO]:
    # Unbuffered: a read takes from the descriptor only what it returns. A follow's cursor
    # is a duplicate of the descriptor a kept read used (one offset); a buffered reader
    # read ahead past what it returned and the follow went on after the read-ahead,
    # skipping up to a buffer of output (seen under load: a new rank's first 17 kB).
    try:
        return open(path, "rb", buffering=0)
    except FileNotFoundError:
        return None


class Capture:
    """The pipe of one worker: its write end goes to the worker (``sink``, closed in the
    agent once the worker started), its read end is drained into the rank's file."""

    def __init__(self, rank_log: RankLog) -> None:
        read_fd, write_fd = os.pipe()
        self.sink = os.fdopen(write_fd, "wb", buffering=0)
        self.drained = threading.Event()
        self.thread = threading.Thread(target=self._drain, args=(read_fd, rank_log), daemon=True)
        self.thread.start()

    @staticmethod
    def _drain_into(read_fd: int, rank_log: RankLog) -> None:
        while chunk := os.read(read_fd, CHUNK_BYTES):
            rank_log.write(chunk)

    def _drain(self, read_fd: int, rank_log: RankLog) -> None:
        try:
            self._drain_into(read_fd, rank_log)
        finally:
            os.close(read_fd)
            rank_log.close()
            self.drained.set()


class RankOutput:
    """A rank's kept output opened for reading, as it is now: the rotated file, then the
    current one, from the start of the last ``tail_lines`` lines (0: all of it), a chunk
    at a time; ``cursor()`` is where a follow goes on."""

    def __init__(self, path: Path, tail_lines: int = 0) -> None:
        self.path = path
        self.handles, current = self._open_both(path)
        self.sizes = [os.fstat(h.fileno()).st_size for h in self.handles]  # what is read: no more
        for handle, start in zip(self.handles, self._starts(tail_lines)):
            handle.seek(start)
        # The newest file read, held for a follow: a duplicate descriptor shares its offset,
        # so it stands where this read stops, and outlives the handle chunk() closes.
        self._newest = os.fdopen(os.dup(self.handles[-1].fileno()), "rb", buffering=0) if self.handles else None

    @staticmethod
    def _open_both(path: Path) -> tuple[list[BinaryIO], Optional[BinaryIO]]:
        """The rotated and the current file as one snapshot. The writer may rotate between
        two opens: the current file is opened first, and the pair is taken only if it is
        still the current file once the rotated one is open (a rotation links a new inode
        at ``path`` while the old one lives on as the rotated file); else both are opened again."""
        for _ in range(100):
            current = _open_or_none(path)
            older = _open_or_none(rotated(path))
            try:
                still = current is None or os.stat(path).st_ino == os.fstat(current.fileno()).st_ino
            except FileNotFoundError:
                still = False
            if still:
                return [h for h in (older, current) if h is not None], current
            for handle in (older, current):
                if handle is not None:
                    handle.close()
        raise OSError(f"{path} rotated under every read (100 tries)")

    def _starts(self, lines: int) -> list[int]:
        """Where each file is read from: after the newline that ends the line before the
        last ``lines`` (a final newline ends the last line, it does not start one)."""
        starts = [0] * len(self.handles)
        filled = [i for i, size in enumerate(self.sizes) if size]
        if not lines or not filled:
            return starts
        last = self.handles[filled[-1]]
        last.seek(self.sizes[filled[-1]] - 1)
        wanted = lines + (last.read(1) == b"\n")
        for i in reversed(filled):
            handle, end = self.handles[i], self.sizes[i]
            while end > 0:
                begin = max(0, end - CHUNK_BYTES)
                handle.seek(begin)
                block, cut = handle.read(end - begin), None
                while (at := block.rfind(b"\n", 0, len(block) if cut is None else cut)) >= 0:
                    wanted, cut = wanted - 1, at
                    if wanted == 0:
                        return self.sizes[:i] + [begin + at + 1] + [0] * (len(self.handles) - i - 1)
                end = begin
        return starts

    def chunk(self) -> bytes:
        """The next at most CHUNK_BYTES; b"" at the end (as it was when opened)."""
        while self.handles:
            handle, size = self.handles[0], self.sizes[0]
            data = handle.read(min(size - handle.tell(), CHUNK_BYTES))
            if data:
                return data
            handle.close()
            self.handles.pop(0), self.sizes.pop(0)
        return b""

    def __enter__(self) -> "RankOutput":
        return self

    def cursor(self) -> "Cursor":
        """Where a follow goes on: after what this read gave (it then owns the file held)."""
        newest, self._newest = self._newest, None
        return Cursor(self.path, newest)

    def __exit__(self, *exc) -> None:
        for handle in self.handles + [self._newest]:
            if handle is not None:
                handle.close()


class Cursor:
    """A follow of one rank's output: the file it reads is held open. An inode number is a
    file's only name across a rotation, and a deleted file's number is soon reused, so a
    follow slower than two rotations would take the newest file for the one it was reading
    and skip what lay between; a held file is never deleted under it, and its number never
    reused. Output in a file rotated past twice between two reads is gone (the bound)."""

    def __init__(self, path: Path, handle: Optional[BinaryIO]) -> None:
        self.path, self.handle = path, handle

    def read(self) -> bytes:
        """The next at most CHUNK_BYTES written since; b"" when there is nothing new."""
        for _ in range(100):  # files written one after another, each read to its end
            if self.handle is not None:
                data = self.handle.read(CHUNK_BYTES)
                if data or _is_file_at(self.handle, self.path):  # the current file: nothing new yet
                    return data
            following = self._following()
            if following is None:
                return b""
            self.close()
            self.handle = following
        return b""

    def _following(self) -> Optional[BinaryIO]:
        """The file written after the one held: the rotated file when it is not the held one
        (the held one was rotated past twice), else the current file. None: none yet."""
        for _ in range(100):
            older = _open_or_none(rotated(self.path))
            if older is not None and (self.handle is None or not _same(older, self.handle)):
                return older
            current = _open_or_none(self.path)
            still = older is None or _is_file_at(older, rotated(self.path))  # no rotation since
            if older is not None:
                older.close()
            if still or current is None:
                return current
            current.close()
        return None

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


def _same(a: BinaryIO, b: BinaryIO) -> bool:
    return os.fstat(a.fileno()).st_ino == os.fstat(b.fileno()).st_ino


def _is_file_at(handle: BinaryIO, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
    except FileNotFoundError:
        return False


class WorkerLogs:
    """The node's kept output: ``<root>/<job>/rank-<R>.log[.1]``."""

    def __init__(self, root: Path, max_bytes: int = DEFAULT_MAX_BYTES, keep_jobs: int = DEFAULT_KEEP_JOBS) -> None:
        self.root, self.max_bytes, self.keep_jobs = root, max_bytes, keep_jobs
        self.captures: dict[tuple[str, int], Capture] = {}
        self.serving: set[asyncio.Task] = set()

    def job_dir(self, job_id: str) -> Path:
        """A job id may hold "/" or be "..": its directory's name is the id quoted."""
        return self.root / ("job-" + quote(job_id, safe=""))

    def capture(self, job_id: str, generation: int, rank: int) -> Capture:
        """A pipe for rank ``rank`` of this launch; its output is appended after a line
        that says which generation starts here."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        directory = self.job_dir(job_id)
        fresh = not directory.exists()
        directory.mkdir(mode=0o700, exist_ok=True)
        if fresh:
            self.prune(keep=job_id)
        rank_log = RankLog(directory / f"rank-{rank}.log", self.max_bytes)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        rank_log.write(f"--- meshgate: rank {rank}, generation {generation}, started {stamp} ---\n".encode())
        capture = self.captures[(job_id, rank)] = Capture(rank_log)
        return capture

    def sink_for(self, job_id: str, generation: int, rank: int) -> Optional[BinaryIO]:
        """The write end for a worker about to start; None (it writes where the agent's
        own output goes, as before) when its output cannot be kept: a job never fails for it."""
        try:
            return self.capture(job_id, generation, rank).sink
        except OSError as exc:
            log.error("cannot keep the output of rank %d of job %s under %s: %s", rank, job_id, self.root, exc)
            return None

    def prune(self, keep: str) -> None:
        """Only the ``keep_jobs`` most recent jobs' output stays (``keep`` among them)."""
        kept = self.job_dir(keep).name
        jobs = sorted(
            (p for p in self.root.iterdir() if p.is_dir() and p.name != kept), key=lambda p: p.stat().st_mtime
        )
        for old in jobs[: max(len(jobs) - (self.keep_jobs - 1), 0)]:
            shutil.rmtree(old, ignore_errors=True)
            log.info("worker output of job %s removed (a node keeps the last %d jobs')", old.name, self.keep_jobs)

    def drained(self, job_id: str, rank: int, timeout_s: float) -> bool:
        """Wait until everything rank ``rank`` wrote is in its file (its pipe closed)."""
        capture = self.captures.get((job_id, rank))
        return capture is None or capture.drained.wait(timeout_s)

    def capturing(self, job_id: str, rank: int) -> bool:
        capture = self.captures.get((job_id, rank))
        return capture is not None and not capture.drained.is_set()

    def forget(self, job_id: str) -> None:
        """The job is over on this node: its captures (drained or not) are let go."""
        for key in [k for k in self.captures if k[0] == job_id]:
            del self.captures[key]

    def ranks(self, job_id: str) -> list[int]:
        try:
            directory = self.job_dir(job_id)
            names = [p.name for p in directory.iterdir()]
        except (OSError, ValueError):
            return []
        return sorted({int(m.group(1)) for n in names if (m := re.match(r"^rank-(\d+)\.log$", n))})

    def exit_tail(self, job_id: str, rank: int, wait_s: float = 2.0) -> str:
        """What an exit report quotes of a failed worker: its last lines, once its pipe
        is drained (a child still holding it open is waited for ``wait_s`` at most)."""
        self.drained(job_id, rank, wait_s)
        try:
            return self.tail(job_id, rank)
        except OSError:
            return ""

    def tail(self, job_id: str, rank: int, lines: int = EXIT_TAIL_LINES, max_bytes: int = EXIT_TAIL_BYTES) -> str:
        """The last ``lines`` lines of a rank's output, at most ``max_bytes`` (cut at the front)."""
        kept = b""
        with self.read(job_id, rank, lines) as output:
            while chunk := output.chunk():
                kept = (kept + chunk)[-max_bytes:]
        return kept.decode("utf-8", errors="replace")

    def read(self, job_id: str, rank: int, tail_lines: int = 0) -> "RankOutput":
        return RankOutput(self.job_dir(job_id) / f"rank-{rank}.log", tail_lines)

    # ---- answering readers -----------------------------------------------------------------

    def answer(self, request: nodes_pb2.LogRequest, push: Callable, serves: Callable[[str], bool]) -> None:
        """Answer a reader (in the background): ``push(PushLogsRequest fields)`` is the
        agent's PushLogs call; ``serves(job_id)`` whether this node still serves the job."""
        if len(self.serving) >= MAX_SERVING:
            notice = f"this node answers {MAX_SERVING} log readers at once already; try again"
            task = asyncio.ensure_future(push(request.request_id, 0, b"", True, notice))
        else:
            task = asyncio.ensure_future(self._serve(request, push, serves))
        self.serving.add(task)
        task.add_done_callback(self.serving.discard)

    async def _serve(self, request: nodes_pb2.LogRequest, push: Callable, serves: Callable[[str], bool]) -> None:
        job_id, rid = request.job_id, request.request_id
        try:
            quiet_since = time.monotonic()
            while request.follow and serves(job_id) and not self._wanted(request):  # followed from its submit
                if time.monotonic() - quiet_since > KEEPALIVE_S:
                    if await push(rid, 0, b"", False, ""):
                        return
                    quiet_since = time.monotonic()
                await asyncio.sleep(FOLLOW_POLL_S)
            ranks = self._wanted(request)
            if not ranks:
                wanted = ", ".join(map(str, request.ranks)) or "any rank"
                await push(rid, 0, b"", True, f"no output of job {job_id} ({wanted}) is kept on this node")
                return
            cursors: dict[int, Cursor] = {}
            try:
                for rank in ranks:
                    if not await self._send_kept(request, rank, request.tail_lines, cursors, push):
                        return
                if request.follow and not await self._follow(request, cursors, push, serves):
                    return
            finally:
                for cursor in cursors.values():
                    cursor.close()
            await push(rid, 0, b"", True, "")
        except grpc.aio.AioRpcError as exc:
            log.warning("log request %s of job %s: %s: %s", rid, job_id, exc.code().name, exc.details())
        except (OSError, ValueError) as exc:
            log.warning("log request %s of job %s: %s", rid, job_id, exc)
            try:
                await push(rid, 0, b"", True, f"this node could not read the output: {str(exc)[:200]}")
            except grpc.aio.AioRpcError:
                pass

    async def _send_kept(
        self, request: nodes_pb2.LogRequest, rank: int, tail: int, cursors: dict, push: Callable
    ) -> bool:
        """A rank's kept output (its last ``tail`` lines), pushed; where a follow goes on
        from goes to ``cursors``. False when the reader went away."""
        with await asyncio.to_thread(self.read, request.job_id, rank, tail) as output:
            cursors[rank] = output.cursor()  # held from here: closed with the request
            while chunk := await asyncio.to_thread(output.chunk):
                if await push(request.request_id, rank, chunk, False, ""):
                    return False
        return True

    def _wanted(self, request: nodes_pb2.LogRequest) -> list[int]:
        """The ranks of the request whose output this node keeps (no ranks named: all)."""
        kept = self.ranks(request.job_id)
        return [r for r in request.ranks if r in kept] if request.ranks else kept

    async def _follow(
        self,
        request: nodes_pb2.LogRequest,
        cursors: dict[int, Cursor],
        push: Callable,
        serves: Callable[[str], bool],
    ) -> bool:
        """New output as it comes, until the job is over on this node and every pipe is
        drained. False when the reader went away."""
        job_id, rid = request.job_id, request.request_id
        quiet_since = time.monotonic()
        while True:
            over = not serves(job_id) and not any(self.capturing(job_id, r) for r in cursors)
            sent = False
            for rank in set(self._wanted(request)) - set(cursors):  # a rank that started since: all of it
                sent = True
                if not await self._send_kept(request, rank, 0, cursors, push):
                    return False
            for rank, cursor in cursors.items():
                while data := await asyncio.to_thread(cursor.read):
                    sent = True
                    if await push(rid, rank, data, False, ""):
                        return False
            if over:
                return True
            if sent:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > KEEPALIVE_S:
                if await push(rid, 0, b"", False, ""):
                    return False
                quiet_since = time.monotonic()
            await asyncio.sleep(FOLLOW_POLL_S)

    def close(self) -> None:
        for task in list(self.serving):
            task.cancel()


__all__ = ["WorkerLogs", "CHUNK_BYTES", "DEFAULT_MAX_BYTES", "DEFAULT_KEEP_JOBS", "EXIT_TAIL_LINES", "EXIT_TAIL_BYTES"]
