"""Gemma 4's tool-call markup: ``<|tool_call>call:NAME{ARGS}<tool_call|>``, where ARGS is the
template's own notation, not JSON: keys bare, strings between ``<|"|>`` delimiters (a
special token, so a string holds any text), numbers, ``true``/``false``/``null`` bare,
objects ``{k:v,...}`` and arrays ``[v,...]`` nested."""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from kvcellar.server.tools.parsers.base import BlockParser, _Literal

QUOTE = '<|"|>'
# Longest function name read before a block is taken for text.
_MAX_NAME = 256
_NAME = re.compile(r"[\w.\-]+")
_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")
_BARE = {"true": True, "false": False, "null": None}


class _Reader:
    """ARGS text to the value it writes; a text cut short (the output ended) gives what it holds."""

    def __init__(self, text: str) -> None:
        self.text, self.at = text, 0

    def _ws(self) -> None:
        while self.at < len(self.text) and self.text[self.at] in " \t\r\n":
            self.at += 1

    def _peek(self) -> str:
        self._ws()
        return self.text[self.at] if self.at < len(self.text) else ""

    def members(self, close: str) -> dict[str, Any]:
        """``k:v`` pairs up to ``close`` (consumed) or the end of the text."""
        out: dict[str, Any] = {}
        while (c := self._peek()) and c != close:
            if c == ",":
                self.at += 1
                continue
            key = self._key()
            if key is None:
                break
            out[key] = self.value(close)
        self.at += 1 if self._peek() == close else 0
        return out

    def _key(self) -> str | None:
        if self.text.startswith(QUOTE, self.at):
            key = self._string()
            if self._peek() != ":":
                return None
        else:
            end = self.text.find(":", self.at)
            if end < 0:
                return None
            key = self.text[self.at:end].strip()
            self.at = end
        self.at += 1  # the colon
        return key

    def _string(self) -> str:
        start = self.at + len(QUOTE)
        end = self.text.find(QUOTE, start)
        end = len(self.text) if end < 0 else end
        self.at = min(len(self.text), end + len(QUOTE))
        return self.text[start:end]

    def value(self, close: str) -> Any:
        c = self._peek()
        if self.text.startswith(QUOTE, self.at):
            return self._string()
        if c == "{":
            self.at += 1
            return self.members("}")
        if c == "[":
            self.at += 1
            items = []
            while (c := self._peek()) and c != "]":
                if c == ",":
                    self.at += 1
                    continue
                before = self.at
                items.append(self.value("]"))
                if self.at == before:  # nothing read: a stray character
                    self.at += 1
            self.at += 1 if self._peek() == "]" else 0
            return items
        end = self.at
        while end < len(self.text) and self.text[end] not in ",]}" + close:
            end += 1
        raw, self.at = self.text[self.at:end].strip(), end
        if raw in _BARE:
            return _BARE[raw]
        if _NUMBER.fullmatch(raw):
            return json.loads(raw)
        return raw


def arguments_json(args: str) -> str:
    """Gemma 4's ARGS (the text between a call's braces) as a JSON object's text."""
    return json.dumps(_Reader(args).members(""), ensure_ascii=False)


class Gemma4Parser(BlockParser):
    """Gemma 4: any number of ``<|tool_call>call:NAME{ARGS}<tool_call|>`` blocks anywhere in
    the output; the text around them is content. The call is emitted when its name (up to
    ``{``) is read and allowed; its arguments, as JSON, when the brace that closes ARGS is
    read (braces inside ``<|"|>`` strings do not count), or what ARGS holds where the output
    ends inside them. A block that is no call stays content up to its ``<tool_call|>``."""

    family = "gemma4"
    OPEN: ClassVar[str] = "<|tool_call>"
    CLOSE: ClassVar[str] = "<tool_call|>"
    CALL: ClassVar[str] = "call:"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._state = "content"

    def _advance(self, final: bool) -> bool:
        state = self._state
        if state == "content":
            if not self._content_until(self.OPEN, final):
                return False
            self._state = "name"
        elif state == "name":
            call = self._literal(self.CALL, final)
            if call is _Literal.PARTIAL:
                return False
            brace = self._buf.find("{", len(self.CALL))
            name = self._buf[len(self.CALL): brace if brace >= 0 else len(self._buf)]
            if call is _Literal.NO or (brace < 0 and (final or len(name) > _MAX_NAME)):
                return self._invalid()
            if brace < 0:
                return False if not name or _NAME.fullmatch(name) else self._invalid()
            if not _NAME.fullmatch(name) or not self._allowed(name):
                return self._invalid()
            self._consume(brace + 1, hold=True)
            self._start_call(name)
            self._state = "args"
        elif state == "args":
            end = _closing_brace(self._buf)
            if end < 0 and not final:
                return False
            args = self._consume(len(self._buf) if end < 0 else end, hold=False)
            self._args(arguments_json(args))
            self._end_call()
            if end < 0:
                self._state = "content"
                return True
            self._consume(1, hold=False)  # the closing brace
            self._state = "close"
        else:
            return self._after_call_or_block(state, final)
        return True

    def _invalid(self) -> bool:
        """The block is no call: its opening tag and what follows are content."""
        self._release_held()
        self._state = "invalid"
        return True

    def _end(self) -> None:
        self._release_held()  # (every state settles itself on the final pass)


def _closing_brace(text: str) -> int:
    """Where the brace that closes ARGS (the text after the call's ``{``) is, or -1."""
    depth, at = 0, 0
    while at < len(text):
        if text.startswith(QUOTE, at):
            end = text.find(QUOTE, at + len(QUOTE))
            if end < 0:
                return -1
            at = end + len(QUOTE)
            continue
        c = text[at]
        if c in "{[":
            depth += 1
        elif c in "}]":
            if depth == 0:
                return at if c == "}" else -1
            depth -= 1
        at += 1
    return -1
