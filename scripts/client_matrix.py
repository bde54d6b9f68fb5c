"""Client x feature check of the clients kept out of the dev extra (litellm, instructor, the
``llm`` CLI) against a running ``kvcellar serve`` (issue 11's table; the openai client,
pydantic-ai, langchain-openai and openai-agents are covered by tests/server/).

They get a venv of their own: instructor pins an older openai than the dev extra's, litellm
needs ``mcp`` for tools and pulls many packages.

    python3 -m venv /tmp/clients && /tmp/clients/bin/pip install litellm instructor llm mcp
    .venv/bin/kvcellar serve --port 8765 --dtype float32 &
    /tmp/clients/bin/python scripts/client_matrix.py litellm instructor llm [--base-url URL]
"""
import json
import subprocess
import sys
import traceback
from typing import Literal

from pydantic import BaseModel

BASE = (sys.argv[sys.argv.index("--base-url") + 1] if "--base-url" in sys.argv else "http://127.0.0.1:8765/v1")
MODEL = "SmolLM2-135M-Instruct"
results: list[tuple[str, str, str]] = []


class City(BaseModel):
    name: str
    country: str
    size: Literal["small", "medium", "large"]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False}}}


def check(client: str, feature: str, fn) -> None:
    try:
        detail = fn()
        results.append((client, feature, f"PASS {detail}"))
    except Exception as exc:
        traceback.print_exc()
        results.append((client, feature, f"FAIL {type(exc).__name__}: {exc}"[:200]))


def litellm_checks() -> None:
    import litellm
    kw = dict(model=f"openai/{MODEL}", api_base=BASE, api_key="none", temperature=0, max_tokens=64)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]

    def plain():
        r = litellm.completion(messages=[{"role": "user", "content": "Say hi"}], **kw)
        assert r.choices[0].message.content
        return repr(r.choices[0].message.content[:30])

    def required():
        r = litellm.completion(messages=msgs, tools=[WEATHER], tool_choice="required", **kw)
        call = r.choices[0].message.tool_calls[0]
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and isinstance(args["city"], str)
        assert r.choices[0].finish_reason == "tool_calls"
        return call.function.arguments

    def streamed():
        chunks = list(litellm.completion(messages=msgs, tools=[WEATHER], tool_choice="required", stream=True, **kw))
        built = litellm.stream_chunk_builder(chunks, messages=msgs)
        call = built.choices[0].message.tool_calls[0]
        json.loads(call.function.arguments)
        return call.function.arguments

    def json_schema():
        r = litellm.completion(messages=[{"role": "user", "content": "Describe Paris."}], response_format=City, **kw)
        return City.model_validate_json(r.choices[0].message.content).model_dump_json()

    check("litellm", "plain chat", plain)
    check("litellm", "tool_choice=required", required)
    check("litellm", "streamed tool call", streamed)
    check("litellm", "response_format pydantic", json_schema)


def instructor_checks() -> None:
    import instructor
    from openai import OpenAI
    raw = OpenAI(base_url=BASE, api_key="none")
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA, instructor.Mode.JSON):
        def run(mode=mode):
            client = instructor.from_openai(raw, mode=mode)
            city = client.chat.completions.create(model=MODEL, response_model=City, temperature=0, max_tokens=80,
                                                  max_retries=0,
                                                  messages=[{"role": "user", "content": "Describe Paris."}])
            return city.model_dump_json()
        check("instructor", f"Mode.{mode.name}", run)


def llm_checks() -> None:
    import os
    import pathlib
    import tempfile
    home = pathlib.Path(tempfile.mkdtemp())
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: kvc\n  model_name: {MODEL}\n  api_base: {BASE}\n"
        "  supports_schema: true\n  supports_tools: true\n")
    env = {**os.environ, "LLM_USER_PATH": str(home), "OPENAI_API_KEY": "none"}
    llm = str(pathlib.Path(sys.executable).with_name("llm"))

    def plain():
        out = subprocess.run([llm, "-m", "kvc", "-o", "temperature", "0", "-o", "max_tokens", "20", "Say hi"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip(), out.stderr
        return repr(out.stdout.strip()[:30])

    def schema():
        out = subprocess.run([llm, "-m", "kvc", "-o", "temperature", "0", "-o", "max_tokens", "80", "--schema",
                              "name, country, population int", "Describe Paris."],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        data = json.loads(out.stdout)
        assert {"name", "country", "population"} <= set(data) and isinstance(data["population"], int)
        return out.stdout.strip()

    def tools():
        out = subprocess.run([llm, "-m", "kvc", "-o", "temperature", "0", "-o", "max_tokens", "60",
                              "--functions",
                              "def add(a: int, b: int) -> int:\n    'Add two integers.'\n    return a + b\n",
                              "--td", "Use the add tool to add 2 and 3."],
                             env=env, capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr
        text = out.stdout + out.stderr
        assert "add(" in text or "Tool call" in text, text
        return repr(text.strip()[:120])

    check("llm CLI", "plain prompt", plain)
    check("llm CLI", "--schema", schema)
    check("llm CLI", "--functions (tool loop)", tools)


litellm_checks() if "litellm" in sys.argv else None
instructor_checks() if "instructor" in sys.argv else None
llm_checks() if "llm" in sys.argv else None
print()
for c, f, r in results:
    print(f"| {c} | {f} | {r} |")
