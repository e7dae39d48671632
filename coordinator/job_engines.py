"""Each job's rendezvous engine and its own log, for the cluster (coordinator/cluster.py):
opened when the job runs, closed when it ends, deleted after the retention; and the jobs
whose log this process cannot serve, and why.

A log that cannot be trusted is refused for good (DATA_LOSS, naming the file, left as
found; every other job serves); one that cannot be opened now for want of descriptors,
space or memory waits (UNAVAILABLE; health NOT_SERVING) and the cluster retries it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Optional

from meshgate.coordinator.engine import Coordinator
from meshgate.coordinator.keys import KeyRing
from meshgate.coordinator.rendezvous import Code, RendezvousConfig, RendezvousError
from meshgate.coordinator.store import Store, StoreError, StoreResourcesError

log = logging.getLogger("meshgate.coordinator")

# Opens the log of one job (created empty on first use; refused if it cannot be trusted).
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
    ) -> None:
        self.keys = keys
        self.open_job_store = open_job_store
        self.drop_job_store = drop_job_store
        self.attestation_ttl_s = attestation_ttl_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.on_store_failure = on_store_failure
        self.engines: dict[str, Coordinator] = {}
        self.stores: dict[str, Store] = {}  # the open log of each job in self.engines
        self.damaged: dict[str, str] = {}  # job id -> why its log is refused for good
        self.unopened: dict[str, str] = {}  # job id -> why its log cannot be opened now

    def get(self, job_id: str) -> Optional[Coordinator]:
        return self.engines.get(job_id)

    def open(self, config: RendezvousConfig) -> Coordinator:
        """The job's engine, its log opened and replayed on first use."""
        engine = self.engines.get(config.job_id)
        if engine is None:
            store = self._open_store(config)
            self.stores[config.job_id] = store
            engine = self.engines[config.job_id] = Coordinator(
                config,
                store,
                self.keys,
                attestation_ttl_s=self.attestation_ttl_s,
                heartbeat_timeout_s=self.heartbeat_timeout_s,
                on_store_failure=self.on_store_failure,
            )
        return engine

    def adopt(self, engine: Coordinator) -> None:
        """An engine opened by its caller (cluster.cluster_of_engine): served and closed here."""
        self.engines[engine.config.job_id] = engine
        self.stores[engine.config.job_id] = engine.store

    def replayed(self, config: RendezvousConfig) -> Coordinator:
        """A job's engine replayed from its own log for reading, the log closed again at
        once: never kept, never written to."""
        store = self._open_store(config)  # DATA_LOSS for a damaged log
        try:
            return Coordinator(
                config,
                store,
                self.keys,
                attestation_ttl_s=self.attestation_ttl_s,
                heartbeat_timeout_s=self.heartbeat_timeout_s,
            )
        finally:
            store.close()

    def _open_store(self, config: RendezvousConfig) -> Store:
        """The job's log, or a RendezvousError for this job alone: DATA_LOSS for a log that
        cannot be trusted, UNAVAILABLE while the process is out of descriptors, space or memory."""
        job_id = config.job_id
        if job_id in self.damaged:
            raise RendezvousError(Code.DATA_LOSS, self.damaged[job_id])
        try:
            store = self.open_job_store(config)
        except StoreResourcesError as exc:
            if job_id not in self.unopened:
                log.error("job %s: its log cannot be opened now; health is NOT_SERVING until it is: %s", job_id, exc)
            self.unopened[job_id] = str(exc)
            raise RendezvousError(Code.UNAVAILABLE, f"job {job_id!r}: its log cannot be opened now: {exc}") from None
        except StoreError as exc:
            self.unopened.pop(job_id, None)
            self.damaged[job_id] = f"job {job_id!r}: its log cannot be trusted, refused and left as found: {exc}"
            log.error("%s", self.damaged[job_id])
            raise RendezvousError(Code.DATA_LOSS, self.damaged[job_id]) from None
        if self.unopened.pop(job_id, None) is not None:
            log.info("job %s: its log is open again", job_id)
        return store

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

    def close_all(self) -> None:
        for store in self.stores.values():
            store.close()


__all__ = ["JobEngines", "JobStoreDropper", "JobStoreOpener"]
