"""Transport security: TLS / mTLS for every meshgate gRPC connection.

The crypto for TLS certificates lives here; signing of attestations stays in
``meshgate/attestation.py``. Keys are ECDSA P-256: gRPC's BoringSSL (grpcio 1.85) does not
negotiate Ed25519 certificates (the handshake fails with NO_COMMON_SIGNATURE_ALGORITHMS).

API
---

``init_dev_ca(directory, hosts=..., agent_names=..., worker=True, admin=True) -> DevCA``
    Create a development CA plus every certificate a single-host deployment or a test needs.
    It refuses to overwrite a CA that is already there (``DevCAExists``).
``issue_cert(directory, role, name, hosts=()) -> CertPair``
    Issue one more certificate from the dev CA in ``directory``. Use it, for example, for an agent
    added later.
``TLSConfig``
    The TLS settings of one endpoint (frozen). It checks its files when it is built.
    ``TLSConfig.from_mapping(table, section=, base_dir=, server=)`` reads a TOML table and returns
    None when the table says ``insecure = true`` (plaintext).
``warn_insecure(logger, what)``
    The loud warning to log whenever a caller goes plaintext.
``server_credentials(tls)`` / ``channel_credentials(tls)``
    The grpc credentials objects.
``secure_channel(address, tls, aio=False, options=())``
    A grpc (or grpc.aio) channel. It is TLS unless ``tls`` is None.
``peer_identity(context) -> PeerIdentity(role, name, fingerprint) | None``
    Who called, taken from the verified client certificate (mTLS only).

TOML keys (``TLS_KEYS``), all paths relative to the config file::

    insecure            = false          # true: plaintext; then no other key may be set
    ca_file             = "tls/ca.pem"   # required unless insecure
    cert_file           = "tls/coordinator.pem"   # server: required; client: with key_file
    key_file            = "tls/coordinator.key"   # must be mode 0600 (or stricter)
    require_client_cert = true           # server only: the mTLS switch (default true)
    server_name         = "coord.example"  # client only: ssl_target_name_override

``from_mapping`` looks only at these keys. The caller keeps refusing unknown keys in its own
table, and adds ``TLS_KEYS`` to the set of keys it allows.

Roles
-----

A client certificate carries its role in the subject: ``OU=<role>, CN=<name>``. The roles are
``agent`` (CN = node id), ``worker``, ``admin``, and ``coordinator`` for the server
certificate. An agent certificate also names its node in a SAN URI
``spiffe://<trust-domain>/node/<node_id>`` (``node_uri``; the trust domain defaults to
``meshgate``), the form SPIFFE-style CAs issue. Server certificates carry EKU serverAuth and
client certificates carry clientAuth
only, so an agent's certificate cannot pass for the coordinator's.

Wiring
------

Coordinator::

    tls = TLSConfig.from_mapping(doc.get("tls", {}), section="tls", base_dir=cfg.parent,
                                 server=True)
    if tls is None:
        warn_insecure(log, f"coordinator on {listen}")
        port = server.add_insecure_port(listen)
    else:
        port = server.add_secure_port(listen, server_credentials(tls))

Agent, worker or CLI (for a client, ``server=False``)::

    channel = secure_channel(address, tls, aio=True)   # tls None -> plaintext (warn first)

Inside a servicer, to authorize by role (only meaningful with require_client_cert = true)::

    who = peer_identity(context)
    if who is None or who.role != ROLE_AGENT:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "agents only")

Credentials are read from disk when ``server_credentials``/``channel_credentials`` is called.
Rotating a certificate therefore means a restart, or a new channel on the client side.
"""

from __future__ import annotations

