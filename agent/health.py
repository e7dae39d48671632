"""The node's health check ([agent.health_check], issue #30): a command the agent runs,
or a node health service it asks (NVIDIA's nvhcd: ``nvhcd.HealthCheckService/RunHealthCheck``
over a Unix socket, meshgate/v1/nvhcd.proto, as NVRx's ft_launcher asks it before every
rendezvous), before its first Join, before the node takes a job after one that failed, and
every ``interval_s`` while idle. Its result rides on the Join and on every heartbeat
(nodes.proto NodeHealth); the coordinator holds a failing node out of allocation
(`unhealthy`, with the summary) until a check passes again.

A check that cannot run (not found, not executable; a service that does not answer, or
answers that it could not run its check) is decided by ``on_error``: "fail"
(the default: fail closed, the node takes no job) or "pass"; either way it is logged once
per distinct error and its summary says so. A check that outlives ``timeout_s`` is killed
(its whole process group) and fails. The decision (``judge``) is pure.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from meshgate.v1 import nodes_pb2

log = logging.getLogger("meshgate.agent")

MAX_SUMMARY = 512  # NodeHealth.summary: one line, at most this many bytes
MAX_OUTPUT = 64 << 10  # what is read of a check's output; the rest is drained and dropped
ON_ERROR = ("fail", "pass")


class HealthConfigError(ValueError):
    pass


@dataclass(frozen=True)
class HealthCheckConfig:
    command: tuple[str, ...] = ()  # a check to run, or ...
    timeout_s: float = 60.0
    interval_s: float = 300.0  # while idle; 0: only before the first Join and after a failed job
    on_error: str = "fail"  # a check that cannot run: "fail" (closed) or "pass"
    service: str = ""  # ... the Unix socket of a health service (nvhcd) to ask
    args: tuple[str, ...] = ()  # HealthCheckRequest.args for the service

    @classmethod
    def from_mapping(cls, table: Any) -> "HealthCheckConfig":
        if not isinstance(table, Mapping):
            raise HealthConfigError(
                f'[agent] health_check must be a table, e.g. health_check = {{command = ["/usr/local/bin/check"]}}, '
                f"got {table!r}"
            )
        unknown = sorted(set(table) - {"command", "service", "args", "timeout_s", "interval_s", "on_error"})
        if unknown:
            raise HealthConfigError(f"[agent] health_check: unknown key(s) {unknown}")
        if ("command" in table) == ("service" in table):
            raise HealthConfigError(
                "[agent] health_check needs one of command (a check to run) and service (the Unix socket of a "
                'node health service, e.g. service = "/run/nvhcd/nvhcd.sock"), not both'
            )
        command, service = table.get("command", ()), table.get("service", "")
        if "command" in table and (
            not isinstance(command, list) or not command or not all(isinstance(a, str) and a for a in command)
        ):
            raise HealthConfigError(
                f"[agent] health_check command must be a non-empty list of strings, got {command!r}"
            )
        if "service" in table and (not isinstance(service, str) or not service.removeprefix("unix:").startswith("/")):
            raise HealthConfigError(
                f"[agent] health_check service must be the absolute path of a Unix socket, got {service!r}"
            )
        args = table.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args) or (args and not service):
            raise HealthConfigError(
                f"[agent] health_check args (for a service) must be a list of strings, got {args!r}"
            )
        numbers = {}
        for key, default, least in (("timeout_s", 60.0, 0.001), ("interval_s", 300.0, 0.0)):
            value = table.get(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < least:
                raise HealthConfigError(f"[agent] health_check {key} must be a number >= {least:g}, got {value!r}")
            numbers[key] = float(value)
        on_error = table.get("on_error", "fail")
        if on_error not in ON_ERROR:
            raise HealthConfigError(f'[agent] health_check on_error must be "fail" or "pass", got {on_error!r}')
        return cls(
            tuple(command),
            numbers["timeout_s"],
            numbers["interval_s"],
            on_error,
            service.removeprefix("unix:"),
            tuple(args),
        )


def one_line(output: bytes) -> str:
    """A check's output as one bounded line: its last non-empty lines, newest last."""
    text = output.decode("utf-8", "replace")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = " | ".join(lines[-4:])
    return line if len(line) <= MAX_SUMMARY else "..." + line[-(MAX_SUMMARY - 3) :]


def judge(
    exit_code: Optional[int], output: bytes, timed_out: bool, error: str, on_error: str, timeout_s: float
) -> nodes_pb2.NodeHealth:
    """What a check run comes to. ``error``: why it could not run ("" when it ran)."""
    if error:
        passed = on_error == "pass"
        what = 'passes by on_error = "pass"' if passed else 'fails closed (on_error = "fail")'
        return nodes_pb2.NodeHealth(
            passed=passed, summary=f"the health check could not run: {error}; {what}"[:MAX_SUMMARY]
        )
    if timed_out:
        return nodes_pb2.NodeHealth(
            passed=False, summary=f"the health check ran past timeout_s={timeout_s:g} and was killed"[:MAX_SUMMARY]
        )
    said = one_line(output)
    if exit_code == 0:
        return nodes_pb2.NodeHealth(passed=True, summary=said or "exit 0")
    how = f"exit {exit_code}" if exit_code is not None and exit_code >= 0 else f"killed by signal {-(exit_code or 0)}"
    return nodes_pb2.NodeHealth(passed=False, summary=f"{how}: {said}"[:MAX_SUMMARY] if said else how)


