from meshgate.v1 import attestation_pb2 as _attestation_pb2
from meshgate.v1 import plan_pb2 as _plan_pb2
from meshgate.v1 import rendezvous_pb2 as _rendezvous_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LogRequest(_message.Message):
    __slots__ = ("request_id", "job_id", "ranks", "tail_lines", "follow")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TAIL_LINES_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    job_id: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    tail_lines: int
    follow: bool
    def __init__(self, request_id: _Optional[str] = ..., job_id: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., tail_lines: _Optional[int] = ..., follow: _Optional[bool] = ...) -> None: ...

class PushLogsRequest(_message.Message):
    __slots__ = ("node_id", "node_credential", "request_id", "rank", "data", "done", "notice")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    NOTICE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    node_credential: bytes
    request_id: str
    rank: int
    data: bytes
    done: bool
    notice: str
    def __init__(self, node_id: _Optional[str] = ..., node_credential: _Optional[bytes] = ..., request_id: _Optional[str] = ..., rank: _Optional[int] = ..., data: _Optional[bytes] = ..., done: _Optional[bool] = ..., notice: _Optional[str] = ...) -> None: ...

class PushLogsResponse(_message.Message):
    __slots__ = ("stop",)
    STOP_FIELD_NUMBER: _ClassVar[int]
    stop: bool
    def __init__(self, stop: _Optional[bool] = ...) -> None: ...

class RegisterBatchRequest(_message.Message):
    __slots__ = ("job_id", "node_id", "node_credential", "requests", "one_signature")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ONE_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    node_id: str
    node_credential: bytes
    requests: _containers.RepeatedCompositeFieldContainer[_rendezvous_pb2.RegisterRequest]
    one_signature: bool
    def __init__(self, job_id: _Optional[str] = ..., node_id: _Optional[str] = ..., node_credential: _Optional[bytes] = ..., requests: _Optional[_Iterable[_Union[_rendezvous_pb2.RegisterRequest, _Mapping]]] = ..., one_signature: _Optional[bool] = ...) -> None: ...

class RegisterResult(_message.Message):
    __slots__ = ("attestation", "refusal", "heartbeat_secret")
    ATTESTATION_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_SECRET_FIELD_NUMBER: _ClassVar[int]
    attestation: _attestation_pb2.SignedAttestation
    refusal: Refusal
    heartbeat_secret: bytes
    def __init__(self, attestation: _Optional[_Union[_attestation_pb2.SignedAttestation, _Mapping]] = ..., refusal: _Optional[_Union[Refusal, _Mapping]] = ..., heartbeat_secret: _Optional[bytes] = ...) -> None: ...

