"""The shortest completion of a grammar from a matcher state, over one tokenizer's vocabulary.

``GrammarCompiler.min_tokens`` and ``TokenConstraint``'s steering (engine/constraints.py) ask it
how a JSON output can end soonest: the start plan of a grammar sizes the least ``max_tokens``
of a forced call or schema, and near the budget's end it is the path the output is steered
along. Engine thread and compiler threads alike: it keeps no state between calls.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np

RANKED = 2048  # how many of the planner's preferred tokens it checks first
_CLOSER = 1e4  # the score of a token made of closers (quotes, brackets, spaces)
_QUOTE = 1e3  # added where it holds a quote: the one closer inside a string
# Short texts that end a string value of a JSON Schema ``format`` (each with its closing
# quote), tried wherever no closer is allowed, fewest tokens first. The longest-token walk alone
# never ends some values: a URI's scheme, an e-mail's local part or a duration take any number of
# letters or digits (and an e-mail's may hold braces, which the walk takes for closers), so it
# extends them to the search's cap. Whole values are there where they are shorter than the walk's
# (``face::``), or valid where the walk's are not (its year 0000 is RFC 3339's, not Python's, so
# not jsonschema's).
FORMAT_ENDINGS = ('2000-01-01T00:00:00Z"', '2000-01-01"', '00:00:00Z"', 'P0D"', '::"', ':"', '@a"', 'a"', '0"',
                  '0D"', 'a:"', 'a@a"', '.a"', 'a.a"')

# Closing markup of a value that is free text (the XML tool-call markup's string parameters,
# Gemma 4's strings): tried first wherever it fits, since a free-text value takes any token,
# closers included, and the walk would extend it to the cap. Never inside a JSON string, which
# holds no raw newline and no bare quote.
MARKUP_ENDINGS = ("\n</parameter>\n", '<|"|>')


class Planner:
    """Shortest-completion search over one tokenizer's vocabulary, driven by the matcher.

    From a matcher state, it walks toward an accepting state: forced tokens first (the
    matcher's fast-forward tokens: keys, ``const`` values, markup), else among the allowed
    tokens the one that closes the most (made of ``"``, ``]``, ``}`` and spaces, longest
    first), else the longest allowed token that opens no array or object (so an enum value,
    a number, a ``minLength`` string take few tokens). That first, greedy completion is
    usually the shortest; ``search`` can spend extra nodes on a depth-first branch and bound
    over the next best alternatives at each choice. Deterministic: the result depends only
    on the grammar state and the arguments.
    """

    def __init__(self, lltok: Any, vocab_size: int) -> None:
        n = min(vocab_size, lltok.vocab_size)
        # float64: ties are broken toward lower ids (more frequent merges), deterministically.
        score = np.full(n, -np.inf)
        close = set(b'"]} ')
        specials = []
        for i in range(n):
            raw = lltok.decode_bytes([i])
            if not raw:
                continue
            if lltok.is_special_token(i):
                specials.append(i)
                value = -1e6  # only where the grammar names it (its markup is forced anyway)
            elif set(raw) <= close and raw.strip():
                # Inside a string only a quote closes: the others would be content there.
                value = _CLOSER + (_QUOTE if b'"' in raw else 0) + len(raw)
            else:
                opens = max(0, raw.count(b"{") + raw.count(b"[") - raw.count(b"}") - raw.count(b"]"))
                # a lone escape or minus sign is a value still to finish
                value = len(raw) - 2 * opens - (8 if raw.endswith((b"\\", b"-")) else 0)
            score[i] = value - i * 1e-6
        self.score = score
        self.ranked = np.argsort(-score, kind="stable")[:RANKED]  # the best tokens, best first
        # Special tokens: where the grammar allows one beside text, it is markup that closes
        # something (Gemma 4's string delimiter), tried first.
        self._specials = np.array(specials, dtype=np.int64)
        self._lltok = lltok
        # fewest tokens first: where several fit, the shortest is the plan's
        self._endings = sorted((list(lltok.tokenize_bytes(text.encode())) for text in FORMAT_ENDINGS), key=len)
        self._markup = [list(lltok.tokenize_bytes(text.encode())) for text in MARKUP_ENDINGS]
        self.eos = [int(t) for t in getattr(lltok, "eos_tokens", None) or [lltok.eos_token]]

    def choices(self, m: Any, k: int, bias: np.ndarray | None = None) -> list[int]:
        """The ``k`` best allowed tokens in ``m``'s state (``bias``: its mask, where the caller
        has it), best first."""
        if bias is None:
            bias = np.frombuffer(m.compute_logit_bias(), dtype=np.uint8)
        top = self.ranked[bias[self.ranked] != 0][:k]  # cheap where most tokens are allowed (strings)
        if top.size == k:
            return cast(list[int], top.tolist())
        allowed = np.flatnonzero(bias[:self.score.size])
        if allowed.size <= 1:
            return allowed.tolist()
        scores = self.score[allowed]
        if k == 1:
            return [int(allowed[np.argmax(scores)])]
        best = np.argpartition(-scores, k)[:k] if allowed.size > k else np.arange(allowed.size)
        best = best[np.argsort(-scores[best], kind="stable")]
        return cast(list[int], allowed[best].tolist())

    def search(self, m: Any, limit: int, *, extra_nodes: int = 0, branch: int = 1) -> list[int] | None:
        """A completion of at most ``limit`` tokens from ``m``'s state to an accepting one
        (the shortest found), or None. ``m`` is the caller's copy: it is advanced and may
        be left anywhere. Spends at most ``limit + extra_nodes`` nodes (mask or forced-token
        computations); ``branch``: alternatives tried at each choice (1: greedy only)."""
        if m.is_accepting():
            return []
        if m.is_error() or m.is_stopped() or limit <= 0:
            return None

        def expand() -> list[list[int]]:
            forced = m.compute_ff_tokens()
            if forced:
                return [list(forced)]
            bias = np.frombuffer(m.compute_logit_bias(), dtype=np.uint8)
            picks = [[t] for t in self.choices(m, branch, bias)]
            if self._specials.size:
                specials = [[int(t)] for t in self._specials[self._specials < bias.size] if bias[t]]
                if specials and len(specials) < len(picks) + 8:  # a few named ones, not "any token"
                    return specials + [p for p in picks if p not in specials]
            markup = [e for e in self._markup if m.validate_tokens(e) == len(e)]
            if markup:
                return markup + picks
            if picks and self.score[picks[0][0]] >= _CLOSER + _QUOTE:
                return picks
            return [e for e in self._endings if m.validate_tokens(e) == len(e)] + picks

        best: list[int] | None = None
        path: list[int] = []
        stack: list[tuple[list[list[int]], int]] = [(expand(), 0)]
        nodes, max_nodes = 1, limit  # then ``extra_nodes`` more once a first completion is found
        while stack:
            moves, depth = stack[-1]
            if len(path) > depth:
                m.rollback(len(path) - depth)
                del path[depth:]
            if not moves:
                stack.pop()
                continue
            bound = len(best) if best is not None else limit + 1  # a new completion must be shorter
            done = False
            for t in moves.pop(0):
                if len(path) + 1 >= bound:
                    break
                if not m.consume_token(t):  # cannot happen: the matcher offered it
                    return best
                path.append(t)
                if m.is_accepting():
                    if best is None:
                        max_nodes = nodes + extra_nodes
                    best, done = path.copy(), True
                    break
            if done or len(path) + 1 >= bound or len(path) == depth:
                continue
            if nodes >= max_nodes:
                break
            nodes += 1
            stack.append((expand(), len(path)))
        if best:
            m.rollback(len(path))
            best = self._merged(m, best)
        return best

    def _merged(self, m: Any, plan: list[int]) -> list[int]:
        """``plan``'s text tokenized as the tokenizer would, where that is shorter and ends
        accepted too (the search goes token by token: ``"`` then ``,`` where ``",`` is one)."""
        merged: list[int] = self._lltok.tokenize_bytes(self._lltok.decode_bytes(plan))
        if len(merged) >= len(plan):
            return plan
        for i, t in enumerate(merged):
            if not m.consume_token(t):
                return plan
            if m.is_accepting():
                return merged[:i + 1]
        return plan