import datetime
import functools
import ipaddress
import logging
import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "ROLE_ADMIN",
    "ROLE_AGENT",
    "ROLE_COORDINATOR",
    "ROLE_SUBMITTER",
    "ROLE_WORKER",
    "ROLES",
    "TLS_KEYS",
    "CertPair",
    "DevCA",
    "DevCAExists",
    "PeerIdentity",
    "TLSConfig",
    "TLSConfigError",
    "TLSError",
    "DEFAULT_TRUST_DOMAIN",
    "channel_credentials",
    "cert_fingerprint",
    "init_dev_ca",
    "leaf_pair",
    "issue_cert",
    "node_uri",
    "peer_identity",
    "secure_channel",
    "server_credentials",
    "warn_insecure",
]

ROLE_AGENT = "agent"
ROLE_WORKER = "worker"
ROLE_ADMIN = "admin"
ROLE_COORDINATOR = "coordinator"
# May submit, watch and cancel jobs (their commands run on the nodes), nothing else.
ROLE_SUBMITTER = "submitter"
ROLES = frozenset({ROLE_AGENT, ROLE_WORKER, ROLE_ADMIN, ROLE_COORDINATOR, ROLE_SUBMITTER})

TLS_KEYS = frozenset({"insecure", "ca_file", "cert_file", "key_file", "require_client_cert", "server_name"})

DEFAULT_TRUST_DOMAIN = "meshgate"
_TRUST_DOMAIN = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,253}[a-z0-9])?$")

CA_CERT = "ca.pem"
CA_KEY = "ca.key"
# Agent certificates also name their node as the SAN URI spiffe://<trust domain>/node/<id>
# (the dev CA's trust domain is DEFAULT_TRUST_DOMAIN; a production PKI, e.g. SPIRE, uses its own).
_NODE_URI = re.compile(r"^spiffe://[A-Za-z0-9.\-]+/node/([A-Za-z0-9._:@+=\-]+)$")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_CLOCK_SKEW = datetime.timedelta(minutes=5)


class TLSError(Exception):
    """Base of this module's errors."""


class TLSConfigError(TLSError, ValueError):
    """TLS settings that cannot work. The message names the key and the file."""


class DevCAExists(TLSError, FileExistsError):
    """init_dev_ca / issue_cert would overwrite an existing file."""