class Refusal(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class RegisterBatchResponse(_message.Message):
    __slots__ = ("results", "batch")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[RegisterResult]
    batch: bytes
    def __init__(self, results: _Optional[_Iterable[_Union[RegisterResult, _Mapping]]] = ..., batch: _Optional[bytes] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("job_id", "node_id", "hostname", "slots", "slot_kind", "join_token", "node_credential", "node_public_key", "master_addr", "master_port", "labels", "agent_instance", "health", "hardware")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_KIND_FIELD_NUMBER: _ClassVar[int]
    JOIN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NODE_CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    NODE_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    AGENT_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    node_id: str
    hostname: str
    slots: int
    slot_kind: str
    join_token: str
    node_credential: bytes
    node_public_key: bytes
    master_addr: str
    master_port: int
    labels: _containers.ScalarMap[str, str]
    agent_instance: str
    health: NodeHealth
    hardware: _rendezvous_pb2.NodeHardware
    def __init__(self, job_id: _Optional[str] = ..., node_id: _Optional[str] = ..., hostname: _Optional[str] = ..., slots: _Optional[int] = ..., slot_kind: _Optional[str] = ..., join_token: _Optional[str] = ..., node_credential: _Optional[bytes] = ..., node_public_key: _Optional[bytes] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., agent_instance: _Optional[str] = ..., health: _Optional[_Union[NodeHealth, _Mapping]] = ..., hardware: _Optional[_Union[_rendezvous_pb2.NodeHardware, _Mapping]] = ...) -> None: ...

class LaunchAssignment(_message.Message):
    __slots__ = ("command", "nprocs", "first_rank", "world_size", "env", "restart_policy", "max_restarts", "master_addr", "master_port", "plan", "per_node")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    NPROCS_FIELD_NUMBER: _ClassVar[int]
    FIRST_RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    RESTART_POLICY_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    PER_NODE_FIELD_NUMBER: _ClassVar[int]
    command: _containers.RepeatedScalarFieldContainer[str]
    nprocs: int
    first_rank: int
    world_size: int
    env: _containers.ScalarMap[str, str]
    restart_policy: str
    max_restarts: int
    master_addr: str
    master_port: int
    plan: _plan_pb2.ParallelPlan
    per_node: bool
    def __init__(self, command: _Optional[_Iterable[str]] = ..., nprocs: _Optional[int] = ..., first_rank: _Optional[int] = ..., world_size: _Optional[int] = ..., env: _Optional[_Mapping[str, str]] = ..., restart_policy: _Optional[str] = ..., max_restarts: _Optional[int] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., plan: _Optional[_Union[_plan_pb2.ParallelPlan, _Mapping]] = ..., per_node: _Optional[bool] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("node_rank", "generation", "assignment", "trust_bundle", "heartbeat_interval_ms", "node_credential", "spare", "signed_trust_bundle")
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    TRUST_BUNDLE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    NODE_CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    SIGNED_TRUST_BUNDLE_FIELD_NUMBER: _ClassVar[int]
    node_rank: int
    generation: int
    assignment: LaunchAssignment
    trust_bundle: _attestation_pb2.TrustBundle
    heartbeat_interval_ms: int
    node_credential: bytes
    spare: bool
    signed_trust_bundle: _attestation_pb2.SignedTrustBundle
    def __init__(self, node_rank: _Optional[int] = ..., generation: _Optional[int] = ..., assignment: _Optional[_Union[LaunchAssignment, _Mapping]] = ..., trust_bundle: _Optional[_Union[_attestation_pb2.TrustBundle, _Mapping]] = ..., heartbeat_interval_ms: _Optional[int] = ..., node_credential: _Optional[bytes] = ..., spare: _Optional[bool] = ..., signed_trust_bundle: _Optional[_Union[_attestation_pb2.SignedTrustBundle, _Mapping]] = ...) -> None: ...

class NodeHeartbeatRequest(_message.Message):
    __slots__ = ("job_id", "node_id", "generation", "running_workers", "node_credential", "agent_instance", "live_units", "health", "progress", "hardware")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RUNNING_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NODE_CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    AGENT_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    LIVE_UNITS_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    node_id: str
    generation: int
    running_workers: int
    node_credential: bytes
    agent_instance: str
    live_units: _containers.RepeatedScalarFieldContainer[str]
    health: NodeHealth
    progress: _containers.RepeatedCompositeFieldContainer[RankProgress]
    hardware: _rendezvous_pb2.NodeHardware
    def __init__(self, job_id: _Optional[str] = ..., node_id: _Optional[str] = ..., generation: _Optional[int] = ..., running_workers: _Optional[int] = ..., node_credential: _Optional[bytes] = ..., agent_instance: _Optional[str] = ..., live_units: _Optional[_Iterable[str]] = ..., health: _Optional[_Union[NodeHealth, _Mapping]] = ..., progress: _Optional[_Iterable[_Union[RankProgress, _Mapping]]] = ..., hardware: _Optional[_Union[_rendezvous_pb2.NodeHardware, _Mapping]] = ...) -> None: ...

class RankProgress(_message.Message):
    __slots__ = ("local_rank", "step", "at", "loss", "samples_per_s", "step_time_s")
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    local_rank: int
    step: int
    at: float
    loss: float
    samples_per_s: float
    step_time_s: float
    def __init__(self, local_rank: _Optional[int] = ..., step: _Optional[int] = ..., at: _Optional[float] = ..., loss: _Optional[float] = ..., samples_per_s: _Optional[float] = ..., step_time_s: _Optional[float] = ...) -> None: ...

class NodeHealth(_message.Message):
    __slots__ = ("passed", "summary", "seq", "asked")
    PASSED_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ASKED_FIELD_NUMBER: _ClassVar[int]
    passed: bool
    summary: str
    seq: int
    asked: bool
    def __init__(self, passed: _Optional[bool] = ..., summary: _Optional[str] = ..., seq: _Optional[int] = ..., asked: _Optional[bool] = ...) -> None: ...

class NodeHeartbeatResponse(_message.Message):
    __slots__ = ("generation", "node_rank", "job_failure", "job_id", "job_state", "node_state", "pool_state", "log_requests", "run_health_check", "send_hardware")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    JOB_FAILURE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_STATE_FIELD_NUMBER: _ClassVar[int]
    NODE_STATE_FIELD_NUMBER: _ClassVar[int]
    POOL_STATE_FIELD_NUMBER: _ClassVar[int]
    LOG_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUN_HEALTH_CHECK_FIELD_NUMBER: _ClassVar[int]
    SEND_HARDWARE_FIELD_NUMBER: _ClassVar[int]
    generation: int
    node_rank: int
    job_failure: str
    job_id: str
    job_state: _rendezvous_pb2.JobState
    node_state: _rendezvous_pb2.NodeState
    pool_state: _rendezvous_pb2.PoolState
    log_requests: _containers.RepeatedCompositeFieldContainer[LogRequest]
    run_health_check: bool
    send_hardware: bool
    def __init__(self, generation: _Optional[int] = ..., node_rank: _Optional[int] = ..., job_failure: _Optional[str] = ..., job_id: _Optional[str] = ..., job_state: _Optional[_Union[_rendezvous_pb2.JobState, str]] = ..., node_state: _Optional[_Union[_rendezvous_pb2.NodeState, str]] = ..., pool_state: _Optional[_Union[_rendezvous_pb2.PoolState, str]] = ..., log_requests: _Optional[_Iterable[_Union[LogRequest, _Mapping]]] = ..., run_health_check: _Optional[bool] = ..., send_hardware: _Optional[bool] = ...) -> None: ...

class WorkerExitReport(_message.Message):
    __slots__ = ("job_id", "node_id", "local_rank", "exit_code", "restarts", "will_restart", "node_credential", "generation", "stopped_by_agent", "detail", "start_failed", "log_tail")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    WILL_RESTART_FIELD_NUMBER: _ClassVar[int]
    NODE_CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STOPPED_BY_AGENT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    START_FAILED_FIELD_NUMBER: _ClassVar[int]
    LOG_TAIL_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    node_id: str
    local_rank: int
    exit_code: int
    restarts: int
    will_restart: bool
    node_credential: bytes
    generation: int
    stopped_by_agent: bool
    detail: str
    start_failed: bool
    log_tail: str
    def __init__(self, job_id: _Optional[str] = ..., node_id: _Optional[str] = ..., local_rank: _Optional[int] = ..., exit_code: _Optional[int] = ..., restarts: _Optional[int] = ..., will_restart: _Optional[bool] = ..., node_credential: _Optional[bytes] = ..., generation: _Optional[int] = ..., stopped_by_agent: _Optional[bool] = ..., detail: _Optional[str] = ..., start_failed: _Optional[bool] = ..., log_tail: _Optional[str] = ...) -> None: ...

class ReportExitResponse(_message.Message):
    __slots__ = ("generation", "job_failure")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    JOB_FAILURE_FIELD_NUMBER: _ClassVar[int]
    generation: int
    job_failure: str
    def __init__(self, generation: _Optional[int] = ..., job_failure: _Optional[str] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("job_id", "node_id", "reason", "node_credential")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NODE_CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    node_id: str
    reason: str
    node_credential: bytes
    def __init__(self, job_id: _Optional[str] = ..., node_id: _Optional[str] = ..., reason: _Optional[str] = ..., node_credential: _Optional[bytes] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
