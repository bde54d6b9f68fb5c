"""Wire types of the OpenAI-compatible API.

Requests are validated strictly on type (a string is not a number, ``"true"`` is not a
boolean) and on range; unknown extra fields are tolerated, as OpenAI does. Every optional
field accepts ``null``. Response models document the shapes (OpenAPI) and let tests check
what the server sends; the serving code builds the same shapes as plain dicts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

# vLLM/SGLang extras we accept, beyond OpenAI's fields: top_k, ignore_eos, stop_token_ids,
# skip_special_tokens, cache_salt, and per-request timeouts (never above the server's).

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20


def _integral(value: Any) -> Any:
    """JSON does not tell 2 from 2.0 (JSON Schema calls both integers): accept whole floats."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# An integer parameter: strict (no strings, no booleans), but 2.0 counts as 2.
Int = Annotated[int, BeforeValidator(_integral)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


MAX_STOP_CHARS = 1024  # the stop matcher's work per token grows with a stop string's length

StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]


class StreamOptions(_Request):
    include_usage: bool | None = None


class ContentPart(_Request):
    """Only text parts are served; the other OpenAI part types are recognised and refused."""

    type: Literal["text", "image_url", "input_audio", "file", "refusal"]
    text: str | None = None


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


class FunctionCallText(_Request):
    name: FunctionName
    arguments: str = Field(max_length=1 << 20)


class MessageToolCall(_Request):
    """A call the assistant made earlier in the conversation."""

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCallText


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    # An assistant turn's reasoning, as this server returned it: rendered back where the
    # model's template renders reasoning, so the next turn's prompt repeats what was generated.
    reasoning_content: str | None = None


class FunctionDefinition(_Request):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Request):
    name: str = Field(max_length=64)
    description: str | None = None
    # "schema" would shadow BaseModel.schema: stored as json_schema, read and written as "schema".
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Request):
    """Fields shared by chat and legacy completions."""

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: Int | None = Field(None, ge=1, le=128)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    seed: Int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extras
    cache_salt: str | None = Field(None, max_length=4096, description="Separates this request's prefix "
                                   "cache from requests with another (or no) salt.")
    top_k: Int | None = Field(None, ge=-1, description="-1 or 0: off")
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=256)
    skip_special_tokens: bool | None = None
    first_token_timeout: float | None = Field(None, gt=0.0, description="seconds; capped by the server's")
    inter_token_timeout: float | None = Field(None, gt=0.0, description="seconds; capped by the server's")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


Prompt = str | Annotated[list[str], Field(min_length=1)] | Annotated[list[int], Field(min_length=1)] \
    | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: Int | None = Field(None, ge=1)
    logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = None
    suffix: str | None = None
    response_format: ResponseFormat | None = None
    best_of: Int | None = Field(None, ge=1, le=128)


# ---- responses ------------------------------------------------------------------------------


class PromptTokensDetails(_Response):
    cached_tokens: int


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str


class ToolCall(_Response):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Response):
    role: Literal["assistant"]
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # a thinking model's reasoning (server/reasoning.py)


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(_Response):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class Completion(_Response):
    """Also the shape of each streamed chunk (``finish_reason`` null until the last)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(_Response):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(_Response):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(_Response):
    error: ErrorDetail
