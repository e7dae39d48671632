"""`meshgate certs init --host` / `certs issue`: certificates for real hosts (issue #14)."""

from __future__ import annotations

import ipaddress
import os
import stat

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from meshgate.cli import main
from meshgate.tls import TLSConfig, secure_channel, server_credentials


def _cert(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _sans(cert: x509.Certificate) -> x509.SubjectAlternativeName:
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value


def _fingerprint_lines(out: str) -> list[str]:
    return [line.split()[-1] for line in out.splitlines() if line.strip().startswith("sha256 ")]


def test_init_puts_every_host_in_the_coordinator_sans(tmp_path, capsys):
    directory = tmp_path / "tls"
    assert (
        main(["certs", "init", str(directory), "--host", "10.77.0.1", "--host", "coord.example", "--agent", "host-a"])
        == 0
    )
    out = capsys.readouterr().out
    sans = _sans(_cert(directory / "coordinator.pem"))
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.77.0.1")]
    assert sans.get_values_for_type(x509.DNSName) == ["coord.example"]
    # No loopback name sneaks in when hosts are given.
    assert ipaddress.ip_address("127.0.0.1") not in sans.get_values_for_type(x509.IPAddress)
    for key in directory.glob("*.key"):
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600, key
    printed = _fingerprint_lines(out)
    for name in ("ca", "coordinator", "agent-host-a", "worker", "admin"):
        pem = directory / f"{name}.pem"
        assert str(pem) in out
        assert _cert(pem).fingerprint(hashes.SHA256()).hex() in printed


def test_issue_agent_carries_its_node_id_in_cn_and_spiffe_uri(tmp_path, capsys):
    directory = tmp_path / "tls"
    assert main(["certs", "init", str(directory), "--host", "10.77.0.1", "--trust-domain", "cluster.example"]) == 0
    capsys.readouterr()
    assert (
        main(
            [
                "certs",
                "issue",
                str(directory),
                "--role",
                "agent",
                "--node-id",
                "gpu-07",
                "--host",
                "10.77.0.7",
                "--trust-domain",
                "cluster.example",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    cert = _cert(directory / "agent-gpu-07.pem")
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "gpu-07"
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value == "agent"
    sans = _sans(cert)
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == ["spiffe://cluster.example/node/gpu-07"]
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.77.0.7")]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert _fingerprint_lines(out) == [cert.fingerprint(hashes.SHA256()).hex()]
    assert stat.S_IMODE(os.stat(directory / "agent-gpu-07.key").st_mode) == 0o600


@pytest.mark.parametrize("role", ["worker", "admin", "submitter"])
def test_issue_client_roles(tmp_path, capsys, role):
    directory = tmp_path / "tls"
    assert main(["certs", "init", str(directory), "--no-worker", "--no-admin"]) == 0
    assert not (directory / f"{role}.pem").exists()
    assert main(["certs", "issue", str(directory), "--role", role]) == 0
    cert = _cert(directory / f"{role}.pem")
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value == role
    with pytest.raises(x509.ExtensionNotFound):
        _sans(cert)  # no host, no node: nothing to name


def test_issue_prints_the_files_it_wrote(tmp_path, capsys):
    """--name picks the file names (submitter-alice.pem): the output says which (issue #34)."""
    directory = tmp_path / "tls"
    assert main(["certs", "init", str(directory), "--no-worker", "--no-admin"]) == 0
    capsys.readouterr()
    assert main(["certs", "issue", str(directory), "--role", "submitter", "--name", "alice"]) == 0
    out = capsys.readouterr().out
    for name in ("submitter-alice.pem", "submitter-alice.key"):
        assert (directory / name).is_file() and str(directory / name) in out, out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--role", "agent"], "--role agent needs --node-id"),
        (["--role", "worker", "--node-id", "n1"], "--node-id is for --role agent"),
        (["--role", "coordinator", "--name", "coord-b"], "needs at least one --host"),
        (["--role", "agent", "--node-id", "../evil"], "'../evil' must be 1-64 characters"),
        (["--role", "agent", "--node-id", "n1", "--trust-domain", "Bad Domain"], "trust domain"),
    ],
)
def test_issue_refuses_bad_input_and_writes_nothing(tmp_path, capsys, argv, message):
    directory = tmp_path / "tls"
    assert main(["certs", "init", str(directory)]) == 0
    before = sorted(p.name for p in directory.iterdir())
    assert main(["certs", "issue", str(directory), *argv]) != 0
    assert message in capsys.readouterr().err
    assert sorted(p.name for p in directory.iterdir()) == before


def test_issue_never_overwrites(tmp_path, capsys):
    directory = tmp_path / "tls"
    assert main(["certs", "init", str(directory)]) == 0
    assert main(["certs", "issue", str(directory), "--role", "agent", "--node-id", "n1"]) == 0
    first = (directory / "agent-n1.pem").read_bytes()
    capsys.readouterr()
    assert main(["certs", "issue", str(directory), "--role", "agent", "--node-id", "n1"]) == 1
    assert "refusing to overwrite" in capsys.readouterr().err
    assert (directory / "agent-n1.pem").read_bytes() == first


def test_init_refuses_an_existing_ca(tmp_path, capsys):
    directory = tmp_path / "tls"
    assert main(["certs", "init", str(directory)]) == 0
    ca = (directory / "ca.pem").read_bytes()
    assert main(["certs", "init", str(directory), "--host", "10.0.0.1"]) == 1
    assert "already exists" in capsys.readouterr().err
    assert (directory / "ca.pem").read_bytes() == ca


# ---- the handshake: a client dialling the coordinator by the address in its certificate ----

_METHOD = "/meshgate.test.Echo/Echo"


def _echo_server(tls: TLSConfig) -> tuple[grpc.Server, int]:
    from concurrent import futures

    handler = grpc.method_handlers_generic_handler(
        "meshgate.test.Echo",
        {"Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request)},
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_secure_port("127.0.0.1:0", server_credentials(tls))
    server.start()
    return server, port


def _echo(port: int, tls: TLSConfig) -> bytes:
    with secure_channel(f"127.0.0.1:{port}", tls) as channel:
        call = channel.unary_unary(_METHOD, request_serializer=None, response_deserializer=None)
        return call(b"ping", timeout=10)


def test_mtls_handshake_checks_the_host_sans(tmp_path, capsys):
    """The coordinator certificate from `certs init --host 10.77.0.1 --host coord.example`
    passes a client dialling either name (the socket is on 127.0.0.1; the checked name is
    overridden, as a client reaching 10.77.0.1 checks it), and fails one dialling another."""
    directory = tmp_path / "tls"
    assert main(["certs", "init", str(directory), "--host", "10.77.0.1", "--host", "coord.example"]) == 0
    assert main(["certs", "issue", str(directory), "--role", "agent", "--node-id", "host-a"]) == 0
    server_tls = TLSConfig(directory / "ca.pem", directory / "coordinator.pem", directory / "coordinator.key")
    server, port = _echo_server(server_tls)
    try:
        for name in ("10.77.0.1", "coord.example"):
            client = TLSConfig(
                directory / "ca.pem",
                directory / "agent-host-a.pem",
                directory / "agent-host-a.key",
                server_name=name,
            )
            assert _echo(port, client) == b"ping"
        wrong = TLSConfig(
            directory / "ca.pem",
            directory / "agent-host-a.pem",
            directory / "agent-host-a.key",
            server_name="10.77.0.2",
        )
        with pytest.raises(grpc.RpcError) as refused:
            _echo(port, wrong)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)
