"""A coding agent's first two turns with a served model, as the agent tests of each model
family run them: two tools (a read and an edit), a long system prompt, a question; a call
forced on every API and checked against its tool's schema; turn 2 with the call and its
result fed back."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jsonschema

from tests.helpers import ServerProcess

READ = {"type": "object", "properties": {"path": {"type": "string"}, "max_lines": {"type": "integer", "minimum": 1}},
        "required": ["path"]}
EDIT = {"type": "object", "properties": {"path": {"type": "string"}, "line": {"type": "integer"},
                                         "text": {"type": "string"}}, "required": ["path", "line", "text"]}
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
                                           "parameters": READ}},
         {"type": "function", "function": {"name": "edit_file", "description": "Replace one line of a file.",
                                           "parameters": EDIT}}]
SCHEMAS = {"read_file": READ, "edit_file": EDIT}
RULES = ("You are a coding agent working in a Rust repository. Read before you edit; keep changes small; "
         "run the tests after each edit. ")
ASK = "The parser panics on empty input. Find the bug in src/parse.rs."
RESULT = "fn parse(s: &str) -> Expr {\n    let first = s.chars().next().unwrap();\n    ...\n}"


def valid(name: str, arguments: Any) -> dict[str, Any]:
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(value, SCHEMAS[name])
    assert isinstance(value, dict)
    return value


@dataclass
class Agent:
    """The conversation against ``server`` serving ``model``, with ``system`` as its system prompt."""

    server: ServerProcess
    model: str
    system: str

    def first_turn(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": ASK}]

    def second_turn(self, call_id: str, name: str, arguments: str) -> list[dict[str, Any]]:
        return [*self.first_turn(),
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": call_id, "type": "function",
                                 "function": {"name": name, "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": call_id, "name": name, "content": RESULT}]

    def chat(self, messages: list[dict[str, Any]], server: ServerProcess | None = None, **kwargs: Any) -> Any:
        return (server or self.server).client().chat.completions.create(
            model=self.model, messages=messages, tools=TOOLS, temperature=0, **kwargs)

    def forced_calls_on_every_api(self, max_tokens: int) -> None:
        """``tool_choice`` required on chat completions, a named function on Responses, ``any``
        on Anthropic Messages: each reply one call, valid against its tool's schema."""
        r = self.chat(self.first_turn(), tool_choice="required", max_tokens=max_tokens)
        assert r.choices[0].finish_reason == "tool_calls", r
        ((call),) = r.choices[0].message.tool_calls
        valid(call.function.name, call.function.arguments)
        assert r.choices[0].message.content is None

        named = self.server.client().responses.create(
            model=self.model, input=ASK, instructions=self.system, temperature=0, max_output_tokens=max_tokens,
            tools=[{"type": "function", **t["function"]} for t in TOOLS],
            tool_choice={"type": "function", "name": "edit_file"})
        calls = [o for o in named.output if o.type == "function_call"]
        assert [c.name for c in calls] == ["edit_file"] and named.status == "completed"
        valid("edit_file", calls[0].arguments)

        import anthropic

        client = anthropic.Anthropic(base_url=self.server.url, api_key="unused", max_retries=0)
        message = client.messages.create(
            model=self.model, system=self.system, messages=[{"role": "user", "content": ASK}], max_tokens=max_tokens,
            extra_body={"temperature": 0}, tool_choice={"type": "any"},
            tools=[{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS])
        uses = [b for b in message.content if b.type == "tool_use"]
        assert message.stop_reason == "tool_use" and len(uses) == 1
        valid(uses[0].name, uses[0].input)
