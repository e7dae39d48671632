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
from typing import TYPE_CHECKING, Awaitable, Callable, Iterable, Optional

from meshgate.coordinator.cluster import ClusterCoordinator, JobStoreOpener
from meshgate.coordinator.config import CoordinatorConfig
from meshgate.coordinator.keys import KeyRing
from meshgate.coordinator.jobs import JobAllocated, JobSubmitted, JobSummarized, check_job_id
from meshgate.coordinator.rendezvous import Code, Event, RendezvousConfig, RendezvousError, shown
from meshgate.coordinator.service import CoordinatorSlot
from meshgate.coordinator.resources import exhausted
from meshgate.coordinator.store import Store, StoreError, StoreResourcesError, open_store
from meshgate.coordinator.store.codec import JobPinned, cluster_pin, job_pin
from meshgate.coordinator.store.mark import FILE_NAME as MARK_FILE
from meshgate.coordinator.store.mark import DurableMark

if TYPE_CHECKING:
    from meshgate.coordinator.store.etcd import EtcdJobLogs, EtcdLog, EtcdSession

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


def etcd_root(config: CoordinatorConfig) -> str:
    """Where the cluster's state lives in etcd: under ``/meshgate/cluster/`` its log, its
    leader key, and every job's log under ``jobs/<id>/`` (a declared job's too)."""
    return f"/meshgate/{config.log_id}/"


def etcd_reset(config: CoordinatorConfig, job_id: str = "") -> str:
    """How to start an etcd state (or one job's, ``job_id``) afresh by hand: --reset-state
    deletes nothing in etcd."""
    root, marks = etcd_root(config), config.keys_dir / "marks"
    if job_id:
        return (
            f"once job {job_id} has ended, delete etcd prefix {root}jobs/{job_id}/ (etcdctl del --prefix) and "
            f"move {marks / job_id} aside as {job_id}{RESET_SUFFIX}<time> on every coordinator host"
        )
    return (
        f"with every coordinator stopped, delete etcd prefix {root} (etcdctl del --prefix {root}), move "
        f"{marks} aside and provision a new signing key on every coordinator host"
    )


def job_store_opener(config: CoordinatorConfig, job_logs: Optional["EtcdJobLogs"] = None) -> JobStoreOpener:
    """Each job's log (under ``<state>/jobs/<id>/``, or in etcd through ``job_logs``), its
    mark under ``marks/``."""

    def open_log(job: RendezvousConfig, mark: DurableMark) -> Store:
        if job_logs is not None:
            return job_logs.open(job_pin(job), mark)
        return open_store(
            config.store_kind,
            state_dir=job_path(config.state_dir / "jobs", job.job_id),
            job_id=job.job_id,
            pin=job_pin(job),
            mark=mark,
        )

    def open_job_store(job: RendezvousConfig) -> Store:
        try:
            mark = DurableMark(job_path(_marks_dir(config), job.job_id), job.job_id)
            reset = reset_aside(config, job.job_id)
            if reset:  # never a fresh log (new ranks, same key) under a reset id
                raise StateRefused(
                    f"job {job.job_id!r}: its state was moved aside by --reset-state --job (mark now "
                    f"{reset}); it is not served again under this id"
                )
            return open_log(job, mark)
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
    # a prefix match, not a glob: a glob compiles (and caches) a pattern per job id
    prefix = f"{mark.name}{RESET_SUFFIX}"
    moved = sorted(p for p in mark.parent.iterdir() if p.name.startswith(prefix))
    return moved[-1] if moved else None


