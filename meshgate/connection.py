"""One way to reach a coordinator: its settings, its transport, failover, polling.

Every caller (the worker client, the node agent, the admin client, the ``meshgate`` CLI and
the launchers) builds its channel here, so they all read the same settings the same way and
fail over the same way.

Settings, each from the first place that gives it:

1. arguments: the CLI's flags (``--coordinator``, ``--ca-file`` ...), or a library call's
   keywords (``coordinator=``, ``tls=``);
2. the environment: ``MESHGATE_COORDINATOR``, ``MESHGATE_TLS_CA`` / ``MESHGATE_TLS_CERT`` /
   ``MESHGATE_TLS_KEY`` / ``MESHGATE_TLS_SERVER_NAME``, ``MESHGATE_INSECURE=1``,
   ``MESHGATE_ADMIN_TOKEN`` / ``MESHGATE_ADMIN_TOKEN_FILE``;
3. the client config file (``$MESHGATE_CLIENT_CONFIG``, else ``$XDG_CONFIG_HOME/meshgate/client.toml``,
   else ``~/.config/meshgate/client.toml``), one table per context, as kubectl's contexts::

       current_context = "prod"

       [contexts.prod]
       coordinator = "head-a:7443,head-b:7443"   # an HA list: failover in order
       tls_ca = "prod/ca.pem"                     # paths relative to this file
       tls_cert = "prod/admin.pem"
       tls_key = "prod/admin.key"                 # a secret file: 0600 or stricter
       # tls_server_name = "coordinator", admin_token_file = "...", insecure = true (dev only)

   ``--context NAME`` (or ``MESHGATE_CONTEXT``) picks another context.

The transport is one setting, never mixed across places: the first place that says anything
about it (a TLS file, a server name, or insecure) gives all of it. So a worker's
``MESHGATE_TLS_CA`` is never paired with an admin key from a config file. TLS needs a CA;
plaintext is chosen only by saying insecure; with neither the caller gets one error that names
the flags, the variables and the config file, before any byte is sent. Every setting remembers
where it came from, and errors say so.

Failover: ``coordinator`` may list the coordinators of an HA pair (``"a:7443,b:7443"``); a
standby answers UNAVAILABLE naming the leader in the ``meshgate-leader`` trailing metadata
(meshgate.endpoints), and the call goes there next, else to the next address.
"""

from __future__ import annotations

import os
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, TypeVar

import grpc

from meshgate import wire
from meshgate.endpoints import FAILOVER_CODES, Endpoints, leader_hint
from meshgate.tls import TLSConfig, TLSConfigError, secure_channel

CONFIG_ENV = "MESHGATE_CLIENT_CONFIG"
CONTEXT_ENV = "MESHGATE_CONTEXT"
# The settings, by their name in a config file's context (and in ``resolve``'s ``given``).
ENV_NAMES = {
    "coordinator": "MESHGATE_COORDINATOR",
    "tls_ca": "MESHGATE_TLS_CA",
    "tls_cert": "MESHGATE_TLS_CERT",
    "tls_key": "MESHGATE_TLS_KEY",
    "tls_server_name": "MESHGATE_TLS_SERVER_NAME",
    "insecure": "MESHGATE_INSECURE",
    "admin_token": "MESHGATE_ADMIN_TOKEN",
    "admin_token_file": "MESHGATE_ADMIN_TOKEN_FILE",
}
FLAG_NAMES = {
    "coordinator": "--coordinator",
    "tls_ca": "--ca-file",
    "tls_cert": "--cert-file",
    "tls_key": "--key-file",
    "tls_server_name": "--server-name",
    "insecure": "--insecure",
    "admin_token_file": "--admin-token-file",
    "context": "--context",
}
ARGUMENT_NAMES = {"coordinator": "coordinator=", "tls": "tls=", "admin_token": "admin_token="}
CONTEXT_KEYS = frozenset(
    {"coordinator", "tls_ca", "tls_cert", "tls_key", "tls_server_name", "insecure", "admin_token_file"}
)
TRANSPORT_KEYS = ("tls", "tls_ca", "tls_cert", "tls_key", "tls_server_name", "insecure")
ADMIN_TOKEN_KEYS = ("admin_token", "admin_token_file")
_TRUE = ("1", "true", "yes")


