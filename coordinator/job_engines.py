"""Each job's rendezvous engine and its own log, for the cluster (coordinator/cluster.py):
opened when the job runs, closed when it ends, deleted after the retention; and the jobs
whose log this process cannot serve, and why.

A log that cannot be trusted is refused for good (DATA_LOSS, naming the file, left as
found; every other job serves); one that cannot be opened now for want of descriptors,
space or memory waits (UNAVAILABLE; health NOT_SERVING) and the cluster retries it.

A running job's log is opened (created, verified, read) in a worker thread, never on the
event loop: creating one costs several fsyncs, and every other call of every job waits
for the loop. Its engine is built from it back on the loop (the replay changes state
that only the loop touches). One open per job at a time (``opening``): a call that needs
the engine meanwhile is answered UNAVAILABLE "being opened; retry" (every node call of an
agent retries it) rather than opening the same file a second time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

from meshgate.coordinator.engine import Coordinator
from meshgate.coordinator.hardware import HardwareBook
from meshgate.coordinator.keys import KeyRing
from meshgate.coordinator.rendezvous import Code, RendezvousConfig, RendezvousError
from meshgate.coordinator.store import Store, StoreError, StoreResourcesError

log = logging.getLogger("meshgate.coordinator")

# Opens the log of one job (created empty on first use; refused if it cannot be trusted).
# Called in a worker thread (a running job's) or on the loop (a declared job's at start).
JobStoreOpener = Callable[[RendezvousConfig], Store]
# Deletes an ended job's own log and mark (by job id); a missing one is no error.
JobStoreDropper = Callable[[str], None]


class JobEngines:
    def __init__(
        self,
        keys: KeyRing,
        open_job_store: JobStoreOpener,
        *,
        attestation_ttl_s: float,
        heartbeat_timeout_s: float,
        on_store_failure: Optional[Callable[[BaseException], None]] = None,
        drop_job_store: Optional[JobStoreDropper] = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.keys = keys
        self.clock = clock  # the cluster's: a job's liveness and the pool's are read on one clock
        self.open_job_store = open_job_store
        self.drop_job_store = drop_job_store
        self.attestation_ttl_s = attestation_ttl_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.on_store_failure = on_store_failure
        self.engines: dict[str, Coordinator] = {}
        self.stores: dict[str, Store] = {}  # the open log of each job in self.engines
        self.damaged: dict[str, str] = {}  # job id -> why its log is refused for good
        self.unopened: dict[str, str] = {}  # job id -> why its log cannot be opened now
        self.opening: dict[str, asyncio.Task[Optional[Coordinator]]] = {}  # job id -> its log opening off the loop
        self.closed = False  # close_all() ran: a log whose open ends later is closed at once
        # What each served engine signs of a worker's hardware and places TP groups by (the
        # cluster sets it; coordinator/hardware.py).
        self.hardware: Optional[HardwareBook] = None

    def get(self, job_id: str) -> Optional[Coordinator]:
        return self.engines.get(job_id)

    def open(self, config: RendezvousConfig) -> Coordinator:
        """A declared job's engine, its log opened and replayed on the loop: at start, before
        any call is served (a log it cannot trust refuses the start)."""
        engine = self.engines.get(config.job_id)
        if engine is None:
            engine = self._serve(config, self._open_store(config))
        return engine

    def served(self, config: RendezvousConfig, serves: Callable[[], bool]) -> Coordinator:
        """A running job's engine for a call that cannot wait: DATA_LOSS for a log refused
        for good, UNAVAILABLE while it cannot be opened now (the cluster's loop retries it),
        else UNAVAILABLE while it is opened off the loop, started here if no one did."""
        job_id = config.job_id
        engine = self.engines.get(job_id)
        if engine is not None:
            return engine
        self._refuse_damaged(job_id)
        if job_id in self.unopened and job_id not in self.opening:
            raise self._unavailable(job_id, self.unopened[job_id])
        self._opening(config, serves)
        raise RendezvousError(Code.UNAVAILABLE, f"job {job_id!r}: its log is being opened; retry")

    async def opened(self, config: RendezvousConfig, serves: Callable[[], bool]) -> Optional[Coordinator]:
        """A running job's engine, its log opened in a worker thread while the loop serves
        every other call: the same open for every caller (one store per job, ever). None
        when ``serves()`` says no more once it is open (the job ended meanwhile): the log
        is closed again and no engine kept. DATA_LOSS and UNAVAILABLE as ``_open_store``."""
        engine = self.engines.get(config.job_id)
        if engine is not None:
            return engine
        # Shielded: a caller that goes away (a cancelled RPC) never strands a store half-kept.
        return await asyncio.shield(self._opening(config, serves))

    def _opening(self, config: RendezvousConfig, serves: Callable[[], bool]) -> "asyncio.Task[Optional[Coordinator]]":
        task = self.opening.get(config.job_id)
        if task is None:
            task = self.opening[config.job_id] = asyncio.get_running_loop().create_task(
                self._open_off_loop(config, serves)
            )
            task.add_done_callback(_retrieved)
        return task

    async def _open_off_loop(self, config: RendezvousConfig, serves: Callable[[], bool]) -> Optional[Coordinator]:
        job_id = config.job_id
        try:
            self._refuse_damaged(job_id)
            try:
                store = await asyncio.to_thread(self.open_job_store, config)
            except StoreError as exc:
                raise self._refused(job_id, exc) from None
            self._opened(job_id)
            if self.closed or not serves():
                log.info("job %s ended while its log was being opened: closed again, not served", job_id)
                store.close()
                return None
            return self._serve(config, store)
        finally:
            self.opening.pop(job_id, None)  # in the same step as the outcome: no caller sees a done open

    def _serve(self, config: RendezvousConfig, store: Store) -> Coordinator:
        """The job's engine over its open ``store`` (replayed here, on the loop), served from now on."""
        try:
            engine = self._engine(config, store, self.on_store_failure)
        except BaseException:
            store.close()
            raise
        self.stores[config.job_id] = store
        self.engines[config.job_id] = engine
        self._claims(engine)
        return engine

    def _claims(self, engine: Coordinator) -> None:
        if self.hardware is not None:
            engine.signer.hardware = self.hardware.claim
            engine.state.nvlink_domains = self.hardware.nvlink_domains

    def _engine(
        self, config: RendezvousConfig, store: Store, on_store_failure: Optional[Callable[[BaseException], None]]
    ) -> Coordinator:
        return Coordinator(
            config,
            store,
            self.keys,
            attestation_ttl_s=self.attestation_ttl_s,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            on_store_failure=on_store_failure,
            clock=self.clock,
        )

    def adopt(self, engine: Coordinator) -> None:
        """An engine opened by its caller (cluster.cluster_of_engine): served and closed here."""
        self.engines[engine.config.job_id] = engine
        self.stores[engine.config.job_id] = engine.store
        self._claims(engine)

    def replayed(self, config: RendezvousConfig) -> Coordinator:
        """A job's engine replayed from its own log for reading, the log closed again at
        once: never kept, never written to."""
        store = self._open_store(config)  # DATA_LOSS for a damaged log
        try:
            return self._engine(config, store, None)
        finally:
            store.close()

    def _open_store(self, config: RendezvousConfig) -> Store:
        """The job's log, or a RendezvousError for this job alone: DATA_LOSS for a log that
        cannot be trusted, UNAVAILABLE while the process is out of descriptors, space or memory."""
        job_id = config.job_id
        self._refuse_damaged(job_id)
        try:
            store = self.open_job_store(config)
        except StoreError as exc:
            raise self._refused(job_id, exc) from None
        self._opened(job_id)
        return store

    def _refuse_damaged(self, job_id: str) -> None:
        if job_id in self.damaged:
            raise RendezvousError(Code.DATA_LOSS, self.damaged[job_id])

    def _refused(self, job_id: str, exc: StoreError) -> RendezvousError:
        """What a failed open of the job's log answers, recorded for the job."""
        if isinstance(exc, StoreResourcesError):
            if job_id not in self.unopened:
                log.error("job %s: its log cannot be opened now; health is NOT_SERVING until it is: %s", job_id, exc)
            self.unopened[job_id] = str(exc)
            return self._unavailable(job_id, str(exc))
        self.unopened.pop(job_id, None)
        self.damaged[job_id] = f"job {job_id!r}: its log cannot be trusted, refused and left as found: {exc}"
        log.error("%s", self.damaged[job_id])
        return RendezvousError(Code.DATA_LOSS, self.damaged[job_id])

    @staticmethod
    def _unavailable(job_id: str, why: str) -> RendezvousError:
        return RendezvousError(Code.UNAVAILABLE, f"job {job_id!r}: its log cannot be opened now: {why}")

    def _opened(self, job_id: str) -> None:
        if self.unopened.pop(job_id, None) is not None:
            log.info("job %s: its log is open again", job_id)

    async def close(self, job_id: str) -> Coordinator:
        """Stop serving the job: its engine is dropped at once (so that no later call finds
        it), and its log closed once every append made before is durable."""
        engine = self.engines.pop(job_id)
        store = self.stores.pop(job_id)
        try:
            await engine.durable()
        finally:
            store.close()
        return engine

    async def drop(self, job_ids: list[str]) -> None:
        """Delete the own logs (and marks) of ended jobs."""
        if self.drop_job_store is not None:
            for job_id in job_ids:
                await asyncio.to_thread(self.drop_job_store, job_id)

    def stores_healthy(self) -> bool:
        """Every open job log takes writes."""
        return all(store.healthy() for store in list(self.stores.values()))

    def store_refusal(self) -> str:
        """Why an open job log cannot take writes ("" when every one can)."""
        return next((why for store in list(self.stores.values()) if (why := store.refusal())), "")

    def close_all(self) -> None:
        self.closed = True  # a log still being opened is closed when its open ends
        for store in self.stores.values():
            store.close()


def _retrieved(task: "asyncio.Task[Optional[Coordinator]]") -> None:
    """An open that no caller awaited (a call told to retry started it): its refusal is
    already recorded (damaged, unopened) and logged; nothing more to report."""
    if not task.cancelled():
        task.exception()


__all__ = ["JobEngines", "JobStoreDropper", "JobStoreOpener"]
