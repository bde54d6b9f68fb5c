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


def generation_prompt_ids(tokenizer: Any) -> list[int]:
    """The tokens the chat template's generation prompt adds after the messages (``<|im_start|>
    assistant\n``, maybe an opened ``<think>``), found by rendering a one-message chat with and
    without it; [] where it adds none, is not a plain suffix, or the template refuses the probe."""
    probe = [{"role": "user", "content": "?"}]
    try:
        with_prompt = render_chat(tokenizer, probe)
        without = render_chat(tokenizer, probe, add_generation_prompt=False)
    except InvalidRequestError:
        return []
    if len(with_prompt) <= len(without) or not with_prompt.startswith(without):
        return []
    return list(tokenizer(with_prompt[len(without):], add_special_tokens=False).input_ids)


def history_length(prompt: Sequence[int], generation_prompt: Sequence[int]) -> int | None:
    """A chat prompt's tokens before its generation prompt (what the conversation's next turn
    repeats), or None where the prompt does not end with it as tokens."""
    n = len(generation_prompt)
    if n == 0 or n >= len(prompt) or list(prompt[-n:]) != list(generation_prompt):
        return None
    return len(prompt) - n


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
