"""The real coding agents against a real server: Claude Code (Messages API), Codex CLI (Responses
API) and opencode (chat completions), pinned and installed by ``make agents`` (tests/coding_agents.py
runs them offline, each in a folder of its own).

Each agent runs with its full default request (Claude Code's is ~12.4k tokens, Codex's ~9.3k), so
the server is started with a context of 32k tokens. What is checked is what a user sees: the
agent exits 0 after its turn, and a later turn finds the conversation so far in the cache. The
cache share of a turn is its first request's (prompt tokens served from the cache / prompt
tokens), read from the server's JSON request log.

The answers are not judged, so the server runs a small random-weight Llama with the embedded
model's tokenizer and chat template, served under the embedded model's name (``agent_model``):
the embedded model spent ~215 s of the suite on the three agents' cold prefills alone on two
cores, while what is under test (the three APIs as the agents speak them, and the prefix cache
across sessions and turns) is the same for any model. Its replies are random tokens that end
the way a chat model's do: the end token gets a fixed share of every step (~15 tokens on
average at temperature 1; an empty reply under greedy decoding). The server also ends a reply
at its first newline or sentence end (``--stop``, as an Ollama Modelfile's stop) with
``--max-completion-tokens`` as a backstop: Claude Code (on ``max_tokens``) and Codex (on
``incomplete``) treat a cut reply as a failure, and a turn whose reply the cap still cut is run
once more (the agent says so; any other failure fails the test).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests import coding_agents as agents
from tests._models import embedded, tiny_model
from tests.helpers import MODEL, ServerProcess

pytestmark = pytest.mark.slow

# What Claude Code and Codex print when a reply was cut by max_tokens (they fail the turn).
CUT_BY_THE_CAP = ("reason: max_output_tokens", "output token maximum")
TIMEOUT = 300.0  # one agent turn
END_WEIGHT = 1.1  # the end token's logit per unit of the constant feature: ~15 tokens a reply


def agent_model(out: Path) -> Path:
    """A 2-layer random-weight Llama with the embedded model's tokenizer, saved as a HF folder,
    whose replies end after a few tokens. Feature 0 of the residual stream is a constant no
    layer writes to, so after the final norm it is large at every position, and only the end
    token's row of ``lm_head`` reads it: the end token gets the same share at every step."""
    tokenizer = embedded("float32").tokenizer
    model = tiny_model("llama", tokenizer, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768).model
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0].zero_()
            layer.mlp.down_proj.weight[0].zero_()
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[eos, 0] = END_WEIGHT
    model.generation_config.eos_token_id = eos
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[ServerProcess]:
    # a context that holds the agents' prompts; the pool grows to one such request
    model = agent_model(tmp_path_factory.mktemp("agent-model"))
    proc = ServerProcess(tmp_path_factory.mktemp("agents-server"), "--model", str(model),
                         "--served-model-name", MODEL, "--dtype", "auto", "--max-model-len", "32768",
                         "--stop", "\\n,. ,! ,? ", "--max-completion-tokens", "512",
                         "--log-level", "INFO", "--log-format", "json", models_dir=models_dir).start()
    yield proc
    proc.stop()


def finished_requests(server: ServerProcess) -> list[dict[str, Any]]:
    """Every request the server has finished, in order, from its JSON request log."""
    out = []
    for line in server.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"request finished"' in line:
            out.append(json.loads(line))
    return out


def run_turn(server: ServerProcess, name: str, prompt: str, folder: Path, **kwargs: Any
             ) -> tuple[str, float, int]:
    """Run one turn; (the agent's answer, the share of the prompt of the turn's first request
    read from the cache, the number of requests it made). Only the first request's share says
    what the cache kept: the model may call a tool, and the next request then carries the
    tool's output, which no cache can have seen."""
    skip = agents.skip_reason(name)
    if skip is not None:
        pytest.skip(skip)
    before = len(finished_requests(server))
    result = agents.run_agent(name, server.url, MODEL, prompt, folder, timeout=TIMEOUT, **kwargs)
    if result.returncode != 0 and any(cut in result.stdout + result.stderr for cut in CUT_BY_THE_CAP):
        before = len(finished_requests(server))  # the model rambled to --max-completion-tokens: sample again
        result = agents.run_agent(name, server.url, MODEL, prompt, folder, timeout=TIMEOUT, **kwargs)
    assert result.returncode == 0, f"{name} exited {result.returncode}:\n{result.stdout[-3000:]}\n" \
                                   f"{result.stderr[-3000:]}\nserver log: {server.log_path}"
    answer = agents.answer_text(name, result)  # may be empty: the model's reply can start with its stop
    server.wait_idle()  # a request's log line is written as its stream closes
    turn = finished_requests(server)[before:]
    assert turn and turn[0]["prompt_tokens"] > 0, turn
    return answer, turn[0]["cached_tokens"] / turn[0]["prompt_tokens"], len(turn)


