"""A step that raises answers the requests it can be traced to with an error, and the
engine goes on serving the others (issue 24): a forward failing for one request's input, a
failure while admitting one request, and failures that cannot be traced to anyone."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import pytest

from kvcellar.engine import SamplingParams, observability
from kvcellar.engine.model_runner import ModelRunner
from kvcellar.engine.scheduler import Scheduled, Scheduler, StepPlan
from tests._models import assert_no_leaks, chat_ids, make_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Give me a name for a grey cat."]
POISONED = "Spell the word zebra backwards."


def poison_of(model: Any) -> tuple[int, ...]:
    """The token run only ``POISONED`` holds."""
    return tuple(model.tokenizer.encode(" zebra backwards", add_special_tokens=False))


def holds(seq: Any, poison: tuple[int, ...]) -> bool:
    """Whether ``seq``'s prompt holds the ``poison`` token run."""
    ids, n = seq.token_ids[:seq.num_prompt_tokens], len(poison)
    return any(tuple(ids[i:i + n]) == poison for i in range(len(ids) - n + 1))


class PoisonedRunner(ModelRunner):
    """The real runner, whose forward raises for any batch holding a prompt with the
    ``poison`` token run (as a kernel failing for one request's shape would)."""

    poison: tuple[int, ...] = ()

    def run(self, plan: StepPlan) -> Any:
        if any(holds(item.seq, self.poison) for item in plan.items):
            raise RuntimeError("kernel failed for this shape")
        return super().run(plan)


def poisoned_engine(model: Any, **overrides: Any) -> Any:
    engine = make_engine(model, **overrides)
    engine.runner.__class__ = PoisonedRunner
    engine.runner.poison = poison_of(model)
    return engine


@pytest.fixture(scope="module")
def clean(model: Any) -> list[list[int]]:
    engine = make_engine(model)
    return [r.token_ids for r in engine.generate([chat_ids(model, p) for p in PROMPTS], GREEDY)]


def test_a_forward_failing_for_one_request_fails_only_that_request(model, clean):
    engine = poisoned_engine(model)
    handles = [engine.submit(chat_ids(model, p), GREEDY) for p in PROMPTS]
    bad = engine.submit(chat_ids(model, POISONED), GREEDY)
    engine.run_until_idle()
    results = [engine.collect(h) for h in handles]
    assert [r.token_ids for r in results] == clean
    assert all(r.finish_reason in ("stop", "length") for r in results)
    failed = engine.collect(bad)
    assert failed.finish_reason == "error"
    assert "RuntimeError: kernel failed for this shape" in (failed.error or "")
    assert engine.stats.step_failures == 1
    assert engine.stats.requests_failed == 1
    assert engine.last_step_error == "RuntimeError: kernel failed for this shape"
    assert engine.healthy  # the steps after it succeeded
    assert engine.stats.step_failures_in_a_row == 0
    assert_no_leaks(engine)


def test_the_failed_request_joining_mid_decode_does_not_change_the_others(model, clean):
    engine = poisoned_engine(model)
    handles = [engine.submit(chat_ids(model, p), GREEDY) for p in PROMPTS]
    for _ in range(4):
        engine.step()
    bad = engine.submit(chat_ids(model, POISONED), GREEDY)
    engine.run_until_idle()
    assert [engine.collect(h).token_ids for h in handles] == clean
    assert engine.collect(bad).finish_reason == "error"
    assert_no_leaks(engine)


class PoisonedScheduler(Scheduler):
    """The real scheduler, whose commit raises for a sequence holding the ``poison`` run once
    it has generated a few tokens (as post-processing failing for one request would)."""

    poison: tuple[int, ...] = ()

    def commit(self, item: Scheduled) -> None:
        seq = item.seq
        if seq.num_tokens > seq.num_prompt_tokens + 2 and holds(seq, self.poison):
            raise RuntimeError("post-processing failed")
        super().commit(item)


