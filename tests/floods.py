"""Floods of what any client may send, as request bodies ``(path, JSON bytes)``, and a
concurrent sender: tests/server/test_floods.py sends them at counts scaled to the suite's
time, benchmarks/bench_floods.py at the full counts (``FULL``)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

Bodies = list[tuple[str, bytes]]

# stored responses, requests of 100 unknown tool types each, distinct schemas, token counts
FULL = {"stored": 2000, "tools": 100, "schemas": 1000, "counts": 500}


def stored_responses(model: str, n: int) -> Bodies:
    """Responses stored with the largest metadata the API allows."""
    metadata = {f"key{i:02d}" + "k" * 58: "v" * 512 for i in range(16)}
    return [("/v1/responses", json.dumps({"model": model, "input": f"Reply {i}.", "metadata": metadata,
                                          "max_output_tokens": 1, "store": True}).encode()) for i in range(n)]


def unknown_tools(model: str, n: int) -> Bodies:
    """``n`` requests of 100 tool types this server ignores each: OpenAI hosted tools and
    Anthropic server tools, half each."""
    hosted = [("/v1/responses/input_tokens", json.dumps({
        "model": model, "input": "hi", "tools": [{"type": f"hosted_{i}_{j}" + "x" * 200} for j in range(100)],
    }).encode()) for i in range(n // 2)]
    server_tools = [("/v1/messages/count_tokens", json.dumps({
        "model": model, "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": f"server_{i}_{j}" + "x" * 200, "name": f"t{j}"} for j in range(100)]}).encode())
        for i in range(n - n // 2)]
    return hosted + server_tools


def distinct_schemas(model: str, n: int) -> Bodies:
    """Distinct JSON schemas of ~6 KB each, compiled into grammars."""
    return [("/v1/chat/completions", json.dumps({
        "model": model, "messages": [{"role": "user", "content": "Fill it in."}], "max_tokens": 1,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
            "type": "object", "properties": {f"field_{i}_{j}_" + "p" * 40: {"type": "string"} for j in range(60)}}}},
    }).encode()) for i in range(n)]


def token_counts(model: str, n: int) -> Bodies:
    """Token counts of 200 KB each, meant to be sent all at once."""
    return [("/v1/messages/count_tokens", json.dumps({
        "model": model, "messages": [{"role": "user", "content": f"{i} " + "lorem ipsum " * 17_000}]}).encode())
        for i in range(n)]


def peak_rss(pid: int) -> int:
    """A process's peak resident set so far (``VmHWM``), bytes."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024


async def _send_all(url: str, bodies: Bodies, concurrency: int) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one(path: str, body: bytes) -> httpx.Response:
            async with gate:
                return await client.post(path, content=body, headers={"Content-Type": "application/json"})

        return await asyncio.gather(*(one(path, body) for path, body in bodies))


def send_all(url: str, bodies: Bodies, concurrency: int = 8) -> list[httpx.Response]:
    """Every body POSTed, ``concurrency`` at a time; the responses in order."""
    return asyncio.run(_send_all(url, bodies, concurrency))
