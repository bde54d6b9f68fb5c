"""Turns a step plan into one packed forward pass of the transformers model.

Threads: a step of at most ``SMALL_STEP_TOKENS`` tokens (decodes) runs with
``decode_threads`` threads, larger ones (prefill chunks) with all of them. Whether a small step
is faster on one thread depends on the machine, so warm-up (``engine/warmup.py``) measures it
(``calibrate_decode_threads``; figures in docs/performance.md). The kernels' own threads spin
between a decode step's loops while the machine has room (``native/threads.py``: ``SpinGate``),
so a decode step does not wait for a sleeping thread to wake at every kernel call; so do those of
a step of decodes and verifications of any size (no prefill chunk).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from kvcellar.cache.block_manager import NULL_BLOCK
from kvcellar.cache.kv_pool import KVPool
from kvcellar.cache.state_pool import StatePool, capture_point, history_point
from kvcellar.engine.attention import DecodeBatch, PrefillSpan, StepMeta
from kvcellar.engine.config import ThreadSpin
from kvcellar.engine.deltanet import RecurrentStep
from kvcellar.engine.lean_forward import fusion_groups, lean_forward_for, module_forward
from kvcellar.engine.lean_qwen35 import is_hybrid
from kvcellar.engine.linears import prepare_model
from kvcellar.engine.native.threads import SPARE, SpinGate
from kvcellar.engine.scheduler import Scheduled, StepPlan
from kvcellar.quantization import QuantizedWeight
from kvcellar.stats import Stats, counter, gauge

log = logging.getLogger(__name__)

# Steps of at most this many tokens (decodes of up to 8 sequences) use ``decode_threads``.
SMALL_STEP_TOKENS = 8
# How much faster one thread count's decode steps must be than the other's to settle the
# choice after one block of steps each.
CLEAR_LEAD = 1.25


@dataclass
class RunnerStats(Stats):
    PREFIX: ClassVar[str] = "runner_"
    cold_paths: int = counter()  # attention paths first run by a request (see ``paths_seen``)
    decode_threads: int = gauge()
    spinning: int = gauge()  # 1 while the kernels' threads spin between decode loops (native/threads.py)


class StepRunner(Protocol):
    """What the engine runs a step plan with: ``ModelRunner`` (torch) or ``engine/mlx``'s."""

    states: StatePool | None
    threads: int
    decode_threads: int
    measured_quiet: bool  # the last decode-thread measurement saw no other process busy
    paths_seen: set[str]
    stats: RunnerStats

    def run(self, plan: StepPlan) -> torch.Tensor: ...

    def rewind(self, item: Scheduled, row: int, dst: int) -> None: ...

    def set_decode_threads(self, n: int) -> None: ...

    def calibrate_decode_threads(self, decode_step: Callable[[], object], steps: int = 4,
                                 clock: Callable[[], float] = time.perf_counter) -> int: ...


def _slot(seq: Any) -> int:
    if seq.state_slot is None:
        raise RuntimeError(f"sequence {seq.seq_id} runs without a recurrent-state slot")
    slot: int = seq.state_slot
    return slot


