"""Mistral tool calls (``[TOOL_CALLS]`` with a JSON array, or ``name[ARGS]{...}``)."""

from __future__ import annotations

import string
from collections.abc import Collection, Mapping
from typing import Any, ClassVar

from kvcellar.server.tools.parsers.base import (
    _ID_ALPHABET,
    ToolParser,
    _CallObject,
    _Literal,
    _NestingScanner,
    _Status,
)


class MistralParser(ToolParser):
    """Mistral: ``[TOOL_CALLS]`` then a JSON array of call objects (v3 tokenizers), or
    ``[TOOL_CALLS]fn[ARGS]{...}``, repeated for parallel calls (v11+; an optional ``[CALL_ID]id``
    between the name and ``[ARGS]`` is skipped). Text outside the markup is content.

    A ``[TOOL_CALLS]`` not followed by a call is content as written, and the text after it is read
    again. In an array whose first call was emitted, anything broken drops the rest of the output.
    """

    family = "mistral"
    MARK: ClassVar[str] = "[TOOL_CALLS]"
    ARGS: ClassVar[str] = "[ARGS]"
    CALL_ID: ClassVar[str] = "[CALL_ID]"
    _NAME_CHARS: ClassVar[frozenset[str]] = frozenset(string.ascii_letters + string.digits + "_-.")

    def __init__(self, tool_names: Collection[str] | None = None,
                 schemas: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        super().__init__(tool_names, schemas)
        self._state = "content"
        self._obj = _CallObject(self)
        self._nesting = _NestingScanner()
        self._name = ""
        self._array_called = False  # the current array has an emitted call: a broken element drops the rest

    def _advance(self, final: bool) -> bool:
        state = self._state
        if state == "content":
            if not self._content_until(self.MARK, final):
                return False
            self._state = "marked"
            return True
        if state == "swallow":
            self._buf = ""
            return False
        if state == "object":
            return self._advance_object()
        if state == "name":
            return self._advance_name(final)
        if state == "call_id":
            n = len(self._buf) - len(self._buf.lstrip(_ID_ALPHABET))
            self._consume(n, hold=False)
            if not self._buf:
                return False
            found = self._literal(self.ARGS, final)
            if found is _Literal.PARTIAL:
                return False
            if found is _Literal.MATCH:
                self._consume(len(self.ARGS), hold=False)
                self._state = "args_open"
            else:
                self._end_call()
                self._state = "content"
            return True
        if state == "args":
            end = self._nesting.scan(self._buf)
            self._args(self._consume(len(self._buf) if end < 0 else end, hold=False))
            if end < 0:
                return False
            self._end_call()
            self._state = "content"
            return True
        hold = state in ("marked", "array_open")
        self._skip_ws(hold=hold)
        if not self._buf:
            return False
        c = self._buf[0]
        if state == "marked" and c == "[":
            self._consume(1, hold=True)
            self._array_called, self._state = False, "array_open"
        elif state == "marked" and c in self._NAME_CHARS:
            self._name, self._state = "", "name"
        elif state in ("array_open", "element") and c == "{":
            self._obj, self._state = _CallObject(self), "object"
        elif state == "array_next" and c in ",]":
            self._consume(1, hold=False)
            self._state = "element" if c == "," else "content"
        elif state == "args_open" and c == "{":
            self._nesting, self._state = _NestingScanner(), "args"
        elif state == "args_open":
            self._end_call()
            self._state = "content"
        elif hold:
            self._release_held()
            self._state = "content"
        else:
            self._state = "swallow"
        return True

    def _advance_object(self) -> bool:
        status = self._obj.advance()
        if status is _Status.MORE:
            return False
        if status is _Status.DONE:
            self._array_called, self._state = True, "array_next"
        elif status is _Status.INVALID and not self._array_called:
            self._release_held()
            self._state = "content"
        else:
            self._held = ""
            self._state = "swallow"
        return True

    def _advance_name(self, final: bool) -> bool:
        n = 0
        while n < len(self._buf) and self._buf[n] in self._NAME_CHARS:
            n += 1
        self._name += self._consume(n, hold=True)
        if not self._buf:
            return False
        for marker, next_state in ((self.ARGS, "args_open"), (self.CALL_ID, "call_id")):
            found = self._literal(marker, final)
            if found is _Literal.PARTIAL:
                return False
            if found is _Literal.MATCH:
                self._consume(len(marker), hold=True)
                if self._allowed(self._name):
                    self._start_call(self._name)
                    self._state = next_state
                else:
                    self._release_held()
                    self._state = "content"
                return True
        self._release_held()
        self._state = "content"
        return True

    def _end(self) -> None:
        if self._state == "object":
            if self._obj.end() is _Status.INVALID:
                self._release_held()
        elif self._state in ("call_id", "args_open", "args"):
            self._end_call()
        else:
            self._release_held()
