"""What a chat request asks of tools and output shape, checked before anything is rendered.

``ToolPlan`` holds a request's tools and its ``tool_choice`` resolved to one of ``none``,
``auto``, ``required`` or ``named``. ``OutputPlan`` adds ``response_format``. Every
problem is a 400 naming the parameter, as OpenAI answers: an unknown ``tool_choice``
string (rejected by the wire model), a named tool that is not in ``tools``, duplicate tool
names, a ``parameters`` schema that is not a valid JSON Schema object, a ``tool`` message
without ``tool_call_id``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema

from kvcellar.server import errors
from kvcellar.server.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, ResponseFormat


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]]  # OpenAI-shaped tool definitions, in the caller's order
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    @property
    def forced_tools(self) -> list[dict[str, Any]]:
        if self.choice == "named":
            return [t for t in self.tools if t["function"]["name"] == self.named]
        return self.tools


def check_schema(schema: Any, param: str) -> None:
    """A 400 unless ``schema`` is a JSON Schema document (any draft jsonschema knows)."""
    if not isinstance(schema, dict):
        raise errors.invalid(f"Invalid schema for '{param}': a JSON Schema must be an object.", param=param,
                             code="invalid_schema")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise errors.invalid(f"Invalid schema for '{param}'{f' at {where!r}' if where else ''}: {exc.message}",
                             param=param, code="invalid_schema") from None


def plan_tools(req: ChatCompletionRequest) -> ToolPlan | None:
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none":
            raise errors.invalid("'tool_choice' is only allowed when 'tools' are specified.", param="tool_choice")
        return None
    seen: set[str] = set()
    tools = []
    for i, tool in enumerate(req.tools):
        fn = tool.function
        if fn.name in seen:
            raise errors.invalid(f"Duplicate tool name '{fn.name}' in 'tools'.", param=f"tools[{i}].function.name")
        seen.add(fn.name)
        if fn.parameters is not None:
            param = f"tools[{i}].function.parameters"
            check_schema(fn.parameters, param)
            if fn.parameters.get("type", "object") != "object":
                raise errors.invalid(f"Invalid schema for '{param}': function parameters must be of type 'object'.",
                                     param=param, code="invalid_schema")
        tools.append(tool.model_dump(exclude_none=True))
    named = None
    if isinstance(choice, NamedToolChoice):
        named = choice.function.name
        if named not in seen:
            raise errors.invalid(f"Tool choice '{named}' is not in 'tools' (tools: {', '.join(sorted(seen))}).",
                                 param="tool_choice")
        kind = "named"
    else:
        kind = choice or "auto"
    parallel = req.parallel_tool_calls is not False
    return ToolPlan(tools, kind, named, parallel)


def check_tool_messages(messages: Sequence[ChatMessage]) -> None:
    for i, m in enumerate(messages):
        if m.role == "tool" and not m.tool_call_id:
            raise errors.invalid(f"Messages with role 'tool' must carry 'tool_call_id' (messages[{i}]).",
                                 param=f"messages[{i}].tool_call_id", code="missing_required_parameter")


def response_schema(fmt: ResponseFormat | None) -> dict[str, Any] | None:
    """The JSON schema ``response_format`` asks for, None for plain text."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.json_schema is None:
        raise errors.invalid("response_format of type 'json_schema' needs a 'json_schema' object.",
                             param="response_format.json_schema", code="missing_required_parameter")
    schema = fmt.json_schema.json_schema
    if schema is None:
        return {"type": "object"}
    check_schema(schema, "response_format.json_schema.schema")
    return schema
