"""The agent forks its workers while gRPC runs: with gRPC's fork support on, every forked child
restarts gRPC's threads between the fork and the exec, and one that wakes on a descriptor the child
has just closed aborts the worker before its command runs (exit -6; meshgate/grpc_fork.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from meshgate import grpc_fork
from meshgate.launchers.local import WorkerSpec

# Starts a gRPC server and a channel to it, forks, and reports how many threads the child has.
FORK_PROBE = textwrap.dedent(
    """
    import asyncio, os, sys
    if sys.argv[1] == "agent":
        import meshgate.agent.__main__  # what the meshgate-agent entry point runs first
    import grpc

    async def main():
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        await asyncio.wait_for(channel.channel_ready(), 10)
        pid = os.fork()
        if pid == 0:  # the window between a worker's fork and its exec
            os.write(1, str(len(os.listdir("/proc/self/task"))).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        await channel.close()
        await server.stop(None)

    asyncio.run(main())
    """
)


def threads_in_forked_child(how: str) -> int:
    env = grpc_fork.worker_environ()
    env.pop(grpc_fork.VARIABLE, None)
    done = subprocess.run([sys.executable, "-c", FORK_PROBE, how], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


def test_a_child_forked_by_the_agent_runs_no_grpc_thread_before_its_exec():
    assert threads_in_forked_child("agent") == 1


def test_without_it_grpc_restarts_its_threads_in_every_forked_child():
    # What the agent guards against, shown on the pinned gRPC: if this stops holding, gRPC no
    # longer restarts threads in a forked child and meshgate/grpc_fork.py can go.
    assert threads_in_forked_child("plain") > 1


@pytest.mark.parametrize(
    "operator, worker",
    [({}, None), ({grpc_fork.VARIABLE: "1"}, "1"), ({grpc_fork.VARIABLE: "0"}, "0")],
)
def test_a_worker_gets_grpc_fork_support_as_the_operator_left_it(operator, worker):
    agent_env = dict(operator, PATH="/usr/bin")
    assert grpc_fork.disable(agent_env) is ("grpc" not in sys.modules)
    if "grpc" in sys.modules:  # this test process has loaded gRPC; the agent's setting is simulated
        agent_env[grpc_fork.OPERATOR_VALUE] = operator.get(grpc_fork.VARIABLE, grpc_fork.UNSET)
        agent_env[grpc_fork.VARIABLE] = "0"
    env = grpc_fork.worker_environ(agent_env)
    assert env.get(grpc_fork.VARIABLE) == worker
    assert grpc_fork.OPERATOR_VALUE not in env and env["PATH"] == "/usr/bin"


def test_the_launcher_starts_workers_from_the_operators_environment(monkeypatch):
    monkeypatch.setenv(grpc_fork.OPERATOR_VALUE, grpc_fork.UNSET)
    monkeypatch.setenv(grpc_fork.VARIABLE, "0")
    spec = WorkerSpec(command=["true"], nprocs=1, coordinator="c:1", job_id="j", node_id="n", trust_bundle="t")
    env = spec.env_for(0)
    assert grpc_fork.VARIABLE not in env and grpc_fork.OPERATOR_VALUE not in env
