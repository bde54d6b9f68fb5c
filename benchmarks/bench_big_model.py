"""A 7-8B 4-bit GGUF served by kvcellar beside llama.cpp's own ``llama-server`` (issue 25).

Writes a GGUF with the real shapes of Qwen2.5-7B (``--arch qwen2``, the default),
Llama-3.1-8B (``--arch llama``) or the mixture-of-experts Qwen3-30B-A3B / Qwen3-Coder-30B-A3B
(``--arch qwen3moe``: 128 experts of 768, 8 routed a token, q/k norms; ~17 GB in Q4_K with
``--mix q4_k_m``, whose ``ffn_down_exps`` are Q6_K in llama.cpp's "more bits" layers) or
gpt-oss-20b (``--arch gpt-oss``: 32 experts of 2880 in MXFP4, 4 routed a token, attention
sinks, 128-token windows every other layer, Q8_0 attention and embedding; ~12 GB) or the
hybrid Qwen3.5-9B (``--arch qwen35``: Gated DeltaNet layers, every fourth gated attention; or
``--arch qwen35-2b``; or its MoE, Qwen3.5-35B-A3B, ``--arch qwen35moe``: 256 experts of 512 and a
shared one, 8 routed a token; ~19.5 GB in Q4_0) and random weights, then measures both servers on that very
file, one after the other, with the same token-id prompts (``/v1/completions`` takes a list of
token ids, so prompt lengths are exact on both servers).

The file: every decoder linear and ``token_embd`` in Q4_0 (``--mix q4_k_m``: in Q4_K, with
``attn_v`` and ``ffn_down`` in Q6_K in the layers llama.cpp's Q4_K_M gives more bits), ``output``
in ``--output-type`` (Q6_K, as llama.cpp's ``llama-quantize`` writes it; or Q8_0, Q4_0), norms
and Qwen2's q/k/v biases in F32. Blocks are written as bytes (random nibbles or 6-bit values under an
fp16 scale that gives weights of std ~0.02), not quantized from floats, so the 4.4 GB of a
7B take seconds; one tensor at a time is in memory. The tokenizer is a real byte-level BPE
(256 byte tokens, a few merges, ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, a ChatML
template) padded to the model's vocabulary with plain word tokens (`` w123``), so that every
id decodes to text and both servers load it with their own GGUF tokenizer readers. With
``--vocab-from-embedded`` it is the embedded SmolLM2's trained BPE instead, padded the same way
(for prompts of real text: ``bench_agent_replay.py --model``).

kvcellar (``kvcellar serve --model FILE --weights auto --kv-cache-gb 2``, fresh ``--cache-dir``):
  1st start    the GGUF prepared into the artifact cache: wall time until ``/health`` answers
               200 and peak RSS of the server's process group (VmRSS summed over the group,
               sampled every 0.2 s); ``/health`` ``weights`` and ``linears``
  2nd start    SIGTERM, the same cache dir: the prepared entry is loaded
  serving      prefill of cold distinct prompts of ``--lengths`` tokens (non-streamed
               ``max_tokens`` 1: TTFT is the request's wall time; prefill tok/s = tokens /
               TTFT), RAM hit (the longest prompt again, once kvcellar has written its blocks
               to the SSD: stop 36's figures had that write-through beside the hit), decode of
               ``--decode-tokens`` (128)
               tokens with ``ignore_eos`` at one stream and at ``--batch`` (8) concurrent
               streams (short distinct prompts), RSS of the group (peak over the phase)
  restart      SIGTERM (kvcellar drains its disk writer), the page cache of the KV files
               dropped (``posix_fadvise DONTNEED`` on the cache dir, not its ``models``), a
               3rd start, the longest prompt again: TTFT with the KV read from the SSD tier
llama-server (``-t`` cores ``-c`` max(4096, longest + 512) ``-np 1 --cache-reuse 256``; its
prompt cache is on by default):
  start time and peak RSS, RSS after start, one 16-token request (kvcellar warms itself up
  before it answers), the same prefill / RAM-hit / batch-1 decode, then a restart with ``-np 8``
  for the batch decode. It keeps no cache across a restart.

RSS is what the kernel counts resident: for llama-server that includes the mmapped GGUF pages
it touched (``RssFile``, shared with the page cache); the JSON has anon and file parts.
Figures only, no asserts. Run when ``uptime`` shows a load below ~1.5.

    .venv/bin/python benchmarks/bench_big_model.py --out bench-results/big-model.json   # 7B, ~20-30 min
    .venv/bin/python benchmarks/bench_big_model.py --small --out /tmp/small.json        # tiny shapes, ~2 min
    .venv/bin/python benchmarks/bench_big_model.py --arch llama --gguf /tmp/llama8b-q4_0.gguf --keep-gguf

``--gguf PATH`` reuses a file this script wrote earlier (same arch and shapes) or writes it
there; ``--skip-kvcellar`` / ``--skip-peer`` measure one side only; ``--kvcellar-cmd`` runs
another kvcellar (e.g. ``"python my_wrapper.py"``, which must take ``serve`` and its flags).
A side that fails or is stopped (SIGTERM/Ctrl-C) keeps what it measured in the JSON, with the
error, how long into its phase and that phase's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvcellar.bench.launch import LaunchError, ServerLauncher, kvcellar_command
from kvcellar.bench.report import format_table, machine_info, machine_line, table
from kvcellar.bench.targets import flat_counters

PEER_BIN = Path(os.environ.get("LLAMA_SERVER_BIN", "/work/llama-server/bin/llama-server"))
READY_TIMEOUT_S = 3600.0
REQUEST_TIMEOUT_S = 1800.0
SAMPLE_INTERVAL_S = 0.2
# /health counters whose deltas around the restart hit say which tier served it.
TIER_COUNTERS = ("sched_lower_tier_hit_tokens", "kv_hit_tokens", "ssd_load_bytes")

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MERGES = ("Ġ t", "h e", "i n", "e r", "a n", "Ġ a", "o n", "r e")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


# ---- the model file ----------------------------------------------------------------------------


# Qwen3.5's linear attention: key heads, value heads, their size, the convolution's taps.
QWEN35_LINEAR = (16, 32, 128, 4)


@dataclass(frozen=True)
class Shape:
    arch: str  # GGUF architecture: qwen2 (q/k/v biases), llama or qwen3moe (q/k norms, experts)
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float
    rms_eps: float
    context: int
    name: str
    experts: int = 0  # per layer, each of ``ffn`` (a MoE shape has no dense MLP)
    experts_used: int = 0
    head_size: int = 0  # where it is not hidden / heads
    linear: tuple[int, int, int, int] = QWEN35_LINEAR  # qwen35's Gated DeltaNet layers

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads


SHAPES = {
    "qwen2": Shape("qwen2", 3584, 18944, 28, 28, 4, 152064, 1e6, 1e-6, 32768, "Qwen2.5-7B-shaped"),
    # Llama-3.1's rope scaling (rope_freqs) is left out: RoPE frequencies do not change the cost.
    "llama": Shape("llama", 4096, 14336, 32, 32, 8, 128256, 5e5, 1e-5, 32768, "Llama-3.1-8B-shaped"),
    "qwen3moe": Shape("qwen3moe", 2048, 768, 48, 32, 4, 151936, 1e7, 1e-6, 40960, "Qwen3-30B-A3B-shaped",
                      experts=128, experts_used=8, head_size=128),
    # Qwen3.5's hybrid (transformers' Qwen3_5TextConfig defaults): three Gated DeltaNet layers (16 key
    # and 32 value heads of 128) to one gated attention layer (16 heads of 256, 4 KV heads, a quarter
    # of each rotated)
    "qwen35": Shape("qwen35", 4096, 12288, 32, 16, 4, 248320, 1e7, 1e-6, 262144, "Qwen3.5-9B-shaped",
                    head_size=256),
    # the small dense Qwen3.5 (16 key and 16 value heads; 8 attention heads of 256, 2 KV heads)
    "qwen35-2b": Shape("qwen35", 2048, 6144, 24, 8, 2, 248320, 1e7, 1e-6, 262144, "Qwen3.5-2B-shaped",
                       head_size=256, linear=(16, 16, 128, 4)),
    # the hybrid MoE (transformers' Qwen3_5MoeTextConfig defaults): 256 experts of 512 and a
    # shared one of 512 in every layer, 8 routed a token
    "qwen35moe": Shape("qwen35moe", 2048, 512, 40, 16, 2, 248320, 1e7, 1e-6, 262144, "Qwen3.5-35B-A3B-shaped",
                       experts=256, experts_used=8, head_size=256),
    # every other layer a 128-token window; YaRN x32 over 4096 (llama.cpp's gpt-oss metadata)
    "gpt-oss": Shape("gpt-oss", 2880, 2880, 24, 64, 8, 201088, 150000.0, 1e-5, 131072, "gpt-oss-20b-shaped",
                     experts=32, experts_used=4, head_size=64),
}
HYBRIDS = ("qwen35", "qwen35moe")  # Gated DeltaNet layers, every fourth a gated attention one
GPT_OSS_WINDOW = 128
FULL_ATTENTION_INTERVAL = 4  # Qwen3.5: every fourth layer is full attention
SMALL = {"hidden": 512, "ffn": 1536, "layers": 2, "heads": 8, "kv_heads": 2, "vocab": 8192}

WEIGHT_STD = 0.02
# Per-type block layout: (values per block, bytes per block).
BLOCKS = {"Q4_0": (32, 18), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q6_K": (256, 210), "MXFP4": (32, 17)}


def tokenizer_tokens(vocab: int) -> tuple[list[str], list[int]]:
    """A byte-level BPE vocabulary of ``vocab`` entries: bytes, merges, specials, then words."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    tokens = [byte_chars[b] for b in range(256)] + [m.replace(" ", "") for m in MERGES] + list(SPECIALS)
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)  # 1 normal, 3 control
    first_word = len(tokens)
    tokens += [f"Ġw{i}" for i in range(first_word, vocab)]
    types += [1] * (vocab - first_word)
    return tokens, types


