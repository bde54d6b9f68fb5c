"""The identity of everything that changes KV: the namespace of cached blocks.

Two engines share blocks only if their fingerprints are equal: same weights, tokenizer and
chat template, compute dtype, KV dtype, block size and KV quantization (bits and group
size; 16-bit KV adds neither, so its fingerprints are those of before quantized KV), and the
revision of kvcellar's own kernels' arithmetic where they compute the KV (``arithmetic``:
another revision computes other bits, and a hit must give the bits recomputing gives; a
hybrid's recurrence and routed experts' gating on those kernels likewise), and the engine
computing it (``--engine mlx``: MLX's arithmetic, not torch's). The
RAM tier folds it into the root of every digest chain; the SSD tier uses it as its directory
name (adding its own format version), so a mismatch is a miss, never an error.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kv_descriptor(
    *, weights_id: str, tokenizer_id: str, dtype: torch.dtype, kv_dtype: torch.dtype, block_size: int,
    model_name: str = "", kv_bits: int = 16, kv_group_size: int = 0, arithmetic: str = "", recurrence: str = "",
    experts: str = "", engine: str = "torch",
) -> dict[str, Any]:
    quantized = {"kv_bits": kv_bits, "kv_group_size": kv_group_size} if kv_bits != 16 else {}
    own = {"arithmetic": arithmetic} if arithmetic else {}
    if recurrence:  # a hybrid model's linear attention on kvcellar's kernel: its numbers move the KV
        own["recurrence"] = recurrence
    if experts:  # MoE blocks routed and gated by kvcellar's kernels: their rounding is their own
        own["experts"] = experts
    if engine != "torch":  # another framework's arithmetic (the torch engine's fingerprints name none)
        own["engine"] = engine
    return {
        "weights": weights_id,
        "tokenizer": tokenizer_id,
        "dtype": dtype_name(dtype),
        "kv_dtype": dtype_name(kv_dtype),
        "block_size": block_size,
        **quantized,
        **own,
        "model_name": model_name,  # informational; not part of the fingerprint
    }


def kv_fingerprint(descriptor: dict[str, Any]) -> str:
    identity = {k: v for k, v in descriptor.items() if k != "model_name"}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]
