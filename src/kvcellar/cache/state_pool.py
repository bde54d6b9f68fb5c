"""The recurrent-state pool of hybrid models: each running sequence's linear-attention state.

A Gated DeltaNet layer (Qwen3.5/3.6) carries, per sequence, the last ``conv_kernel - 1``
inputs of its causal convolution and a recurrent state ``[value_heads, key_dim, value_dim]``
that every token updates. Unlike KV, that state after token L cannot be rebuilt from blocks:
it is one slot per sequence, overwritten in place, always float32 (it accumulates over the
whole sequence). ``StatePool`` holds one slot per sequence the scheduler may run at once,
in two preallocated tensors (``conv [layers, slots, channels, kernel - 1]``, ``recurrent
[layers, slots, heads, key_dim, value_dim]``); the prefix cache hands a sequence a slot when
it admits it and takes it back when it releases the sequence. The tensors are allocated
empty and a slot is zeroed when it is handed out: pages of slots never used are never
touched, so the pool costs what the concurrency it served needed.

Threading: not thread-safe; only the engine thread calls in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

STATE_DTYPE = torch.float32


@dataclass(frozen=True)
class StateLayout:
    num_layers: int  # linear-attention layers
    conv_channels: int  # query, key and value channels, convolved together
    conv_kernel: int
    heads: int  # value heads (key heads are repeated to them)
    key_dim: int
    value_dim: int

    @property
    def bytes_per_slot(self) -> int:
        per_layer = self.conv_channels * (self.conv_kernel - 1) + self.heads * self.key_dim * self.value_dim
        return self.num_layers * per_layer * STATE_DTYPE.itemsize

    @classmethod
    def from_model_config(cls, config: Any) -> StateLayout | None:
        """The layout of a hybrid model's states, or None for a model without linear attention."""
        text = getattr(config, "get_text_config", lambda: config)()
        layers = sum(1 for t in getattr(text, "layer_types", None) or () if t == "linear_attention")
        if not layers:
            return None
        key_dim = int(text.linear_key_head_dim) * int(text.linear_num_key_heads)
        value_dim = int(text.linear_value_head_dim) * int(text.linear_num_value_heads)
        return cls(layers, 2 * key_dim + value_dim, int(text.linear_conv_kernel_dim), int(text.linear_num_value_heads),
                   int(text.linear_key_head_dim), int(text.linear_value_head_dim))


class OutOfStateSlotsError(RuntimeError):
    """``acquire`` found every slot taken (a caller bug: the scheduler admits at most ``slots``)."""


class StatePool:
    def __init__(self, layout: StateLayout, slots: int, device: torch.device | str = "cpu") -> None:
        self.layout = layout
        self.slots = slots
        self.device = torch.device(device)
        lay = layout
        self.conv = torch.empty((lay.num_layers, slots, lay.conv_channels, lay.conv_kernel - 1),
                                dtype=STATE_DTYPE, device=self.device)
        self.recurrent = torch.empty((lay.num_layers, slots, lay.heads, lay.key_dim, lay.value_dim),
                                     dtype=STATE_DTYPE, device=self.device)
        self._free = list(range(slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        """A zeroed slot: the state before a sequence's first token."""
        if not self._free:
            raise OutOfStateSlotsError(f"all {self.slots} state slots are taken")
        slot = self._free.pop()
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.slots:
            raise AssertionError(f"state slot {slot} released but not held")
        self._free.append(slot)
