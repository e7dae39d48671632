"""The HA store: the same event log in etcd (through ``aetcd``), and leader election.

Keys, under ``/meshgate/<job>/``:

  meta             {"schema": 2, "job_id": ...}
  events/<seq>     one chained record each (store/codec.py; record 1 pins the job and
                   its plan), seq zero-padded so keys sort in order
  leader           the leader's advertised address, attached to its lease

Election: a coordinator leads while it holds ``leader`` under a lease of
``lease_ttl_s`` that it keeps alive. Standbys poll the key and campaign when it is
gone. Every write is a transaction that first compares ``leader``'s create revision
with the one this coordinator created, so a deposed leader (lease lost, partitioned)
can never append: its write fails and it stops. That fencing is what keeps a rank
from being assigned twice across a failover.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Optional, Sequence

from meshgate.coordinator.rendezvous import Event
from meshgate.coordinator.store import GroupCommitStore, StoreError
from meshgate.coordinator.store.codec import (
    GENESIS,
    RECORD_SCHEMA,
    JobPinned,
    OldLogFormatError,
    encode_record,
    verify_records,
)
from meshgate.coordinator.store.mark import DurableMark

log = logging.getLogger("meshgate.coordinator")

SCHEMA_VERSION = RECORD_SCHEMA
MAX_OPS_PER_TXN = 100  # etcd's default --max-txn-ops is 128


class EtcdUnavailable(StoreError):
    """etcd cannot be reached now (or lost this coordinator's lease): stand by and retry.
    Unlike other StoreErrors (garbage in a key), this one is not the process's end."""


@contextlib.contextmanager
def _unavailable_as(what: str):
    """aetcd's connection and timeout errors, as one EtcdUnavailable line (no traceback)."""
    import aetcd.exceptions

    try:
        yield
    except aetcd.exceptions.ClientError as exc:
        raise EtcdUnavailable(f"{what}: {type(exc).__name__}: {str(exc)[:200]}") from None


def _client_for(endpoint: str):
    try:
        import aetcd
    except ImportError as exc:  # pragma: no cover - the extra is missing
        raise StoreError("[store] kind = \"etcd\" needs aetcd: pip install 'meshgate[etcd]'") from exc
    host, _, port = endpoint.rpartition(":")
    return aetcd.Client(host=host or "127.0.0.1", port=int(port or 2379), timeout=5)


class EtcdStore(GroupCommitStore):
    def __init__(
        self, endpoints: Sequence[str], pin: JobPinned, advertise: str, lease_ttl_s: int = 5,
        mark: Optional[DurableMark] = None,
    ) -> None:
        super().__init__(mark)
        job_id = pin.job_id
        self.pin = pin
        if not endpoints:
            raise StoreError("[store] endpoints: at least one etcd endpoint is needed")
        self.endpoints = list(endpoints)
        self.job_id = job_id
        self.advertise = advertise
        self.lease_ttl_s = lease_ttl_s
        self.prefix = f"/meshgate/{job_id}/"
        self.leader_key = (self.prefix + "leader").encode()
        self.client = None
        self.lease = None
        self.leader_revision: Optional[int] = None
        self.where = f"etcd {','.join(self.endpoints)} (job {job_id})"
        self._events: list[Event] = []
        self._keepalive: Optional[asyncio.Task] = None
        self.lost_leadership = asyncio.Event()

    def _event_key(self, seq: int) -> bytes:
        return f"{self.prefix}events/{seq:012d}".encode()

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

    def leadership_lost(self) -> asyncio.Event:
        return self.lost_leadership

    async def campaign(self, stop: asyncio.Event, poll_s: Optional[float] = None) -> bool:
        """Block until this coordinator leads (True) or ``stop`` is set (False); raises
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
                log.info("elected leader of job %s (lease %x, ttl %ds)", self.job_id, lease.id, self.lease_ttl_s)
                await self._load_all()
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
                self._fail(StoreError(f"etcd lease lost ({why}); stepping down"))
                return

    def _fail(self, exc: BaseException) -> None:
        if self._failed is None:
            self._failed = exc
            self.lost_leadership.set()
            log.error("%s", exc)

    async def _load_all(self) -> None:
        """Read and verify the whole log (chain, pin, high-water mark) before leading;
        write only to start a new one (the meta key and record 1, the pin)."""
        meta_key = (self.prefix + "meta").encode()
        meta = await self.client.get(meta_key)
        result = await self.client.get_prefix((self.prefix + "events/").encode())
        rows = []
        for kv in result:
            key = kv.key.decode()
            try:
                rows.append((int(key.rsplit("/", 1)[1]), kv.value))
            except ValueError:
                raise StoreError(f"etcd key {key}: not an event key") from None
        if meta is None:
            if rows:
                raise StoreError(f"etcd key {meta_key.decode()} is missing, but {len(rows)} records are there")
            mark = self.mark.read() if self.mark is not None else None
            if mark is not None:
                raise StoreError(
                    f"{self.where}: no log, but high-water mark {self.mark.path} says "
                    f"{mark.count} records of job {mark.job_id!r} were acknowledged"
                )
            body = json.dumps({"schema": SCHEMA_VERSION, "job_id": self.job_id}).encode()
            text, head = encode_record(1, GENESIS, self.pin)
            tx = self.client.transactions
            await self._fenced([tx.put(meta_key, body), tx.put(self._event_key(1), text.encode())])
            if self.mark is not None:
                await asyncio.to_thread(self.mark.advance, 1, head)
            self._events, self._next_seq, self._head = [], 2, head
            return
        try:
            values = json.loads(meta.value)
            schema, job = values.get("schema"), values.get("job_id")
        except (ValueError, AttributeError):
            schema = job = None
        if schema == 1:
            raise OldLogFormatError(
                f"etcd key {meta_key.decode()}: written by an older meshgate (schema 1, unchained "
                f"records); this version reads schema {SCHEMA_VERSION} only"
            )
        if schema != SCHEMA_VERSION or job != self.job_id:
            raise StoreError(
                f"etcd key {meta_key.decode()}: {meta.value[:80]!r} is not meshgate "
                f"schema {SCHEMA_VERSION} for job {self.job_id!r}"
            )
        verified = verify_records(
            rows, self.where, self.pin,
            name_of=lambda seq: f"etcd key {self._event_key(seq).decode()} (record {seq})",
        )
        if self.mark is not None:
            self.mark.check(len(verified.sums), verified.sums, self.where, missing_ok=True)
        self._events = list(verified.events)
        self._next_seq = len(verified.sums) + 1
        self._head = verified.head

    def load(self) -> list[Event]:
        return list(self._events)

    async def _fenced(self, ops) -> None:
        tx = self.client.transactions
        won, _ = await self.client.transaction(
            compare=[tx.create(self.leader_key) == self.leader_revision], success=ops, failure=[]
        )
        if not won:
            raise StoreError(
                f"etcd key {self.leader_key.decode()}: this coordinator no longer leads; "
                "write refused (fenced)"
            )

    async def _write(self, rows: list[tuple[int, str]]) -> None:
        tx = self.client.transactions
        ops = [tx.put(self._event_key(seq), text.encode()) for seq, text in rows]
        for start in range(0, len(ops), MAX_OPS_PER_TXN):
            await self._fenced(ops[start : start + MAX_OPS_PER_TXN])

    def healthy(self) -> bool:
        return self._failed is None and self.leader_revision is not None

    async def resign(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
        if self.lease is not None and self._failed is None:
            try:
                await self.client.revoke_lease(self.lease.id)
            except Exception:  # noqa: BLE001 - best effort: the lease expires anyway
                pass

    async def aclose(self) -> None:
        await self.resign()
        if self.client is not None:
            with contextlib.suppress(Exception):  # etcd may be gone: nothing left to release
                await self.client.close()
        if self.mark is not None:
            self.mark.close()
