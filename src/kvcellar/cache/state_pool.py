"""The recurrent-state pool of hybrid models: each running sequence's linear-attention state,
and snapshots of it that let a later request resume where an earlier one was.

A Gated DeltaNet layer (Qwen3.5/3.6) carries, per sequence, the last ``conv_kernel - 1``
inputs of its causal convolution and a recurrent state ``[value_heads, key_dim, value_dim]``
that every token updates. Unlike KV, that state after token L cannot be rebuilt from blocks:
a prefix is reusable only where the state after it was kept. ``StatePool`` holds slots of
every linear-attention layer's state (always float32: it accumulates over the whole
sequence) in two preallocated tensors (``conv [layers, slots, channels, kernel - 1]``,
``recurrent [layers, slots, heads, key_dim, value_dim]``). A slot is

* a running sequence's live state, zeroed or restored from a snapshot when it is admitted;
* its checkpoint: the state at the last block boundary it crossed (the forward copies it
  there in the step that crosses it, ``engine/deltanet.py``);
* its history checkpoint: a chat prompt's state at the last boundary before its generation
  prompt (``history_point``), where the conversation's next turn resumes when its template
  renders the reply otherwise than the model wrote it;
* the state before a speculative verification (``take_verify_slot``), from which the engine rewinds
  the live state to the last drafted token the model agreed with (``ModelRunner.rewind``);
  these slots are apart from the free ones, for a step's verifications only: one never takes
  a slot an admission or a snapshot needs;
* or a stored snapshot: a checkpoint handed over when the prompt's prefill is done (the history
  one too), every ``snapshot_every_blocks`` blocks, and when the sequence is released (a
  generation's end: an agent's next turn starts right there), keyed by the digest of the block
  before the boundary, which chains every token before it (``cache/hashing.py``).

Snapshots are evicted least recently used first beyond ``max_snapshots`` (``on_evict`` sees each
before its slot is reused: the tiers below RAM may keep it, ``cache/tiering.py``), and dropped
(``discard``) when the block they end is dropped from a cache that has no tier below RAM: a
snapshot is worthless without its chain's blocks. A slot's bytes
as the tiers store them (``export``/``restore``): its conv inputs, then its recurrent state, each
``[layers, ...]`` in C order. The tensors are
allocated empty and a slot is written before it is read: pages of slots never used are
never touched, so the pool costs what was used of it.

Threading: not thread-safe; only the engine thread calls in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvcellar.stats import Stats, counter, gauge

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
    """``acquire`` found every slot taken (a caller bug: slots are sized for the sequences the
    scheduler may admit, two each, and the snapshots kept)."""


@dataclass
class StateStats(Stats):
    PREFIX: ClassVar[str] = "state_"
    snapshots_stored: int = counter()  # checkpoints kept as snapshots
    snapshots_loaded: int = counter()  # admissions that resumed from a snapshot
    snapshots_missed: int = counter()  # admissions with cached blocks but no snapshot at their end
    snapshots_evicted: int = counter()
    snapshots_unreachable: int = counter()  # dropped with their chain's block: nothing could resume from them
    resume_distance_tokens: int = counter()  # cached-block tokens past the snapshot resumed from, recomputed
    snapshots: int = gauge()
    snapshot_bytes: int = gauge()  # bytes of one snapshot


@dataclass(frozen=True)
class Snapshot:
    slot: int
    tokens: int  # the state after this many tokens
    block_tokens: tuple[int, ...] = ()  # the token ids of the block before the boundary (what a tier checks)


def capture_point(start: int, end: int, prompt_tokens: int, block_size: int) -> int | None:
    """The block boundary a step over tokens ``[start, end)`` checkpoints: the last one it
    crosses, within a prompt no further than its last token's start (the same prompt again
    must still compute that token), or None."""
    limit = min(end, prompt_tokens - 1) if start < prompt_tokens else end
    boundary = limit // block_size * block_size
    return boundary if boundary > start else None


def history_point(history_tokens: int | None, prompt_tokens: int, block_size: int) -> int | None:
    """The block boundary within a chat prompt's history (its tokens before the generation
    prompt) where a sequence also keeps a snapshot, or None: history not known, or no boundary
    before the prompt's own last one (``capture_point``'s, which a snapshot covers already)."""
    if history_tokens is None:
        return None
    boundary = history_tokens // block_size * block_size
    return boundary if 0 < boundary < (prompt_tokens - 1) // block_size * block_size else None


class StatePool:
    def __init__(self, layout: StateLayout, slots: int, device: torch.device | str = "cpu", *,
                 max_snapshots: int = 0, draft_slots: int = 0) -> None:
        """``slots``: live and checkpoint slots (two per sequence that may run at once); the
        pool adds ``max_snapshots`` for the snapshots it keeps and ``draft_slots`` for a step's
        speculative verifications."""
        self.layout = layout
        self.max_snapshots = max_snapshots
        self.draft_slots = draft_slots
        self.slots = slots + max_snapshots + draft_slots
        self.device = torch.device(device)
        lay = layout
        self.conv = torch.empty((lay.num_layers, self.slots, lay.conv_channels, lay.conv_kernel - 1),
                                dtype=STATE_DTYPE, device=self.device)
        self.recurrent = torch.empty((lay.num_layers, self.slots, lay.heads, lay.key_dim, lay.value_dim),
                                     dtype=STATE_DTYPE, device=self.device)
        shared = self.slots - draft_slots
        self._free = list(range(shared - 1, -1, -1))
        self._drafts = list(range(self.slots - 1, shared - 1, -1))
        self._stored: OrderedDict[bytes, Snapshot] = OrderedDict()  # first = least recently used
        self.stats = StateStats(snapshot_bytes=layout.bytes_per_slot)
        self.on_evict: Callable[[bytes, Snapshot], None] | None = None  # before the slot is freed

    @property
    def num_free(self) -> int:
        """Slots neither held nor storing a snapshot."""
        return len(self._free)

    @property
    def num_held(self) -> int:
        """Slots held by sequences (live or checkpoint)."""
        return self.slots - self.draft_slots - len(self._free) - len(self._stored)

    def acquire(self, zeroed: bool = True) -> int:
        """A slot; ``zeroed``: holding the state before a sequence's first token."""
        if not self._free and self._stored:
            self._evict()
        if not self._free:
            raise OutOfStateSlotsError(f"all {self.slots} state slots are taken")
        slot = self._free.pop()
        if zeroed:
            self.conv[:, slot].zero_()
            self.recurrent[:, slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.slots - self.draft_slots:
            raise AssertionError(f"state slot {slot} released but not held")
        self._free.append(slot)

    @property
    def drafts_free(self) -> int:
        """Verification slots not taken this step."""
        return len(self._drafts)

    def take_verify_slot(self) -> int | None:
        """A verification slot, held until ``return_verify_slots``; None if all are taken."""
        return self._drafts.pop() if self._drafts else None

    def return_verify_slots(self, slots: tuple[int, ...]) -> None:
        shared = self.slots - self.draft_slots
        if any(s in self._drafts or not shared <= s < self.slots for s in slots):
            raise AssertionError(f"draft slots {slots} returned but not taken")
        self._drafts.extend(slots)

    def copy(self, src: int, dst: int) -> None:
        self.conv[:, dst].copy_(self.conv[:, src])
        self.recurrent[:, dst].copy_(self.recurrent[:, src])

    def _as_bytes(self, slot: int, data: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(the slot's part, the same part's place in ``data``, a slot's bytes), in the order
        the tiers store them: conv inputs, then recurrent state."""
        out, pos = [], 0
        for part in (self.conv[:, slot], self.recurrent[:, slot]):
            n = part.numel() * part.element_size()
            out.append((part, data[pos:pos + n].view(STATE_DTYPE).view(part.shape)))
            pos += n
        return out

    def export(self, slot: int) -> torch.Tensor:
        """The state in ``slot`` as bytes (a new CPU tensor, ``layout.bytes_per_slot`` long)."""
        out = torch.empty(self.layout.bytes_per_slot, dtype=torch.uint8)
        for part, place in self._as_bytes(slot, out):
            place.copy_(part)
        return out

    def staging(self) -> torch.Tensor:
        """A CPU buffer for one slot's bytes (a load from a tier reads into it)."""
        return torch.empty(self.layout.bytes_per_slot, dtype=torch.uint8)

    def restore(self, slot: int, data: torch.Tensor) -> None:
        """Put ``export``'s bytes back, into ``slot``."""
        if data.dtype != torch.uint8 or data.numel() != self.layout.bytes_per_slot:
            raise ValueError(f"a state of {self.layout.bytes_per_slot} bytes, got {data.dtype} {tuple(data.shape)}")
        for part, place in self._as_bytes(slot, data):
            part.copy_(place)

    # ---- snapshots ----------------------------------------------------------------------

    def store(self, key: bytes, slot: int, tokens: int, block_tokens: tuple[int, ...] = ()) -> bool:
        """Keep the state in ``slot`` (the pool takes it) as the snapshot after ``tokens``
        tokens of the chain ``key`` ends (``block_tokens``: the ids of its last block). False
        (and the slot freed) if one is kept already."""
        if key in self._stored or self.max_snapshots == 0:
            self.release(slot)
            return False
        while len(self._stored) >= self.max_snapshots:
            self._evict()
        self._stored[key] = Snapshot(slot, tokens, block_tokens)
        self.stats.snapshots_stored += 1
        self.stats.snapshots = len(self._stored)
        return True

    def find(self, key: bytes, tokens: int) -> Snapshot | None:
        """The snapshot after ``tokens`` tokens of chain ``key``, marked recently used."""
        snap = self._stored.get(key)
        if snap is None or snap.tokens != tokens:
            return None
        self._stored.move_to_end(key)
        return snap

    def stored(self) -> list[tuple[bytes, Snapshot]]:
        """Every snapshot kept, keyed by its chain's digest, least recently used first."""
        return list(self._stored.items())

    def discard(self, key: bytes) -> bool:
        """Drop the snapshot of chain ``key``, offered to no one: its chain's blocks are gone,
        so no lookup can reach it (its slot is worth more to a snapshot that can be)."""
        snap = self._stored.pop(key, None)
        if snap is None:
            return False
        self._free.append(snap.slot)
        self.stats.snapshots_unreachable += 1
        self.stats.snapshots = len(self._stored)
        return True

    def evict_all(self) -> int:
        n = len(self._stored)
        while self._stored:
            self._evict()
        return n

    def _evict(self) -> None:
        key, snap = self._stored.popitem(last=False)
        if self.on_evict is not None:
            self.on_evict(key, snap)
        self._free.append(snap.slot)
        self.stats.snapshots_evicted += 1
        self.stats.snapshots = len(self._stored)
