"""The Anthropic renderer without a server: one recorded output, fed as engine events cut in
every possible way, must give the same message streamed (the SSE events, accumulated the way
a client does) as whole (``response()``): same content blocks, stop reason and usage.

The output is what the embedded model writes for a forced ``get_weather`` call in the fallback
(Hermes) markup; the events carry its text the way the engine does (a token's releasable
text, sometimes empty, the last event with ``finish_reason``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from anthropic.types import RawMessageStreamEvent
from jiter import from_json
from pydantic import TypeAdapter

from kvcellar.engine import TokenEvent
from kvcellar.server.anthropic.render import MessagesRenderer
from kvcellar.server.internal import OutputTracker
from kvcellar.server.tools.parsers import HermesParser

MODEL = "SmolLM2-135M-Instruct"
PROMPT, CACHED = 57, 48
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
RECORDED = "Sure." + CALL
EXPECTED_CALL = {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris"}}
EVENT_TYPES = TypeAdapter(RawMessageStreamEvent)


def events(pieces: Sequence[str], finish: str = "eos", stop_string: str | None = None,
           empty_between: bool = False) -> list[TokenEvent]:
    """One event per piece (token). ``finish``: ``eos`` (a last event with no text, as an EOS
    token ends), ``length`` (the last piece's event ends it), ``stop_string`` (likewise, with
    ``stop_string`` set: the engine never sends the stop string itself). ``empty_between``:
    an event with no text after each piece (a token whose text is held back)."""
    out: list[TokenEvent] = []
    n = 0

    def event(text: str, finish_reason: str | None = None, **kw: Any) -> TokenEvent:
        nonlocal n
        n += 1
        return TokenEvent(0, 1000 + n, text, finish_reason=finish_reason, num_prompt_tokens=PROMPT,
                          num_cached_tokens=CACHED, num_output_tokens=n, **kw)

    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        if last and finish == "length":
            out.append(event(piece, "length"))
        elif last and finish == "stop_string":
            out.append(event(piece, "stop", stop_string=stop_string))
        else:
            out.append(event(piece))
            if empty_between and not last:
                out.append(event(""))
    if finish == "eos":
        last_event = event("", "stop", is_eos=True)
        last_event.cached_tokens_by_tier = {"ram": CACHED}
        out.append(last_event)
    return out


REQUEST_STOPS = ("2.", "_call>")  # the stop_sequences the stop-string cases ask for


def renderer(tools: bool = True, stops: tuple[str, ...] = REQUEST_STOPS) -> MessagesRenderer:
    return MessagesRenderer(MODEL, OutputTracker(HermesParser(["get_weather"]) if tools else None), stops)


def test_a_server_wide_stop_is_a_normal_end() -> None:
    """``--stop`` strings the request did not ask for end the turn as ``end_turn``."""
    r = renderer(tools=False, stops=())
    for ev in events(["Hello.", " More"], finish="stop_string", stop_string="\n"):
        r.add(0, ev)
    assert r.response()["stop_reason"] == "end_turn" and r.response()["stop_sequence"] is None


def whole(evs: Sequence[TokenEvent], tools: bool = True) -> dict[str, Any]:
    r = renderer(tools)
    for ev in evs:
        r.add(0, ev)
    return r.response()


def parse_sse(chunks: Sequence[bytes]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) pairs; every event is ``event: NAME\\ndata: JSON\\n\\n``."""
    out = []
    for frame in b"".join(chunks).decode().split("\n\n")[:-1]:
        lines = frame.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), frame
        out.append((lines[0][len("event: "):], json.loads(lines[1][len("data: "):])))
    assert b"".join(chunks).endswith(b"\n\n")
    return out


