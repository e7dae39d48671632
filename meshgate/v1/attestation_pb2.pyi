import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from meshgate.v1 import plan_pb2 as _plan_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Attestation(_message.Message):
    __slots__ = ("job_id", "generation", "plan", "plan_digest", "rank", "world_size", "local_rank", "node_rank", "node_id", "worker_id", "coordinate", "nonce", "issued_at", "expires_at", "key_id", "hardware")
    class CoordinateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    COORDINATE_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    generation: int
    plan: _plan_pb2.ParallelPlan
    plan_digest: bytes
    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    node_id: str
    worker_id: str
    coordinate: _containers.ScalarMap[str, int]
    nonce: bytes
    issued_at: _timestamp_pb2.Timestamp
    expires_at: _timestamp_pb2.Timestamp
    key_id: str
    hardware: WorkerHardware
    def __init__(self, job_id: _Optional[str] = ..., generation: _Optional[int] = ..., plan: _Optional[_Union[_plan_pb2.ParallelPlan, _Mapping]] = ..., plan_digest: _Optional[bytes] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., local_rank: _Optional[int] = ..., node_rank: _Optional[int] = ..., node_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., coordinate: _Optional[_Mapping[str, int]] = ..., nonce: _Optional[bytes] = ..., issued_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., key_id: _Optional[str] = ..., hardware: _Optional[_Union[WorkerHardware, _Mapping]] = ...) -> None: ...

class WorkerHardware(_message.Message):
    __slots__ = ("machine_id", "gpu_uuid", "gpu_pci_bus_id", "nvlink_domain", "rail_nics")
    MACHINE_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    GPU_PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    NVLINK_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    RAIL_NICS_FIELD_NUMBER: _ClassVar[int]
    machine_id: str
    gpu_uuid: str
    gpu_pci_bus_id: str
    nvlink_domain: str
    rail_nics: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, machine_id: _Optional[str] = ..., gpu_uuid: _Optional[str] = ..., gpu_pci_bus_id: _Optional[str] = ..., nvlink_domain: _Optional[str] = ..., rail_nics: _Optional[_Iterable[str]] = ...) -> None: ...

class SignedAttestation(_message.Message):
    __slots__ = ("payload", "signature", "key_id", "batch", "batch_index")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    signature: bytes
    key_id: str
    batch: bytes
    batch_index: int
    def __init__(self, payload: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., key_id: _Optional[str] = ..., batch: _Optional[bytes] = ..., batch_index: _Optional[int] = ...) -> None: ...

class AttestationBatch(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, entries: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PublicKey(_message.Message):
    __slots__ = ("key_id", "ed25519", "not_after")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    ED25519_FIELD_NUMBER: _ClassVar[int]
    NOT_AFTER_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    ed25519: bytes
    not_after: _timestamp_pb2.Timestamp
    def __init__(self, key_id: _Optional[str] = ..., ed25519: _Optional[bytes] = ..., not_after: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class TrustBundle(_message.Message):
    __slots__ = ("job_id", "keys", "version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    keys: _containers.RepeatedCompositeFieldContainer[PublicKey]
    version: int
    def __init__(self, job_id: _Optional[str] = ..., keys: _Optional[_Iterable[_Union[PublicKey, _Mapping]]] = ..., version: _Optional[int] = ...) -> None: ...

class Endorsement(_message.Message):
    __slots__ = ("key_id", "signature")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    signature: bytes
    def __init__(self, key_id: _Optional[str] = ..., signature: _Optional[bytes] = ...) -> None: ...

class SignedTrustBundle(_message.Message):
    __slots__ = ("payload", "endorsements")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    ENDORSEMENTS_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    endorsements: _containers.RepeatedCompositeFieldContainer[Endorsement]
    def __init__(self, payload: _Optional[bytes] = ..., endorsements: _Optional[_Iterable[_Union[Endorsement, _Mapping]]] = ...) -> None: ...

class VouchClaims(_message.Message):
    __slots__ = ("job_id", "node_id", "generation", "local_rank", "vouch_id", "expires_at", "rank")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    VOUCH_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    node_id: str
    generation: int
    local_rank: int
    vouch_id: bytes
    expires_at: _timestamp_pb2.Timestamp
    rank: int
    def __init__(self, job_id: _Optional[str] = ..., node_id: _Optional[str] = ..., generation: _Optional[int] = ..., local_rank: _Optional[int] = ..., vouch_id: _Optional[bytes] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., rank: _Optional[int] = ...) -> None: ...

class WorkerVouch(_message.Message):
    __slots__ = ("payload", "signature")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    signature: bytes
    def __init__(self, payload: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...