async def ask_service(
    socket_path: str, args: tuple[str, ...], timeout_s: float
) -> tuple[Optional[int], bytes, bool, str]:
    """One RunHealthCheck of the node health service on ``socket_path``, as a run of a
    command: (exit code, output, timed out, why it could not run)."""
    import grpc

    from meshgate.v1 import nvhcd_pb2, nvhcd_pb2_grpc

    async with grpc.aio.insecure_channel(f"unix:{socket_path}") as channel:  # a local socket: its mode guards it
        try:
            answer = await nvhcd_pb2_grpc.HealthCheckServiceStub(channel).RunHealthCheck(
                nvhcd_pb2.HealthCheckRequest(args=list(args)), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return None, b"", True, ""
            return None, b"", False, f"health service {socket_path}: {exc.code().name}: {exc.details()}"
    if answer.error and not answer.success:  # it could not run its check
        return None, b"", False, f"health service {socket_path}: {answer.error}"
    code = 0 if answer.success else (answer.exit_code or 1)
    return code, answer.output.encode(), False, ""


class HealthCheck:
    """The configured check (None: this node runs none; report() is then None) and its
    latest result."""

    def __init__(self, config: Optional[HealthCheckConfig]) -> None:
        self.config = config
        self.latest: Optional[nodes_pb2.NodeHealth] = None
        self.errors_logged: set[str] = set()  # a check that cannot run is logged once per error
        self.lock = asyncio.Lock()  # one run at a time (the idle loop and a job's end)
        self.seq = 0  # checks begun by this agent instance (NodeHealth.seq)
        self.wanted = asyncio.Event()  # the coordinator asked for a check now (an uncordon waits)
        self.heard = False  # asked, and no check has begun since (the next one answers it)

    def report(self) -> Optional[nodes_pb2.NodeHealth]:
        return self.latest

    async def check(self, why: str) -> Optional[nodes_pb2.NodeHealth]:
        """Run the check now (``why``: when, for the log) and keep its result."""
        if self.config is None:
            return None
        async with self.lock:
            self.seq += 1  # numbered as it begins: one begun before an ask does not answer it
            seq, asked, self.heard = self.seq, self.heard, False
            exit_code, output, timed_out, error = await self._run()
        result = judge(exit_code, output, timed_out, error, self.config.on_error, self.config.timeout_s)
        result.seq, result.asked = seq, asked
        if error and error not in self.errors_logged:
            self.errors_logged.add(error)
            log.error("%s", result.summary)
        elif not result.passed and (self.latest is None or self.latest.passed):
            log.warning("health check failed (%s): %s; this node takes no job until it passes", why, result.summary)
        elif result.passed and self.latest is not None and not self.latest.passed:
            log.info("health check passes again (%s)", why)
        self.latest = result
        return result

    async def _run(self) -> tuple[Optional[int], bytes, bool, str]:
        assert self.config is not None
        if self.config.service:
            return await ask_service(self.config.service, self.config.args, self.config.timeout_s)
        try:
            process = await asyncio.create_subprocess_exec(
                *self.config.command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # its own group: a timeout kills what it started too
            )
        except OSError as exc:
            return None, b"", False, f"{self.config.command[0]}: {exc.strerror or exc}"
        output = bytearray()

        async def read() -> None:
            while chunk := await process.stdout.read(8192):
                if len(output) < MAX_OUTPUT:
                    output.extend(chunk[: MAX_OUTPUT - len(output)])

        try:
            await asyncio.wait_for(asyncio.gather(read(), process.wait()), self.config.timeout_s)
        except asyncio.TimeoutError:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await process.wait()
            return process.returncode, bytes(output), True, ""
        return process.returncode, bytes(output), False, ""

    async def until_passing(self, stopping: asyncio.Event, why: str, must_pass: bool) -> None:
        """Check; ``must_pass`` (a declared job's node, whose Join places it in its job):
        while it fails, check again each interval (1..60 s), never Joining failing. A pool
        node Joins the cluster either way, its result on the Join: `unhealthy`, never allocated."""
        while not stopping.is_set():
            result = await self.check(why)
            if result is None or result.passed or not must_pass:
                return
            try:
                await asyncio.wait_for(stopping.wait(), timeout=max(min(self.config.interval_s or 5.0, 60.0), 1.0))
            except asyncio.TimeoutError:
                pass

    def ask(self) -> None:
        """The coordinator wants a check run now (NodeHeartbeatResponse.run_health_check: an
        operator's uncordon waits for one); the idle loop runs it at once."""
        if self.config is not None:
            self.heard = True
            self.wanted.set()

    async def while_idle(self, stopping: asyncio.Event, idle: Callable[[], bool]) -> None:
        """Every interval_s while ``idle()`` (0: never periodically), and whenever asked
        (``ask``): the heartbeats carry the latest result."""
        if self.config is None:
            return
        interval = self.config.interval_s or None
        last = time.monotonic()
        while not stopping.is_set():
            timeout = None if interval is None else max(last + interval - time.monotonic(), 0.0)
            waits = [asyncio.ensure_future(stopping.wait()), asyncio.ensure_future(self.wanted.wait())]
            try:
                await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiting in waits:
                    waiting.cancel()
            asked = self.wanted.is_set()
            self.wanted.clear()
            if not stopping.is_set() and idle():
                await self.check(
                    "asked by the coordinator (an uncordon waits for it)" if asked else "periodic, while idle"
                )
            last = time.monotonic()
