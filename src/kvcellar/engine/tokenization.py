"""Prompt rendering and tokenization, done once per request.

Chat messages are rendered with the model's chat template to text that already holds every
special token the template wants (BOS included), then encoded with
``add_special_tokens=False``: the tokenizer must not add a second BOS. A plain completion
prompt is encoded with the tokenizer's own special-token rule (its BOS, where it adds one),
unless its text already starts with the BOS (a chat rendered by the client). Token prompts
are the client's exact tokens and are not touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcellar.errors import InvalidRequestError


def render_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
                **template_kwargs: Any) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model has no chat template; use /v1/completions", param="messages")
    try:
        text: str = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs
        )
        return text
    except InvalidRequestError:
        raise
    except Exception as exc:  # template errors (e.g. jinja raise_exception for bad roles)
        raise InvalidRequestError(f"the chat template rejected the messages: {exc}", param="messages") from None


def encode_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], **template_kwargs: Any) -> list[int]:
    text = render_chat(tokenizer, messages, **template_kwargs)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    bos = getattr(tokenizer, "bos_token", None)
    already = isinstance(bos, str) and bool(bos) and prompt.startswith(bos)
    return list(tokenizer(prompt, add_special_tokens=not already).input_ids)


def shared_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens ``a`` and ``b`` have in common from the start."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
