import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchLoadRequest(_message.Message):
    __slots__ = ("min_interval",)
    MIN_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    min_interval: _duration_pb2.Duration
    def __init__(self, min_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("time", "devices", "engine", "weight", "healthy", "node", "reason")
    TIME_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    time: _timestamp_pb2.Timestamp
    devices: _containers.RepeatedCompositeFieldContainer[DeviceReport]
    engine: EngineReport
    weight: float
    healthy: bool
    node: str
    reason: str
    def __init__(self, time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., devices: _Optional[_Iterable[_Union[DeviceReport, _Mapping]]] = ..., engine: _Optional[_Union[EngineReport, _Mapping]] = ..., weight: _Optional[float] = ..., healthy: _Optional[bool] = ..., node: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DeviceReport(_message.Message):
    __slots__ = ("index", "uuid", "name", "memory_used_bytes", "memory_total_bytes", "gpu_utilization", "memory_utilization", "temperature_c", "power_w", "ecc_errors", "retired_pages_pending", "remapped_rows_pending", "last_xid", "fault")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_C_FIELD_NUMBER: _ClassVar[int]
    POWER_W_FIELD_NUMBER: _ClassVar[int]
    ECC_ERRORS_FIELD_NUMBER: _ClassVar[int]
    RETIRED_PAGES_PENDING_FIELD_NUMBER: _ClassVar[int]
    REMAPPED_ROWS_PENDING_FIELD_NUMBER: _ClassVar[int]
    LAST_XID_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    gpu_utilization: float
    memory_utilization: float
    temperature_c: float
    power_w: float
    ecc_errors: int
    retired_pages_pending: bool
    remapped_rows_pending: bool
    last_xid: int
    fault: str
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., memory_used_bytes: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., gpu_utilization: _Optional[float] = ..., memory_utilization: _Optional[float] = ..., temperature_c: _Optional[float] = ..., power_w: _Optional[float] = ..., ecc_errors: _Optional[int] = ..., retired_pages_pending: _Optional[bool] = ..., remapped_rows_pending: _Optional[bool] = ..., last_xid: _Optional[int] = ..., fault: _Optional[str] = ...) -> None: ...

class EngineReport(_message.Message):
    __slots__ = ("url", "reachable", "healthy", "kv_blocks_total", "kv_blocks_free", "block_size", "kv_usage", "requests_running", "requests_waiting", "ttft_p95_ms", "error")
    URL_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    TTFT_P95_MS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    url: str
    reachable: bool
    healthy: bool
    kv_blocks_total: int
    kv_blocks_free: int
    block_size: int
    kv_usage: float
    requests_running: int
    requests_waiting: int
    ttft_p95_ms: float
    error: str
    def __init__(self, url: _Optional[str] = ..., reachable: _Optional[bool] = ..., healthy: _Optional[bool] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_usage: _Optional[float] = ..., requests_running: _Optional[int] = ..., requests_waiting: _Optional[int] = ..., ttft_p95_ms: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...
