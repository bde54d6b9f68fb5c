"""What a chat request asks of tools and output shape, checked before anything is rendered.

``ToolPlan`` holds a request's tools and its ``tool_choice`` resolved to one of ``none``,
``auto``, ``required`` or ``named``. ``OutputPlan`` adds ``response_format``. Every
problem is a 400 naming the parameter, as OpenAI answers: an unknown ``tool_choice``
string (rejected by the wire model), a named tool that is not in ``tools``, duplicate tool
names, a ``parameters`` schema that is not a valid JSON Schema object, a ``tool`` message
without ``tool_call_id``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema

from kvcellar.server import errors
from kvcellar.server.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, ResponseFormat

# A schema's patterns must compile; the uri-reference format of its ``$ref`` and ``$id`` values is
# not held against it (with jsonschema's format extras installed, check_schema would).
_SCHEMA_FORMATS = jsonschema.FormatChecker(["regex"])


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
    cls = jsonschema.validators.validator_for(schema)
    error = jsonschema.exceptions.best_match(cls(cls.META_SCHEMA, format_checker=_SCHEMA_FORMATS).iter_errors(schema))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path)
        raise errors.invalid(f"Invalid schema for '{param}'{f' at {where!r}' if where else ''}: {error.message}",
                             param=param, code="invalid_schema")


def plan_tools(req: ChatCompletionRequest) -> ToolPlan | None:
    choice = req.tool_choice
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    return make_tool_plan([t.model_dump(exclude_none=True) for t in req.tools or []],
                          "named" if isinstance(choice, NamedToolChoice) else choice, named,
                          req.parallel_tool_calls is not False,
                          schema_param=lambda i: f"tools[{i}].function.parameters")


def make_tool_plan(tools: Sequence[dict[str, Any]], choice: str | None, named: str | None, parallel: bool, *,
                   schema_param: Callable[[int], str], choice_param: str = "tool_choice",
                   names_param: Callable[[int], str] | None = None) -> ToolPlan | None:
    """A plan from OpenAI-shaped function tools (any API's, converted), checked: unique
    names, valid object schemas, a named choice among them. Errors name the caller's params."""
    if not tools:
        if choice is not None and choice != "none":
            raise errors.invalid(f"'{choice_param}' is only allowed when 'tools' are specified.", param=choice_param)
        return None
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if fn["name"] in seen:
            raise errors.invalid(f"Duplicate tool name '{fn['name']}' in 'tools'.",
                                 param=names_param(i) if names_param else f"tools[{i}].function.name")
        seen.add(fn["name"])
        parameters = fn.get("parameters")
        if parameters is not None:
            param = schema_param(i)
            check_schema(parameters, param)
            if parameters.get("type", "object") != "object":
                raise errors.invalid(f"Invalid schema for '{param}': function parameters must be of type 'object'.",
                                     param=param, code="invalid_schema")
    if named is not None and named not in seen:
        raise errors.invalid(f"Tool choice '{named}' is not in 'tools' (tools: {', '.join(sorted(seen))}).",
                             param=choice_param)
    return ToolPlan(list(tools), choice or "auto", named, parallel)


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
