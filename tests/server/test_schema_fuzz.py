"""Schema-driven fuzzing: schemathesis draws valid and invalid requests from the server's own
OpenAPI document; none may produce a server error, and every error is OpenAI-shaped.

Bounded to keep it cheap: a fixed number of examples, generation capped at a few tokens, and
the per-request timeout extras removed (a client asking for a 1 µs timeout gets a legitimate
504, which is not what this test is about).
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import MODEL, ServerProcess

pytestmark = pytest.mark.slow

schemathesis = pytest.importorskip("schemathesis")

MAX_EXAMPLES = int(os.environ.get("KVCELLAR_FUZZ_EXAMPLES", "150"))
MAX_GENERATED_TOKENS = 4
OPERATIONS = [("/v1/chat/completions", "POST"), ("/v1/completions", "POST"), ("/v1/models", "GET"),
              ("/v1/models/{model_id}", "GET"), ("/health", "GET")]


def bounded(body: Any, path: str) -> Any:
    """Cap generation length; keep invalid values (<= 0, wrong types) as drawn."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for key in ("first_token_timeout", "inter_token_timeout"):
        body.pop(key, None)
    limits = ["max_tokens", "max_completion_tokens"] if path.endswith("chat/completions") else ["max_tokens"]
    has_int_limit = False
    for key in limits:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            body[key] = min(value, MAX_GENERATED_TOKENS)
            has_int_limit = True
    if not has_int_limit and body.get(limits[0]) is None:
        body[limits[0]] = MAX_GENERATED_TOKENS
    return body


def check_response(case: Any, response: Any) -> None:
    where = f"{case.method} {case.path} body={json.dumps(case.body, default=str)[:500]}"
    assert response.status_code < 500, f"{response.status_code} for {where}: {response.text[:500]}"
    ctype = response.headers.get("content-type") or ""
    if isinstance(ctype, list):  # schemathesis keeps every value of a header
        ctype = ctype[0] if ctype else ""
    if response.status_code >= 400:
        err = response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, where
    elif ctype.startswith("text/event-stream"):
        text = response.text
        assert text.rstrip().endswith("data: [DONE]"), where
        assert '"server_error"' not in text, f"in-stream server error for {where}: {text[-500:]}"


def test_no_server_errors_on_schema_driven_requests(server: ServerProcess) -> None:
    from schemathesis import GenerationMode

    raw = httpx.get(server.url + "/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(raw)
    strategies = []
    for path, method in OPERATIONS:
        op = schema[path][method]
        strategies.append(op.as_strategy(GenerationMode.POSITIVE))
        strategies.append(op.as_strategy(GenerationMode.NEGATIVE))
    seen: dict[int, int] = {}

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=st.one_of(strategies), real_model=st.booleans())
    def run(case: Any, real_model: bool) -> None:
        if isinstance(case.body, dict):
            case.body = bounded(case.body, case.path)
            if real_model and isinstance(case.body.get("model"), str):
                case.body["model"] = MODEL  # otherwise nearly everything is a 404
        if real_model and case.path_parameters and "model_id" in case.path_parameters:
            case.path_parameters["model_id"] = MODEL
        response = case.call(base_url=server.url, timeout=120)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        check_response(case, response)

    run()
    print("status codes seen:", dict(sorted(seen.items())))
    assert any(200 <= code < 300 for code in seen) and any(400 <= code < 500 for code in seen)
    assert server.wait_idle()["kv_blocks_used"] == 0
