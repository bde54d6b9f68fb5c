"""Grammar-constrained decoding: a per-sequence token mask from llguidance.

A request that must produce text of a given shape (a JSON schema, any JSON object, a tool
call) carries a ``Grammar``: a grammar compiled and validated once for this engine's
tokenizer, when the request arrives (so an impossible schema is a 400 before anything is
queued). Each engine sequence built from it gets its own ``TokenConstraint`` (the matcher's
state). In the sampling step the engine asks the constraint for the allowed tokens of that
row only: sequences without a grammar pay nothing, and constrained ones stay in the same
continuously batched step as everyone else.

Why llguidance (measured on this 2-core CPU, SmolLM2's 49k vocabulary, a weather-tool
schema with an enum, an integer range and a nested object; see docs/structured-outputs.md):
compile 1.5 ms (xgrammar 1.1 ms after a 9.5 ms first), mask per token 0.05 ms median,
2.6 ms worst (xgrammar 0.003 / 0.24 ms): both are far below a 60 ms decode step. llguidance
wins on what we need besides speed: Lark grammars with inline JSON schemas and special-token
references (tool-call markup of every model family), a dependency-free wheel (xgrammar pulls
triton and a TVM runtime), and it is what llama.cpp and vLLM ship.

Threading: ``GrammarCompiler`` is thread-safe (the server compiles on its tokenizer thread);
a ``TokenConstraint`` belongs to one sequence and is used only by the engine thread.
"""

from __future__ import annotations

import collections
import hashlib
import json
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvcellar.engine.grammar_planner import Planner
from kvcellar.errors import InvalidRequestError
from kvcellar.stats import Stats, counter

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared in llguidance's stub only

# JSON is written the way json.dumps writes it (", " and ": "), with no free whitespace:
# small models given free whitespace can emit newlines until max_tokens.
JSON_STYLE: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The same, where a keyword the engine does not implement (``not``, ``uniqueItems``, ``if``...)
# constrains nothing instead of failing the compile: tool schemas, whose every other keyword holds.
LENIENT_JSON_STYLE: JsonCompileOptions = {**JSON_STYLE, "lenient": True}
_CACHE_SIZE = 256
# What the compiled grammars kept may hold in all (their sources; a request's schema can be
# megabytes, and distinct schemas are what any client can send).
_CACHE_BYTES = 64 << 20
# Budget steering (TokenConstraint, Planner).
_PLAN_CAP = 2048  # the longest start plan min_tokens looks for
_PLAN_EXTRA_NODES = 64  # masks a start-plan search may spend improving its first completion
_PLAN_BRANCH = 3  # alternatives it tries at each choice
_MIN_JUMP = 32  # the least the checked zone assumes one token may add to the plan's length
_ALTERNATIVES = 2  # the model's next best tokens tried when its pick cannot end in time


@dataclass(frozen=True)
class Grammar:
    """A validated llguidance grammar for one tokenizer (immutable, shareable)."""

    source: str  # llguidance's serialized grammar
    description: str  # for logs: "json_schema", "tool_call", ...
    # Steer toward the end when max_tokens runs short (see TokenConstraint). Off for
    # grammars of free text with constrained islands, which accept after every token.
    steer_to_end: bool = True


@dataclass
class GrammarStats(Stats):
    PREFIX: ClassVar[str] = "grammar_"
    compiled: int = counter()
    cache_hits: int = counter()
    compile_seconds: float = counter(0.0)


