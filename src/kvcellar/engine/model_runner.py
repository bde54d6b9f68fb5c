"""Turns a step plan into one packed forward pass of the transformers model."""

from __future__ import annotations

from typing import Any

import torch

from kvcellar.cache.block_manager import NULL_BLOCK
from kvcellar.cache.kv_pool import KVPool
from kvcellar.engine.attention import DecodeBatch, PrefillSpan, StepMeta
from kvcellar.engine.lean_forward import lean_forward_for, module_forward
from kvcellar.engine.scheduler import StepPlan


class ModelRunner:
    def __init__(self, model: Any, pool: KVPool, *, lean: bool = True) -> None:
        """``lean``: run supported architectures through ``engine/lean_forward.py`` (the same
        logits with less Python per step), others through transformers' modules."""
        self.model = model
        self.pool = pool
        self.lean = lean_forward_for(model) if lean else None
        self.forward = self.lean or module_forward(model)
        self.device = pool.device
        self.block_size = pool.layout.block_size
        # Attention paths run so far (see ``StepMeta.paths``). The first run of a path pays
        # one-off costs (kernel selection, lazy imports, allocator growth); ``runner_cold_paths``
        # counts paths first run by a request, i.e. after warm-up (``Engine.warm_up``).
        self.paths_seen: set[str] = set()
        self.stats: dict[str, float] = {"runner_cold_paths": 0}

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def build(self, plan: StepPlan) -> tuple[dict[str, torch.Tensor], StepMeta]:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        keep: list[int] = []

        def place(seq_blocks: list[int], start: int, length: int) -> None:
            for pos in range(start, start + length):
                positions.append(pos)
                slot_blocks.append(seq_blocks[pos // bs])

        decode = None
        if plan.decodes:
            tables: list[list[int]] = []
            contexts: list[int] = []
            for item in plan.decodes:
                seq = item.seq
                table = [b.block_id for b in seq.blocks]
                ids.append(seq.token_ids[item.start])
                place(table, item.start, 1)
                keep.append(len(ids) - 1)
                tables.append(table)
                contexts.append(item.start + 1)
            width = max(len(t) for t in tables)
            padded = [t + [NULL_BLOCK] * (width - len(t)) for t in tables]
            ctx = self._tensor(contexts)
            mask = None
            if any(c != width * bs for c in contexts):
                k_pos = torch.arange(width * bs, device=self.device)
                mask = (k_pos[None, :] < ctx[:, None])[:, None, None, :]
            decode = DecodeBatch(len(tables), self._tensor(padded).view(len(tables), width), ctx, mask)

        spans: list[PrefillSpan] = []
        for item in plan.prefills:
            seq = item.seq
            start_idx = len(ids)
            context = item.start + item.length
            table = [b.block_id for b in seq.blocks[: (context + bs - 1) // bs]]
            ids.extend(seq.token_ids[item.start : context])
            place(table, item.start, item.length)
            if item.sample:
                keep.append(len(ids) - 1)
            spans.append(PrefillSpan(start_idx, item.length, context, self._tensor(table).view(1, -1)))

        pos_t = self._tensor(positions)
        meta = StepMeta(
            pool=self.pool,
            slot_blocks=self._tensor(slot_blocks),
            slot_offsets=pos_t % bs,
            decode=decode,
            prefills=spans,
        )
        inputs = {
            "input_ids": self._tensor(ids).view(1, -1),
            "position_ids": pos_t.view(1, -1),
            "logits_to_keep": self._tensor(keep),
        }
        return inputs, meta

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor:
        """Float32 logits ``[n_sampled, vocab]``, in plan order (decodes, then prefills that sample)."""
        inputs, meta = self.build(plan)
        logits = self.forward(inputs["input_ids"], inputs["position_ids"], inputs["logits_to_keep"], meta)
        if not meta.paths <= self.paths_seen:
            new = meta.paths - self.paths_seen
            self.paths_seen |= new
            self.stats["runner_cold_paths"] += len(new)
        return logits[0].float()
