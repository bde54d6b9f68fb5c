"""How far drafting can take `kvcellar bench spec`'s work on this machine, and how much of that the
drafter takes: the greedy outputs of the same conversations (the embedded model, the same seeds,
each turn carrying the replies before it), what a step costs here by its rows, and a replay of
the drafter over those outputs beside an oracle.

    .venv/bin/python benchmarks/bench_spec_ceiling.py                  # ~3 min on 2 cores
    .venv/bin/python benchmarks/bench_spec_ceiling.py --kinds code-edit --repeats 3 --extra-row-ms 2,1.5,1
    .venv/bin/python benchmarks/bench_spec_ceiling.py --costs-model 7b.gguf   # a 7B's steps, these drafts

Greedy output is the same with and without drafts, so one run without drafts gives every token a
drafted run would emit, and a draft's fate is known without the model: the replay asks the
drafter (``engine/speculation.py``, as shipped, its step costs learnt from the ones measured here)
for each step's draft and prices the step by its rows. The oracle verifies the same drafts cut to
the tokens the model takes: no row is spent on a rejected token and none is left out, the most
any choice of draft lengths from these drafts can make; its tokens a step are those of every
draft verified whole. Between the drafter and the oracle, what each kind of wasted row costs:
the drafter's choices with no draft where the model rejects its first token, and with none of
its rows on a rejected token. Modelled speedups (step costs only: no server, no
client) over decoding one token a step. With ``--costs-model`` the steps are timed on another
model (a GGUF ``bench_big_model.py --keep-gguf`` wrote: random weights, whose own drafts mean
nothing) and the replay projects what the embedded model's drafts make of its steps. Figures only,
no asserts.
"""

from __future__ import annotations

# ruff: noqa: I001  -- kvcellar is imported before torch on purpose (OMP_WAIT_POLICY)
import argparse
import collections
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import kvcellar  # noqa: F401  (OMP wait policy before torch)

from kvcellar.artifacts import ArtifactCache
from kvcellar.bench.spec_work import conversations
from kvcellar.engine import Engine, SamplingParams, assemble_engine
from kvcellar.engine.config import EngineConfig
from kvcellar.engine.loader import LoadedModel
from kvcellar.engine.speculation import Candidate, Drafter, RecentOutputs
from kvcellar.engine.tokenization import encode_chat
from kvcellar.runtime import prepare_and_load


@dataclass
class Turn:
    kind: str
    prompt: list[int]
    output: list[int]


class ForcedDrafts(Drafter):
    """Drafts of ``k`` tokens every step (the last token repeated: the model rejects them, which
    changes no step's cost), each step's seconds recorded by its rows."""

    def __init__(self) -> None:
        super().__init__("ngram", 16)
        self.k = 0
        self.seconds: dict[int, list[float]] = collections.defaultdict(list)

    def candidate(self, seq_id: int, tokens: Sequence[int], limit: int, root: bytes = b"") -> Candidate | None:
        k = min(self.k, limit)
        return Candidate(seq_id, [tokens[-1]] * k, 1.0) if k else None

    def choose(self, candidates: list[Candidate], rows: int, budget: int) -> None:
        for c in candidates:
            c.taken = len(c.draft)

    def observe(self, rows: int, seconds: float) -> None:
        self.seconds[rows].append(seconds)


def record(loaded: LoadedModel, engine: Engine, seed: str, repeats: int, kinds: tuple[str, ...],
           max_tokens: int) -> list[Turn]:
    """Every turn of the work, run without drafts as `kvcellar bench spec` runs it."""
    turns: list[Turn] = []
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for rep in range(repeats):
        for conv in conversations(f"{seed}:{rep}", kinds, round_=rep):
            messages = [{"role": "system", "content": conv.system}] if conv.system else []
            for text in conv.turns:
                messages.append({"role": "user", "content": text})
                prompt = encode_chat(loaded.tokenizer, messages)
                out = engine.generate([prompt], params)[0]
                turns.append(Turn(conv.kind, list(prompt), list(out.token_ids)))
                messages.append({"role": "assistant", "content": out.text})
    return turns


def step_costs(loaded: LoadedModel, prompt: list[int], most: int, repeats: int,
               tokens: int = 24) -> dict[int, float]:
    """Median seconds of a decode step of one sequence by its rows (1 .. most + 1), after ``prompt``
    (its ids folded into the model's vocabulary)."""
    drafter = ForcedDrafts()
    engine = assemble_engine(loaded, EngineConfig(kv_cache_gb=1.0, speculative="ngram"))
    engine.scheduler.drafter = drafter
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompt = [t % loaded.model.config.vocab_size for t in prompt]
    for rep in range(repeats):
        for k in range(most + 1):
            drafter.k = k
            engine.generate([[*prompt, rep, k]], params)  # a prompt of its own: no cache hit shortens it
    engine.shutdown()
    return {rows: statistics.median(s) for rows, s in sorted(drafter.seconds.items())}


