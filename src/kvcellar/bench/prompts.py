"""Deterministic prompts from a seed, with lengths exact in the model's own tokens.

No data set is downloaded: text is drawn from a fixed word list with ``random.Random``
seeded by a string, so the same seed gives the same prompt on every machine. Chat prompts
are rendered with the model's chat template and tokenized exactly as kvcellar does
(``kvcellar.engine.tokenization.encode_chat``), and their word count is adjusted until the
rendered prompt has exactly the asked number of tokens.

Every prompt opens its system message with words drawn from its own seed, so prompts of
different seeds share no KV block (a template's fixed preamble alone never fills one).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcellar.engine.tokenization import shared_prefix_len

_WORD_TEXT = """
able about above across after again against almost alone along already also always among animal answer
apple area around back ball bank base basket bear beauty before began begin behind below best better
between bird black blue board boat body bones book both bottom box brave bread bridge bright bring broken
brother brown build built busy cabin call calm came camp candle captain card care carry case castle
catch cause center chain chair chance change check child choose circle city class clean clear clock
close cloud coast cold color common copper corner cotton could count country course cover cross crowd
dance dark daughter deep desert design detail direct doctor door double dream dress drive during early
earth east edge engine enough even evening every example face fact fair family farm fast father field
final finger fire first fish floor flower follow force forest form forward found frame free fresh friend
front fruit full game garden gate gentle glass gold good grass great green ground group grow guard guide
half hand happy harbor heart heavy held help high hill history hold home hope horse hour house human
idea inside island iron job join journey judge jump keep kind king kitchen knife lake land large last
late laugh layer lead learn leave letter level light line list little long lost loud machine main
market matter meadow metal middle might mind minute mirror moment money month moon morning mother
mountain move music name narrow nation nature near night noise north note number ocean office often
open orange order other outside page paint paper parent party path pattern people piece place plain
plan plant pocket point poem pond power present press quick quiet rain reach ready record river road
rock room round rule safe sail salt sand school science season second seed shadow shape sharp ship shore
short signal silver simple single sister size sky sleep slow small smile snow soft soil sound south space
speak spring square stand star station steel stone storm story street strong summer sun table tall teacher
temple thick thin thread tiny tool top tower town track trade train travel tree true turn under valley
village voice wall warm watch water wave weather west wheel white whole wide wind window winter wood world
yard year yellow young
"""
WORDS = tuple(_WORD_TEXT.split())


def words(seed: str | int, n: int) -> list[str]:
    rnd = random.Random(f"kvcellar-bench:{seed}")
    return [rnd.choice(WORDS) for _ in range(n)]


def sentences(seed: str | int, n_words: int) -> str:
    """Sentence-shaped text of about ``n_words`` words (for user turns and system blocks)."""
    rnd = random.Random(f"kvcellar-bench:sent:{seed}")
    out: list[str] = []
    left = n_words
    while left > 0:
        k = min(left, rnd.randint(6, 14))
        ws = [rnd.choice(WORDS) for _ in range(k)]
        out.append(" ".join(ws).capitalize() + ".")
        left -= k
    return " ".join(out)


@dataclass(frozen=True)
class ChatPrompt:
    messages: list[dict[str, str]]
    token_ids: list[int]

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


class PromptMaker:
    """Builds chat prompts of exact token lengths with the model's tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cost: dict[str, int] = {}
        self._one_token = [w for w in WORDS if self.cost(w) == 1] or list(WORDS)

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        from kvcellar.engine.tokenization import encode_chat

        return encode_chat(self.tokenizer, messages)

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    def cost(self, word: str) -> int:
        """Tokens of `` word`` after another word (the tokenizer splits on spaces)."""
        c = self._cost.get(word)
        if c is None:
            c = self._cost[word] = self.count(" " + word)
        return c

    def fill(self, seed: str, n_tokens: int) -> list[str]:
        """Words whose space-joined tokens add up to ``n_tokens``; the same seed and count give
        the same words."""
        rnd = random.Random(f"kvcellar-bench:fill:{seed}")
        out: list[str] = []
        left = n_tokens
        while left > 0:
            w = rnd.choice(WORDS)
            if self.cost(w) > left:
                w = self._one_token[rnd.randrange(len(self._one_token))]
            out.append(w)
            left -= self.cost(w)
        return out

    def chat(self, n_tokens: int, seed: str | int, *, tail_tokens: int = 0, tail_seed: str | int | None = None,
             tries: int = 12) -> ChatPrompt:
        """A system + user chat whose rendered prompt has exactly ``n_tokens`` tokens.

        The user message is ``body + tail``: prompts with the same ``seed`` and different
        ``tail_seed`` share everything up to the tail (whose words cover ``tail_tokens``)."""
        system = "Notebook " + " ".join(words(f"head:{seed}", 10)) + "."
        overhead = len(self.encode(self._messages(system, ["x"])))
        body_tokens = max(1, n_tokens - overhead - tail_tokens)
        tail_words = self.fill(f"tail:{seed}:{tail_seed}", tail_tokens) if tail_tokens else []
        best: ChatPrompt | None = None
        for _ in range(tries):
            body_words = self.fill(f"body:{seed}", body_tokens)
            msgs = self._messages(system, body_words + tail_words)
            ids = self.encode(msgs)
            best = ChatPrompt(msgs, ids)
            diff = len(ids) - n_tokens
            if diff == 0:
                return best
            body_tokens = max(1, body_tokens - diff)
        assert best is not None
        return best  # within a token or two; callers report the exact length

    def partial_pair(self, n_tokens: int, seed: str | int, tail: int) -> tuple[ChatPrompt, ChatPrompt]:
        """Two prompts of ``n_tokens`` tokens that share all but their last ``tail`` tokens
        (the tail covers the end of the user message and the template's closing tokens)."""
        tail_words = tail
        for _ in range(6):
            a = self.chat(n_tokens, seed, tail_tokens=tail_words, tail_seed="a")
            b = self.chat(n_tokens, seed, tail_tokens=tail_words, tail_seed="b")
            unshared = n_tokens - shared_prefix_len(a.token_ids, b.token_ids)
            if unshared == tail or tail_words <= 1:
                break
            tail_words = max(1, tail_words + tail - unshared)
        return a, b

    @staticmethod
    def _messages(system: str, user_words: list[str]) -> list[dict[str, str]]:
        return [{"role": "system", "content": system}, {"role": "user", "content": " ".join(user_words)}]


