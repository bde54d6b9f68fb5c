"""The KV block pool: one preallocated tensor holding every layer's K and V, in blocks.

Layout ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``: block-major, so
one block (all layers, K and V) is a single contiguous region. That makes saving a block
to a lower tier one copy and loading one ``readinto`` straight into the pool; gathering a
sequence's blocks for one layer is an ``index_select`` over the block dimension of a
strided view, measured as fast as a layer-major layout here.

Keys are stored after RoPE (the model applies it before attention). The pool is zeroed at
allocation: masked-out positions must hold finite values (0 x NaN is NaN in softmax @ V).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * torch.tensor([], dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size

    @classmethod
    def from_model_config(cls, config: object, block_size: int, dtype: torch.dtype) -> KVLayout:
        text = getattr(config, "get_text_config", lambda: config)()
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        return cls(text.num_hidden_layers, kv_heads, head_dim, block_size, dtype)


class KVPool:
    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = device
        self.data = torch.zeros((num_blocks, *layout.block_shape), dtype=layout.dtype, device=device)
        # Per-layer views [num_blocks, block_size, kv_heads, head_dim]; indexing them does not copy.
        self._k = [self.data[:, i, 0] for i in range(layout.num_layers)]
        self._v = [self.data[:, i, 1] for i in range(layout.num_layers)]

    @staticmethod
    def blocks_for_budget(layout: KVLayout, budget_bytes: int) -> int:
        return max(2, budget_bytes // layout.bytes_per_block)

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor,
              key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``key``/``value`` ``[T, kv_heads, head_dim]`` at (block, offset) pairs."""
        self._k[layer][blocks, offsets] = key
        self._v[layer][blocks, offsets] = value

    def gather(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``block_table [B, n]`` as ``[B, kv_heads, n * block_size, head_dim]`` views."""
        b, n = block_table.shape
        flat = block_table.reshape(-1)
        shape = (b, n * self.layout.block_size, self.layout.num_kv_heads, self.layout.head_dim)
        k = self._k[layer].index_select(0, flat).view(shape).transpose(1, 2)
        v = self._v[layer].index_select(0, flat).view(shape).transpose(1, 2)
        return k, v

    def copy_block(self, src: int, dst: int) -> None:
        self.data[dst].copy_(self.data[src])

    def block(self, block_id: int) -> torch.Tensor:
        """One block's storage (all layers, K and V), a contiguous view."""
        return self.data[block_id]
