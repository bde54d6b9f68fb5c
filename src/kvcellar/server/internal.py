"""The one internal request every API front-end produces, and the output pieces it reads back.

Each API (chat completions, legacy completions, Responses, Anthropic Messages) is an adapter:
it validates its own wire shape, turns it into an ``InternalRequest`` (OpenAI-shaped chat
messages with tool calls and results, a ``ToolPlan``, an output constraint, sampling and
limits), and renders the one engine event stream in its own JSON / SSE shape. Rendering the
prompt, compiling grammars, running, timeouts, disconnects and errors are shared
(``serving.Serving``); so is reading calls out of the text (``OutputTracker``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvcellar.engine import SamplingParams, TokenEvent
from kvcellar.server.errors import APIError
from kvcellar.server.tools.parsers import CallFragment, OutputReader, Thought
from kvcellar.server.tools.request import ToolPlan


@dataclass
class OutputSpec:
    """A constraint on the whole output that is not a tool call: a JSON schema, or a Lark
    grammar (a forced custom tool of the Responses API). ``param`` is what errors blame."""

    schema: dict[str, Any] | None = None
    lark: str | None = None
    param: str = "response_format"


@dataclass
class InternalRequest:
    api: str  # "chat" | "responses" | "messages": for logs
    model: str
    messages: list[dict[str, Any]]  # OpenAI chat shape: role, content (text), name, tool_calls, tool_call_id
    params: SamplingParams  # max_tokens is replaced by ``max_tokens`` or the room left
    max_tokens: int | None = None
    tools: ToolPlan | None = None
    output: OutputSpec | None = None
    n: int = 1
    stream: bool = False
    cache_salt: str | None = None
    first_token_timeout: float | None = None
    inter_token_timeout: float | None = None
    # The caller chose skip_special_tokens itself (else tool markup made of special tokens is kept)
    explicit_skip_special: bool = False
    # The prompt's tokens before its generation prompt (set by ``prepare_chat``; engine.submit's
    # ``history_tokens``)
    history_tokens: int | None = None


class Renderer(Protocol):
    """One API's view of one request's events (made per request by its adapter)."""

    id: str

    def add(self, index: int, ev: TokenEvent) -> None: ...
    def response(self) -> dict[str, Any]: ...
    def open_stream(self) -> list[bytes]: ...
    def stream(self, index: int, ev: TokenEvent) -> list[bytes]: ...
    def close_stream(self) -> list[bytes]: ...
    def fail_stream(self, err: APIError) -> list[bytes]: ...
    def log_fields(self) -> dict[str, Any]: ...


# ---- output pieces --------------------------------------------------------------------------


@dataclass
class Text:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class CallArgs:
    index: int
    text: str


@dataclass
class Reasoning:
    """The model's reasoning (server/reasoning.py), before the content it came before."""

    text: str


Piece = Text | CallStart | CallArgs | Reasoning


@dataclass
class OutputTracker:
    """One choice's output as decided pieces of content and tool calls, plus its totals.

    Fed every event of the choice (in order); ``feed`` yields what became certain. With a
    tool parser, text that may still be call markup is held back until decided; the pieces
    of a whole output equal those of the same output streamed (the parser's invariant). A
    thinking model's reasoning comes as ``Reasoning`` pieces."""

    parser: OutputReader | None = None
    max_calls: int = 1 << 30
    finish_reason: str | None = None
    stop_string: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] | None = None
    calls: list[CallStart] = field(default_factory=list)
    arguments: dict[int, list[str]] = field(default_factory=dict)

    def feed(self, ev: TokenEvent) -> Iterator[Piece]:
        if ev.finish_reason is not None or ev.token_id is not None:
            self.num_prompt_tokens = ev.num_prompt_tokens
            self.num_cached_tokens = ev.num_cached_tokens
            self.num_output_tokens = ev.num_output_tokens
            self.cached_tokens_by_tier = ev.cached_tokens_by_tier
        if ev.finish_reason is not None:
            self.finish_reason = ev.finish_reason
            self.stop_string = ev.stop_string
            self.error = ev.error
        final = ev.finish_reason in ("stop", "length")
        if self.parser is None:
            if ev.text:
                yield Text(ev.text)
            return
        items: list[str | CallFragment | Thought] = []
        if ev.text:
            items += self.parser.feed(ev.text).items
        if final:
            items += self.parser.finish().items
        yield from self._pieces(items)

    def _pieces(self, items: list[str | CallFragment | Thought]) -> Iterator[Piece]:
        for d in items:
            if isinstance(d, str):
                yield Text(d)
                continue
            if isinstance(d, Thought):
                yield Reasoning(d.text)
                continue
            if d.index >= self.max_calls:
                continue  # one call only (parallel calls off): later ones are dropped
            if d.name is not None:
                start = CallStart(d.index, d.id or "", d.name)
                self.calls.append(start)
                self.arguments[d.index] = []
                yield start
            if d.arguments:
                self.arguments[d.index].append(d.arguments)
                yield CallArgs(d.index, d.arguments)

    def arguments_of(self, index: int) -> str:
        return "".join(self.arguments.get(index, ())) or "{}"

    def log_fields(self) -> dict[str, Any]:
        return {"finish": self.finish_reason, "prompt_tokens": self.num_prompt_tokens,
                "cached_tokens": self.num_cached_tokens, "completion_tokens": self.num_output_tokens,
                "cached_by_tier": self.cached_tokens_by_tier}

    @property
    def called(self) -> bool:
        return bool(self.calls)

    @property
    def cut_short(self) -> bool:
        return self.finish_reason == "length"
