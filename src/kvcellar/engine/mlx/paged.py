"""The cache object mlx-lm's attention layers see, over kvcellar's paged block pool.

mlx-lm's models read ``offset`` (RoPE positions: an int, or one per row of a batch),
``update_and_fetch(keys, values)`` and ``make_mask(...)`` from each layer's cache. Here
``update_and_fetch`` writes the step's K/V into the pool slots the scheduler gave them
(quantized there under ``kv_bits``) and returns each row's whole context read back from its
blocks, the step's own tokens included: every token attends to the KV the pool holds, whoever
computed it, so a cache hit gives what recomputing gives. The mask is built from each query's
position against the gathered key positions (padding of shorter rows and any sliding window).

Arrays cross between MLX and torch through numpy (bf16 as its bits): the pool is host memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
import torch

from kvcellar.cache.kv_pool import KVPool


def to_torch(a: mx.array) -> torch.Tensor:
    """``a`` as a torch CPU tensor of the same dtype (a copy)."""
    if a.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(a.view(mx.uint16))).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))


def to_mx(t: torch.Tensor) -> mx.array:
    """``t`` as an MLX array of the same dtype (a copy)."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return mx.array(t.view(torch.uint16).numpy()).view(mx.bfloat16)
    return mx.array(t.numpy())


@dataclass
class StepSlots:
    """Where one forward call's tokens go and what they see: ``blocks``/``offsets`` per token
    (row-major over ``[B, T]``), each row's block table ``tables [B, W]`` and each query's
    position ``positions [B, T]``."""

    blocks: torch.Tensor
    offsets: torch.Tensor
    tables: torch.Tensor
    positions: np.ndarray

    @property
    def rope_offset(self) -> int | mx.array:
        """mlx-lm's ``offset``: the first query position, per row where rows differ."""
        firsts = self.positions[:, 0]
        if len(firsts) == 1:
            return int(firsts[0])
        return mx.array(firsts.astype(np.int32))


class PagedLayerCache:
    """Layer ``layer``'s view of the pool for the forward call ``slots`` describes."""

    def __init__(self, pool: KVPool, layer: int, slots: StepSlots) -> None:
        self.pool = pool
        self.layer = layer
        self.slots = slots
        self.offset = slots.rope_offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        b, heads, t, _ = keys.shape
        dtype = keys.dtype

        def rows(x: mx.array) -> torch.Tensor:  # [B, H, T, D] -> [B * T, H, D]
            return to_torch(x.transpose(0, 2, 1, 3).reshape(b * t, heads, x.shape[-1]))

        self.pool.write(self.layer, self.slots.blocks, self.slots.offsets, rows(keys), rows(values))
        k, v = self.pool.gather(self.layer, self.slots.tables)  # [B, H, W * block_size, D]
        return to_mx(k).astype(dtype), to_mx(v).astype(dtype)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None,
                  **_: Any) -> mx.array:
        """``[B, 1, T, K]``: a query sees the gathered keys at or before its position (and,
        with a window, within its last ``window_size``)."""
        keys = self.slots.tables.shape[1] * self.pool.layout.block_size
        k_pos = mx.arange(keys)[None, None, None, :]
        q_pos = mx.array(self.slots.positions.astype(np.int32))[:, None, :, None]
        mask = k_pos <= q_pos
        if window_size:
            mask = mask & (k_pos > q_pos - window_size)
        return mask
