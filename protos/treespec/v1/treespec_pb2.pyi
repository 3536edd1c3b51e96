from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_CANCELLED: FinishReason

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "shared_offset")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHARED_OFFSET_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    shared_offset: int
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., shared_offset: _Optional[int] = ...) -> None: ...

class TreeEnvelope(_message.Message):
    __slots__ = ("name", "depth", "topk", "num_nodes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    name: str
    depth: int
    topk: int
    num_nodes: int
    def __init__(self, name: _Optional[str] = ..., depth: _Optional[int] = ..., topk: _Optional[int] = ..., num_nodes: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "min_p")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    min_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., min_p: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_ids", "max_tokens", "stop_token_ids", "ignore_eos", "sampling", "no_speculation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NO_SPECULATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    sampling: SamplingParams
    no_speculation: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., no_speculation: _Optional[bool] = ...) -> None: ...

class RequestStats(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "steps", "draft_tokens", "accepted_tokens", "fallback_steps", "planned_plain_steps", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_STEPS_FIELD_NUMBER: _ClassVar[int]
    PLANNED_PLAIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    steps: int
    draft_tokens: int
    accepted_tokens: int
    fallback_steps: int
    planned_plain_steps: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., fallback_steps: _Optional[int] = ..., planned_plain_steps: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "stats")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    stats: RequestStats
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[RequestStats, _Mapping]] = ...) -> None: ...

class GenerationInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GenerationInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "eos_token_ids", "max_model_len", "envelope", "draft_connected", "proposer", "has_tokenizer", "sampling_defaults")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    envelope: TreeEnvelope
    draft_connected: bool
    proposer: str
    has_tokenizer: bool
    sampling_defaults: SamplingParams
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ..., envelope: _Optional[_Union[TreeEnvelope, _Mapping]] = ..., draft_connected: _Optional[bool] = ..., proposer: _Optional[str] = ..., has_tokenizer: _Optional[bool] = ..., sampling_defaults: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class DrafterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterInfo(_message.Message):
    __slots__ = ("envelope", "vocab_size", "proposer", "target_hidden_layers", "model", "local_socket", "instance_id", "max_model_len", "projected_width", "lookahead", "prefix_block_size")
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    TARGET_HIDDEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    PROJECTED_WIDTH_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    envelope: TreeEnvelope
    vocab_size: int
    proposer: str
    target_hidden_layers: _containers.RepeatedScalarFieldContainer[int]
    model: str
    local_socket: str
    instance_id: str
    max_model_len: int
    projected_width: int
    lookahead: int
    prefix_block_size: int
    def __init__(self, envelope: _Optional[_Union[TreeEnvelope, _Mapping]] = ..., vocab_size: _Optional[int] = ..., proposer: _Optional[str] = ..., target_hidden_layers: _Optional[_Iterable[int]] = ..., model: _Optional[str] = ..., local_socket: _Optional[str] = ..., instance_id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., projected_width: _Optional[int] = ..., lookahead: _Optional[int] = ..., prefix_block_size: _Optional[int] = ...) -> None: ...

class ProjectionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SequenceUpdate(_message.Message):
    __slots__ = ("seq_id", "committed_len", "new_tokens", "full", "accepted_nodes", "accepted_step_id", "hidden_states", "sampling", "rejection_sampling", "lookahead_hit", "lookahead", "cached_len")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REJECTION_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_HIT_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    committed_len: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    full: bool
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    accepted_step_id: int
    hidden_states: Tensor
    sampling: SamplingParams
    rejection_sampling: bool
    lookahead_hit: int
    lookahead: bool
    cached_len: int
    def __init__(self, seq_id: _Optional[int] = ..., committed_len: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ..., full: _Optional[bool] = ..., accepted_nodes: _Optional[_Iterable[int]] = ..., accepted_step_id: _Optional[int] = ..., hidden_states: _Optional[_Union[Tensor, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., rejection_sampling: _Optional[bool] = ..., lookahead_hit: _Optional[int] = ..., lookahead: _Optional[bool] = ..., cached_len: _Optional[int] = ...) -> None: ...

class SpeculateRequest(_message.Message):
    __slots__ = ("step_id", "sequences", "released", "trace_context", "max_depth")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceUpdate]
    released: _containers.RepeatedScalarFieldContainer[int]
    trace_context: _containers.ScalarMap[str, str]
    max_depth: int
    def __init__(self, step_id: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[SequenceUpdate, _Mapping]]] = ..., released: _Optional[_Iterable[int]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., max_depth: _Optional[int] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("step_id", "seq_ids", "tokens", "parents", "resync", "received_unix_ns", "sent_unix_ns", "q_ids", "q_probs", "lookahead", "lookahead_keys", "lost_prefix")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    Q_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_PROBS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_KEYS_FIELD_NUMBER: _ClassVar[int]
    LOST_PREFIX_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    tokens: Tensor
    parents: Tensor
    resync: _containers.RepeatedScalarFieldContainer[int]
    received_unix_ns: int
    sent_unix_ns: int
    q_ids: Tensor
    q_probs: Tensor
    lookahead: bool
    lookahead_keys: Tensor
    lost_prefix: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., seq_ids: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Union[Tensor, _Mapping]] = ..., parents: _Optional[_Union[Tensor, _Mapping]] = ..., resync: _Optional[_Iterable[int]] = ..., received_unix_ns: _Optional[int] = ..., sent_unix_ns: _Optional[int] = ..., q_ids: _Optional[_Union[Tensor, _Mapping]] = ..., q_probs: _Optional[_Union[Tensor, _Mapping]] = ..., lookahead: _Optional[bool] = ..., lookahead_keys: _Optional[_Union[Tensor, _Mapping]] = ..., lost_prefix: _Optional[_Iterable[int]] = ...) -> None: ...
