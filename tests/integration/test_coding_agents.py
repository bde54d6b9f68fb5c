"""The real coding agents against a real server: Claude Code (Messages API), Codex CLI (Responses
API) and opencode (chat completions), pinned and installed by ``make agents`` (tests/coding_agents.py
runs them offline, each in a folder of its own).

Each agent runs with its full default request (Claude Code's is ~12.4k tokens, Codex's ~9.3k), so
the server is started with a context above the embedded model's 8192 tokens. A 135M model at
temperature 1 over such a prompt sometimes writes thousands of tokens before its end token, and
Claude Code (on ``max_tokens``) and Codex (on ``incomplete``) treat a cut reply as a failure, so
the server ends every reply at its first newline or sentence end (``--stop``, as an Ollama
Modelfile's stop; reported as a normal end) with ``--max-completion-tokens`` as a backstop, and a
turn whose reply the cap still cut is run once more (the agent says so; any other failure fails
the test). What is checked is what a user sees: the agent exits 0 after its turn, and a later
turn finds the conversation so far in the cache. The cache share of a turn is its first
request's (prompt tokens served from the cache / prompt tokens), read from the server's JSON
request log. The answers themselves are a 135M model's and are not judged.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import coding_agents as agents
from tests.helpers import MODEL, ServerProcess

pytestmark = pytest.mark.slow

# What Claude Code and Codex print when a reply was cut by max_tokens (they fail the turn).
CUT_BY_THE_CAP = ("reason: max_output_tokens", "output token maximum")
TIMEOUT = 540.0  # one agent turn: a cold ~12k-token prefill and whatever the model writes


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[ServerProcess]:
    # bf16 where the CPU has it (prefill of the agents' prompts is the slow part); a context that
    # holds them; the pool grows to one such request.
    proc = ServerProcess(tmp_path_factory.mktemp("agents-server"), "--dtype", "auto", "--max-model-len", "32768",
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
    """No request of the agents above was refused (a 404 for another model name, a 400, a 500)."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    answered = [line for line in text.splitlines() if line.startswith("kvcellar_http_request_duration_seconds_count")]
    assert any('route="/v1/messages"' in line for line in answered), answered
    failed = [line for line in answered if 'status="2' not in line]
    assert not failed, json.dumps(failed)
