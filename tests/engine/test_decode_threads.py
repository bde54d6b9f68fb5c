"""Small steps (decodes) may run on fewer torch threads than prefill chunks
(engine/model_runner.py); warm-up measures which is faster. Outputs do not depend on it."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcellar.engine import SamplingParams, observability
from kvcellar.engine.loader import MachineFigures
from kvcellar.engine.model_runner import CLEAR_LEAD, SMALL_STEP_TOKENS
from kvcellar.engine.native.threads import SpinGate
from kvcellar.engine.warmup import warm_up
from tests._models import LOGPROB_TOL, chat_ids, make_engine

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, logprobs=True, ignore_eos=True)


@pytest.fixture
def two_threads() -> Iterator[None]:
    """Test workers run on one thread each; the engine under test gets two to choose from."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_decode_steps_use_decode_threads_and_prefill_uses_all(model: Any, two_threads: None) -> None:
    engine = make_engine(model, decode_threads=1)
    seen: list[tuple[int, int]] = []
    forward = engine.runner.forward

    def spy(*args: Any) -> Any:
        seen.append((int(args[0].shape[1]), torch.get_num_threads()))
        return forward(*args)

    engine.runner.forward = spy
    engine.generate([chat_ids(model, "Tell me about tea. " * 4)], GREEDY)
    assert torch.get_num_threads() == 2  # set per step, then given back
    assert seen[0][0] > SMALL_STEP_TOKENS and seen[0][1] == 2  # the prefill
    assert len(seen) == GREEDY.max_tokens and all(threads == 1 for _, threads in seen[1:])  # decodes
    assert observability.snapshot(engine)["runner_decode_threads"] == 1
    assert "runner_decode_threads" in observability.gauge_keys(engine)


