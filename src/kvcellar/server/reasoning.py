"""A model's reasoning, read out of its output text and kept out of the answer.

Thinking models write their reasoning before the answer, in markup their chat template names
(``ThinkMarkup``): Qwen3, QwQ, DeepSeek-R1 and Qwen3.5 wrap it in ``<think>`` ... ``</think>``,
Gemma 4 in ``<|channel>thought`` ... ``<channel|>``; templates that open the block themselves
(the generation prompt ends in its opening tag) leave only the closing tag to the model.
``ThinkSplitter`` splits one output into reasoning and the rest; the rest goes on to the
tool-call parser, if any. Each API returns the reasoning its own way (``reasoning_content`` on
chat completions, ``thinking`` blocks on Anthropic Messages, ``reasoning`` items on
Responses), never inside the content.

The split keeps the tool parsers' invariant: it is a function of the text only, never of where
the text was cut into pieces (a tail that may be the start of a tag is held back until decided).
The whitespace a template writes around the tags (``<think>\\n`` ... ``\\n</think>\\n\\n``) is
not reasoning and not content.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from kvcellar.server.tools.parsers import OutputReader, ParsedOutput, StreamDelta, Thought, collect, partial_tail

_WS = " \t\r\n"


@dataclass(frozen=True)
class ThinkMarkup:
    """A family's reasoning block: its opening and closing tags, and what a forced output (a
    tool call, a JSON schema) starts with where the prompt opened the block: the block closed
    empty, as the template writes a turn without reasoning."""

    open: str
    close: str
    empty_close: str


THINK = ThinkMarkup("<think>", "</think>", "\n</think>\n\n")
GEMMA4 = ThinkMarkup("<|channel>thought", "<channel|>", "\n<channel|>")


def template_markup(chat_template: str | None) -> ThinkMarkup | None:
    """The reasoning markup a chat template's model writes (the template renders its tags), or
    None for a model that writes none."""
    template = chat_template or ""
    if "<|channel>" in template and GEMMA4.close in template:
        return GEMMA4
    return THINK if THINK.close in template else None


def starts_inside(prompt_tail: str, markup: ThinkMarkup = THINK) -> bool:
    """Whether a prompt whose text ends with ``prompt_tail`` opened the reasoning block itself
    (the output then starts inside it)."""
    tail = prompt_tail.rstrip(_WS)
    return tail.endswith(markup.open)


class _State(Enum):
    START = "start"  # nothing decided: leading whitespace, maybe the opening tag
    LEAD = "lead"  # just inside the block: whitespace there is not reasoning
    INSIDE = "inside"
    AFTER = "after"  # just past the closing tag: whitespace there is not content
    CONTENT = "content"


class ThinkSplitter:
    """Splits one output into (reasoning, content) pieces: ``feed`` pieces, then ``finish``.
    Only a block that opens the output is reasoning; a ``<think>`` later on is content."""

    def __init__(self, inside: bool = False, markup: ThinkMarkup = THINK) -> None:
        self._state = _State.LEAD if inside else _State.START
        self._buf = ""
        self._open, self._close = markup.open, markup.close

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            buf = self._buf
            if self._state is _State.START:
                body = buf.lstrip(_WS)
                if body.startswith(self._open):
                    self._buf, self._state = body[len(self._open):], _State.LEAD
                elif not final and (not body or self._open.startswith(body)):
                    break  # whitespace only, or a start of the tag: not decided yet
                else:
                    self._state = _State.CONTENT
            elif self._state in (_State.LEAD, _State.AFTER):
                body = buf.lstrip(_WS)
                if not body and not final:
                    break
                self._buf = body
                self._state = _State.INSIDE if self._state is _State.LEAD else _State.CONTENT
            elif self._state is _State.INSIDE:
                at = buf.find(self._close)
                if at >= 0:
                    reasoning.append(buf[:at].rstrip(_WS))
                    self._buf, self._state = buf[at + len(self._close):], _State.AFTER
                    continue
                # Hold a tail that may be whitespace before the closing tag, or its start.
                keep = 0 if final else partial_tail(buf, self._close)
                head = buf[:len(buf) - keep]
                core = head if final else head.rstrip(_WS)
                reasoning.append(core)
                self._buf = buf[len(core):]
                if not final:
                    break
            else:
                content.append(buf)
                self._buf = ""
        return "".join(reasoning), "".join(content)


class ReasoningReader:
    """One output read as reasoning, then content and tool calls: an ``OutputReader``
    (``feed``/``finish``/``parse``/``called``) whose deltas and parse also carry the reasoning
    (``StreamDelta.reasoning`` and ``Thought`` items; ``ParsedOutput.reasoning``)."""

    def __init__(self, make_splitter: Callable[[], ThinkSplitter], make_calls: Callable[[], OutputReader] | None
                 ) -> None:
        self._make_splitter, self._make_calls = make_splitter, make_calls
        self._splitter = make_splitter()
        self._calls = make_calls() if make_calls is not None else None

    @property
    def called(self) -> bool:
        return self._calls is not None and self._calls.called

    def feed(self, text: str) -> StreamDelta:
        return self._delta(*self._splitter.feed(text), final=False)

    def finish(self) -> StreamDelta:
        return self._delta(*self._splitter.finish(), final=True)

    def parse(self, text: str) -> ParsedOutput:
        """The whole ``text`` read by a fresh reader (this one's stream is untouched)."""
        fresh = ReasoningReader(self._make_splitter, self._make_calls)
        return collect([fresh.feed(text), fresh.finish()])

    def _delta(self, reasoning: str, content: str, final: bool) -> StreamDelta:
        out = StreamDelta()
        if reasoning:
            out.reasoning = reasoning
            out.items.append(Thought(reasoning))
        if self._calls is None:
            out.text(content)
            return out
        inner = self._calls.feed(content) if content else StreamDelta()
        if final:
            end = self._calls.finish()
            inner = StreamDelta(inner.content + end.content, inner.tool_calls + end.tool_calls,
                                inner.items + end.items)
        out.content, out.tool_calls = inner.content, inner.tool_calls
        out.items.extend(inner.items)
        return out


def reader_factory(inside: bool, calls: Callable[[], OutputReader] | None,
                   markup: ThinkMarkup = THINK) -> Callable[[], ReasoningReader]:
    """Readers of a thinking model's outputs: reasoning first (``inside``: the prompt opened
    its block), then what ``calls`` makes of the rest (plain content without tools)."""
    return lambda: ReasoningReader(lambda: ThinkSplitter(inside, markup), calls)
