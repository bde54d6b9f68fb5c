"""gpt-oss's "harmony" chat format: its output read as reasoning, content and tool calls.

A gpt-oss reply is a sequence of messages, each a header and a body made of special tokens
(so the server detokenizes with them kept):

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"a": 1}<|call|>
    <|start|>assistant<|channel|>final<|message|>The answer.<|return|>

A message's channel decides what its body is: ``analysis`` is reasoning (returned as each API
returns reasoning, never in the content); a message addressed ``to=functions.NAME`` (the
recipient may also sit in the role part of the header) is a call of that tool, its body the
arguments; ``final`` and ``commentary`` to nobody are content. A message to a recipient the
request did not offer keeps its body as content. An output that does not start with a
harmony header is content as it is.

``HarmonyReader`` keeps the tool parsers' invariant: what it reads is a function of the text
only, never of where the text was cut (a tail that may be the start of a marker is held back
until decided).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from enum import Enum

from kvcellar.server.tools.parsers import (
    CallReporter,
    ParsedCall,
    ParsedOutput,
    StreamDelta,
    Thought,
    collect,
    partial_tail,
)

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
# How a header may begin: a channel, the next message's start, a recipient before the channel.
_HEADER_STARTS = (CHANNEL, START, CONSTRAIN, " to=", "to=")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
FUNCTIONS = "functions."


def template_is_harmony(chat_template: str | None) -> bool:
    """Whether a chat template writes the harmony format (gpt-oss)."""
    return bool(chat_template) and CHANNEL in (chat_template or "") and MESSAGE in (chat_template or "")


class _State(Enum):
    HEADER = "header"  # reading a message's header, up to <|message|>
    BODY = "body"
    PLAIN = "plain"  # not harmony: all content


class HarmonyReader(CallReporter):
    """Reads one gpt-oss output (an ``OutputReader``): ``feed`` pieces, then ``finish``; or
    ``parse`` a whole text. ``tool_names``: the tools its calls may name (None: any)."""

    def __init__(self, tool_names: Collection[str] | None = None,
                 on_finish: Callable[[list[ParsedCall]], None] | None = None) -> None:
        self._names = frozenset(tool_names) if tool_names is not None else None
        self.on_finish = on_finish
        self._buf = ""
        self._state = _State.HEADER
        self._first = True  # still in the output's first header: it decides harmony or plain
        self._route = "content"  # where the body goes: "reasoning", "content" or "call"
        self._calls = 0
        self._args_sent = False
        self._read: list[ParsedCall] = []
        self._out = StreamDelta()

    @property
    def called(self) -> bool:
        return self._calls > 0

    def parse(self, text: str) -> ParsedOutput:
        fresh = HarmonyReader(self._names, self.on_finish)
        return collect([fresh.feed(text), fresh.finish()])

    def feed(self, text: str) -> StreamDelta:
        self._buf += text
        self._advance(final=False)
        return self._take()

    def finish(self) -> StreamDelta:
        self._advance(final=True)
        if self._state is _State.BODY and self._route == "call":
            self._end_call()
        if self.on_finish is not None:
            self.on_finish(list(self._read))
        return self._take()

    # ---- the state machine --------------------------------------------------------------

    def _advance(self, final: bool) -> None:
        while self._buf:
            if self._state is _State.PLAIN:
                self._text(self._buf, "content")
                self._buf = ""
            elif self._state is _State.HEADER:
                head = self._buf.lstrip()
                if head and not any(head.startswith(s) or s.startswith(head) for s in _HEADER_STARTS):
                    self._state = _State.PLAIN  # no harmony header: the text is the answer
                    continue
                at = self._buf.find(MESSAGE)
                if at < 0:
                    if final:  # the output ended in a header: markup, unless it is all there is
                        if self._first:
                            self._text(self._buf, "content")
                        self._buf = ""
                    return
                self._open(self._buf[:at])
                self._buf = self._buf[at + len(MESSAGE):]
            else:
                at, marker = self._next_marker()
                if at < 0:
                    keep = 0 if final else max(partial_tail(self._buf, m) for m in MARKERS)
                    self._body(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return
                self._body(self._buf[:at])
                self._close()
                # an end marker is consumed; a header marker starts the next header
                self._buf = self._buf[at + len(marker):] if marker in ENDS else self._buf[at:]
                self._state = _State.HEADER

    def _next_marker(self) -> tuple[int, str]:
        found = [(self._buf.find(m), m) for m in (*ENDS, START, CHANNEL)]
        hits = [(i, m) for i, m in found if i >= 0]
        return min(hits) if hits else (-1, "")

    def _open(self, header: str) -> None:
        """A message's header read: route its body."""
        self._first = False
        self._state = _State.BODY
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        name = recipient.group(1) if recipient else None
        if name is not None and name.startswith(FUNCTIONS) and self._allowed(name[len(FUNCTIONS):]):
            self._route = "call"
            self._start_call(name[len(FUNCTIONS):])
        elif name is None and channel is not None and channel.group(1) == "analysis":
            self._route = "reasoning"
        else:
            self._route = "content"

    def _close(self) -> None:
        if self._route == "call":
            self._end_call()
        self._route = "content"

    def _body(self, text: str) -> None:
        if not text:
            return
        if self._route == "call":
            self._args(text)
        else:
            self._text(text, self._route)

    # ---- what it reports ----------------------------------------------------------------

    def _allowed(self, name: str) -> bool:
        return bool(name) and (self._names is None or name in self._names)

    def _text(self, text: str, route: str) -> None:
        if not text:
            return
        if route == "reasoning":
            self._out.reasoning += text
            last = self._out.items[-1] if self._out.items else None
            if isinstance(last, Thought):
                last.text += text
            else:
                self._out.items.append(Thought(text))
        else:
            self._out.text(text)


def reader_factory(tool_names: Collection[str] | None,
                   on_finish: Callable[[list[ParsedCall]], None] | None = None) -> Callable[[], HarmonyReader]:
    return lambda: HarmonyReader(tool_names, on_finish)