def test_a_request_failing_after_the_forward_leaves_the_others_their_own_logits(model, clean):
    """The failing request decodes first in the batch: the rows of the logits after its own
    still go to their own requests."""
    engine = make_engine(model)
    engine.scheduler.__class__ = PoisonedScheduler
    engine.scheduler.poison = poison_of(model)
    bad = engine.submit(chat_ids(model, POISONED), GREEDY)
    handles = [engine.submit(chat_ids(model, p), GREEDY) for p in PROMPTS]
    engine.run_until_idle()
    assert [engine.collect(h).token_ids for h in handles] == clean
    assert engine.collect(bad).finish_reason == "error"
    assert_no_leaks(engine)


def test_steps_failing_in_a_row_make_the_engine_unhealthy_until_one_succeeds(model, clean):
    engine = poisoned_engine(model, unhealthy_after_failed_steps=3)
    for n in range(1, 4):
        assert engine.collect(engine.submit(chat_ids(model, POISONED), GREEDY)).finish_reason == "error"
        assert engine.stats.step_failures_in_a_row == n
        assert engine.healthy == (n < 3)
    health = observability.step_health(engine)
    assert health["healthy"] is False and health["step_failures"] == 3
    assert "kernel failed" in str(health["last_step_error"])
    assert engine.generate([chat_ids(model, PROMPTS[0])], GREEDY)[0].token_ids == clean[0]
    assert engine.healthy and engine.stats.step_failures == 3
    assert_no_leaks(engine)


def test_a_failure_while_admitting_one_request_fails_that_request_alone(model, clean):
    engine = make_engine(model)
    cache = engine.scheduler.cache
    admit = cache.admit
    bad_prompt = chat_ids(model, POISONED)

    def failing_admit(seq: Any, **kw: Any) -> Any:
        if seq.token_ids[:seq.num_prompt_tokens] == bad_prompt:
            raise KeyError("block table broken")
        return admit(seq, **kw)

    cache.admit = failing_admit
    first = engine.submit(chat_ids(model, PROMPTS[0]), GREEDY)
    bad = engine.submit(bad_prompt, GREEDY)  # queued between two good ones
    rest = [engine.submit(chat_ids(model, p), GREEDY) for p in PROMPTS[1:]]
    engine.run_until_idle()
    assert [engine.collect(h).token_ids for h in [first, *rest]] == clean
    failed = engine.collect(bad)
    assert failed.finish_reason == "error" and "KeyError" in (failed.error or "")
    assert engine.stats.step_failures == 1
    assert_no_leaks(engine)


def test_failures_traced_to_no_request_fail_every_request_after_too_many_in_a_row(model, clean):
    """A step that keeps failing before it reaches any request (here: polling the lower
    tiers) must not leave requests waiting forever: after the limit, every active one gets
    an error; once the fault is gone the engine serves again."""
    engine = make_engine(model, unhealthy_after_failed_steps=3)
    cache = engine.scheduler.cache
    poll = cache.poll
    broken = [True]

    def failing_poll() -> Seq[Any]:
        if broken[0]:
            raise OSError("lower tiers unreachable")
        return poll()

    cache.poll = failing_poll
    handles = [engine.submit(chat_ids(model, p), GREEDY) for p in PROMPTS[:2]]
    for _ in range(2):  # retried: the fault may pass
        engine.step()
        assert engine.num_active() == 2
    engine.step()  # the third in a row fails them
    assert engine.num_active() == 0
    for h in handles:
        result = engine.collect(h)
        assert result.finish_reason == "error" and "OSError: lower tiers unreachable" in (result.error or "")
    assert not engine.healthy
    broken[0] = False
    assert engine.generate([chat_ids(model, PROMPTS[2])], GREEDY)[0].token_ids == clean[2]
    assert engine.healthy
    assert_no_leaks(engine)


def test_a_threaded_engine_answers_a_failed_request(model, clean):
    engine = poisoned_engine(model)
    engine.start()
    try:
        bad = engine.submit(chat_ids(model, POISONED), GREEDY)
        good = engine.submit(chat_ids(model, PROMPTS[1]), GREEDY)
        assert engine.collect(bad).finish_reason == "error"
        assert engine.collect(good).token_ids == clean[1]
    finally:
        assert engine.shutdown(30.0)
