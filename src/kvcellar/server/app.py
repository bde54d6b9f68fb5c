"""The FastAPI application: routes, middleware, lifespan.

``create_app(engine, settings)`` takes an engine that is built but not necessarily started.
The app owns its lifecycle from then on: startup starts the engine's step loop; shutdown
stops admitting, lets in-flight work finish for ``settings.shutdown_timeout`` seconds,
aborts the rest and stops the engine (``Engine.shutdown``). ``runner.serve`` adds signal
handling around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.middleware.cors import CORSMiddleware

import kvcellar
from kvcellar.engine import Engine, native, observability
from kvcellar.engine.loader import linear_kernels
from kvcellar.server import errors, tenants
from kvcellar.server.anthropic import adapter as anthropic
from kvcellar.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from kvcellar.server.config import ServerConfig
from kvcellar.server.metrics import InflightLevels, ServerMetrics, SnapshotCollector, group_by_prefix, merged_stats
from kvcellar.server.middleware import ApiGate, BrowserGuard, DrainState, RequestMetrics
from kvcellar.server.protocol import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from kvcellar.server.reasoning import GEMMA4
from kvcellar.server.responses import adapter as responses
from kvcellar.server.responses.protocol import InputTokensRequest, ResponsesRequest
from kvcellar.server.responses.store import ResponseStore
from kvcellar.server.serving import Serving
from kvcellar.server.streaming import ClientDisconnected
from kvcellar.server.tenants import Keys

log = logging.getLogger(__name__)

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in ((400, "Invalid request"), (401, "Missing or wrong API key"), (404, "Unknown model"),
                         (413, "Body too large"), (500, "Generation failed"), (503, "Shutting down or overloaded"),
                         (504, "Timed out; the request was cancelled"))
}


def _generation_responses(model: type) -> dict[int | str, dict[str, Any]]:
    return {200: {"model": model, "content": {"text/event-stream": {"schema": {"type": "string"}}},
                  "description": "The completion; with stream=true, server-sent events whose data are "
                                 "chunks (chat.completion.chunk / text_completion), then [DONE]"},
            **_ERRORS}


class ServerState:
    """What the routes share; one per app."""

    def __init__(self, engine: Engine, config: ServerConfig,
                 stats_sources: Sequence[Callable[[], Mapping[str, float]]] = (),
                 stats_gauges: Collection[str] = ()) -> None:
        self.engine = engine
        self.extra_gauges = frozenset(stats_gauges)  # levels among the extra sources' keys
        self.config = config
        # Every counter source, merged in this order by ``stats`` (their key prefixes keep them
        # apart): the engine (engine_, sched_, kv_, and whatever tiers it reports), the
        # artifact cache the model came from, any extra ones, then this layer's server_.
        self.sources: list[Callable[[], Mapping[str, float]]] = [lambda: observability.snapshot(engine)]
        artifact_cache = getattr(getattr(engine.loaded, "artifact", None), "cache", None)
        if artifact_cache is not None and hasattr(artifact_cache, "stats"):
            self.sources.append(artifact_cache.stats)
        self.sources.extend(stats_sources)
        self.metrics = ServerMetrics()
        self.serving = Serving(engine, config, self.metrics)
        self.responses = ResponseStore(config.max_stored_responses, int(config.max_stored_responses_mb * 2**20))
        self.keys = Keys.configured(config.api_key, config.api_key_file, config.shared_key_names())
        self.started = time.time()
        self.drain = DrainState()
        self.metrics.registry.register(
            SnapshotCollector(self.stats, self.gauge_keys, lambda: observability.tier_reports(engine)))

    @property
    def draining(self) -> bool:
        return self.drain.draining

    def start_draining(self) -> None:
        self.drain.draining = True

    def stats(self) -> dict[str, float]:
        inflight = InflightLevels(inflight_requests=len(self.serving.inflight),
                                  inflight_sequences=self.serving.inflight.num_sequences())
        server = {**self.metrics.stats.as_dict(), **inflight.as_dict()}
        parts = []
        for source in self.sources:
            try:
                parts.append(source())
            except Exception:  # a broken counter source must not take /health down
                log.exception("stats source %r failed", source)
        return merged_stats(*parts, server)

    def gauge_keys(self) -> frozenset[str]:
        """The keys of ``stats`` that are levels, as each source's owner declares them."""
        artifact_cache = getattr(getattr(self.engine.loaded, "artifact", None), "cache", None)
        return (observability.gauge_keys(self.engine) | InflightLevels.gauge_names()
                | getattr(artifact_cache, "GAUGES", frozenset()) | self.extra_gauges)

    def health(self) -> dict[str, Any]:
        stats = self.stats()
        tiers = self.tiers()
        # A tier's counters are listed under ``tiers`` only, not again in the groups by prefix.
        shown = {k for tier in tiers.values() for k in tier["counters"]}
        ssd = tiers.get("ssd")
        return {
            "status": "draining" if self.draining else "ok" if self.engine.healthy else "unhealthy",
            "model": self.serving.model_name,
            "backend": self.engine.loaded.engine,  # the framework computing the model (--engine): torch or mlx
            "weights": self.engine.loaded.weights,
            "linears": linear_kernels(self.engine.loaded.model),  # how many run which kernel
            # the forms of kvcellar's CPU kernels this machine runs (AVX2 / AVX-512, AMX tiles)
            "cpu_kernels": (native.cpu_kernels() if self.engine.loaded.engine == "torch"
                            and self.engine.loaded.device.type == "cpu" else None),
            "dtype": str(self.engine.loaded.dtype).removeprefix("torch."),
            # The activations' dtype in the quantized kernels, where it is not ``dtype``.
            "kernel_dtype": (str(self.engine.loaded.kernel_dtype).removeprefix("torch.")
                             if self.engine.loaded.kernel_dtype is not None else None),
            # How the chat template writes tool calls and reasoning, as the server reads them.
            "chat_format": {"tool_calls": self.serving.tool_prompting.family,
                            "reasoning": "harmony" if self.serving.tool_prompting.harmony else
                            None if self.serving.reasons is None else
                            "gemma4" if self.serving.reasons is GEMMA4 else "think"},
            "version": kvcellar.__version__,
            "pid": os.getpid(),  # which process answered: a launcher checks it is the one it started
            "uptime_s": round(time.time() - self.started, 3),
            "queue_depth": int(stats.get("engine_waiting", 0)),
            "running": int(stats.get("engine_running", 0)),
            "inflight_requests": int(stats.get("server_inflight_requests", 0)),
            "kv_blocks_used": int(stats.get("kv_blocks_used", 0)),
            # Whether the previous run on this cache dir shut down cleanly (writer drained,
            # index flushed); null without an SSD tier.
            "last_shutdown_clean": None if ssd is None else ssd.get("last_shutdown_clean"),
            "last_shutdown_reason": None if ssd is None else (ssd.get("ssd") or {}).get("last_shutdown_reason"),
            # Why /health may be 503 while not draining: steps failing in a row.
            "engine_steps": observability.step_health(self.engine),
            "speculative": observability.speculation_health(self.engine),
            "tiers": tiers,
            **self._artifact_health(),
            **group_by_prefix({k: v for k, v in stats.items() if k not in shown}),
        }

    def _artifact_health(self) -> dict[str, Any]:
        """The artifact cache's hit rate and last eviction, when the model came from it."""
        cache = getattr(getattr(self.engine.loaded, "artifact", None), "cache", None)
        if cache is None or not hasattr(cache, "health"):
            return {}
        try:
            return {"artifact_cache": cache.health()}
        except Exception:  # a broken source must not take /health down
            log.exception("artifact cache health failed")
            return {}

    def tiers(self) -> dict[str, dict[str, Any]]:
        """Each cache tier once, top first: its state and health (lower tiers: policy, last
        error, writer queue, a tier-specific sub-dict) with its counters."""
        health = observability.tier_health(self.engine)
        return {name: {**health.get(name, {"state": "ok"}), "counters": counters}
                for name, counters in observability.tier_stats(self.engine).items()}