def job_store_dropper(config: CoordinatorConfig, job_logs: Optional["EtcdJobLogs"] = None) -> Callable[[str], None]:
    """Deletes an ended job's own log (its directory, or its etcd prefix), then its mark (a
    missing one is fine: a crash between the two is finished by the next prune). An etcd
    delete that fails is UNAVAILABLE: nothing is recorded as pruned, and the term ends."""

    def drop_job_store(job_id: str) -> None:
        if job_logs is not None:
            try:
                job_logs.drop(job_id)
            except StoreError as exc:
                raise RendezvousError(Code.UNAVAILABLE, f"job {job_id!r}: its log was not deleted: {exc}") from None
        elif config.store_kind == "sqlite":
            shutil.rmtree(config.state_dir / "jobs" / job_id, ignore_errors=True)
        else:
            return
        (_marks_dir(config) / job_id).unlink(missing_ok=True)

    return drop_job_store


def job_logs_in_use(events: Iterable[Event]) -> set[str]:
    """The jobs whose own log a new term may read, from the cluster's log: those allocated
    or declared, and not summarized (running, or ended before their summary was written). A
    pending job has no log yet, and a summarized one is read from its summary."""
    opened = {
        event.job_id
        for event in events
        if isinstance(event, JobAllocated) or (isinstance(event, JobSubmitted) and event.declared)
    }
    return opened - {event.job_id for event in events if isinstance(event, JobSummarized)}


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
    if config.store_kind == "etcd":
        refuse_single_job_etcd_state(config)
    found = legacy_state(config) if config.store_kind == "sqlite" else []
    if found:
        raise StateRefused(
            f"{found[0]} is the state of a single-job coordinator of the old layout (meshgate before the "
            f"cluster served every config); this version keeps the cluster's log in {store_dir(config)} and "
            f"each job's in {config.state_dir / 'jobs'}/<id>, and does not read it as anything else. To keep "
            "serving that job: `meshgate-coordinator --config CONFIG --migrate-state` with the config that "
            "wrote it (its [job] id and [plan]); or move it aside with --reset-state"
        )


