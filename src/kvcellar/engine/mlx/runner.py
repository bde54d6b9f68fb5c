"""Turns a step plan into mlx-lm forward calls over the paged pool.

One call runs every decode of the step as a batch of one-token rows (each with its own RoPE
offset and context); prefill chunks and verify spans run as rows of calls of their own, those
of similar lengths together (padded to the longest; ``span_groups``). The model's final hidden
states are projected to logits only at the rows the step samples (a decode's, a verify's every
row, a prefill chunk's last if it samples).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
import torch

from kvcellar.cache.block_manager import NULL_BLOCK
from kvcellar.cache.kv_pool import KVPool
from kvcellar.cache.state_pool import StatePool
from kvcellar.engine.mlx.paged import PagedLayerCache, StepSlots, to_torch
from kvcellar.engine.model_runner import RunnerStats
from kvcellar.engine.scheduler import Scheduled, StepPlan


class MLXRunner:
    """The MLX engine's step runner (``ModelRunner``'s counterpart): ``run(plan)`` gives the
    float32 logits of the sampled rows, in plan order."""

    def __init__(self, module: Any, pool: KVPool) -> None:
        self.module = module
        # A multimodal wrapper's text model (Gemma 3) computes the text.
        self.text = getattr(module, "language_model", module)
        self.pool = pool
        self.states: StatePool | None = None  # hybrid models are the torch engine's
        self.block_size = pool.layout.block_size
        self.num_layers = len(self.text.layers)
        self.paths_seen: set[str] = set()
        self.threads = self.decode_threads = 1  # MLX schedules its own threads
        self.measured_quiet = False
        self.stats = RunnerStats(decode_threads=1)

    def rewind(self, item: Scheduled, row: int, dst: int) -> None:
        raise RuntimeError("the MLX engine runs no hybrid model: there is no recurrent state to rewind")

    def set_decode_threads(self, n: int) -> None:
        """MLX has no thread count to set; kept for the engine's interface."""

    def calibrate_decode_threads(self, decode_step: Callable[[], object], steps: int = 4,
                                 clock: Callable[[], float] = time.perf_counter) -> int:
        return 1

    def _slots(self, rows: list[tuple[list[int], int, int]], width: int) -> StepSlots:
        """Rows ``(block table, first position, tokens)`` padded to ``width`` tokens: a pad
        continues its row's positions and writes into the null block, which no row reads
        unmasked."""
        bs = self.block_size
        blocks: list[int] = []
        offsets: list[int] = []
        for table, start, length in rows:
            for p in range(start, start + width):
                blocks.append(table[p // bs] if p < start + length else NULL_BLOCK)
                offsets.append(p % bs)
        widest = max(len(table) for table, _, _ in rows)
        tables = [table + [NULL_BLOCK] * (widest - len(table)) for table, _, _ in rows]
        positions = np.array([[start + t for t in range(width)] for _, start, _ in rows], dtype=np.int64)
        return StepSlots(torch.tensor(blocks, dtype=torch.long), torch.tensor(offsets, dtype=torch.long),
                         torch.tensor(tables, dtype=torch.long), positions)

    def _hidden(self, ids: list[list[int]], slots: StepSlots) -> mx.array:
        caches = [PagedLayerCache(self.pool, i, slots) for i in range(self.num_layers)]
        out: mx.array = self.text.model(mx.array(ids), cache=caches)
        return out

    def _logits(self, hidden: mx.array) -> torch.Tensor:
        """The output head over final hidden states ``[rows, hidden]``."""
        text = self.text
        logits = text.lm_head(hidden) if "lm_head" in text else text.model.embed_tokens.as_linear(hidden)
        return to_torch(logits.astype(mx.float32))

    def _table(self, item: Scheduled, context: int) -> list[int]:
        return [b.block_id for b in item.seq.blocks[: (context + self.block_size - 1) // self.block_size]]

    def run(self, plan: StepPlan) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]``: a row per decode, every row of a verify, a row per
        prefill that samples."""
        parts: list[mx.array] = []
        if plan.decodes:
            rows = [(self._table(item, item.start + 1), item.start, 1) for item in plan.decodes]
            ids = [[item.seq.token_ids[item.start]] for item in plan.decodes]
            parts.append(self._hidden(ids, self._slots(rows, 1))[:, 0])
        spans = plan.verifies + plan.prefills
        kept: dict[int, mx.array] = {}
        for group in span_groups([item.length for item in spans]):
            width = max(spans[i].length for i in group)
            ids = []
            for i in group:
                item = spans[i]
                tokens = ([item.seq.token_ids[item.start], *item.draft] if item.draft
                          else item.seq.token_ids[item.start:item.start + item.length])
                ids.append(tokens + [0] * (width - item.length))
            rows = [(self._table(spans[i], spans[i].start + spans[i].length), spans[i].start, spans[i].length)
                    for i in group]
            hidden = self._hidden(ids, self._slots(rows, width))
            for row, i in enumerate(group):
                item = spans[i]
                if item.draft:
                    kept[i] = hidden[row, :item.length]
                elif item.sample:
                    kept[i] = hidden[row, item.length - 1:item.length]
        parts.extend(kept[i] for i in range(len(spans)) if i in kept)
        if not parts:
            return torch.empty((0, 0), dtype=torch.float32)
        return self._logits(mx.concatenate(parts, axis=0))


def span_groups(lengths: list[int], waste: float = 0.25) -> list[list[int]]:
    """The spans (by index) run as one call each group: rows of similar length, padded to the
    longest, with at most ``waste`` of a call's tokens padding."""
    groups: list[list[int]] = []
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    for i in order:
        group = groups[-1] if groups else None
        if group is not None and (len(group) + 1) * lengths[group[0]] <= (1 + waste) * (
                sum(lengths[j] for j in group) + lengths[i]):
            group.append(i)
        else:
            groups.append([i])
    return groups