def embedded_tokens(vocab: int) -> tuple[list[str], list[int], list[str], str]:
    """The embedded SmolLM2's BPE (tokens, types, merges, pre-tokenizer) padded to ``vocab``
    entries with plain words: real text then tokenizes as a trained BPE does (~4 characters a
    token in English and code), not a byte a token."""
    import gguf

    from kvcellar.model_source import find_embedded_gguf

    reader = gguf.GGUFReader(str(find_embedded_gguf()))
    field = reader.fields
    tokens = list(field["tokenizer.ggml.tokens"].contents())
    types = [int(t) for t in field["tokenizer.ggml.token_type"].contents()]
    if vocab < len(tokens):
        raise ValueError(f"the embedded vocabulary has {len(tokens)} tokens, more than the shape's {vocab}")
    tokens += [f"Ġw{i}" for i in range(len(tokens), vocab)]
    types += [1] * (vocab - len(types))
    return tokens, types, list(field["tokenizer.ggml.merges"].contents()), str(field["tokenizer.ggml.pre"].contents())


def first_word_id() -> int:
    return 256 + len(MERGES) + len(SPECIALS)


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's rule for the layers whose attn_v and ffn_down Q4_K_M stores in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_plan(shape: Shape, output_type: str, mix: str = "q4_0") -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, numpy shape (rows, cols), type) in the order llama.cpp's converter writes them.
    ``mix``: q4_0 (every linear and the embedding Q4_0) or q4_k_m (Q4_K, with attn_v and
    ffn_down in Q6_K in llama.cpp's "more bits" layers)."""
    h, kv, q = shape.hidden, shape.kv_heads * shape.head_dim, shape.heads * shape.head_dim
    if shape.arch == "gpt-oss":
        return gpt_oss_plan(shape, output_type)
    if shape.arch in HYBRIDS:
        return qwen35_plan(shape, output_type, mix)
    four = "Q4_0" if mix == "q4_0" else "Q4_K"
    plan: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (shape.vocab, h), four)]
    for i in range(shape.layers):
        b = f"blk.{i}."
        wide = "Q6_K" if mix == "q4_k_m" and more_bits(i, shape.layers) else four
        plan += [(b + "attn_norm.weight", (h,), "F32"),
                 (b + "attn_q.weight", (q, h), four), (b + "attn_k.weight", (kv, h), four),
                 (b + "attn_v.weight", (kv, h), wide)]
        if shape.arch == "qwen2":
            plan += [(b + "attn_q.bias", (h,), "F32"), (b + "attn_k.bias", (kv,), "F32"),
                     (b + "attn_v.bias", (kv,), "F32")]
        if shape.arch == "qwen3moe":
            plan += [(b + "attn_q_norm.weight", (shape.head_dim,), "F32"),
                     (b + "attn_k_norm.weight", (shape.head_dim,), "F32")]
        plan += [(b + "attn_output.weight", (h, q), four), (b + "ffn_norm.weight", (h,), "F32")]
        if shape.experts:
            e = shape.experts
            plan += [(b + "ffn_gate_inp.weight", (e, h), "F32"),
                     (b + "ffn_gate_exps.weight", (e, shape.ffn, h), four),
                     (b + "ffn_up_exps.weight", (e, shape.ffn, h), four),
                     (b + "ffn_down_exps.weight", (e, h, shape.ffn), wide)]
            continue
        plan += [(b + "ffn_gate.weight", (shape.ffn, h), four), (b + "ffn_up.weight", (shape.ffn, h), four),
                 (b + "ffn_down.weight", (h, shape.ffn), wide)]
    plan += [("output_norm.weight", (h,), "F32"), ("output.weight", (shape.vocab, h), output_type)]
    return plan


