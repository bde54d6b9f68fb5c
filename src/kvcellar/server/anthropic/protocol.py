"""Wire types of the Anthropic Messages API, as the official SDK sends them.

Strict on types, tolerant of unknown fields (new API fields must not break old servers).
Fields that mean nothing here are accepted and ignored: ``thinking``, ``context_management``,
``output_config.effort``, ``metadata``, ``service_tier``, ``cache_control`` on any block, ``citations``.
Block types this server cannot serve (``image``, ``document``, ...) are recognised so the
error names them; anything else is an unknown block type. Both are 400s.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from kvcellar.server.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS, Int, _Request

UNSUPPORTED_BLOCKS = ("image", "document", "search_result", "container_upload")
# Blocks of an assistant turn that carry nothing we render (our replies never hold them).
SKIPPED_BLOCKS = ("redacted_thinking", "server_tool_use", "web_search_tool_result",
                  "web_fetch_tool_result", "code_execution_tool_result", "mcp_tool_use", "mcp_tool_result")


class TextBlock(_Request):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Request):
    type: Literal["tool_use"]
    id: str = Field(max_length=256)
    name: str = Field(max_length=256)
    input: dict[str, Any]


class ToolResultBlock(_Request):
    type: Literal["tool_result"]
    tool_use_id: str = Field(max_length=256)
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Request):
    """An assistant turn's reasoning, as this server returned it (rendered back where the
    model's template renders reasoning). The signature is not checked: there is none to check."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class OtherBlock(_Request):
    """A block type we recognise but do not serve, or skip (see the module docstring)."""

    type: Literal[UNSUPPORTED_BLOCKS + SKIPPED_BLOCKS]  # type: ignore[valid-type]  # built from tuples at runtime


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | OtherBlock,
                  Field(discriminator="type")]


class Message(_Request):
    # "system" entries inside messages are what Claude Code sends for reminders.
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(_Request):
    """A client tool (``input_schema``), or a server tool (``type`` like ``web_search_20250305``,
    no schema) that this server ignores."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class JsonOutputFormat(_Request):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Request):
    """``format`` constrains the reply to a JSON schema; ``effort`` means nothing here."""

    format: JsonOutputFormat | None = None


StopSequence = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class MessagesRequest(_Request):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: Int = Field(ge=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: Annotated[list[StopSequence], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=0)
    tools: Annotated[list[Tool], Field(max_length=256)] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None


class CountTokensRequest(_Request):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[Tool], Field(max_length=256)] | None = None
    tool_choice: ToolChoice | None = None
