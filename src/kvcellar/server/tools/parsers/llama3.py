"""Llama 3.x JSON tool calling (``<|python_tag|>`` and ``;``-separated call objects)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, ClassVar

from kvcellar.server.tools.parsers.base import ToolParser, _CallObject, _Literal, _Status


class Llama3Parser(ToolParser):
    """Llama 3.1/3.2/3.3 JSON tool calling: the whole output (after optional whitespace and an
    optional ``<|python_tag|>``) is one call object ``{"name": "fn", "parameters": {...}}``
    (``"arguments"`` accepted too), or several separated by ``;``.

    An output that does not start that way, or whose first object is not a call, is content,
    unchanged. After a call, text that is not ``;`` and another object is content; an object after
    ``;`` that is not a call is content from the ``;`` on; a trailing ``;`` is dropped; text after a
    call broken mid-object is dropped.
    """

    family = "llama3"
    PYTHON_TAG: ClassVar[str] = "<|python_tag|>"

    def __init__(self, tool_names: Collection[str] | None = None,
                 schemas: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        super().__init__(tool_names, schemas)
        self._state = "start"
        self._obj = _CallObject(self)

    def _advance(self, final: bool) -> bool:
        state = self._state
        if state == "plain":
            self._content(self._consume(len(self._buf), hold=False))
            return False
        if state == "swallow":
            self._buf = ""
            return False
        if state == "object":
            status = self._obj.advance()
            if status is _Status.MORE:
                return False
            if status is _Status.INVALID:
                self._release_held()
            self._state = {_Status.DONE: "between", _Status.INVALID: "plain", _Status.MALFORMED: "swallow"}[status]
            return True
        self._skip_ws(hold=True)
        if not self._buf:
            return False
        if state == "start":
            tag = self._literal(self.PYTHON_TAG, final)
            if tag is _Literal.PARTIAL:
                return False
            if tag is _Literal.MATCH:
                self._consume(len(self.PYTHON_TAG), hold=True)
                self._state = "tagged"
                return True
        if state in ("start", "tagged", "separated") and self._buf[0] == "{":
            self._obj, self._state = _CallObject(self), "object"
        elif state == "between" and self._buf[0] == ";":
            self._consume(1, hold=True)
            self._state = "separated"
        else:
            self._release_held()
            self._state = "plain"
        return True

    def _end(self) -> None:
        if self._state == "object":
            if self._obj.end() is _Status.INVALID:
                self._release_held()
        elif self._state == "separated":
            self._held = ""
        else:
            self._release_held()
