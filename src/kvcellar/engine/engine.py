"""The engine: runs the step loop over the parts ``engine/build.py`` assembled (KV pool,
block manager, scheduler, model runner, the link to the lower tiers).

Other threads talk to it only through ``submit`` / ``cancel`` (an inbox drained at the
start of every step) and receive results through each request's ``EventStream``. The
step loop runs on one named thread (``kvcellar-engine``) started by ``start()``; without
it, tests may drive the engine deterministically by calling ``step()`` themselves.
Warm-up is ``engine/warmup.py``; what the engine reports, ``engine/observability.py``.

Shutdown protocol: ``shutdown(timeout)`` stops admitting, lets running and queued
sequences finish until the deadline, aborts what is left (each stream gets a final
``abort`` event), then stops and joins the thread.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence as Seq
from typing import Any

import torch

from kvcellar.cache.block_manager import BlockManager
from kvcellar.cache.hashing import DIGEST_SIZE, root_digest
from kvcellar.cache.kv_pool import KVLayout, KVPool
from kvcellar.cache.tiering import LowerTierLink
from kvcellar.engine import native
from kvcellar.engine.blocking import GenerationResult, collect, run_to_end
from kvcellar.engine.config import EngineConfig
from kvcellar.engine.constraints import GrammarCompiler
from kvcellar.engine.detokenizer import IncrementalDetokenizer, StopMatcher
from kvcellar.engine.loader import LoadedModel
from kvcellar.engine.model_runner import StepRunner
from kvcellar.engine.output import final_event, token_event
from kvcellar.engine.sampling import SampleResult, SamplingParams, greedy_tokens, plain_greedy, sample_row
from kvcellar.engine.scheduler import Scheduled, Scheduler, StepPlan
from kvcellar.engine.sequence import EventStream, RequestHandle, SeqState, Sequence, TokenEvent
from kvcellar.engine.stats import EngineStats
from kvcellar.errors import EngineStoppedError, InvalidRequestError
from kvcellar.storage import block_format
from kvcellar.storage.base import BlockSpec, KVTier

log = logging.getLogger(__name__)


# Bytes of free blocks an idle engine thread faults in ahead of their use, and how many it
# touches before it looks at its inbox again (a block at least).
TOUCH_AHEAD_BYTES = 128 << 20
TOUCH_AT_A_TIME_BYTES = 2 << 20


# What other threads put in the engine's inbox; the step loop drains it.
@dataclasses.dataclass(frozen=True)
class _Add:
    seq: Sequence


@dataclasses.dataclass(frozen=True)
class _Cancel:
    seq_id: int


@dataclasses.dataclass(frozen=True)
class _AbortAll:
    pass


@dataclasses.dataclass(frozen=True)
class _Stop:
    pass


_Message = _Add | _Cancel | _AbortAll | _Stop


@dataclasses.dataclass
class EngineParts:
    """What an engine runs, assembled by ``engine/build.py``."""

    layout: KVLayout
    pool: KVPool
    blocks: BlockManager
    lower: LowerTierLink
    scheduler: Scheduler
    runner: StepRunner
    descriptor: dict[str, Any]  # what the KV cache's fingerprint is computed from
    fingerprint: str
    max_model_len: int
    wake: threading.Event  # set by whoever has work for the engine thread (the tiers' reads too)


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, parts: EngineParts) -> None:
        """Use ``assemble_engine`` (``engine/build.py``), which assembles ``parts``."""
        self.loaded = loaded
        self.config = config
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        # The engine thread decodes with its own copy: HF tokenizers keep mutable
        # truncation/padding state, and the server encodes on other threads.
        self._detok_tokenizer = copy.deepcopy(loaded.tokenizer)
        self.device = loaded.device
        self.block_size = config.block_size
        self.layout = parts.layout
        self.max_model_len = parts.max_model_len
        self.pool = parts.pool
        self.blocks = parts.blocks
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.lower = parts.lower
        self.descriptor = parts.descriptor
        self.fingerprint = parts.fingerprint
        self.vocab_size = int(loaded.model.config.get_text_config().vocab_size)
        # Structured outputs: grammars compiled for this tokenizer (llguidance loads lazily).
        self.grammars = GrammarCompiler(loaded.tokenizer, self.vocab_size, loaded.eos_token_ids)

        self._inbox: queue.SimpleQueue[_Message] = queue.SimpleQueue()
        self._wake = parts.wake
        self._thread: threading.Thread | None = None
        self._accepting = True
        self._stop_now = False
        self._shutdown_lock = threading.Lock()
        self._shutdown_result: bool | None = None
        self._seqs: dict[int, Sequence] = {}
        # Hybrid models: sequences of a batch whose forward failed, rolled back to their last
        # snapshot, by seq_id -> the token count the failed step would have reached; each runs
        # alone until it passes it (``_run_alone``).
        self._suspects: dict[int, int] = {}
        # Free blocks whose pages an idle engine thread touched (``_touch_ahead``), by block id.
        self._touched = bytearray(self.blocks.num_blocks)
        self._ids = itertools.count(1)
        layout = self.layout
        self.stats = EngineStats(kv_bits=layout.kv_bits, kv_group_size=layout.kv_group_size if layout.quantized else 0,
                                 kv_bytes_per_token=layout.bytes_per_token, kv_pool_tokens=self.pool_tokens)
        # The last step failure, for /health: "<ExceptionType>: message" and its unix time.
        self.last_step_error: str | None = None
        self.last_step_error_time: float | None = None

    # ---- public, any thread ---------------------------------------------------------------

    def submit(
        self,
        prompt_ids: Seq[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        stream: EventStream | None = None,
        history_tokens: int | None = None,
        tenant: str | None = None,
    ) -> RequestHandle:
        """Queue a completion of ``prompt_ids``; its events arrive on the returned stream.
        ``history_tokens``: a chat prompt's tokens before its generation prompt (the part the
        conversation's next turn repeats), where a hybrid model also keeps a snapshot.
        ``tenant``: who asks (an API key's name), for fair admission between tenants."""
        if not self._accepting:
            raise EngineStoppedError("the engine is shutting down")
        try:
            params.validate()
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        prompt = [int(t) for t in prompt_ids]
        fitted = self.fit_max_tokens(len(prompt), params.max_tokens)
        if fitted != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=fitted)
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        stream = stream or EventStream()
        seq = Sequence(
            seq_id=next(self._ids),
            token_ids=prompt,
            num_prompt_tokens=len(prompt),
            params=params,
            root=root_digest(self.fingerprint, cache_salt),
            emit=stream.put,
            detokenizer=IncrementalDetokenizer(self._detok_tokenizer, skip_special_tokens=params.skip_special_tokens),
            stop_matcher=StopMatcher(params.stop),
            eos_token_ids=frozenset() if params.ignore_eos else self.loaded.eos_token_ids,
            generator=params.make_generator(self.device),
            constraint=(self.grammars.constraint(params.grammar, params.max_tokens)
                        if params.grammar is not None else None),
            history_tokens=history_tokens if history_tokens is not None and 0 < history_tokens < len(prompt) else None,
            tenant=tenant,
        )
        self._inbox.put(_Add(seq))
        self._wake.set()
        return RequestHandle(seq.seq_id, stream, len(prompt), self.cancel)

    def fit_max_tokens(self, prompt_tokens: int, max_tokens: int) -> int:
        """``max_tokens`` clamped to the room the context and the pool leave after the prompt
        (as llama.cpp and Ollama do: agents ask for 32000 whatever the model); raises
        ``InvalidRequestError`` only when the prompt does not fit by itself."""
        if prompt_tokens < 1:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        pool = (self.blocks.num_blocks - 1) * self.block_size
        room = min(self.max_model_len, pool) - prompt_tokens
        if room < 1:
            if prompt_tokens >= self.max_model_len:
                message = (f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                           f"prompt has {prompt_tokens} tokens, which leaves no room for the completion. Please "
                           "shorten the prompt, or serve with a larger --max-model-len.")
            else:
                message = (f"The KV cache pool holds {pool} tokens and your prompt has {prompt_tokens}, which leaves "
                           "no room for the completion. Please shorten the prompt, or serve with a larger "
                           "--kv-cache-gb.")
            raise InvalidRequestError(message, param="messages", code="context_length_exceeded")
        if self.config.max_completion_tokens > 0:
            room = min(room, self.config.max_completion_tokens)
        return max(1, min(max_tokens, room))

    def cancel(self, seq_id: int) -> None:
        self._inbox.put(_Cancel(seq_id))
        self._wake.set()

    def generate(
        self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams], *, cache_salt: str | None = None
    ) -> list[GenerationResult]:
        """Blocking convenience: run completions of ``prompts`` to the end (``engine/blocking.py``)."""
        return run_to_end(self, prompts, params, cache_salt=cache_salt)

    def collect(self, handle: RequestHandle) -> GenerationResult:
        return collect(self, handle)

    @property
    def threaded(self) -> bool:
        """Whether the engine thread runs the step loop (else callers step it)."""
        return self._thread is not None

    @property
    def block_spec(self) -> BlockSpec:
        """Geometry of one KV block, as lower tiers store it."""
        return LowerTierLink.block_spec(self.pool)

    @property
    def snapshot_spec(self) -> BlockSpec | None:
        """Geometry of one recurrent-state snapshot as lower tiers store it (hybrid models
        only, else None)."""
        states = self.scheduler.cache.states
        return None if states is None else LowerTierLink.snapshot_spec(states.layout, self.config.block_size)

    def attach_tier(self, tier: KVTier, policy: str = "write_through", snapshots: KVTier | None = None) -> None:
        """Put ``tier`` below the RAM tier and the tiers attached before it (attach the
        fastest first; before ``start``). The engine owns it from here on and closes it in
        ``shutdown``. ``policy``: write_through, evict_only or read_only. ``snapshots``: a
        hybrid model's tier for snapshots beside it (``snapshot_spec``), of the same kind:
        without one, the hybrid resumes nothing from this tier."""
        if snapshots is not None and self.snapshot_spec is None:
            raise ValueError("snapshots are for hybrid models' recurrent state; this model has none")
        if self._thread is not None:
            raise RuntimeError("attach tiers before starting the engine")
        if not self.config.prefix_caching:
            raise ValueError("a lower tier needs prefix caching")
        if self.blocks.key_bytes < DIGEST_SIZE:
            raise ValueError(f"a lower tier needs key_bytes = {DIGEST_SIZE} (the whole digest), not "
                             f"{self.blocks.key_bytes}: it names blocks by their key, and blocks sharing one "
                             "would delete each other")
        if native.folds_crc32():  # the tiers' block checksums: the same values, faster
            block_format.use_crc32(native.crc32)
        self.lower.attach(tier, policy, snapshots)

    def prompt_progress(self, seq_id: int) -> int | None:
        """Tokens of sequence ``seq_id`` whose KV is computed (cache hits included; back to 0
        if it is preempted), None once it is no longer active. Read from another thread: a
        snapshot, for telling a long prefill that advances from a request that waits."""
        seq = self._seqs.get(seq_id)
        return None if seq is None else seq.num_computed

    def in_prefill(self, seq_id: int) -> bool:
        """Whether sequence ``seq_id`` is active and still computing its prompt."""
        seq = self._seqs.get(seq_id)
        return seq is not None and seq.in_prefill

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="kvcellar-engine", daemon=False)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> bool:
        """Stop admitting; let in-flight work finish until ``timeout``; abort the rest; then
        drain and close the lower tier. Returns True if nothing had to be aborted and the
        tier's writer drained."""
        with self._shutdown_lock:  # idempotent; concurrent callers wait for the first
            if self._shutdown_result is not None:
                return self._shutdown_result
            deadline = time.monotonic() + timeout
            clean = self._stop_engine(timeout)
            if self.scheduler.drafter is not None:
                self.scheduler.drafter.close()
            clean = self.lower.close(max(1.0, deadline - time.monotonic()),
                                     cached=self.blocks.cached_blocks(), states=self.scheduler.cache.states) and clean
            self._shutdown_result = clean
            return clean

    def _stop_engine(self, timeout: float) -> bool:
        self._accepting = False
        clean = True
        if self._thread is not None:
            deadline = time.monotonic() + timeout
            while self._thread.is_alive() and time.monotonic() < deadline:
                if self.num_active() == 0 and self._inbox.empty():
                    break
                time.sleep(0.02)
            clean = self.num_active() == 0
            self._inbox.put(_AbortAll())
            self._inbox.put(_Stop())
            self._wake.set()
            self._thread.join(timeout=max(5.0, timeout))
            if self._thread.is_alive():
                log.error("engine thread did not stop; a forward pass may be stuck. Aborting its %d request(s)",
                          len(self._seqs))
                # Their clients get a final event now instead of waiting for a step that may never
                # end; only the streams are touched (the scheduler and blocks are the stuck thread's).
                for seq in list(self._seqs.values()):
                    seq.emit(TokenEvent(seq.seq_id, None, "", finish_reason="abort"))
                return False
            self._thread = None
        else:
            self._drain_inbox()
            clean = not self.scheduler.has_work()
            self._abort_all()
            while self.scheduler.has_work():  # cancelled loads still reading into the pool
                self.scheduler.schedule()
                self._wake.wait(0.01)
        return clean

    def num_active(self) -> int:
        return len(self._seqs)

    @property
    def pool_tokens(self) -> int:
        """Tokens of KV the RAM block pool holds (the null block excluded)."""
        return (self.blocks.num_blocks - 1) * self.block_size

    @property
    def healthy(self) -> bool:
        """False once ``unhealthy_after_failed_steps`` steps failed in a row (until one succeeds)."""
        return self.stats.step_failures_in_a_row < self.config.unhealthy_after_failed_steps

    # ---- engine thread --------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop_now:
            self._wake.clear()
            if not self.step() and not self._stop_now and not self._touch_ahead():
                self._wake.wait(timeout=1.0)

    def _touch_ahead(self) -> bool:
        """Idle: fault in the pages of a few of the free blocks handed out next,
        ``TOUCH_AHEAD_BYTES`` of them at most ahead, so that a step does not fault them in as it
        writes their first KV (a fresh pool's pages; milliseconds each on some virtual machines).
        A few at a time: a request that arrives meanwhile waits for them only. True if it touched
        any."""
        if self.pool.device.type != "cpu":  # device memory is there from its allocation
            return False
        block_bytes = self.layout.bytes_per_block
        ahead = self.blocks.free_front(max(1, TOUCH_AHEAD_BYTES // block_bytes))
        fresh = [b.block_id for b in ahead if not self._touched[b.block_id]]
        fresh = fresh[:max(1, TOUCH_AT_A_TIME_BYTES // block_bytes)]
        if not fresh:
            return False
        self.pool.touch(fresh)
        for block_id in fresh:
            self._touched[block_id] = 1
        return True

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            match message:
                case _Add(seq):
                    self._seqs[seq.seq_id] = seq
                    self.scheduler.add(seq)
                    self.stats.requests_total += 1
                    self.stats.prompt_tokens += seq.num_prompt_tokens
                case _Cancel(seq_id):
                    if (cancelled := self._seqs.get(seq_id)) is not None:
                        self._finish(cancelled, TokenEvent(seq_id, None, "", finish_reason="abort"))
                case _AbortAll():
                    self._abort_all()
                case _Stop():
                    self._stop_now = True

    def _abort_all(self) -> None:
        for seq in list(self._seqs.values()):
            self._finish(seq, TokenEvent(seq.seq_id, None, "", finish_reason="abort"))

    def step(self) -> bool:
        """Run one scheduling step. Returns False when there was nothing to do.

        Never raises: an exception fails the sequences it can be traced to (those of a
        forward that fails even when run alone, the one being scheduled, any the scheduler
        dropped), each with an error event, and the engine goes on with the others."""
        try:
            return self._step()
        except Exception as exc:
            log.exception("engine step failed")
            self._step_failed(exc, self._culprits())
            return True

    def _step(self) -> bool:
        self._drain_inbox()
        plan = self.scheduler.schedule()
        if plan is None:
            self.lower.flush()
            return False
        try:
            return self._run_step(plan)
        finally:  # a hybrid's verification slots are the step's, whatever became of it
            states = self.scheduler.cache.states
            held = tuple(item.state_before for item in plan.verifies if item.state_before is not None)
            if states is not None and held:
                states.return_verify_slots(held)

    def _run_step(self, plan: StepPlan) -> bool:
        if self._suspects:
            plan = self._run_alone(plan)
        t0 = time.perf_counter()
        try:
            logits = self.runner.run(plan)
        except Exception as exc:
            log.exception("forward pass of %d sequences failed", len(plan.items))
            plan = self._run_apart(plan, exc)
            if not plan.items:
                return True
            try:
                logits = self.runner.run(plan)
            except Exception as again:
                self._step_failed(again, [item.seq for item in plan.items])
                return True
        if self.scheduler.drafter is not None and not plan.prefills:
            self.scheduler.drafter.observe(plan.num_tokens, time.perf_counter() - t0)
        self.stats.steps += 1
        self.stats.computed_tokens += plan.num_tokens
        plain = [p for item in plan.items for p in [plain_greedy(item.seq.params, item.seq.constraint)] * item.rows]
        try:
            greedy = greedy_tokens(logits, plain)
        except Exception:  # then each row alone, where a failure is that sequence's
            log.exception("picking the greedy tokens of a batch failed")
            greedy = [None] * len(plain)
        row = 0
        failed: list[tuple[Sequence, Exception]] = []
        for item in plan.items:
            seq, r = item.seq, row
            row += item.rows
            try:
                if item.draft:
                    self._verify(item, logits, greedy, r)
                    continue
                self.scheduler.commit(item)
                if item.sample:
                    self._append(seq, self._pick(seq, logits, greedy, r))
            except Exception as exc:  # one sequence's failure must not strand the others
                log.exception("post-processing sequence %d failed", seq.seq_id)
                failed.append((seq, exc))
        self.lower.flush()
        self.stats.step_seconds += time.perf_counter() - t0
        for item in plan.items:
            if item.seq.seq_id in self._suspects and item.seq.num_computed >= self._suspects[item.seq.seq_id]:
                del self._suspects[item.seq.seq_id]  # past the failed step alone: not the cause
        if failed:
            for seq, error in failed:
                self._step_failed(error, [seq])
        else:
            self.stats.step_failures_in_a_row = 0
        return True

    @staticmethod
    def _pick(seq: Sequence, logits: torch.Tensor, greedy: list[int | None], row: int) -> SampleResult:
        token = greedy[row]
        if token is not None:
            return SampleResult(token, None, None)
        return sample_row(logits[row], seq.params, seq.output_ids, seq.generator, seq.constraint)

    def _verify(self, item: Scheduled, logits: torch.Tensor, greedy: list[int | None], row: int) -> None:
        """Emit what decoding ``item.seq`` one token a step would have, from the rows of its
        draft's step: row i is the step after the draft's first i tokens, valid while those were
        the tokens picked; the token picked where the draft and the pick part is emitted too.
        Only the KV of emitted tokens is kept (committed and published); the blocks rejected
        tokens took go back."""
        seq, draft = item.seq, item.draft
        cache = self.scheduler.cache
        self._commit_verified(item, 0)  # the KV of the last token, fed first
        accepted = 0
        for i in range(len(draft) + 1):
            res = self._pick(seq, logits, greedy, row + i)
            self._append(seq, res)
            if seq.state == SeqState.FINISHED or i == len(draft) or res.token_id != draft[i]:
                break
            accepted += 1
            self._commit_verified(item, i + 1)  # the draft's token i was right: its KV is
        if seq.state != SeqState.FINISHED:
            cache.trim(seq)
            if item.state_before is not None and accepted < len(draft) and seq.state_slot is not None:
                # the recurrent state back to after the last row the model agreed with
                self.runner.rewind(item, accepted, seq.state_slot)
        if self.scheduler.drafter is not None:
            self.scheduler.drafter.verified(seq.seq_id, len(draft), accepted)
        self.stats.spec_verifies += 1
        self.stats.spec_drafted_tokens += len(draft)
        self.stats.spec_accepted_tokens += accepted

    def _commit_verified(self, item: Scheduled, row: int) -> None:
        """Commit ``item``'s tokens through its verification's ``row``. A hybrid's checkpoint at a
        block boundary that row ends is the state after it: rewound to (the live state after the
        verification's last row)."""
        seq, cache = item.seq, self.scheduler.cache
        computed = item.start + 1 + row
        states = cache.states
        if (states is not None and item.state_before is not None and seq.checkpoint_slot is not None
                and seq.state_slot is not None and computed % cache.block_size == 0):
            if row < len(item.draft):
                self.runner.rewind(item, row, seq.checkpoint_slot)
            else:
                states.copy(seq.state_slot, seq.checkpoint_slot)
        cache.commit(seq, computed)

    def _run_alone(self, plan: StepPlan) -> StepPlan:
        """The step of the first suspect in ``plan``, alone, if it holds one: the others of the plan
        wait a step (nothing of theirs was changed by planning it)."""
        for item in plan.items:
            if item.seq.seq_id in self._suspects:
                return plan.only(lambda i: i is item)  # noqa: B023 (used at once)
        return plan

    def _run_apart(self, plan: StepPlan, exc: Exception) -> StepPlan:
        """The batch's forward raised: run each sequence's part alone to find the ones that
        fail by themselves (a shape or input only they have), fail those, and return the
        plan of the others (whose forward is run again, batched: the KV it rewrites is the
        same). A single sequence that fails is the culprit without a second try. A hybrid
        model's forward may have advanced some of their recurrent states already (a KV write is
        redone the same; a state update is not): each is rolled back instead, preempted to
        resume from its last snapshot, and runs alone up to where this step would have taken
        it, where it fails by itself or is cleared (``_run_alone``)."""
        if self.runner.states is not None:
            self.scheduler.cache.discard_checkpoints(item.seq for item in plan.items)
        if len(plan.items) == 1:
            self._step_failed(exc, [plan.items[0].seq])
            return StepPlan([], [])
        if self.runner.states is not None:
            for item in plan.items:
                self._suspects[item.seq.seq_id] = item.start + item.length
                self.scheduler.preempt(item.seq)
            self._step_failed(exc, [])
            return StepPlan([], [])
        keep: list[Scheduled] = []
        for item in plan.items:
            alone = plan.only(lambda i: i is item)  # noqa: B023 (used at once)
            try:
                self.runner.run(alone)
            except Exception as item_exc:
                self._step_failed(item_exc, [item.seq])
                continue
            keep.append(item)
        if len(keep) == len(plan.items):  # none fails alone: a fault of the batch itself
            self._step_failed(exc, [item.seq for item in plan.items])
            return StepPlan([], [])
        kept = {id(item) for item in keep}
        return plan.only(lambda i: id(i) in kept)

    def _culprits(self) -> list[Sequence]:
        """The sequences an exception outside the forward is traced to: the one the
        scheduler had in hand, those it had taken off its queues, and (after too many
        failures in a row, when nothing can be traced) every active one, so that no request
        waits for a step that keeps failing."""
        sched = self.scheduler
        queued = {id(s) for s in (*sched.waiting, *sched.running, *sched.loading)}
        found = [s for s in self._seqs.values() if id(s) not in queued]
        if sched.in_hand is not None and sched.in_hand.state != SeqState.FINISHED and sched.in_hand not in found:
            found.append(sched.in_hand)
        if not found and self.stats.step_failures_in_a_row + 1 >= self.config.unhealthy_after_failed_steps:
            found = list(self._seqs.values())
        return found

    def _step_failed(self, exc: Exception, seqs: Seq[Sequence]) -> None:
        """Count a failed step and fail ``seqs`` with its error."""
        self.stats.step_failures += 1
        self.stats.step_failures_in_a_row += 1
        self.last_step_error = f"{type(exc).__name__}: {exc}"
        self.last_step_error_time = time.time()
        if not self.healthy and self.stats.step_failures_in_a_row == self.config.unhealthy_after_failed_steps:
            log.error("%d engine steps failed in a row; /health answers 503 until one succeeds",
                      self.config.unhealthy_after_failed_steps)
        for seq in seqs:
            self._finish(seq, TokenEvent(seq.seq_id, None, "", finish_reason="error", error=self.last_step_error))

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Step until no work is left (manual mode: tests, benchmarks)."""
        for _ in range(max_steps):
            if not self.step_or_wait():
                return

    def step_or_wait(self) -> bool:
        """Manual mode: one step, or a short wait for lower-tier reads. False when idle."""
        self._wake.clear()
        if self.step() or not self._inbox.empty():
            return True
        if self.scheduler.has_work():  # only loads in flight: their completion sets _wake
            self._wake.wait(0.05)
            return True
        return False

    def _append(self, seq: Sequence, res: SampleResult) -> None:
        seq.token_ids.append(res.token_id)
        self.stats.generated_tokens += 1
        event = token_event(seq, res, self.max_model_len)
        if event.finish_reason is None:
            seq.emit(event)
        else:
            self._finish(seq, event)

    def _finish(self, seq: Sequence, event: TokenEvent) -> None:
        if seq.state == SeqState.FINISHED:
            return
        # The client gets its last event even when the bookkeeping around it fails.
        try:
            self.scheduler.remove(seq)
        except Exception:
            log.exception("releasing sequence %d failed; its blocks may stay held", seq.seq_id)
            seq.state = SeqState.FINISHED
        self._seqs.pop(seq.seq_id, None)
        self._suspects.pop(seq.seq_id, None)
        seq.finish_reason = event.finish_reason
        try:
            final_event(seq, event)
        except Exception:
            log.exception("the totals of sequence %d's last event failed", seq.seq_id)
        if event.finish_reason == "abort":
            self.stats.requests_aborted += 1
        elif event.finish_reason == "error":
            self.stats.requests_failed += 1
        else:
            self.stats.requests_finished += 1
        self.stats.cached_prompt_tokens += seq.num_cached_tokens or 0
        seq.emit(event)



__all__ = ["Engine", "GenerationResult", "RequestHandle"]
