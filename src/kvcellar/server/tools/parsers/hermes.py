"""Hermes / Qwen tool-call markup (``<tool_call>`` blocks), also kvcellar's fallback format."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, ClassVar

from kvcellar.server.tools.parsers.base import BlockParser, _CallObject, _Status


class HermesParser(BlockParser):
    """Hermes, Qwen2/2.5/3 and kvcellar's fallback format: any number of
    ``<tool_call>{"name": "fn", "arguments": {...}}</tool_call>`` blocks anywhere in the output
    (whitespace inside the tags optional); the text around them is content.

    A block that is not a call stays content up to and including its ``</tool_call>`` (or up to the
    next ``<tool_call>``, which opens a new block). After an emitted call, anything other than
    whitespace before ``</tool_call>`` is dropped the same way; a missing
    ``</tool_call>`` (a stop string ate it, or the output ended) does not undo the call, and a
    ``<tool_call>`` right after a call's object also opens the next block.
    """

    family = "hermes"
    OPEN: ClassVar[str] = "<tool_call>"
    CLOSE: ClassVar[str] = "</tool_call>"

    def __init__(self, tool_names: Collection[str] | None = None,
                 schemas: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        super().__init__(tool_names, schemas)
        self._state = "content"
        self._obj = _CallObject(self)

    def _advance(self, final: bool) -> bool:
        state = self._state
        if state == "content":
            if not self._content_until(self.OPEN, final):
                return False
            self._obj, self._state = _CallObject(self), "object"
        elif state == "object":
            status = self._obj.advance()
            if status is _Status.MORE:
                return False
            if status is _Status.INVALID:
                self._release_held()
            self._state = {_Status.DONE: "close", _Status.INVALID: "invalid", _Status.MALFORMED: "swallow"}[status]
        else:
            return self._after_call_or_block(state, final)
        return True

    def _end(self) -> None:
        if self._state == "object" and self._obj.end() is _Status.INVALID:
            self._release_held()
