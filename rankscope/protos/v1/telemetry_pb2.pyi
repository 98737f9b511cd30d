from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpanKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPAN_KIND_COMPUTE: _ClassVar[SpanKind]
    SPAN_KIND_COMM: _ClassVar[SpanKind]
    SPAN_KIND_DATA: _ClassVar[SpanKind]
    SPAN_KIND_OPTIMIZER: _ClassVar[SpanKind]
    SPAN_KIND_USER: _ClassVar[SpanKind]

class CollectiveState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COLLECTIVE_STATE_COMPLETED: _ClassVar[CollectiveState]
    COLLECTIVE_STATE_FAILED: _ClassVar[CollectiveState]
    COLLECTIVE_STATE_PENDING: _ClassVar[CollectiveState]
SPAN_KIND_COMPUTE: SpanKind
SPAN_KIND_COMM: SpanKind
SPAN_KIND_DATA: SpanKind
SPAN_KIND_OPTIMIZER: SpanKind
SPAN_KIND_USER: SpanKind
COLLECTIVE_STATE_COMPLETED: CollectiveState
COLLECTIVE_STATE_FAILED: CollectiveState
COLLECTIVE_STATE_PENDING: CollectiveState

class Group(_message.Message):
    __slots__ = ("name", "description", "ranks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("world_size", "host", "pid", "local_rank", "device", "tp", "pp", "dp", "tp_rank", "pp_rank", "dp_rank", "groups", "run_name", "config_json", "start_time_ns", "agent_version", "time_ns", "world")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    RUN_NAME_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    START_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIME_NS_FIELD_NUMBER: _ClassVar[int]
    WORLD_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    host: str
    pid: int
    local_rank: int
    device: str
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    groups: _containers.RepeatedCompositeFieldContainer[Group]
    run_name: str
    config_json: str
    start_time_ns: int
    agent_version: str
    time_ns: int
    world: str
    def __init__(self, world_size: _Optional[int] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., local_rank: _Optional[int] = ..., device: _Optional[str] = ..., tp: _Optional[int] = ..., pp: _Optional[int] = ..., dp: _Optional[int] = ..., tp_rank: _Optional[int] = ..., pp_rank: _Optional[int] = ..., dp_rank: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[Group, _Mapping]]] = ..., run_name: _Optional[str] = ..., config_json: _Optional[str] = ..., start_time_ns: _Optional[int] = ..., agent_version: _Optional[str] = ..., time_ns: _Optional[int] = ..., world: _Optional[str] = ...) -> None: ...

class RegisterBatch(_message.Message):
    __slots__ = ("registers", "ranks")
    REGISTERS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    registers: _containers.RepeatedCompositeFieldContainer[Register]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, registers: _Optional[_Iterable[_Union[Register, _Mapping]]] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class SpanBatch(_message.Message):
    __slots__ = ("count", "strings", "name", "kind", "step", "microbatch", "start_ns", "end_ns", "attributes", "cpu_ns", "rank")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    STRINGS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    END_NS_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    CPU_NS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    count: int
    strings: _containers.RepeatedScalarFieldContainer[str]
    name: bytes
    kind: bytes
    step: bytes
    microbatch: bytes
    start_ns: bytes
    end_ns: bytes
    attributes: bytes
    cpu_ns: bytes
    rank: bytes
    def __init__(self, count: _Optional[int] = ..., strings: _Optional[_Iterable[str]] = ..., name: _Optional[bytes] = ..., kind: _Optional[bytes] = ..., step: _Optional[bytes] = ..., microbatch: _Optional[bytes] = ..., start_ns: _Optional[bytes] = ..., end_ns: _Optional[bytes] = ..., attributes: _Optional[bytes] = ..., cpu_ns: _Optional[bytes] = ..., rank: _Optional[bytes] = ...) -> None: ...

class CollectiveBatch(_message.Message):
    __slots__ = ("count", "strings", "group", "seq", "op", "nbytes", "dtype", "peer", "issue_ns", "start_ns", "end_ns", "state", "step", "rank")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    STRINGS_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    ISSUE_NS_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    END_NS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    count: int
    strings: _containers.RepeatedScalarFieldContainer[str]
    group: bytes
    seq: bytes
    op: bytes
    nbytes: bytes
    dtype: bytes
    peer: bytes
    issue_ns: bytes
    start_ns: bytes
    end_ns: bytes
    state: bytes
    step: bytes
    rank: bytes
    def __init__(self, count: _Optional[int] = ..., strings: _Optional[_Iterable[str]] = ..., group: _Optional[bytes] = ..., seq: _Optional[bytes] = ..., op: _Optional[bytes] = ..., nbytes: _Optional[bytes] = ..., dtype: _Optional[bytes] = ..., peer: _Optional[bytes] = ..., issue_ns: _Optional[bytes] = ..., start_ns: _Optional[bytes] = ..., end_ns: _Optional[bytes] = ..., state: _Optional[bytes] = ..., step: _Optional[bytes] = ..., rank: _Optional[bytes] = ...) -> None: ...