def gpt_oss_plan(shape: Shape, output_type: str) -> list[tuple[str, tuple[int, ...], str]]:
    """gpt-oss as llama.cpp's gpt-oss GGUFs hold it: experts in MXFP4 (whatever the label),
    attention and the embedding in Q8_0, biases on the attention, router and experts, a sink
    per head, the norm after attention named ``post_attention_norm``."""
    h, kv, q, e, f = (shape.hidden, shape.kv_heads * shape.head_dim, shape.heads * shape.head_dim, shape.experts,
                      shape.ffn)
    plan: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (shape.vocab, h), "Q8_0")]
    for i in range(shape.layers):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (h,), "F32")]
        for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            plan += [(b + name + ".weight", (rows, h), "Q8_0"), (b + name + ".bias", (rows,), "F32")]
        plan += [(b + "attn_output.weight", (h, q), "Q8_0"), (b + "attn_output.bias", (h,), "F32"),
                 (b + "attn_sinks.weight", (shape.heads,), "F32"), (b + "post_attention_norm.weight", (h,), "F32"),
                 (b + "ffn_gate_inp.weight", (e, h), "F32"), (b + "ffn_gate_inp.bias", (e,), "F32")]
        for name, dims in (("ffn_gate_exps", (e, f, h)), ("ffn_up_exps", (e, f, h)), ("ffn_down_exps", (e, h, f))):
            plan += [(b + name + ".weight", dims, "MXFP4"), (b + name + ".bias", dims[:2], "F32")]
    plan += [("output_norm.weight", (h,), "F32"), ("output.weight", (shape.vocab, h), output_type)]
    return plan


def qwen35_plan(shape: Shape, output_type: str, mix: str) -> list[tuple[str, tuple[int, ...], str]]:
    """Qwen3.5 as llama.cpp's converter writes it: linear-attention layers (fused q/k/v, the
    output gate, beta and alpha, the convolution and the decay in F32) and every fourth a gated
    attention layer (each head's query and gate side by side in ``attn_q``, q/k norms)."""
    h, f = shape.hidden, shape.ffn
    k_heads, v_heads, dim, taps = shape.linear
    four = "Q4_0" if mix == "q4_0" else "Q4_K"
    plan: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (shape.vocab, h), four)]
    for i in range(shape.layers):
        b = f"blk.{i}."
        wide = "Q6_K" if mix == "q4_k_m" and more_bits(i, shape.layers) else four
        plan += [(b + "attn_norm.weight", (h,), "F32")]
        if (i + 1) % FULL_ATTENTION_INTERVAL:
            conv = 2 * k_heads * dim + v_heads * dim
            plan += [(b + "attn_qkv.weight", (conv, h), four), (b + "attn_gate.weight", (v_heads * dim, h), four),
                     (b + "ssm_beta.weight", (v_heads, h), four), (b + "ssm_alpha.weight", (v_heads, h), four),
                     (b + "ssm_conv1d.weight", (conv, taps), "F32"), (b + "ssm_dt.bias", (v_heads,), "F32"),
                     (b + "ssm_a", (v_heads,), "F32"), (b + "ssm_norm.weight", (dim,), "F32"),
                     (b + "ssm_out.weight", (h, v_heads * dim), wide)]
        else:
            q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
            plan += [(b + "attn_q.weight", (2 * q, h), four), (b + "attn_k.weight", (kv, h), four),
                     (b + "attn_v.weight", (kv, h), wide), (b + "attn_q_norm.weight", (shape.head_dim,), "F32"),
                     (b + "attn_k_norm.weight", (shape.head_dim,), "F32"), (b + "attn_output.weight", (h, q), four)]
        plan += [(b + "post_attention_norm.weight", (h,), "F32")]
        if shape.experts:  # routed experts and a shared one of the same width, its output gated
            e = shape.experts
            plan += [(b + "ffn_gate_inp.weight", (e, h), "F32"), (b + "ffn_gate_exps.weight", (e, f, h), four),
                     (b + "ffn_up_exps.weight", (e, f, h), four), (b + "ffn_down_exps.weight", (e, h, f), wide),
                     (b + "ffn_gate_inp_shexp.weight", (h,), "F32"), (b + "ffn_gate_shexp.weight", (f, h), four),
                     (b + "ffn_up_shexp.weight", (f, h), four), (b + "ffn_down_shexp.weight", (h, f), wide)]
            continue
        plan += [(b + "ffn_gate.weight", (f, h), four), (b + "ffn_up.weight", (f, h), four),
                 (b + "ffn_down.weight", (h, f), wide)]
    plan += [("output_norm.weight", (h,), "F32"), ("output.weight", (shape.vocab, h), output_type)]
    return plan