def test_outputs_do_not_depend_on_decode_threads(model: Any, two_threads: None) -> None:
    prompts = [chat_ids(model, q) for q in ("Name a colour.", "Count to three.", "Why is the sky blue?")]
    one = make_engine(model, decode_threads=1).generate(prompts, GREEDY)
    both = make_engine(model, decode_threads=2)
    assert both.runner.decode_threads == 2  # the first engine's steps left torch's count alone
    all_ = both.generate(prompts, GREEDY)
    for a, b in zip(one, all_, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= LOGPROB_TOL


def test_warm_up_measures_decode_threads_and_leaves_no_trace(model: Any, two_threads: None) -> None:
    engine = make_engine(model)
    assert engine.runner.decode_threads == 2  # before warm-up: all threads
    warm_up(engine)
    assert engine.runner.decode_threads in (1, 2)
    snap = observability.snapshot(engine)
    assert snap["runner_decode_threads"] == engine.runner.decode_threads
    assert snap["engine_requests_total"] == 0 and engine.blocks.num_used == 0
    assert make_engine(model, decode_threads=1, warmup=True).runner.decode_threads == 1  # given: kept


@pytest.mark.parametrize(("one_thread", "blocks"), [(2.0, 2), (0.5, 2), (1.1, 4), (CLEAR_LEAD, 4)])
def test_a_clear_lead_settles_decode_threads_after_one_block_each(model: Any, two_threads: None, one_thread: float,
                                                                   blocks: int) -> None:
    """A clock that advances by the step's cost on the threads set: one thread's steps cost
    ``one_thread``, two threads' 1. A lead beyond ``CLEAR_LEAD`` stops after a block each
    (``thread_spin`` on: the choice is the blocks' whatever else the machine runs)."""
    runner = make_engine(model, thread_spin="on").runner
    now = [0.0]
    steps: list[int] = []

    def step() -> None:
        steps.append(runner.decode_threads)
        now[0] += one_thread if runner.decode_threads == 1 else 1.0

    chosen = runner.calibrate_decode_threads(step, steps=3, clock=lambda: now[0])
    assert chosen == runner.decode_threads == (1 if one_thread < 1.0 else 2)
    assert len(steps) == blocks * (1 + 3)
    assert steps[:4] == [1] * 4 and steps[4:8] == [2] * 4


def test_threads_measured_while_other_processes_ran_are_all_kept(model: Any, two_threads: None,
                                                                 tmp_path: Path) -> None:
    """One thread's steps look faster while another process takes a CPU (a server starting
    beside this one): under thread_spin auto the measurement is set aside and all threads kept;
    the gate runs decode steps on the CPUs left while the machine stays busy."""
    runner = make_engine(model).runner
    stat, own = tmp_path / "stat", tmp_path / "self_stat"
    ticks = {"machine": 0, "own": 0}

    def write() -> None:
        stat.write_text(f"cpu  {ticks['machine']} 0 0 99999 0 0 0 0 0 0\n")
        own.write_text(f"42 (python) S {' '.join(['0'] * 10)} {ticks['own']} 0 0 0\n")

    write()
    now, busy = [0.0], [1.0]
    runner.spin = SpinGate("auto", cpus=2, proc_stat=stat, self_stat=own, clock=lambda: now[0], quota=math.inf)
    runner.spin.hz = 100

    def step() -> None:
        cost = 0.5 if runner.decode_threads == 1 else 1.0
        now[0] += cost
        ticks["own"] += round(100 * cost * runner.decode_threads)
        ticks["machine"] += round(100 * cost * (runner.decode_threads + busy[0]))
        write()

    assert runner.calibrate_decode_threads(step, steps=3, clock=lambda: now[0]) == 2
    assert not runner.measured_quiet  # not a figure to keep for later starts
    busy[0] = 0.0
    assert runner.calibrate_decode_threads(step, steps=3, clock=lambda: now[0]) == 1  # a quiet machine: measured
    assert runner.measured_quiet


def test_decode_threads_measured_on_a_quiet_machine_are_kept_for_the_next_start(
        model: Any, two_threads: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server's warm-up keeps the decode threads it measured with no other process busy
    (``MachineFigures``, per model and thread count); the next start takes them without
    measuring. A measurement beside a busy process is not kept."""
    figures = MachineFigures(tmp_path / "figures.json")
    measured: list[bool] = []

    def calibrate(runner: Any, quiet: bool) -> Any:
        def measure(decode_step: Any, steps: int = 4, clock: Any = None) -> int:
            measured.append(quiet)
            runner.measured_quiet = quiet
            runner.set_decode_threads(1)
            return 1
        return measure

    engines = [make_engine(model) for _ in range(3)]
    try:
        busy, first, second = engines
        monkeypatch.setattr(busy.runner, "calibrate_decode_threads", calibrate(busy.runner, False))
        warm_up(busy, figures=figures)
        assert measured == [False] and not figures.path.exists()
        monkeypatch.setattr(first.runner, "calibrate_decode_threads", calibrate(first.runner, True))
        warm_up(first, figures=figures)
        assert measured == [False, True] and first.runner.decode_threads == 1
        monkeypatch.setattr(second.runner, "calibrate_decode_threads", calibrate(second.runner, True))
        assert second.runner.decode_threads == second.runner.threads
        warm_up(second, figures=figures)
        assert measured == [False, True] and second.runner.decode_threads == 1  # read back, not measured
        assert observability.snapshot(second)["runner_decode_threads"] == 1
    finally:
        for engine in engines:
            engine.shutdown(timeout=10)


def _timed_steps_rows(runner: Any, monkeypatch: pytest.MonkeyPatch, fail_at: int | None = None) -> list[int]:
    """Spy on the decode-thread measurement: the rows of each step it times (and of the steps
    between its blocks); ``fail_at``: that step's forward raises, and the measurement then
    reports one thread on a quiet machine (what timing empty steps can come to)."""
    rows: list[int] = []
    measure, forward = runner.calibrate_decode_threads, runner.forward

    def spy(*args: Any) -> Any:
        rows.append(int(args[0].shape[1]))
        if len(rows) == fail_at:
            raise RuntimeError("a step that fails while decode threads are measured")
        return forward(*args)

    def calibrate(decode_step: Any, steps: int = 4, clock: Any = None) -> int:
        monkeypatch.setattr(runner, "forward", spy)
        try:
            chosen = measure(decode_step, steps) if clock is None else measure(decode_step, steps, clock)
        finally:
            monkeypatch.setattr(runner, "forward", forward)
        if fail_at is not None:
            runner.set_decode_threads(1)
            runner.measured_quiet, chosen = True, 1
        return int(chosen)

    monkeypatch.setattr(runner, "calibrate_decode_threads", calibrate)
    return rows


def test_decode_threads_are_measured_on_decode_steps_with_drafting_on(
        model: Any, two_threads: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Warm-up's prompt repeats itself, so its continuation is what drafts are made of: the
    measurement suspends drafting, and every step it times decodes one row (a verification's
    cost would decide the threads of every later decode). Drafting is back afterwards."""
    engine = make_engine(model, speculative="ngram", thread_spin="on")
    drafter = engine.scheduler.drafter
    assert drafter is not None
    rows = _timed_steps_rows(engine.runner, monkeypatch)
    warm_up(engine, figures=MachineFigures(tmp_path / "figures.json"))
    assert len(rows) >= 2 * 5 and set(rows) == {1}
    assert engine.scheduler.drafter is drafter


def test_a_step_that_fails_while_decode_threads_are_measured_keeps_all_threads_and_no_figure(
        model: Any, two_threads: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A failed step leaves the measurement's sequence gone and the later steps empty (fast on
    any threads): that is no measurement, and no figure for later starts."""
    engine = make_engine(model, thread_spin="on")
    figures = MachineFigures(tmp_path / "figures.json")
    rows = _timed_steps_rows(engine.runner, monkeypatch, fail_at=3)
    warm_up(engine, figures=figures)
    assert len(rows) == 3  # the sequence failed at its third timed step; none ran after
    assert engine.runner.decode_threads == 2 and not engine.runner.measured_quiet
    assert not figures.path.exists()
    assert engine.stats.requests_total == 0  # warm-up leaves no trace, failure included
