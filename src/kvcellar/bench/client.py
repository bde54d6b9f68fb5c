"""A streaming chat client that times what a user sees.

TTFT is the time from sending the request to the first streamed chunk that carries text
or a finish reason (a leading role-only chunk does not count: kvcellar sends it before the
prefill). The decode step is the mean gap between the first and the last text chunk over
the generated tokens (``usage.completion_tokens``), so chunks that carry several tokens are
counted right. Works against any OpenAI-compatible server; the fields a server does not
report (``cached_tokens`` for most peers) stay None.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Self

import httpx


@dataclass
class StreamResult:
    ok: bool
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float = 0.0
    last_token_s: float | None = None  # since the request was sent
    text: str = ""
    text_chunks: int = 0
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    started: float = field(default=0.0, repr=False)  # perf_counter at send

    @property
    def output_tokens(self) -> int:
        """``usage.completion_tokens``; where a server streams no usage (llama-cpp-python),
        the text chunks, one token each in the servers measured here."""
        return self.completion_tokens if self.completion_tokens is not None else self.text_chunks

    @property
    def decode_step_s(self) -> float | None:
        """Mean time per generated token after the first one."""
        n = self.output_tokens
        if self.ttft_s is None or self.last_token_s is None or n < 2:
            return None
        return (self.last_token_s - self.ttft_s) / (n - 1)


@dataclass(frozen=True)
class RequestRecord:
    """One request as result.json records it: a ``StreamResult`` without its text and start
    time, with its derived figures; scenarios subclass it to add their own fields."""

    ok: bool
    error: str | None
    ttft_s: float | None
    e2e_s: float
    last_token_s: float | None
    text_chunks: int
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    decode_step_s: float | None
    output_tokens: int

    @classmethod
    def of(cls, r: StreamResult, **extra: Any) -> Self:
        """``extra``: a subclass's own fields."""
        return cls(ok=r.ok, error=r.error, ttft_s=r.ttft_s, e2e_s=r.e2e_s, last_token_s=r.last_token_s,
                   text_chunks=r.text_chunks, finish_reason=r.finish_reason, prompt_tokens=r.prompt_tokens,
                   completion_tokens=r.completion_tokens, cached_tokens=r.cached_tokens,
                   decode_step_s=r.decode_step_s, output_tokens=r.output_tokens, **extra)


class ChatClient:
    """One HTTP connection pool to one server; ``stream_chat`` may run concurrently."""

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, timeout: float = 1800.0,
                 max_connections: int = 64) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            headers=headers, timeout=httpx.Timeout(timeout, connect=30.0),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections))

    async def __aenter__(self) -> ChatClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def stream_chat(self, messages: list[dict[str, Any]], max_tokens: int, *, ignore_eos: bool = False,
                          temperature: float = 0.0, extra: dict[str, Any] | None = None) -> StreamResult:
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {}),
        }
        if ignore_eos:
            body["ignore_eos"] = True
        res = StreamResult(ok=False)
        parts: list[str] = []
        t0 = time.perf_counter()
        res.started = t0
        try:
            async with self._http.stream("POST", self.base_url + "/chat/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    res.error = f"HTTP {r.status_code}: {r.text[:300]}"
                    res.e2e_s = time.perf_counter() - t0
                    return res
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter() - t0
                    self._take_chunk(json.loads(data), now, res, parts)
        except (httpx.HTTPError, ValueError) as exc:
            res.error = f"{type(exc).__name__}: {exc}"
            res.e2e_s = time.perf_counter() - t0
            return res
        res.e2e_s = time.perf_counter() - t0
        res.text = "".join(parts)
        res.ok = res.error is None and res.ttft_s is not None
        if not res.ok and res.error is None:
            res.error = "the stream ended without a token"
        return res

    @staticmethod
    def _take_chunk(chunk: dict[str, Any], now: float, res: StreamResult, parts: list[str]) -> None:
        if "error" in chunk:
            res.error = str(chunk["error"])[:300]
            return
        for choice in chunk.get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if content:
                parts.append(content)
                res.text_chunks += 1
                res.last_token_s = now
            if (content or choice.get("finish_reason")) and res.ttft_s is None:
                res.ttft_s = now
            if choice.get("finish_reason"):
                res.finish_reason = choice["finish_reason"]
                if res.last_token_s is None:
                    res.last_token_s = now
        usage = chunk.get("usage")
        if usage:
            res.prompt_tokens = usage.get("prompt_tokens")
            res.completion_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details") or {}
            res.cached_tokens = details.get("cached_tokens")