def qwen35_metadata(w: Any, shape: Shape) -> None:
    k_heads, v_heads, dim, taps = shape.linear
    a = shape.arch
    rotary = shape.head_dim // 4
    w.add_uint32(f"{a}.full_attention_interval", FULL_ATTENTION_INTERVAL)
    w.add_uint32(f"{a}.ssm.conv_kernel", taps)
    w.add_uint32(f"{a}.ssm.state_size", dim)
    w.add_uint32(f"{a}.ssm.group_count", k_heads)
    w.add_uint32(f"{a}.ssm.time_step_rank", v_heads)
    w.add_uint32(f"{a}.ssm.inner_size", v_heads * dim)
    w.add_array(f"{a}.rope.dimension_sections", [11, 11, 10, 0] if rotary == 64 else [rotary // 2, 0, 0, 0])
    return None


def random_blocks(rng: np.random.Generator, rows: int, cols: int, kind: str) -> np.ndarray:
    """``rows x cols`` weights of GGUF type ``kind`` as random block bytes, values of std ~0.02."""
    per, nbytes = BLOCKS[kind]
    n = rows * cols // per
    raw = np.frombuffer(rng.bytes(n * nbytes), np.uint8).reshape(n, nbytes).copy()
    jitter = (0.75 + 0.5 * rng.random(n)).astype(np.float32)
    if kind == "Q4_0":  # d (fp16), 16 bytes of nibbles: w = d * (q - 8), q uniform 0..15 (std 4.6)
        raw[:, :2] = (jitter * (WEIGHT_STD / 4.6)).astype(np.float16).view(np.uint8).reshape(n, 2)
    elif kind == "Q8_0":  # d (fp16), 32 int8: w = d * q, q uniform -128..127 (std 74)
        raw[:, :2] = (jitter * (WEIGHT_STD / 74)).astype(np.float16).view(np.uint8).reshape(n, 2)
    elif kind == "MXFP4":  # E8M0 e, 16 bytes of E2M1 codes: w = value * 2^(e - 127), values of std 2.93
        raw[:, 0] = rng.integers(119, 122, n, dtype=np.uint8)  # 2^-8 .. 2^-6: std ~0.02
    elif kind == "Q4_K":  # d, dmin (fp16), 12 bytes of 6-bit sc and m, nibbles: w = d * sc * q - dmin * m
        d = jitter * (WEIGHT_STD / (4.6 * 31.5))  # sc and m uniform 0..63 (mean 31.5), q 0..15 (std 4.6)
        raw[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(n, 2)
        raw[:, 2:4] = (7.5 * d).astype(np.float16).view(np.uint8).reshape(n, 2)  # mean ~0: dmin * m ~ d * sc * 7.5
    else:  # Q6_K: ql[128] qh[64] scales[16] int8, d (fp16): w = d * sc * (q - 32), q 6-bit (std 18.5)
        raw[:, 192:208] = rng.integers(16, 48, (n, 16), dtype=np.uint8)  # sc mean 32
        raw[:, 208:] = (jitter * (WEIGHT_STD / (18.5 * 32))).astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, cols // per * nbytes)


def write_model(path: Path, shape: Shape, output_type: str, seed: int = 0, mix: str = "q4_0",
                vocab_from_embedded: bool = False) -> dict[str, Any]:
    """Write the GGUF one tensor at a time; returns its size and the seconds it took.
    ``vocab_from_embedded``: the embedded SmolLM2's BPE (``embedded_tokens``) instead of the
    byte-level one."""
    import gguf

    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), shape.arch)
    w.add_name(shape.name + f" random {mix.upper()}")
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_rope_dimension_count(shape.head_dim if shape.arch not in HYBRIDS else shape.head_dim // 4)
    w.add_vocab_size(shape.vocab)
    if shape.arch in HYBRIDS:
        qwen35_metadata(w, shape)
    if shape.head_size:
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
    if shape.experts:
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.experts_used)
        w.add_expert_feed_forward_length(shape.ffn)
        if shape.arch == "qwen35moe":
            w.add_expert_shared_feed_forward_length(shape.ffn)
    if shape.arch == "gpt-oss":
        w.add_sliding_window(GPT_OSS_WINDOW)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    else:
        w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0 if mix == "q4_0" else gguf.LlamaFileType.MOSTLY_Q4_K_M)
    if vocab_from_embedded:
        tokens, types, merges, pre = embedded_tokens(shape.vocab)
    else:
        (tokens, types), merges = tokenizer_tokens(shape.vocab), list(MERGES)
        pre = "qwen2" if shape.arch == "qwen2" else "llama-bpe"
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    eot, _im_start, im_end = (tokens.index(s) for s in SPECIALS)
    w.add_bos_token_id(eot)
    w.add_eos_token_id(im_end)
    w.add_pad_token_id(eot)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)

    plan = tensor_plan(shape, output_type, mix)
    for name, dims, kind in plan:
        if kind == "F32":
            w.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:
            per, nbytes = BLOCKS[kind]
            byte_dims = (*dims[:-1], dims[-1] // per * nbytes)
            w.add_tensor_info(name, byte_dims, np.dtype(np.uint8), int(np.prod(byte_dims)),
                              raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, dims, kind in plan:
        if kind != "F32":
            rows = int(np.prod(dims[:-1]))
            w.write_tensor_data(random_blocks(rng, rows, dims[-1], kind).reshape(*dims[:-1], -1))
        elif name.endswith(".bias"):
            w.write_tensor_data((rng.standard_normal(dims) * WEIGHT_STD).astype(np.float32))
        elif name.endswith("ssm_a"):  # -exp(A_log), A_log uniform in [0, log 16) as Qwen3.5 initialises it
            w.write_tensor_data(-rng.uniform(1.0, 16.0, dims).astype(np.float32))
        elif len(dims) == 2:  # a router: logits of std ~1, so that tokens spread over the experts
            w.write_tensor_data((rng.standard_normal(dims) * (1 / dims[1] ** 0.5)).astype(np.float32))
        else:  # norms: ~1
            w.write_tensor_data((1.0 + 0.05 * rng.standard_normal(dims[0])).astype(np.float32))
    w.close()
    return {"path": str(path), "bytes": path.stat().st_size, "write_s": time.perf_counter() - t0}


# ---- memory of a process group -----------------------------------------------------------------


def group_memory(pgid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssFile (bytes) summed over the processes of group ``pgid``."""
    total = {"rss": 0, "anon": 0, "file": 0, "procs": 0}
    keys = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file"}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:  # fields: state, ppid, pgrp, ...
                continue
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    key = line.split(None, 1)[0]
                    if key in keys:
                        total[keys[key]] += int(line.split()[1]) * 1024
        except (OSError, IndexError, ValueError):
            continue
        total["procs"] += 1
    return total


class RssSampler:
    """Samples ``group_memory`` of a launcher's process group every 0.2 s on one thread
    (``rss-sampler``) from ``start()`` until ``stop()``; ``peak()`` is the highest VmRSS sum
    seen since the last ``reset()``. The group is found when the launcher has a process."""

    def __init__(self, launcher: ServerLauncher) -> None:
        self.launcher = launcher
        self._lock = threading.Lock()  # guards _peak and _last
        self._peak: dict[str, int] = {}
        self._last: dict[str, int] = {}
        self.since = time.perf_counter()  # of the last reset()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler")

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def reset(self) -> None:
        with self._lock:
            self._peak = {}
        self.since = time.perf_counter()

    def peak(self) -> dict[str, int]:
        with self._lock:
            return dict(self._peak)

    def now(self) -> dict[str, int]:
        proc = self.launcher.proc
        return group_memory(proc.pid) if proc is not None and proc.poll() is None else {}

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            m = self.now()
            if not m.get("procs"):
                continue
            with self._lock:
                self._last = m
                if m["rss"] > self._peak.get("rss", -1):
                    self._peak = m


# ---- requests ------------------------------------------------------------------------------------


def prompt_ids(n: int, seed: int, vocab: int) -> list[int]:
    """``n`` token ids of plain words, different for every seed from the first token on."""
    rng = np.random.default_rng(1_000_003 + seed)
    return [int(t) for t in rng.integers(first_word_id(), vocab, n)]


def complete(url: str, model: str, prompt: list[int], max_tokens: int = 1) -> dict[str, Any]:
    """One non-streamed completion; its wall time is the TTFT when ``max_tokens`` is 1."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    wall = time.perf_counter() - t0
    r.raise_for_status()
    usage = r.json().get("usage") or {}
    return {"ttft_s": wall, "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def stream_decode(url: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed completion of exactly ``max_tokens`` tokens (``ignore_eos``). TTFT: the
    first chunk with text; decode tok/s: text chunks after the first over the time from the
    first to the last one (every token of this vocabulary has text; a server sends one chunk
    a token), and over the wall time after the TTFT (``decode_tok_s_e2e``)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    text_chunks = 0
    finish = None
    usage: dict[str, Any] = {}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                finish = choice.get("finish_reason") or finish
                if choice.get("text"):
                    last = time.perf_counter() - t0
                    first = last if first is None else first
                    text_chunks += 1
    end = time.perf_counter() - t0
    tokens = usage.get("completion_tokens") or (max_tokens if finish == "length" else text_chunks)
    out = {"ttft_s": first, "e2e_s": end, "tokens": tokens, "text_chunks": text_chunks, "finish_reason": finish,
           "decode_tok_s": None, "decode_tok_s_e2e": None}
    if first is not None and last is not None and text_chunks > 1 and last > first:
        out["decode_tok_s"] = (text_chunks - 1) / (last - first)
    if first is not None and tokens > 1 and end > first:
        out["decode_tok_s_e2e"] = (tokens - 1) / (end - first)
    return out


def decode_batch(url: str, model: str, prompts: Sequence[list[int]], max_tokens: int) -> dict[str, Any]:
    """``len(prompts)`` streams at once: aggregate tok/s = all tokens / wall time."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: stream_decode(url, model, p, max_tokens), prompts))
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    rates = [r["decode_tok_s"] for r in results if r["decode_tok_s"]]
    return {"streams": len(prompts), "wall_s": wall, "tokens": tokens, "aggregate_tok_s": tokens / wall,
            "per_stream_tok_s": sum(rates) / len(rates) if rates else None, "results": results}


def health(url: str) -> dict[str, Any]:
    return httpx.get(url + "/health", timeout=30).json()


def written_through(url: str, timeout: float = 900.0) -> float:
    """Seconds until a kvcellar server has written the blocks it holds to its SSD tier (at
    once for a server without one, or llama-server), so that a hit measured next does not
    share the CPU with the write-through of the prompt before it."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        ssd = health(url).get("tiers", {}).get("ssd")
        if not ssd or (ssd.get("writer_queue_depth", 0) == 0 and ssd.get("ssd", {}).get("writer_in_flight", 0) == 0):
            break
        time.sleep(0.2)
    return time.perf_counter() - t0


# ---- one server's run ------------------------------------------------------------------------


def timed_start(launcher: ServerLauncher, sampler: RssSampler) -> dict[str, Any]:
    """Start, timing until the ready check holds; the peak RSS while starting and RSS once up."""
    sampler.reset()
    t0 = time.perf_counter()
    launcher.start(READY_TIMEOUT_S)
    out = {"ready_s": time.perf_counter() - t0, "peak": sampler.peak()}
    time.sleep(1.0)
    out["after"] = sampler.now()
    if out["after"].get("rss", 0) > out["peak"].get("rss", 0):  # up before the first sample
        out["peak"] = out["after"]
    print(f"  {launcher.name} up in {out['ready_s']:.1f} s, peak RSS {gb(out['peak'].get('rss'))} GB, "
          f"then {gb(out['after'].get('rss'))} GB", flush=True)
    return out


def serve_phase(url: str, model: str, sampler: RssSampler, args: argparse.Namespace, vocab: int, *,
                batch: bool) -> dict[str, Any]:
    """Cold prefill per length, the RAM hit of the longest, decode at 1 (and ``--batch``) streams."""
    out: dict[str, Any] = {"prefill": {}}
    sampler.reset()
    for i, n in enumerate(args.lengths):
        r = complete(url, model, prompt_ids(n, 100 + i, vocab))
        r["prefill_tok_s"] = (r["prompt_tokens"] or n) / r["ttft_s"]
        out["prefill"][str(n)] = r
        print(f"  cold {n}: TTFT {r['ttft_s']:.2f} s ({r['prefill_tok_s']:.0f} tok/s), "
              f"prompt_tokens {r['prompt_tokens']}", flush=True)
    longest = max(args.lengths)
    out["written_through_s"] = written_through(url)
    out["ram_hit"] = complete(url, model, prompt_ids(longest, 100 + args.lengths.index(longest), vocab))
    print(f"  RAM hit {longest}: TTFT {out['ram_hit']['ttft_s']:.3f} s, "
          f"cached {out['ram_hit']['cached_tokens']} (after {out['written_through_s']:.1f} s of write-through)",
          flush=True)
    out["decode_1"] = stream_decode(url, model, prompt_ids(args.decode_prompt, 500, vocab), args.decode_tokens)
    print(f"  decode 1 stream: {fmt(out['decode_1']['decode_tok_s'])} tok/s", flush=True)
    if batch:
        out["decode_batch"] = decode_batch(url, model, [prompt_ids(args.decode_prompt, 600 + k, vocab)
                                                        for k in range(args.batch)], args.decode_tokens)
        print(f"  decode {args.batch} streams: {fmt(out['decode_batch']['aggregate_tok_s'])} tok/s aggregate",
              flush=True)
    out["serving_peak"] = sampler.peak()
    out["serving_after"] = sampler.now()
    return out


def failed(out: dict[str, Any], exc: BaseException, sampler: RssSampler, launcher: ServerLauncher) -> None:
    """Record why a side stopped, when, and the peak RSS of the phase it stopped in."""
    out["error"] = f"{type(exc).__name__}: {exc}".split("\n")[0]
    out["interrupted"] = isinstance(exc, KeyboardInterrupt)
    out["error_phase"] = {"after_s": time.perf_counter() - sampler.since, "peak": sampler.peak()}
    print(f"{launcher.name} failed: {out['error']} ({out['error_phase']['after_s']:.0f} s into the phase, peak RSS "
          f"{gb(out['error_phase']['peak'].get('rss'))} GB)\n{launcher.log_tail(3000)}", flush=True)


def drop_kv_pages(cache_dir: Path) -> int:
    """posix_fadvise(DONTNEED) on every file of ``cache_dir`` but its prepared models."""
    os.sync()
    files = 0
    for dirpath, dirs, names in os.walk(cache_dir):
        if Path(dirpath) == cache_dir and "models" in dirs:
            dirs.remove("models")
        for name in names:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                files += 1
            finally:
                os.close(fd)
    return files


def run_kvcellar(gguf_path: Path, work: Path, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    cache_dir = work / "kvcellar-cache"
    flags = ["--model", str(gguf_path), "--weights", args.weights, "--kv-cache-gb", str(args.kv_cache_gb),
             *args.kvcellar_args.split()]
    base = args.kvcellar_cmd.split() if args.kvcellar_cmd else kvcellar_command()

    def command(port: int) -> list[str]:
        return [*base, "serve", "--port", str(port), "--cache-dir", str(cache_dir), *flags]

    launcher = ServerLauncher(command, work / "kvcellar.log", name="kvcellar")
    sampler = RssSampler(launcher).start()
    out: dict[str, Any] = {"command": " ".join(command(0))}
    try:
        print("kvcellar: 1st start (preparation)", flush=True)
        out["start_1"] = timed_start(launcher, sampler)
        h = health(launcher.url)
        out["weights"], out["linears"], out["cpu_kernels"] = h.get("weights"), h.get("linears"), h.get("cpu_kernels")
        model = httpx.get(launcher.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        print(f"  weights {out['weights']}, linears {json.dumps(out['linears'])}", flush=True)
        launcher.stop()
        print("kvcellar: 2nd start", flush=True)
        out["start_2"] = timed_start(launcher, sampler)
        out["serve"] = serve_phase(launcher.url, model, sampler, args, vocab, batch=True)
        launcher.stop()
        out["dropped_files"] = drop_kv_pages(cache_dir)
        print("kvcellar: restart (SSD)", flush=True)
        out["start_3"] = timed_start(launcher, sampler)
        longest = max(args.lengths)
        before = flat_counters(health(launcher.url))
        out["restart_hit"] = complete(launcher.url, model,
                                      prompt_ids(longest, 100 + args.lengths.index(longest), vocab))
        after = flat_counters(health(launcher.url))
        out["restart_hit"]["tiers"] = {k: after.get(k, 0) - before.get(k, 0) for k in TIER_COUNTERS}
        print(f"  restart hit {longest}: TTFT {out['restart_hit']['ttft_s']:.3f} s, "
              f"cached {out['restart_hit']['cached_tokens']}, tiers {out['restart_hit']['tiers']}", flush=True)
        out["health_end"] = health(launcher.url)
    except (LaunchError, httpx.HTTPError, KeyboardInterrupt) as exc:
        failed(out, exc, sampler, launcher)
    finally:
        launcher.stop()
        sampler.stop()
    return out


def peer_command(gguf_path: Path, args: argparse.Namespace, slots: int) -> Callable[[int], list[str]]:
    ctx = max(args.peer_ctx, max(args.lengths) + 512)
    return lambda port: [str(args.peer_bin), "-m", str(gguf_path), "--host", "127.0.0.1", "--port", str(port),
                         "-c", str(ctx), "-np", str(slots), "-t", str(args.threads), "--cache-reuse", "256",
                         "--no-webui", "--alias", "bench", *args.peer_args.split()]


def run_peer(gguf_path: Path, work: Path, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    out: dict[str, Any] = {"command": " ".join(peer_command(gguf_path, args, 1)(0))}
    launcher = ServerLauncher(peer_command(gguf_path, args, 1), work / "llama-server.log", name="llama-server")
    sampler = RssSampler(launcher).start()
    try:
        print("llama-server: start (-np 1)", flush=True)
        out["start_1"] = timed_start(launcher, sampler)
        # kvcellar runs every path once before it answers; llama-server gets one short request
        out["warmup"] = complete(launcher.url, "bench", prompt_ids(16, 999, vocab))
        out["serve"] = serve_phase(launcher.url, "bench", sampler, args, vocab, batch=False)
        launcher.stop()
        print(f"llama-server: restart with -np {args.batch}", flush=True)
        launcher.command = peer_command(gguf_path, args, args.batch)
        out["start_2"] = timed_start(launcher, sampler)
        out["serve"]["decode_batch"] = decode_batch(
            launcher.url, "bench", [prompt_ids(args.decode_prompt, 600 + k, vocab) for k in range(args.batch)],
            args.decode_tokens)
        print(f"  decode {args.batch} streams: {fmt(out['serve']['decode_batch']['aggregate_tok_s'])} tok/s "
              f"aggregate", flush=True)
    except (LaunchError, httpx.HTTPError, KeyboardInterrupt) as exc:
        failed(out, exc, sampler, launcher)
    finally:
        launcher.stop()
        sampler.stop()
    return out


# ---- the table ---------------------------------------------------------------------------------


def gb(n: int | None) -> str:
    return "-" if not n else f"{n / 1e9:.2f}"


def fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def get(d: dict[str, Any], *path: str) -> Any:
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def rss_cell(m: dict[str, Any] | None) -> str:
    if not m or not m.get("rss"):
        return "-"
    return f"{gb(m['rss'])} (anon {gb(m['anon'])}, file {gb(m['file'])})"


def mix_label(args: argparse.Namespace) -> str:
    return "MXFP4 experts, Q8_0 attention" if args.arch == "gpt-oss" else args.mix.upper()


def result_table(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    kvc, peer = result.get("kvcellar") or {}, result.get("llama_server") or {}
    longest = max(args.lengths)

    def both(f: Callable[[dict[str, Any]], str], peer_f: Callable[[dict[str, Any]], str] | None = None) -> list[str]:
        return [f(kvc) if kvc else "-", (peer_f or f)(peer) if peer else "-"]

    def secs(*path: str) -> Callable[[dict[str, Any]], str]:
        return lambda r: fmt(get(r, *path), 2)

    rows = [["first start (kvcellar: GGUF preparation), s", *both(secs("start_1", "ready_s"))],
            ["first start: peak RSS, GB", *both(lambda r: rss_cell(get(r, "start_1", "peak")))],
            ["second start, s", *both(secs("start_2", "ready_s"), lambda r: "same as first (mmap)")],
            ["second start: peak RSS, GB", *both(lambda r: rss_cell(get(r, "start_2", "peak")),
                                                 lambda r: "-")],
            ["RSS after start, GB", *both(lambda r: rss_cell(get(r, "start_2", "after")),
                                          lambda r: rss_cell(get(r, "start_1", "after")))],
            ["peak RSS while serving, GB", *both(lambda r: rss_cell(get(r, "serve", "serving_peak")))],
            ["weights / linears", *both(lambda r: f"{r.get('weights')} / {json.dumps(r.get('linears'))}",
                                        lambda r: f"{mix_label(args)} (ggml)")]]
    for n in args.lengths:
        rows.append([f"cold {n} tokens: TTFT s (prefill tok/s)",
                     *both(lambda r, n=n: f"{fmt(get(r, 'serve', 'prefill', str(n), 'ttft_s'), 2)} "
                                          f"({fmt(get(r, 'serve', 'prefill', str(n), 'prefill_tok_s'), 0)})")])
    rows += [[f"RAM hit {longest}: TTFT s", *both(secs("serve", "ram_hit", "ttft_s"))],
             [f"restart (SSD) hit {longest}: TTFT s", *both(secs("restart_hit", "ttft_s"),
                                                            lambda r: "n/a (no cache across restarts)")],
             ["decode, 1 stream, tok/s", *both(lambda r: fmt(get(r, "serve", "decode_1", "decode_tok_s")))],
             [f"decode, {args.batch} streams: aggregate tok/s (per stream)",
              *both(lambda r: f"{fmt(get(r, 'serve', 'decode_batch', 'aggregate_tok_s'))} "
                              f"({fmt(get(r, 'serve', 'decode_batch', 'per_stream_tok_s'))})")]]
    notes = [f"{result['model']['name']}, {gb(result['model']['bytes'])} GB GGUF ({mix_label(args)}, output "
             f"{args.output_type}), random weights; {args.threads} threads for llama-server",
             machine_line(result["machine"])]
    if kvc.get("restart_hit"):
        tiers = get(kvc, "restart_hit", "tiers") or {}
        notes.append(f"kvcellar cached tokens: RAM hit {get(kvc, 'serve', 'ram_hit', 'cached_tokens')}, "
                     f"restart hit {get(kvc, 'restart_hit', 'cached_tokens')} (from SSD "
                     f"{fmt(tiers.get('sched_lower_tier_hit_tokens'), 0)} tokens, "
                     f"{fmt((tiers.get('ssd_load_bytes') or 0) / 1e6)} MB read); "
                     f"restart start {fmt(get(kvc, 'start_3', 'ready_s'), 1)} s")
    notes += [f"{side} failed: {r['error']} ({fmt(get(r, 'error_phase', 'after_s'), 0)} s into its phase, peak "
              f"RSS {rss_cell(get(r, 'error_phase', 'peak'))} GB)"
              for side, r in (("kvcellar", kvc), ("llama-server", peer)) if r.get("error")]
    return table("kvcellar beside llama-server", ["", "kvcellar", "llama-server"], rows, notes)


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=sorted(SHAPES), default="qwen2",
                   help="qwen2: Qwen2.5-7B, llama: Llama-3.1-8B, qwen3moe: Qwen3-30B-A3B, gpt-oss: gpt-oss-20b "
                   "(MXFP4 experts, Q8_0 attention and embedding, whatever --mix), qwen35: Qwen3.5-9B (hybrid), "
                   "qwen35-2b: Qwen3.5-2B, qwen35moe: Qwen3.5-35B-A3B (hybrid MoE)")
    p.add_argument("--vocab-from-embedded", action="store_true",
                   help="the embedded SmolLM2's BPE (merges, pre-tokenizer) padded to the shape's vocabulary, "
                   "for prompts of real text (bench_agent_replay.py --model)")
    p.add_argument("--small", action="store_true", help="tiny shapes for a smoke run: " + json.dumps(SMALL))
    for key in ("hidden", "ffn", "layers", "heads", "kv_heads", "vocab"):
        p.add_argument("--" + key.replace("_", "-"), type=int, help="override the shape's " + key)
    p.add_argument("--output-type", choices=("Q6_K", "Q8_0", "Q4_0"),
                   help="default Q6_K; gpt-oss: Q8_0 (its 2880 inputs are no multiple of Q6_K's 256)")
    p.add_argument("--mix", choices=("q4_0", "q4_k_m"), default="q4_0",
                   help="the linears' and embedding's types: all Q4_0, or a Q4_K_M-like mix (Q4_K, some Q6_K)")
    p.add_argument("--gguf", type=Path, help="the model file: reused if it exists, else written there "
                   "(default: a temporary file, deleted at the end unless --keep-gguf)")
    p.add_argument("--keep-gguf", action="store_true")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[512, 2048],
                   help="cold prompt lengths; the longest is also the RAM and restart hit (default 512,2048)")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--decode-prompt", type=int, default=32, help="prompt tokens of each decode stream")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--weights", default="auto")
    p.add_argument("--kv-cache-gb", type=float, default=2.0)
    p.add_argument("--kvcellar-args", default="", help="more `kvcellar serve` flags, word-split")
    p.add_argument("--kvcellar-cmd", default="", help="the command that runs kvcellar, word-split "
                   "(default: the kvcellar script beside this Python)")
    p.add_argument("--peer-bin", type=Path, default=PEER_BIN)
    p.add_argument("--peer-ctx", type=int, default=4096)
    p.add_argument("--peer-args", default="", help="more llama-server flags, word-split")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--skip-kvcellar", action="store_true")
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--work-dir", type=Path, help="logs and the kvcellar cache dir (default: a temp dir, kept)")
    p.add_argument("--out", type=Path, help="write the JSON result here")
    return p.parse_args(argv)


def save(result: dict[str, Any], path: Path | None) -> None:
    """The result so far (a run cut short keeps what it measured)."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1, default=str))


def interrupted(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through the launchers' stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.output_type = args.output_type or ("Q8_0" if args.arch == "gpt-oss" else "Q6_K")
    signal.signal(signal.SIGTERM, interrupted)
    shape = replace(SHAPES[args.arch], **(SMALL if args.small else {}))
    shape = replace(shape, **{k: v for k in SMALL if (v := getattr(args, k)) is not None})
    if args.small or any(getattr(args, k) is not None for k in SMALL):
        shape = replace(shape, name=shape.name.replace("-shaped", "") + f"-small-{shape.hidden}x{shape.layers}")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="kvc-big-model-"))
    work.mkdir(parents=True, exist_ok=True)
    gguf_path = args.gguf or work / f"{shape.arch}-{shape.hidden}x{shape.layers}-{args.mix}.gguf"
    print(f"work dir {work}", flush=True)

    result: dict[str, Any] = {"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()},
                              "shape": asdict(shape), "argv": sys.argv}
    try:
        if gguf_path.exists():
            result["model"] = {"path": str(gguf_path), "bytes": gguf_path.stat().st_size, "write_s": None}
            print(f"reusing {gguf_path}", flush=True)
        else:
            print(f"writing {shape.name} to {gguf_path}", flush=True)
            result["model"] = write_model(gguf_path, shape, args.output_type, mix=args.mix,
                                          vocab_from_embedded=args.vocab_from_embedded)
            print(f"  {gb(result['model']['bytes'])} GB in {result['model']['write_s']:.1f} s", flush=True)
        result["model"]["name"] = shape.name
        save(result, args.out)
        if not args.skip_kvcellar:
            result["kvcellar"] = run_kvcellar(gguf_path, work, args, shape.vocab)
            save(result, args.out)
        if not args.skip_peer and not (result.get("kvcellar") or {}).get("interrupted"):
            result["llama_server"] = run_peer(gguf_path, work, args, shape.vocab)
    finally:
        if not args.keep_gguf and args.gguf is None and gguf_path.exists():
            gguf_path.unlink()
        shutil.rmtree(work / "kvcellar-cache", ignore_errors=True)
    t = result_table(result, args)
    result["tables"] = [t]
    print("\n" + format_table(t))
    if args.out:
        save(result, args.out)
        print(f"\nwrote {args.out}")
    return 1 if any((result.get(k) or {}).get("error") for k in ("kvcellar", "llama_server")) else 0


if __name__ == "__main__":
    sys.exit(main())
