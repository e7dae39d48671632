"""One way to reach a coordinator (meshgate/connection.py).

Pure: how the settings are settled (arguments, then MESHGATE_*, then the client config
file's context), what each error names, and one read model (``job show`` renders a job's
rendezvous with the lines ``status`` renders). Real: ``meshgate job list`` against an mTLS
jobs-mode coordinator process with only MESHGATE_COORDINATOR and MESHGATE_TLS_* set, then
with only a client config file (and ``--context`` picking another context), and failover
past a dead address and a standby (a real TLS server that answers UNAVAILABLE naming the
leader).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from conftest import REPO
from meshgate import views
from meshgate.cli import main as meshgate_main
from meshgate.connection import ClientConfigError, Connection, RendezvousRefused, poll
from meshgate.endpoints import LEADER_METADATA_KEY
from meshgate.plan import ParallelPlan
from meshgate.tls import init_dev_ca, issue_cert, server_credentials
from meshgate.v1 import rendezvous_pb2 as pb

SETTINGS_ENV = (
    "MESHGATE_COORDINATOR",
    "MESHGATE_TLS_CA",
    "MESHGATE_TLS_CERT",
    "MESHGATE_TLS_KEY",
    "MESHGATE_TLS_SERVER_NAME",
    "MESHGATE_INSECURE",
    "MESHGATE_ADMIN_TOKEN",
    "MESHGATE_ADMIN_TOKEN_FILE",
    "MESHGATE_CONTEXT",
    "MESHGATE_CLIENT_CONFIG",
    "MESHGATE_JOB",
)


def clean_env(home: Path, **settings: str) -> dict[str, str]:
    """This process's environment with no meshgate settings but ``settings``, and a HOME of its own."""
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS_ENV and k != "XDG_CONFIG_HOME"}
    env.update(HOME=str(home), PYTHONPATH=str(REPO), **settings)
    return env


@pytest.fixture
def bare(monkeypatch, tmp_path):
    """No meshgate settings in this process's environment, and an empty HOME (no client config)."""
    for name in SETTINGS_ENV + ("XDG_CONFIG_HOME",):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    root = tmp_path_factory.mktemp("ca")
    dev = init_dev_ca(root / "tls", agent_names=("n0",))
    return dev, issue_cert(root / "tls", "submitter", "alice"), issue_cert(root / "tls", "submitter", "bob")