class InFlight(_message.Message):
    __slots__ = ("group", "seq", "op", "peer", "issue_ns", "waiting")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    ISSUE_NS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    group: str
    seq: int
    op: str
    peer: int
    issue_ns: int
    waiting: bool
    def __init__(self, group: _Optional[str] = ..., seq: _Optional[int] = ..., op: _Optional[str] = ..., peer: _Optional[int] = ..., issue_ns: _Optional[int] = ..., waiting: _Optional[bool] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("time_ns", "step", "phase", "status", "last_progress_ns", "in_flight", "events_dropped")
    TIME_NS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LAST_PROGRESS_NS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    time_ns: int
    step: int
    phase: str
    status: str
    last_progress_ns: int
    in_flight: _containers.RepeatedCompositeFieldContainer[InFlight]
    events_dropped: int
    def __init__(self, time_ns: _Optional[int] = ..., step: _Optional[int] = ..., phase: _Optional[str] = ..., status: _Optional[str] = ..., last_progress_ns: _Optional[int] = ..., in_flight: _Optional[_Iterable[_Union[InFlight, _Mapping]]] = ..., events_dropped: _Optional[int] = ...) -> None: ...

class HeartbeatBatch(_message.Message):
    __slots__ = ("heartbeats", "ranks", "columns")
    HEARTBEATS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    heartbeats: _containers.RepeatedCompositeFieldContainer[Heartbeat]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    columns: HeartbeatColumns
    def __init__(self, heartbeats: _Optional[_Iterable[_Union[Heartbeat, _Mapping]]] = ..., ranks: _Optional[_Iterable[int]] = ..., columns: _Optional[_Union[HeartbeatColumns, _Mapping]] = ...) -> None: ...

class HeartbeatColumns(_message.Message):
    __slots__ = ("count", "strings", "time_ns", "step", "phase", "status", "last_progress_ns", "events_dropped", "in_flight", "rank", "ops")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    STRINGS_FIELD_NUMBER: _ClassVar[int]
    TIME_NS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LAST_PROGRESS_NS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    count: int
    strings: _containers.RepeatedScalarFieldContainer[str]
    time_ns: bytes
    step: bytes
    phase: bytes
    status: bytes
    last_progress_ns: bytes
    events_dropped: bytes
    in_flight: bytes
    rank: bytes
    ops: InFlightColumns
    def __init__(self, count: _Optional[int] = ..., strings: _Optional[_Iterable[str]] = ..., time_ns: _Optional[bytes] = ..., step: _Optional[bytes] = ..., phase: _Optional[bytes] = ..., status: _Optional[bytes] = ..., last_progress_ns: _Optional[bytes] = ..., events_dropped: _Optional[bytes] = ..., in_flight: _Optional[bytes] = ..., rank: _Optional[bytes] = ..., ops: _Optional[_Union[InFlightColumns, _Mapping]] = ...) -> None: ...

class InFlightColumns(_message.Message):
    __slots__ = ("count", "strings", "group", "seq", "op", "peer", "issue_ns", "waiting")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    STRINGS_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    ISSUE_NS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    count: int
    strings: _containers.RepeatedScalarFieldContainer[str]
    group: bytes
    seq: bytes
    op: bytes
    peer: bytes
    issue_ns: bytes
    waiting: bytes
    def __init__(self, count: _Optional[int] = ..., strings: _Optional[_Iterable[str]] = ..., group: _Optional[bytes] = ..., seq: _Optional[bytes] = ..., op: _Optional[bytes] = ..., peer: _Optional[bytes] = ..., issue_ns: _Optional[bytes] = ..., waiting: _Optional[bytes] = ...) -> None: ...

class MetricBatch(_message.Message):
    __slots__ = ("count", "strings", "time_ns", "name", "device", "value")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    STRINGS_FIELD_NUMBER: _ClassVar[int]
    TIME_NS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    count: int
    strings: _containers.RepeatedScalarFieldContainer[str]
    time_ns: bytes
    name: bytes
    device: bytes
    value: bytes
    def __init__(self, count: _Optional[int] = ..., strings: _Optional[_Iterable[str]] = ..., time_ns: _Optional[bytes] = ..., name: _Optional[bytes] = ..., device: _Optional[bytes] = ..., value: _Optional[bytes] = ...) -> None: ...

class StepMetricBatch(_message.Message):
    __slots__ = ("count", "strings", "step", "name", "value", "time_ns", "rank")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    STRINGS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TIME_NS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    count: int
    strings: _containers.RepeatedScalarFieldContainer[str]
    step: bytes
    name: bytes
    value: bytes
    time_ns: bytes
    rank: bytes
    def __init__(self, count: _Optional[int] = ..., strings: _Optional[_Iterable[str]] = ..., step: _Optional[bytes] = ..., name: _Optional[bytes] = ..., value: _Optional[bytes] = ..., time_ns: _Optional[bytes] = ..., rank: _Optional[bytes] = ...) -> None: ...

class StackDump(_message.Message):
    __slots__ = ("time_ns", "reason", "method", "text")
    TIME_NS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    time_ns: int
    reason: str
    method: str
    text: str
    def __init__(self, time_ns: _Optional[int] = ..., reason: _Optional[str] = ..., method: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class EndOfRank(_message.Message):
    __slots__ = ("time_ns", "reason", "exit_code", "signal", "message")
    class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REASON_NORMAL: _ClassVar[EndOfRank.Reason]
        REASON_EXIT_CODE: _ClassVar[EndOfRank.Reason]
        REASON_EXCEPTION: _ClassVar[EndOfRank.Reason]
        REASON_SIGNAL: _ClassVar[EndOfRank.Reason]
    REASON_NORMAL: EndOfRank.Reason
    REASON_EXIT_CODE: EndOfRank.Reason
    REASON_EXCEPTION: EndOfRank.Reason
    REASON_SIGNAL: EndOfRank.Reason
    TIME_NS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    time_ns: int
    reason: EndOfRank.Reason
    exit_code: int
    signal: int
    message: str
    def __init__(self, time_ns: _Optional[int] = ..., reason: _Optional[_Union[EndOfRank.Reason, str]] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class EndBatch(_message.Message):
    __slots__ = ("ends", "ranks")
    ENDS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ends: _containers.RepeatedCompositeFieldContainer[EndOfRank]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ends: _Optional[_Iterable[_Union[EndOfRank, _Mapping]]] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class Action(_message.Message):
    __slots__ = ("time_ns", "action", "hosts", "incident_id", "reason", "evidence_json")
    TIME_NS_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_JSON_FIELD_NUMBER: _ClassVar[int]
    time_ns: int
    action: str
    hosts: _containers.RepeatedScalarFieldContainer[str]
    incident_id: str
    reason: str
    evidence_json: str
    def __init__(self, time_ns: _Optional[int] = ..., action: _Optional[str] = ..., hosts: _Optional[_Iterable[str]] = ..., incident_id: _Optional[str] = ..., reason: _Optional[str] = ..., evidence_json: _Optional[str] = ...) -> None: ...

class NodeState(_message.Message):
    __slots__ = ("time_ns", "host", "state", "incident_id", "reason", "actor")
    TIME_NS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    time_ns: int
    host: str
    state: str
    incident_id: str
    reason: str
    actor: str
    def __init__(self, time_ns: _Optional[int] = ..., host: _Optional[str] = ..., state: _Optional[str] = ..., incident_id: _Optional[str] = ..., reason: _Optional[str] = ..., actor: _Optional[str] = ...) -> None: ...

class SelfCheck(_message.Message):
    __slots__ = ("time_ns", "host", "passed", "summary", "figures")
    TIME_NS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    FIGURES_FIELD_NUMBER: _ClassVar[int]
    time_ns: int
    host: str
    passed: bool
    summary: str
    figures: _containers.RepeatedCompositeFieldContainer[SelfCheckFigure]
    def __init__(self, time_ns: _Optional[int] = ..., host: _Optional[str] = ..., passed: _Optional[bool] = ..., summary: _Optional[str] = ..., figures: _Optional[_Iterable[_Union[SelfCheckFigure, _Mapping]]] = ...) -> None: ...

class SelfCheckFigure(_message.Message):
    __slots__ = ("check", "value", "unit", "reference", "passed", "detail")
    CHECK_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    check: str
    value: float
    unit: str
    reference: float
    passed: bool
    detail: str
    def __init__(self, check: _Optional[str] = ..., value: _Optional[float] = ..., unit: _Optional[str] = ..., reference: _Optional[float] = ..., passed: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...
