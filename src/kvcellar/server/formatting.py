"""Engine events -> OpenAI response bodies and stream chunks, chat and legacy completions.

Bodies and chunks are built as server/protocol.py's response models (the shapes the
OpenAPI page shows), dumped with only the keys set: a key OpenAI leaves out (a chunk's
``usage`` without ``include_usage``, a tool-call delta's ``content``) stays out.

A ``ResponseBuilder`` is made per request. Non-streaming, it accumulates every event and
builds the final body once; streaming, ``chunks_for(index, event)`` turns each event into
the chunk dicts to send right away. Both paths count the same way:

* ``usage.prompt_tokens`` counts each prompt once, however many choices it has, and
  ``prompt_tokens_details.cached_tokens`` is the prompt tokens reused from the cache by
  each prompt's first choice (its siblings reuse the blocks the first one computed);
* logprobs cover every generated token except an EOS/stop token id (which has no text).
"""

from __future__ import annotations

import copy
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvcellar.engine import TokenEvent
from kvcellar.server.errors import APIError
from kvcellar.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    FunctionCall,
    FunctionCallDelta,
    PromptTokensDetails,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from kvcellar.server.streaming import DONE, sse
from kvcellar.server.tools.parsers import CallFragment, OutputReader, ParsedCall, StreamDelta

RawLogprob = tuple[int, float, list[tuple[int, float]] | None]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable-character table used by byte-level BPE vocabularies."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


class TokenTexts:
    """The bytes and display text of single token ids (for logprobs), cached.

    Used on the event loop thread with its own copy of the tokenizer: HF tokenizers take a
    mutable borrow while encoding (on the tokenizer thread), and a concurrent call from
    another thread would fail with "Already borrowed"."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = copy.deepcopy(tokenizer)
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_of: dict[str, int] | None = None
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        if decoder is not None and type(decoder).__name__ == "ByteLevel":
            self._byte_of = {c: b for b, c in _bytes_to_unicode().items()}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        raw: bytes | None = None
        if self._byte_of is not None:
            piece = self._tok.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(ch in self._byte_of for ch in piece):
                raw = bytes(self._byte_of[ch] for ch in piece)
        if raw is None:
            raw = self._tok.decode([token_id], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False).encode("utf-8")
        out = (raw.decode("utf-8", errors="replace"), list(raw))
        if len(self._cache) < 1_000_000:
            self._cache[token_id] = out
        return out


def finite(x: float) -> float:
    """JSON has no infinities; OpenAI reports an impossible token as -9999."""
    return x if math.isfinite(x) else -9999.0


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class ChoiceState:
    index: int
    prompt_index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[RawLogprob] = field(default_factory=list)
    pending: list[RawLogprob] = field(default_factory=list)  # streamed: tokens whose text is held back
    text_offset: int = 0
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] | None = None
    parser: OutputReader | None = None  # streamed chat with tools or reasoning: this choice's reader


@dataclass
class RequestShape:
    """What a request asked for that changes the response's shape."""

    kind: str  # "chat" | "completion"
    model: str
    fingerprint: str
    n: int
    num_prompts: int
    logprobs: bool
    top_logprobs: int
    include_usage: bool
    echo_texts: Sequence[str] | None = None  # completions with echo: each prompt's text
    tool_parser: Callable[[], OutputReader] | None = None  # chat with tools or reasoning: reads the text


def tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall(id=call.id, type="function", function=FunctionCall(name=call.name, arguments=call.arguments))


def tool_call_delta(delta: CallFragment) -> ToolCallDelta:
    """A call's first fragment carries its id, type and name; the others their arguments only."""
    fn = FunctionCallDelta(arguments=delta.arguments) if delta.name is None else \
        FunctionCallDelta(name=delta.name, arguments=delta.arguments)
    if delta.id is None:
        return ToolCallDelta(index=delta.index, function=fn)
    return ToolCallDelta(index=delta.index, id=delta.id, type="function", function=fn)


