"""RemoteWriter on its own: a batch or an idle call that raises is survived and counted, a
write that never returns does not hold ``close`` past its timeout, and every block offered
around ``close`` is written or counted (never lost)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvcellar.storage.base import StoreRequest
from kvcellar.storage.remote.stats import RemoteStats
from kvcellar.storage.remote.writer import RemoteWriter
from tests.helpers import wait_until
from tests.storage.helpers import chain

DROPS = ("dropped_closed", "dropped_queue_full", "dropped_error")


class Written:
    """A ``write_batch`` that records what it got; ``before`` runs first (may raise or block)."""

    def __init__(self, before: Callable[[int], None] = lambda call: None) -> None:
        self.before = before
        self.lock = threading.Lock()
        self.calls = 0
        self.blocks: list[StoreRequest] = []

    def __call__(self, batch: list[StoreRequest]) -> None:
        with self.lock:
            self.calls += 1
            call = self.calls
        self.before(call)
        with self.lock:
            self.blocks.extend(batch)

    @property
    def count(self) -> int:
        with self.lock:
            return len(self.blocks)


@pytest.fixture
def make_writer() -> Iterator[Callable[..., tuple[RemoteWriter, RemoteStats]]]:
    """``make_writer(write_batch, idle=None, capacity=16, batch=4)``; closed at teardown."""
    made: list[RemoteWriter] = []

    def make(write_batch: Callable[[list[StoreRequest]], None], idle: Callable[[], None] | None = None,
             capacity: int = 16, batch: int = 4, idle_s: float = 0.02) -> tuple[RemoteWriter, RemoteStats]:
        counters = RemoteStats()
        writer = RemoteWriter("kvcellar-remote-writer-test", capacity, batch, write_batch, idle or (lambda: None),
                              counters, idle_s=idle_s)
        made.append(writer)
        return writer, counters

    yield make
    for w in made:
        w.close(5)


def test_a_batch_that_raises_is_counted_and_the_thread_goes_on(make_writer, caplog):
    def fail_first(call: int) -> None:
        if call == 1:
            raise RuntimeError("a bug in write_batch")

    written = Written(fail_first)
    writer, c = make_writer(written)
    blocks = chain(4)
    with caplog.at_level(logging.ERROR, logger="kvcellar.storage.remote"):
        assert writer.offer(blocks[0])
        assert writer.wait_idle(30)
    assert c.dropped_error.value == 1 and written.count == 0
    assert any("a bug in write_batch" in r.exc_text for r in caplog.records if r.exc_text)
    for b in blocks[1:]:
        assert writer.offer(b)
    assert writer.wait_idle(30)
    assert written.blocks == blocks[1:] and c.enqueued.value == 4 and c.dropped_error.value == 1
    assert writer.close(10) is True


def test_an_idle_call_that_raises_is_survived_and_logged_boundedly(make_writer, caplog):
    calls = 0

    def idle() -> None:
        nonlocal calls
        calls += 1
        raise ValueError("a bug in the probe")

    written = Written()
    with caplog.at_level(logging.ERROR, logger="kvcellar.storage.remote"):
        writer, _ = make_writer(written, idle=idle)
        wait_until(lambda: calls >= 20, timeout=30, what="idle calls going on")
        logged = len([r for r in caplog.records if "idle call" in r.getMessage()])
    assert logged <= calls.bit_length()  # 1, 2, 4, 8, ...: not one line per failure
    blocks = chain(3)
    for b in blocks:
        assert writer.offer(b)
    assert writer.wait_idle(30) and written.blocks == blocks
    assert writer.close(10) is True


def test_close_returns_in_time_with_a_stuck_write_and_a_full_queue(make_writer):
    entered, release = threading.Event(), threading.Event()

    def hang(call: int) -> None:
        entered.set()
        release.wait()

    written = Written(hang)
    writer, c = make_writer(written, capacity=8, batch=1)
    try:
        blocks = chain(20)
        assert writer.offer(blocks[0])
        assert entered.wait(30)
        accepted = 1 + sum(writer.offer(b) for b in blocks[1:])  # never waits on the full queue
        assert accepted == 9 and writer.full and c.dropped_queue_full.value == 11
        t0 = time.monotonic()
        assert writer.close(0.5) is False
        assert time.monotonic() - t0 < 5
        assert c.dropped_closed.value == 8  # the queued ones; the stuck one is still in write_batch
        assert writer.in_flight == 1 and not writer.wait_idle(0.1)
        assert writer.offer(blocks[0]) is False and c.dropped_closed.value == 9
    finally:
        release.set()
    assert writer.wait_idle(30)  # the stuck write returned: nothing outstanding
    assert written.count == 1
    refused_after_close = 1
    assert c.enqueued.value == 9 == written.count + c.dropped_closed.value - refused_after_close


class Fatal(BaseException):
    """Not an Exception: nothing in the writer survives it, its thread ends."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_thread_does_not_hang_wait_idle_or_close(make_writer):
    def die(call: int) -> None:
        raise Fatal

    writer, c = make_writer(Written(die), capacity=8, batch=1)
    blocks = chain(5)
    assert writer.offer(blocks[0])
    wait_until(lambda: c.dropped_error.value == 1, timeout=30, what="the thread to die on its first batch")
    for b in blocks[1:]:
        assert writer.offer(b)
    t0 = time.monotonic()
    assert writer.wait_idle(30) is False  # at once: nobody will ever take these
    assert writer.close(30) is False
    assert time.monotonic() - t0 < 5
    assert c.enqueued.value == 5 and c.dropped_error.value + c.dropped_closed.value == 5


@pytest.mark.parametrize("round_", range(10))
def test_offers_racing_close_are_written_or_counted(make_writer, round_):
    written = Written()
    writer, c = make_writer(written, capacity=16, batch=4)
    blocks = chain(8)
    results: list[list[bool]] = [[] for _ in range(4)]
    closed = threading.Event()

    def produce(out: list[bool]) -> None:
        refused_after_close = 0
        i = 0
        while refused_after_close < 50:
            ok = writer.offer(blocks[i % len(blocks)])
            out.append(ok)
            i += 1
            if closed.is_set() and not ok:
                refused_after_close += 1

    producers = [threading.Thread(target=produce, args=(out,), name=f"producer-{i}") for i, out in enumerate(results)]
    for p in producers:
        p.start()
    wait_until(lambda: written.count >= 200, timeout=30, what="writes under way")
    assert writer.close(30) is True
    closed.set()
    for p in producers:
        p.join(30)
        assert not p.is_alive()
    offered = sum(len(r) for r in results)
    accepted = sum(sum(r) for r in results)
    assert c.enqueued.value == accepted == written.count  # all accepted ones written: close drained
    assert offered == written.count + sum(getattr(c, d).value for d in DROPS)
    assert c.dropped_error.value == 0 and writer.wait_idle(1)
