"""Chat and legacy completions: request -> engine sequences -> response or stream.

Order of work for every request: check the model name and the parameters kvcellar cannot
honour; render and tokenize the prompt (on one dedicated thread: HF tokenizers carry
mutable state and must not be used by two threads at once); check every prompt against the
context before submitting anything; submit ``n`` choices per prompt; then either collect
the whole response or stream it.

A streamed response starts (status 200) only once the first token exists, so that a
first-token timeout or an immediate failure can still be a proper 504/4xx/5xx. After that,
failures are sent in-stream as ``data: {"error": {...}}`` followed by ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from kvcellar.engine import Engine, SamplingParams, TokenEvent
from kvcellar.engine.constraints import Grammar
from kvcellar.engine.tokenization import encode_chat, encode_prompt
from kvcellar.errors import InvalidRequestError
from kvcellar.server import errors
from kvcellar.server.config import ServerConfig
from kvcellar.server.formatting import RequestShape, ResponseBuilder, TokenTexts
from kvcellar.server.generation import Generation, GenerationTimeout, Inflight, Timeouts
from kvcellar.server.metrics import ServerMetrics
from kvcellar.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, ResponseFormat
from kvcellar.server.streaming import DONE, ClientDisconnected, SSEResponse, sse, until_disconnect
from kvcellar.server.tools.grammar import auto_call_grammar, forced_call_grammar
from kvcellar.server.tools.render import ToolPrompting
from kvcellar.server.tools.request import ToolPlan, check_tool_messages, plan_tools, response_schema

log = logging.getLogger("kvcellar.server")

T = TypeVar("T")
Events = AsyncIterator[tuple[int, TokenEvent]]


_SURROGATE = re.compile("[\ud800-\udfff]")


def find_invalid_text(obj: Any, path: str = "") -> str | None:
    """The path of the first string holding a lone UTF-16 surrogate (JSON lets ``"\\ud800"``
    through; no tokenizer can encode it), or None."""
    if isinstance(obj, str):
        return (path or "body") if _SURROGATE.search(obj) else None
    if isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(key, str) and _SURROGATE.search(key):
                return path or "body"  # never echo the bad text itself
            if found := find_invalid_text(value, f"{path}.{key}" if path else str(key)):
                return found
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            if found := find_invalid_text(value, f"{path}[{i}]"):
                return found
    return None


def check_text(req: BaseModel) -> None:
    bad = find_invalid_text(req.model_dump(exclude_none=True))
    if bad is not None:
        raise errors.invalid(f"Invalid value for '{bad}': the text is not valid Unicode (it holds a lone UTF-16 "
                             "surrogate escape such as \\ud800).", param=bad, code="invalid_value")


class OpenAIServing:
    def __init__(self, engine: Engine, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.model_name = engine.loaded.name
        self.model_names = [self.model_name, *config.model_aliases()]
        self.created = int(time.time())
        self.fingerprint = "fp_" + engine.fingerprint[:12]
        self.tokens = TokenTexts(engine.tokenizer)
        self.inflight = Inflight()
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="kvcellar-tokenize")
        self.tool_prompting = ToolPrompting.probe(engine.tokenizer)
        # llguidance's view of the tokenizer takes ~0.5 s: build it before the first
        # constrained request needs it (on the same thread that compiles grammars).
        self._tokenizer_thread.submit(engine.grammars.prepare)

    def close(self) -> None:
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    # ---- request translation ------------------------------------------------------------

    def check_model(self, name: str) -> None:
        if name not in self.model_names:
            raise errors.APIError(404, f"The model '{name}' does not exist. This server serves: "
                                  f"{', '.join(self.model_names)}.", param="model", code="model_not_found")

    async def _on_tokenizer_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._tokenizer_thread, lambda: fn(*args, **kwargs))
        except UnicodeError as exc:  # check_text should have caught it; never a 500 for bad text
            raise errors.invalid(f"The request holds text that cannot be encoded: {exc}") from None

    def _room(self, prompt_len: int) -> int:
        """Default max_tokens: whatever the context (and the KV pool) leaves."""
        pool_tokens = self.engine.pool_tokens
        return max(1, min(self.engine.max_model_len, pool_tokens) - prompt_len)

    def _timeouts(self, req: ChatCompletionRequest | CompletionRequest) -> Timeouts:
        return Timeouts(min(self.config.first_token_timeout, req.first_token_timeout or math.inf),
                        min(self.config.inter_token_timeout, req.inter_token_timeout or math.inf))

    def _choice_count(self, req: ChatCompletionRequest | CompletionRequest, num_prompts: int) -> int:
        n = req.n or 1
        if n * num_prompts > self.config.max_choices:
            raise errors.invalid(f"This server returns at most {self.config.max_choices} choices per request "
                                 f"(n={n} x {num_prompts} prompt(s)).", param="n", code="invalid_value")
        return n

    @staticmethod
    def _common_checks(req: ChatCompletionRequest | CompletionRequest) -> None:
        if req.logit_bias:
            raise errors.invalid("logit_bias is not supported by this server.", param="logit_bias",
                                 code="unsupported_parameter")

    @staticmethod
    def _params(req: ChatCompletionRequest | CompletionRequest, max_tokens: int, logprobs: bool,
                top_logprobs: int) -> SamplingParams:
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k if req.top_k and req.top_k > 0 else 0,
            seed=req.seed,
            stop=stop,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=bool(req.ignore_eos),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            skip_special_tokens=True if req.skip_special_tokens is None else req.skip_special_tokens,
        )

    @staticmethod
    def _per_choice(params: SamplingParams, n: int) -> list[SamplingParams]:
        """With a seed s, choice i samples with seed s + i (reproducible, yet different)."""
        if params.seed is None:
            return [params] * n
        return [dataclasses.replace(params, seed=params.seed + i) for i in range(n)]

    @staticmethod
    def _message(m: ChatMessage, i: int) -> dict[str, Any]:
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise errors.invalid(f"Only text content parts are supported (got type '{part.type}').",
                                         param=f"messages[{i}].content[{j}]", code="unsupported_content")
                texts.append(part.text)
            content = "\n".join(texts)
        out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.name is not None:
            out["name"] = m.name
        if m.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            out["tool_call_id"] = m.tool_call_id
        return out

    # ---- endpoints ----------------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest, receive: Receive) -> Response:
        check_text(req)
        self.check_model(req.model)
        self._common_checks(req)
        if req.top_logprobs and not req.logprobs:
            raise errors.invalid("top_logprobs requires logprobs to be true.", param="top_logprobs")
        n = self._choice_count(req, 1)
        check_tool_messages(req.messages)
        tools = plan_tools(req)
        messages = [self._message(m, i) for i, m in enumerate(req.messages)]
        messages, template_kwargs = self.tool_prompting.prepare(messages, tools.tools if tools else None)
        prompt = await self._on_tokenizer_thread(encode_chat, self.engine.tokenizer, messages, **template_kwargs)
        grammar = await self._on_tokenizer_thread(self._chat_grammar, req.response_format, tools)
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self._params(req, limit if limit is not None else self._room(len(prompt)),
                              bool(req.logprobs), req.top_logprobs or 0)
        parse_calls = tools is not None and tools.choice != "none"
        if parse_calls and req.skip_special_tokens is None and self.tool_prompting.markup_is_special:
            params.skip_special_tokens = False  # the call markup is made of special tokens: keep it to parse
        params.grammar = grammar
        shape = RequestShape("chat", req.model, self.fingerprint, n, 1, bool(req.logprobs), req.top_logprobs or 0,
                             bool(req.stream and req.stream_options and req.stream_options.include_usage),
                             tool_parser=self.tool_prompting.parser_factory(tools) if parse_calls else None)
        return await self._run(shape, [prompt], self._per_choice(params, n), req, receive)

    def _chat_grammar(self, fmt: ResponseFormat | None, tools: ToolPlan | None) -> Grammar | None:
        """Forced tool calls win over ``response_format`` (the output is the calls), which
        wins over keeping ``auto`` calls well-formed."""
        family = self.tool_prompting.family
        if tools is not None and tools.forced:
            return forced_call_grammar(self.engine.grammars, family, tools.forced_tools,
                                       parallel=tools.parallel and tools.choice == "required",
                                       mistral_token_id=self.tool_prompting.mistral_token_id)
        if fmt is None and tools is not None and tools.choice == "auto":
            return auto_call_grammar(self.engine.grammars, family, tools.tools)
        return self._format_grammar(fmt)

    def _format_grammar(self, fmt: ResponseFormat | None) -> Grammar | None:
        schema = response_schema(fmt)
        if schema is None:
            return None
        param = "response_format" if fmt is None or fmt.type == "json_object" else "response_format.json_schema.schema"
        return self.engine.grammars.json_schema(schema, param=param)

    async def completions(self, req: CompletionRequest, receive: Receive) -> Response:
        check_text(req)
        self.check_model(req.model)
        self._common_checks(req)
        if req.suffix:
            raise errors.invalid("suffix is not supported by this server.", param="suffix",
                                 code="unsupported_parameter")
        if req.echo and req.logprobs is not None:
            raise errors.invalid("echo together with logprobs (prompt logprobs) is not supported.", param="echo",
                                 code="unsupported_parameter")
        raw = req.prompt
        if isinstance(raw, str):
            raw_prompts: list[str | list[int]] = [raw]
        elif raw and isinstance(raw[0], int):
            raw_prompts = [list(raw)]  # type: ignore[arg-type]
        else:
            raw_prompts = list(raw)  # type: ignore[arg-type]
        n = self._choice_count(req, len(raw_prompts))
        if req.best_of is not None and req.best_of != n:
            raise errors.invalid("best_of is supported only equal to n.", param="best_of",
                                 code="unsupported_parameter")
        prompts: list[list[int]] = []
        for p in raw_prompts:
            prompts.append(await self._on_tokenizer_thread(encode_prompt, self.engine.tokenizer, p)
                           if isinstance(p, str) else p)
        echo_texts = None
        if req.echo:
            echo_texts = [p if isinstance(p, str) else await self._on_tokenizer_thread(
                self.engine.tokenizer.decode, p) for p in raw_prompts]
        logprobs = req.logprobs is not None
        params = self._params(req, req.max_tokens if req.max_tokens is not None else 16, logprobs,
                              req.logprobs or 0)
        params.grammar = await self._on_tokenizer_thread(self._format_grammar, req.response_format)
        shape = RequestShape("completion", req.model, self.fingerprint, n, len(prompts), logprobs, req.logprobs or 0,
                             bool(req.stream and req.stream_options and req.stream_options.include_usage),
                             echo_texts)
        return await self._run(shape, prompts, self._per_choice(params, n), req, receive)

    # ---- running ------------------------------------------------------------------------

    async def _run(self, shape: RequestShape, prompts: Sequence[list[int]], params: list[SamplingParams],
                   req: ChatCompletionRequest | CompletionRequest, receive: Receive) -> Response:
        if len(self.inflight) >= self.config.max_inflight_requests:
            raise errors.APIError(503, "The server has too many requests in flight; retry later.",
                                  type=errors.SERVER_ERROR, code="overloaded")
        for i, prompt in enumerate(prompts):
            try:
                self.engine.check_length(len(prompt), params[0].max_tokens)
            except InvalidRequestError as exc:
                if exc.param in (None, "messages") and shape.kind == "completion":
                    exc.param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                raise
        builder = ResponseBuilder(shape, self.tokens)
        gen = Generation(self.engine, self.inflight, self._timeouts(req))
        streaming: SSEResponse | None = None
        try:
            gen.submit(prompts, params, req.cache_salt)
            if not req.stream:
                return await until_disconnect(self._collect(gen, builder), receive)
            streaming = await self._start_stream(gen, builder, receive)
            return streaming
        except ClientDisconnected:
            self.metrics.count("server_client_disconnects")
            return Response(status_code=499)  # nobody is listening; keeps the access log honest
        except GenerationTimeout as exc:
            raise self._timed_out(exc) from None
        finally:
            if streaming is None:  # otherwise the stream owns the generation until it ends
                gen.close()
                self._log_done(builder, gen, "stream" if req.stream else "full")

    async def _start_stream(self, gen: Generation, builder: ResponseBuilder, receive: Receive) -> SSEResponse:
        events = gen.events()
        first = await until_disconnect(anext(events), receive)
        self._check_event(first[1])
        self._observe_ttft(gen)

        def on_close(disconnected: bool) -> None:
            gen.close()
            if disconnected:
                self.metrics.count("server_client_disconnects")
            self._log_done(builder, gen, "stream-disconnected" if disconnected else "stream")

        return SSEResponse(self._stream(builder, first, events), on_close)

    def _timed_out(self, exc: GenerationTimeout) -> errors.APIError:
        self.metrics.count(f"server_{exc.kind}_timeouts")
        return errors.timed_out(exc.kind, exc.seconds)

    @staticmethod
    def _check_event(ev: TokenEvent) -> None:
        """Raise for an engine-side end that is not a normal finish."""
        if ev.finish_reason == "abort":  # not ours (ours are filtered out by Generation): shutdown
            raise errors.cancelled_by_shutdown()
        if ev.finish_reason == "error":
            raise errors.APIError(500, f"Generation failed: {ev.error or 'engine error'}", type=errors.SERVER_ERROR)

    async def _collect(self, gen: Generation, builder: ResponseBuilder) -> Response:
        async for index, ev in gen.events():
            self._check_event(ev)
            builder.add(index, ev)
        self._observe_ttft(gen)
        return JSONResponse(builder.response())

    async def _stream(self, builder: ResponseBuilder, first: tuple[int, TokenEvent], rest: Events
                      ) -> AsyncIterator[bytes]:
        try:
            for chunk in builder.stream_start():
                yield sse(chunk)
            for chunk in builder.chunks_for(*first):
                yield sse(chunk)
            async for index, ev in rest:
                self._check_event(ev)
                for chunk in builder.chunks_for(index, ev):
                    yield sse(chunk)
            if builder.shape.include_usage:
                yield sse(builder.usage_chunk())
        except GenerationTimeout as exc:
            yield sse(self._timed_out(exc).body())
        except errors.APIError as exc:
            yield sse(exc.body())
        yield DONE

    def _observe_ttft(self, gen: Generation) -> None:
        if gen.first_event_at is not None:
            self.metrics.ttft_seconds.observe(gen.first_event_at - gen.created)

    def _log_done(self, builder: ResponseBuilder, gen: Generation, mode: str) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        usage = builder.usage()
        ttft = None if gen.first_event_at is None else round((gen.first_event_at - gen.created) * 1000, 1)
        log.info("request finished", extra={"fields": {
            "id": builder.id, "mode": mode, "choices": len(builder.choices),
            "finish": ",".join(str(c.finish_reason) for c in builder.choices),
            "prompt_tokens": usage["prompt_tokens"], "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "completion_tokens": usage["completion_tokens"], "ttft_ms": ttft,
            # where the cached tokens came from (first choice): {"ram": n, "ssd": n, "remote": n}
            "cached_by_tier": builder.choices[0].cached_tokens_by_tier if builder.choices else None,
            "total_ms": round((time.monotonic() - gen.created) * 1000, 1)}})
