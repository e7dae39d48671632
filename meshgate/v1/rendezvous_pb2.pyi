import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from meshgate.v1 import attestation_pb2 as _attestation_pb2
from meshgate.v1 import plan_pb2 as _plan_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    PENDING: _ClassVar[JobState]
    RUNNING: _ClassVar[JobState]
    SUCCEEDED: _ClassVar[JobState]
    FAILED: _ClassVar[JobState]
    CANCELLED: _ClassVar[JobState]

class PoolState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOL_STATE_UNSPECIFIED: _ClassVar[PoolState]
    POOL_STATE_IDLE: _ClassVar[PoolState]
    POOL_STATE_SERVING: _ClassVar[PoolState]
    POOL_STATE_CLEARING: _ClassVar[PoolState]
    POOL_STATE_LEFT: _ClassVar[PoolState]
    POOL_STATE_CORDONED: _ClassVar[PoolState]
    POOL_STATE_QUARANTINED: _ClassVar[PoolState]
    POOL_STATE_UNHEALTHY: _ClassVar[PoolState]
    POOL_STATE_DRAINING: _ClassVar[PoolState]

class NodeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_STATE_UNSPECIFIED: _ClassVar[NodeState]
    NODE_STATE_ACTIVE: _ClassVar[NodeState]
    NODE_STATE_SPARE: _ClassVar[NodeState]
    NODE_STATE_LOST: _ClassVar[NodeState]
    NODE_STATE_LEFT: _ClassVar[NodeState]
    NODE_STATE_REPLACED: _ClassVar[NodeState]

class RankMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RANK_MODE_UNSPECIFIED: _ClassVar[RankMode]
    RANK_MODE_ASSIGNED: _ClassVar[RankMode]
    RANK_MODE_CLAIMED: _ClassVar[RankMode]

class LaunchMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LAUNCH_MODE_UNSPECIFIED: _ClassVar[LaunchMode]
    LAUNCH_MODE_PER_SLOT: _ClassVar[LaunchMode]
    LAUNCH_MODE_PER_NODE: _ClassVar[LaunchMode]

class TopologyPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOPOLOGY_POLICY_UNSPECIFIED: _ClassVar[TopologyPolicy]
    TOPOLOGY_POLICY_WARN: _ClassVar[TopologyPolicy]
    TOPOLOGY_POLICY_REFUSE: _ClassVar[TopologyPolicy]
    TOPOLOGY_POLICY_ALLOW: _ClassVar[TopologyPolicy]

class RestartPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESTART_POLICY_UNSPECIFIED: _ClassVar[RestartPolicy]
    RESTART_POLICY_NEVER: _ClassVar[RestartPolicy]
    RESTART_POLICY_ON_FAILURE: _ClassVar[RestartPolicy]