class ClientConfigError(ValueError):
    """A setting the caller must give and did not, or gave wrong; the message names where."""


class RendezvousRefused(RuntimeError):
    """The coordinator refused; ``code`` is the gRPC status, the message says why.
    ``address``: the coordinator that answered last ("" when unknown)."""

    def __init__(self, code: grpc.StatusCode, details: str, address: str = "") -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.address = address

    def __reduce__(self):
        # Exception pickles as cls(*self.args), and args holds the one formatted string:
        # a Ray driver would get a TypeError instead of the refusal. Rebuild from the parts.
        return (type(self), (self.code, self.details, self.address))


# ---- settings ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layer:
    """One place settings come from: its values and how to name each of them."""

    values: Mapping[str, Any]
    name_of: Callable[[str], str]
    base_dir: Optional[Path] = None  # relative paths are taken from here (a config file's directory)

    def gives(self, key: str) -> bool:
        value = self.values.get(key)
        if key == "tls":
            return value is not None  # a TLSConfig, or False: plaintext
        if key == "insecure" and isinstance(value, str):
            return value.lower() in _TRUE  # MESHGATE_INSECURE=0 says "not plaintext", not "TLS from here"
        return value not in (None, "", False)

    def path(self, key: str) -> Optional[Path]:
        value = self.values.get(key)
        if not value:
            return None
        path = Path(value).expanduser()
        return path if path.is_absolute() or self.base_dir is None else self.base_dir / path