class GrammarCompiler:
    """Compiles JSON schemas and Lark grammars for one tokenizer; caches by source text."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._lltok: Any = None
        self._planner: Planner | None = None
        self._lock = threading.Lock()
        # Keyed by the source's digest: a key does not hold a second copy of a large source.
        self._cache: collections.OrderedDict[bytes, Grammar] = collections.OrderedDict()
        self._cache_bytes = 0
        self._plans: collections.OrderedDict[bytes, tuple[int, ...] | None] = collections.OrderedDict()
        self.stats = GrammarStats()

    def prepare(self) -> None:
        """Build llguidance's view of the tokenizer (~0.5 s): done once, by the warm-up or
        else by the first constrained request."""
        self._tokenizer()

    @property
    def prepared(self) -> bool:
        return self._lltok is not None

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._lltok is None:
                import llguidance.hf

                lltok = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None)
                self._planner = Planner(lltok, self.vocab_size)
                self._lltok = lltok
            return self._lltok

    def json_schema(self, schema: dict[str, Any], *, param: str, lenient: bool = False) -> Grammar:
        """A grammar for JSON text matching ``schema``; errors name ``param``. ``lenient``:
        keywords llguidance does not implement are not enforced (``LENIENT_JSON_STYLE``)."""
        import llguidance

        try:
            source = llguidance.LLMatcher.grammar_from_json_schema(
                schema, overrides=LENIENT_JSON_STYLE if lenient else JSON_STYLE)
        except ValueError as exc:
            raise InvalidRequestError(f"Invalid schema for '{param}': {exc}", param=param) from None
        return self._compile(source, "json_schema", param)

    def lark(self, lark: str, *, param: str, description: str, steer_to_end: bool = True) -> Grammar:
        import llguidance

        return self._compile(llguidance.LLMatcher.grammar_from_lark(lark), description, param, steer_to_end)

    def after(self, prefix: str, grammar: Grammar) -> Grammar:
        """``grammar`` with the literal text ``prefix`` first (a thinking model's empty
        reasoning block closed before a forced output)."""
        try:  # llguidance takes a serialized grammar list or plain Lark text
            top = json.loads(grammar.source)
        except ValueError:
            top = {"grammars": [{"lark_grammar": grammar.source}]}
        body = top["grammars"]
        name = body[0].setdefault("name", "kvcellar_body")
        start = {"lark_grammar": f"start: {json.dumps(prefix)} @{name}"}
        source = json.dumps({**top, "grammars": [start, *body]})
        return self._compile(source, grammar.description, "", grammar.steer_to_end)

    def _compile(self, source: str, description: str, param: str, steer_to_end: bool = True) -> Grammar:
        import time

        import llguidance

        key = _digest(f"{int(steer_to_end)}{source}")
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                return hit
        lltok = self._tokenizer()
        t0 = time.perf_counter()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, lltok)
        if is_error:
            detail = messages[0] if messages else "unknown error"
            raise InvalidRequestError(f"Invalid schema for '{param}': the grammar engine cannot compile it "
                                      f"({detail.strip()}).", param=param, code="invalid_schema")
        grammar = Grammar(source, description, steer_to_end)
        with self._lock:
            self.stats.compiled += 1
            self.stats.compile_seconds += time.perf_counter() - t0
            if key not in self._cache and len(source) <= _CACHE_BYTES:
                self._cache[key] = grammar
                self._cache_bytes += len(source)
            while len(self._cache) > _CACHE_SIZE or self._cache_bytes > _CACHE_BYTES:
                self._cache_bytes -= len(self._cache.popitem(last=False)[1].source)
        return grammar

    @property
    def cached_bytes(self) -> int:
        """The bytes of grammar sources kept for reuse (at most ``_CACHE_BYTES``)."""
        return self._cache_bytes

    def constraint(self, grammar: Grammar, max_tokens: int) -> TokenConstraint:
        """A fresh matcher state for one sequence that may generate ``max_tokens``."""
        matcher = self._matcher(grammar)
        assert self._planner is not None
        if not grammar.steer_to_end:
            return TokenConstraint(matcher, self._planner, None)
        return TokenConstraint(matcher, self._planner, max_tokens, self.start_plan(grammar))

    def min_tokens(self, grammar: Grammar, limit: int) -> int | None:
        """The fewest tokens in which this engine ends an output of ``grammar``: the length
        of its start plan (see ``start_plan``), or None if that is more than ``limit`` (or
        no completion was found at all within ``_PLAN_CAP`` tokens).

        Contract, for the server: with ``max_tokens >= M`` (``M = min_tokens(grammar, big)``)
        a sequence of this grammar ends with output the grammar accepts (finish_reason
        ``stop``), whatever the model picks; with ``max_tokens < M`` no such output is
        guaranteed (the output follows the plan and is cut), so refuse the request up
        front: ``if compiler.min_tokens(grammar, max_tokens) is None`` -> 400 "max_tokens N
        is too small for this tool call / schema: it needs at least M tokens" (M from a
        second call with a large ``limit``). Check the budget the engine will really use
        (``Engine.fit_max_tokens`` may lower it to the context's room).

        M is an upper bound on the true minimum (a heuristic search: forced markup and keys,
        then the shortest values; the tokenizer's own merges), deterministic and cached, so
        ``min_tokens(g, M - 1)`` is None and ``min_tokens(g, M) == M``. 0 for grammars that
        do not steer (``auto`` tool calls: free text). The first call per grammar searches
        (1-10 ms on the 49k-token SmolLM2 vocabulary for tool calls and nested schemas);
        later calls are a dict lookup. Thread-safe.
        """
        if not grammar.steer_to_end:
            return 0
        plan = self.start_plan(grammar)
        return len(plan) if plan is not None and len(plan) <= limit else None

    def start_plan(self, grammar: Grammar) -> tuple[int, ...] | None:
        """The shortest completion of ``grammar`` from its start that the planner finds
        (token ids), or None if none within ``_PLAN_CAP`` tokens; cached per grammar."""
        key = _digest(grammar.source)
        with self._lock:
            if key in self._plans:
                self._plans.move_to_end(key)
                return self._plans[key]
        matcher = self._matcher(grammar)
        assert self._planner is not None
        found = self._planner.search(matcher, _PLAN_CAP, extra_nodes=_PLAN_EXTRA_NODES, branch=_PLAN_BRANCH)
        plan = tuple(found) if found is not None else None
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > _CACHE_SIZE:
                self._plans.popitem(last=False)
        return plan

    def _matcher(self, grammar: Grammar) -> Any:
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer(), grammar.source, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"The grammar could not be instantiated: {matcher.get_error()}")
        return matcher


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=20).digest()


class TokenConstraint:
    """One sequence's position in its grammar, and its plan to end within ``max_tokens``.

    A grammar guarantees the shape of a *finished* output; a small model can still loop (one
    more array item, one more tool call, a string that never closes) until ``max_tokens``
    cuts the JSON in half. So, when steering, the constraint keeps a **plan**: a completion
    of the grammar from the current state, the shortest ``Planner.search`` finds, and keeps
    the invariant *the plan fits in the budget left*. Whatever the model picks, the output
    then ends accepted (finish_reason ``stop``) whenever the start plan fits in
    ``max_tokens`` (``GrammarCompiler.min_tokens``):

    * ``mask`` is the grammar's mask, except with no slack left (the budget left equals the
      plan's length): then only the plan's next token is allowed, so the output follows the
      plan to its accepting end (closing strings, filling required keys with the shortest
      values);
    * ``choose`` (called by the sampler with the token it picked) keeps the invariant: in the
      *checked zone* (slack at most ``reserve`` plus the most one token may add to the plan,
      e.g. a new parallel call), a token is kept only if the output can still end within
      the budget after it (the plan so far if it still applies, typically inside a string,
      else a new search), else the model's next best token that can, else the plan's next
      token;
    * farther from the end nothing is checked or searched per token: the plan is looked
      for again only now and then (whenever an eighth of the slack is spent), so the cost
      per token is the mask's, as without steering;
    * at an accepting point (e.g. after a complete tool call) the output ends when what is
      left is less than the longest stretch between accepting points so far plus the
      reserve: it never starts a call it is unlikely to finish.

    Below the start plan's length nothing can be guaranteed: the output follows the plan
    and is cut by ``max_tokens`` (the server refuses such requests up front). The one
    assumption: outside the checked zone a single token does not add more than its width
    (``max(32, 2 * the start plan, 2 * the largest addition seen)``) to the plan, e.g. an
    array item whose required fields take more tokens than that, opened exactly there.
    Tokens emitted without ``choose`` (a caller that only masks) are not checked either.

    Engine thread only.
    """

    def __init__(self, matcher: Any, planner: Planner, max_tokens: int | None,
                 plan: Sequence[int] | None = None) -> None:
        """``max_tokens``: the sequence's budget to steer within; None: no steering.
        ``plan``: a completion of the grammar from its start (the compiler's cached start
        plan), or None to search for one when due."""
        self._matcher = matcher
        self._planner = planner
        self._steer = max_tokens is not None
        self._max_tokens = max_tokens or 0
        self.reserve = min(64, max(12, self._max_tokens // 5))
        self._generated = 0
        self._last_accepting = 0
        self._longest_stretch = 0
        # A completion from the current state (None: unknown since the model left it; looked
        # for again once the budget left is down to ``_check_at``).
        self._plan: list[int] | None = list(plan) if plan is not None and self._steer else None
        # What one token may add to the plan's length, assumed: it sizes the checked zone.
        self._jump = max(_MIN_JUMP, 2 * len(self._plan or ()))
        self._check_at = self._max_tokens
        if self._plan is not None:
            self._schedule(self._max_tokens, len(self._plan))
        self._checked: dict[int, list[int] | None] = {}  # this step: token -> completion after it
        self._checked_at = -1

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[vocab]`` with the tokens the grammar forbids next set to -inf (a new
        tensor: the model's logits are inference-mode tensors and stay as they are)."""
        bias = self._matcher.compute_logit_bias()  # one byte per token: 0 = forbidden
        allowed = torch.zeros(logits.shape[-1], dtype=torch.bool)
        n = min(logits.shape[-1], len(bias))  # logits past the tokenizer's ids stay forbidden
        allowed[:n] = torch.frombuffer(bytearray(bias[:n]), dtype=torch.uint8) != 0
        if self._steer:
            forced = self._begin_step()
            if forced is not None and forced < n and bool(allowed[forced]):
                allowed = torch.zeros_like(allowed)
                allowed[forced] = True
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def choose(self, token_id: int, logits: torch.Tensor) -> int:
        """The token to emit instead of ``token_id`` (picked from ``logits``, this step's
        masked logits), if the output could not end within ``max_tokens`` after it: the best
        token by ``logits`` after which it can, or the plan's next token. ``token_id`` itself
        almost always (far from the end: without checking)."""
        left = self._max_tokens - self._generated
        plan = self._plan
        if not self._steer or plan is None or self._checked_at != self._generated or left <= 0:
            return token_id
        if left - len(plan) > self.reserve + self._jump or (plan and token_id == plan[0]):
            return token_id
        if self._completion_after(token_id, left - 1) is not None:
            return token_id
        values, ids = torch.topk(logits.detach().to("cpu", torch.float32), min(_ALTERNATIVES + 1, logits.numel()))
        alternatives: list[int] = [t for v, t in zip(values.tolist(), ids.tolist(), strict=True)
                                   if v != float("-inf") and t != token_id][:_ALTERNATIVES]
        for token in alternatives:
            if self._completion_after(token, left - 1) is not None:
                return token
        if plan:
            return plan[0]
        for eos in self._planner.eos:  # accepting: ending keeps it so
            if self._completion_after(eos, left - 1) is not None:
                return eos
        return token_id

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``. False if the grammar forbids it (the sequence must end)."""
        ok = bool(self._matcher.consume_token(token_id))
        left = self._max_tokens - self._generated  # before this token
        if ok and self._steer:
            plan = self._plan
            after = self._checked.get(token_id) if self._checked_at == self._generated else None
            if after is not None:
                self._plan = after
            elif plan and plan[0] == token_id:
                self._plan = plan[1:]
            else:  # the model left the plan (far from the end): look again when due
                self._plan = None
                if plan is not None:
                    self._schedule(left, len(plan))
            if plan is not None and self._plan is not None:
                self._jump = max(self._jump, 2 * (len(self._plan) - len(plan) + 1))
        self._checked = {}
        self._generated += 1
        if ok and self._matcher.is_accepting():
            self._longest_stretch = max(self._longest_stretch, self._generated - self._last_accepting)
            self._last_accepting = self._generated
        return ok

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` the grammar allows next, in order (the state is unchanged)."""
        return int(self._matcher.validate_tokens(tokens))

    @property
    def finished(self) -> bool:
        """End the output now: nothing but the end may follow, or it is complete and the
        budget left would likely not hold another complete stretch."""
        if self._matcher.is_stopped():
            return True
        if not self._steer or not self._matcher.is_accepting():
            return False
        return self._max_tokens - self._generated < self._longest_stretch + self.reserve

    @property
    def accepting(self) -> bool:
        """The output so far is a complete output of the grammar."""
        return bool(self._matcher.is_accepting())

    @property
    def plan_length(self) -> int | None:
        """Tokens of the current plan to the grammar's end (None: not known right now)."""
        return None if self._plan is None else len(self._plan)

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())

    # ---- steering ---------------------------------------------------------------------------

    def _schedule(self, left: int, plan_length: int) -> None:
        """When to look for a plan again, should the model leave this one: once an eighth of
        the slack beyond the checked zone is spent (at once within it)."""
        gap = left - plan_length - self.reserve - self._jump
        self._check_at = left - gap // 8 if gap > 0 else left

    def _begin_step(self) -> int | None:
        """Refresh the plan if due; the one token allowed if there is no slack left."""
        self._checked = {}
        self._checked_at = self._generated
        left = self._max_tokens - self._generated
        if left <= 0:
            return None
        if self._plan is None:
            if left > self._check_at:
                return None
            self._plan = self._planner.search(self._matcher.deep_copy(), left + self.reserve + self._jump)
            if self._plan is None:  # no end within reach: nothing to steer toward
                self._check_at = 0
                return None
            self._schedule(left, len(self._plan))
        plan = self._plan
        if plan and left <= len(plan):  # no slack (none from the start: follow the plan anyway)
            self._checked[plan[0]] = plan[1:]
            return plan[0]
        return None

    def _completion_after(self, token: int, limit: int) -> list[int] | None:
        """A completion of at most ``limit`` tokens after ``token`` (None: none found),
        remembered for this step."""
        if token in self._checked:
            return self._checked[token]
        found = self._search_after(token, limit)
        self._checked[token] = found
        return found

    def _search_after(self, token: int, limit: int) -> list[int] | None:
        m = self._matcher.deep_copy()
        if not m.consume_token(token):
            return None
        if m.is_accepting():
            return []
        plan = self._plan
        if plan and token == plan[0]:
            return plan[1:]
        if plan and len(plan) <= limit:  # the plan still ends it (typically inside a string)
            probe = m.deep_copy()
            for i, t in enumerate(plan):
                if not probe.consume_token(t):
                    break
                if probe.is_accepting():
                    return plan[:i + 1]
        return self._planner.search(m, limit)


def dumps_schema(schema: Any) -> str:
    """Canonical JSON of a schema (cache keys, Lark ``%json`` bodies)."""
    return json.dumps(schema, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
