from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ParallelPlan(_message.Message):
    __slots__ = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "etp", "microbatches", "gradient_accumulation_steps", "order")
    DP_REPLICATE_FIELD_NUMBER: _ClassVar[int]
    DP_SHARD_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    CP_FIELD_NUMBER: _ClassVar[int]
    EP_FIELD_NUMBER: _ClassVar[int]
    ETP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_ACCUMULATION_STEPS_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    microbatches: int
    gradient_accumulation_steps: int
    order: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, dp_replicate: _Optional[int] = ..., dp_shard: _Optional[int] = ..., tp: _Optional[int] = ..., pp: _Optional[int] = ..., cp: _Optional[int] = ..., ep: _Optional[int] = ..., etp: _Optional[int] = ..., microbatches: _Optional[int] = ..., gradient_accumulation_steps: _Optional[int] = ..., order: _Optional[_Iterable[str]] = ...) -> None: ...
