"""Pydantic models of the OpenAI wire format that the server speaks.

Requests are strict (``extra="forbid"``): a misspelt parameter is a 400 naming
it, not a silently ignored value. OpenAI parameters we accept but cannot act
on are listed explicitly and checked to hold their neutral value. Responses
mirror OpenAI's field names so the official ``openai`` client parses them.

Content parts of chat messages are kept as raw dicts here and validated one by
one in ``parse_content_part``, because a pydantic union over them reports
errors at paths a client cannot read (``content.list[...].image_url``).

Every number a request carries is bounded here to what the engine can hold
(int64 / int32 arrays, float32 tensors) and act on, so no value reaches the
sampler that it cannot write; numbers are strict (``"5"``, ``true`` or ``5.0``
is not an integer) and finite. Limits that depend on the prompt (``max_tokens``
against the context) are checked in ``serving_common.check_context``.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, TypeAdapter, ValidationError

from omnistage.entrypoints.openai.errors import APIError, bad_request, from_validation_error


INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_N = 128  # completions per prompt (n, best_of)
MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_TOKEN_ID = INT32_MAX  # past any vocabulary; ids beyond the model's are harmless where they only match

TokenId = Annotated[StrictInt, Field(ge=0, le=MAX_TOKEN_ID)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class _Loose(BaseModel):
    """Nested request objects: OpenAI adds fields to these over time, so ignore extras."""

    model_config = ConfigDict(extra="ignore")


# --------------------------------------------------------------------------- requests


class StreamOptions(_Loose):
    include_usage: bool = False


class AudioOutputParams(_Loose):
    voice: str = Field(min_length=1)
    format: Literal["wav", "mp3", "flac", "opus", "pcm16", "aac"] = "wav"


class ResponseFormat(_Loose):
    type: Literal["text", "json_object", "json_schema"] = "text"


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class _SamplingFields(_Request):
    """Parameters shared by chat and text completions, with OpenAI's ranges
    (vLLM's for its extensions) and an upper bound on every count."""

    model: str | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    # int64, so seed + completion index (n <= 128) stays within what torch generators take.
    seed: StrictInt | None = Field(None, ge=-(2**63), le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    # vLLM's multiplicative penalty (1: off). It divides or multiplies float32
    # logits; this range keeps them finite and is wider than any useful setting.
    repetition_penalty: StrictFloat | None = Field(None, ge=0.01, le=100.0)
    logit_bias: dict[str, Annotated[StrictFloat, Field(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None
    # vLLM-style extensions (sent through ``extra_body`` by the openai client).
    # top_k beyond the vocabulary keeps every token; the bound keeps it far inside the sampler's int64.
    top_k: StrictInt | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: StrictFloat | None = Field(None, ge=0.0, le=1.0)
    min_tokens: StrictInt = Field(0, ge=0, le=INT32_MAX)
    ignore_eos: StrictBool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    # Each prompt token's logprob and the top N at its position (vLLM's ``prompt_logprobs``;
    # answered in the response's ``prompt_logprobs``, not streamed).
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Keep the prompt's last k tokens (-1: as many as the context holds; vLLM's; 0 is refused).
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=-1, le=INT32_MAX)
    # Tenant isolation (vLLM extension): requests share KV blocks and encoder outputs only
    # with requests of the same salt.
    cache_salt: str | None = Field(None, min_length=1)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # Any count fits int64; whether it fits the context is checked against the prompt.
    max_tokens: StrictInt | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioOutputParams | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    # Accepted and ignored: they describe bookkeeping on OpenAI's side, not generation.
    metadata: dict[str, str] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None
    # Chat-template knobs (vLLM extension).
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    # Token ids are checked against the vocabulary by the engine (any int, however large).
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(16, ge=0, le=INT64_MAX)  # 0: the echoed prompt alone
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = Field(None, ge=1, le=MAX_N)


# Content parts of a chat message. ``parse_content_part`` picks one by ``type``.


class TextPart(_Loose):
    type: Literal["text"]
    text: str


class ImageURL(_Loose):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Loose):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(_Loose):
    data: str = Field(min_length=1)
    format: Literal["wav", "mp3"]


class AudioPart(_Loose):
    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = TextPart | ImagePart | AudioPart

_PART_ADAPTERS: dict[str, TypeAdapter[Any]] = {
    "text": TypeAdapter(TextPart),
    "image_url": TypeAdapter(ImagePart),
    "input_audio": TypeAdapter(AudioPart),
}


def parse_content_part(raw: dict[str, Any], param: str) -> ContentPart:
    """Validate one content part; ``param`` is its path (``messages[0].content[1]``)."""
    kind = raw.get("type")
    adapter = _PART_ADAPTERS.get(kind) if isinstance(kind, str) else None
    if adapter is None:
        raise bad_request(
            f"Invalid content part type {kind!r} at {param}; expected one of {sorted(_PART_ADAPTERS)}",
            param=f"{param}.type",
            code="invalid_content_part",
        )
    try:
        return adapter.validate_python(raw)
    except ValidationError as exc:
        raise from_validation_error(exc, prefix=param) from None


def parse_request(model: type[BaseModel], body: Any) -> Any:
    """Validate a decoded JSON body against a request model, or raise an APIError."""
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def unsupported(param: str, why: str) -> APIError:
    return bad_request(f"Parameter {param!r} is not supported: {why}", param=param, code="unsupported_parameter")


# --------------------------------------------------------------------------- responses


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token at one prompt position (vLLM's ``Logprob``): ``rank`` counts from 1 for the most
    likely token and is None for a prompt token outside the top entries asked for."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt token: None for the first, else {token id: its entry} for the token and the top N.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class ChatChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatAudio(BaseModel):
    """The spoken answer (``message.audio``): base64 WAV and its text."""

    id: str
    data: str
    expires_at: int
    transcript: str


class ChatAudioDelta(BaseModel):
    """A piece of the spoken answer in a stream (``delta.audio``). The first piece
    carries ``transcript`` and ``expires_at``; every piece carries ``id`` and
    ``data``, whose base64-decoded bytes, concatenated, are one WAV file."""

    id: str
    data: str
    expires_at: int | None = None
    transcript: str | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    audio: ChatAudio | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extension (request field prompt_logprobs)


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    audio: ChatAudioDelta | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extension (request field prompt_logprobs)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "omnistage"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