def write_client_config(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ---- settling the settings (no sockets) ---------------------------------------------------------


def test_no_settings_at_all_names_every_place_to_set_them(bare, capsys):
    for argv in (["job", "list"], ["status"], ["token", "create", "--any-node"]):
        assert meshgate_main(argv) == 2
        err = capsys.readouterr().err
        assert "coordinator is not set" in err and "--coordinator" in err and "MESHGATE_COORDINATOR" in err, err
        assert "client.toml" in err and "Socket closed" not in err
    assert meshgate_main(["job", "list", "--coordinator", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    for name in (
        "MESHGATE_TLS_CA",
        "MESHGATE_TLS_CERT",
        "MESHGATE_TLS_KEY",
        "MESHGATE_INSECURE=1",
        "--ca-file",
        "--insecure",
        str(Path(os.environ["HOME"]) / ".config" / "meshgate" / "client.toml"),
    ):
        assert name in err, (name, err)
    assert "Socket closed" not in err


def test_arguments_then_environment_then_the_config_files_context(bare, tmp_path, ca):
    dev, alice, bob = ca
    config = write_client_config(
        tmp_path / "xdg" / "meshgate" / "client.toml",
        f"""
current_context = "alice"
[contexts.alice]
coordinator = "head-a:7443,head-b:7443"
tls_ca = "{os.path.relpath(dev.ca, tmp_path / "xdg" / "meshgate")}"
tls_cert = "{alice.cert}"
tls_key = "{alice.key}"
[contexts.bob]
coordinator = "head-c:7443"
tls_ca = "{dev.ca}"
tls_cert = "{bob.cert}"
tls_key = "{bob.key}"
[contexts.dev]
coordinator = "127.0.0.1:7443"
insecure = true
""",
    )
    bare.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    from_file = Connection.resolve()
    assert from_file.endpoints.addresses == ["head-a:7443", "head-b:7443"]
    assert from_file.tls.ca_file.resolve() == dev.ca.resolve()  # a relative path is the file's directory's
    assert from_file.tls.cert_file == alice.cert and from_file.tls.key_file == alice.key
    assert f"context 'alice' in {config}" in from_file.source("coordinator")
    assert Connection.resolve({"context": "bob"}).tls.cert_file == bob.cert
    bare.setenv("MESHGATE_CONTEXT", "dev")
    assert Connection.resolve().tls is None and Connection.resolve({"context": "bob"}).coordinator == "head-c:7443"
    # the environment beats the file, the arguments beat both; the transport comes whole from one place
    bare.setenv("MESHGATE_COORDINATOR", "env-head:7443")
    bare.setenv("MESHGATE_TLS_CA", str(dev.ca))
    settled = Connection.resolve({"context": "alice"})
    assert settled.coordinator == "env-head:7443" and settled.source("coordinator") == "MESHGATE_COORDINATOR"
    assert settled.tls.ca_file == dev.ca and settled.tls.cert_file is None  # never alice's key beside the env's CA
    given = Connection.resolve({"coordinator": "arg:1", "tls": False})
    assert (given.coordinator, given.tls, given.source("transport")) == ("arg:1", None, "tls=")


@pytest.mark.parametrize(
    "text, needle",
    [
        ('current_context = "x"\n[contexts.x]\ncoordinator = "h:1"\ntls_kye = "k"\n', "unknown key(s) ['tls_kye']"),
        ('current_context = "nope"\n[contexts.x]\ncoordinator = "h:1"\n', "context 'nope' (from current_context"),
        ('current_context = "x"\n[contexts.x]\ncoordinator = 7\n', "coordinator must be a string"),
        (
            'current_context = "x"\n[contexts.x]\ncoordinator = "h:1"\ninsecure = true\ntls_ca = "ca.pem"\n',
            "insecure in context 'x'",
        ),
        ('current_context = "x"\n[contexts.x]\ncoordinator = "h:1"\ntls_cert = "a.pem"\n', "TLS needs the CA"),
        ("coordinator = 'h:1'\n", "unknown key(s) ['coordinator']"),
    ],
)
def test_a_bad_config_file_is_refused_naming_the_file_and_key(bare, tmp_path, text, needle):
    config = write_client_config(tmp_path / "client.toml", text)
    bare.setenv("MESHGATE_CLIENT_CONFIG", str(config))
    with pytest.raises(ClientConfigError) as caught:
        Connection.resolve()
    assert needle in str(caught.value) and str(config) in str(caught.value), str(caught.value)


def test_a_named_context_or_file_that_is_not_there_is_an_error(bare, tmp_path):
    with pytest.raises(ClientConfigError, match="context 'prod' \\(from --context\\): there is no client config"):
        Connection.resolve({"context": "prod"}, names={"context": "--context"})
    bare.setenv("MESHGATE_CLIENT_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(ClientConfigError, match="from MESHGATE_CLIENT_CONFIG\\) does not exist"):
        Connection.resolve()


def test_a_readable_key_file_is_refused_naming_where_it_was_set(bare, tmp_path, ca):
    dev, alice, _ = ca
    loose = tmp_path / "alice.key"
    loose.write_bytes(alice.key.read_bytes())
    loose.chmod(0o644)
    config = write_client_config(
        tmp_path / "client.toml",
        f"""current_context = "a"
[contexts.a]
coordinator = "h:1"
tls_ca = "{dev.ca}"
tls_cert = "{alice.cert}"
tls_key = "alice.key"
""",
    )
    bare.setenv("MESHGATE_CLIENT_CONFIG", str(config))
    with pytest.raises(ClientConfigError) as caught:
        Connection.resolve()
    message = str(caught.value)
    assert "mode 0644" in message and f"chmod 600 {loose}" in message and "tls_key in context 'a'" in message
    token = tmp_path / "admin.token"
    token.write_text("t0k\n")
    token.chmod(0o640)
    with pytest.raises(ClientConfigError, match="--admin-token-file .* has mode 0640"):
        Connection.resolve(
            {"coordinator": "h:1", "tls": False, "admin_token_file": str(token)},
            names={"admin_token_file": "--admin-token-file"},
            admin=True,
        )
    token.chmod(0o600)
    assert Connection.resolve(
        {"coordinator": "h:1", "tls": False, "admin_token_file": str(token)}, admin=True
    ).admin_metadata == (("authorization", "Bearer t0k"),)


def test_the_environment_may_not_ask_for_plaintext_and_tls_at_once(bare, ca):
    bare.setenv("MESHGATE_COORDINATOR", "h:1")
    bare.setenv("MESHGATE_INSECURE", "1")
    bare.setenv("MESHGATE_TLS_CA", str(ca[0].ca))
    with pytest.raises(ClientConfigError, match="MESHGATE_INSECURE conflicts with MESHGATE_TLS_CA"):
        Connection.resolve()
    bare.setenv("MESHGATE_INSECURE", "0")  # what an agent hands its TLS workers: not plaintext
    assert Connection.resolve().tls.ca_file == ca[0].ca


def test_poll_yields_until_the_caller_breaks_or_time_runs_out(monkeypatch):
    slept = []
    monkeypatch.setattr("time.sleep", slept.append)
    answers = iter(["PENDING", "PENDING", "RUNNING"])
    for answer in poll(lambda: next(answers), every_s=0.5):
        if answer == "RUNNING":
            break
    assert slept == [0.5, 0.5]
    assert list(poll(lambda: "x", every_s=10.0, for_s=1.0)) == ["x"]  # the next poll would be past the end


def test_job_show_renders_the_jobs_rendezvous_as_status_does():
    plan = ParallelPlan(dp_shard=4)
    status = pb.Status(
        job_id="j",
        generation=2,
        plan=plan.to_proto(),
        world_size=4,
        registered=3,
        missing_ranks="3",
        master_addr="10.0.0.1",
        master_port=29500,
        nodes=[
            pb.NodeStatus(
                node_id="n0",
                node_rank=0,
                state=pb.NODE_STATE_ACTIVE,
                first_rank=0,
                slots=2,
                registered=2,
                exits=["local 1: exit 1 (restart 1/3)"],
            ),
            pb.NodeStatus(node_id="n1", node_rank=1, state=pb.NODE_STATE_ACTIVE, first_rank=2, slots=2, registered=1),
            pb.NodeStatus(node_id="n2", node_rank=-1, state=pb.NODE_STATE_SPARE),
        ],
    )
    status.opened_at.FromSeconds(1000)
    info = pb.JobInfo(
        spec=pb.JobSpec(job_id="j", plan=plan.to_proto(), slots_per_node=2),
        state=pb.RUNNING,
        nodes=["n0", "n1"],
        spare_nodes=["n2"],
        status=status,
    )
    shown = views.job_dict(info, "head:7443", now=1010.0)
    seen = views.status_dict(status, "head:7443", 1010.0)
    assert shown["status"] == seen and json.loads(json.dumps(shown))["status"]["nodes"][2]["ranks"] == "-"
    status_lines = views.render_status(seen).splitlines()[2:]  # after its heading
    job_text = views.render_job(shown)
    assert "\n".join(status_lines) in job_text
    assert "missing ranks (1 of 4), by node:" in job_text and "  n1: 3" in job_text
    assert views.progress(shown) == "j: RUNNING, generation 2, 3/4 ranks"


# ---- against a real mTLS jobs-mode coordinator ---------------------------------------------------


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory):
    from test_ownership import Coordinator

    running = Coordinator(tmp_path_factory.mktemp("connection"))
    running.submit("alice", "alice-1")
    yield running
    running.stop()


def cli(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshgate.cli", *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_job_list_with_only_the_workers_variables(coordinator, tmp_path):
    admin = coordinator.tls["admin"]
    env = clean_env(
        tmp_path,
        MESHGATE_COORDINATOR=coordinator.address,
        MESHGATE_TLS_CA=str(admin.ca_file),
        MESHGATE_TLS_CERT=str(admin.cert_file),
        MESHGATE_TLS_KEY=str(admin.key_file),
    )
    listed = cli(env, "job", "list")
    assert listed.returncode == 0, listed.stderr
    assert any(line.startswith("alice-1 ") and "submitter:alice" in line for line in listed.stdout.splitlines())
    # the same without the transport: one error naming what to set, and not a byte sent
    del env["MESHGATE_TLS_CA"], env["MESHGATE_TLS_CERT"], env["MESHGATE_TLS_KEY"]
    refused = cli(env, "job", "list")
    assert refused.returncode == 2 and "no transport security configured" in refused.stderr
    assert "MESHGATE_TLS_CA" in refused.stderr and "Socket closed" not in refused.stderr
    # plaintext asked for on purpose against a TLS coordinator: the error says what to check
    plaintext = cli(env, "job", "list", "--insecure", "--timeout", "2")
    assert plaintext.returncode == 2 and "UNAVAILABLE" in plaintext.stderr
    assert "plaintext (from --insecure)" in plaintext.stderr and "TLS coordinator" in plaintext.stderr


@pytest.mark.slow
def test_job_commands_with_only_a_client_config_and_its_contexts(coordinator, bare, tmp_path, capsys):
    tls = coordinator.tls
    contexts = "\n".join(
        f'[contexts.{who}]\ncoordinator = "{coordinator.address}"\n'
        f'tls_ca = "{os.path.relpath(tls[who].ca_file, tmp_path)}"\n'  # relative: from the file's directory
        f'tls_cert = "{tls[who].cert_file}"\ntls_key = "{tls[who].key_file}"\n'
        for who in ("alice", "bob")
    )
    config = write_client_config(tmp_path / "client.toml", f'current_context = "alice"\n{contexts}')
    bare.setenv("MESHGATE_CLIENT_CONFIG", str(config))
    assert meshgate_main(["job", "list"]) == 0
    assert "alice-1 " in capsys.readouterr().out
    assert meshgate_main(["job", "show", "alice-1"]) == 0
    assert "command: python train.py" in capsys.readouterr().out  # alice's own job, alice's context
    assert meshgate_main(["job", "show", "--context", "bob", "alice-1"]) == 0
    assert "withheld" in capsys.readouterr().out  # bob's context: a stranger's view
    bare.setenv("MESHGATE_CONTEXT", "bob")
    assert meshgate_main(["job", "cancel", "alice-1"]) == 2
    assert "PERMISSION_DENIED" in capsys.readouterr().err
    assert meshgate_main(["job", "show", "--json", "--context", "alice", "alice-1"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "PENDING"


class Standby:
    """A real gRPC server (TLS with ``server_tls``) that answers every call UNAVAILABLE: as a
    standby coordinator does, naming the ``leader`` in the meshgate-leader trailing metadata,
    or (no leader) as a coordinator that took the call and then failed."""

    def __init__(self, server_tls=None, leader: str = "") -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.calls: list[str] = []
        self.server = grpc.server(ThreadPoolExecutor(2))
        self.server.add_generic_rpc_handlers([self])
        if server_tls is None:
            self.port = self.server.add_insecure_port("127.0.0.1:0")
        else:
            self.port = self.server.add_secure_port("127.0.0.1:0", server_credentials(server_tls))
        self.address = f"127.0.0.1:{self.port}"
        self.leader = leader
        self.lock = threading.Lock()
        self.server.start()

    def service(self, details):
        method = details.method

        def refuse(request, context):
            with self.lock:
                self.calls.append(method.rsplit("/", 1)[-1])
            if self.leader:
                context.set_trailing_metadata(((LEADER_METADATA_KEY, self.leader),))
            context.abort(grpc.StatusCode.UNAVAILABLE, "not the leader" if self.leader else "lost mid-call")

        return grpc.unary_unary_rpc_method_handler(refuse)


def test_a_call_not_safe_to_repeat_stays_where_it_was_taken():
    """A coordinator that took a cancel and answered UNAVAILABLE naming no leader may have
    acted on it: the cancel is not sent to the next address. A read is."""
    from meshgate import admin

    first, second = Standby(), Standby()
    both = f"{first.address},{second.address}"
    try:
        with pytest.raises(RendezvousRefused) as caught:
            admin.cancel_job(both, "j", "why", tls=False, timeout=3)
        assert (caught.value.code, caught.value.address) == (grpc.StatusCode.UNAVAILABLE, first.address)
        assert (first.calls, second.calls) == (["CancelJob"], [])
        with pytest.raises(RendezvousRefused):
            admin.get_job(both, "j", tls=False, timeout=1)
        assert "GetJob" in first.calls and "GetJob" in second.calls
    finally:
        first.server.stop(None)
        second.server.stop(None)


@pytest.mark.slow
def test_the_cli_fails_over_past_a_dead_address_and_a_standby(coordinator, bare, capsys):
    from conftest import free_port

    admin = coordinator.tls["admin"]
    flags = ["--ca-file", str(admin.ca_file), "--cert-file", str(admin.cert_file), "--key-file", str(admin.key_file)]
    dead = f"127.0.0.1:{free_port()}"
    assert meshgate_main(["job", "list", "--coordinator", f"{dead},{coordinator.address}", *flags]) == 0
    assert "alice-1 " in capsys.readouterr().out
    coordinator.submit("alice", "to-cancel")
    # a cancel is not safe to repeat: it moves on only because the dead address took no call
    assert meshgate_main(["job", "cancel", "--coordinator", f"{dead},{coordinator.address}", *flags, "to-cancel"]) == 0
    assert "CANCELLED" in capsys.readouterr().out
    standby = Standby(coordinator.ca.server_tls(), coordinator.address)
    try:
        address = f"127.0.0.1:{standby.port}"
        assert meshgate_main(["job", "show", "--coordinator", address, *flags, "alice-1"]) == 0
        assert "job alice-1: PENDING" in capsys.readouterr().out
        coordinator.submit("alice", "to-cancel-2")
        assert meshgate_main(["job", "cancel", "--coordinator", address, *flags, "to-cancel-2"]) == 0
        assert "CANCELLED" in capsys.readouterr().out
        assert standby.calls == ["GetJob", "CancelJob"]  # asked once each, then the leader it named
    finally:
        standby.server.stop(None)
    # every address down: the refusal names the last one tried and what to check
    with pytest.raises(RendezvousRefused) as caught:
        from meshgate import admin as admin_api

        admin_api.list_jobs(f"{dead},{address}", tls=admin, timeout=1.5)
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE and caught.value.address in (dead, address)


# ---- one channel across calls --------------------------------------------------------------------


class CountingProxy:
    """A TCP proxy in front of a coordinator that counts the connections made through it
    (each one a TLS handshake), and can cut every one it carries (a network reset)."""

    def __init__(self, target: str) -> None:
        import socket

        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.accepted = 0
        self.carried: list = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import socket

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            upstream = socket.create_connection(self.target)
            self.carried += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pipe(source, sink) -> None:
        import socket

        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            try:
                sink.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        import socket

        for sock in self.carried:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()
        self.cut()


@pytest.mark.slow
def test_a_direct_workers_heartbeats_share_one_connection_and_reconnect_after_a_cut(
    coordinator_factory, bare, tmp_path
):
    """A direct worker of a real mTLS coordinator beats 20 times through a proxy that counts
    connections: one connection (one TLS handshake), not one per beat (each call opened a
    channel before). The proxy then cuts it: the beats go on over one new connection."""
    import time

    from meshgate.client import Heartbeat, register

    dev = init_dev_ca(tmp_path / "tls")
    plan = ParallelPlan(dp_shard=1)
    server = {"insecure": False, "ca_file": str(dev.ca), "cert_file": str(dev.server.cert)}
    server.update(key_file=str(dev.server.key), require_client_cert=True)
    coordinator = coordinator_factory(plan, job={"require_vouch": False}, server=server)
    bare.setenv("MESHGATE_TLS_CA", str(dev.ca))
    bare.setenv("MESHGATE_TLS_CERT", str(dev.worker.cert))
    bare.setenv("MESHGATE_TLS_KEY", str(dev.worker.key))
    attestation = register(
        coordinator=coordinator.address, job_id="test", trust_bundle=coordinator.trust_bundle_path, node_id="n0"
    )
    proxy = CountingProxy(coordinator.address)
    beating = Heartbeat(attestation, coordinator=proxy.address, interval=0.02)

    def beats(count: int) -> None:
        deadline = time.monotonic() + 30
        while beating.beats < count:
            assert not beating.stale and time.monotonic() < deadline, (beating.beats, beating.stale)
            time.sleep(0.01)

    try:
        beating.start()
        beats(20)
        assert proxy.accepted == 1, f"{proxy.accepted} connections for {beating.beats} heartbeats"
        proxy.cut()
        beats(beating.beats + 20)
        assert proxy.accepted == 2, f"{proxy.accepted} connections after one cut"
    finally:
        beating.stop()
        proxy.close()
    assert beating.connection._kept is None  # the thread closed its channel on the way out
