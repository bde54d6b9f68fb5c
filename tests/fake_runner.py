"""The real scheduler, prefix cache, block manager, KV pool and tier link, driven by a
fake model runner, so their logic is tested in milliseconds (tests/cache, tests/engine).

The fake model is a pure function of the token sequence, like a real one: the KV it
writes at position ``p`` is ``[h_p, p]`` / ``[token_p, 1]``, with ``h_p`` a hash of tokens
``0..p``, and the token it samples next is computed from the KV it *reads back from the
pool* through the sequence's block table. A block holding another prefix's KV, a stale or
half-loaded block, or a wrong block table therefore changes the output, and is also
counted (``wrong_kv``). ``reference`` computes the same outputs with no cache at all.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence as Seq

import torch

from kvcellar.cache.block_manager import BlockManager
from kvcellar.cache.hashing import root_digest
from kvcellar.cache.kv_pool import KVLayout, KVPool
from kvcellar.cache.prefix_cache import PrefixCache
from kvcellar.cache.tiering import LowerTierLink
from kvcellar.engine.config import EngineConfig
from kvcellar.engine.sampling import SamplingParams
from kvcellar.engine.scheduler import Scheduler, StepPlan
from kvcellar.engine.sequence import Sequence
from kvcellar.storage.base import KVTier

VOCAB = 97
_MOD = 1 << 23  # hashes stay exact in float32


def prefix_hashes(tokens: Seq[int]) -> list[int]:
    out, h = [], 7
    for t in tokens:
        h = (h * 31 + t + 1) % _MOD
        out.append(h)
    return out


def next_token(hashes: Seq[int]) -> int:
    return sum((h % 1009) * (i + 1) for i, h in enumerate(hashes)) % VOCAB


def reference(prompt: Seq[int], max_tokens: int) -> list[int]:
    """What the fake model generates for ``prompt``, computed without any cache."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(prefix_hashes(tokens)))
    return tokens[len(prompt):]


class FakeRunner:
    """Writes the fake KV of each scheduled span into the pool and samples from what it
    reads back."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.block_size = pool.layout.block_size
        self.wrong_kv = 0  # positions whose KV read back differed from the truth

    def _slot(self, seq: Sequence, pos: int) -> torch.Tensor:
        return self.pool.data[seq.blocks[pos // self.block_size].block_id, 0, :, pos % self.block_size, 0]

    def run(self, plan: StepPlan) -> dict[int, int]:
        """Sampled token per sequence id."""
        out = {}
        for item in plan.items:
            seq = item.seq
            hashes = prefix_hashes(seq.token_ids)
            for pos in range(item.start, item.start + item.length):
                self._slot(seq, pos).copy_(torch.tensor([[hashes[pos], pos], [seq.token_ids[pos], 1]]))
            if item.sample:
                read = []
                for pos in range(seq.num_tokens):
                    k, v = self._slot(seq, pos).tolist()
                    if k != [hashes[pos], pos] or v != [seq.token_ids[pos], 1]:
                        self.wrong_kv += 1
                    read.append(int(k[0]))
                out[seq.seq_id] = next_token(read)
        return out


class Driver:
    """A minimal step loop around the real scheduler (the engine's, without a model)."""

    def __init__(self, *, num_blocks: int = 64, block_size: int = 4, prefix_caching: bool = True,
                 max_num_seqs: int = 8, max_step_tokens: int = 32, prefetch_pool_fraction: float = 0.25,
                 guard_backoff_s: tuple[float, float] = (1.0, 30.0)) -> None:
        layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, block_size=block_size, dtype=torch.float32)
        self.pool = KVPool(layout, num_blocks, torch.device("cpu"))
        self.bm = BlockManager(num_blocks, block_size)
        self.wake = threading.Event()
        self.lower = LowerTierLink(self.pool, self.bm.key, wake=self.wake.set, guard_backoff_s=guard_backoff_s)
        self.bm.on_evict = self.lower.evicted
        # max_prefill_step_tokens=0: every step under the one budget, decoding or not.
        config = EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs, max_step_tokens=max_step_tokens,
                              max_prefill_step_tokens=0, prefix_caching=prefix_caching,
                              prefetch_pool_fraction=prefetch_pool_fraction)
        self.sched = Scheduler(self.bm, self.lower, config, copy_block=self.pool.copy_block)
        self.runner = FakeRunner(self.pool)
        self.done: dict[int, list[int]] = {}
        self._ids = 0
        self._max_tokens: dict[int, int] = {}

    @property
    def cache(self) -> PrefixCache[Sequence]:
        return self.sched.cache

    def attach(self, tier: KVTier, policy: str = "write_through") -> None:
        self.lower.attach(tier, policy)

    def submit(self, prompt: Seq[int], max_tokens: int = 4, salt: str | None = None,
               tenant: str | None = None) -> Sequence:
        self._ids += 1
        seq = Sequence(seq_id=self._ids, token_ids=list(prompt), num_prompt_tokens=len(prompt),
                       params=SamplingParams(max_tokens=max_tokens), root=root_digest("fake", salt),
                       emit=lambda _e: None, detokenizer=None, stop_matcher=None,  # type: ignore[arg-type]
                       eos_token_ids=frozenset(), tenant=tenant)
        self._max_tokens[seq.seq_id] = max_tokens
        self.sched.add(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        self.sched.remove(seq)

    def step(self) -> bool:
        """One step; False when there was nothing to compute (reads may still be in flight)."""
        plan = self.sched.schedule()
        if plan is None:
            self.lower.flush()
            return False
        sampled = self.runner.run(plan)
        for item in plan.items:
            seq = item.seq
            self.sched.commit(item)
            if item.sample:
                seq.token_ids.append(sampled[seq.seq_id])
                if len(seq.output_ids) >= self._max_tokens[seq.seq_id]:
                    self.done[seq.seq_id] = seq.output_ids
                    self.sched.remove(seq)
        self.lower.flush()
        return True

    def run(self, max_steps: int = 100_000) -> None:
        """Step until nothing is left, waiting for lower-tier reads when only they are."""
        for _ in range(max_steps):
            self.wake.clear()
            if not self.step():
                if not self.sched.has_work():
                    return
                self.wake.wait(0.05)  # a read that hangs never wakes us: poll for it being overdue
        raise AssertionError("the scheduler did not finish")

    def assert_no_leaks(self) -> None:
        assert not self.sched.running and not self.sched.waiting
        assert not self.cache.busy() and not self.cache._computing
        assert self.bm.num_used == 0 and all(b.ref_count == 0 for b in self.bm.blocks)
        assert self.bm.num_free + self.bm.num_evictable == self.bm.num_blocks - 1
