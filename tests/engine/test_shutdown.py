"""Shutdown with an engine thread that does not stop (a forward stuck in a kernel): it
returns within its bound, says it was not clean, and the stuck request's client gets a final
event instead of waiting forever (issue 24)."""

from __future__ import annotations

import threading
import time
from typing import Any

from kvcellar.engine import SamplingParams
from kvcellar.engine.model_runner import ModelRunner
from kvcellar.engine.scheduler import StepPlan
from tests._models import chat_ids, make_engine


class StuckRunner(ModelRunner):
    """The real runner, whose forward blocks until ``release`` is set."""

    entered: threading.Event
    release: threading.Event

    def run(self, plan: StepPlan) -> Any:
        self.entered.set()
        self.release.wait()
        return super().run(plan)


def test_shutdown_returns_with_a_stuck_engine_thread_and_aborts_its_requests(model, caplog):
    engine = make_engine(model)
    engine.runner.__class__ = StuckRunner
    engine.runner.entered, engine.runner.release = threading.Event(), threading.Event()
    engine.start()
    thread = engine._thread
    try:
        handle = engine.submit(chat_ids(model, "What is the capital of France?"), SamplingParams(max_tokens=4))
        assert engine.runner.entered.wait(60)
        t0 = time.monotonic()
        assert engine.shutdown(timeout=0.5) is False
        assert time.monotonic() - t0 < 30  # bounded: the join waits max(5 s, timeout)
        event = handle.stream.get_sync(timeout=30)  # before: no event ever came
        assert event.finish_reason == "abort"
        assert "engine thread did not stop" in caplog.text
    finally:
        engine.runner.release.set()
        assert thread is not None
        thread.join(60)
        assert not thread.is_alive()
