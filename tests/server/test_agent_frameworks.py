"""Agent frameworks end to end: pydantic-ai, langchain-openai and openai-agents against the real server.

Each framework builds its own requests (its output tool, ``tool_choice``, ``response_format``,
the tool-result turn) and parses our responses with its own models, so these catch shape
mismatches the ``openai`` client alone would let through. The embedded SmolLM2 does not
choose tools by itself: every case forces the call (``required`` or a named function) or
asks for a ``json_schema`` output, which the grammar keeps valid. Each test records the
request bodies the framework sent and asserts the mechanism as well as the parsed values.

Nothing here touches the network: tracing is off and no token counting (tiktoken) is used.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.helpers import MODEL, ServerProcess

# Room for the call markup and a short object; the grammar ends the output well before.
MAX_TOKENS = 60
REPLY_TOKENS = 8  # a free-text turn after a tool result: only its shape is checked
ASK_WEATHER = "What's the weather in Paris?"


class Forecast(BaseModel):
    """A weather forecast for one city."""

    model_config = ConfigDict(extra="forbid")  # additionalProperties: false keeps the output short

    city: str = Field(min_length=1, max_length=24)
    sky: Literal["sunny", "cloudy", "rainy"]
    temperature_c: int


def check_forecast(out: Any) -> None:
    assert isinstance(out, Forecast), f"expected a Forecast, got {out!r}"
    assert isinstance(out.city, str) and 1 <= len(out.city) <= 24
    assert out.sky in ("sunny", "cloudy", "rainy")
    assert isinstance(out.temperature_c, int) and not isinstance(out.temperature_c, bool)


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"Sunny and 21 degrees in {city}."


def api_key(server: ServerProcess) -> str:
    return server.api_key or "sk-no-key-needed"


class RequestLog:
    """The JSON bodies of the chat requests a framework sent, via the openai client's httpx hooks."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def _record(self, request: Any) -> None:
        if request.url.path.endswith("/chat/completions"):
            self.bodies.append(json.loads(request.content))

    async def _record_async(self, request: Any) -> None:
        self._record(request)

    def sync_http_client(self) -> Any:
        return openai.DefaultHttpxClient(event_hooks={"request": [self._record]})

    def async_client(self, server: ServerProcess) -> openai.AsyncOpenAI:
        http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [self._record_async]})
        return openai.AsyncOpenAI(base_url=server.base_url, api_key=api_key(server), http_client=http)


def forced(body: dict[str, Any], name: str | None = None) -> bool:
    """Whether a request forced a tool call (``required``, or the named function)."""
    choice = body.get("tool_choice")
    if name is None:
        return choice == "required" or isinstance(choice, dict)
    return isinstance(choice, dict) and choice["function"]["name"] == name


def tool_names(body: dict[str, Any]) -> list[str]:
    return [t["function"]["name"] for t in body.get("tools", [])]


def tool_result(message: dict[str, Any]) -> tuple[str, str, str]:
    """(role, tool_call_id, content) of a message the framework sent."""
    return message["role"], message.get("tool_call_id", ""), message.get("content", "")


# ---- pydantic-ai ----------------------------------------------------------------------------


@pytest.fixture
def pydantic_ai_agent(server: ServerProcess) -> Callable[..., tuple[Any, RequestLog]]:
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent

    try:
        from pydantic_ai.models.openai import OpenAIChatModel as ChatModel
    except ImportError:  # releases before the Chat/Responses split
        from pydantic_ai.models.openai import OpenAIModel as ChatModel  # type: ignore[attr-defined,no-redef]
    from pydantic_ai.providers.openai import OpenAIProvider

    def make(output_type: Any, **kwargs: Any) -> tuple[Any, RequestLog]:
        log = RequestLog()
        model = ChatModel(MODEL, provider=OpenAIProvider(openai_client=log.async_client(server)))
        agent = Agent(model, output_type=output_type,
                      model_settings={"max_tokens": MAX_TOKENS, "temperature": 0}, **kwargs)
        return agent, log

    return make


