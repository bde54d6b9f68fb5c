"""Shared pieces of the artifact-cache tests: tiny real GGUF files and greedy decoding.

``write_tiny_gguf`` writes a real llama-architecture GGUF (Q8_0 weights, a byte-level BPE
vocabulary of 264 tokens with ChatML specials and a chat template) that transformers loads
and dequantizes like any downloaded file, in a fraction of a second; different seeds give
different weights, hence different content hashes and different cache entries.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_gguf(path: Path, seed: int = 0, *, hidden: int = 64, layers: int = 2, heads: int = 4,
                    kv_heads: int = 2, ffn: int = 128) -> Path:
    import gguf
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    byte_chars = bytes_to_unicode()
    tokens = [byte_chars[b] for b in range(256)]
    merges = ["h e", "l l", "o r", "Ġ t", "he ll"]
    tokens += [m.replace(" ", "") for m in merges]
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    token_types = [1] * (len(tokens) - 3) + [3, 3, 3]  # 3: control (special)
    vocab = len(tokens)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"tiny-{seed}")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_unk_token_id(vocab - 3)
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)
    w.add_pad_token_id(vocab - 1)
    w.add_chat_template(CHAT_TEMPLATE)

    def tensor(name: str, shape: tuple[int, ...], quantize: bool = True, scale: float = 0.1) -> None:
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        if quantize:
            w.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, data)

    head_dim = hidden // heads
    tensor("token_embd.weight", (vocab, hidden))
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", (hidden,), quantize=False)
        tensor(f"blk.{i}.attn_q.weight", (hidden, hidden))
        tensor(f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden))
        tensor(f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden))
        tensor(f"blk.{i}.attn_output.weight", (hidden, hidden))
        tensor(f"blk.{i}.ffn_norm.weight", (hidden,), quantize=False)
        tensor(f"blk.{i}.ffn_gate.weight", (ffn, hidden))
        tensor(f"blk.{i}.ffn_up.weight", (ffn, hidden))
        tensor(f"blk.{i}.ffn_down.weight", (hidden, ffn))
    tensor("output_norm.weight", (hidden,), quantize=False)
    tensor("output.weight", (vocab, hidden), scale=2.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def greedy(loaded: Any, user: str = "hello there", max_tokens: int = 8) -> list[int]:
    """Greedy completion of a one-turn chat through the kvcellar engine."""
    from kvcellar.engine import SamplingParams, assemble_engine
    from kvcellar.engine.config import EngineConfig
    from kvcellar.engine.tokenization import encode_chat

    ids = encode_chat(loaded.tokenizer, [{"role": "user", "content": user}])
    engine = assemble_engine(loaded, EngineConfig(kv_cache_gb=0.02))
    try:
        [result] = engine.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0))
    finally:
        engine.shutdown(timeout=5)
    assert result.finish_reason in ("stop", "length"), result
    return result.token_ids