def dump(model: Any) -> dict[str, Any]:
    """A response model as JSON, with the keys that were set (``None`` ones too)."""
    out: dict[str, Any] = model.model_dump(exclude_unset=True)
    return out


def final_reason(reason: str | None, called: bool = False) -> Literal["stop", "length", "tool_calls"]:
    """The ``finish_reason`` of a choice that ended normally (on stop or length: the others end
    a request with an error); one that called tools and stopped finishes with ``tool_calls``."""
    if reason == "length":
        return "length"
    if reason != "stop":
        raise ValueError(f"not a normal finish: {reason!r}")
    return "tool_calls" if called else "stop"


def legacy_reason(reason: str | None) -> Literal["stop", "length"]:
    """The same for a legacy completion, which has no tools."""
    return "length" if final_reason(reason) == "length" else "stop"


class ResponseBuilder:
    def __init__(self, shape: RequestShape, tokens: TokenTexts) -> None:
        self.shape = shape
        self.tokens = tokens
        self.id = new_id("chatcmpl" if shape.kind == "chat" else "cmpl")
        self.created = int(time.time())
        self.choices = [ChoiceState(i, i // shape.n) for i in range(shape.n * shape.num_prompts)]
        if shape.tool_parser is not None:
            for c in self.choices:
                c.parser = shape.tool_parser()

    # ---- shared -------------------------------------------------------------------------

    def _record(self, choice: ChoiceState, ev: TokenEvent) -> RawLogprob | None:
        if ev.finish_reason is not None:
            choice.finish_reason = ev.finish_reason
            choice.error = ev.error
        if ev.finish_reason is not None or ev.token_id is not None:
            # Every token event carries the counts so far: a request that ends early (client
            # gone, timeout) still reports what it used.
            choice.num_prompt_tokens = ev.num_prompt_tokens
            choice.num_cached_tokens = ev.num_cached_tokens
            choice.cached_tokens_by_tier = ev.cached_tokens_by_tier
            choice.num_output_tokens = ev.num_output_tokens
        if self.shape.logprobs and ev.token_id is not None and not ev.is_eos and ev.logprob is not None:
            return (ev.token_id, ev.logprob, ev.top_logprobs)
        return None

    def usage(self) -> Usage:
        prompt = cached = completion = 0
        for c in self.choices:
            completion += c.num_output_tokens
            if c.index % self.shape.n == 0:
                prompt += c.num_prompt_tokens
                cached += c.num_cached_tokens
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def _chat_logprobs(self, raws: Sequence[RawLogprob]) -> ChatLogprobs:
        content = []
        for token_id, lp, top in raws:
            text, raw = self.tokens.get(token_id)
            tops = []
            for tid, tlp in (top or [])[: self.shape.top_logprobs]:
                ttext, traw = self.tokens.get(tid)
                tops.append(TopLogprob(token=ttext, logprob=finite(tlp), bytes=traw))
            content.append(TokenLogprob(token=text, logprob=finite(lp), bytes=raw, top_logprobs=tops))
        return ChatLogprobs(content=content, refusal=None)

    def _legacy_logprobs(self, choice: ChoiceState, raws: Sequence[RawLogprob]) -> CompletionLogprobs:
        tokens, token_lps, offsets = [], [], []
        tops: list[dict[str, float] | None] = []
        for token_id, lp, top in raws:
            text, _ = self.tokens.get(token_id)
            tokens.append(text)
            token_lps.append(finite(lp))
            offsets.append(choice.text_offset)
            choice.text_offset += len(text)
            if self.shape.top_logprobs:
                tops.append({self.tokens.get(tid)[0]: finite(tlp) for tid, tlp in (top or [])})
            else:
                tops.append(None)
        return CompletionLogprobs(tokens=tokens, token_logprobs=list(token_lps),
                                  top_logprobs=tops if self.shape.top_logprobs else None, text_offset=offsets)

    # ---- non-streaming ------------------------------------------------------------------

    def add(self, index: int, ev: TokenEvent) -> None:
        choice = self.choices[index]
        raw = self._record(choice, ev)
        if raw is not None:
            choice.logprobs.append(raw)
        if ev.text:
            choice.text.append(ev.text)

    def response(self) -> dict[str, Any]:
        """The body of a request that finished (every choice on stop, length or its tools)."""
        if self.shape.kind != "chat":
            return dump(Completion(id=self.id, object="text_completion", created=self.created, model=self.shape.model,
                                   system_fingerprint=self.shape.fingerprint, choices=self._completion_choices(),
                                   usage=self.usage()))
        choices = []
        for c in self.choices:
            text = "".join(c.text)
            message = AssistantMessage(role="assistant", content=text, refusal=None)
            called = False
            if c.parser is not None:
                parsed = c.parser.parse(text)
                message = AssistantMessage(role="assistant", content=parsed.content, refusal=None)
                if parsed.tool_calls:
                    message.tool_calls = [tool_call(call) for call in parsed.tool_calls]
                    called = True
                if parsed.reasoning is not None:
                    message.reasoning_content = parsed.reasoning
            finish = final_reason(c.finish_reason, called)
            choices.append(ChatChoice(index=c.index, message=message, finish_reason=finish,
                                      logprobs=self._chat_logprobs(c.logprobs) if self.shape.logprobs else None))
        return dump(ChatCompletion(id=self.id, object="chat.completion", created=self.created, model=self.shape.model,
                                   system_fingerprint=self.shape.fingerprint, choices=choices, usage=self.usage()))

    def _completion_choices(self) -> list[CompletionChoice]:
        out = []
        for c in self.choices:
            echo = self.shape.echo_texts[c.prompt_index] if self.shape.echo_texts is not None else ""
            c.text_offset = len(echo)
            out.append(CompletionChoice(
                index=c.index, text=echo + "".join(c.text), finish_reason=legacy_reason(c.finish_reason),
                logprobs=self._legacy_logprobs(c, c.logprobs) if self.shape.logprobs else None))
        return out

    # ---- streaming ----------------------------------------------------------------------

    def _chunk(self, choices: Sequence[ChatChunkChoice | CompletionChoice], usage: Usage | None = None
               ) -> dict[str, Any]:
        """A chunk; ``usage`` is there (null but in the last one) only with ``include_usage``."""
        chunk: ChatCompletionChunk | Completion
        fp = self.shape.fingerprint
        if self.shape.kind == "chat":
            chat = [c for c in choices if isinstance(c, ChatChunkChoice)]
            chunk = ChatCompletionChunk(id=self.id, object="chat.completion.chunk", created=self.created,
                                        model=self.shape.model, system_fingerprint=fp, choices=chat)
        else:
            legacy = [c for c in choices if isinstance(c, CompletionChoice)]
            chunk = Completion(id=self.id, object="text_completion", created=self.created, model=self.shape.model,
                               system_fingerprint=fp, choices=legacy)
        if self.shape.include_usage:
            chunk.usage = usage  # set, so dumped (null but in the last chunk)
        return dump(chunk)

    def stream_start(self) -> list[dict[str, Any]]:
        """Chunks sent before any token: the assistant role (chat), the echoed prompt
        (completions with echo)."""
        out = []
        for c in self.choices:
            if self.shape.kind == "chat":
                out.append(self._chunk([ChatChunkChoice(index=c.index, delta=ChatDelta(role="assistant", content=""),
                                                        logprobs=None, finish_reason=None)]))
            elif self.shape.echo_texts is not None:
                echo = self.shape.echo_texts[c.prompt_index]
                c.text_offset = len(echo)
                out.append(self._chunk([CompletionChoice(index=c.index, text=echo, logprobs=None,
                                                         finish_reason=None)]))
        return out

    def chunks_for(self, index: int, ev: TokenEvent) -> list[dict[str, Any]]:
        """Chunks for one event. The finish chunk is left to the caller for "abort"/"error",
        which end the stream with an error instead."""
        c = self.choices[index]
        raw = self._record(c, ev)
        if raw is not None:
            c.pending.append(raw)
        final = ev.finish_reason in ("stop", "length")
        if ev.finish_reason is not None and not final:
            return []
        out: list[dict[str, Any]] = []
        if self.shape.kind == "chat":
            delta = self._chat_delta(c, ev.text, final)
            if delta.content or delta.tool_calls or delta.reasoning or (final and c.pending):
                logprobs = self._chat_logprobs(c.pending) if self.shape.logprobs else None
                c.pending = []
                calls = [tool_call_delta(d) for d in delta.tool_calls]
                # A delta of tool calls (or reasoning) only carries no content key, as OpenAI sends it.
                body = ChatDelta(content=delta.content, tool_calls=calls) if delta.content and calls else \
                    ChatDelta(tool_calls=calls) if calls else \
                    ChatDelta() if delta.reasoning and not delta.content else ChatDelta(content=delta.content)
                if delta.reasoning:
                    body.reasoning_content = delta.reasoning
                out.append(self._chunk([ChatChunkChoice(index=index, delta=body, logprobs=logprobs,
                                                        finish_reason=None)]))
            if final:
                called = c.parser is not None and c.parser.called
                out.append(self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(), logprobs=None,
                                                        finish_reason=final_reason(ev.finish_reason, called))]))
        elif ev.text or final:
            legacy = self._legacy_logprobs(c, c.pending) if self.shape.logprobs else None
            c.pending = []
            reason = legacy_reason(ev.finish_reason) if final else None
            out.append(self._chunk([CompletionChoice(index=index, text=ev.text, logprobs=legacy,
                                                     finish_reason=reason)]))
        return out

    @staticmethod
    def _chat_delta(c: ChoiceState, text: str, final: bool) -> StreamDelta:
        """What of ``text`` a streamed chat choice sends: all of it as content, or, with
        tools, the content and call fragments its parser has decided on so far."""
        if c.parser is None:
            return StreamDelta(content=text)
        delta = c.parser.feed(text) if text else StreamDelta()
        if final:
            end = c.parser.finish()
            delta = StreamDelta(delta.content + end.content, delta.tool_calls + end.tool_calls,
                                reasoning=delta.reasoning + end.reasoning)
        merged: list[CallFragment] = []
        for d in delta.tool_calls:  # one entry per call and chunk, as OpenAI sends them
            if merged and merged[-1].index == d.index:
                merged[-1].arguments += d.arguments
            else:
                merged.append(CallFragment(d.index, d.id, d.name, d.arguments))
        return StreamDelta(delta.content, merged, reasoning=delta.reasoning)

    def usage_chunk(self) -> dict[str, Any]:
        return self._chunk([], self.usage())

    # ---- as a Renderer (server/internal.py) ------------------------------------------------

    def open_stream(self) -> list[bytes]:
        return [sse(c) for c in self.stream_start()]

    def stream(self, index: int, ev: TokenEvent) -> list[bytes]:
        return [sse(c) for c in self.chunks_for(index, ev)]

    def close_stream(self) -> list[bytes]:
        return [sse(self.usage_chunk()), DONE] if self.shape.include_usage else [DONE]

    def fail_stream(self, err: APIError) -> list[bytes]:
        return [sse(err.body()), DONE]

    def log_fields(self) -> dict[str, Any]:
        usage = self.usage()
        return {"choices": len(self.choices), "finish": ",".join(str(c.finish_reason) for c in self.choices),
                "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": usage.prompt_tokens_details.cached_tokens,
                "completion_tokens": usage.completion_tokens,
                # where the cached tokens came from (first choice): {"ram": n, "ssd": n, "remote": n}
                "cached_by_tier": self.choices[0].cached_tokens_by_tier if self.choices else None}
