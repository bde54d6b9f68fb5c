"""Qwen3-Coder's and Qwen3.5's tool-call markup: XML-like tags, no JSON around the arguments."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any, ClassVar

from kvcellar.server.tools.parsers.base import BlockParser, _Literal

# Longest function or parameter name read before a tag is taken for text.
_MAX_NAME = 256
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "integer": (int,), "number": (int, float), "boolean": (bool,), "object": (dict,), "array": (list,),
    "null": (type(None),),
}


def parameter_value(raw: str, schema: Mapping[str, Any] | None) -> str:
    """One parameter's text as the JSON value it stands for. The templates write strings as
    they are and other values as JSON (Qwen3-Coder's ``| string`` gives Python's ``True``), so
    the parameter's schema decides: a string where it allows one and the text is no JSON
    value of another type it allows; else the JSON value; a text that is neither stays a
    string (a forced call's arguments are checked against the schema later)."""
    types = (schema or {}).get("type")
    allowed = [types] if isinstance(types, str) else list(types) if isinstance(types, list) else []
    if allowed == ["string"]:
        return json.dumps(raw, ensure_ascii=False)
    if "boolean" in allowed and raw in ("True", "False"):
        return "true" if raw == "True" else "false"
    try:
        value = json.loads(raw)
    except ValueError:
        return json.dumps(raw, ensure_ascii=False)
    others = [t for t in allowed if t != "string"]
    fits = any(isinstance(value, _JSON_TYPES.get(t, ()))
               and not (t in ("integer", "number") and isinstance(value, bool)) for t in others)
    if (allowed and not fits) or (not allowed and isinstance(value, str)):
        return json.dumps(raw, ensure_ascii=False)
    return json.dumps(value, ensure_ascii=False)


class XmlFunctionParser(BlockParser):
    """Qwen3-Coder and Qwen3.5: any number of blocks

    ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>``

    anywhere in the output; the text around them is content. A parameter's value is the text
    between its tags less the newline the template puts on each side, read as the JSON value
    the tool's schema says it is (``parameter_value``); ``arguments`` is the JSON object of
    the parameters in the order written. The call is emitted when its ``<function=NAME>`` tag
    is read and the name allowed; each parameter's value when its closing tag is read (a
    value ended by the output is kept as it stands). A block that is no call stays content up
    to its ``</tool_call>``; markup that breaks after the call was emitted is dropped up to it.
    """

    family = "xml_function"
    OPEN: ClassVar[str] = "<tool_call>"
    CLOSE: ClassVar[str] = "</tool_call>"
    FUNCTION: ClassVar[str] = "<function="
    FUNCTION_END: ClassVar[str] = "</function>"
    PARAMETER: ClassVar[str] = "<parameter="
    PARAMETER_END: ClassVar[str] = "</parameter>"

    def __init__(self, tool_names: Collection[str] | None = None,
                 schemas: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        super().__init__(tool_names, schemas)
        self._state = "content"
        self._function = ""
        self._parameter = ""
        self._written = 0  # parameters of the current call

    def _advance(self, final: bool) -> bool:
        state = self._state
        if state == "content":
            if not self._content_until(self.OPEN, final):
                return False
            self._state = "function"
        elif state == "function":
            self._skip_ws(hold=True)
            name = self._tag(self.FUNCTION, final, hold=True)
            if name is None:
                return False
            if not name or not self._allowed(name):
                self._release_held()
                self._state = "invalid"
            else:
                self._function, self._written = name, 0
                self._start_call(name)
                self._state = "parameters"
        elif state == "parameters":
            self._skip_ws(hold=False)
            if not self._buf:
                return False
            end = self._literal(self.FUNCTION_END, final)
            if end is _Literal.MATCH:
                self._consume(len(self.FUNCTION_END), hold=False)
                self._close_call()
                self._state = "close"
                return True
            name = self._tag(self.PARAMETER, final, hold=False, other=end)
            if name is None:
                return False
            if not name:
                self._close_call()
                self._state = "swallow"
            else:
                self._parameter, self._state = name, "value"
        elif state == "value":
            i = self._buf.find(self.PARAMETER_END)
            if i < 0 and not final:
                return False
            raw = self._consume(len(self._buf) if i < 0 else i, hold=False)
            if i >= 0:
                self._consume(len(self.PARAMETER_END), hold=False)
            self._write_parameter(raw)
            if i < 0:  # the output ended inside the value
                self._close_call()
            self._state = "parameters" if i >= 0 else "content"
        else:
            return self._after_call_or_block(state, final)
        return True

    def _tag(self, opening: str, final: bool, *, hold: bool, other: _Literal = _Literal.NO) -> str | None:
        """The name in ``<opening>NAME>`` at the buffer's start, consumed; "" where the buffer
        holds no such tag (nothing consumed); None where more text may still make one (or
        ``other``, another literal the caller waits on, may)."""
        tag = self._literal(opening, final)
        if tag is _Literal.PARTIAL or (tag is _Literal.NO and other is _Literal.PARTIAL):
            return None
        if tag is _Literal.NO:
            return ""
        end = self._buf.find(">", len(opening))
        name = self._buf[len(opening): end if end >= 0 else len(self._buf)]
        if "\n" in name or "<" in name or len(name) > _MAX_NAME:
            return ""
        if end < 0:
            return "" if final else None
        self._consume(end + 1, hold=hold)
        return name.strip()

    def _write_parameter(self, raw: str) -> None:
        raw = raw.removeprefix("\n").removesuffix("\n")
        schema = (self._schemas.get(self._function) or {}).get("properties", {})
        value = parameter_value(raw, schema.get(self._parameter) if isinstance(schema, Mapping) else None)
        self._args(("{" if not self._written else ", ") + json.dumps(self._parameter, ensure_ascii=False) + ": "
                   + value)
        self._written += 1

    def _close_call(self) -> None:
        if self._written:
            self._args("}")
        self._end_call()

    def _end(self) -> None:
        if self._state == "function":
            self._release_held()
        elif self._state in ("parameters", "value"):
            self._close_call()