class ModelRunner:
    def __init__(self, model: Any, pool: KVPool, *, lean: bool = True,
                 quantized: dict[str, QuantizedWeight] | None = None, kernel_dtype: torch.dtype | None = None,
                 states: StatePool | None = None, thread_spin: ThreadSpin = "auto") -> None:
        """``lean``: run supported architectures through ``engine/lean_forward.py`` (the same
        logits with less Python per step), others through transformers' modules. The model's
        linears are prepared once (``engine/linears.py``: prepacked, fused for the lean
        forward, ``quantized`` ones with their kernels, on ``kernel_dtype`` activations where
        given); other runners over the same model object share that. ``states``: a hybrid
        model's recurrent-state pool (its walk is its only path, lean or not). ``thread_spin``:
        ``EngineConfig.thread_spin``."""
        self.model = model
        self.pool = pool
        self.states = states
        self._recurrent: RecurrentStep | None = None  # the last step's (``rewind``)
        hybrid = is_hybrid(model)
        if hybrid and states is None:
            raise ValueError("a hybrid model needs a recurrent-state pool")
        self.linears = prepare_model(model, quantized, fuse=fusion_groups(model) if lean else (),
                                     kernel_dtype=kernel_dtype)
        walk = lean_forward_for(model)  # also puts the hidden states' norms on the kernels, for either forward
        self.lean = walk if lean or hybrid else None
        # Whether the norms run on kvcellar's kernels (the KV namespace then names their arithmetic).
        self.kernel_norms = bool(getattr(walk, "kernel_norms", False))
        if hybrid and self.lean is None:
            raise ValueError(f"kvcellar has no forward for the hybrid model {type(model).__name__}")
        self.forward = self.lean or module_forward(model)
        self.device = pool.device
        self.block_size = pool.layout.block_size
        # Attention paths run so far (see ``StepMeta.paths``). The first run of a path pays
        # one-off costs (kernel selection, lazy imports, allocator growth); ``stats.cold_paths``
        # counts paths first run by a request, i.e. after warm-up (``engine/warmup.py``).
        self.paths_seen: set[str] = set()
        self.threads = torch.get_num_threads()
        self.decode_threads = self.threads
        # Whether the last ``calibrate_decode_threads`` measured a quiet machine (worth keeping).
        self.measured_quiet = False
        self.stats = RunnerStats(decode_threads=self.threads)
        self.spin = SpinGate(thread_spin if self.device.type == "cpu" else "off")

    def set_decode_threads(self, n: int) -> None:
        self.decode_threads = max(1, min(n, self.threads))
        self.stats.decode_threads = self.decode_threads

    def calibrate_decode_threads(self, decode_step: Callable[[], object], steps: int = 4,
                                 clock: Callable[[], float] = time.perf_counter) -> int:
        """Time ``decode_step`` (one batch-1 decode step of the engine) with one thread and
        with all, in alternating blocks, and keep the faster for small steps. A lead of more
        than ``CLEAR_LEAD`` after one block each decides: a large model's steps are slow,
        and a second block each added seconds to every start. The kernels' workers spin
        meanwhile; under ``thread_spin`` auto, if other processes took more than ``SPARE`` of a
        CPU meanwhile, all threads are kept (the gate caps decode steps while they stay busy)."""
        if self.threads == 1:
            return 1
        times: dict[int, list[float]] = {1: [], self.threads: []}
        start = self.spin.reading() if self.spin.mode == "auto" else None
        with self.spin.forced("on" if self.spin.mode == "auto" else self.spin.mode):  # threads as they run uncontended
            for i, n in enumerate((1, self.threads, 1, self.threads)):
                if i == 2:
                    one, every = statistics.median(times[1]), statistics.median(times[self.threads])
                    if max(one, every) > CLEAR_LEAD * min(one, every):
                        break
                self.set_decode_threads(n)
                decode_step()  # the first step after a switch pays for it
                for _ in range(steps):
                    t0 = clock()
                    decode_step()
                    times[n].append(clock() - t0)
        best = min(times, key=lambda n: statistics.median(times[n]))
        end = self.spin.reading() if start is not None else None
        others = self.spin.others(start, end) if start is not None and end is not None else 0.0
        if others > SPARE:
            # another process ran meanwhile (a server starting beside this one): the blocks say
            # little about a quiet machine, and while the machine stays busy the gate runs decode
            # steps on the CPUs left anyway
            log.info("decode threads: other processes took %.1f CPUs while they were measured; all %d kept",
                     others, self.threads)
            best = self.threads
        self.measured_quiet = start is not None and others <= SPARE
        self.set_decode_threads(best)
        return best

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
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
        recurrent = None
        if self.states is not None:
            recurrent = RecurrentStep(self.states, None, [], {})
            if plan.decodes:
                recurrent.decode_slots = self._tensor([_slot(item.seq) for item in plan.decodes])
            for row, item in enumerate(plan.decodes):
                self._capture(recurrent, item, row)
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
        for item in plan.verifies:  # a span like a prefill's, the draft after the last token; every row kept
            seq = item.seq
            start_idx = len(ids)
            context = item.start + item.length
            table = [b.block_id for b in seq.blocks[: (context + bs - 1) // bs]]
            ids.append(seq.token_ids[item.start])
            ids.extend(item.draft)
            place(table, item.start, item.length)
            keep.extend(range(start_idx, len(ids)))
            spans.append(PrefillSpan(start_idx, item.length, context, self._tensor(table).view(1, -1)))
            if recurrent is not None:  # the state before the span kept apart: ``rewind`` replays from it
                if item.state_before is None:
                    raise RuntimeError("a hybrid model's draft needs a state slot to keep the state before it")
                live = _slot(seq)
                recurrent.pool.copy(live, item.state_before)
                recurrent.spans.append((start_idx, item.length, live))
                recurrent.verifies[live] = []
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
            if recurrent is not None:
                recurrent.spans.append((start_idx, item.length, _slot(seq)))
                self._capture(recurrent, item, start_idx)

        self._recurrent = recurrent
        pos_t = self._tensor(positions)
        meta = StepMeta(
            pool=self.pool,
            slot_blocks=self._tensor(slot_blocks),
            slot_offsets=pos_t % bs,
            decode=decode,
            prefills=spans,
            attend_threads=self.threads,
            recurrent=recurrent,
        )
        inputs = {
            "input_ids": self._tensor(ids).view(1, -1),
            "position_ids": pos_t.view(1, -1),
            "logits_to_keep": self._tensor(keep),
        }
        return inputs, meta

    def rewind(self, item: Scheduled, row: int, dst: int) -> None:
        """Into state slot ``dst``, the state after row ``row`` of ``item``'s verification in the last
        step (a hybrid model's): the state before it, and its rows 0..``row`` run again."""
        assert self.states is not None and self._recurrent is not None and item.state_before is not None
        replays = self._recurrent.verifies[_slot(item.seq)]
        self.states.copy(item.state_before, dst)
        for replay in replays:
            replay(row, dst)

    def _capture(self, recurrent: RecurrentStep, item: Scheduled, first_row: int) -> None:
        """Checkpoint the state of ``item``'s sequence at the block boundary its tokens cross
        (``capture_point``: the prefix cache records the same one when it commits the step)."""
        seq = item.seq
        boundary = capture_point(item.start, item.start + item.length, seq.num_prompt_tokens, self.block_size)
        if boundary is not None and seq.checkpoint_slot is not None:
            recurrent.captures[first_row + boundary - 1 - item.start] = seq.checkpoint_slot
        history = history_point(seq.history_tokens, seq.num_prompt_tokens, self.block_size)
        if (seq.history_slot is not None and history is not None and history != boundary
                and item.start < history <= item.start + item.length):  # at ``boundary``: copied at commit
            recurrent.captures[first_row + history - 1 - item.start] = seq.history_slot

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]``, in plan order: a row per decode, every row of a verify,
        a row per prefill that samples."""
        # torch's thread count is process-wide: set it for this step only (switching costs
        # nothing measurable), so other engines and callers see the count they set.
        small = plan.num_tokens <= SMALL_STEP_TOKENS
        # decodes and verifications alone (no prefill chunk): short loops with Python between
        # them, where a worker that sleeps is woken at every one (docs/performance.md)
        decode = small or not plan.prefills
        threads = self.spin.step(decode, self.decode_threads if small else self.threads)
        self.stats.spinning = int(self.spin.spinning)
        before = torch.get_num_threads()
        if before != threads:
            torch.set_num_threads(threads)
        try:
            inputs, meta = self.build(plan)
            logits = self.forward(inputs["input_ids"], inputs["position_ids"], inputs["logits_to_keep"], meta)
        finally:
            if before != threads:
                torch.set_num_threads(before)
        if not meta.paths <= self.paths_seen:
            new = meta.paths - self.paths_seen
            self.paths_seen |= new
            self.stats.cold_paths += len(new)
        return logits[0].float()
