"""Terms of office: when this process may serve, and what it does when it may not.

A coordinator process serves in *terms*. A term starts when the process may write
the store (at once for SQLite and memory; after winning the etcd election for HA)
and ends on SIGTERM, on a store failure, or when an HA leader loses its lease.

- A disk store that fails ends the process (exit 2): its log can no longer be
  trusted to hold what was acknowledged, and a restart re-validates it.
- An HA term that ends because etcd went away (lease lost, fenced write, etcd
  unreachable) does not end the process: it steps down to standby, answers
  UNAVAILABLE naming the last known leader, reconnects with backoff and campaigns
  again. A daemon that runs for months outlives an etcd outage without a restart by
  hand; the fencing in the etcd store keeps a deposed leader from writing.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable, Optional

from meshgate.coordinator.cluster import ClusterCoordinator, JobStoreOpener
from meshgate.coordinator.config import CoordinatorConfig
from meshgate.coordinator.keys import KeyRing
from meshgate.coordinator.jobs import check_job_id
from meshgate.coordinator.rendezvous import Code, RendezvousConfig, RendezvousError, shown
from meshgate.coordinator.service import CoordinatorSlot
from meshgate.coordinator.resources import exhausted
from meshgate.coordinator.store import MemoryStore, Store, StoreError, StoreResourcesError, open_store
from meshgate.coordinator.store.codec import JobPinned, cluster_pin, job_pin
from meshgate.coordinator.store.mark import FILE_NAME as MARK_FILE
from meshgate.coordinator.store.mark import DurableMark

log = logging.getLogger("meshgate.coordinator")


class StateRefused(StoreError):
    """The state on disk (or in etcd) cannot be trusted: refused before serving, and
    left as found. Not retried: an operator decides (``--reset-state``)."""


def durable_mark(config: CoordinatorConfig) -> DurableMark:
    """The high-water mark lives with the signing keys: a state directory that lost its
    log still has keys that signed for it, and so a mark that says so. One mark per log
    under ``marks/``: the cluster's, and each job's."""
    return DurableMark(_marks_dir(config) / config.log_id, config.log_id)


def _marks_dir(config: CoordinatorConfig) -> Path:
    marks = config.keys_dir / "marks"
    marks.mkdir(mode=0o700, exist_ok=True)
    return marks


RESET_SUFFIX = ".reset-"  # what --reset-state appends (and a timestamp) to what it moves aside


def log_pin(config: CoordinatorConfig) -> JobPinned:
    return cluster_pin()


def store_dir(config: CoordinatorConfig) -> Path:
    """Where the cluster's own log lives; each job's is under ``jobs/<id>/``."""
    return config.state_dir / "cluster"


def job_path(parent: Path, job_id: str) -> Path:
    """``parent / job_id``, only for an id that is one safe path component (jobs.check_job_id:
    no "/", no "..", no leading "." or "-"), so no job's files land outside ``parent``. A log
    written before ids were checked may name another: that job is refused, nothing opened."""
    try:
        check_job_id(job_id)
    except RendezvousError as exc:
        raise StateRefused(f"job {shown(job_id)} cannot have files under {parent}: {exc.message}") from None
    return parent / job_id


def job_store_opener(config: CoordinatorConfig) -> JobStoreOpener:
    """Each job's log under ``<state>/jobs/<id>/``, its mark under ``marks/``."""

    def open_job_store(job: RendezvousConfig) -> Store:
        try:
            mark = DurableMark(job_path(_marks_dir(config), job.job_id), job.job_id)
            reset = reset_aside(config, job.job_id)
            if reset:  # never a fresh log (new ranks, same key) under a reset id
                raise StateRefused(
                    f"job {job.job_id!r}: its state was moved aside by --reset-state --job (mark now "
                    f"{reset}); it is not served again under this id"
                )
            return open_store(config.store_kind, state_dir=job_path(config.state_dir / "jobs", job.job_id),
                              job_id=job.job_id, pin=job_pin(job), mark=mark)
        except (StoreResourcesError, StateRefused):
            raise  # out of descriptors, space or memory: the job's state is intact
        except StoreError as exc:
            raise StateRefused(str(exc)) from None
        except OSError as exc:  # the marks directory itself
            if exhausted(exc):
                raise StoreResourcesError(f"job {job.job_id!r}: {exc}") from None
            raise StateRefused(f"job {job.job_id!r}: {exc}") from None

    return open_job_store