def streamed(evs: Sequence[TokenEvent], tools: bool = True) -> tuple[dict[str, Any], list[str]]:
    """The message a client rebuilds from the stream, and the event names in order. Checks
    the stream's grammar on the way: message_start, ping, per block start / deltas / stop
    (indices 0, 1, ... in order, deltas of the block's own kind), message_delta, message_stop;
    each data's ``type`` is its event's name and parses as the SDK's event type."""
    r = renderer(tools)
    chunks = list(r.open_stream())
    for ev in evs:
        chunks += r.stream(0, ev)
    chunks += r.close_stream()
    pairs = parse_sse(chunks)
    names = [name for name, _ in pairs]
    for name, data in pairs:
        assert data["type"] == name, (name, data)
        if name != "ping":
            EVENT_TYPES.validate_python(data)
    assert names[:2] == ["message_start", "ping"], names
    assert names[-2:] == ["message_delta", "message_stop"], names
    message: dict[str, Any] = dict(pairs[0][1]["message"])
    assert message["content"] == [] and message["stop_reason"] is None
    assert message["usage"]["output_tokens"] <= 1
    message["content"] = []
    partial: dict[int, str] = {}
    open_index: int | None = None
    for name, data in pairs[2:-2]:
        if name == "content_block_start":
            assert open_index is None, "a block started before the previous one stopped"
            assert data["index"] == len(message["content"])
            open_index = data["index"]
            block = dict(data["content_block"])
            assert block in ({"type": "text", "text": ""}, {"type": "thinking", "thinking": "", "signature": ""},
                             {**block, "type": "tool_use", "input": {}}), block
            message["content"].append(block)
            partial[open_index] = ""
        elif name == "content_block_delta":
            assert data["index"] == open_index
            block, delta = message["content"][open_index], data["delta"]
            if delta["type"] == "text_delta":
                assert block["type"] == "text" and delta["text"]
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                assert block["type"] == "thinking" and delta["thinking"]
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                assert block["type"] == "thinking"
                block["signature"] = delta["signature"]
            else:
                assert delta["type"] == "input_json_delta" and block["type"] == "tool_use"
                partial[open_index] += delta["partial_json"]
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
        else:
            raise AssertionError(f"unexpected event {name} inside the message")
    assert open_index is None, "the last block was never stopped"
    delta_event = pairs[-2][1]
    for index, text in partial.items():
        if text:  # a call cut by max_tokens has unfinished JSON: read it as the SDK does
            message["content"][index]["input"] = json.loads(text) if delta_event["delta"]["stop_reason"] != \
                "max_tokens" else from_json(text.encode(), partial_mode=True)
    message["stop_reason"] = delta_event["delta"]["stop_reason"]
    message["stop_sequence"] = delta_event["delta"]["stop_sequence"]
    message["usage"] = {**message["usage"], **delta_event["usage"]}
    return message, names


def without_ids(message: dict[str, Any]) -> dict[str, Any]:
    """Content, stop reason, stop sequence and usage; tool_use ids checked and dropped (each
    renderer draws its own)."""
    blocks = []
    for block in message["content"]:
        block = dict(block)
        if block["type"] == "tool_use":
            assert block.pop("id").startswith("toolu_")
        blocks.append(block)
    return {"content": blocks, "stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"],
            "usage": message["usage"]}


def cuts(text: str) -> list[list[str]]:
    """The text whole, cut in two at every character boundary, and as single characters."""
    return [[text], *([text[:k], text[k:]] for k in range(1, len(text))), list(text)]


def check_same(evs: Sequence[TokenEvent], tools: bool = True) -> dict[str, Any]:
    message, _ = streamed(evs, tools)
    response = whole(evs, tools)
    assert response["type"] == "message" and response["role"] == "assistant" and response["model"] == MODEL
    assert response["id"].startswith("msg_") and message["id"].startswith("msg_")
    ids = [b["id"] for b in response["content"] if b["type"] == "tool_use"]
    assert len(set(ids)) == len(ids)
    assert without_ids(message) == without_ids(response)
    return without_ids(response)