def replay(turns: list[Turn], costs: dict[int, float], mode: str, most: int,
           oracle: str = "") -> dict[str, list[float]]:
    """Per kind: [steps' seconds, tokens, steps, drafted, accepted], the drafter (``mode``) asked for
    each step's draft. ``oracle``: "all", each draft cut to the tokens the model takes; "tail", the
    drafter's choice cut so (no row on a rejected token); "first", the drafter's choice, none where
    the model rejects the draft's first token (where the waste of each kind goes)."""
    drafter = Drafter(mode, most, RecentOutputs() if mode == "suffix" else None)
    for rows, s in costs.items():
        drafter.observe(rows, s)
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0] * 5)
    for n, turn in enumerate(turns):
        tokens = turn.prompt + turn.output
        t = len(turn.prompt) + 1  # the first token comes with the prompt's step
        fig = out[turn.kind]
        while t < len(tokens):
            c = drafter.candidate(n, tokens[:t], min(most, len(tokens) - t - 1))
            k = taken = 0
            if c is not None:
                good = 0
                while good < len(c.draft) and c.draft[good] == tokens[t + good]:
                    good += 1
                if oracle == "all":
                    k = good
                else:
                    drafter.choose([c], 1, most)
                    k = c.taken
                    if oracle == "tail" or (oracle == "first" and not good):
                        k = min(k, good)
                taken = min(k, good)
                if k:
                    drafter.verified(n, k, taken)
            fig[0] += costs[min(1 + k, max(costs))]
            fig[1] += taken + 1
            fig[2] += 1
            fig[3] += k
            fig[4] += taken
            t += taken + 1
        drafter.finished(n, turn.output)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", default="0", help="the work's seed, as `kvcellar bench spec --seed` (default 0)")
    ap.add_argument("--repeats", type=int, default=2, help="variants of the work, as the bench's repeats")
    ap.add_argument("--kinds", default="code-edit,json,agent,chat")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--draft-tokens", type=int, default=8, help="the longest draft (--speculative-max-tokens)")
    ap.add_argument("--cost-repeats", type=int, default=3, help="runs of each row count when timing steps")
    ap.add_argument("--costs-model", default=None, help="time the steps on this model (a GGUF path): what the "
                    "embedded model's drafts would make of its steps")
    ap.add_argument("--extra-row-ms", default="", help="also replay where each row past the first costs these ms "
                    "(comma-separated; the one-row step as measured): what cheaper verified rows would give")
    args = ap.parse_args()

    loaded = prepare_and_load(None, artifacts=ArtifactCache.open())
    engine = assemble_engine(loaded, EngineConfig(kv_cache_gb=1.0, speculative="off"))
    start = time.perf_counter()
    turns = record(loaded, engine, args.seed, args.repeats, tuple(args.kinds.split(",")), args.max_tokens)
    engine.shutdown()
    print(f"{len(turns)} turns, {sum(len(t.output) for t in turns)} tokens generated in "
          f"{time.perf_counter() - start:.0f} s")
    longest = max(turns, key=lambda t: len(t.prompt) if t.kind == "code-edit" else 0)
    timed = loaded
    if args.costs_model:
        del loaded
        timed = prepare_and_load(args.costs_model, artifacts=ArtifactCache.open())
        print(f"steps timed on {args.costs_model}")
    costs = step_costs(timed, longest.prompt, args.draft_tokens, args.cost_repeats, 12 if args.costs_model else 24)
    one = costs[1]
    print(f"a step by its rows after {len(longest.prompt)} tokens, ms (and in one-row steps): "
          + ", ".join(f"{rows}: {s * 1e3:.2f} ({s / one:.2f})" for rows, s in costs.items()))

    runs = {mode: replay(turns, costs, mode, args.draft_tokens) for mode in ("ngram", "suffix")}
    runs["suffix, first token known"] = replay(turns, costs, "suffix", args.draft_tokens, "first")
    runs["suffix, no rejected row"] = replay(turns, costs, "suffix", args.draft_tokens, "tail")
    runs["oracle"] = replay(turns, costs, "ngram", args.draft_tokens, "all")
    runs["oracle, suffix drafts"] = replay(turns, costs, "suffix", args.draft_tokens, "all")
    kinds = [k for k in args.kinds.split(",") if k in runs["oracle"]]
    print("\nmodelled speedup over one token a step (tokens a step, acceptance)")
    print("| kind | " + " | ".join(runs) + " |")
    print("|---" * (len(runs) + 1) + "|")
    for kind in kinds:
        print(f"| {kind} | " + " | ".join(_cell(runs[mode][kind], one, True) for mode in runs) + " |")

    extra = [float(v) for v in args.extra_row_ms.split(",") if v]
    if extra:
        print("\nwhere each row past the first costs x ms (modelled speedup: ngram / suffix / oracle)")
        print("| x ms | " + " | ".join(kinds) + " |")
        print("|---" * (len(kinds) + 1) + "|")
        for ms in extra:
            model = {rows: one + ms / 1e3 * (rows - 1) for rows in costs}
            these = {mode: replay(turns, model, mode, args.draft_tokens) for mode in ("ngram", "suffix")}
            these["oracle"] = replay(turns, model, "ngram", args.draft_tokens, "all")
            print(f"| {ms:g} | " + " | ".join(" / ".join(_cell(these[m][kind], one, False) for m in these)
                                              for kind in kinds) + " |")


def _cell(fig: list[float], one: float, detail: bool) -> str:
    seconds, tokens, steps, drafted, accepted = fig
    ratio = tokens * one / seconds  # each token a one-row step of its own without drafts
    return f"{ratio:.2f}x ({tokens / steps:.2f}, {accepted / max(drafted, 1):.2f})" if detail else f"{ratio:.2f}x"


if __name__ == "__main__":
    main()
