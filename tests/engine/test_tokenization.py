"""Chat prompts are rendered by the model's template and tokenized once, without a second
BOS (SPEC §3), checked on the ids of the embedded model's own template."""

from __future__ import annotations

from kvcellar.engine.tokenization import encode_chat, encode_prompt
from tests._models import embedded

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]


def test_chat_ids_are_the_templates_ids_with_one_bos() -> None:
    tok = embedded("float32").tokenizer
    ids = encode_chat(tok, MESSAGES)
    # the template's own tokenization (what the model was trained on) is the reference
    reference = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert ids == list(reference["input_ids"])
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    bos = tok.bos_token_id
    assert bos is not None and text.startswith(tok.bos_token)  # this template writes its BOS itself
    assert ids[0] == bos and ids[1] != bos  # exactly one BOS at the start
    assert ids.count(bos) == text.count(tok.bos_token)  # no token the template did not write
    # encoding the rendered text with the tokenizer's default rule could add one more
    default = list(tok(text).input_ids)
    assert default[len(default) - len(ids):] == ids and len(default) - len(ids) in (0, 1)


def test_plain_prompts_keep_the_tokenizers_rule() -> None:
    tok = embedded("float32").tokenizer
    assert encode_prompt(tok, "Once upon a time") == list(tok("Once upon a time").input_ids)
