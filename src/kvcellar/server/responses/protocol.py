"""Wire types of the Responses API: the top-level fields, typed and strict; ``input`` items and
``tools`` stay plain dicts that the adapter reads one by one, so that each problem is a 400
naming the item (``input[3].call_id``) and item types this server skips need no model."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from kvcellar.server.protocol import Int, _Request


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: str | None = None


class NamedTool(_Request):
    type: Literal["function", "custom"]
    name: str


class ResponsesRequest(_Request):
    model: str
    input: str | Annotated[list[dict[str, Any]], Field(max_length=100_000)]
    instructions: str | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=512)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = Field(None, max_length=256)
    background: bool | None = None
    # Accepted; they change nothing here: include, reasoning, prompt_cache_key, client_metadata,
    # metadata, user, truncation, service_tier, safety_identifier, top_logprobs.
    metadata: dict[str, Any] | None = None


class InputTokensRequest(_Request):
    model: str
    input: str | Annotated[list[dict[str, Any]], Field(max_length=100_000)] | None = None
    instructions: str | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=512)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = Field(None, max_length=256)