def default_config_path(environ: Mapping[str, str] = os.environ) -> Path:
    """Where the client config file is looked for (it need not exist)."""
    if environ.get(CONFIG_ENV):
        return Path(environ[CONFIG_ENV]).expanduser()
    base = environ.get("XDG_CONFIG_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".config")
    return Path(base) / "meshgate" / "client.toml"


def _context_layer(path: Path, context: str, context_from: str, environ: Mapping[str, str]) -> Optional[_Layer]:
    """The chosen context of the client config file; None when there is no file and none was asked for."""
    explicit_file = bool(environ.get(CONFIG_ENV))
    try:
        with open(path, "rb") as handle:
            document = tomllib.load(handle)
    except FileNotFoundError:
        if explicit_file:
            raise ClientConfigError(f"client config {path} (from {CONFIG_ENV}) does not exist") from None
        if context:
            raise ClientConfigError(f"context {context!r} (from {context_from}): there is no client config {path}")
        return None
    except OSError as exc:
        raise ClientConfigError(f"client config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ClientConfigError(f"client config {path}: invalid TOML: {exc}") from None
    unknown = sorted(set(document) - {"current_context", "contexts"})
    if unknown:
        raise ClientConfigError(
            f"client config {path}: unknown key(s) {unknown}; it has current_context and [contexts.NAME] tables"
        )
    contexts = document.get("contexts", {})
    if not isinstance(contexts, dict) or not all(isinstance(t, dict) for t in contexts.values()):
        raise ClientConfigError(f"client config {path}: contexts must be tables, [contexts.NAME]")
    if not context:
        context, context_from = document.get("current_context", ""), f"current_context in {path}"
        if not isinstance(context, str):
            raise ClientConfigError(f"client config {path}: current_context must be a string")
        if not context:
            return None
    if context not in contexts:
        raise ClientConfigError(
            f"context {context[:64]!r} (from {context_from}) is not in {path}; "
            f"its contexts: {sorted(contexts) or 'none'}"
        )
    table = contexts[context]
    where = f"context {context!r} in {path}"
    bad = sorted(set(table) - CONTEXT_KEYS)
    if bad:
        raise ClientConfigError(f"{where}: unknown key(s) {bad}; known: {sorted(CONTEXT_KEYS)}")
    for key, value in table.items():
        if not isinstance(value, bool if key == "insecure" else str):
            kind = "true or false" if key == "insecure" else "a string"
            raise ClientConfigError(f"{where}: {key} must be {kind}, got {str(value)[:64]!r}")
    return _Layer(table, lambda key: f"{key} in {where}", base_dir=path.parent)


def _transport(layer: _Layer) -> Optional[TLSConfig]:
    """The TLSConfig of the one layer that gives the transport; None for plaintext."""
    given = layer.values.get("tls")
    if isinstance(given, TLSConfig) or given is False:
        return given or None
    files = [k for k in ("tls_ca", "tls_cert", "tls_key", "tls_server_name") if layer.gives(k)]
    if layer.gives("insecure"):
        if files:
            raise ClientConfigError(
                f"{layer.name_of('insecure')} conflicts with {', '.join(layer.name_of(k) for k in files)}: "
                f"choose plaintext (development only) or TLS, not both"
            )
        return None
    if not layer.gives("tls_ca"):
        raise ClientConfigError(
            f"{', '.join(layer.name_of(k) for k in files)} without {layer.name_of('tls_ca')}: TLS needs the CA "
            f"to trust, from the same place (the TLS settings come together: flags, MESHGATE_TLS_*, or a context)"
        )
    try:
        return TLSConfig(
            ca_file=layer.path("tls_ca"),
            cert_file=layer.path("tls_cert"),
            key_file=layer.path("tls_key"),
            require_client_cert=False,
            server_name=layer.values.get("tls_server_name") or None,
        )
    except TLSConfigError as exc:
        raise ClientConfigError(f"{exc} (TLS settings from {', '.join(layer.name_of(k) for k in files)})") from None


def _admin_token(layer: _Layer) -> str:
    if layer.gives("admin_token"):
        return str(layer.values["admin_token"]).strip()
    from meshgate.secret_files import SecretFileError, read_secret

    try:
        return read_secret(layer.path("admin_token_file"), layer.name_of("admin_token_file")).decode().strip()
    except (SecretFileError, UnicodeDecodeError) as exc:
        raise ClientConfigError(str(exc)) from None


# ---- the connection -----------------------------------------------------------------------------


@dataclass
class Connection:
    """The settled way to one coordinator (or an HA list of them): its addresses, its
    transport (``tls`` None: plaintext, chosen explicitly), the admin token if any, and where
    each came from. ``call`` and ``stream`` fail over, over one channel kept across calls;
    ``channel`` opens a new one to the current address (for a caller that keeps its own).

    The kept channel: a TLS handshake per Connection, not per call (a worker's heartbeat every
    few seconds paid one each). It is dropped when a call fails with a failover code, so the
    next call connects afresh (to the next address, or the same one at once, rather than after
    gRPC's reconnect backoff); a call still running on it keeps it until it ends, and gRPC
    closes a channel no one holds. ``close()`` (or ``with``) closes it; a Connection dropped
    unclosed releases it when collected."""

    coordinator: str
    tls: Optional[TLSConfig]
    admin_token: str = ""
    sources: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            self.endpoints = Endpoints(self.coordinator)
        except ValueError as exc:
            raise ClientConfigError(f"{exc} (from {self.source('coordinator')})") from None
        self._kept: Optional[tuple[str, grpc.Channel]] = None  # (address, channel to it)
        self._kept_lock = threading.Lock()  # a Connection may be shared by threads

    def __getstate__(self) -> dict:
        # A channel does not pickle (a launcher may ship its settings to a Ray actor): the
        # copy opens its own on its first call.
        state = dict(self.__dict__)
        state["_kept"], state["_kept_lock"] = None, None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _kept_lock=threading.Lock())

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Close the kept channel (a later call opens a new one)."""
        with self._kept_lock:
            kept, self._kept = self._kept, None
        if kept is not None:
            kept[1].close()

    def kept_channel(self) -> grpc.Channel:
        """The channel ``call`` and ``stream`` use: to the current address, opened on first
        use and kept until a failure drops it or the address moves on."""
        with self._kept_lock:
            address = self.current
            if self._kept is None or self._kept[0] != address:
                self._kept = (address, self.channel())
            return self._kept[1]

    def _drop(self, channel: grpc.Channel) -> None:
        """After a failover code on ``channel``: the next call opens a new one."""
        with self._kept_lock:
            if self._kept is not None and self._kept[1] is channel:
                self._kept = None

    @classmethod
    def resolve(
        cls,
        given: Optional[Mapping[str, Any]] = None,
        *,
        names: Mapping[str, str] = ARGUMENT_NAMES,
        admin: bool = False,
        environ: Optional[Mapping[str, str]] = None,
    ) -> "Connection":
        """The settings from ``given`` (the caller's arguments or flags, named by ``names``;
        None values are "not given"), then the environment, then the client config file's
        context. ``admin``: also settle the admin token, if any place gives one."""
        environ = os.environ if environ is None else environ
        given = dict(given or {})
        argument = _Layer(given, lambda key: names.get(key, key))
        env = _Layer({k: environ.get(v) for k, v in ENV_NAMES.items()}, ENV_NAMES.__getitem__)
        layers = [argument, env]
        context, context_from = given.get("context"), names.get("context", "context=")
        if not context and environ.get(CONTEXT_ENV):
            context, context_from = environ[CONTEXT_ENV], CONTEXT_ENV
        config = default_config_path(environ)

        def first(keys: Sequence[str]) -> Optional[_Layer]:
            for layer in layers:
                if any(layer.gives(k) for k in keys):
                    return layer
            if len(layers) == 2:  # the file is read only when the arguments and environment left a gap
                file_layer = _context_layer(config, context or "", context_from, environ)
                layers.append(file_layer or _Layer({}, str))
                return first(keys)
            return None

        where = f"a context of {config} ({', '.join(sorted(CONTEXT_KEYS - {'admin_token_file'}))})"
        source = first(("coordinator",))
        if source is None:
            raise ClientConfigError(
                f"coordinator is not set: pass {names.get('coordinator', 'coordinator=')} or set MESHGATE_COORDINATOR "
                f"(HOST:PORT, or an HA list), or name it in {where}"
            )
        sources = {"coordinator": source.name_of("coordinator")}
        coordinator = str(source.values["coordinator"])
        source = first(TRANSPORT_KEYS)
        if source is None:
            flags = (
                " or ".join(names[k] for k in ("tls_ca", "insecure") if k in names)
                if "tls_ca" in names
                else names.get("tls", "tls=")
            )
            raise ClientConfigError(
                f"no transport security configured for coordinator {coordinator}: set MESHGATE_TLS_CA (plus "
                f"MESHGATE_TLS_CERT and MESHGATE_TLS_KEY for mTLS), or MESHGATE_INSECURE=1 for a plaintext dev "
                f"coordinator; or pass {flags}; or name them in {where}"
            )
        tls = _transport(source)
        sources["transport"] = ", ".join(source.name_of(k) for k in TRANSPORT_KEYS if source.gives(k))
        token = ""
        if admin:
            source = first(ADMIN_TOKEN_KEYS)
            if source is not None:
                token = _admin_token(source)
                sources["admin_token"] = next(source.name_of(k) for k in ADMIN_TOKEN_KEYS if source.gives(k))
        return cls(coordinator, tls, token, sources)

    def source(self, setting: str) -> str:
        return self.sources.get(setting, "the caller")

    @property
    def current(self) -> str:
        return self.endpoints.current

    def describe(self) -> str:
        """One line: where it goes and how, and where those came from (for errors)."""
        how = (
            "plaintext" if self.tls is None else "TLS" + (" with a client certificate" if self.tls.has_identity else "")
        )
        return (
            f"coordinator {self.coordinator} (from {self.source('coordinator')}), {how} "
            f"(from {self.source('transport')})"
        )

    def channel(self, *, aio: bool = False, options: Sequence[tuple[str, Any]] = ()):
        """A channel to the current address (a ``unix:`` one, a node agent's fan-in socket,
        is plaintext: the socket's file mode and the vouch guard it)."""
        tls = None if self.current.startswith("unix:") else self.tls
        # Every call carries this release's versions (meshgate/wire.py): the coordinator
        # checks them against its skew policy.
        if aio:
            return secure_channel(self.current, tls, aio=True, options=options, interceptors=wire.aio_interceptors())
        return grpc.intercept_channel(secure_channel(self.current, tls, options=options), wire.VersionInterceptor())

    def fail_over(self, error: Optional[grpc.RpcError] = None) -> bool:
        """Move on after ``error``: to the leader it names, else the next address. True if it moved."""
        before = self.current
        return self.endpoints.failed(error) != before

    @property
    def admin_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.admin_token}"),) if self.admin_token else ()

    def stream(
        self,
        stub_class,
        method: str,
        request,
        *,
        timeout: Optional[float],
        metadata: Sequence[tuple[str, str]] = (),
    ) -> Iterator:
        """A server-streaming call's messages as they come (``timeout`` None: no deadline,
        e.g. a follow). It fails over as an idempotent call does, but only until its first
        message: after that an error ends it. Raises RendezvousRefused."""
        deadline = time.monotonic() + (timeout or 10.0)
        delay = 0.05
        while True:
            address, received = self.current, False
            channel = self.kept_channel()
            try:
                call = getattr(stub_class(channel), method)
                messages = call(request, timeout=timeout, metadata=tuple(metadata) or None)
                try:
                    for message in messages:
                        received = True
                        yield message
                finally:  # a reader that stops early ends the call, not the kept channel
                    messages.cancel()
                return
            except grpc.RpcError as exc:
                if exc.code() in FAILOVER_CODES:
                    self._drop(channel)
                if received or exc.code() not in FAILOVER_CODES or time.monotonic() + delay >= deadline:
                    raise refused(exc, method, address) from None
                self.fail_over(exc)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def call(
        self,
        stub_class,
        method: str,
        request,
        *,
        timeout: float,
        idempotent: bool = True,
        metadata: Sequence[tuple[str, str]] = (),
    ):
        """One unary call, failing over across the addresses until ``timeout`` runs out.
        A call that is not safe to repeat (``idempotent=False``) moves on only when the first
        coordinator certainly did not act on it: a standby refused it naming the leader, or
        no connection was made. Raises RendezvousRefused."""
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            remaining = deadline - time.monotonic()
            address = self.current
            channel = self.kept_channel()
            try:
                return getattr(stub_class(channel), method)(
                    request, timeout=max(remaining, 0.1), metadata=tuple(metadata) or None
                )
            except grpc.RpcError as exc:
                if exc.code() in FAILOVER_CODES:
                    self._drop(channel)
                repeatable = idempotent or leader_hint(exc) or _not_sent(exc)
                if exc.code() not in FAILOVER_CODES or not repeatable or time.monotonic() + delay >= deadline:
                    raise refused(exc, method, address) from None
                self.fail_over(exc)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


def refused(error: grpc.RpcError, method: str, address: str) -> RendezvousRefused:
    """``error`` as RendezvousRefused; a call the coordinator does not have (UNIMPLEMENTED,
    gRPC's "Method not found!") names the call and which side to upgrade."""
    details = error.details() or ""
    if error.code() == grpc.StatusCode.UNIMPLEMENTED:
        details = (
            f"{method}: the coordinator has no such call: it is older than this client (release "
            f"{wire.RELEASE}, wire {wire.WIRE_VERSION}); upgrade the coordinator (docs/operating.md, Upgrading)"
        )
    return RendezvousRefused(error.code(), details, address)


def _not_sent(error: grpc.RpcError) -> bool:
    # gRPC's words for a call that never left: no connection to the address could be made.
    return (error.details() or "").startswith("failed to connect to all addresses")


def connect(target: "Connection | str | None" = None, *, admin: bool = False, **given: Any) -> Connection:
    """``target`` as a Connection: a Connection as it is, else one resolved with ``target``
    as the coordinator and ``given`` (``tls=`` a TLSConfig, or False for plaintext;
    ``admin_token=``) as the caller's arguments."""
    if isinstance(target, Connection):
        return target
    return Connection.resolve({"coordinator": target, **given}, admin=admin)


def refusal_line(refusal: RendezvousRefused, connection: Optional[Connection] = None) -> str:
    """A refusal as one line: the coordinator that answered, and after UNAVAILABLE what to
    check (never a bare "Socket closed")."""
    where = refusal.address or (connection.current if connection is not None else "")
    line = f"coordinator {where}: {refusal}"
    if refusal.code != grpc.StatusCode.UNAVAILABLE or connection is None:
        return line
    return (
        f"{line} (is it running, and does it speak what this client does? {connection.describe()}; "
        f"a TLS coordinator closes a plaintext client's socket, and a plaintext one fails a TLS handshake)"
    )


# ---- the CLI's flags -----------------------------------------------------------------------------


def add_arguments(parser) -> None:
    """The connection flags of every ``meshgate`` command that calls a coordinator."""
    parser = parser.add_argument_group(
        "connection",
        "each setting from its flag, else MESHGATE_*, else the client config file's context "
        "($MESHGATE_CLIENT_CONFIG, else ~/.config/meshgate/client.toml)",
    )
    parser.add_argument(
        "--coordinator",
        help="HOST:PORT, or an HA list a:7443,b:7443 "
        "(default: $MESHGATE_COORDINATOR, else the client config's context)",
    )
    parser.add_argument(
        "--context", help="the client config's context to use (default: $MESHGATE_CONTEXT, else its current_context)"
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="RPC timeout in seconds")
    parser.add_argument("--ca-file", help="TLS: CA to trust for the coordinator (default: $MESHGATE_TLS_CA)")
    parser.add_argument("--cert-file", help="mTLS: client certificate, e.g. an admin one ($MESHGATE_TLS_CERT)")
    parser.add_argument("--key-file", help="mTLS: its key, mode 0600 ($MESHGATE_TLS_KEY)")
    parser.add_argument("--server-name", help="TLS: name to check the coordinator's certificate against")
    parser.add_argument(
        "--insecure", action="store_true", help="plaintext, for a development coordinator ($MESHGATE_INSECURE=1)"
    )
    parser.add_argument(
        "--admin-token-file", help="file with the admin token, mode 0600 (default: $MESHGATE_ADMIN_TOKEN_FILE)"
    )


def from_arguments(args) -> Connection:
    """The Connection the flags of ``add_arguments`` (then the environment, then the client config) give."""
    given = {
        "coordinator": args.coordinator,
        "context": args.context,
        "tls_ca": args.ca_file,
        "tls_cert": args.cert_file,
        "tls_key": args.key_file,
        "tls_server_name": args.server_name,
        "insecure": True if args.insecure else None,
        "admin_token_file": args.admin_token_file,
    }
    return Connection.resolve(given, names=FLAG_NAMES, admin=True)


# ---- polling ---------------------------------------------------------------------------------------

T = TypeVar("T")


def poll(fetch: Callable[[], T], *, every_s: float, for_s: Optional[float] = None) -> Iterator[T]:
    """``fetch()``, then again every ``every_s`` seconds, yielding each answer; stop after
    ``for_s`` seconds (None: never). The caller breaks out when it has what it waits for; a
    loop that ends without a break ran out of time."""
    deadline = None if for_s is None else time.monotonic() + for_s
    while True:
        yield fetch()
        if deadline is not None and time.monotonic() + every_s > deadline:
            return
        time.sleep(every_s)


__all__ = [
    "ClientConfigError",
    "Connection",
    "RendezvousRefused",
    "add_arguments",
    "connect",
    "default_config_path",
    "from_arguments",
    "poll",
    "refusal_line",
]
