from google.protobuf import struct_pb2 as _struct_pb2
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
    JOB_STATE_QUEUED: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_UNSPECIFIED: _ClassVar[Priority]
    PRIORITY_INTERACTIVE: _ClassVar[Priority]
    PRIORITY_BATCH: _ClassVar[Priority]
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_QUEUED: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_CANCELLED: JobState
PRIORITY_UNSPECIFIED: Priority
PRIORITY_INTERACTIVE: Priority
PRIORITY_BATCH: Priority

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "cache_control")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    CACHE_CONTROL_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: _struct_pb2.Value
    cache_control: CacheControl
    def __init__(self, role: _Optional[str] = ..., content: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., cache_control: _Optional[_Union[CacheControl, _Mapping]] = ...) -> None: ...

class CacheControl(_message.Message):
    __slots__ = ("type", "ttl")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    type: str
    ttl: str
    def __init__(self, type: _Optional[str] = ..., ttl: _Optional[str] = ...) -> None: ...

class CacheBreakpoint(_message.Message):
    __slots__ = ("tokens", "ttl")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    ttl: str
    def __init__(self, tokens: _Optional[int] = ..., ttl: _Optional[str] = ...) -> None: ...

class CacheUse(_message.Message):
    __slots__ = ("read", "write")
    READ_FIELD_NUMBER: _ClassVar[int]
    WRITE_FIELD_NUMBER: _ClassVar[int]
    read: bool
    write: bool
    def __init__(self, read: _Optional[bool] = ..., write: _Optional[bool] = ...) -> None: ...

class Messages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "seed", "stop")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("type", "json_schema")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    type: str
    json_schema: JsonSchema
    def __init__(self, type: _Optional[str] = ..., json_schema: _Optional[_Union[JsonSchema, _Mapping]] = ...) -> None: ...

class JsonSchema(_message.Message):
    __slots__ = ("name", "schema", "strict")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    name: str
    schema: _struct_pb2.Struct
    strict: bool
    def __init__(self, name: _Optional[str] = ..., schema: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., strict: _Optional[bool] = ...) -> None: ...