def reset_aside(config: CoordinatorConfig, job_id: str) -> Optional[Path]:
    """The mark ``--reset-state --job`` moved aside for ``job_id`` (its witness), if the
    job has no mark since; None otherwise."""
    try:
        mark = job_path(_marks_dir(config), job_id)
    except StateRefused:
        return None
    if mark.exists():
        return None
    moved = sorted(mark.parent.glob(f"{mark.name}{RESET_SUFFIX}*"))
    return moved[-1] if moved else None


def job_store_dropper(config: CoordinatorConfig) -> Callable[[str], None]:
    """Deletes an ended job's own log directory, then its mark (a missing one is fine:
    a crash between the two is finished by the next prune)."""

    def drop_job_store(job_id: str) -> None:
        if config.store_kind != "sqlite":
            return
        shutil.rmtree(config.state_dir / "jobs" / job_id, ignore_errors=True)
        (_marks_dir(config) / job_id).unlink(missing_ok=True)

    return drop_job_store


LEGACY_LOG = "state.sqlite3"  # <state>/state.sqlite3: a single-job coordinator's log before #22


def legacy_state(config: CoordinatorConfig) -> list[Path]:
    """The files of a single-job state directory of the old layout (its log in
    ``<state>/state.sqlite3``, its mark in ``<keys>/durable-mark``) that exist."""
    log_file = config.state_dir / LEGACY_LOG
    paths = [log_file.with_name(log_file.name + suffix) for suffix in ("", "-wal", "-shm")]
    return [path for path in paths + [config.keys_dir / MARK_FILE] if path.exists()]


def refuse_single_job_state(config: CoordinatorConfig) -> None:
    """A single-job state directory of the old layout is never read as something else (an
    empty cluster): refused by name, left as found, whatever the config declares."""
    found = legacy_state(config) if config.store_kind == "sqlite" else []
    if found:
        raise StateRefused(
            f"{found[0]} is the state of a single-job coordinator of the old layout (meshgate before the "
            f"cluster served every config); this version keeps the cluster's log in {store_dir(config)} and "
            f"each job's in {config.state_dir / 'jobs'}/<id>, and does not read it as anything else. To keep "
            "serving that job: `meshgate-coordinator --config CONFIG --migrate-state` with the config that "
            "wrote it (its [job] id and [plan]); or move it aside with --reset-state"
        )


class TermEnd(enum.Enum):
    STOPPED = "stopped"  # SIGTERM / SIGINT: the process ends, exit 0
    STORE_FAILED = "store failed"  # a disk store failed: the process ends, exit 2
    STEPPED_DOWN = "stepped down"  # HA: back to standby, campaign again


@dataclass(frozen=True)
class Backoff:
    """Delays between reconnect attempts: doubling from ``first_s`` up to ``max_s``."""

    first_s: float = 0.2
    max_s: float = 5.0

    def delay(self, attempt: int) -> float:
        return min(self.max_s, self.first_s * (2 ** min(attempt, 16)))


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except asyncio.TimeoutError:
        pass


HealthUpdate = Callable[[], Awaitable[object]]


def _start_refused(config: CoordinatorConfig, exc: RendezvousError) -> StoreError:
    """Why the cluster could not start: the declared job's log (its message names the
    file), or the cluster's log and the config disagree on the declared job."""
    if exc.code is Code.UNAVAILABLE:
        return StoreResourcesError(exc.message)
    if exc.code is Code.DATA_LOSS:
        return StateRefused(exc.message)
    return StateRefused(f"the cluster's log in {store_dir(config)}: {exc.message}")


