from rankscope.protos.v1 import telemetry_pb2 as _telemetry_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Batch(_message.Message):
    __slots__ = ("schema_version", "run_id", "rank", "batch_id", "clock_offset_ns", "sent_ns", "attempt", "parts", "register", "spans", "collectives", "heartbeats", "metrics", "step_metrics", "stack", "end", "action", "selfcheck", "registers", "ends", "node_state")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    CLOCK_OFFSET_NS_FIELD_NUMBER: _ClassVar[int]
    SENT_NS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_FIELD_NUMBER: _ClassVar[int]
    HEARTBEATS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    STEP_METRICS_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    SELFCHECK_FIELD_NUMBER: _ClassVar[int]
    REGISTERS_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    NODE_STATE_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    run_id: str
    rank: int
    batch_id: bytes
    clock_offset_ns: int
    sent_ns: int
    attempt: int
    parts: _containers.RepeatedCompositeFieldContainer[BatchPart]
    register: _telemetry_pb2.Register
    spans: _telemetry_pb2.SpanBatch
    collectives: _telemetry_pb2.CollectiveBatch
    heartbeats: _telemetry_pb2.HeartbeatBatch
    metrics: _telemetry_pb2.MetricBatch
    step_metrics: _telemetry_pb2.StepMetricBatch
    stack: _telemetry_pb2.StackDump
    end: _telemetry_pb2.EndOfRank
    action: _telemetry_pb2.Action
    selfcheck: _telemetry_pb2.SelfCheck
    registers: _telemetry_pb2.RegisterBatch
    ends: _telemetry_pb2.EndBatch
    node_state: _telemetry_pb2.NodeState
    def __init__(self, schema_version: _Optional[int] = ..., run_id: _Optional[str] = ..., rank: _Optional[int] = ..., batch_id: _Optional[bytes] = ..., clock_offset_ns: _Optional[int] = ..., sent_ns: _Optional[int] = ..., attempt: _Optional[int] = ..., parts: _Optional[_Iterable[_Union[BatchPart, _Mapping]]] = ..., register: _Optional[_Union[_telemetry_pb2.Register, _Mapping]] = ..., spans: _Optional[_Union[_telemetry_pb2.SpanBatch, _Mapping]] = ..., collectives: _Optional[_Union[_telemetry_pb2.CollectiveBatch, _Mapping]] = ..., heartbeats: _Optional[_Union[_telemetry_pb2.HeartbeatBatch, _Mapping]] = ..., metrics: _Optional[_Union[_telemetry_pb2.MetricBatch, _Mapping]] = ..., step_metrics: _Optional[_Union[_telemetry_pb2.StepMetricBatch, _Mapping]] = ..., stack: _Optional[_Union[_telemetry_pb2.StackDump, _Mapping]] = ..., end: _Optional[_Union[_telemetry_pb2.EndOfRank, _Mapping]] = ..., action: _Optional[_Union[_telemetry_pb2.Action, _Mapping]] = ..., selfcheck: _Optional[_Union[_telemetry_pb2.SelfCheck, _Mapping]] = ..., registers: _Optional[_Union[_telemetry_pb2.RegisterBatch, _Mapping]] = ..., ends: _Optional[_Union[_telemetry_pb2.EndBatch, _Mapping]] = ..., node_state: _Optional[_Union[_telemetry_pb2.NodeState, _Mapping]] = ...) -> None: ...

class BatchPart(_message.Message):
    __slots__ = ("rank", "batch_id", "count")
    RANK_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    batch_id: bytes
    count: int
    def __init__(self, rank: _Optional[int] = ..., batch_id: _Optional[bytes] = ..., count: _Optional[int] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("stack_dump", "rank")
    STACK_DUMP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    stack_dump: StackDumpRequest
    rank: int
    def __init__(self, stack_dump: _Optional[_Union[StackDumpRequest, _Mapping]] = ..., rank: _Optional[int] = ...) -> None: ...

class StackDumpRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("batch_id", "duplicate", "received_ns", "replied_ns", "commands")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_NS_FIELD_NUMBER: _ClassVar[int]
    REPLIED_NS_FIELD_NUMBER: _ClassVar[int]
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    batch_id: bytes
    duplicate: bool
    received_ns: int
    replied_ns: int
    commands: _containers.RepeatedCompositeFieldContainer[Command]
    def __init__(self, batch_id: _Optional[bytes] = ..., duplicate: _Optional[bool] = ..., received_ns: _Optional[int] = ..., replied_ns: _Optional[int] = ..., commands: _Optional[_Iterable[_Union[Command, _Mapping]]] = ...) -> None: ...
