"""Running requests: an API's internal request -> engine sequences -> its renderer's response or stream.

``Serving`` is shared by every API front-end (server/internal.py): chat and legacy
completions are adapted here, the Responses and Messages APIs in their own packages.

Order of work for every request: check the model name and the parameters kvcellar cannot
honour; render and tokenize the prompt (on one dedicated thread: HF tokenizers carry
mutable state and must not be used by two threads at once); check every prompt against the
context before submitting anything; submit ``n`` choices per prompt; then either collect
the whole response or stream it.

A streamed response starts (status 200) only once the first token exists, so that a
first-token timeout or an immediate failure can still be a proper 504/4xx/5xx. After that,
failures are sent in-stream in the API's own shape (``Renderer.fail_stream``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from kvcellar.engine import Engine, SamplingParams, TokenEvent
from kvcellar.engine.constraints import Grammar
from kvcellar.engine.tokenization import encode_chat, encode_prompt, generation_prompt_ids, history_length
from kvcellar.errors import InvalidRequestError
from kvcellar.server import errors, tenants
from kvcellar.server.config import ServerConfig
from kvcellar.server.formatting import RequestShape, ResponseBuilder, TokenTexts
from kvcellar.server.generation import Generation, GenerationTimeout, Inflight, Timeouts
from kvcellar.server.internal import InternalRequest, OutputSpec, OutputTracker, Renderer
from kvcellar.server.logs import FirstSeen
from kvcellar.server.metrics import ServerMetrics
from kvcellar.server.middleware import started
from kvcellar.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from kvcellar.server.reasoning import reader_factory, starts_inside, template_markup
from kvcellar.server.streaming import ClientDisconnected, SSEResponse, until_disconnect
from kvcellar.server.tools.grammar import auto_call_grammar, forced_call_grammar, no_call_grammar, parameters_of
from kvcellar.server.tools.parsers import OutputReader, ParsedCall
from kvcellar.server.tools.render import ToolPrompting
from kvcellar.server.tools.request import ToolPlan, check_tool_messages, plan_tools, response_schema
from kvcellar.server.tools.schemas import ArgumentsCheck

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


class Serving:
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
        self._tokenizer_thread = tenants.TurnTaking("kvcellar-tokenize")
        self.tool_prompting = ToolPrompting.probe(engine.tokenizer)
        self.reasons = template_markup(getattr(engine.tokenizer, "chat_template", None))
        # a hybrid model keeps a snapshot where a chat's messages end, before this suffix
        self.generation_prompt = generation_prompt_ids(engine.tokenizer)
        self._unknown_model_logged = FirstSeen()

    def close(self) -> None:
        self._tokenizer_thread.close()

    # ---- shared checks ------------------------------------------------------------------

    def check_model(self, name: str) -> None:
        if name in self.model_names:
            return
        if self.config.serve_any_model:
            if self._unknown_model_logged(name):
                log.info("serving model name %r with %s (serve_any_model is on)", name, self.model_name)
            self.metrics.stats.other_model_names += 1
            return
        raise errors.APIError(404, f"The model '{name}' does not exist. This server serves: "
                              f"{', '.join(self.model_names)}.", param="model", code="model_not_found")

    async def on_tokenizer_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn`` on the one tokenizer thread (the request's CPU work before the engine: off the
        event loop), the tenants' jobs in turn. Within the request's first-token timeout, counted
        from its arrival, and only while its client is there: a job not started yet is dropped
        when either ends."""
        job = asyncio.wrap_future(self._tokenizer_thread.submit(tenants.owner(), lambda: fn(*args, **kwargs)))
        clock = started.get()
        limit = min(self.config.first_token_timeout, (clock and clock.first_token_timeout) or math.inf)
        try:
            if clock is None:
                return await job
            remaining = clock.arrived + limit - time.monotonic()
            return await asyncio.wait_for(until_disconnect(job, clock.receive), timeout=max(remaining, 0.0))
        except TimeoutError:
            self.metrics.stats.first_token_timeouts += 1
            raise errors.APIError(504, f"Timed out after {limit:g} s before the first token, still preparing the "
                                  "request; it was cancelled.", type=errors.SERVER_ERROR,
                                  code="first_token_timeout") from None
        except UnicodeError as exc:  # check_text should have caught it; never a 500 for bad text
            raise errors.invalid(f"The request holds text that cannot be encoded: {exc}") from None

    def _choice_count(self, n: int, num_prompts: int) -> int:
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
        if m.role == "assistant" and m.reasoning_content:
            out["reasoning_content"] = m.reasoning_content
        return out

    # ---- OpenAI chat and legacy completions ---------------------------------------------

    @staticmethod
    def _own_timeout(seconds: float | None) -> None:
        """A request's own first-token timeout bounds its preparation too."""
        clock = started.get()
        if clock is not None and seconds:
            started.set(dataclasses.replace(clock, first_token_timeout=seconds))

    async def chat(self, req: ChatCompletionRequest, receive: Receive) -> Response:
        self._own_timeout(req.first_token_timeout)
        check_text(req)
        self.check_model(req.model)
        self._common_checks(req)
        if req.top_logprobs and not req.logprobs:
            raise errors.invalid("top_logprobs requires logprobs to be true.", param="top_logprobs")
        n = self._choice_count(req.n or 1, 1)
        check_tool_messages(req.messages)
        fmt = req.response_format
        param = "response_format" if fmt is None or fmt.type == "json_object" else "response_format.json_schema.schema"
        schema = await self.on_tokenizer_thread(response_schema, fmt)  # schema checks: off the event loop
        tools = await self.on_tokenizer_thread(plan_tools, req)
        ireq = InternalRequest(
            api="chat", model=req.model, messages=[self._message(m, i) for i, m in enumerate(req.messages)],
            params=self._params(req, 1, bool(req.logprobs), req.top_logprobs or 0),
            max_tokens=req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
            tools=tools, output=OutputSpec(schema=schema, param=param) if schema is not None else None,
            n=n, stream=bool(req.stream), cache_salt=req.cache_salt,
            first_token_timeout=req.first_token_timeout, inter_token_timeout=req.inter_token_timeout,
            explicit_skip_special=req.skip_special_tokens is not None)
        prepared = await self.prepare_chat(ireq)
        shape = RequestShape("chat", req.model, self.fingerprint, n, 1, bool(req.logprobs), req.top_logprobs or 0,
                             bool(req.stream and req.stream_options and req.stream_options.include_usage),
                             tool_parser=prepared.tool_parser)
        return await self.run(ResponseBuilder(shape, self.tokens), [prepared.prompt],
                              self._per_choice(prepared.params, n), ireq, receive)

    async def completions(self, req: CompletionRequest, receive: Receive) -> Response:
        self._own_timeout(req.first_token_timeout)
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
            raw_prompts = [list(raw)]
        else:
            raw_prompts = list(raw)  # type: ignore[arg-type]  # list[str] or list[list[int]]: raw[0] is no int
        n = self._choice_count(req.n or 1, len(raw_prompts))
        if req.best_of is not None and req.best_of != n:
            raise errors.invalid("best_of is supported only equal to n.", param="best_of",
                                 code="unsupported_parameter")
        prompts: list[list[int]] = []
        for p in raw_prompts:
            prompts.append(await self.on_tokenizer_thread(encode_prompt, self.engine.tokenizer, p)
                           if isinstance(p, str) else p)
        echo_texts = None
        if req.echo:
            echo_texts = [p if isinstance(p, str) else await self.on_tokenizer_thread(
                self.engine.tokenizer.decode, p) for p in raw_prompts]
        logprobs = req.logprobs is not None
        params = self._params(req, req.max_tokens if req.max_tokens is not None else 16, logprobs,
                              req.logprobs or 0)
        params.stop = self.with_default_stops(params.stop)
        params.grammar = await self.on_tokenizer_thread(self._schema_grammar, response_schema(req.response_format),
                                                        "response_format")
        shape = RequestShape("completion", req.model, self.fingerprint, n, len(prompts), logprobs, req.logprobs or 0,
                             bool(req.stream and req.stream_options and req.stream_options.include_usage),
                             echo_texts)
        ireq = InternalRequest(api="completion", model=req.model, messages=[], params=params, n=n,
                               stream=bool(req.stream), cache_salt=req.cache_salt,
                               first_token_timeout=req.first_token_timeout,
                               inter_token_timeout=req.inter_token_timeout)
        for i, prompt in enumerate(prompts):
            try:
                self.engine.fit_max_tokens(len(prompt), params.max_tokens)
            except InvalidRequestError as exc:
                exc.param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                raise
        return await self.run(ResponseBuilder(shape, self.tokens), prompts, self._per_choice(params, n), ireq,
                              receive)

    # ---- shared by every chat-like API ---------------------------------------------------

    def with_default_stops(self, stop: tuple[str, ...]) -> tuple[str, ...]:
        return stop + tuple(s for s in self.config.default_stops() if s not in stop)

    async def render_prompt(self, ireq: InternalRequest) -> list[int]:
        """The request's messages and tools rendered with the model's template, tokenized."""
        messages, template_kwargs = self.tool_prompting.prepare(
            ireq.messages, ireq.tools.tools if ireq.tools else None)
        return await self.on_tokenizer_thread(encode_chat, self.engine.tokenizer, messages, **template_kwargs)

    async def prepare_chat(self, ireq: InternalRequest) -> PreparedChat:
        """Prompt tokens, sampling params (grammar and max_tokens set) and the call parser."""
        prompt = await self.render_prompt(ireq)
        ireq.history_tokens = history_length(prompt, self.generation_prompt)
        tools = ireq.tools
        params = dataclasses.replace(ireq.params)
        params.stop = self.with_default_stops(params.stop)
        # No max_tokens: whatever room the context leaves (fit_max_tokens clamps to it). Checked
        # before the grammar is compiled: a prompt that cannot fit costs no compile.
        requested = ireq.max_tokens if ireq.max_tokens is not None else self.engine.max_model_len
        try:
            params.max_tokens = self.engine.fit_max_tokens(len(prompt), requested)
        except InvalidRequestError as exc:
            exc.param = "input" if ireq.api == "responses" else "messages"
            raise
        params.grammar = await self.on_tokenizer_thread(self._chat_grammar, ireq.output, tools)
        markup = self.reasons
        inside = markup is not None and starts_inside(
            await self.on_tokenizer_thread(self.engine.tokenizer.decode, prompt[-8:]), markup)
        if inside and markup is not None and params.grammar is not None and params.grammar.steer_to_end:
            # A forced output (a call, a schema) closes the reasoning block first; free text
            # with well-formed calls (``auto``) may reason.
            params.grammar = await self.on_tokenizer_thread(self.engine.grammars.after, markup.empty_close,
                                                            params.grammar)
        if params.grammar is not None:
            await self.on_tokenizer_thread(self._check_room_for_grammar, params.grammar, params.max_tokens, ireq)
        parse_calls = tools is not None and tools.choice != "none"
        if parse_calls and not ireq.explicit_skip_special and self.tool_prompting.markup_is_special:
            params.skip_special_tokens = False  # the call markup is made of special tokens: keep it to parse
        parser: Callable[[], OutputReader] | None = self.tool_prompting.parser_factory(
            tools, self._arguments_check(tools)) if parse_calls and tools else None
        if self.tool_prompting.harmony:  # channels (reasoning), content and calls are all markup
            if not ireq.explicit_skip_special:
                params.skip_special_tokens = False
            if parser is None:
                parser = self.tool_prompting.parser_factory(None)
        elif markup is not None:
            if not ireq.explicit_skip_special and self._think_is_special:
                params.skip_special_tokens = False
            parser = reader_factory(bool(inside), parser, markup)
        return PreparedChat(prompt, params, parser, parallel_calls=tools is None or tools.parallel)

    @functools.cached_property
    def _think_is_special(self) -> bool:
        """The reasoning tags are special tokens, which plain detokenizing drops."""
        markup = self.reasons
        specials = set(getattr(self.engine.tokenizer, "all_special_tokens", ()))
        return markup is not None and any(special and special in tag for special in specials
                                          for tag in (markup.open, markup.close))

    def _arguments_check(self, tools: ToolPlan) -> Callable[[list[ParsedCall]], None] | None:
        """For forced calls: each call's arguments checked against its tool's full schema. The
        grammar enforces all but a few keywords (tools/schemas.py); a call that breaks one is
        still the model's answer (its arguments may already be streamed), logged and counted."""
        if not tools.forced:
            return None
        check = ArgumentsCheck({t["function"]["name"]: parameters_of(t) for t in tools.forced_tools})
        stats = self.metrics.stats

        def on_finish(calls: list[ParsedCall]) -> None:
            for call in calls:
                stats.tool_arguments_checked += 1
                problem = check.problem(call.name, call.arguments)
                if problem is not None:
                    stats.tool_arguments_invalid += 1
                    log.warning("forced call of %r: its arguments fail the tool's schema %s", call.name, problem)
        return on_finish

    def _check_room_for_grammar(self, grammar: Grammar, max_tokens: int, ireq: InternalRequest) -> None:
        """A forced call or a schema that cannot end within max_tokens is refused up front, not
        cut into broken JSON."""
        compiler = self.engine.grammars
        if compiler.min_tokens(grammar, max_tokens) is not None:
            return
        least = compiler.min_tokens(grammar, 1 << 20)
        what = "this forced tool call" if ireq.tools is not None and ireq.tools.forced else "this output schema"
        need = f"at least {least} tokens" if least is not None else "more tokens than any limit allows"
        param = {"messages": "max_tokens", "responses": "max_output_tokens"}.get(ireq.api, "max_tokens")
        raise errors.invalid(f"max_tokens {max_tokens} is too small for {what}: a complete, valid output needs "
                             f"{need} (the context and --max-completion-tokens bound max_tokens too).",
                             param=param, code="max_tokens_too_small")

    def _chat_grammar(self, output: OutputSpec | None, tools: ToolPlan | None) -> Grammar | None:
        """Forced tool calls win over the output format (the output is the calls), which
        wins over keeping ``auto`` calls well-formed."""
        family = self.tool_prompting.family
        if tools is not None and tools.forced:
            return forced_call_grammar(self.engine.grammars, family, tools.forced_tools,
                                       parallel=tools.parallel and tools.choice == "required",
                                       mistral_token_id=self.tool_prompting.mistral_token_id,
                                       harmony_ids=self.tool_prompting.harmony_ids,
                                       markup_tokens=self.tool_prompting.markup_tokens)
        if output is None and tools is not None and tools.choice == "auto":
            return auto_call_grammar(self.engine.grammars, family, tools.tools, self.tool_prompting.markup_tokens)
        if output is None and tools is not None and tools.choice == "none":
            return no_call_grammar(self.engine.grammars, family)
        if output is not None and output.lark is not None:
            return self.engine.grammars.lark(output.lark, param=output.param, description="custom_tool")
        return self._schema_grammar(output.schema if output else None, output.param if output else "")

    def _schema_grammar(self, schema: dict[str, Any] | None, param: str) -> Grammar | None:
        if schema is None:
            return None
        return self.engine.grammars.json_schema(schema, param=param)

    # ---- running ------------------------------------------------------------------------

    async def run(self, renderer: Renderer, prompts: Sequence[list[int]], params: list[SamplingParams],
                  ireq: InternalRequest, receive: Receive) -> Response:
        if len(self.inflight) >= self.config.max_inflight_requests:
            raise errors.APIError(503, "The server has too many requests in flight; retry later.",
                                  type=errors.SERVER_ERROR, code="overloaded")
        timeouts = Timeouts(min(self.config.first_token_timeout, ireq.first_token_timeout or math.inf),
                            min(self.config.inter_token_timeout, ireq.inter_token_timeout or math.inf))
        gen = Generation(self.engine, self.inflight, timeouts)
        streaming: SSEResponse | None = None
        try:
            clock = started.get()
            gen.submit(prompts, params, tenants.cache_salt(ireq.cache_salt), ireq.history_tokens,
                       None if clock is None else clock.arrived, tenants.owner())
            if not ireq.stream:
                return await until_disconnect(self._collect(gen, renderer), receive)
            streaming = await self._start_stream(gen, renderer, receive)
            return streaming
        except ClientDisconnected:
            self.metrics.stats.client_disconnects += 1
            return Response(status_code=499)  # nobody is listening; keeps the access log honest
        except GenerationTimeout as exc:
            raise self._timed_out(exc) from None
        finally:
            if streaming is None:  # otherwise the stream owns the generation until it ends
                gen.close()
                self._log_done(ireq, renderer, gen, "stream" if ireq.stream else "full")

    async def _start_stream(self, gen: Generation, renderer: Renderer, receive: Receive) -> SSEResponse:
        events = gen.events()
        first = await until_disconnect(anext(events), receive)
        self._check_event(first[1])
        self._observe_ttft(gen)

        def on_close(disconnected: bool) -> None:
            gen.close()
            if disconnected:
                self.metrics.stats.client_disconnects += 1
            self._log_done(None, renderer, gen, "stream-disconnected" if disconnected else "stream")

        return SSEResponse(self._stream(renderer, first, events), on_close)

    def _timed_out(self, exc: GenerationTimeout) -> errors.APIError:
        if exc.kind == "first_token":
            self.metrics.stats.first_token_timeouts += 1
        else:
            self.metrics.stats.inter_token_timeouts += 1
        return errors.timed_out(exc.kind, exc.seconds)

    @staticmethod
    def _check_event(ev: TokenEvent) -> None:
        """Raise for an engine-side end that is not a normal finish."""
        if ev.finish_reason == "abort":  # not ours (ours are filtered out by Generation): shutdown
            raise errors.cancelled_by_shutdown()
        if ev.finish_reason == "error":
            raise errors.APIError(500, f"Generation failed: {ev.error or 'engine error'}", type=errors.SERVER_ERROR)

    async def _collect(self, gen: Generation, renderer: Renderer) -> Response:
        async for index, ev in gen.events():
            self._check_event(ev)
            renderer.add(index, ev)
        self._observe_ttft(gen)
        return JSONResponse(renderer.response())

    async def _stream(self, renderer: Renderer, first: tuple[int, TokenEvent], rest: Events
                      ) -> AsyncIterator[bytes]:
        try:
            for chunk in renderer.open_stream():
                yield chunk
            for chunk in renderer.stream(*first):
                yield chunk
            async for index, ev in rest:
                self._check_event(ev)
                for chunk in renderer.stream(index, ev):
                    yield chunk
            for chunk in renderer.close_stream():
                yield chunk
        except GenerationTimeout as exc:
            for chunk in renderer.fail_stream(self._timed_out(exc)):
                yield chunk
        except errors.APIError as exc:
            for chunk in renderer.fail_stream(exc):
                yield chunk
        except Exception as exc:  # the 200 is sent: the client still gets an error in the stream
            log.error("stream of %s failed", renderer.id, exc_info=exc)
            self.metrics.stats.internal_errors += 1
            for chunk in renderer.fail_stream(errors.from_exception(exc)):
                yield chunk

    def _observe_ttft(self, gen: Generation) -> None:
        if gen.first_event_at is not None:
            self.metrics.ttft_seconds.observe(gen.first_event_at - gen.created)

    def _log_done(self, ireq: InternalRequest | None, renderer: Renderer, gen: Generation, mode: str) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        ttft = None if gen.first_event_at is None else round((gen.first_event_at - gen.created) * 1000, 1)
        log.info("request finished", extra={"fields": {
            "id": renderer.id, "mode": mode, **({"api": ireq.api} if ireq else {}), **renderer.log_fields(),
            "ttft_ms": ttft, "total_ms": round((time.monotonic() - gen.created) * 1000, 1)}})


@dataclasses.dataclass
class PreparedChat:
    prompt: list[int]
    params: SamplingParams
    tool_parser: Callable[[], OutputReader] | None
    parallel_calls: bool = True

    def tracker(self) -> OutputTracker:
        """A fresh reader of one choice's output (the APIs that render blocks use it)."""
        return OutputTracker(self.tool_parser() if self.tool_parser else None,
                             max_calls=(1 << 30) if self.parallel_calls else 1)