async def serve_term(
    config: CoordinatorConfig, slot: CoordinatorSlot, store: Store, keys: KeyRing, stop: asyncio.Event,
    health_update: HealthUpdate, open_job_store: JobStoreOpener, lease: Optional[Store] = None,
    on_serving: Callable[[], None] = lambda: None,
) -> tuple[TermEnd, Optional[BaseException]]:
    """Serve the cluster from ``store`` (already leading; ``lease``: the store whose
    leadership the term holds, when not ``store``) until stop, a store failure or lost
    leadership. ``health_update`` publishes the health at once when the term starts and ends;
    ``on_serving`` runs once the cluster serves (its declared job declared and opened)."""
    failed = asyncio.Event()
    failure: list[BaseException] = []

    def store_failed(exc: BaseException) -> None:
        failure.append(exc)
        failed.set()

    cluster = ClusterCoordinator(
        store, keys, open_job_store,
        attestation_ttl_s=config.attestation_ttl_s,
        heartbeat_timeout_s=config.heartbeat_timeout_s,
        require_vouch=config.require_vouch,
        on_store_failure=store_failed,
        drop_job_store=job_store_dropper(config),
        retention_s=config.retention_s,
        declared=config.declared,
        reset_aside=lambda job_id: reset_aside(config, job_id) is not None,
    )
    try:
        await cluster.start()
    except RendezvousError as exc:
        cluster.close()
        raise _start_refused(config, exc) from None
    slot.coordinator = cluster
    on_serving()
    await health_update()
    log.info("serving jobs: %d known, %d nodes", len(cluster.state.jobs), len(cluster.state.nodes))
    for spec, _ in config.declared:
        log.info("serving job %s (%s), declared by the config", spec.job_id, spec.plan.describe())
    sweeper = asyncio.create_task(cluster.run(config.heartbeat_interval_s / 2))
    watchers = [asyncio.create_task(stop.wait()), asyncio.create_task(failed.wait())]
    lost = (lease or store).leadership_lost()
    if lost is not None:
        watchers.append(asyncio.create_task(lost.wait()))
    try:
        await asyncio.wait(watchers, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for watcher in watchers:
            watcher.cancel()
        sweeper.cancel()
        cluster.close()
        if failed.is_set():
            await health_update()  # NOT_SERVING naming coordinator.store, while it is still the leader
        slot.coordinator = None  # from here on every call is answered UNAVAILABLE
        await health_update()
    if lost is not None and (lost.is_set() or failed.is_set()):
        return TermEnd.STEPPED_DOWN, (failure[0] if failure else StoreError("lost the etcd leadership"))
    if failed.is_set():
        return TermEnd.STORE_FAILED, failure[0]
    return TermEnd.STOPPED, None


async def serve_embedded(
    config: CoordinatorConfig, slot: CoordinatorSlot, keys: KeyRing, stop: asyncio.Event,
    on_connected: Callable[[], None], health_update: HealthUpdate,
) -> None:
    """SQLite or memory: one term; a store failure ends the process."""
    job_logs = DeclaredFirst(config, job_store_opener(config))
    try:
        refuse_single_job_state(config)
        job_logs.open_existing()
        store = open_store(
            config.store_kind, state_dir=store_dir(config), job_id=config.log_id,
            pin=log_pin(config), mark=durable_mark(config),
        )
    except StoreResourcesError:
        job_logs.close()
        raise  # not a state to refuse or reset: the message says to free space or descriptors
    except StateRefused:
        job_logs.close()
        raise
    except StoreError as exc:
        job_logs.close()
        raise StateRefused(str(exc)) from None
    try:
        end, failure = await serve_term(config, slot, store, keys, stop, health_update, job_logs,
                                        on_serving=on_connected)
    finally:
        job_logs.close()
        store.close()
    if end is TermEnd.STORE_FAILED:
        raise StoreError(f"stopped after a store failure: {failure}")


class DeclaredFirst:
    """A job store opener that opens the declared job's log, when it has one, before the
    cluster's log is touched: a refused one then leaves every file as found (opening and
    closing the cluster's log would checkpoint its WAL). The cluster takes the open log."""

    def __init__(self, config: CoordinatorConfig, open_job_store: JobStoreOpener) -> None:
        self.config = config
        self.open_job_store = open_job_store
        self.opened: dict[str, Store] = {}

    def open_existing(self) -> None:
        for _, job in self.config.declared:
            known = (job_path(self.config.state_dir / "jobs", job.job_id).exists()
                     or (self.config.keys_dir / "marks" / job.job_id).exists())
            if known:
                self.opened[job.job_id] = self.open_job_store(job)

    def __call__(self, job: RendezvousConfig) -> Store:
        store = self.opened.pop(job.job_id, None)
        return store if store is not None else self.open_job_store(job)

    def close(self) -> None:
        """Close what no cluster took (a start refused after it was opened)."""
        for store in self.opened.values():
            store.close()
        self.opened.clear()


async def serve_ha(
    config: CoordinatorConfig,
    slot: CoordinatorSlot,
    keys: KeyRing,
    stop: asyncio.Event,
    address: str,
    on_connected: Callable[[], None],
    health_update: HealthUpdate,
    backoff: Optional[Backoff] = None,
) -> None:
    """etcd: stand by, campaign, lead; when etcd goes away, step down and start over.
    Reconnects back off from 0.2 s up to half a lease TTL (at most 5 s), so that once etcd
    is back a coordinator leads again within two TTLs: one wait to reconnect, and the old
    leader's restored lease running out."""
    if backoff is None:
        backoff = Backoff(max_s=min(5.0, max(config.lease_ttl_s / 2, 0.2)))
    from meshgate.coordinator.store.etcd import EtcdStore, EtcdUnavailable

    attempt = 0
    while not stop.is_set():
        declared = config.rendezvous  # etcd serves a config that declares a job, so far
        store = EtcdStore(
            config.etcd_endpoints, job_pin(declared), config.advertise or address,
            config.lease_ttl_s, DurableMark(job_path(_marks_dir(config), declared.job_id), declared.job_id),
        )
        try:
            await store.connect()
            slot.leader_hint = await store.current_leader()
            on_connected()
            try:
                if not await _campaign(config, slot, store, stop):
                    return  # stopped while standing by
            except EtcdUnavailable:
                raise
            except StoreError as exc:  # the log in etcd cannot be trusted: never retried
                raise StateRefused(str(exc)) from None
            attempt = 0
            # So far the declared job's log is the one in etcd; the cluster's is kept in memory
            # and written afresh each term (it holds no more than the declaration).
            end, failure = await serve_term(
                config, slot, MemoryStore(), keys, stop, health_update, _only_declared(declared, store), lease=store
            )
            if end is TermEnd.STOPPED:
                return
            log.warning("stepping down to standby: %s", failure)
        except EtcdUnavailable as exc:
            log.warning("etcd unavailable (%s); standing by, retrying in %.1fs", exc, backoff.delay(attempt))
        finally:
            slot.coordinator = None
            await store.aclose()
        await _wait(stop, backoff.delay(attempt))
        attempt += 1


def _only_declared(declared: RendezvousConfig, store: Store) -> JobStoreOpener:
    """etcd holds the declared job's log only, so far: a submitted job's is refused (it fails, naming why)."""

    def open_job_store(job: RendezvousConfig) -> Store:
        if job.job_id != declared.job_id:
            raise StateRefused(f"job {job.job_id!r}: on etcd this coordinator serves only its config's job so far")
        return store

    return open_job_store


async def _campaign(config: CoordinatorConfig, slot: CoordinatorSlot, store, stop: asyncio.Event) -> bool:
    """Follow the leader (for the UNAVAILABLE hint) while campaigning; True once leading."""

    async def follow_leader() -> None:
        while True:
            slot.leader_hint = await store.current_leader()
            await asyncio.sleep(max(config.lease_ttl_s / 4, 0.2))

    follower = asyncio.create_task(follow_leader())
    campaign = asyncio.create_task(store.campaign(stop))
    try:
        log.info("standby for job %s; leader is %s", config.log_id, slot.leader_hint or "none yet")
        # Whichever ends first: winning (or stop), or etcd failing under the follower.
        done, _ = await asyncio.wait({follower, campaign}, return_when=asyncio.FIRST_COMPLETED)
        if campaign in done:
            return campaign.result()
        follower.result()  # raises EtcdUnavailable: etcd went away while standing by
        raise AssertionError("unreachable: the follower only ends by raising")
    finally:
        follower.cancel()
        campaign.cancel()
        await asyncio.gather(follower, campaign, return_exceptions=True)

