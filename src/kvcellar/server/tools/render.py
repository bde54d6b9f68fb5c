"""Tools in the prompt: the model's own chat template when it renders them, else our fallback.

Whether a template renders tools is found by trying (``ToolPrompting.probe``): a conversation
rendered with one probe tool and without it must differ, and the probe tool's name must
appear. Templates that ignore ``tools`` (SmolLM2's, many base-model templates) get the
**fallback format**, which is the Hermes markup most open models have seen in training:

* the tool definitions go into the system turn (appended to the caller's system message,
  or as a system message of their own), as a ``<tools>`` block of JSON signatures with an
  instruction to answer calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
* an assistant turn with ``tool_calls`` becomes text: its content, then one
  ``<tool_call>`` block per call;
* ``role: "tool"`` results become a user turn holding one
  ``<tool_response>{"tool_call_id": ..., "name": ..., "content": ...}</tool_response>`` per
  result (consecutive results share one turn, so user/assistant alternation holds).

With a template that renders tools, messages go to it in the shape transformers documents:
``tool_calls[].function.arguments`` as a dict (the wire carries a JSON string).

The rendered tool block depends only on the request's ``tools`` (in the caller's order), so
the same tools and system prompt give the same prompt prefix, which the prefix cache then
serves to the next request.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvcellar.engine.tokenization import render_chat
from kvcellar.server.harmony import CHANNEL, CONSTRAIN, MESSAGE, template_is_harmony
from kvcellar.server.harmony import reader_factory as harmony_reader_factory
from kvcellar.server.tools import gemma4_syntax
from kvcellar.server.tools.parsers import OutputReader, ParsedCall, ToolParser, parser_for_template

if TYPE_CHECKING:
    from kvcellar.server.tools.request import ToolPlan

FALLBACK_INSTRUCTIONS = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    "</tool_call>"
)

_PROBE_NAME = "kvcellar_probe_tool_5e1c"
_PROBE_TOOL = {"type": "function", "function": {
    "name": _PROBE_NAME, "description": "probe", "parameters": {"type": "object", "properties": {}}}}


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


@dataclass(frozen=True)
class ToolPrompting:
    """How one model's chat template takes tools, and which parser reads its calls."""

    template_renders_tools: bool
    parser: type[ToolParser]
    mistral_token_id: int | None = None  # the [TOOL_CALLS] special token, for forced calls
    # gpt-oss's harmony format (server/harmony.py): the ids of <|channel|>, <|constrain|> and
    # <|message|>, for forced calls; None for every other template.
    harmony_ids: tuple[int, int, int] | None = None
    # The family's call markup that the vocabulary holds as single tokens (Gemma 4's), by text.
    markup_tokens: dict[str, int] = field(default_factory=dict)

    @classmethod
    def probe(cls, tokenizer: Any) -> ToolPrompting:
        template = getattr(tokenizer, "chat_template", None)
        renders = False
        if template:
            messages = [{"role": "user", "content": "hi"}]
            try:
                plain = render_chat(tokenizer, messages)
                with_tool = render_chat(tokenizer, messages, tools=[_PROBE_TOOL])
                renders = with_tool != plain and _PROBE_NAME in with_tool
            except Exception:  # a template that chokes on tools does not render them
                renders = False
        parser = parser_for_template(template if renders else None)
        mistral_id = None
        if parser.family == "mistral":
            found = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
            mistral_id = found if isinstance(found, int) and found != tokenizer.unk_token_id else None
        harmony_ids = None
        if template_is_harmony(template):
            ids = [tokenizer.convert_tokens_to_ids(t) for t in (CHANNEL, CONSTRAIN, MESSAGE)]
            if all(isinstance(i, int) and i != tokenizer.unk_token_id for i in ids):
                harmony_ids = (ids[0], ids[1], ids[2])
        markup: dict[str, int] = {}
        if parser.family == "gemma4":
            for text in (gemma4_syntax.OPEN, gemma4_syntax.CLOSE, gemma4_syntax.QUOTE):
                found = tokenizer.convert_tokens_to_ids(text)
                if isinstance(found, int) and found != tokenizer.unk_token_id:
                    markup[text] = found
        return cls(renders, parser, mistral_id, harmony_ids, markup)

    @property
    def harmony(self) -> bool:
        return self.harmony_ids is not None

    @property
    def family(self) -> str:
        return "harmony" if self.harmony else self.parser.family

    @property
    def markup_is_special(self) -> bool:
        """The family's call markers are special tokens, which plain detokenizing drops."""
        return self.family in ("llama3", "mistral", "harmony", "gemma4")

    def parser_factory(self, plan: ToolPlan | None, on_finish: Callable[[list[ParsedCall]], None] | None = None
                       ) -> Callable[[], OutputReader]:
        """Readers of ``plan``'s calls; ``on_finish`` gets each output's calls as it ends. For
        harmony (which also reads the reasoning) ``plan`` may be None: no calls to read."""
        names = [] if plan is None else [t["function"]["name"] for t in plan.forced_tools] if plan.forced else \
            [t["function"]["name"] for t in plan.tools]
        if self.harmony:
            return harmony_reader_factory(names, on_finish)
        assert plan is not None
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in plan.tools}

        def make() -> ToolParser:
            parser = self.parser(names, schemas)
            parser.on_finish = on_finish
            return parser
        return make

    def prepare(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
                ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Messages and extra template arguments for rendering a request with ``tools``."""
        if self.template_renders_tools:
            kwargs = {"tools": list(tools)} if tools else {}
            return [_for_template(m) for m in messages], kwargs
        return fallback_messages(messages, tools), {}


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    if message.get("reasoning_content") and "thinking" not in message:
        # gpt-oss's template reads an assistant turn's reasoning as ``thinking``
        message = {**message, "thinking": message["reasoning_content"]}
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = dict(message)
    converted = []
    for call in calls:
        fn = dict(call.get("function") or {})
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args) if args.strip() else {}
            except ValueError:
                pass  # leave text the model (or caller) wrote as it is
        converted.append({**call, "function": fn})
    out["tool_calls"] = converted
    return out


def tool_signatures(tools: Sequence[dict[str, Any]]) -> str:
    return "\n".join(_dumps(t) for t in tools)


def format_tool_call(name: str, arguments: str) -> str:
    """One call in the fallback markup (``arguments`` is JSON text, kept verbatim)."""
    args = arguments.strip() or "{}"
    return f'<tool_call>\n{{"name": {_dumps(name)}, "arguments": {args}}}\n</tool_call>'


def fallback_messages(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
                      ) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool_call_id -> function name, for the results
    for m in messages:
        role = m["role"]
        if role == "assistant" and m.get("tool_calls"):
            parts = [m["content"]] if m.get("content") else []
            for call in m["tool_calls"]:
                fn = call.get("function") or {}
                names[str(call.get("id", ""))] = str(fn.get("name", ""))
                parts.append(format_tool_call(str(fn.get("name", "")), str(fn.get("arguments") or "{}")))
            out.append({"role": "assistant", "content": "\n".join(parts)})
        elif role == "tool":
            call_id = str(m.get("tool_call_id", ""))
            body = {"tool_call_id": call_id, "name": m.get("name") or names.get(call_id, ""),
                    "content": m.get("content", "")}
            block = f"<tool_response>\n{_dumps(body)}\n</tool_response>"
            prev = out[-1] if out else None
            if prev is not None and prev.get("_tool_results"):
                prev["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        block = FALLBACK_INSTRUCTIONS.format(tools=tool_signatures(tools))
        if out and out[0]["role"] == "system":
            first = out[0]
            out[0] = {**first, "content": f"{first['content']}\n\n{block}" if first["content"] else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
