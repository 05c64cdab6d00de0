"""The background batch writer: batches, never blocks, counts drops, retries, flushes on close."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from collectors.batch_writer import BatchWriter


class ListSink:
    """A sink at our own seam: records what it is given; can be told to fail or to stall."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.fail_next = 0
        self.gate = threading.Event()
        self.gate.set()

    def write(self, batch: Sequence[int]) -> None:
        self.gate.wait(10)
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("database is locked")
        self.batches.append(list(batch))

    @property
    def items(self) -> list[int]:
        return [x for b in self.batches for x in b]


def test_everything_submitted_is_written_in_order_in_batches() -> None:
    sink = ListSink()
    writer = BatchWriter(sink.write, batch_size=100, flush_interval_s=0.05)
    sink.gate.clear()  # hold the first write so the rest queue up and batch together
    writer.start()
    for i in range(1000):
        assert writer.submit(i)
    sink.gate.set()
    assert writer.flush(10)
    writer.close()
    assert sink.items == list(range(1000))
    assert max(len(b) for b in sink.batches) == 100
    assert len(sink.batches) < 1000
    stats = writer.stats
    assert (stats.submitted, stats.written, stats.dropped_queue_full, stats.queued) == (1000, 1000, 0, 0)


def test_a_full_queue_drops_and_counts_without_blocking() -> None:
    sink = ListSink()
    sink.gate.clear()
    writer = BatchWriter(sink.write, max_queue=10, batch_size=5, flush_interval_s=0.05)
    writer.start()
    started = time.perf_counter()
    accepted = sum(writer.submit(i) for i in range(100))
    assert time.perf_counter() - started < 0.5  # never waits for the stalled sink
    assert accepted <= 10 + 5  # the queue plus what the writer already took
    assert writer.stats.dropped_queue_full == 100 - accepted
    sink.gate.set()
    writer.close()
    assert len(sink.items) == accepted
    assert writer.stats.written == accepted


def test_a_failing_write_is_retried_then_succeeds() -> None:
    sink = ListSink()
    sink.fail_next = 2
    writer = BatchWriter(sink.write, max_attempts=3, retry_delay_s=0.01, flush_interval_s=0.05)
    writer.start()
    writer.submit(1)
    writer.submit(2)
    assert writer.flush(10)
    writer.close()
    assert sink.items == [1, 2]
    assert writer.stats.write_errors == 2 and writer.stats.dropped_write_failed == 0


def test_a_batch_that_keeps_failing_is_dropped_and_counted_and_later_ones_still_go() -> None:
    sink = ListSink()
    sink.fail_next = 3
    writer = BatchWriter(sink.write, max_attempts=3, retry_delay_s=0.01, flush_interval_s=0.05)
    writer.start()
    writer.submit(1)
    assert writer.flush(10)
    writer.submit(2)
    assert writer.flush(10)
    writer.close()
    assert sink.items == [2]
    assert writer.stats.dropped_write_failed == 1 and writer.stats.write_errors == 3


def test_records_arriving_together_are_written_in_one_batch() -> None:
    sink = ListSink()
    writer = BatchWriter(sink.write, linger_s=0.3, flush_interval_s=0.05)
    writer.start()
    for i in range(5):
        writer.submit(i)
        time.sleep(0.02)  # trickling in, as requests finish one by one
    assert writer.flush(10)
    writer.close()
    assert sink.batches == [[0, 1, 2, 3, 4]]


def test_close_writes_what_is_still_queued() -> None:
    sink = ListSink()
    writer = BatchWriter(sink.write, flush_interval_s=5.0)  # a long interval: only close flushes
    writer.start()
    for i in range(10):
        writer.submit(i)
    writer.close()
    assert sink.items == list(range(10))


def test_never_started_writer_writes_on_close() -> None:
    sink = ListSink()
    writer = BatchWriter(sink.write)
    writer.submit(7)
    writer.close()
    assert sink.items == [7]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_queue": 0},
        {"batch_size": 0},
        {"max_attempts": 0},
        {"flush_interval_s": 0},
        {"retry_delay_s": -1},
        {"linger_s": -0.1},
    ],
)
def test_bad_settings_name_the_value(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="got"):
        BatchWriter(ListSink().write, **kwargs)  # type: ignore[arg-type]
