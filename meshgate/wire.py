"""Versions on the wire: every client and daemon says which release it is and which
wire contract it speaks, in the gRPC metadata of every call; the coordinator checks them
against its skew policy and records each node's.

The wire contract version (``WIRE_VERSION``) counts changes of the messages' meaning:
fields and enum values that a peer of an older wire version does not know. It moves by one
per release that changes the contract; the package version (``RELEASE``) names the build.

The skew policy (docs/operating.md, "Upgrading"): agents, clients and workers may speak up
to ``WIRE_SKEW`` wire versions older or newer than the coordinator. Outside it every call is
refused FAILED_PRECONDITION naming both versions and which side to upgrade. Inside it a
request that carries a field or an enum value this coordinator does not know (a newer
peer's) is refused naming the field and the wire version that lacks it, never dropped.

A peer that sends no version is the release before versions were sent (7736840, "stop 36"):
wire 0, release "0.1.0 (unversioned)"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import grpc
from google.protobuf import descriptor
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from meshgate import __version__

RELEASE = __version__
WIRE_VERSION = 1
# How many wire versions apart a peer and the coordinator may be (either way).
WIRE_SKEW = 1
# What a peer that sends no version is taken to be: the release before this one.
UNVERSIONED_WIRE = 0
UNVERSIONED_RELEASE = "0.1.0 (unversioned)"

RELEASE_KEY = "meshgate-release"
WIRE_KEY = "meshgate-wire"
MAX_RELEASE_LEN = 64  # what a peer's release may spell; longer is cut when shown
# What a NodeHardware may hold (the agent sends no more, the coordinator takes no more):
# GPUs or NICs per node (8 GPUs and a rail NIC each, with room), characters per string.
HARDWARE_MAX_DEVICES = 64
HARDWARE_MAX_TEXT = 128


@dataclass(frozen=True)
class PeerVersion:
    release: str
    wire: int

    @property
    def described(self) -> str:
        return f"release {self.release} (wire {self.wire})"


OWN = PeerVersion(RELEASE, WIRE_VERSION)
UNVERSIONED = PeerVersion(UNVERSIONED_RELEASE, UNVERSIONED_WIRE)
# An agent that sends no version and names no agent instance either (in its Join and its
# heartbeats) is older still: 91c899c and before, outside the policy. Its running jobs are
# served; what it lacks is refused naming it (LOG_RELAY_WIRE).
PRE_INSTANCES = PeerVersion("91c899c or older (unversioned, no agent instance)", UNVERSIONED_WIRE - 1)
# The wire version an agent needs for `meshgate job logs` (the relay through its heartbeats
# and PushLogs): every agent that names an instance has it.
LOG_RELAY_WIRE = UNVERSIONED_WIRE


def metadata() -> tuple[tuple[str, str], ...]:
    """What every call of this release carries."""
    return ((RELEASE_KEY, RELEASE), (WIRE_KEY, str(WIRE_VERSION)))


def peer_version(metadata_pairs: Optional[Iterable[tuple[str, object]]]) -> PeerVersion:
    """The peer's version from a call's metadata; no version: UNVERSIONED. A wire version
    that is no decimal integer is taken as -1, outside any policy (and so refused)."""
    release, wire = None, None
    for key, value in metadata_pairs or ():
        if key == RELEASE_KEY:
            release = str(value)[:MAX_RELEASE_LEN]
        elif key == WIRE_KEY:
            text = str(value)
            wire = int(text) if text.isdigit() and len(text) < 6 else -1
    if wire is None:
        return UNVERSIONED if release is None else PeerVersion(release, UNVERSIONED_WIRE)
    return PeerVersion(release or "unknown", wire)


def agent_version(metadata_pairs: Optional[Iterable[tuple[str, object]]], agent_instance: str) -> PeerVersion:
    """A node's agent's version from a Join or heartbeat: as ``peer_version``, told apart from
    the releases before agent instances by the instance it names."""
    peer = peer_version(metadata_pairs)
    return PRE_INSTANCES if peer == UNVERSIONED and not agent_instance else peer


def agent_lacks(feature: str, needs_wire: int, node_id: str, agent: Optional[PeerVersion]) -> Optional[str]:
    """Why ``node_id``'s agent (its last known version; None: not heard from since this
    coordinator started) cannot serve ``feature``, naming its version; None when it can."""
    if agent is None or agent.wire >= needs_wire:
        return None
    return (
        f"node {node_id}'s agent is {agent.described}, which has no {feature}: "
        "upgrade its agent (docs/operating.md, Upgrading)"
    )


def skew_refusal(peer: PeerVersion, own: PeerVersion = OWN, role: str = "client") -> Optional[str]:
    """Why ``peer`` is outside the skew policy of a coordinator at ``own``, naming both
    versions and what to upgrade; None inside it."""
    if abs(peer.wire - own.wire) <= WIRE_SKEW:
        return None
    upgrade = f"upgrade this {role}" if peer.wire < own.wire else "upgrade the coordinator"
    return (
        f"version skew: this {role} is {peer.described}, the coordinator {own.described}; "
        f"they may differ by at most {WIRE_SKEW} wire version: {upgrade} (docs/operating.md, Upgrading)"
    )


def unknown_in(request: Message, peer: PeerVersion, own: PeerVersion = OWN) -> Optional[str]:
    """A field or an enum value in ``request`` from a newer ``peer`` that this release does
    not know, named with the wire version that lacks it; None when it knows all. Walks the
    request and its singular message fields (a JobSpec, its plan); repeated entries (a
    RegisterBatch's thousands) are not walked."""
    if peer.wire <= own.wire:
        # Not skew: the servicers' own checks name what an older client's retired field was.
        return None
    found = _unknown(request, request.DESCRIPTOR.name)
    if found is None:
        return None
    return (
        f"{found}, which the coordinator's {own.described} does not know; the sender is "
        f"{peer.described}: upgrade the coordinator first (docs/operating.md, Upgrading)"
    )


def _unknown(message: Message, path: str) -> Optional[str]:
    unknown = UnknownFieldSet(message)
    if len(unknown):
        return f"{path} carries field number {unknown[0].field_number}"
    for field, value in message.ListFields():
        if field.is_repeated:
            continue
        if field.type == descriptor.FieldDescriptor.TYPE_ENUM and value not in field.enum_type.values_by_number:
            return f"{path}.{field.name} is {field.enum_type.name} value {value}"
        if field.type == descriptor.FieldDescriptor.TYPE_MESSAGE:
            found = _unknown(value, f"{path}.{field.name}")
            if found is not None:
                return found
    return None


# ---- the client side: every call of this release carries its versions ----------------------


def with_versions(given: Optional[Sequence[tuple[str, str]]]) -> list[tuple[str, str]]:
    pairs = [p for p in (given or ()) if p[0] not in (RELEASE_KEY, WIRE_KEY)]
    return pairs + list(metadata())


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details, metadata) -> None:
        self.method, self.timeout, self.metadata = details.method, details.timeout, metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class VersionInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """For a blocking channel (grpc.intercept_channel)."""

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_CallDetails(details, with_versions(details.metadata)), request)

    intercept_unary_stream = intercept_unary_unary

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(_CallDetails(details, with_versions(details.metadata)), requests)

    intercept_stream_stream = intercept_stream_unary


def _aio_details(details) -> grpc.aio.ClientCallDetails:
    return grpc.aio.ClientCallDetails(
        details.method,
        details.timeout,
        grpc.aio.Metadata(*with_versions(tuple(details.metadata or ()))),
        details.credentials,
        details.wait_for_ready,
    )


class AioUnaryVersions(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_aio_details(details), request)


class AioStreamVersions(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_aio_details(details), request)


def aio_interceptors() -> list:
    """For a grpc.aio channel (its ``interceptors``)."""
    return [AioUnaryVersions(), AioStreamVersions()]


__all__ = [
    "LOG_RELAY_WIRE",
    "OWN",
    "PRE_INSTANCES",
    "RELEASE",
    "UNVERSIONED",
    "WIRE_SKEW",
    "WIRE_VERSION",
    "PeerVersion",
    "VersionInterceptor",
    "agent_lacks",
    "agent_version",
    "aio_interceptors",
    "metadata",
    "peer_version",
    "skew_refusal",
    "unknown_in",
]
