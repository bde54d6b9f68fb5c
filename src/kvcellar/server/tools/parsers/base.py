"""What every tool-call parser family shares: the output types, the ``ToolParser`` base class and the
JSON call-object scanner. The families turn a model's raw output text into content and OpenAI
``tool_calls``.

A model with tools writes its calls as text markup; each family has its own (see the family modules). The raw
text includes special tokens (the server detokenizes with ``skip_special_tokens=False`` when tools are
active). One parser object reads one output, either whole (``parse``) or streamed (``feed`` pieces, then
``finish``).

Invariants, for every family:

- ``parse(text)`` is by definition the stream fed ``text`` in one piece and finished, and the stream is
  a function of the text only, never of where it was cut: for ANY cutting of an output into pieces, the
  concatenated streamed content equals ``parse(text).content or ""``, and the calls rebuilt from the
  deltas (name, concatenated arguments) equal ``parse(text).tool_calls`` (ids aside). Text that may still
  turn out to be markup (``<tool_`` at the end of a piece, a leading ``{`` for llama3) is held back until
  decided, so markup never reaches streamed content.
- A block becomes a call when its function name has been read completely and is allowed (``tool_names``
  is None, or holds the name); at that moment the call's first delta (index, id, name) is emitted. Until
  then the block is held back; if it turns out not to be a call (invalid JSON, a key other than the ones
  the family knows, no string ``name``, an unknown tool, the output ending first) its text is released
  as content unchanged.
- Once emitted, a call stays a call: its arguments are streamed raw as they arrive (the JSON value is
  delimited by tracking strings, escapes and nesting, so no closing tag is awaited), and if the output
  ends inside them (``max_tokens``) or the markup goes wrong after them, the call keeps what was
  streamed. ``ParsedCall.arguments`` is the model's arguments text as written, ``"{}"`` when it gave none.
- Whitespace that only separates calls from each other, from the end of the output, or from the content
  before them is not content: the whitespace run right before a call is dropped, and so is a
  whitespace-only stretch after the last call. ``content`` is None when there are calls and nothing else;
  with no calls it is the whole text, unchanged.

``on_finish``, when set, is called once with the output's calls when it ends (``finish``, or
``parse``'s fresh parser): the server checks a forced call's arguments there.

Not thread-safe: one parser object belongs to one request.
"""

from __future__ import annotations

import json
import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Protocol

_JSON_WS = " \t\n\r"
_ID_ALPHABET = string.ascii_letters + string.digits
_NAME_KEY = "name"
_ARGUMENT_KEYS = frozenset({"arguments", "parameters"})
_IGNORED_KEYS = frozenset({"id", "type"})  # string-valued keys some models add beside name/arguments


@dataclass
class ParsedCall:
    """A tool call read out of the model's text, in no API's shape (server/protocol.py's
    ``ToolCall`` is OpenAI's wire shape; the Anthropic and Responses renderers have their own)."""

    name: str
    arguments: str  # the arguments JSON text as the model wrote it; "{}" when it gave none
    id: str  # "call_" + 24 random [A-Za-z0-9], see new_call_id()


@dataclass
class ParsedOutput:
    content: str | None  # text outside the markup; None when there are calls and nothing else
    tool_calls: list[ParsedCall]
    reasoning: str | None = None  # the model's reasoning, where its family writes some (server/reasoning.py)