def find_tokenizer_dir(models_dir: Path, model_name: str | None = None) -> Path | None:
    """A prepared model's folder (with ``tokenizer.json``) in kvcellar's artifact cache; the
    one whose manifest names ``model_name`` if there is one, else the newest."""
    import json

    entries = sorted((models_dir / "entries").glob("*/tokenizer.json"), key=lambda p: p.stat().st_mtime,
                     reverse=True)
    if model_name:
        for tok in entries:
            try:
                name = json.loads((tok.parent / "manifest.json").read_text())["descriptor"]["name"]
            except (OSError, ValueError, KeyError):
                continue
            if name == model_name:
                return tok.parent
    return entries[0].parent if entries else None


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def resolve_tokenizer(path: Path | None) -> Any:
    """The tokenizer in ``path`` (``--tokenizer``, or a prepared model's folder), else the
    embedded default model's, read from its GGUF: a peer or a ``--base-url`` server on a
    machine where kvcellar never prepared the model."""
    if path is not None:
        return load_tokenizer(path)
    from transformers import AutoTokenizer

    from kvcellar.errors import ModelNotFoundError
    from kvcellar.model_source import find_embedded_gguf

    try:
        gguf = find_embedded_gguf()
    except ModelNotFoundError as exc:
        raise SystemExit(f"no tokenizer: pass --tokenizer DIR or --models-dir with a prepared model ({exc})") from exc
    print(f"no prepared model found: using the embedded model's tokenizer ({gguf.name})", flush=True)
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
