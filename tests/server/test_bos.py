"""Exactly one BOS at the start of every prompt the engine receives, on every API, with the
tokenizers that add one by default (Llama-3's post-processor, Gemma's ``add_bos_token``;
tests/bos_tokenizers.py). Chat templates write the BOS themselves, so rendered chats are
encoded without special tokens; a plain completion prompt gets the tokenizer's BOS unless
its text already starts with one; token prompts reach the engine as given.

A real uvicorn server on 127.0.0.1 around a small random-weight Llama with each tokenizer,
driven by the official clients; the engine is a test subclass that records the token ids
``submit`` receives (what the scheduler and the prefix cache see)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from kvcellar.engine import Engine
from kvcellar.engine.build import assemble_parts
from kvcellar.engine.config import EngineConfig
from kvcellar.server.app import create_app
from kvcellar.server.config import ServerConfig
from tests._models import tiny_model
from tests.bos_tokenizers import TOKENIZERS
from tests.helpers import InProcessServer

MODEL = "kvcellar-bos-test"
SYSTEM = "You are a helpful assistant."
QUESTION = "What is the capital of France?"


class RecordingEngine(Engine):
    """The real engine; ``prompts`` holds every prompt ``submit`` was given, in order."""

    prompts: list[list[int]]

    def submit(self, prompt_ids: Any, params: Any, **kwargs: Any) -> Any:
        self.prompts.append([int(t) for t in prompt_ids])
        return super().submit(prompt_ids, params, **kwargs)


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def served(request: pytest.FixtureRequest) -> Iterator[tuple[InProcessServer, RecordingEngine, Any]]:
    tokenizer = TOKENIZERS[request.param]()
    loaded = tiny_model("llama", tokenizer, name=f"tiny-{request.param}-bos")
    config = EngineConfig(kv_cache_gb=0.05, block_size=16, max_num_seqs=4)
    engine = RecordingEngine(loaded, config, assemble_parts(loaded, config))
    engine.prompts = []
    with InProcessServer(create_app(engine, ServerConfig(served_model_name=MODEL))) as server:
        yield server, engine, tokenizer


def received(engine: RecordingEngine, call: Any) -> list[int]:
    """The one prompt the engine received while ``call`` ran."""
    before = len(engine.prompts)
    call()
    assert len(engine.prompts) == before + 1
    return engine.prompts[-1]


def assert_one_bos(prompt: list[int], bos: int) -> None:
    assert prompt[0] == bos and prompt.count(bos) == 1, prompt[:8]


def rendered(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def test_the_tokenizers_add_a_bos_by_default(served) -> None:
    """The premise: encoding these templates' output with the tokenizer's defaults would
    give two BOS tokens."""
    _, _, tokenizer = served
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                         tokenize=False)
    assert tokenizer(text).input_ids[:2] == [tokenizer.bos_token_id] * 2


def test_chat_completions(served) -> None:
    server, engine, tokenizer = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    messages: Any = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    prompt = received(engine, lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                                                     temperature=0))
    assert prompt == rendered(tokenizer, messages)
    assert_one_bos(prompt, tokenizer.bos_token_id)


def test_completions_with_a_text_prompt(served) -> None:
    server, engine, tokenizer = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    bos = tokenizer.bos_token_id
    prompt = received(engine, lambda: client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=2))
    assert prompt == [bos, *tokenizer(QUESTION, add_special_tokens=False).input_ids]
    # A prompt rendered by the client (a chat template's output) already starts with the BOS text.
    text = tokenizer.bos_token + QUESTION
    prompt = received(engine, lambda: client.completions.create(model=MODEL, prompt=text, max_tokens=2))
    assert prompt == tokenizer(text, add_special_tokens=False).input_ids
    assert_one_bos(prompt, bos)
    both = [QUESTION, text]  # a batch: each prompt on its own
    before = len(engine.prompts)
    client.completions.create(model=MODEL, prompt=both, max_tokens=2)
    assert sorted(engine.prompts[before:]) == sorted([[bos, *tokenizer(QUESTION, add_special_tokens=False).input_ids],
                                                      tokenizer(text, add_special_tokens=False).input_ids])


def test_completions_with_token_prompts_reach_the_engine_as_given(served) -> None:
    server, engine, tokenizer = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    ids = tokenizer(QUESTION).input_ids
    assert_one_bos(ids, tokenizer.bos_token_id)
    assert received(engine, lambda: client.completions.create(model=MODEL, prompt=ids, max_tokens=2)) == ids
    bare = ids[1:]  # the client's choice: no BOS is added to a token prompt
    assert received(engine, lambda: client.completions.create(model=MODEL, prompt=bare, max_tokens=2)) == bare


def test_anthropic_messages(served) -> None:
    server, engine, tokenizer = served
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    messages: Any = [{"role": "user", "content": QUESTION}]
    prompt = received(engine, lambda: claude.messages.create(model=MODEL, max_tokens=2, system=SYSTEM,
                                                             messages=messages))
    assert prompt == rendered(tokenizer, [{"role": "system", "content": SYSTEM}, *messages])
    assert_one_bos(prompt, tokenizer.bos_token_id)
    counted = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages).input_tokens
    assert counted == len(prompt)


def test_responses(served) -> None:
    server, engine, tokenizer = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    prompt = received(engine, lambda: client.responses.create(model=MODEL, instructions=SYSTEM, input=QUESTION,
                                                              max_output_tokens=16, temperature=0))
    assert_one_bos(prompt, tokenizer.bos_token_id)
    counted = httpx.post(server.url + "/v1/responses/input_tokens",
                         json={"model": MODEL, "instructions": SYSTEM, "input": QUESTION}, timeout=60)
    assert counted.status_code == 200 and counted.json()["input_tokens"] == len(prompt)
