"""A thinking model's reasoning (server/reasoning.py): read out of the output whatever the cut
into pieces, never in the content, and returned as each API returns reasoning —
``reasoning_content`` on chat completions, ``thinking`` blocks on Anthropic Messages,
``reasoning`` items on Responses — streamed as whole; sent back by a client, it is rendered
into the next turn's prompt by the model's template."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from kvcellar.engine import TokenEvent
from kvcellar.server.anthropic.render import MessagesRenderer
from kvcellar.server.formatting import RequestShape, ResponseBuilder
from kvcellar.server.internal import OutputTracker
from kvcellar.server.reasoning import (
    GEMMA4,
    THINK,
    ReasoningReader,
    ThinkSplitter,
    reader_factory,
    starts_inside,
    template_markup,
)
from kvcellar.server.responses.render import ResponsesRenderer, ToolNames
from kvcellar.server.tools.parsers import HermesParser, collect
from tests.artifacts.gguf_files import THINKING_TEMPLATE, write_gguf
from tests.helpers import ServerProcess
from tests.server.test_anthropic_render import events, parse_sse, streamed, without_ids

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
RECORDED = "<think>\nThe user wants the weather.\n</think>\n\nSure." + CALL
THOUGHT = "The user wants the weather."
RESPONSE_EVENTS = TypeAdapter(ResponseStreamEvent)

# (output, whether the prompt opened the block) -> (reasoning, content)
SPLITS = [
    ("<think>\nplan\n</think>\n\nanswer", False, "plan", "answer"),
    ("  \n<think>a < b </think>b", False, "a < b", "b"),
    ("no reasoning <think>x</think>", False, "", "no reasoning <think>x</think>"),
    ("plan\n</think>\n\nanswer", True, "plan", "answer"),
    ("cut short by max_tokens", True, "cut short by max_tokens", ""),
    ("<think>\ncut short </thi", False, "cut short </thi", ""),
    ("<thi", False, "", "<thi"),
    ("\n\n", False, "", "\n\n"),
    ("</think> after", True, "", "after"),
]


def split(text: str, inside: bool, pieces: Sequence[str]) -> tuple[str, str]:
    splitter, reasoning, content = ThinkSplitter(inside), [], []
    for piece in pieces:
        r, c = splitter.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = splitter.finish()
    return "".join(reasoning) + r, "".join(content) + c


def cuttings(text: str) -> list[list[str]]:
    """Whole, cut in two and in three at every pair of boundaries, and a character at a time."""
    out = [[text], list(text)]
    for a, b in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        out.append([text[:a], text[a:b], text[b:]])
    return out


# The renderers' cases: a sample of the cuttings, and a character at a time.
SOME_CUTS = [*cuttings(RECORDED)[:40:3], list(RECORDED)]


@pytest.mark.parametrize(("text", "inside", "reasoning", "content"), SPLITS)
def test_the_split_is_the_same_for_every_cut(text: str, inside: bool, reasoning: str, content: str) -> None:
    for pieces in cuttings(text):
        assert split(text, inside, pieces) == (reasoning, content), pieces


def test_gemma4_thought_channel_then_its_calls_streamed_equal_whole() -> None:
    """Gemma 4: reasoning in ``<|channel>thought`` ... ``<channel|>``, then content and calls
    in its own markup; a ``<think>`` tag is nothing to it."""
    from kvcellar.server.tools.parsers import Gemma4Parser

    call = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
    recorded = f"<|channel>thought\n{THOUGHT} <think>\n<channel|>Sure.{call}"
    make = reader_factory(False, lambda: Gemma4Parser(["get_weather"]), GEMMA4)
    parsed = make().parse(recorded)
    assert parsed.reasoning == THOUGHT + " <think>" and parsed.content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", {"city": "Paris"})]
    for pieces in cuttings(recorded)[::5]:
        reader: ReasoningReader = make()
        rebuilt = collect([reader.feed(p) for p in pieces] + [reader.finish()])
        assert (rebuilt.reasoning, rebuilt.content) == (parsed.reasoning, "Sure.")
        assert [(c.name, c.arguments) for c in rebuilt.tool_calls] == \
            [(c.name, c.arguments) for c in parsed.tool_calls]
    # an empty thought channel in the prompt (thinking off) leaves the output all content
    assert not starts_inside("<|turn>model\n<|channel>thought\n<channel|>", GEMMA4)
    assert starts_inside("<|turn>model\n<|channel>thought\n", GEMMA4)


def test_reasoning_then_tool_calls_streamed_equal_whole() -> None:
    make = reader_factory(False, lambda: HermesParser(["get_weather"]))
    parsed = make().parse(RECORDED)
    assert parsed.reasoning == THOUGHT and parsed.content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", {"city": "Paris"})]
    for pieces in cuttings(RECORDED)[::7]:
        reader: ReasoningReader = make()
        deltas = [reader.feed(p) for p in pieces] + [reader.finish()]
        rebuilt = collect(deltas)
        assert "".join(d.reasoning for d in deltas) == THOUGHT and rebuilt.content == "Sure."
        assert [(c.name, c.arguments) for c in rebuilt.tool_calls] == \
            [(c.name, c.arguments) for c in parsed.tool_calls]
        assert reader.called


def test_templates_that_reason_and_prompts_that_open_the_block() -> None:
    assert template_markup("{{ '<think>\\n' + r + '\\n</think>\\n\\n' }}") is THINK
    assert template_markup("{{- '<|channel>thought\\n' + thinking_text + '\\n<channel|>' -}}") is GEMMA4
    assert template_markup("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert template_markup(None) is None
    assert starts_inside("<|im_start|>assistant\n<think>\n") and not starts_inside("<|im_start|>assistant\n")
    assert not starts_inside("<think>\n\n</think>\n\n")  # a template that closed it: no reasoning to read


# ---- the three APIs' renderers, fed the engine's events ------------------------------------------------


def reader() -> ReasoningReader:
    return reader_factory(False, lambda: HermesParser(["get_weather"]))()


def chat(evs: Sequence[TokenEvent], stream: bool) -> dict[str, Any]:
    shape = RequestShape("chat", "m", "fp", 1, 1, False, 0, False, tool_parser=reader)
    builder = ResponseBuilder(shape, None)  # type: ignore[arg-type]  # no logprobs: no token texts needed
    if not stream:
        for ev in evs:
            builder.add(0, ev)
        body = builder.response()
        ChatCompletion.model_validate(body)
        message = body["choices"][0]["message"]
        return {"reasoning": message.get("reasoning_content"), "content": message["content"],
                "calls": [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]}
    reasoning, content, calls = "", "", {}
    for ev in evs:
        for chunk in builder.chunks_for(0, ev):
            ChatCompletionChunk.model_validate(chunk)
            delta = chunk["choices"][0]["delta"]
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                name, args = calls.get(call["index"], ("", ""))
                calls[call["index"]] = (name + call["function"].get("name", ""),
                                        args + call["function"].get("arguments", ""))
    return {"reasoning": reasoning or None, "content": content, "calls": list(calls.values())}


@pytest.mark.parametrize("pieces", SOME_CUTS, ids=lambda p: str(len(p)))
def test_chat_completions_return_reasoning_content(pieces: list[str]) -> None:
    evs = events(pieces)
    want = {"reasoning": THOUGHT, "content": "Sure.", "calls": [("get_weather", '{"city": "Paris"}')]}
    assert chat(evs, stream=False) == want
    assert chat(evs, stream=True) == want


@pytest.mark.parametrize("pieces", SOME_CUTS, ids=lambda p: str(len(p)))
def test_anthropic_returns_a_thinking_block_first(pieces: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import tests.server.test_anthropic_render as anthropic_render

    monkeypatch.setattr(anthropic_render, "renderer",
                        lambda tools=True, stops=(): MessagesRenderer("m", OutputTracker(reader()), stops))
    evs = events(pieces)
    r = anthropic_render.renderer()
    for ev in evs:
        r.add(0, ev)
    whole = without_ids(r.response())
    message, names = streamed(evs)
    assert without_ids(message) == whole
    assert whole["content"][0] == {"type": "thinking", "thinking": THOUGHT, "signature": ""}
    assert whole["content"][1:] == [{"type": "text", "text": "Sure."},
                                    {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris"}}]
    assert whole["stop_reason"] == "tool_use"
    assert names.count("content_block_start") == 3


def responses_renderer() -> ResponsesRenderer:
    echo = {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True}  # what the adapter echoes
    return ResponsesRenderer("m", OutputTracker(reader()), ToolNames(), echo, lambda _: None)


@pytest.mark.parametrize("pieces", SOME_CUTS, ids=lambda p: str(len(p)))
def test_responses_return_a_reasoning_item_first(pieces: list[str]) -> None:
    evs = events(pieces)
    r = responses_renderer()
    for ev in evs:
        r.add(0, ev)
    body = r.response()
    Response.model_validate(body)
    kinds = [i["type"] for i in body["output"]]
    assert kinds == ["reasoning", "message", "function_call"]
    assert body["output"][0]["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert body["output_text"] == "Sure."
    assert r.reply_messages()[0]["reasoning_content"] == THOUGHT

    s = responses_renderer()
    chunks = s.open_stream()
    for ev in evs:
        chunks += s.stream(0, ev)
    chunks += s.close_stream()
    pairs = parse_sse(chunks)
    for _, data in pairs:
        RESPONSE_EVENTS.validate_python(data)
    deltas = "".join(d["delta"] for name, d in pairs if name == "response.reasoning_text.delta")
    done = [d for name, d in pairs if name == "response.reasoning_text.done"]
    assert deltas == THOUGHT and [d["text"] for d in done] == [THOUGHT]
    final = pairs[-1][1]["response"]
    assert [i["type"] for i in final["output"]] == kinds and final["output"][0]["content"] == \
        body["output"][0]["content"]


# ---- a real server on a thinking model -------------------------------------------------------------------

THINKER = "tiny-thinker"
ASK = "What is the weather in Paris?"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
LONG = {"max_tokens": 24, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[ServerProcess]:
    """``kvcellar serve`` on a small random llama GGUF whose template opens the reasoning
    block in the generation prompt (``THINKING_TEMPLATE``): all it writes is reasoning until
    it closes the block, which a random model never does."""
    root = tmp_path_factory.mktemp("thinker")
    gguf = write_gguf(root / f"{THINKER}.gguf", seed=11, chat_template=THINKING_TEMPLATE, head_scale=0.5,
                      context=4096)
    server = ServerProcess(root / "cache", "--model", str(gguf), models_dir=models_dir).start()
    try:
        yield server
    finally:
        assert server.stop() == 0


def test_a_served_thinking_model_returns_its_reasoning_on_every_api(thinker: ServerProcess) -> None:
    assert thinker.health()["chat_format"] == {"tool_calls": "hermes", "reasoning": "think"}
    client = thinker.client()
    messages = [{"role": "user", "content": ASK}]
    whole = client.chat.completions.create(model=THINKER, messages=messages, **LONG)
    message = whole.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and reasoning == reasoning.strip() and message.content == ""
    parts: list[tuple[str, str]] = []
    for chunk in client.chat.completions.create(model=THINKER, messages=messages, stream=True, **LONG):
        for choice in chunk.choices:
            parts.append(((choice.delta.model_extra or {}).get("reasoning_content") or "", choice.delta.content or ""))
    assert "".join(r for r, _ in parts) == reasoning and not "".join(c for _, c in parts)

    import anthropic

    claude = anthropic.Anthropic(base_url=thinker.url, api_key="unused", max_retries=0)
    ask = {"model": THINKER, "max_tokens": 24, "messages": messages,
           "extra_body": {"temperature": 0, "ignore_eos": True}}
    reply = claude.messages.create(**ask)
    assert [(b.type, b.thinking) for b in reply.content] == [("thinking", reasoning)]
    with claude.messages.stream(**ask) as stream:
        assert stream.get_final_message().content == reply.content

    ask = {"model": THINKER, "input": ASK, "max_output_tokens": 24, "temperature": 0,
           "extra_body": {"ignore_eos": True}}
    response = client.responses.create(**ask)
    (item,) = response.output
    assert item.type == "reasoning" and [c.text for c in item.content] == [reasoning] and response.output_text == ""
    events = list(client.responses.create(stream=True, **ask))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert events[-1].response.output[0].content == item.content


def test_reasoning_sent_back_is_rendered_into_the_next_prompt(thinker: ServerProcess) -> None:
    """The next turn's prompt holds the reasoning the client sent back, where the template puts
    it: where the model wrote it, so that the turn's prompt repeats the tokens written."""
    client = thinker.client()
    first = [{"role": "user", "content": ASK + " Think it through."}]
    r1 = client.chat.completions.create(model=THINKER, messages=first, **{**LONG, "max_tokens": 48})
    reasoning = r1.choices[0].message.model_extra["reasoning_content"]
    follow = {"role": "user", "content": "And in Rome?"}
    back = [*first, {"role": "assistant", "content": "", "reasoning_content": reasoning}, follow]
    dropped = [*first, {"role": "assistant", "content": ""}, follow]
    with_it = client.chat.completions.create(model=THINKER, messages=back, max_tokens=1)
    without = client.chat.completions.create(model=THINKER, messages=dropped, max_tokens=1)
    # (a byte-level vocabulary: about a token a byte; its random text need not re-tokenize to
    # the tokens written, so how far the hit reaches past the first turn's prompt is not asserted)
    assert with_it.usage.prompt_tokens - without.usage.prompt_tokens >= len(reasoning.encode()) // 2