class Request(_message.Message):
    __slots__ = ("custom_id", "messages", "tokens", "sampling", "response_format", "logprobs", "top_logprobs", "cache_control", "cache_salt", "prompt_cache_key", "cache", "cache_breakpoints")
    CUSTOM_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHE_CONTROL_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CACHE_KEY_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    CACHE_BREAKPOINTS_FIELD_NUMBER: _ClassVar[int]
    custom_id: str
    messages: Messages
    tokens: TokenIds
    sampling: SamplingParams
    response_format: ResponseFormat
    logprobs: bool
    top_logprobs: int
    cache_control: CacheControl
    cache_salt: str
    prompt_cache_key: str
    cache: CacheUse
    cache_breakpoints: _containers.RepeatedCompositeFieldContainer[CacheBreakpoint]
    def __init__(self, custom_id: _Optional[str] = ..., messages: _Optional[_Union[Messages, _Mapping]] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., cache_control: _Optional[_Union[CacheControl, _Mapping]] = ..., cache_salt: _Optional[str] = ..., prompt_cache_key: _Optional[str] = ..., cache: _Optional[_Union[CacheUse, _Mapping]] = ..., cache_breakpoints: _Optional[_Iterable[_Union[CacheBreakpoint, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "computed_tokens", "written_tokens", "written_input_tokens", "write_ttl_s")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WRITE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    computed_tokens: int
    written_tokens: int
    written_input_tokens: int
    write_ttl_s: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., written_tokens: _Optional[int] = ..., written_input_tokens: _Optional[int] = ..., write_ttl_s: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "bytes", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    bytes: bytes
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., bytes: _Optional[bytes] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Result(_message.Message):
    __slots__ = ("seq", "index", "custom_id", "request_id", "ok", "error_code", "error_message", "text", "output_tokens", "finish_reason", "usage", "worker_id", "ttft_s", "tpot_s", "attempts", "model", "worker_s", "logprobs")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TPOT_S_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WORKER_S_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    index: int
    custom_id: str
    request_id: str
    ok: bool
    error_code: str
    error_message: str
    text: str
    output_tokens: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    usage: Usage
    worker_id: str
    ttft_s: float
    tpot_s: float
    attempts: int
    model: str
    worker_s: float
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, seq: _Optional[int] = ..., index: _Optional[int] = ..., custom_id: _Optional[str] = ..., request_id: _Optional[str] = ..., ok: _Optional[bool] = ..., error_code: _Optional[str] = ..., error_message: _Optional[str] = ..., text: _Optional[str] = ..., output_tokens: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., worker_id: _Optional[str] = ..., ttft_s: _Optional[float] = ..., tpot_s: _Optional[float] = ..., attempts: _Optional[int] = ..., model: _Optional[str] = ..., worker_s: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "tenant", "state", "total", "completed", "failed", "cancelled", "created_unix_ms", "finished_unix_ms", "model", "priority")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    tenant: str
    state: JobState
    total: int
    completed: int
    failed: int
    cancelled: int
    created_unix_ms: int
    finished_unix_ms: int
    model: str
    priority: Priority
    def __init__(self, job_id: _Optional[str] = ..., tenant: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., total: _Optional[int] = ..., completed: _Optional[int] = ..., failed: _Optional[int] = ..., cancelled: _Optional[int] = ..., created_unix_ms: _Optional[int] = ..., finished_unix_ms: _Optional[int] = ..., model: _Optional[str] = ..., priority: _Optional[_Union[Priority, str]] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("requests", "idempotency_key", "priority")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[Request]
    idempotency_key: str
    priority: Priority
    def __init__(self, requests: _Optional[_Iterable[_Union[Request, _Mapping]]] = ..., idempotency_key: _Optional[str] = ..., priority: _Optional[_Union[Priority, str]] = ...) -> None: ...

class BatchFileChunk(_message.Message):
    __slots__ = ("data", "file_name", "idempotency_key", "priority")
    DATA_FIELD_NUMBER: _ClassVar[int]
    FILE_NAME_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    file_name: str
    idempotency_key: str
    priority: Priority
    def __init__(self, data: _Optional[bytes] = ..., file_name: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., priority: _Optional[_Union[Priority, str]] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("limit", "page_size", "page_token", "states", "created_after_unix_ms")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AFTER_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    limit: int
    page_size: int
    page_token: str
    states: _containers.RepeatedScalarFieldContainer[JobState]
    created_after_unix_ms: int
    def __init__(self, limit: _Optional[int] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., states: _Optional[_Iterable[_Union[JobState, str]]] = ..., created_after_unix_ms: _Optional[int] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class StreamResultsRequest(_message.Message):
    __slots__ = ("job_id", "offset", "follow")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    offset: int
    follow: bool
    def __init__(self, job_id: _Optional[str] = ..., offset: _Optional[int] = ..., follow: _Optional[bool] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request", "priority")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request: Request
    priority: Priority
    def __init__(self, request: _Optional[_Union[Request, _Mapping]] = ..., priority: _Optional[_Union[Priority, str]] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("delta", "result")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    delta: TokenDelta
    result: Result
    def __init__(self, delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., result: _Optional[_Union[Result, _Mapping]] = ...) -> None: ...

class Worker(_message.Message):
    __slots__ = ("worker_id", "node", "state", "running", "queued_tokens", "cache_bytes", "cache_capacity_bytes", "cache_blocks", "hit_ratio", "requests_served", "disk")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATIO_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SERVED_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    node: str
    state: str
    running: int
    queued_tokens: int
    cache_bytes: int
    cache_capacity_bytes: int
    cache_blocks: int
    hit_ratio: float
    requests_served: int
    disk: DiskTier
    def __init__(self, worker_id: _Optional[str] = ..., node: _Optional[str] = ..., state: _Optional[str] = ..., running: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., cache_capacity_bytes: _Optional[int] = ..., cache_blocks: _Optional[int] = ..., hit_ratio: _Optional[float] = ..., requests_served: _Optional[int] = ..., disk: _Optional[_Union[DiskTier, _Mapping]] = ...) -> None: ...

class DiskTier(_message.Message):
    __slots__ = ("blocks", "bytes", "capacity_bytes", "free_bytes", "corrupt", "torn", "outdated", "full", "evictions")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    TORN_FIELD_NUMBER: _ClassVar[int]
    OUTDATED_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    bytes: int
    capacity_bytes: int
    free_bytes: int
    corrupt: int
    torn: int
    outdated: int
    full: bool
    evictions: int
    def __init__(self, blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., corrupt: _Optional[int] = ..., torn: _Optional[int] = ..., outdated: _Optional[int] = ..., full: _Optional[bool] = ..., evictions: _Optional[int] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[Worker]
    def __init__(self, workers: _Optional[_Iterable[_Union[Worker, _Mapping]]] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: int
    def __init__(self, workers: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class InvalidateRequest(_message.Message):
    __slots__ = ("tenant", "messages", "tokens")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    messages: Messages
    tokens: TokenIds
    def __init__(self, tenant: _Optional[str] = ..., messages: _Optional[_Union[Messages, _Mapping]] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class InvalidateResponse(_message.Message):
    __slots__ = ("blocks_removed",)
    BLOCKS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    blocks_removed: int
    def __init__(self, blocks_removed: _Optional[int] = ...) -> None: ...

class CacheStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheStats(_message.Message):
    __slots__ = ("workers", "cache_bytes", "cache_capacity_bytes", "cache_blocks", "input_tokens", "cached_tokens", "computed_tokens", "written_tokens", "hit_ratio", "disk")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATIO_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    workers: int
    cache_bytes: int
    cache_capacity_bytes: int
    cache_blocks: int
    input_tokens: int
    cached_tokens: int
    computed_tokens: int
    written_tokens: int
    hit_ratio: float
    disk: DiskTier
    def __init__(self, workers: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., cache_capacity_bytes: _Optional[int] = ..., cache_blocks: _Optional[int] = ..., input_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., written_tokens: _Optional[int] = ..., hit_ratio: _Optional[float] = ..., disk: _Optional[_Union[DiskTier, _Mapping]] = ...) -> None: ...