class TimelineMoment(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIMELINE_MOMENT_UNSPECIFIED: _ClassVar[TimelineMoment]
    TIMELINE_SUBMITTED: _ClassVar[TimelineMoment]
    TIMELINE_ALLOCATED: _ClassVar[TimelineMoment]
    TIMELINE_NODE_JOINED: _ClassVar[TimelineMoment]
    TIMELINE_RANKS_REGISTERED: _ClassVar[TimelineMoment]
    TIMELINE_WORLD_FORMED: _ClassVar[TimelineMoment]
    TIMELINE_GENERATION_CHANGED: _ClassVar[TimelineMoment]
    TIMELINE_NODE_CHANGED: _ClassVar[TimelineMoment]
    TIMELINE_WORKERS_EXITED: _ClassVar[TimelineMoment]
    TIMELINE_JOB_FAILED: _ClassVar[TimelineMoment]
    TIMELINE_ENDED: _ClassVar[TimelineMoment]
    TIMELINE_LOG_PRUNED: _ClassVar[TimelineMoment]
    TIMELINE_PROGRESS: _ClassVar[TimelineMoment]
JOB_STATE_UNSPECIFIED: JobState
PENDING: JobState
RUNNING: JobState
SUCCEEDED: JobState
FAILED: JobState
CANCELLED: JobState
POOL_STATE_UNSPECIFIED: PoolState
POOL_STATE_IDLE: PoolState
POOL_STATE_SERVING: PoolState
POOL_STATE_CLEARING: PoolState
POOL_STATE_LEFT: PoolState
POOL_STATE_CORDONED: PoolState
POOL_STATE_QUARANTINED: PoolState
POOL_STATE_UNHEALTHY: PoolState
POOL_STATE_DRAINING: PoolState
NODE_STATE_UNSPECIFIED: NodeState
NODE_STATE_ACTIVE: NodeState
NODE_STATE_SPARE: NodeState
NODE_STATE_LOST: NodeState
NODE_STATE_LEFT: NodeState
NODE_STATE_REPLACED: NodeState
RANK_MODE_UNSPECIFIED: RankMode
RANK_MODE_ASSIGNED: RankMode
RANK_MODE_CLAIMED: RankMode
LAUNCH_MODE_UNSPECIFIED: LaunchMode
LAUNCH_MODE_PER_SLOT: LaunchMode
LAUNCH_MODE_PER_NODE: LaunchMode
TOPOLOGY_POLICY_UNSPECIFIED: TopologyPolicy
TOPOLOGY_POLICY_WARN: TopologyPolicy
TOPOLOGY_POLICY_REFUSE: TopologyPolicy
TOPOLOGY_POLICY_ALLOW: TopologyPolicy
RESTART_POLICY_UNSPECIFIED: RestartPolicy
RESTART_POLICY_NEVER: RestartPolicy
RESTART_POLICY_ON_FAILURE: RestartPolicy
TIMELINE_MOMENT_UNSPECIFIED: TimelineMoment
TIMELINE_SUBMITTED: TimelineMoment
TIMELINE_ALLOCATED: TimelineMoment
TIMELINE_NODE_JOINED: TimelineMoment
TIMELINE_RANKS_REGISTERED: TimelineMoment
TIMELINE_WORLD_FORMED: TimelineMoment
TIMELINE_GENERATION_CHANGED: TimelineMoment
TIMELINE_NODE_CHANGED: TimelineMoment
TIMELINE_WORKERS_EXITED: TimelineMoment
TIMELINE_JOB_FAILED: TimelineMoment
TIMELINE_ENDED: TimelineMoment
TIMELINE_LOG_PRUNED: TimelineMoment
TIMELINE_PROGRESS: TimelineMoment

class AssignedRank(_message.Message):
    __slots__ = ("local_rank",)
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    local_rank: int
    def __init__(self, local_rank: _Optional[int] = ...) -> None: ...

class ClaimedRank(_message.Message):
    __slots__ = ("rank", "local_rank")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    rank: int
    local_rank: int
    def __init__(self, rank: _Optional[int] = ..., local_rank: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("job_id", "worker_id", "nonce", "node_id", "assigned", "claimed", "plan_digest", "generation", "endpoint_host", "endpoint_port", "vouch")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_HOST_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_PORT_FIELD_NUMBER: _ClassVar[int]
    VOUCH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    worker_id: str
    nonce: bytes
    node_id: str
    assigned: AssignedRank
    claimed: ClaimedRank
    plan_digest: bytes
    generation: int
    endpoint_host: str
    endpoint_port: int
    vouch: _attestation_pb2.WorkerVouch
    def __init__(self, job_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., nonce: _Optional[bytes] = ..., node_id: _Optional[str] = ..., assigned: _Optional[_Union[AssignedRank, _Mapping]] = ..., claimed: _Optional[_Union[ClaimedRank, _Mapping]] = ..., plan_digest: _Optional[bytes] = ..., generation: _Optional[int] = ..., endpoint_host: _Optional[str] = ..., endpoint_port: _Optional[int] = ..., vouch: _Optional[_Union[_attestation_pb2.WorkerVouch, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("attestation", "heartbeat_secret")
    ATTESTATION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_SECRET_FIELD_NUMBER: _ClassVar[int]
    attestation: _attestation_pb2.SignedAttestation
    heartbeat_secret: bytes
    def __init__(self, attestation: _Optional[_Union[_attestation_pb2.SignedAttestation, _Mapping]] = ..., heartbeat_secret: _Optional[bytes] = ...) -> None: ...

class AwaitWorldRequest(_message.Message):
    __slots__ = ("job_id", "generation", "timeout_ms", "include_members", "worker_id", "heartbeat_secret")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_SECRET_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    generation: int
    timeout_ms: int
    include_members: bool
    worker_id: str
    heartbeat_secret: bytes
    def __init__(self, job_id: _Optional[str] = ..., generation: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., include_members: _Optional[bool] = ..., worker_id: _Optional[str] = ..., heartbeat_secret: _Optional[bytes] = ...) -> None: ...

class WorldMember(_message.Message):
    __slots__ = ("rank", "node_id", "node_rank", "worker_id")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node_id: str
    node_rank: int
    worker_id: str
    def __init__(self, rank: _Optional[int] = ..., node_id: _Optional[str] = ..., node_rank: _Optional[int] = ..., worker_id: _Optional[str] = ...) -> None: ...

class World(_message.Message):
    __slots__ = ("job_id", "generation", "world_size", "master_addr", "master_port", "plan_digest", "members")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    generation: int
    world_size: int
    master_addr: str
    master_port: int
    plan_digest: bytes
    members: _containers.RepeatedCompositeFieldContainer[WorldMember]
    def __init__(self, job_id: _Optional[str] = ..., generation: _Optional[int] = ..., world_size: _Optional[int] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., plan_digest: _Optional[bytes] = ..., members: _Optional[_Iterable[_Union[WorldMember, _Mapping]]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("job_id", "worker_id", "generation", "heartbeat_secret")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_SECRET_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    worker_id: str
    generation: int
    heartbeat_secret: bytes
    def __init__(self, job_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., generation: _Optional[int] = ..., heartbeat_secret: _Optional[bytes] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("generation", "server_time")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    generation: int
    server_time: _timestamp_pb2.Timestamp
    def __init__(self, generation: _Optional[int] = ..., server_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class GetTrustBundleRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CordonNodeRequest(_message.Message):
    __slots__ = ("node_id", "reason", "drain")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    reason: str
    drain: bool
    def __init__(self, node_id: _Optional[str] = ..., reason: _Optional[str] = ..., drain: _Optional[bool] = ...) -> None: ...

class JobLogsRequest(_message.Message):
    __slots__ = ("job_id", "rank", "node_id", "follow", "tail_lines")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    TAIL_LINES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    node_id: str
    follow: bool
    tail_lines: int
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., node_id: _Optional[str] = ..., follow: _Optional[bool] = ..., tail_lines: _Optional[int] = ...) -> None: ...

class JobLogsChunk(_message.Message):
    __slots__ = ("node_id", "rank", "data", "notice")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    NOTICE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    rank: int
    data: bytes
    notice: str
    def __init__(self, node_id: _Optional[str] = ..., rank: _Optional[int] = ..., data: _Optional[bytes] = ..., notice: _Optional[str] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("job_id", "plan", "nodes", "node_ids", "slots_per_node", "spares", "command", "env", "max_restarts", "lost_node_timeout_s", "mode", "topology_policy", "restart_policy", "time_limit_s", "launch_deadline_s", "launch")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    SPARES_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    LOST_NODE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_POLICY_FIELD_NUMBER: _ClassVar[int]
    RESTART_POLICY_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_S_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    plan: _plan_pb2.ParallelPlan
    nodes: int
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    slots_per_node: int
    spares: int
    command: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    max_restarts: int
    lost_node_timeout_s: float
    mode: RankMode
    topology_policy: TopologyPolicy
    restart_policy: RestartPolicy
    time_limit_s: float
    launch_deadline_s: float
    launch: LaunchMode
    def __init__(self, job_id: _Optional[str] = ..., plan: _Optional[_Union[_plan_pb2.ParallelPlan, _Mapping]] = ..., nodes: _Optional[int] = ..., node_ids: _Optional[_Iterable[str]] = ..., slots_per_node: _Optional[int] = ..., spares: _Optional[int] = ..., command: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., max_restarts: _Optional[int] = ..., lost_node_timeout_s: _Optional[float] = ..., mode: _Optional[_Union[RankMode, str]] = ..., topology_policy: _Optional[_Union[TopologyPolicy, str]] = ..., restart_policy: _Optional[_Union[RestartPolicy, str]] = ..., time_limit_s: _Optional[float] = ..., launch_deadline_s: _Optional[float] = ..., launch: _Optional[_Union[LaunchMode, str]] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("spec", "wait_for_nodes")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_NODES_FIELD_NUMBER: _ClassVar[int]
    spec: JobSpec
    wait_for_nodes: bool
    def __init__(self, spec: _Optional[_Union[JobSpec, _Mapping]] = ..., wait_for_nodes: _Optional[bool] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "state", "owner")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    state: JobState
    owner: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., owner: _Optional[str] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class FinishJobRequest(_message.Message):
    __slots__ = ("job_id", "succeeded", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SUCCEEDED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    succeeded: bool
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., succeeded: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class JobInfo(_message.Message):
    __slots__ = ("spec", "plan_digest", "state", "reason", "nodes", "spare_nodes", "submitted_at", "ended_at", "status", "owner", "redacted", "nodes_more")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    SPARE_NODES_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    REDACTED_FIELD_NUMBER: _ClassVar[int]
    NODES_MORE_FIELD_NUMBER: _ClassVar[int]
    spec: JobSpec
    plan_digest: bytes
    state: JobState
    reason: str
    nodes: _containers.RepeatedScalarFieldContainer[str]
    spare_nodes: _containers.RepeatedScalarFieldContainer[str]
    submitted_at: _timestamp_pb2.Timestamp
    ended_at: _timestamp_pb2.Timestamp
    status: Status
    owner: str
    redacted: bool
    nodes_more: int
    def __init__(self, spec: _Optional[_Union[JobSpec, _Mapping]] = ..., plan_digest: _Optional[bytes] = ..., state: _Optional[_Union[JobState, str]] = ..., reason: _Optional[str] = ..., nodes: _Optional[_Iterable[str]] = ..., spare_nodes: _Optional[_Iterable[str]] = ..., submitted_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ended_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., status: _Optional[_Union[Status, _Mapping]] = ..., owner: _Optional[str] = ..., redacted: _Optional[bool] = ..., nodes_more: _Optional[int] = ...) -> None: ...

class JobList(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobInfo]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class NodeHardware(_message.Message):
    __slots__ = ("machine_id", "gpus", "nics", "nvlink_domain", "gpu_source")
    MACHINE_ID_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    NICS_FIELD_NUMBER: _ClassVar[int]
    NVLINK_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    GPU_SOURCE_FIELD_NUMBER: _ClassVar[int]
    machine_id: str
    gpus: _containers.RepeatedCompositeFieldContainer[GpuDevice]
    nics: _containers.RepeatedCompositeFieldContainer[NicDevice]
    nvlink_domain: str
    gpu_source: str
    def __init__(self, machine_id: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[GpuDevice, _Mapping]]] = ..., nics: _Optional[_Iterable[_Union[NicDevice, _Mapping]]] = ..., nvlink_domain: _Optional[str] = ..., gpu_source: _Optional[str] = ...) -> None: ...

class GpuDevice(_message.Message):
    __slots__ = ("index", "uuid", "pci_bus_id", "serial", "nvlink_domain")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    SERIAL_FIELD_NUMBER: _ClassVar[int]
    NVLINK_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    pci_bus_id: str
    serial: str
    nvlink_domain: str
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., pci_bus_id: _Optional[str] = ..., serial: _Optional[str] = ..., nvlink_domain: _Optional[str] = ...) -> None: ...

class NicDevice(_message.Message):
    __slots__ = ("name", "kind", "address", "state")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    address: str
    state: str
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[str] = ...) -> None: ...

class PoolNode(_message.Message):
    __slots__ = ("node_id", "state", "hostname", "slots", "slot_kind", "labels", "job_id", "last_seen", "joined_at", "silent_s", "job_node_state", "cordoned", "quarantined", "unhealthy", "failures", "uncordon_asked", "hardware", "hardware_shared", "agent_release", "agent_wire")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_KIND_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    JOINED_AT_FIELD_NUMBER: _ClassVar[int]
    SILENT_S_FIELD_NUMBER: _ClassVar[int]
    JOB_NODE_STATE_FIELD_NUMBER: _ClassVar[int]
    CORDONED_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    UNHEALTHY_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    UNCORDON_ASKED_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_SHARED_FIELD_NUMBER: _ClassVar[int]
    AGENT_RELEASE_FIELD_NUMBER: _ClassVar[int]
    AGENT_WIRE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    state: PoolState
    hostname: str
    slots: int
    slot_kind: str
    labels: _containers.ScalarMap[str, str]
    job_id: str
    last_seen: _timestamp_pb2.Timestamp
    joined_at: _timestamp_pb2.Timestamp
    silent_s: float
    job_node_state: NodeState
    cordoned: str
    quarantined: str
    unhealthy: str
    failures: int
    uncordon_asked: str
    hardware: NodeHardware
    hardware_shared: str
    agent_release: str
    agent_wire: int
    def __init__(self, node_id: _Optional[str] = ..., state: _Optional[_Union[PoolState, str]] = ..., hostname: _Optional[str] = ..., slots: _Optional[int] = ..., slot_kind: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., job_id: _Optional[str] = ..., last_seen: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., joined_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., silent_s: _Optional[float] = ..., job_node_state: _Optional[_Union[NodeState, str]] = ..., cordoned: _Optional[str] = ..., quarantined: _Optional[str] = ..., unhealthy: _Optional[str] = ..., failures: _Optional[int] = ..., uncordon_asked: _Optional[str] = ..., hardware: _Optional[_Union[NodeHardware, _Mapping]] = ..., hardware_shared: _Optional[str] = ..., agent_release: _Optional[str] = ..., agent_wire: _Optional[int] = ...) -> None: ...

class NodeList(_message.Message):
    __slots__ = ("nodes", "next_page_token", "total")
    NODES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[PoolNode]
    next_page_token: str
    total: int
    def __init__(self, nodes: _Optional[_Iterable[_Union[PoolNode, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., total: _Optional[int] = ...) -> None: ...

class GetClusterRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JobStateCount(_message.Message):
    __slots__ = ("state", "count")
    STATE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    state: JobState
    count: int
    def __init__(self, state: _Optional[_Union[JobState, str]] = ..., count: _Optional[int] = ...) -> None: ...

class PoolStateCount(_message.Message):
    __slots__ = ("state", "count")
    STATE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    state: PoolState
    count: int
    def __init__(self, state: _Optional[_Union[PoolState, str]] = ..., count: _Optional[int] = ...) -> None: ...

class QueuedJob(_message.Message):
    __slots__ = ("job_id", "owner", "reason", "submitted_at")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    owner: str
    reason: str
    submitted_at: _timestamp_pb2.Timestamp
    def __init__(self, job_id: _Optional[str] = ..., owner: _Optional[str] = ..., reason: _Optional[str] = ..., submitted_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class SubmitterQuota(_message.Message):
    __slots__ = ("owner", "waiting_jobs", "jobs", "nodes", "spec_bytes_per_job", "spec_bytes", "running_jobs", "running_nodes")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    WAITING_JOBS_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    SPEC_BYTES_PER_JOB_FIELD_NUMBER: _ClassVar[int]
    SPEC_BYTES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_JOBS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_NODES_FIELD_NUMBER: _ClassVar[int]
    owner: str
    waiting_jobs: int
    jobs: int
    nodes: int
    spec_bytes_per_job: int
    spec_bytes: int
    running_jobs: int
    running_nodes: int
    def __init__(self, owner: _Optional[str] = ..., waiting_jobs: _Optional[int] = ..., jobs: _Optional[int] = ..., nodes: _Optional[int] = ..., spec_bytes_per_job: _Optional[int] = ..., spec_bytes: _Optional[int] = ..., running_jobs: _Optional[int] = ..., running_nodes: _Optional[int] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("jobs", "nodes", "queue", "queue_more", "declared_job_id", "quotas", "quota_admins_exempt", "held", "held_more")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MORE_FIELD_NUMBER: _ClassVar[int]
    DECLARED_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    QUOTAS_FIELD_NUMBER: _ClassVar[int]
    QUOTA_ADMINS_EXEMPT_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    HELD_MORE_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobStateCount]
    nodes: _containers.RepeatedCompositeFieldContainer[PoolStateCount]
    queue: _containers.RepeatedCompositeFieldContainer[QueuedJob]
    queue_more: int
    declared_job_id: str
    quotas: _containers.RepeatedCompositeFieldContainer[SubmitterQuota]
    quota_admins_exempt: bool
    held: _containers.RepeatedCompositeFieldContainer[PoolNode]
    held_more: int
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobStateCount, _Mapping]]] = ..., nodes: _Optional[_Iterable[_Union[PoolStateCount, _Mapping]]] = ..., queue: _Optional[_Iterable[_Union[QueuedJob, _Mapping]]] = ..., queue_more: _Optional[int] = ..., declared_job_id: _Optional[str] = ..., quotas: _Optional[_Iterable[_Union[SubmitterQuota, _Mapping]]] = ..., quota_admins_exempt: _Optional[bool] = ..., held: _Optional[_Iterable[_Union[PoolNode, _Mapping]]] = ..., held_more: _Optional[int] = ...) -> None: ...

class CreateJoinTokenRequest(_message.Message):
    __slots__ = ("job_id", "ttl_s", "node_id", "any_node")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ANY_NODE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    ttl_s: int
    node_id: str
    any_node: bool
    def __init__(self, job_id: _Optional[str] = ..., ttl_s: _Optional[int] = ..., node_id: _Optional[str] = ..., any_node: _Optional[bool] = ...) -> None: ...

class JoinToken(_message.Message):
    __slots__ = ("token", "expires_at", "node_id")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    token: str
    expires_at: _timestamp_pb2.Timestamp
    node_id: str
    def __init__(self, token: _Optional[str] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., node_id: _Optional[str] = ...) -> None: ...

class RotateKeyRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node_id", "node_rank", "state", "last_seen", "first_rank", "slots", "registered", "hostname", "slot_kind", "exits", "registered_ranks", "silent_s", "pool_state", "step", "step_time_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_RANK_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    SLOT_KIND_FIELD_NUMBER: _ClassVar[int]
    EXITS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_RANKS_FIELD_NUMBER: _ClassVar[int]
    SILENT_S_FIELD_NUMBER: _ClassVar[int]
    POOL_STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    node_rank: int
    state: NodeState
    last_seen: _timestamp_pb2.Timestamp
    first_rank: int
    slots: int
    registered: int
    hostname: str
    slot_kind: str
    exits: _containers.RepeatedScalarFieldContainer[str]
    registered_ranks: str
    silent_s: float
    pool_state: PoolState
    step: int
    step_time_s: float
    def __init__(self, node_id: _Optional[str] = ..., node_rank: _Optional[int] = ..., state: _Optional[_Union[NodeState, str]] = ..., last_seen: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., first_rank: _Optional[int] = ..., slots: _Optional[int] = ..., registered: _Optional[int] = ..., hostname: _Optional[str] = ..., slot_kind: _Optional[str] = ..., exits: _Optional[_Iterable[str]] = ..., registered_ranks: _Optional[str] = ..., silent_s: _Optional[float] = ..., pool_state: _Optional[_Union[PoolState, str]] = ..., step: _Optional[int] = ..., step_time_s: _Optional[float] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("job_id", "generation", "plan", "plan_digest", "world_size", "registered", "nodes", "missing_ranks", "opened_at", "master_addr", "master_port", "failure", "ended_at", "failure_log_tail", "mode", "nodes_more", "progress")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    MISSING_RANKS_FIELD_NUMBER: _ClassVar[int]
    OPENED_AT_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    FAILURE_LOG_TAIL_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    NODES_MORE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    generation: int
    plan: _plan_pb2.ParallelPlan
    plan_digest: bytes
    world_size: int
    registered: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    missing_ranks: str
    opened_at: _timestamp_pb2.Timestamp
    master_addr: str
    master_port: int
    failure: str
    ended_at: _timestamp_pb2.Timestamp
    failure_log_tail: str
    mode: RankMode
    nodes_more: int
    progress: JobProgress
    def __init__(self, job_id: _Optional[str] = ..., generation: _Optional[int] = ..., plan: _Optional[_Union[_plan_pb2.ParallelPlan, _Mapping]] = ..., plan_digest: _Optional[bytes] = ..., world_size: _Optional[int] = ..., registered: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ..., missing_ranks: _Optional[str] = ..., opened_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., failure: _Optional[str] = ..., ended_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., failure_log_tail: _Optional[str] = ..., mode: _Optional[_Union[RankMode, str]] = ..., nodes_more: _Optional[int] = ..., progress: _Optional[_Union[JobProgress, _Mapping]] = ...) -> None: ...

class JobProgress(_message.Message):
    __slots__ = ("step", "slowest_step", "steps_per_s", "last_step_at", "nodes_reporting", "straggler", "straggler_ratio", "loss", "samples_per_s")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SLOWEST_STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_AT_FIELD_NUMBER: _ClassVar[int]
    NODES_REPORTING_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_RATIO_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    step: int
    slowest_step: int
    steps_per_s: float
    last_step_at: _timestamp_pb2.Timestamp
    nodes_reporting: int
    straggler: str
    straggler_ratio: float
    loss: float
    samples_per_s: float
    def __init__(self, step: _Optional[int] = ..., slowest_step: _Optional[int] = ..., steps_per_s: _Optional[float] = ..., last_step_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., nodes_reporting: _Optional[int] = ..., straggler: _Optional[str] = ..., straggler_ratio: _Optional[float] = ..., loss: _Optional[float] = ..., samples_per_s: _Optional[float] = ...) -> None: ...

class GetJobTimelineRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class TimelineEntry(_message.Message):
    __slots__ = ("moment", "at", "until", "generation", "node_id", "detail", "count")
    MOMENT_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    moment: TimelineMoment
    at: _timestamp_pb2.Timestamp
    until: _timestamp_pb2.Timestamp
    generation: int
    node_id: str
    detail: str
    count: int
    def __init__(self, moment: _Optional[_Union[TimelineMoment, str]] = ..., at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., until: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., generation: _Optional[int] = ..., node_id: _Optional[str] = ..., detail: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class JobTimeline(_message.Message):
    __slots__ = ("job_id", "state", "entries", "entries_dropped", "note")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: JobState
    entries: _containers.RepeatedCompositeFieldContainer[TimelineEntry]
    entries_dropped: int
    note: str
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., entries: _Optional[_Iterable[_Union[TimelineEntry, _Mapping]]] = ..., entries_dropped: _Optional[int] = ..., note: _Optional[str] = ...) -> None: ...
