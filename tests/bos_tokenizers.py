"""Tokenizers that add a BOS token by default, built offline, with the chat templates of the
model families that have them: the embedded SmolLM2's tokenizer adds none, so a prompt that
gets a second BOS would pass every test run on it.

* ``llama3_tokenizer``: Llama-3's way, a byte-level BPE whose post-processor puts
  ``<|begin_of_text|>`` before every encoded text, and a template that starts with
  ``{{ bos_token }}`` and its header tokens.
* ``gemma_tokenizer``: Gemma's way, transformers' ``GemmaTokenizer`` (byte fallback, ``▁``
  for spaces) with ``add_bos_token`` on, ``<bos>``, and a ``<start_of_turn>`` template that
  folds the system prompt into the first user turn.

Both are small (a few hundred tokens) and deterministic: the same ids in every process.
"""

from __future__ import annotations

import functools
from typing import Any

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set first = messages[0]['content'] + '\\n\\n' %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set first = '' %}{%- set turns = messages %}{%- endif %}"
    "{%- for message in turns %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{%- endif %}"
)

# Words the BPE merges learn from (any other text still encodes, byte by byte).
_CORPUS = [
    "You are a helpful assistant. Answer in one short sentence.",
    "What is the capital of France? Paris is the capital of France.",
    "Say hello to the user. Hello! How can I help you today?",
    "system user assistant model tool the a of to in is and",
]


@functools.cache
def llama3_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bos, eos = "<|begin_of_text|>", "<|eot_id|>"
    specials = [bos, "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", eos]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_CORPUS * 4, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                   chat_template=LLAMA3_TEMPLATE)


@functools.cache
def gemma_tokenizer() -> Any:
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    merges: list[tuple[str, str]] = []
    for word in sorted({w for line in _CORPUS for w in line.replace("?", "").replace(".", "").split()}):
        piece = "▁" + word[0]
        vocab.setdefault("▁", len(vocab))
        vocab.setdefault(word[0], len(vocab))
        if piece not in vocab:
            merges.append(("▁", word[0]))
            vocab[piece] = len(vocab)
        for ch in word[1:]:
            vocab.setdefault(ch, len(vocab))
            if piece + ch not in vocab:
                merges.append((piece, ch))
                vocab[piece + ch] = len(vocab)
            piece += ch
    return GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True,
                          additional_special_tokens=["<start_of_turn>", "<end_of_turn>"],
                          chat_template=GEMMA_TEMPLATE)


TOKENIZERS = {"llama3": llama3_tokenizer, "gemma": gemma_tokenizer}
