"""The HA store: event logs in etcd (through ``aetcd``), and leader election.

Keys, under one root (leadership.etcd_root: ``/meshgate/cluster/`` for a cluster,
``/meshgate/<job>/`` for a single-job config):

  leader                 the leader's advertised address, attached to its lease
  meta                   {"schema": 2, "job_id": ...} of the root's own log
  events/<seq>           one chained record each (store/codec.py; record 1 is the pin),
                         seq zero-padded so keys sort in order
  jobs/<id>/meta         each job's own log (a cluster only), the same shape
  jobs/<id>/events/<seq>

One session (EtcdSession) holds the client, the lease and the leader key; every log of
the root (EtcdLog: the cluster's and each job's) writes through it. Election: a
coordinator leads while it holds ``leader`` under a lease of ``lease_ttl_s`` that it keeps
alive. Standbys poll the key and campaign when it is gone. Every write of every log is a
transaction that first compares ``leader``'s create revision with the one this session
created, so a deposed leader (lease lost, partitioned) can append to no log: its write
fails and its term ends. That fencing is what keeps a rank from being assigned twice
across a failover.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Callable, Iterable, Optional, Sequence

from meshgate.coordinator.rendezvous import Event
from meshgate.coordinator.store import GroupCommitStore, StoreError, StoreResourcesError
from meshgate.coordinator.store.codec import (
    GENESIS,
    RECORD_SCHEMA,
    JobPinned,
    OldLogFormatError,
    encode_record,
    newer_state,
    verify_records,
)
from meshgate.coordinator.store.mark import DurableMark
from meshgate.endpoints import split_host_port

log = logging.getLogger("meshgate.coordinator")

SCHEMA_VERSION = RECORD_SCHEMA
MAX_OPS_PER_TXN = 100  # etcd's default --max-txn-ops is 128
MAX_TXN_BYTES = 1 << 20  # etcd's default --max-request-bytes is 1.5 MiB
# A log is read in one range: a large world's log passes gRPC's default 4 MiB for a reply.
MAX_READ_BYTES = 1 << 30


class EtcdUnavailable(StoreError):
    """etcd cannot be reached now (or lost this coordinator's lease): stand by and retry.
    Unlike other StoreErrors (garbage in a key), this one is not the process's end."""


class LogNotReadYet(StoreResourcesError):
    """A job's log is being read from etcd: the job waits (UNAVAILABLE) and is retried."""


@contextlib.contextmanager
def _unavailable_as(what: str):
    """aetcd's connection and timeout errors, as one EtcdUnavailable line (no traceback)."""
    import aetcd.exceptions

    try:
        yield
    except aetcd.exceptions.ClientError as exc:
        raise EtcdUnavailable(f"{what}: {type(exc).__name__}: {str(exc)[:200]}") from None


ETCD_PORT = 2379  # etcd's client port, for an endpoint that names only its host


def etcd_endpoint(endpoint: str) -> tuple[str, int]:
    """``[store] endpoints`` entry as (host, port): ``"10.0.0.5"`` -> ("10.0.0.5", 2379),
    ``"[::1]:2379"`` -> ("::1", 2379). The config checks every entry with it when it loads."""
    return split_host_port(endpoint, "[store] endpoints", default_port=ETCD_PORT)


def _client_for(endpoint: str):
    try:
        import aetcd
    except ImportError as exc:  # pragma: no cover - the extra is missing
        from meshgate.extras import install_hint

        raise StoreError(f'[store] kind = "etcd" needs aetcd: {install_hint("etcd")}') from exc
    host, port = etcd_endpoint(endpoint)
    return aetcd.Client(
        host=f"[{host}]" if ":" in host else host,  # aetcd dials f"{host}:{port}": an IPv6 literal takes brackets
        port=port,
        timeout=5,
        options={"grpc.max_receive_message_length": MAX_READ_BYTES},
    )


def _prefix_end(prefix: bytes) -> bytes:
    from aetcd.utils import prefix_range_end

    return prefix_range_end(prefix)


class EtcdSession:
    """One client, one lease, one leader key: whether this process leads, and the fence
    that every write of every log under the root compares."""

    def __init__(self, endpoints: Sequence[str], root: str, advertise: str, lease_ttl_s: int = 5) -> None:
        if not endpoints:
            raise StoreError("[store] endpoints: at least one etcd endpoint is needed")
        self.endpoints = list(endpoints)
        self.root = root
        self.advertise = advertise
        self.lease_ttl_s = lease_ttl_s
        self.leader_key = (root + "leader").encode()
        self.where = f"etcd {','.join(self.endpoints)} ({root})"
        self.client = None
        self.lease = None
        self.leader_revision: Optional[int] = None
        self.failed: Optional[BaseException] = None
        self.lost_leadership = asyncio.Event()
        self._keepalive: Optional[asyncio.Task] = None

    async def connect(self) -> None:
        last: Optional[BaseException] = None
        for endpoint in self.endpoints:
            client = _client_for(endpoint)
            try:
                await client.connect()
                await client.status()
            except Exception as exc:  # noqa: BLE001 - try the next endpoint
                last = exc
                await client.close()
                continue
            self.client = client
            return
        raise EtcdUnavailable(f"[store] endpoints {self.endpoints}: no etcd answered ({last})")

    async def current_leader(self) -> str:
        with _unavailable_as(f"{self.where}: reading the leader"):
            got = await self.client.get(self.leader_key)
        return got.value.decode() if got is not None else ""

    async def campaign(self, stop: asyncio.Event, poll_s: Optional[float] = None) -> bool:
        """Block until this process leads (True) or ``stop`` is set (False); raises
        EtcdUnavailable when etcd goes away meanwhile."""
        with _unavailable_as(f"{self.where}: campaigning"):
            return await self._campaign(stop, poll_s)

    async def _campaign(self, stop: asyncio.Event, poll_s: Optional[float]) -> bool:
        poll_s = poll_s or max(self.lease_ttl_s / 4, 0.2)
        tx = self.client.transactions
        while not stop.is_set():
            lease = await self.client.lease(self.lease_ttl_s)
            won, _ = await self.client.transaction(
                compare=[tx.create(self.leader_key) == 0],
                success=[tx.put(self.leader_key, self.advertise.encode(), lease=lease.id)],
                failure=[],
            )
            if won:
                self.lease = lease
                got = await self.client.get(self.leader_key)
                self.leader_revision = got.create_revision
                self._keepalive = asyncio.ensure_future(self._keep_alive())
                log.info("elected leader of %s (lease %x, ttl %ds)", self.root, lease.id, self.lease_ttl_s)
                return True
            await self.client.revoke_lease(lease.id)
            try:
                await asyncio.wait_for(stop.wait(), timeout=poll_s)
            except asyncio.TimeoutError:
                pass
        return False

    async def _keep_alive(self) -> None:
        interval = max(self.lease_ttl_s / 3, 0.2)
        while True:
            await asyncio.sleep(interval)
            try:
                reply = await self.client.refresh_lease(self.lease.id)
                ttl = getattr(reply, "TTL", 1)
            except Exception as exc:  # noqa: BLE001 - any failure to refresh is a lost lease: step down
                ttl, why = 0, exc
            else:
                why = "lease expired"
            if ttl <= 0:
                self.fail(StoreError(f"etcd lease lost ({why}); stepping down"))
                return

    def fail(self, exc: BaseException) -> None:
        """This process may no longer write: its term ends (leadership_lost)."""
        if self.failed is None:
            self.failed = exc
            self.lost_leadership.set()
            log.error("%s", exc)

    def healthy(self) -> bool:
        return self.failed is None and self.leader_revision is not None

    async def read_prefix(self, prefix: str) -> list:
        """Every key under ``prefix`` (as aetcd key-values, in key order)."""
        with _unavailable_as(f"{self.where}: reading {prefix}"):
            return list(await self.client.get_prefix(prefix.encode()))

    async def read_log(self, prefix: str) -> list:
        """A log's ``meta`` and ``events/`` (and nothing else under ``prefix``: the cluster's
        log does not read every job's)."""
        with _unavailable_as(f"{self.where}: reading {prefix}"):
            meta = await self.client.get((prefix + "meta").encode())
        return ([meta] if meta is not None else []) + await self.read_prefix(prefix + "events/")

    async def fenced(self, ops: list, compare: Iterable = (), refused: str = "") -> None:
        """Write ``ops`` in one transaction, only while this session leads (and ``compare``
        holds); a refusal is a StoreError naming the leader key."""
        tx = self.client.transactions
        won, _ = await self.client.transaction(
            compare=[tx.create(self.leader_key) == self.leader_revision, *compare], success=ops, failure=[]
        )
        if not won:
            raise StoreError(
                f"etcd key {self.leader_key.decode()}: this coordinator no longer leads{refused}; "
                "write refused (fenced)"
            )

    async def drop_prefix(self, prefix: str) -> None:
        """Delete every key under ``prefix``, fenced like every write."""
        tx = self.client.transactions
        start = prefix.encode()
        with _unavailable_as(f"{self.where}: deleting {prefix}"):
            await self.fenced([tx.delete(start, range_end=_prefix_end(start))])

    async def aclose(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
        if self.lease is not None and self.failed is None:
            with contextlib.suppress(Exception):  # best effort: the lease expires anyway
                await self.client.revoke_lease(self.lease.id)
        if self.client is not None:
            with contextlib.suppress(Exception):  # etcd may be gone: nothing left to release
                await self.client.close()


def _transactions(puts: list[tuple[bytes, bytes]]):
    """``puts`` in order, cut into transactions etcd takes (at most MAX_OPS_PER_TXN puts and
    about MAX_TXN_BYTES each; a single larger record goes alone, and etcd names its size)."""
    chunk: list[tuple[bytes, bytes]] = []
    size = 0
    for key, value in puts:
        if chunk and (len(chunk) == MAX_OPS_PER_TXN or size + len(key) + len(value) > MAX_TXN_BYTES):
            yield chunk
            chunk, size = [], 0
        chunk.append((key, value))
        size += len(key) + len(value)
    if chunk:
        yield chunk


class EtcdLog(GroupCommitStore):
    """One chained log under ``prefix`` (``meta`` and ``events/<seq>``), pinned to one job
    (or the cluster), written only through its session's fence. A new log is written with
    its first append: meta and record 1 (the pin) in the same transaction, and only if no
    meta is there yet, so a log is never written over."""

    def __init__(self, session: EtcdSession, prefix: str, pin: JobPinned, mark: Optional[DurableMark] = None) -> None:
        super().__init__(mark)
        self.session = session
        self.prefix = prefix
        self.pin = pin
        self.meta_key = (prefix + "meta").encode()
        self.where = f"etcd {','.join(session.endpoints)} ({prefix})"
        self._events: list[Event] = []
        self._new = False  # no meta and no pin in etcd yet: the first write adds them

    def _event_key(self, seq: int) -> bytes:
        return f"{self.prefix}events/{seq:012d}".encode()

    async def read(self) -> None:
        """Read and verify the whole log (chain, pin, high-water mark)."""
        self.take(await self.session.read_log(self.prefix))

    def take(self, kvs: Sequence) -> None:
        """Verify the log from its key-values as read from etcd (meta, events/<seq>)."""
        meta, rows = None, []
        events_prefix = self.prefix + "events/"
        for kv in kvs:
            key = kv.key.decode()
            if kv.key == self.meta_key:
                meta = kv.value
            elif key.startswith(events_prefix):
                try:
                    rows.append((int(key[len(events_prefix) :]), kv.value))
                except ValueError:
                    raise StoreError(f"etcd key {key}: not an event key") from None
        if meta is None:
            self._take_empty(len(rows))
            return
        self._check_meta(meta)
        verified = verify_records(
            rows,
            self.where,
            self.pin,
            name_of=lambda seq: f"etcd key {self._event_key(seq).decode()} (record {seq})",
        )
        if self.mark is not None:
            self.mark.check(len(verified.sums), verified.sums, self.where, missing_ok=True)
        self._events = list(verified.events)
        self._next_seq = len(verified.sums) + 1
        self._head = verified.head

    def _take_empty(self, rows: int) -> None:
        if rows:
            raise StoreError(f"etcd key {self.meta_key.decode()} is missing, but {rows} records are there")
        mark = self.mark.read() if self.mark is not None else None
        if mark is not None:
            raise StoreError(
                f"{self.where}: no log, but high-water mark {self.mark.path} says "
                f"{mark.count} records of {mark.job_id!r} were acknowledged"
            )
        _, self._head = encode_record(1, GENESIS, self.pin)
        self._events, self._next_seq, self._new = [], 2, True

    def _check_meta(self, meta: bytes) -> None:
        try:
            values = json.loads(meta)
            schema, job = values.get("schema"), values.get("job_id")
        except (ValueError, AttributeError):
            schema = job = None
        if schema == 1:
            raise OldLogFormatError(
                f"etcd key {self.meta_key.decode()}: written by an older meshgate (schema 1, unchained "
                f"records); this version reads schema {SCHEMA_VERSION} only"
            )
        if isinstance(schema, int) and not isinstance(schema, bool) and schema > SCHEMA_VERSION:
            raise newer_state(f"etcd key {self.meta_key.decode()}", f"schema {schema}")
        if schema != SCHEMA_VERSION or job != self.pin.job_id:
            raise StoreError(
                f"etcd key {self.meta_key.decode()}: {meta[:80]!r} is not meshgate "
                f"schema {SCHEMA_VERSION} for {self.pin.job_id!r}"
            )

    def load(self) -> list[Event]:
        return list(self._events)

    async def _write(self, rows: list[tuple[int, str]], then: Callable[[], None] | None = None) -> None:
        tx = self.session.client.transactions
        puts = [(self._event_key(seq), text.encode()) for seq, text in rows]
        if self._new:  # the log's first write: meta and pin with it, never over another log
            body = json.dumps({"schema": SCHEMA_VERSION, "job_id": self.pin.job_id}).encode()
            pin, _ = encode_record(1, GENESIS, self.pin)
            puts = [(self.meta_key, body), (self._event_key(1), pin.encode())] + puts
        for chunk in _transactions(puts):
            ops = [tx.put(key, value) for key, value in chunk]
            if self._new:
                await self.session.fenced(
                    ops,
                    compare=[tx.create(self.meta_key) == 0],
                    refused=f", or {self.meta_key.decode()} exists already",
                )
                self._new = False
            else:
                await self.session.fenced(ops)
        if then is not None:
            await asyncio.to_thread(then)

    def _fail(self, exc: BaseException) -> None:
        super()._fail(exc)
        self.session.fail(exc)  # one log's failed write ends the term of every log

    def healthy(self) -> bool:
        return self._failed is None and self.session.healthy()

    def leadership_lost(self) -> asyncio.Event:
        return self.session.lost_leadership

    def close(self) -> None:
        if self.mark is not None:
            self.mark.close()


class EtcdJobLogs:
    """Each job's own log under ``<root>jobs/<id>/``, in the leader's session.

    The cluster opens a job's log without awaiting etcd (in a worker thread: JobEngines), so
    the logs it will read are read from etcd when the term starts (``prefetch``): those of the
    jobs allocated and not yet summarized (running, or ended before their summary was
    written). A job allocated later in the term has no log yet (a job is allocated once):
    its log is new, and its first write refuses to land on an existing one. Any other open
    (a log opened once already this term) reads etcd in the background and answers
    LogNotReadYet meanwhile; the cluster retries it.
    """

    def __init__(self, session: EtcdSession, known: Iterable[str]) -> None:
        self.session = session
        self.known = set(known)  # jobs whose log may be in etcd
        self._read: dict[str, list] = {}  # job id -> its key-values, until opened
        self._reading: dict[str, asyncio.Task] = {}
        self._loop = asyncio.get_running_loop()

    def prefix(self, job_id: str) -> str:
        return f"{self.session.root}jobs/{job_id}/"

    async def prefetch(self) -> None:
        """Read every known job's log, all at once (a takeover waits for the slowest, not the sum)."""
        job_ids = sorted(self.known)
        logs = await asyncio.gather(*(self.session.read_log(self.prefix(job_id)) for job_id in job_ids))
        self._read.update(zip(job_ids, logs))

    def open(self, pin: JobPinned, mark: Optional[DurableMark]) -> EtcdLog:
        job_id = pin.job_id
        store = EtcdLog(self.session, self.prefix(job_id), pin, mark)
        if job_id not in self.known:
            store.take(())  # allocated in this term: a new log
            self.known.add(job_id)
            return store
        kvs = self._read.pop(job_id, None)
        if kvs is None:
            self._read_later(job_id)
            raise LogNotReadYet(f"job {job_id!r}: its log is being read from {self.session.where}")
        store.take(kvs)
        return store

    def _read_later(self, job_id: str) -> None:
        """Start reading the log on the session's loop: ``open`` runs in the cluster's
        worker thread (JobEngines opens a running job's log off the loop)."""
        self._loop.call_soon_threadsafe(self._start_reading, job_id)

    def _start_reading(self, job_id: str) -> None:
        if job_id in self._reading and not self._reading[job_id].done():
            return

        async def read() -> None:
            try:
                self._read[job_id] = await self.session.read_log(self.prefix(job_id))
            except StoreError as exc:
                log.warning("job %s: reading its log from etcd failed: %s", job_id, exc)

        self._reading[job_id] = self._loop.create_task(read())

    def drop(self, job_id: str) -> None:
        """Delete an ended job's log (fenced). Called from a worker thread (the cluster's
        prune), so the delete runs on the session's loop."""
        future = asyncio.run_coroutine_threadsafe(self._drop(job_id), self._loop)
        future.result()  # etcd's own timeout (5 s) bounds it

    async def _drop(self, job_id: str) -> None:
        self._read.pop(job_id, None)
        try:
            await self.session.drop_prefix(self.prefix(job_id))
        except Exception as exc:  # noqa: BLE001 - a failed fenced write ends the term, as any other
            self.session.fail(StoreError(f"deleting job {job_id!r}'s log: {exc}"))
            raise

    def close(self) -> None:
        for task in self._reading.values():
            task.cancel()