def create_app(engine: Engine, settings: ServerConfig | None = None,
               stats_sources: Sequence[Callable[[], Mapping[str, float]]] = (),
               stats_gauges: Collection[str] = ()) -> FastAPI:
    """``stats_sources``: extra callables returning prefixed counters (e.g. a tier that the
    engine does not report itself), merged into /health and /metrics; ``stats_gauges``: which
    of their keys are levels (gauges), the rest being counts."""
    config = settings or ServerConfig()
    state = ServerState(engine, config, stats_sources, stats_gauges)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            state.start_draining()
            await asyncio.to_thread(engine.shutdown, config.shutdown_timeout)
            state.serving.close()

    app = FastAPI(title="kvcellar", version=kvcellar.__version__, lifespan=lifespan,
                  description="OpenAI-compatible API with a persistent, tiered prompt KV cache.")
    app.state.kvcellar = state
    errors.install_error_handlers(app)

    async def client_left(request: Request, exc: Exception) -> Response:
        state.metrics.stats.client_disconnects += 1  # while its request was prepared
        return Response(status_code=499)  # nobody is listening; keeps the access log honest

    app.add_exception_handler(ClientDisconnected, client_left)

    @app.post("/v1/chat/completions", responses=_generation_responses(ChatCompletion),
              response_model=None, summary="Chat completion (stream chunks: ChatCompletionChunk)")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await state.serving.chat(body, request.receive)

    @app.post("/v1/completions", responses=_generation_responses(Completion), response_model=None,
              summary="Legacy text completion")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await state.serving.completions(body, request.receive)

    @app.post("/v1/messages", response_model=None, summary="Anthropic Messages API (Claude Code)",
              responses={200: {"description": "A message; with stream=true, Anthropic's server-sent events"}})
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await anthropic.messages(state.serving, body, request.receive)

    @app.post("/v1/messages/count_tokens", summary="Anthropic token count of a Messages request")
    async def messages_count_tokens(body: CountTokensRequest) -> dict[str, int]:
        return await anthropic.count_tokens(state.serving, body)

    @app.post("/v1/responses", response_model=None, summary="OpenAI Responses API (Codex CLI, openai-agents)",
              responses={200: {"description": "A response; with stream=true, the Responses API's server-sent "
                                              "events"}})
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await responses.responses(state.serving, state.responses, body, request.receive)

    @app.post("/v1/responses/input_tokens", summary="Token count of a Responses request")
    async def response_input_tokens(body: InputTokensRequest) -> dict[str, Any]:
        return await responses.input_tokens(state.serving, state.responses, body)

    @app.get("/v1/models", response_model=ModelList, responses={401: _ERRORS[401]})
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_card(name, state) for name in state.serving.model_names]}

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={401: _ERRORS[401],
                                                                                 404: _ERRORS[404]})
    async def get_model(model_id: str) -> dict[str, Any]:
        state.serving.check_model(model_id)
        return _card(model_id, state)

    @app.get("/health", summary="Liveness, queue, and cache statistics by tier")
    async def health() -> JSONResponse:
        body = state.health()
        if state.keys is not None and not config.public_health and tenants.current.get() is None:
            body = {"status": body["status"], "pid": body["pid"]}  # the rest is for key holders
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # The last added runs first: metrics, the browser guard, CORS answers (preflights before
    # the gate asks for a key), the gate.
    app.add_middleware(ApiGate, drain=state.drain, keys=state.keys, max_body_bytes=config.max_body_bytes,
                       public_health=config.public_health, max_active=config.max_inflight_requests,
                       max_body_bytes_held=int(config.max_body_mb_in_flight * 2**20),
                       body_timeout_s=config.body_timeout, max_active_per_key=config.max_inflight_per_key)
    if config.origins():
        app.add_middleware(CORSMiddleware, allow_origins=config.origins(), allow_methods=["GET", "POST"],
                           allow_headers=["*"], max_age=600)
    app.add_middleware(BrowserGuard, bind_host=config.host, allowed_hosts=config.host_names(),
                       allowed_origins=config.origins())
    app.add_middleware(RequestMetrics, metrics=state.metrics)
    return app


def _card(name: str, state: ServerState) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": state.serving.created, "owned_by": "kvcellar"}