def test_a_forced_call_or_schema_closes_the_reasoning_block_the_prompt_opened(thinker: ServerProcess) -> None:
    r = thinker.client().chat.completions.create(model=THINKER, messages=[{"role": "user", "content": ASK}],
                                                 tools=[WEATHER], tool_choice="required", max_tokens=120,
                                                 temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert "reasoning_content" not in (choice.message.model_extra or {})
    ((call),) = choice.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    r = thinker.client().chat.completions.create(
        model=THINKER, messages=[{"role": "user", "content": ASK}], max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": city}})
    assert r.choices[0].finish_reason == "stop" and "reasoning_content" not in (r.choices[0].message.model_extra or {})
    assert isinstance(json.loads(r.choices[0].message.content)["city"], str)
    # tool_choice auto: the calls' grammar leaves the text free, reasoning included
    r = thinker.client().chat.completions.create(model=THINKER, messages=[{"role": "user", "content": ASK}],
                                                 tools=[WEATHER], **LONG)
    assert r.choices[0].message.model_extra["reasoning_content"]


def test_reasoning_sent_back_reaches_the_messages_of_every_api() -> None:
    """A thinking block (Anthropic) and a reasoning item (Responses) become the assistant
    turn's ``reasoning_content``, which the template renders (and gpt-oss's reads as
    ``thinking``); a summary or encrypted content alone is not reasoning."""
    from kvcellar.server.anthropic.adapter import convert_messages
    from kvcellar.server.anthropic.protocol import MessagesRequest
    from kvcellar.server.responses.adapter import convert_input
    from kvcellar.server.tools.render import _for_template

    request = MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": THOUGHT, "signature": ""},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]})
    messages = convert_messages(request.messages)
    assert messages[1]["role"] == "assistant" and messages[1]["reasoning_content"] == THOUGHT
    assert _for_template(messages[1])["thinking"] == THOUGHT

    items = convert_input([
        {"role": "user", "content": ASK},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": THOUGHT}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "short"}],
         "encrypted_content": "opaque"},
        {"role": "assistant", "content": "Sunny."}], ToolNames())
    assert items[1]["reasoning_content"] == THOUGHT and "reasoning_content" not in items[3]
