"""meshgate.tls: a dev CA, TLS / mTLS over real grpc.aio servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import os
import stat

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from meshgate.tls import (
    ROLE_ADMIN,
    ROLE_AGENT,
    ROLE_WORKER,
    DevCAExists,
    PeerIdentity,
    TLSConfig,
    TLSConfigError,
    init_dev_ca,
    issue_cert,
    peer_identity,
    secure_channel,
    server_credentials,
    warn_insecure,
)

METHOD = "/meshgate.test.Echo/Echo"
# Each channel gets its own subchannels, so no connection is shared between the cases.
OPTIONS = (("grpc.use_local_subchannel_pool", 1),)


@pytest.fixture
def dev(tmp_path):
    return init_dev_ca(tmp_path / "ca", agent_names=("agent", "node1"))


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """A second, unrelated CA with the same file layout and the same subject roles (read-only)."""
    return init_dev_ca(tmp_path_factory.mktemp("other") / "ca")


class EchoServer:
    def __init__(self) -> None:
        self.calls: list[PeerIdentity | None] = []
        self.port = 0

    async def echo(self, request: bytes, context) -> bytes:
        self.calls.append(peer_identity(context))
        return request


@contextlib.asynccontextmanager
async def serving(tls: TLSConfig | None):
    echo = EchoServer()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "meshgate.test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo.echo)}
            ),
        )
    )
    if tls is None:
        echo.port = server.add_insecure_port("127.0.0.1:0")
    else:
        echo.port = server.add_secure_port("127.0.0.1:0", server_credentials(tls))
    assert echo.port
    await server.start()
    try:
        yield echo
    finally:
        await server.stop(None)


async def call(port: int, tls: TLSConfig | None, host: str = "127.0.0.1") -> bytes:
    async with secure_channel(f"{host}:{port}", tls, aio=True, options=OPTIONS) as channel:
        return await channel.unary_unary(METHOD)(b"ping", timeout=5)


async def refused(port: int, tls: TLSConfig | None, reason: str = "") -> grpc.RpcError:
    """The call fails before any RPC: UNAVAILABLE, and ``reason`` in the details when given."""
    with pytest.raises(grpc.RpcError) as info:
        await call(port, tls)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    assert reason in (info.value.details() or ""), info.value.details()
    return info.value


def fingerprint(path) -> str:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


# ---- handshakes --------------------------------------------------------------------------


async def test_mtls_client_reaches_handler_and_server_sees_its_role(dev):
    async with serving(dev.server_tls()) as server:
        for pair, role, name in [
            (dev.agent(), ROLE_AGENT, "agent"),
            (dev.agent("node1"), ROLE_AGENT, "node1"),
            (dev.worker, ROLE_WORKER, "worker"),
            (dev.admin, ROLE_ADMIN, "admin"),
        ]:
            assert await call(server.port, dev.client_tls(pair)) == b"ping"
            nodes = (name,) if role == ROLE_AGENT else ()  # agent certs name their node in a SAN URI
            assert server.calls[-1] == PeerIdentity(role, name, fingerprint(pair.cert), nodes)
        # The certificate's SANs name both 127.0.0.1 (IP SAN) and localhost (DNS SAN).
        assert await call(server.port, dev.client_tls(dev.worker), host="localhost") == b"ping"
    assert len(server.calls) == 5


async def test_sync_channel_works_too(dev):
    async with serving(dev.server_tls()) as server:

        def sync_call() -> bytes:
            with secure_channel(f"127.0.0.1:{server.port}", dev.client_tls(dev.agent()), options=OPTIONS) as ch:
                return ch.unary_unary(METHOD)(b"sync", timeout=5)

        assert await asyncio.to_thread(sync_call) == b"sync"
    assert server.calls[0].role == ROLE_AGENT


async def test_plaintext_client_is_refused_by_tls_server(dev):
    async with serving(dev.server_tls()) as server:
        await refused(server.port, None)
    assert server.calls == []


async def test_client_cert_from_another_ca_is_refused(dev, other):
    # It trusts the right CA for the server, but presents an agent cert that another CA signed.
    tls = TLSConfig(dev.ca, other.agent().cert, other.agent().key)
    async with serving(dev.server_tls()) as server:
        await refused(server.port, tls)
    assert server.calls == []


async def test_client_without_cert_is_refused_under_mtls(dev):
    async with serving(dev.server_tls(require_client_cert=True)) as server:
        await refused(server.port, dev.client_tls(None))
    assert server.calls == []


async def test_without_mtls_no_client_cert_is_asked_and_no_identity(dev):
    async with serving(dev.server_tls(require_client_cert=False)) as server:
        assert await call(server.port, dev.client_tls(None)) == b"ping"
        # A client cert is not asked for, and so it is never taken as an identity.
        assert await call(server.port, dev.client_tls(dev.admin)) == b"ping"
    assert server.calls == [None, None]


async def test_plaintext_server_gives_no_identity():
    async with serving(None) as server:
        assert await call(server.port, None) == b"ping"
    assert server.calls == [None]


async def test_client_refuses_server_from_another_ca(dev, other):
    async with serving(dev.server_tls()) as server:
        await refused(
            server.port,
            TLSConfig(other.ca, other.agent().cert, other.agent().key),
            reason="unable to get local issuer certificate",
        )
    assert server.calls == []


async def test_agent_cert_cannot_pose_as_coordinator(dev):
    # Client certs carry EKU clientAuth only; the client's chain check refuses them as a server.
    rogue = TLSConfig(dev.ca, dev.agent().cert, dev.agent().key, require_client_cert=False)
    async with serving(rogue) as server:
        await refused(
            server.port,
            dev.client_tls(None, server_name="agent"),
            reason="unsupported certificate purpose",
        )
    assert server.calls == []


async def test_server_name_override(tmp_path):
    dev = init_dev_ca(tmp_path / "ca", hosts=("coord.internal",))
    async with serving(dev.server_tls()) as server:
        # 127.0.0.1 is not among the SANs: refused ...
        await refused(server.port, dev.client_tls(dev.agent()), reason="Hostname Verification")
        # ... unless the client checks for the name the certificate does carry.
        assert await call(server.port, dev.client_tls(dev.agent(), server_name="coord.internal")) == b"ping"
    assert [c.role for c in server.calls] == [ROLE_AGENT]


# ---- the dev CA ----------------------------------------------------------------------------


def test_keys_are_0600_and_certs_0644_even_with_umask_0(tmp_path):
    old = os.umask(0)
    try:
        dev = init_dev_ca(tmp_path / "ca")
    finally:
        os.umask(old)
    keys = sorted(dev.directory.glob("*.key"))
    certs = sorted(dev.directory.glob("*.pem"))
    assert [p.name for p in keys] == ["admin.key", "agent.key", "ca.key", "coordinator.key", "worker.key"]
    assert len(certs) == 5
    for path in keys:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    for path in certs:
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    assert stat.S_IMODE(dev.directory.stat().st_mode) == 0o700


def test_init_dev_ca_refuses_to_overwrite(dev):
    before = {p.name: p.read_bytes() for p in dev.directory.iterdir()}
    with pytest.raises(DevCAExists, match="refusing to overwrite") as info:
        init_dev_ca(dev.directory)
    assert "ca.pem" in str(info.value) and str(dev.directory) in str(info.value)
    assert {p.name: p.read_bytes() for p in dev.directory.iterdir()} == before


def test_init_dev_ca_writes_nothing_when_a_leaf_exists(tmp_path):
    directory = tmp_path / "ca"
    directory.mkdir()
    (directory / "admin.key").write_text("mine")
    with pytest.raises(DevCAExists, match="admin.key"):
        init_dev_ca(directory)
    assert sorted(p.name for p in directory.iterdir()) == ["admin.key"]


def test_certificates_carry_roles_sans_and_usages(dev):
    def load(path):
        return x509.load_pem_x509_certificate(path.read_bytes())

    server = load(dev.server.cert)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert list(server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH
    ]
    for pair, role, name in [
        (dev.agent("node1"), "agent", "node1"),
        (dev.worker, "worker", "worker"),
        (dev.admin, "admin", "admin"),
    ]:
        cert = load(pair.cert)
        assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value == role
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == name
        assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
            ExtendedKeyUsageOID.CLIENT_AUTH
        ]
        assert cert.issuer == load(dev.ca).subject
    assert load(dev.ca).extensions.get_extension_for_class(x509.BasicConstraints).value.ca


async def test_issue_cert_adds_an_agent_later(dev):
    pair = issue_cert(dev.directory, ROLE_AGENT, "node7")
    assert pair.cert.name == "agent-node7.pem" and stat.S_IMODE(pair.key.stat().st_mode) == 0o600
    with pytest.raises(DevCAExists):
        issue_cert(dev.directory, ROLE_AGENT, "node7")
    with pytest.raises(ValueError, match="name"):
        issue_cert(dev.directory, ROLE_AGENT, "../evil")
    async with serving(dev.server_tls()) as server:
        assert await call(server.port, dev.client_tls(pair)) == b"ping"
    assert server.calls[0].name == "node7"


# ---- TLSConfig ---------------------------------------------------------------------------


def _table(dev, **extra):
    table = {
        "ca_file": "ca.pem",
        "cert_file": "coordinator.pem",
        "key_file": "coordinator.key",
        "require_client_cert": True,
    }
    table.update(extra)
    return {k: v for k, v in table.items() if v is not None}


def test_tlsconfig_from_mapping_resolves_paths_from_base_dir(dev):
    tls = TLSConfig.from_mapping(_table(dev), base_dir=dev.directory, server=True)
    assert tls == dev.server_tls()
    client = TLSConfig.from_mapping({"ca_file": str(dev.ca), "server_name": "localhost"}, section="agent")
    assert client.cert_file is None and client.server_name == "localhost"


@pytest.mark.parametrize("key", ["ca_file", "cert_file", "key_file"])
def test_tlsconfig_refuses_missing_file_naming_path_and_key(dev, key):
    with pytest.raises(TLSConfigError) as info:
        TLSConfig.from_mapping(_table(dev, **{key: "nope.pem"}), section="server", base_dir=dev.directory, server=True)
    message = str(info.value)
    assert message.startswith("[server] ")
    assert key in message and str(dev.directory / "nope.pem") in message, message


def test_tlsconfig_insecure_semantics(dev, caplog):
    assert TLSConfig.from_mapping({"insecure": True}) is None
    with pytest.raises(TLSConfigError, match="conflicts"):
        TLSConfig.from_mapping({"insecure": True, "ca_file": str(dev.ca)})
    with pytest.raises(TLSConfigError, match=r"ca_file.*insecure = true"):
        TLSConfig.from_mapping({})
    with pytest.raises(TLSConfigError, match="cert_file and key_file are required"):
        TLSConfig.from_mapping({"ca_file": str(dev.ca)}, server=True)
    with pytest.raises(TLSConfigError, match="insecure must be true or false"):
        TLSConfig.from_mapping({"insecure": "yes"})
    with caplog.at_level(logging.WARNING):
        warn_insecure(logging.getLogger("meshgate.test"), "coordinator on 127.0.0.1:7443")
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "INSECURE" in record.getMessage() and "127.0.0.1:7443" in record.getMessage()


def test_tlsconfig_refuses_open_key_mismatch_and_half_pairs(dev):
    open_key = dev.directory / "open.key"
    open_key.write_bytes(dev.agent().key.read_bytes())
    open_key.chmod(0o644)
    with pytest.raises(TLSConfigError, match=r"key_file .*open.key has mode 0644.*chmod 600"):
        TLSConfig(dev.ca, dev.agent().cert, open_key)
    with pytest.raises(TLSConfigError, match="does not match"):
        TLSConfig(dev.ca, dev.agent().cert, dev.worker.key)
    with pytest.raises(TLSConfigError, match="cert_file is set but key_file is not"):
        TLSConfig(dev.ca, dev.agent().cert, None)
    with pytest.raises(TLSConfigError, match="ca_file .*not a PEM certificate"):
        TLSConfig(dev.agent().key, None, None)
    with pytest.raises(TLSConfigError, match="require_client_cert must be true or false"):
        TLSConfig.from_mapping(_table(dev, require_client_cert="no"), base_dir=dev.directory)