def test_claude_code_sessions_and_turns_reuse_the_cache(server: ServerProcess, tmp_path: Path) -> None:
    """A second ``claude -p`` session reads its whole prompt from the cache, one with another
    question (another billing pseudo-header) its system prompt and tools (the question comes
    before Claude Code's environment section, which is therefore computed again); a
    ``--continue`` turn finds the whole conversation so far."""
    _, first_share, _ = run_turn(server, "claude", "Say hello.", tmp_path)
    assert first_share < 0.5  # a cold start: nothing of Claude Code's prompt was cached yet
    _, same_question, _ = run_turn(server, "claude", "Say hello.", tmp_path)
    assert same_question >= 0.95, f"a second session read only {same_question:.1%} of its prompt from the cache"
    _, other_question, _ = run_turn(server, "claude", "What is 2+2?", tmp_path)
    assert other_question >= 0.75, f"a new question read only {other_question:.1%} of its prompt from the cache"
    _, next_turn, _ = run_turn(server, "claude", "And again.", tmp_path, continue_session=True)
    assert next_turn >= 0.8, f"the second turn read only {next_turn:.1%} of its prompt from the cache"


def test_codex_turns_reuse_the_cache(server: ServerProcess, tmp_path: Path) -> None:
    run_turn(server, "codex", "Say hello.", tmp_path)
    _, next_turn, _ = run_turn(server, "codex", "And again.", tmp_path, continue_session=True)
    assert next_turn >= 0.8, f"codex's second turn read only {next_turn:.1%} of its prompt from the cache"


def test_opencode_runs(server: ServerProcess, tmp_path: Path) -> None:
    _, _, requests = run_turn(server, "opencode", "Say hello.", tmp_path)
    assert requests >= 1
    _, next_turn, _ = run_turn(server, "opencode", "And again.", tmp_path, continue_session=True)
    assert next_turn >= 0.8, f"opencode's second turn read only {next_turn:.1%} of its prompt from the cache"


def test_the_agents_requests_named_only_the_served_model(server: ServerProcess) -> None:
    """No request of the agents above was refused (a 404 for another model name, a 400, a 500),
    and each agent that ran reached its own API."""
    ran = [name for name in agents.PACKAGES if agents.skip_reason(name) is None]
    if not ran:
        pytest.skip("no coding agent runs here: " + "; ".join(filter(None, map(agents.skip_reason, agents.PACKAGES))))
    text = httpx.get(server.url + "/metrics", timeout=30).text
    answered = [line for line in text.splitlines() if line.startswith("kvcellar_http_request_duration_seconds_count")]
    routes = {"claude": "/v1/messages", "codex": "/v1/responses", "opencode": "/v1/chat/completions"}
    for name in ran:
        assert any(f'route="{routes[name]}"' in line for line in answered), (name, answered)
    failed = [line for line in answered if 'status="2' not in line]
    assert not failed, json.dumps(failed)


def test_claude_code_2_1_197_first_request_is_served(server: ServerProcess) -> None:
    """Claude Code 2.1.197's first request, recorded once (tests/server/fixtures/agents/README.md)
    and sent again as it was: its ``TaskCreate`` and ``TaskUpdate`` declare ``propertyNames``,
    which made it a 400 ("the grammar engine cannot compile it") and 2.1.197 exit 1. Not every
    user updates on the day a release comes out."""
    from tests.server.agent_fixtures import body

    # recorded as kvcellar-model; a few tokens of the random model's reply are enough to show
    # the request is served (its tools are compiled before anything is generated)
    recorded = dict(body("claude_code_2_1_197_messages.json"), model=MODEL, max_tokens=16)
    r = httpx.post(server.url + "/v1/messages?beta=true", json=recorded,
                   headers={"x-api-key": agents.DEFAULT_API_KEY, "anthropic-version": "2023-06-01"}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text[:2000]
    assert "event: message_stop" in r.text and "event: error" not in r.text, r.text[-2000:]
