"""The node as the agent finds it, made once before the first Join: the job user and the
one privileged part (agent/launcher.py), the containment of the job runs, the workers'
route, the node's Ray labels. Jobs come and go; this stays, and with it what a job leaves on
the node until it is gone: the unit of the workers launched now, the units that did not empty
when killed, the master port offered at Join, the job's directory.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Optional

from meshgate.agent.adopted import Adopted
from meshgate.agent.inventory import GpusUnreadable, Inventory, MachineIdUnreadable, hardware_message, read_inventory
from meshgate.agent.config import AgentConfig
from meshgate.agent.containment import Containment, ContainmentError, ContainmentUnit, open_containment
from meshgate.agent.job_user import JobUser, JobUserError
from meshgate.agent.launcher import Launcher, LauncherError, clear_ambient_capabilities
from meshgate.agent.netif import InterfaceError, MasterReservation, Route, choose
from meshgate.agent.session import AgentError
from meshgate.agent.store_activation import StoreActivation, store_host_missing
from meshgate.launchers.local import DEFAULT_WORKER_ENV
from meshgate.launchers.ray_labels import ray_node_labels, write_labels_file
from meshgate.v1 import rendezvous_pb2

log = logging.getLogger("meshgate.agent")

UNIT_KILL_TIMEOUT_S = 30.0  # how long a killed containment unit may take to empty
# What of the agent's environment the store host keeps: how its interpreter finds its packages.
STORE_HOST_ENVS = ("PATH", "PYTHONPATH", "VIRTUAL_ENV", "LANG", "LC_ALL")


class NodeContext:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.job_user: Optional[JobUser] = None  # [agent] run_as, resolved in build()
        self.job_user_hold = None  # this agent's exclusive hold on the job user (JobUser.claim)
        # The one privileged part (agent/launcher.py): job directories, uid switch, sockets.
        self.privileged = Launcher(None, config.state_dir)
        self.containment: Optional[Containment] = None
        self.route: Optional[Route] = None  # chosen once, in build()
        self.unit: Optional[ContainmentUnit] = None  # the unit of the workers launched now
        self.lingering: list[ContainmentUnit] = []  # units that did not empty when killed
        self.adopted = Adopted(self.privileged)  # hand-started launchers and their workers (agent/adopted.py)
        # The master offered at Join: listening from the first Join, kept for the job's life
        # (the same endpoint at every Join), released when the job is over here.
        self.master_reservation: Optional[MasterReservation] = None
        # Node rank 0 of a per-slot job: the store host of the generation launched now,
        # started at the first connection to the master (agent/store_activation.py).
        self.store_activation: Optional[StoreActivation] = None
        self.inventory = Inventory("", (), (), "not read yet")  # the node's hardware, read in build()

    def hardware(self) -> rendezvous_pb2.NodeHardware:
        """The inventory as Join and an asked heartbeat carry it."""
        return hardware_message(self.inventory)

    async def build(self, coordinator: str) -> None:
        try:
            self.inventory = await asyncio.to_thread(read_inventory, self.config.machine_id_file)
        except (GpusUnreadable, MachineIdUnreadable) as exc:
            raise AgentError(str(exc)) from None
        log.info("hardware: %s", self.inventory.describe())
        missing = store_host_missing()
        if missing:
            log.warning("%s", missing)
        await self.contain()
        self.write_ray_labels()
        self.route = self.choose_route(coordinator)

    async def contain(self) -> None:
        """Before the first Join: the job user, the containment, and the units of this
        agent's earlier run killed (its workers must never hold ranks beside new ones)."""
        if self.config.run_as:
            try:
                self.job_user = JobUser.resolve(self.config.run_as)
                clear_ambient_capabilities()
            except (JobUserError, LauncherError) as exc:
                raise AgentError(str(exc)) from None
            self.privileged = Launcher(self.job_user, self.config.state_dir)
            log.info(
                "workers run as %s (uid %d, gid %d) in %s",
                self.job_user.name,
                self.job_user.uid,
                self.job_user.gid,
                self.job_user.workdir(),
            )
        self.containment = open_containment(self.config.node_id, self.config.cgroup_dir, self.config.state_dir)
        try:
            earlier = await asyncio.to_thread(self.containment.kill_earlier_units, UNIT_KILL_TIMEOUT_S)
        except (ContainmentError, OSError) as exc:
            raise AgentError(f"cannot kill the containment units of an earlier run: {exc}") from None
        for name, pids in earlier.items():
            log.warning(
                "killed containment unit %s of this agent's earlier run before joining (pids %s)",
                name,
                pids or "none: it was empty",
            )
        if self.job_user is not None:
            try:  # after the earlier run's units are dead: its jobs held the user
                self.job_user_hold = self.job_user.claim()
            except JobUserError as exc:
                raise AgentError(str(exc)) from None
        self.config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.job_user is not None:
            # The job user may pass through (its trust bundle, plan and sockets are here) but
            # not list it; the node key and credential inside stay 0600, the agent's alone.
            os.chmod(self.config.state_dir, 0o711)
        try:
            left = await asyncio.to_thread(self.privileged.remove_earlier_job_dirs)
        except (LauncherError, OSError) as exc:
            raise AgentError(f"cannot remove the job directories of an earlier run: {exc}") from None
        if left:
            log.warning("removed the directories of jobs %s left by this agent's earlier run", left)
        for path in self.config.job_paths:
            refusal = await asyncio.to_thread(self.privileged.job_user_may_write, path)
            if refusal is not None:
                raise AgentError(f"[agent] job_paths: {refusal}")

    def write_ray_labels(self) -> None:
        """This node's Ray labels (its node id, switch, rack) for `ray start --labels-file`,
        so RayTrainLauncher can place each worker on its meshgate rank's node."""
        if self.config.ray_labels_file is not None:
            labels = ray_node_labels(self.config.node_id, dict(self.config.labels))
            try:
                write_labels_file(self.config.ray_labels_file, labels)
            except OSError as exc:
                raise AgentError(f"cannot write [agent] ray_labels_file {self.config.ray_labels_file}: {exc}") from None
            log.info("Ray labels for this node in %s: %s", self.config.ray_labels_file, labels)

    def choose_route(self, coordinator: str) -> Route:
        """The workers' address and interface, once: from the config, else the route to the
        coordinator. Workers get it even behind fan-in, where they dial a Unix socket."""
        try:
            route = choose(
                coordinator,
                advertise_address=self.config.advertise_address,
                interface=self.config.interface,
            )
        except InterfaceError as exc:
            raise AgentError(f"cannot choose the workers' network: {exc}") from None
        log.info("workers advertise %s on interface %s (%s)", route.address, route.interface, route.source)
        return route

    # ---- what a job leaves on the node ---------------------------------------------------------

    def open_unit(self, job_id: str, generation: int) -> None:
        if self.containment is not None:
            self.unit = self.containment.create(job_id, generation)

    async def close_unit(self, why: str) -> None:
        """Kill every process of the current job run and wait until its unit is empty; a
        unit that does not empty stays listed in live_unit_jobs (the node stays out of the pool)."""
        self.stop_store_activation()  # its store host, if started, dies with the unit
        unit, self.unit = self.unit, None
        if unit is None:
            return
        try:
            killed = await asyncio.to_thread(unit.kill_and_wait, UNIT_KILL_TIMEOUT_S)
        except (ContainmentError, OSError) as exc:
            log.error("%s: %s; this node stays out of the pool while it holds a process", why, exc)
            self.lingering.append(unit)
            return
        log.info(
            "%s: containment unit %s of job %s generation %d is empty (killed pids %s)",
            why,
            unit.where,
            unit.job_id,
            unit.generation,
            killed or "none",
        )

    def live_unit_jobs(self) -> set[str]:
        """The jobs whose containment unit on this node may still hold a process: the
        current unit, and any not yet seen empty."""
        self.lingering = [u for u in self.lingering if not u.is_empty()]
        jobs = {u.job_id for u in self.lingering}
        if self.unit is not None and not self.unit.is_empty():
            jobs.add(self.unit.job_id)
        if self.adopted.alive():
            jobs.add(self.adopted.job_id)
        return jobs

    async def remove_job_dir(self, job_id: str) -> bool:
        """What the job left on this node, once its unit is empty (never while a process
        of it may still write there); what cannot be removed is said, and tried again at
        the agent's next start. False when it was not tried."""
        if self.unit is not None or not job_id or any(u.job_id == job_id for u in self.lingering):
            return False
        try:
            await asyncio.to_thread(self.privileged.remove_job_dir, job_id)
        except (LauncherError, OSError) as exc:
            log.error("job %s: its directory is not fully removed: %s", job_id, exc)
        return True

    def release(self) -> None:
        """The agent stops: the containment goes, unless a unit still holds a process."""
        if not self.lingering:
            self.containment.release()

    def reserve_master(self) -> Optional[MasterReservation]:
        """The master this node offers at Join (the same endpoint at every Join of the job:
        it is kept for the job's life); None before a route is chosen."""
        if self.master_reservation is None and self.route is not None:
            try:
                self.master_reservation = MasterReservation.reserve(self.route.address, dict(os.environ))
            except InterfaceError as exc:
                raise AgentError(str(exc)) from None
        return self.master_reservation

    def serve_store_on_demand(self, what: str) -> None:
        """Node rank 0 of a per-slot job whose workers started: its store host starts inside
        their unit once a worker connects to the held master (agent/store_activation.py)."""
        listener, unit = self.master_listener(), self.unit
        if listener is None:
            return
        self.stop_store_activation()
        env = {name: os.environ[name] for name in STORE_HOST_ENVS if name in os.environ}
        env.setdefault("PATH", "/usr/bin:/bin")
        env.update(DEFAULT_WORKER_ENV)  # the store reverse-resolves its clients: fail fast
        fd = listener.fileno()
        self.store_activation = StoreActivation(listener, lambda: self.privileged.start_store_host(fd, unit, env), what)
        self.store_activation.arm()

    def stop_store_activation(self) -> None:
        if self.store_activation is not None:
            self.store_activation.close()
            self.store_activation = None

    def master_listener(self) -> Optional[socket.socket]:
        """The listening socket of this node's master, for node rank 0's store host."""
        return None if self.master_reservation is None else self.master_reservation.listener

    def release_master(self) -> None:
        """The job is over here: its master's port goes (the next job's Join reserves anew)."""
        self.stop_store_activation()  # never close a descriptor the loop watches
        if self.master_reservation is not None:
            self.master_reservation.release()
            self.master_reservation = None
