"""Per-family parsers that turn a model's raw output text into content and OpenAI ``tool_calls``:
one module per family (``hermes``, ``llama3``, ``mistral``, ``xml_function``, ``gemma4``) on the shared
machinery in ``base``, whose docstring states the invariants every family keeps. ``parser_for_template``
picks the family.
"""

from __future__ import annotations

from kvcellar.server.tools.parsers.base import (
    CallFragment,
    CallReporter,
    OutputReader,
    ParsedCall,
    ParsedOutput,
    StreamDelta,
    Thought,
    ToolParser,
    collect,
    new_call_id,
    partial_tail,
    random_id,
)
from kvcellar.server.tools.parsers.gemma4 import Gemma4Parser
from kvcellar.server.tools.parsers.hermes import HermesParser
from kvcellar.server.tools.parsers.llama3 import Llama3Parser
from kvcellar.server.tools.parsers.mistral import MistralParser
from kvcellar.server.tools.parsers.xml_function import XmlFunctionParser

__all__ = [
    "PARSERS",
    "CallFragment",
    "CallReporter",
    "Gemma4Parser",
    "HermesParser",
    "Llama3Parser",
    "MistralParser",
    "OutputReader",
    "ParsedCall",
    "ParsedOutput",
    "StreamDelta",
    "Thought",
    "ToolParser",
    "XmlFunctionParser",
    "collect",
    "new_call_id",
    "parser_for_template",
    "partial_tail",
    "random_id",
]

PARSERS: dict[str, type[ToolParser]] = {p.family: p for p in (HermesParser, Llama3Parser, MistralParser,
                                                               XmlFunctionParser, Gemma4Parser)}


def parser_for_template(chat_template: str | None) -> type[ToolParser]:
    """The parser family a chat template's model writes, decided from the template text, first rule
    that holds: ``<|tool_call>call:`` (Gemma 4) -> gemma4; ``<function=`` (Qwen3-Coder, Qwen3.5) ->
    xml_function; ``<tool_call>`` -> hermes;
    ``[TOOL_CALLS]`` -> mistral; ``<|python_tag|>``, or ``<|start_header_id|>`` together with
    ``parameters`` -> llama3; anything else (no template, or one without tool markup) -> hermes,
    because kvcellar's own fallback tool prompt asks for hermes markup.
    """
    template = chat_template or ""
    if "<|tool_call>call:" in template:
        return Gemma4Parser
    if "<function=" in template:
        return XmlFunctionParser
    if "<tool_call>" in template:
        return HermesParser
    if "[TOOL_CALLS]" in template:
        return MistralParser
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and "parameters" in template):
        return Llama3Parser
    return HermesParser
