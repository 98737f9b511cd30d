from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class QueryRequest(_message.Message):
    __slots__ = ("sql", "params", "max_rows")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SQL_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    sql: str
    params: _containers.ScalarMap[str, str]
    max_rows: int
    def __init__(self, sql: _Optional[str] = ..., params: _Optional[_Mapping[str, str]] = ..., max_rows: _Optional[int] = ...) -> None: ...

class QueryResponse(_message.Message):
    __slots__ = ("arrow_ipc", "rows", "elapsed_s")
    ARROW_IPC_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    arrow_ipc: bytes
    rows: int
    elapsed_s: float
    def __init__(self, arrow_ipc: _Optional[bytes] = ..., rows: _Optional[int] = ..., elapsed_s: _Optional[float] = ...) -> None: ...

class StackRequest(_message.Message):
    __slots__ = ("run_id", "rank", "reason")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    rank: int
    reason: str
    def __init__(self, run_id: _Optional[str] = ..., rank: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class StackRequestReply(_message.Message):
    __slots__ = ("queued",)
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    queued: bool
    def __init__(self, queued: _Optional[bool] = ...) -> None: ...