@dataclass
class CallFragment:
    """One entry of a streamed ``delta.tool_calls``. A call's first entry carries ``id`` and ``name``;
    the ``arguments`` fragments of one index concatenate to its ``ParsedCall.arguments``."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class Thought:
    """Reasoning text (server/reasoning.py), an entry of ``StreamDelta.items``."""

    text: str


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[CallFragment] = field(default_factory=list)
    # The same content and call fragments (and reasoning) in the order they were written
    # (text after a call stays after it), for APIs whose output is a list of blocks.
    items: list[str | CallFragment | Thought] = field(default_factory=list)
    reasoning: str = ""

    def text(self, piece: str) -> None:
        if piece:
            self.content += piece
            self.items.append(piece)


def random_id(prefix: str) -> str:
    """``prefix`` + 24 random [A-Za-z0-9], the shape of OpenAI's and Anthropic's ids."""
    return prefix + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def new_call_id() -> str:
    return random_id("call_")


class _Status(Enum):
    MORE = "more"  # the buffer is used up; the object is not finished
    DONE = "done"  # a call object ended (its call is emitted and ended)
    INVALID = "invalid"  # not a call; its text so far is in parser._held, the offending char in parser._buf
    MALFORMED = "malformed"  # the call was emitted, then the markup broke at parser._buf[0]


class _Literal(Enum):
    MATCH = "match"
    PARTIAL = "partial"  # the buffer is a proper prefix of the literal: wait for more text
    NO = "no"


class _NestingScanner:
    """Finds the end of one JSON object or array fed in pieces, starting at its opening bracket.
    Tracks strings and escapes so brackets and quotes inside strings do not count; does not
    otherwise validate the JSON (a truncated or sloppy value is the model's, streamed as written)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def scan(self, text: str) -> int:
        """Index just past the closing bracket if it is in ``text``, else -1."""
        for i, c in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return -1


class OutputReader(Protocol):
    """What reads one output for the server: a ``ToolParser``, or a reader that also takes the
    model's reasoning out of it (server/reasoning.py)."""

    @property
    def called(self) -> bool: ...
    def feed(self, text: str) -> StreamDelta: ...
    def finish(self) -> StreamDelta: ...
    def parse(self, text: str) -> ParsedOutput: ...


class CallReporter:
    """How a reader of outputs reports calls, as deltas: a call's first fragment (index, id,
    name), its arguments as they come, ``"{}"`` for a call that gave none. Shared by the tool
    parsers and the harmony reader (server/harmony.py)."""

    _out: StreamDelta
    _read: list[ParsedCall]  # the calls so far, for on_finish
    _calls: int
    _args_sent: bool  # the current call has streamed some arguments

    def _start_call(self, name: str) -> None:
        self._args_sent = False
        delta = CallFragment(index=self._calls, id=new_call_id(), name=name)
        self._read.append(ParsedCall(name, "", delta.id or ""))
        self._out.tool_calls.append(delta)
        self._out.items.append(delta)
        self._calls += 1

    def _args(self, fragment: str) -> None:
        if not fragment:
            return
        self._args_sent = True
        self._read[-1].arguments += fragment
        last = self._out.items[-1] if self._out.items else None
        if isinstance(last, CallFragment) and last.index == self._calls - 1:
            last.arguments += fragment
        else:
            delta = CallFragment(index=self._calls - 1, arguments=fragment)
            self._out.tool_calls.append(delta)
            self._out.items.append(delta)

    def _end_call(self) -> None:
        if not self._args_sent:
            self._args("{}")

    def _take(self) -> StreamDelta:
        out, self._out = self._out, StreamDelta()
        return out


class ToolParser(CallReporter, ABC):
    """Reads one output. ``feed`` the pieces in order, then ``finish`` once; or ``parse`` a whole text
    (a fresh parser with the same ``tool_names``; this object's stream is untouched).

    Subclasses implement ``_advance`` (consume what can be decided from ``_buf``; return False when
    it needs more text) and ``_end`` (the output ended: settle whatever state is open). They report
    through ``_content``, ``_release_held``, ``_start_call``, ``_args`` and ``_end_call``.
    """

    family: ClassVar[str]

    def __init__(self, tool_names: Collection[str] | None = None,
                 schemas: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self._tool_names = frozenset(tool_names) if tool_names is not None else None
        # Each tool's ``parameters`` schema by name: a family whose markup writes arguments
        # as text, not JSON, types their values by it.
        self._schemas: Mapping[str, Mapping[str, Any]] = schemas or {}
        self._buf = ""  # received, not yet consumed
        self._held = ""  # consumed markup of a block not yet decided: content if it is not a call
        self._ws_pending = ""  # trailing whitespace of the content so far, not yet emitted
        self._after_call = False  # a call was emitted and no content other than whitespace since
        self._calls = 0
        self._args_sent = False  # the current call has streamed some arguments
        self._out = StreamDelta()
        self._read: list[ParsedCall] = []  # the calls so far, for on_finish
        self.on_finish: Callable[[list[ParsedCall]], None] | None = None

    def parse(self, text: str) -> ParsedOutput:
        fresh = type(self)(self._tool_names, self._schemas)
        fresh.on_finish = self.on_finish
        return collect([fresh.feed(text), fresh.finish()])

    def feed(self, text: str) -> StreamDelta:
        self._buf += text
        while self._advance(final=False):
            pass
        return self._take()

    def finish(self) -> StreamDelta:
        while self._advance(final=True):
            pass
        self._end()
        if self._ws_pending and not self._after_call:
            self._out.text(self._ws_pending)
        self._ws_pending = ""
        if self.on_finish is not None:
            self.on_finish(list(self._read))
        return self._take()

    @property
    def called(self) -> bool:
        return self._calls > 0

    @abstractmethod
    def _advance(self, final: bool) -> bool: ...

    @abstractmethod
    def _end(self) -> None: ...

    # -- what subclasses report --

    def _content(self, text: str) -> None:
        if not text:
            return
        core = text.rstrip()
        if not core:
            self._ws_pending += text
            return
        self._out.text(self._ws_pending + core)
        self._ws_pending = text[len(core) :]
        self._after_call = False

    def _release_held(self) -> None:
        held, self._held = self._held, ""
        self._content(held)

    def _allowed(self, name: str) -> bool:
        return bool(name) and (self._tool_names is None or name in self._tool_names)

    def _start_call(self, name: str) -> None:
        self._held = ""
        self._ws_pending = ""
        self._after_call = True
        super()._start_call(name)

    # -- buffer helpers --

    def _consume(self, n: int, *, hold: bool) -> str:
        taken, self._buf = self._buf[:n], self._buf[n:]
        if hold:
            self._held += taken
        return taken

    def _skip_ws(self, *, hold: bool) -> None:
        n = len(self._buf) - len(self._buf.lstrip(_JSON_WS))
        if n:
            self._consume(n, hold=hold)

    def _literal(self, literal: str, final: bool) -> _Literal:
        if self._buf.startswith(literal):
            return _Literal.MATCH
        if not final and literal.startswith(self._buf):
            return _Literal.PARTIAL
        return _Literal.NO

    def _content_until(self, marker: str, final: bool) -> bool:
        """Emit content up to ``marker`` (consumed, held). True when the marker was found; otherwise
        holds back a tail that could be the marker's start (unless ``final``)."""
        i = self._buf.find(marker)
        if i >= 0:
            self._content(self._consume(i, hold=False))
            self._consume(len(marker), hold=True)
            return True
        keep = 0 if final else partial_tail(self._buf, marker)
        self._content(self._consume(len(self._buf) - keep, hold=False))
        return False

class BlockParser(ToolParser):
    """A family whose calls sit in ``OPEN ... CLOSE`` blocks among the text (Hermes, the XML
    markup): what follows a call's end, and what becomes of a block that is no call."""

    OPEN: ClassVar[str]
    CLOSE: ClassVar[str]
    _state: str

    def _after_call_or_block(self, state: str, final: bool) -> bool:
        """The states every block family ends a block in: ``"close"`` (a call ended: its
        ``CLOSE``, or the next ``OPEN``, leads back to content), ``"invalid"`` (the block's text
        is content) or ``"swallow"`` (it is dropped) up to the block's end. False while more text
        may decide."""
        if state == "close":
            after = self._next_after_call(final)
            if after is None:
                return False
            self._state = after
            return True
        if not self._finish_block(keep_text=state == "invalid", final=final):
            return False
        self._state = "content"
        return True

    def _next_after_call(self, final: bool) -> str | None:
        """After a call's end: its ``CLOSE`` (consumed) or the next ``OPEN`` leads back to
        ``"content"``, anything else to ``"swallow"``; None while more text may decide."""
        self._skip_ws(hold=False)
        if not self._buf:
            return None
        closing, opening = self._literal(self.CLOSE, final), self._literal(self.OPEN, final)
        if closing is _Literal.MATCH:
            self._consume(len(self.CLOSE), hold=False)
            return "content"
        if opening is _Literal.MATCH:
            return "content"
        if _Literal.PARTIAL in (closing, opening):
            return None
        return "swallow"

    def _finish_block(self, *, keep_text: bool, final: bool) -> bool:
        """Pass the rest of a block that is not (or no longer) a call, up to and including its
        ``CLOSE``, or up to an ``OPEN`` that opens the next block, whichever comes first.
        True when the block's end was found; otherwise holds back a tail that may be either tag."""
        close, open_ = self._buf.find(self.CLOSE), self._buf.find(self.OPEN)
        found = close >= 0 or open_ >= 0
        if open_ >= 0 and (close < 0 or open_ < close):
            end = open_
        elif close >= 0:
            end = close + len(self.CLOSE)
        else:
            keep = 0 if final else max(partial_tail(self._buf, self.CLOSE), partial_tail(self._buf, self.OPEN))
            end = len(self._buf) - keep
        passed = self._consume(end, hold=False)
        if keep_text:
            self._content(passed)
        return found


def collect(deltas: Collection[StreamDelta]) -> ParsedOutput:
    """Rebuild a whole output from its stream: content and reasoning concatenated, calls joined
    by index."""
    content = "".join(d.content for d in deltas)
    calls: list[ParsedCall] = []
    for d in deltas:
        for t in d.tool_calls:
            if t.index == len(calls):
                calls.append(ParsedCall(name=t.name or "", arguments="", id=t.id or ""))
            calls[t.index].arguments += t.arguments
    return ParsedOutput(content=None if calls and not content.strip() else content, tool_calls=calls,
                        reasoning="".join(d.reasoning for d in deltas) or None)


def partial_tail(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class _CallObject:
    """One JSON call object ``{"name": "fn", "arguments": {...}}`` read from ``parser._buf``.

    Keys: ``name`` (a non-empty string), one of ``arguments``/``parameters`` (an object, streamed raw),
    and the ignored string keys ``id``/``type``; any other key, a repeated key or another value type
    breaks the object. Consumed text is appended to ``parser._held`` until the call is emitted (when
    the name is read and allowed; arguments read before it are buffered and sent right after).
    """

    def __init__(self, parser: ToolParser) -> None:
        self._p = parser
        self._state = "open"
        self._raw = ""  # the string being read (key or value), escapes undecoded
        self._escaped = False
        self._key = ""
        self._seen: set[str] = set()
        self._nesting = _NestingScanner()
        self._early_args = ""  # arguments read before the name
        self.committed = False

    def advance(self) -> _Status:
        p = self._p
        while p._buf:
            state = self._state
            if state in ("key_string", "value_string"):
                self._read_string()
                if self._state == state:
                    continue  # the string goes on past the buffer
                status = self._string_done(state)
                if status is not None:
                    return status
                continue
            if state == "arguments":
                end = self._nesting.scan(p._buf)
                piece = self._take(len(p._buf) if end < 0 else end)
                if self.committed:
                    p._args(piece)
                else:
                    self._early_args += piece
                if end >= 0:
                    self._state = "after_value"
                continue
            self._skip_ws()
            if not p._buf:
                break
            c = p._buf[0]
            if state == "open" and c == "{":
                self._state = "first_key"
            elif state in ("first_key", "key") and c == '"':
                self._state, self._raw, self._escaped = "key_string", "", False
            elif state in ("first_key", "after_value") and c == "}":
                self._take(1)
                if not self.committed:
                    return _Status.INVALID
                p._end_call()
                return _Status.DONE
            elif state == "after_value" and c == ",":
                self._state = "key"
            elif state == "colon" and c == ":":
                self._state = "value"
            elif state == "value" and c == '"' and self._key not in _ARGUMENT_KEYS:
                self._state, self._raw, self._escaped = "value_string", "", False
            elif state == "value" and c == "{" and self._key in _ARGUMENT_KEYS:
                self._state = "arguments"
                continue  # the scanner reads the opening bracket itself
            else:
                return self._broken()
            self._take(1)
        return _Status.MORE

    def end(self) -> _Status:
        """The output ended inside the object: an emitted call stands as streamed."""
        if not self.committed:
            return _Status.INVALID
        self._p._end_call()
        return _Status.DONE

    def _take(self, n: int) -> str:
        return self._p._consume(n, hold=not self.committed)

    def _skip_ws(self) -> None:
        self._p._skip_ws(hold=not self.committed)

    def _broken(self) -> _Status:
        return _Status.MALFORMED if self.committed else _Status.INVALID

    def _read_string(self) -> None:
        buf = self._p._buf
        for i, c in enumerate(buf):
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._raw += buf[:i]
                self._take(i + 1)
                self._state = "string_read"
                return
        self._raw += buf
        self._take(len(buf))

    def _string_done(self, state: str) -> _Status | None:
        try:
            value = json.loads('"' + self._raw + '"')
        except ValueError:
            return self._broken()
        if state == "key_string":
            known = value == _NAME_KEY or value in _ARGUMENT_KEYS or value in _IGNORED_KEYS
            canonical = "arguments" if value in _ARGUMENT_KEYS else value
            if not known or canonical in self._seen:
                return self._broken()
            self._seen.add(canonical)
            self._key, self._state = value, "colon"
            return None
        self._state = "after_value"
        if self._key != _NAME_KEY:
            return None
        if not self._p._allowed(value):
            return _Status.INVALID  # the name comes before any commit
        self.committed = True
        self._p._start_call(value)
        self._p._args(self._early_args)
        return None