def usage(output_tokens: int) -> dict[str, int]:
    return {"input_tokens": PROMPT - CACHED, "output_tokens": output_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": CACHED}


@pytest.mark.parametrize("pieces", cuts(RECORDED), ids=lambda p: "|".join(map(repr, p))[:60])
def test_tool_call_streamed_equals_whole_at_every_cut(pieces: list[str]) -> None:
    assert check_same(events(pieces)) == {
        "content": [{"type": "text", "text": "Sure."}, EXPECTED_CALL], "stop_reason": "tool_use",
        "stop_sequence": None, "usage": usage(len(pieces) + 1)}


def test_tool_call_with_empty_events_between_tokens() -> None:
    got = check_same(events(list(RECORDED), empty_between=True))
    assert got["content"] == [{"type": "text", "text": "Sure."}, EXPECTED_CALL]
    assert got["stop_reason"] == "tool_use"


def test_tool_call_streams_its_arguments_as_fragments() -> None:
    """Char by char: the tool_use block opens with ``input: {}`` and its arguments arrive as
    several input_json_delta fragments, not as one object at the end."""
    r = renderer()
    chunks = list(r.open_stream())
    for ev in events(list(RECORDED)):
        chunks += r.stream(0, ev)
    chunks += r.close_stream()
    pairs = parse_sse(chunks)
    starts = [d for n, d in pairs if n == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["text", "tool_use"]
    tool_start = starts[1]["content_block"]
    assert tool_start["name"] == "get_weather" and tool_start["input"] == {}
    fragments = [d["delta"]["partial_json"] for n, d in pairs
                 if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    assert len(fragments) > 3 and json.loads("".join(fragments)) == {"city": "Paris"}
    text = "".join(d["delta"]["text"] for n, d in pairs
                   if n == "content_block_delta" and d["delta"]["type"] == "text_delta")
    assert text == "Sure." and "<tool" not in text


def test_only_a_call() -> None:
    for pieces in cuts(CALL):
        got = check_same(events(pieces))
        assert got["content"] == [EXPECTED_CALL] and got["stop_reason"] == "tool_use"


def test_two_calls() -> None:
    rome = CALL.replace("Paris", "Rome")
    text = CALL + "\n" + rome
    for pieces in cuts(text):
        got = check_same(events(pieces))
        assert got["content"] == [EXPECTED_CALL, {**EXPECTED_CALL, "input": {"city": "Rome"}}]
        assert got["stop_reason"] == "tool_use"


def test_call_cut_by_max_tokens() -> None:
    """The output ends inside the arguments' first string: the call stays a call, its input
    is {} (the arguments are not an object; the SDK's partial JSON reading of the streamed
    fragments agrees), and the reason is max_tokens."""
    text = RECORDED[: RECORDED.index("Paris") + 3]
    for pieces in cuts(text):
        got = check_same(events(pieces, finish="length"))
        assert got["content"] == [{"type": "text", "text": "Sure."}, {**EXPECTED_CALL, "input": {}}]
        assert got["stop_reason"] == "max_tokens"


TEXT = "1. Red\n2. Blue\n3. Green — très bien"


@pytest.mark.parametrize("tools", [True, False], ids=["with-parser", "no-parser"])
def test_text_only_at_every_cut(tools: bool) -> None:
    for pieces in cuts(TEXT):
        assert check_same(events(pieces), tools) == {
            "content": [{"type": "text", "text": TEXT}], "stop_reason": "end_turn", "stop_sequence": None,
            "usage": usage(len(pieces) + 1)}


def test_text_cut_by_max_tokens() -> None:
    for pieces in cuts(TEXT):
        got = check_same(events(pieces, finish="length"))
        assert got["content"] == [{"type": "text", "text": TEXT}] and got["stop_reason"] == "max_tokens"
        assert got["usage"]["output_tokens"] == len(pieces)


@pytest.mark.parametrize("tools", [True, False], ids=["with-parser", "no-parser"])
def test_stop_sequence_at_every_cut(tools: bool) -> None:
    before = "1. Red\n"  # the engine stopped at "2." and never sends the stop string
    for pieces in cuts(before):
        got = check_same(events(pieces, finish="stop_string", stop_string="2."), tools)
        assert got["content"] == [{"type": "text", "text": before}]
        assert got["stop_reason"] == "stop_sequence" and got["stop_sequence"] == "2."


def test_stop_sequence_held_back_markup_is_released() -> None:
    """A stop string ends the output right after ``<tool``: the parser held it back as
    possible markup, and the end releases it as text."""
    text = "See <tool"
    for pieces in cuts(text):
        got = check_same(events(pieces, finish="stop_string", stop_string="_call>"))
        assert got["content"] == [{"type": "text", "text": text}]
        assert got["stop_reason"] == "stop_sequence" and got["stop_sequence"] == "_call>"


def test_empty_output() -> None:
    """EOS first: no content block at all, streamed or not."""
    message, names = streamed(events([]))
    assert names == ["message_start", "ping", "message_delta", "message_stop"]
    assert without_ids(message) == without_ids(whole(events([]))) == {
        "content": [], "stop_reason": "end_turn", "stop_sequence": None, "usage": usage(1)}


def test_message_start_carries_the_prompt_usage() -> None:
    r = renderer()
    first = r.stream(0, events(["Hi", "!"])[0])
    (name, data), (ping, _), *_ = parse_sse(first)
    assert (name, ping) == ("message_start", "ping")
    start = data["message"]
    assert start["usage"]["input_tokens"] == PROMPT - CACHED
    assert start["usage"]["cache_read_input_tokens"] == CACHED
    assert start["model"] == MODEL and start["role"] == "assistant" and start["id"] == r.id


# Text after a call: the model writes it (auto tool choice), and an engine event holds more
# than one token's text whenever the stop matcher or the detokenizer held some back.
AFTER = RECORDED + "\nDone."
EXPECTED_AFTER = [{"type": "text", "text": "Sure."}, EXPECTED_CALL, {"type": "text", "text": "\nDone."}]


def test_text_after_a_call_char_by_char() -> None:
    got = check_same(events(list(AFTER)))
    assert got["content"] == EXPECTED_AFTER and got["stop_reason"] == "tool_use"


@pytest.mark.parametrize("pieces", [[AFTER], [AFTER[:60], AFTER[60:]]], ids=["whole", "cut-in-the-arguments"])
def test_text_after_a_call_in_the_same_event(pieces: list[str]) -> None:
    got = check_same(events(pieces))
    assert got["content"] == EXPECTED_AFTER and got["stop_reason"] == "tool_use"