# ---- files --------------------------------------------------------------------------------


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` with ``mode``. O_EXCL: never overwrite and never follow a symlink."""
    try:
        fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise DevCAExists(f"{path} already exists; refusing to overwrite it") from None
    with os.fdopen(fd, "wb") as handle:
        if mode != 0o600:
            # Certificates are public. Pin 0644 whatever the umask. Key files are never chmod'ed:
            # they are created 0600, and a umask can only make them stricter.
            os.fchmod(handle.fileno(), mode)
        handle.write(data)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    _write_new(path, pem, 0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    _write_new(path, cert.public_bytes(serialization.Encoding.PEM), 0o644)


def _check_key_mode(path: Path, what: str) -> None:
    from meshgate.secret_files import SecretFileError, check_private

    try:
        check_private(path, what)
    except SecretFileError as exc:
        raise TLSConfigError(str(exc)) from None


# ---- the development CA --------------------------------------------------------------------


@dataclass(frozen=True)
class CertPair:
    """A certificate and its private key, as PEM files."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class DevCA:
    """The files ``init_dev_ca`` wrote."""

    directory: Path
    ca: Path  # ca.pem: the trust anchor each endpoint is given as ca_file
    ca_key: Path  # ca.key: keep it off the nodes
    server: CertPair  # coordinator.pem / coordinator.key
    agents: Mapping[str, CertPair] = field(default_factory=dict)
    worker: Optional[CertPair] = None
    admin: Optional[CertPair] = None

    def agent(self, name: str = ROLE_AGENT) -> CertPair:
        try:
            return self.agents[name]
        except KeyError:
            raise KeyError(f"no agent certificate {name!r}; have {sorted(self.agents)}") from None

    def server_tls(self, *, require_client_cert: bool = True) -> "TLSConfig":
        """The coordinator's TLSConfig."""
        return TLSConfig(self.ca, self.server.cert, self.server.key, require_client_cert)

    def client_tls(self, pair: Optional[CertPair] = None, *, server_name: Optional[str] = None) -> "TLSConfig":
        """A client's TLSConfig: trust this CA, and present ``pair`` if one is given."""
        return TLSConfig(
            self.ca,
            pair.cert if pair else None,
            pair.key if pair else None,
            server_name=server_name,
        )


def _stem(role: str, name: str) -> str:
    return role if name == role else f"{role}-{name}"


def leaf_pair(directory: str | os.PathLike, role: str, name: str = "") -> CertPair:
    """Where init_dev_ca and issue_cert put ROLE NAME's certificate and key in ``directory``
    (``agent-<node>.pem``; a role's default name gives ``worker.pem``)."""
    _check_name(name or role, f"{role} name")
    stem = _stem(role, name or role)
    return CertPair(cert=Path(directory) / f"{stem}.pem", key=Path(directory) / f"{stem}.key")


def _check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"{what} {name!r} must be 1-64 characters of letters, digits, '.', '_' or '-', "
            f"starting with a letter or digit"
        )


def _san(hosts: Iterable[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in hosts:
        if not isinstance(host, str) or not host:
            raise ValueError(f"host {host!r} must be a non-empty string")
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def node_uri(node_id: str, trust_domain: str = DEFAULT_TRUST_DOMAIN) -> str:
    """The SAN URI that names a node in its agent certificate:
    ``spiffe://<trust_domain>/node/<node_id>``."""
    _check_name(node_id, "node id")
    if not isinstance(trust_domain, str) or not _TRUST_DOMAIN.match(trust_domain):
        raise ValueError(
            f"trust domain {trust_domain!r} must be lowercase letters, digits, '.' and '-' "
            f"(a SPIFFE trust domain, e.g. 'cluster.example')"
        )
    return f"spiffe://{trust_domain}/node/{node_id}"


def cert_fingerprint(path: str | os.PathLike) -> str:
    """The lowercase hex SHA-256 of the first certificate's DER bytes in the PEM file ``path``
    (what ``PeerIdentity.fingerprint`` reports for the same certificate)."""
    cert = x509.load_pem_x509_certificate(Path(path).read_bytes())
    return cert.fingerprint(hashes.SHA256()).hex()


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _make_ca(days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _new_key()
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "meshgate"),
            # Unique per CA, so two dev CAs are never confused by name.
            x509.NameAttribute(NameOID.COMMON_NAME, f"meshgate dev CA {secrets.token_hex(4)}"),
        ]
    )
    now = datetime.datetime.now(datetime.timezone.utc)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _make_leaf(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    role: str,
    name: str,
    hosts: Sequence[str],
    days: int,
    trust_domain: str = DEFAULT_TRUST_DOMAIN,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    server = role == ROLE_COORDINATOR
    if server and not hosts:
        raise ValueError("a coordinator certificate needs at least one host (IP or DNS name)")
    key = _new_key()
    now = datetime.datetime.now(datetime.timezone.utc)
    not_after = min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "meshgate"),
                    x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                    x509.NameAttribute(NameOID.COMMON_NAME, name),
                ]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    names = _san(hosts)
    if role == ROLE_AGENT:
        # The node identity the coordinator binds on Join (CN and this URI name the node).
        names.append(x509.UniformResourceIdentifier(node_uri(name, trust_domain)))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def _plan_files(directory: Path, stems: Iterable[str]) -> None:
    existing = [
        str(directory / f"{stem}{ext}")
        for stem in stems
        for ext in (".pem", ".key")
        if (directory / f"{stem}{ext}").exists() or (directory / f"{stem}{ext}").is_symlink()
    ]
    if existing:
        raise DevCAExists(f"refusing to overwrite existing file(s): {', '.join(existing)}")


def init_dev_ca(
    directory: str | os.PathLike,
    *,
    hosts: Sequence[str] = ("127.0.0.1", "localhost"),
    agent_names: Sequence[str] = ("agent",),
    worker: bool = True,
    admin: bool = True,
    days: int = 365,
    trust_domain: str = DEFAULT_TRUST_DOMAIN,
) -> DevCA:
    """Create a development CA and its certificates in ``directory``. The directory is created
    with mode 0700 if it is missing.

    Files: ca.pem/ca.key, coordinator.pem/.key (SANs: ``hosts``; IPs become IP SANs, the rest DNS
    SANs), ``agent[-NAME].pem/.key`` for each agent name (SAN URI ``node_uri(NAME,
    trust_domain)``), worker.pem/.key and admin.pem/.key.
    Keys are ECDSA P-256, written 0600; certificates are written 0644. The CA is valid for 10 years
    and the other certificates for ``days``. Raises DevCAExists, and writes nothing, if any of these
    files already exists.
    """
    directory = Path(directory)
    if isinstance(hosts, str) or isinstance(agent_names, str):
        raise TypeError("hosts and agent_names are sequences of strings, not one string")
    if isinstance(days, bool) or not isinstance(days, int) or days < 1:
        raise ValueError(f"days must be an integer >= 1, got {days!r}")
    agent_names = tuple(agent_names)
    if len(set(agent_names)) != len(agent_names):
        raise ValueError(f"agent_names has duplicates: {list(agent_names)}")
    for name in agent_names:
        node_uri(name, trust_domain)  # validates the name and the trust domain
    _san(hosts)  # validate before writing anything
    if (directory / CA_CERT).exists() or (directory / CA_KEY).exists():
        raise DevCAExists(
            f"a CA already exists in {directory} ({CA_CERT}/{CA_KEY}); refusing to overwrite it. "
            f"Use issue_cert() to add certificates, or choose another directory"
        )
    leaves = [(ROLE_COORDINATOR, ROLE_COORDINATOR, tuple(hosts))]
    leaves += [(ROLE_AGENT, name, ()) for name in agent_names]
    if worker:
        leaves.append((ROLE_WORKER, ROLE_WORKER, ()))
    if admin:
        leaves.append((ROLE_ADMIN, ROLE_ADMIN, ()))
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    _plan_files(directory, ["ca"] + [_stem(role, name) for role, name, _ in leaves])

    ca_cert, ca_key = _make_ca(days=max(days, 3650))
    _write_key(directory / CA_KEY, ca_key)
    _write_cert(directory / CA_CERT, ca_cert)
    pairs: dict[tuple[str, str], CertPair] = {}
    for role, name, leaf_hosts in leaves:
        pairs[(role, name)] = _issue(directory, ca_cert, ca_key, role, name, leaf_hosts, days, trust_domain)
    return DevCA(
        directory=directory,
        ca=directory / CA_CERT,
        ca_key=directory / CA_KEY,
        server=pairs[(ROLE_COORDINATOR, ROLE_COORDINATOR)],
        agents={name: pairs[(ROLE_AGENT, name)] for name in agent_names},
        worker=pairs.get((ROLE_WORKER, ROLE_WORKER)),
        admin=pairs.get((ROLE_ADMIN, ROLE_ADMIN)),
    )


def _issue(directory, ca_cert, ca_key, role, name, hosts, days, trust_domain) -> CertPair:
    cert, key = _make_leaf(ca_cert, ca_key, role, name, hosts, days, trust_domain)
    stem = _stem(role, name)
    pair = CertPair(cert=directory / f"{stem}.pem", key=directory / f"{stem}.key")
    _write_key(pair.key, key)
    _write_cert(pair.cert, cert)
    return pair


def issue_cert(
    directory: str | os.PathLike,
    role: str,
    name: str,
    *,
    hosts: Sequence[str] = (),
    days: int = 365,
    trust_domain: str = DEFAULT_TRUST_DOMAIN,
) -> CertPair:
    """Issue one more certificate from the dev CA in ``directory`` (ca.pem + ca.key).

    ``role`` is one of ROLES. For ``coordinator`` it is a server certificate, and ``hosts`` become
    its SANs. Every other role gets a client certificate (``hosts`` then add IP/DNS SANs; an
    agent's also names its node, ``node_uri(name, trust_domain)``). The files are
    ``<role>.pem/.key`` when name == role, else ``<role>-<name>.pem/.key``. Existing files are
    never overwritten.
    """
    directory = Path(directory)
    if role not in ROLES:
        raise ValueError(f"role must be one of {sorted(ROLES)}, got {role!r}")
    _check_name(name, f"{role} name")
    if isinstance(hosts, str):
        raise TypeError("hosts is a sequence of strings, not one string")
    if role == ROLE_AGENT:
        node_uri(name, trust_domain)
    _san(hosts)
    if isinstance(days, bool) or not isinstance(days, int) or days < 1:
        raise ValueError(f"days must be an integer >= 1, got {days!r}")
    ca_path, key_path = directory / CA_CERT, directory / CA_KEY
    try:
        _check_key_mode(key_path, "CA key")
        ca_cert = x509.load_pem_x509_certificate(ca_path.read_bytes())
        ca_key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except OSError as exc:
        raise TLSConfigError(f"dev CA in {directory}: {exc.filename}: {exc.strerror}") from exc
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TLSConfigError(f"dev CA key {key_path} is not an ECDSA key")
    _plan_files(directory, [_stem(role, name)])
    return _issue(directory, ca_cert, ca_key, role, name, tuple(hosts), days, trust_domain)


# ---- config ------------------------------------------------------------------------------


def _load_certs(path: Path, what: str) -> list[x509.Certificate]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TLSConfigError(f"{what} {path}: {exc.strerror}") from exc
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise TLSConfigError(f"{what} {path}: not a PEM certificate file ({exc})") from exc
    now = datetime.datetime.now(datetime.timezone.utc)
    for cert in certs:
        if cert.not_valid_after_utc < now:
            raise TLSConfigError(
                f"{what} {path}: certificate {cert.subject.rfc4514_string()} expired on "
                f"{cert.not_valid_after_utc.isoformat(timespec='seconds')}"
            )
    return certs


def _spki(public_key) -> bytes:
    return public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


@dataclass(frozen=True)
class TLSConfig:
    """One endpoint's TLS settings. Building one checks its files.

    * ``ca_file``: PEM CA certificate(s) to trust for the peer (required).
    * ``cert_file`` / ``key_file``: this endpoint's certificate chain and key. A server needs
      both. A client gives both (mTLS) or neither. The key file must be 0600 or stricter, and
      must match the certificate.
    * ``require_client_cert``: server side only. When true (the default), a client must present
      a certificate from ``ca_file`` (mTLS). When false, no client certificate is asked for, and
      ``peer_identity`` returns None.
    * ``server_name``: client side only. The name to check the server's certificate against,
      when it differs from the host in the address (grpc.ssl_target_name_override).
    """

    ca_file: Path
    cert_file: Optional[Path] = None
    key_file: Optional[Path] = None
    require_client_cert: bool = True
    server_name: Optional[str] = None

    def __post_init__(self) -> None:
        for attr in ("ca_file", "cert_file", "key_file"):
            value = getattr(self, attr)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, attr, Path(value))
        if not isinstance(self.require_client_cert, bool):
            raise TLSConfigError(f"require_client_cert must be true or false, got {self.require_client_cert!r}")
        name = self.server_name
        if name is not None and (not isinstance(name, str) or not name):
            raise TLSConfigError(f"server_name must be a non-empty string, got {self.server_name!r}")
        if (self.cert_file is None) != (self.key_file is None):
            given, missing = ("cert_file", "key_file")
            if self.cert_file is None:
                given, missing = missing, given
            raise TLSConfigError(f"{given} is set but {missing} is not; give both or neither")
        _load_certs(self.ca_file, "ca_file")
        if self.cert_file is None:
            return
        chain = _load_certs(self.cert_file, "cert_file")
        try:
            _check_key_mode(self.key_file, "key_file")
            key_data = self.key_file.read_bytes()
        except OSError as exc:
            raise TLSConfigError(f"key_file {self.key_file}: {exc.strerror}") from exc
        try:
            key = serialization.load_pem_private_key(key_data, password=None)
        except (ValueError, TypeError) as exc:
            raise TLSConfigError(f"key_file {self.key_file}: not an unencrypted PEM private key ({exc})") from exc
        if _spki(key.public_key()) != _spki(chain[0].public_key()):
            raise TLSConfigError(
                f"key_file {self.key_file} does not match the certificate in cert_file {self.cert_file}"
            )

    @property
    def has_identity(self) -> bool:
        """True when this endpoint presents a certificate."""
        return self.cert_file is not None

    @classmethod
    def from_mapping(
        cls,
        table: Mapping[str, Any],
        *,
        section: str = "tls",
        base_dir: str | os.PathLike = ".",
        server: bool = False,
    ) -> Optional["TLSConfig"]:
        """Read the TLS_KEYS of ``table``; relative paths are taken from ``base_dir``.

        Returns None when ``insecure = true``: plaintext, and the caller must ``warn_insecure``.
        Otherwise returns a checked TLSConfig. ``ca_file`` is required, and for a server
        (``server=True``) so are ``cert_file`` and ``key_file``. Errors start with ``[section]``.
        """
        base = Path(base_dir)
        insecure = table.get("insecure", False)
        if not isinstance(insecure, bool):
            raise TLSConfigError(f"[{section}] insecure must be true or false, got {insecure!r}")
        given = sorted(k for k in TLS_KEYS - {"insecure"} if k in table)
        if insecure:
            if given:
                raise TLSConfigError(
                    f"[{section}] insecure = true conflicts with {given}: choose plaintext "
                    f"(insecure = true, development only) or TLS (the file keys), not both"
                )
            return None
        required = ["ca_file"] + (["cert_file", "key_file"] if server else [])
        missing = [k for k in required if not table.get(k)]
        if missing:
            raise TLSConfigError(
                f"[{section}] {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                f"required for TLS (or set insecure = true to use plaintext, development only)"
            )

        def path(key: str) -> Optional[Path]:
            value = table.get(key)
            if value is None:
                return None
            if not isinstance(value, str) or not value:
                raise TLSConfigError(f"[{section}] {key} must be a file path, got {value!r}")
            p = Path(value).expanduser()
            return p if p.is_absolute() else base / p

        try:
            return cls(
                ca_file=path("ca_file"),
                cert_file=path("cert_file"),
                key_file=path("key_file"),
                require_client_cert=table.get("require_client_cert", True),
                server_name=table.get("server_name"),
            )
        except TLSConfigError as exc:
            raise TLSConfigError(f"[{section}] {exc}") from exc


def warn_insecure(logger: logging.Logger, what: str) -> None:
    """Log the warning to give whenever ``what`` runs plaintext (insecure = true)."""
    logger.warning(
        "INSECURE: %s uses PLAINTEXT gRPC (insecure = true): no encryption and no peer "
        "authentication. Anyone on the network can read the traffic, impersonate either side, "
        "and register as any worker. Use this only on a trusted development machine; production "
        "configs set ca_file/cert_file/key_file and require_client_cert = true (mTLS).",
        what,
    )


# ---- grpc ---------------------------------------------------------------------------------


def _read(path: Path, key: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TLSConfigError(f"{key} {path}: {exc.strerror}") from exc


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """Server credentials: this server's cert and key. When ``require_client_cert`` is set,
    every client must present a certificate that chains to ``ca_file`` (mTLS)."""
    if not tls.has_identity:
        raise TLSConfigError("a TLS server needs cert_file and key_file")
    return grpc.ssl_server_credentials(
        [(_read(tls.key_file, "key_file"), _read(tls.cert_file, "cert_file"))],
        root_certificates=_read(tls.ca_file, "ca_file"),
        require_client_auth=tls.require_client_cert,
    )


def channel_credentials(tls: TLSConfig) -> grpc.ChannelCredentials:
    """Client credentials: trust ``ca_file``, and present cert/key when they are given."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca_file, "ca_file"),
        private_key=_read(tls.key_file, "key_file") if tls.key_file else None,
        certificate_chain=_read(tls.cert_file, "cert_file") if tls.cert_file else None,
    )


def secure_channel(
    address: str,
    tls: Optional[TLSConfig],
    *,
    aio: bool = False,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[Any] = (),
):
    """A channel to ``address``: TLS with ``tls``, plaintext only when ``tls`` is None.

    The caller decides from its config (``TLSConfig.from_mapping`` returns None for
    insecure = true) and logs ``warn_insecure``. With ``aio=True`` it returns a grpc.aio.Channel.
    The server certificate is checked against the host in ``address``; an IP address matches
    an IP SAN. ``tls.server_name`` overrides that name. ``interceptors``: a grpc.aio
    channel's (a blocking channel is wrapped by its caller, grpc.intercept_channel).
    """
    options = list(options)
    if tls is None:
        if aio:
            return grpc.aio.insecure_channel(address, options=options, interceptors=list(interceptors) or None)
        return grpc.insecure_channel(address, options=options)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    if aio:
        return grpc.aio.secure_channel(
            address, channel_credentials(tls), options=options, interceptors=list(interceptors) or None
        )
    return grpc.secure_channel(address, channel_credentials(tls), options=options)


@dataclass(frozen=True)
class PeerIdentity:
    """The client certificate's subject. ``role`` is its single OU and ``name`` its single CN;
    either is None when it is absent or repeated. ``fingerprint`` is the lowercase hex SHA-256
    of the certificate's DER bytes."""

    role: Optional[str]
    name: Optional[str]
    fingerprint: str
    # Node ids named by SAN URIs spiffe://<trust-domain>/node/<node_id>.
    uri_nodes: tuple[str, ...] = ()

    def names_node(self, node_id: str) -> bool:
        """Whether this certificate may act as ``node_id``: its CN, or one of its
        node SAN URIs, is exactly that id."""
        return node_id == self.name or node_id in self.uri_nodes


def _uri_nodes(cert: x509.Certificate) -> tuple[str, ...]:
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ()
    found = (_NODE_URI.match(uri) for uri in sans.get_values_for_type(x509.UniformResourceIdentifier))
    return tuple(match.group(1) for match in found if match)


def _single(name: x509.Name, oid) -> Optional[str]:
    values = name.get_attributes_for_oid(oid)
    if len(values) != 1 or not isinstance(values[0].value, str):
        return None
    return values[0].value


def peer_identity(context) -> Optional[PeerIdentity]:
    """Who is calling, from a grpc / grpc.aio ServicerContext. None unless the call came over TLS
    with a client certificate.

    The certificate is verified by the handshake only when the server requires client certs
    (``require_client_cert = true``). Without that, gRPC asks for no certificate, and this returns
    None.
    """
    auth = context.auth_context() or {}
    if auth.get("transport_security_type") != [b"ssl"]:
        return None
    pems = auth.get("x509_pem_cert")
    if not pems:
        return None
    return _identity_of(pems[0])


# Every Nodes call asks who is calling: parse each client certificate once. Bounded (one
# entry per distinct certificate the handshake verified); PeerIdentity is frozen.
@functools.lru_cache(maxsize=16384)
def _identity_of(pem: bytes) -> Optional[PeerIdentity]:
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        return None
    return PeerIdentity(
        role=_single(cert.subject, NameOID.ORGANIZATIONAL_UNIT_NAME),
        name=_single(cert.subject, NameOID.COMMON_NAME),
        fingerprint=cert.fingerprint(hashes.SHA256()).hex(),
        uri_nodes=_uri_nodes(cert),
    )
