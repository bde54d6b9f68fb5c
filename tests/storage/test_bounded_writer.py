"""The shared bounded writer (storage/writer.py) on its own, with real threads: what a full
queue refuses, how long ``offer`` may wait, batching, and what ``close`` drains or drops.
Every accepted item is written or counted, and ``done`` sees each exactly once. Waits are
on events and conditions with generous deadlines, never on the clock."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest

from kvcellar.stats import Count, SharedStats, counter
from kvcellar.storage.writer import BoundedWriter
from tests.helpers import wait_until

_log = logging.getLogger("tests.bounded_writer")


class Gate:
    """A ``write_batch`` that records its batches and, while closed, blocks in the call."""

    def __init__(self, *, open_: bool = True) -> None:
        self.lock = threading.Lock()
        self.batches: list[list[int]] = []
        self.entered = threading.Event()
        self.released = threading.Event()
        if open_:
            self.released.set()

    def __call__(self, batch: list[int]) -> None:
        self.entered.set()
        assert self.released.wait(60)
        with self.lock:
            self.batches.append(list(batch))

    @property
    def written(self) -> list[int]:
        with self.lock:
            return [x for b in self.batches for x in b]


@dataclass
class WriterStats(SharedStats):
    PREFIX: ClassVar[str] = "w_"
    enqueued: Count = counter()
    dropped_queue_full: Count = counter()
    dropped_closed: Count = counter()
    enqueue_wait_s_total: Count = counter(0.0)
    dropped_error: Count = counter()
    dropped_abort: Count = counter()
    failed: Count = counter()


class Done:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: list[int] = []

    def __call__(self, batch: list[int]) -> None:
        with self.lock:
            self.items.extend(batch)


@pytest.fixture
def make_writer() -> Iterator[Callable[..., tuple[BoundedWriter[int], WriterStats, Done]]]:
    made: list[BoundedWriter[int]] = []

    def make(write_batch: Callable[[list[int]], None], *, capacity: int = 4, batch: int = 1,
             **kwargs: Any) -> tuple[BoundedWriter[int], WriterStats, Done]:
        counters, done = WriterStats(), Done()
        error = getattr(counters, kwargs.pop("error_counter", "dropped_error"))
        abort = getattr(counters, kwargs.pop("abort_counter", "dropped_closed"))
        writer: BoundedWriter[int] = BoundedWriter("kvcellar-test-writer", capacity, write_batch, counters, log=_log,
                                                   label="test writer", batch=batch, done=done, error_count=error,
                                                   abort_count=abort, **kwargs)
        made.append(writer)
        return writer, counters, done

    yield make
    for w in made:
        w.close(10)


def test_a_full_queue_refuses_and_counts_without_waiting(make_writer) -> None:
    gate = Gate(open_=False)
    writer, c, done = make_writer(gate, capacity=2)
    assert writer.offer(0) and gate.entered.wait(30)  # taken by the thread: the queue is empty again
    assert writer.offer(1) and writer.offer(2)
    assert writer.full and writer.queue_depth == 2 and writer.in_flight == 1
    assert writer.offer(3) is False and c.dropped_queue_full.value == 1
    assert c.enqueue_wait_s_total.value == 0  # no deadline: no wait
    gate.released.set()
    assert writer.wait_idle(30)
    assert gate.written == [0, 1, 2] and sorted(done.items) == [0, 1, 2]
    assert c.enqueued.value == 3 and writer.in_flight == 0 and not writer.full
    assert writer.close(30) is True


def test_offer_with_a_deadline_waits_for_room(make_writer) -> None:
    gate = Gate(open_=False)
    writer, c, _ = make_writer(gate, capacity=1)
    assert writer.offer(0) and gate.entered.wait(30)
    assert writer.offer(1) and writer.full
    assert writer.offer(2, deadline=time.monotonic() - 1) is False  # a spent budget does not wait
    results: list[bool] = []
    producer = threading.Thread(target=lambda: results.append(writer.offer(3, deadline=time.monotonic() + 60)),
                                name="producer")
    producer.start()
    gate.released.set()  # the thread takes 1 from the queue: the producer's 3 fits
    producer.join(60)
    assert not producer.is_alive() and results == [True]
    assert writer.wait_idle(30) and gate.written == [0, 1, 3]
    assert c.dropped_queue_full.value == 1 and c.enqueue_wait_s_total.value > 0


def test_wait_for_room_waits_until_the_thread_takes_an_item(make_writer) -> None:
    gate = Gate(open_=False)
    writer, c, _ = make_writer(gate, capacity=1)
    assert writer.offer(0) and gate.entered.wait(30)
    assert writer.offer(1) and writer.full
    assert writer.wait_for_room(0) is False  # no wait asked: full is full
    results: list[bool] = []
    waiter = threading.Thread(target=lambda: results.append(writer.wait_for_room(60)), name="waiter")
    waiter.start()
    gate.released.set()  # the thread takes 1 from the queue: room
    waiter.join(60)
    assert not waiter.is_alive() and results == [True]
    assert c.dropped_queue_full.value == 0  # a refusal is the caller's to count
    assert writer.close(30) is True
    assert writer.wait_for_room(60) is False  # closed: no room ever again, at once


def test_a_writer_that_frees_nothing_during_a_wait_is_not_waited_on_again(make_writer) -> None:
    """A stalled device costs one wait, not one per block offered after it; a longer wait
    (the shutdown's) is still tried, and once the thread takes an item, every wait is."""
    turns = threading.Semaphore(0)  # one write per release
    written: list[int] = []

    def write(batch: list[int]) -> None:
        assert turns.acquire(timeout=60)
        written.extend(batch)

    writer, c, _ = make_writer(write, capacity=1)
    assert writer.offer(0)
    wait_until(lambda: writer.in_flight == 1 or None, timeout=30, what="the thread to take the first item")
    assert writer.offer(1) and writer.full
    assert writer.wait_for_room(0.05) is False  # the write is stuck: the wait runs out
    waited = c.enqueue_wait_s_total.value
    assert writer.wait_for_room(0.05) is False and writer.wait_for_room(0.01) is False
    assert c.enqueue_wait_s_total.value == waited  # not waited on
    assert writer.wait_for_room(0.1) is False and c.enqueue_wait_s_total.value > waited  # longer: waited on
    turns.release()  # item 0 written; the thread takes item 1 and is stuck again
    wait_until(lambda: writer.wait_for_room(0), timeout=30, what="room in the queue")
    assert writer.offer(2) and writer.full
    waited = c.enqueue_wait_s_total.value
    assert writer.wait_for_room(0.05) is False and c.enqueue_wait_s_total.value > waited  # waited on again
    turns.release(2)
    assert writer.wait_idle(30) and written == [0, 1, 2]


def test_batches_take_up_to_batch_items_in_order(make_writer) -> None:
    gate = Gate(open_=False)
    writer, _, done = make_writer(gate, capacity=16, batch=3)
    assert writer.offer(0) and gate.entered.wait(30)
    for i in range(1, 8):
        assert writer.offer(i)
    gate.released.set()
    assert writer.wait_idle(30)
    assert gate.written == list(range(8)) and all(len(b) <= 3 for b in gate.batches)
    assert gate.batches[0] == [0] and len(gate.batches) >= 1 + 7 // 3
    assert sorted(done.items) == list(range(8))


def test_close_drains_the_queue_then_refuses(make_writer) -> None:
    gate = Gate(open_=False)
    writer, c, done = make_writer(gate, capacity=8)
    for i in range(6):
        assert writer.offer(i)
    gate.released.set()
    assert writer.close(60) is True
    assert gate.written == list(range(6)) and sorted(done.items) == list(range(6))
    assert writer.offer(6) is False and c.dropped_closed.value == 1
    assert writer.wait_idle(1) and writer.close(1) is True


def test_close_past_its_deadline_drops_the_queue_and_the_stuck_write_finishes(make_writer) -> None:
    gate = Gate(open_=False)
    writer, c, done = make_writer(gate, capacity=8, abort_counter="dropped_abort")
    assert writer.offer(0) and gate.entered.wait(30)
    for i in range(1, 6):
        assert writer.offer(i)
    assert writer.close(0.1) is False
    assert c.dropped_abort.value == 5 and sorted(done.items) == [1, 2, 3, 4, 5]  # dropped ones: done at once
    assert writer.queue_depth == 0 and writer.in_flight == 1 and not writer.wait_idle(0)
    assert writer.offer(9) is False and c.dropped_closed.value == 1
    gate.released.set()
    assert writer.wait_idle(30)  # the stuck write returned: nothing outstanding
    assert gate.written == [0] and sorted(done.items) == list(range(6))
    assert c.enqueued.value == 6 == len(gate.written) + c.dropped_abort.value
    assert writer.close(1) is False  # it did drop blocks


def test_a_failing_write_or_hook_is_counted_and_the_thread_goes_on(make_writer, caplog) -> None:
    failures = iter([ValueError("in before_batch"), None, None])

    def before() -> None:
        exc = next(failures, None)
        if exc is not None:
            raise exc

    def write(batch: list[int]) -> None:
        if 1 in batch:
            raise RuntimeError("in write_batch")
        gate(batch)

    gate = Gate()
    with caplog.at_level(logging.ERROR, logger=_log.name):
        writer, c, done = make_writer(write, error_counter="failed", before_batch=before)
        for i in range(4):
            assert writer.offer(i)
        assert writer.wait_idle(30)
    assert c.failed.value == 2 and gate.written == [2, 3] and sorted(done.items) == [0, 1, 2, 3]
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("test writer failed writing 1 block(s)") for m in messages)
    assert writer.close(10) is True


def test_idle_is_called_while_the_queue_is_empty(make_writer) -> None:
    calls = threading.Semaphore(0)
    gate = Gate()
    writer, _, _ = make_writer(gate, idle=calls.release, idle_s=0.01)
    for _ in range(3):
        assert calls.acquire(timeout=30)
    assert writer.offer(7) and writer.wait_idle(30) and gate.written == [7]
    assert writer.close(10) is True
    wait_until(lambda: not any(t.name == "kvcellar-test-writer" and t.is_alive() for t in threading.enumerate()),
               timeout=30, what="the thread to exit")