def test_pydantic_ai_default_output_is_a_forced_tool_call(pydantic_ai_agent: Callable[..., Any]) -> None:
    from pydantic_ai.messages import ModelResponse, ToolCallPart

    agent, log = pydantic_ai_agent(Forecast)
    result = agent.run_sync(ASK_WEATHER)
    check_forecast(result.output)
    (body,) = log.bodies
    assert forced(body) and body["tool_choice"] == "required", body.get("tool_choice")
    (output_tool,) = tool_names(body)
    calls = [p for m in result.all_messages() if isinstance(m, ModelResponse)
             for p in m.parts if isinstance(p, ToolCallPart)]
    assert [c.tool_name for c in calls] == [output_tool]
    assert Forecast.model_validate(calls[0].args_as_dict()) == result.output


def test_pydantic_ai_native_output_uses_json_schema(pydantic_ai_agent: Callable[..., Any]) -> None:
    from pydantic_ai import NativeOutput

    agent, log = pydantic_ai_agent(NativeOutput(Forecast))
    result = agent.run_sync(ASK_WEATHER)
    check_forecast(result.output)
    (body,) = log.bodies
    fmt = body["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["schema"]["additionalProperties"] is False
    assert "tools" not in body


def test_pydantic_ai_function_tool_then_structured_output(pydantic_ai_agent: Callable[..., Any]) -> None:
    """Two turns: a forced call of our function, its result sent back as a ``tool`` message,
    then the output tool. The function is offered once (``prepare``), or the small model
    would call it again and again."""
    from pydantic_ai import RunContext
    from pydantic_ai.messages import ToolReturnPart
    from pydantic_ai.tools import ToolDefinition

    agent, log = pydantic_ai_agent(Forecast)
    cities: list[str] = []

    async def offer_once(ctx: RunContext[Any], tool_def: ToolDefinition) -> ToolDefinition | None:
        return None if cities else tool_def

    @agent.tool_plain(prepare=offer_once)
    def weather(city: str) -> str:
        """Get the current weather in a city."""
        cities.append(city)
        return get_weather(city)

    result = agent.run_sync(ASK_WEATHER)
    check_forecast(result.output)
    assert len(cities) == 1 and isinstance(cities[0], str) and cities[0]
    first, second = log.bodies
    assert forced(first) and "weather" in tool_names(first)
    assert forced(second) and "weather" not in tool_names(second)
    call_turn, result_turn = second["messages"][-2:]
    assert call_turn["role"] == "assistant" and call_turn["tool_calls"][0]["function"]["name"] == "weather"
    assert tool_result(result_turn) == ("tool", call_turn["tool_calls"][0]["id"], get_weather(cities[0]))
    returns = [p for m in result.all_messages() for p in m.parts
               if isinstance(p, ToolReturnPart) and p.tool_name == "weather"]
    assert [r.content for r in returns] == [get_weather(cities[0])]


def test_pydantic_ai_streamed_output(pydantic_ai_agent: Callable[..., Any]) -> None:
    agent, log = pydantic_ai_agent(Forecast)
    if not hasattr(agent, "run_stream_sync"):
        pytest.skip("this pydantic-ai has no run_stream_sync")
    with agent.run_stream_sync(ASK_WEATHER) as result:
        partials = list(result.stream_output(debounce_by=None))
        output = result.get_output()
    check_forecast(output)
    assert len(partials) >= 2, "the output tool's arguments should arrive in several deltas"
    assert partials[-1] == output
    (body,) = log.bodies
    assert body["stream"] is True and forced(body)


# ---- langchain-openai -------------------------------------------------------------------------


@pytest.fixture
def chat_openai(server: ServerProcess) -> Callable[..., tuple[Any, RequestLog]]:
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    def make(max_tokens: int = MAX_TOKENS, log: RequestLog | None = None) -> tuple[Any, RequestLog]:
        log = log or RequestLog()
        llm = ChatOpenAI(base_url=server.base_url, api_key=api_key(server), model=MODEL, temperature=0,
                         max_tokens=max_tokens, http_client=log.sync_http_client())
        return llm, log

    return make


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output(chat_openai: Callable[..., Any], method: str) -> None:
    llm, log = chat_openai()
    out = llm.with_structured_output(Forecast, method=method).invoke(ASK_WEATHER)
    check_forecast(out)
    (body,) = log.bodies
    if method == "function_calling":
        assert forced(body, "Forecast") and tool_names(body) == ["Forecast"]
    else:
        assert body["response_format"]["type"] == "json_schema" and "tools" not in body


def test_langchain_bind_tools_named_call_and_tool_result_turn(chat_openai: Callable[..., Any]) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool

    weather = tool(get_weather)
    llm, log = chat_openai()
    ask = HumanMessage(ASK_WEATHER)
    msg = llm.bind_tools([weather], tool_choice="get_weather").invoke([ask])
    assert isinstance(msg, AIMessage) and not msg.invalid_tool_calls
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    assert set(call["args"]) == {"city"} and isinstance(call["args"]["city"], str)
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    assert forced(log.bodies[0], "get_weather")

    # The result goes back; the model answers in text (tools offered, not forced).
    reply_llm, _ = chat_openai(REPLY_TOKENS, log)
    answer = reply_llm.bind_tools([weather]).invoke([ask, msg, ToolMessage(weather.invoke(call["args"]),
                                                                     tool_call_id=call["id"])])
    assert isinstance(answer, AIMessage) and isinstance(answer.content, str)
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
    sent = log.bodies[1]["messages"]
    assert sent[1]["tool_calls"][0]["id"] == call["id"]
    assert tool_result(sent[2]) == ("tool", call["id"], get_weather(call["args"]["city"]))


def test_langchain_streamed_required_call(chat_openai: Callable[..., Any]) -> None:
    from langchain_core.tools import tool

    llm, log = chat_openai()
    chunks = list(llm.bind_tools([tool(get_weather)], tool_choice="required").stream(ASK_WEATHER))
    assert len(chunks) > 3
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    (call,) = merged.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    assert call["id"].startswith("call_")
    assert sum(1 for c in chunks if c.tool_call_chunks) > 2, "arguments should stream in pieces"
    assert merged.response_metadata.get("finish_reason") == "tool_calls"
    assert log.bodies[0]["stream"] is True and log.bodies[0]["tool_choice"] == "required"


# ---- openai-agents ----------------------------------------------------------------------------


@pytest.fixture
def agents_sdk(server: ServerProcess) -> Callable[..., tuple[Any, RequestLog]]:
    pytest.importorskip("agents")
    from agents import OpenAIChatCompletionsModel

    def make() -> tuple[Any, RequestLog]:
        log = RequestLog()
        return OpenAIChatCompletionsModel(model=MODEL, openai_client=log.async_client(server)), log

    return make


def test_openai_agents_required_tool_call_then_output_type(agents_sdk: Callable[..., Any]) -> None:
    """A forced call of our function (``tool_choice`` wins over ``response_format``), its result
    sent back, then the ``json_schema`` output once the SDK resets ``tool_choice`` to auto."""
    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
    from agents.items import ToolCallItem, ToolCallOutputItem

    model, log = agents_sdk()
    cities: list[str] = []

    @function_tool
    def weather(city: str) -> str:
        """Get the current weather in a city."""
        cities.append(city)
        return get_weather(city)

    agent = Agent(name="forecaster", instructions="Use the weather tool.", tools=[weather], model=model,
                  output_type=Forecast,
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=MAX_TOKENS))
    result = Runner.run_sync(agent, ASK_WEATHER, max_turns=2, run_config=RunConfig(tracing_disabled=True))
    check_forecast(result.final_output)
    assert len(cities) == 1 and cities[0]
    (call,) = [i for i in result.new_items if isinstance(i, ToolCallItem)]
    assert call.raw_item.name == "weather" and json.loads(call.raw_item.arguments) == {"city": cities[0]}
    (output,) = [i for i in result.new_items if isinstance(i, ToolCallOutputItem)]
    assert output.output == get_weather(cities[0])
    first, second = log.bodies
    assert first["tool_choice"] == "required" and tool_names(first) == ["weather"]
    assert second.get("tool_choice") in (None, "auto") and second["response_format"]["type"] == "json_schema"
    assert tool_result(second["messages"][-1]) == ("tool", call.raw_item.call_id, get_weather(cities[0]))


def test_openai_agents_output_type(agents_sdk: Callable[..., Any]) -> None:
    from agents import Agent, ModelSettings, RunConfig, Runner

    model, log = agents_sdk()
    agent = Agent(name="forecaster", instructions="Give the forecast.", output_type=Forecast, model=model,
                  model_settings=ModelSettings(temperature=0, max_tokens=MAX_TOKENS))
    result = Runner.run_sync(agent, ASK_WEATHER, max_turns=1, run_config=RunConfig(tracing_disabled=True))
    check_forecast(result.final_output)
    (body,) = log.bodies
    assert body["response_format"]["type"] == "json_schema"