def refuse_single_job_etcd_state(config: CoordinatorConfig) -> None:
    """An HA pair of the old layout kept one job's log under ``/meshgate/<job>/`` and its mark
    in ``<keys>/durable-mark`` (the keys directory the coordinators share): that mark says so,
    and the cluster under ``/meshgate/cluster/`` never starts afresh beside it."""
    legacy_mark = config.keys_dir / MARK_FILE
    if legacy_mark.exists():
        raise StateRefused(
            f"{legacy_mark} is the mark of a single-job HA coordinator of the old layout (its log under etcd "
            f"prefix /meshgate/<job>/); this version keeps the cluster's state under {etcd_root(config)} and "
            "does not start afresh beside it. Finish that job with the version that wrote it, then, with every "
            f"coordinator stopped, delete its etcd prefix and move {legacy_mark} aside"
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
    config: CoordinatorConfig,
    slot: CoordinatorSlot,
    store: Store,
    keys: KeyRing,
    stop: asyncio.Event,
    health_update: HealthUpdate,
    open_job_store: JobStoreOpener,
    drop_job_store: Callable[[str], None],
    on_serving: Callable[[], None] = lambda: None,
) -> tuple[TermEnd, Optional[BaseException]]:
    """Serve the cluster from ``store`` (already leading) until stop, a store failure or lost
    leadership. ``health_update`` publishes the health at once when the term starts and ends;
    ``on_serving`` runs once the cluster serves (its declared job declared and opened)."""
    failed = asyncio.Event()
    failure: list[BaseException] = []

    def store_failed(exc: BaseException) -> None:
        failure.append(exc)
        failed.set()

    cluster = ClusterCoordinator(
        store,
        keys,
        open_job_store,
        attestation_ttl_s=config.attestation_ttl_s,
        heartbeat_timeout_s=config.heartbeat_timeout_s,
        heartbeat_interval_s=config.heartbeat_interval_s,
        require_vouch=config.require_vouch,
        on_store_failure=store_failed,
        drop_job_store=drop_job_store,
        retention_s=config.retention_s,
        launch_deadline_s=config.launch_deadline_s,
        declared=config.declared,
        quotas=config.quotas,
        quarantine=config.quarantine,
        ended_jobs_kept=config.ended_jobs_kept,
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
    lost = store.leadership_lost()
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
    config: CoordinatorConfig,
    slot: CoordinatorSlot,
    keys: KeyRing,
    stop: asyncio.Event,
    on_connected: Callable[[], None],
    health_update: HealthUpdate,
) -> None:
    """SQLite or memory: one term; a store failure ends the process."""
    job_logs = DeclaredFirst(config, job_store_opener(config))
    try:
        refuse_single_job_state(config)
        job_logs.open_existing()
        store = open_store(
            config.store_kind,
            state_dir=store_dir(config),
            job_id=config.log_id,
            pin=log_pin(config),
            mark=durable_mark(config),
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
        end, failure = await serve_term(
            config, slot, store, keys, stop, health_update, job_logs, job_store_dropper(config), on_serving=on_connected
        )
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
            known = (
                job_path(self.config.state_dir / "jobs", job.job_id).exists()
                or (self.config.keys_dir / "marks" / job.job_id).exists()
            )
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
    leader's restored lease running out. One session (client, lease, leader key) per term
    holds the cluster's log and every job's log, each write fenced on that leader key."""
    if backoff is None:
        backoff = Backoff(max_s=min(5.0, max(config.lease_ttl_s / 2, 0.2)))
    from meshgate.coordinator.store.etcd import EtcdLog, EtcdSession, EtcdUnavailable

    refuse_single_job_state(config)
    attempt = 0
    while not stop.is_set():
        session = EtcdSession(config.etcd_endpoints, etcd_root(config), config.advertise or address, config.lease_ttl_s)
        own_log = EtcdLog(session, session.root, log_pin(config), durable_mark(config))
        job_logs: Optional["EtcdJobLogs"] = None
        try:
            await session.connect()
            slot.leader_hint = await session.current_leader()
            on_connected()
            if not await _campaign(config, slot, session, stop):
                return  # stopped while standing by
            job_logs = await _read_logs(config, session, own_log)
            attempt = 0
            end, failure = await serve_term(
                config,
                slot,
                own_log,
                keys,
                stop,
                health_update,
                job_store_opener(config, job_logs),
                job_store_dropper(config, job_logs),
            )
            if end is TermEnd.STOPPED:
                return
            log.warning("stepping down to standby: %s", failure)
        except EtcdUnavailable as exc:
            log.warning("etcd unavailable (%s); standing by, retrying in %.1fs", exc, backoff.delay(attempt))
        finally:
            slot.coordinator = None
            if job_logs is not None:
                job_logs.close()
            own_log.close()
            await session.aclose()
        await _wait(stop, backoff.delay(attempt))
        attempt += 1


async def _read_logs(config: CoordinatorConfig, session: "EtcdSession", own_log: "EtcdLog") -> "EtcdJobLogs":
    """A new leader reads the cluster's log and the log of every job it will reopen. A log
    that cannot be trusted is refused for good (a job's own log: that job alone, when it is
    opened)."""
    from meshgate.coordinator.store.etcd import EtcdJobLogs, EtcdUnavailable

    try:
        await own_log.read()
        job_logs = EtcdJobLogs(session, job_logs_in_use(own_log.load()))
        await job_logs.prefetch()
        return job_logs
    except EtcdUnavailable:
        raise
    except StoreError as exc:  # the log in etcd cannot be trusted: never retried
        raise StateRefused(str(exc)) from None


async def _campaign(
    config: CoordinatorConfig, slot: CoordinatorSlot, session: "EtcdSession", stop: asyncio.Event
) -> bool:
    """Follow the leader (for the UNAVAILABLE hint) while campaigning; True once leading."""

    async def follow_leader() -> None:
        while True:
            slot.leader_hint = await session.current_leader()
            await asyncio.sleep(max(config.lease_ttl_s / 4, 0.2))

    follower = asyncio.create_task(follow_leader())
    campaign = asyncio.create_task(session.campaign(stop))
    try:
        log.info("standby for %s; leader is %s", session.root, slot.leader_hint or "none yet")
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
