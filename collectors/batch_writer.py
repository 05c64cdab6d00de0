"""Write records in batches on a background thread, off the request path.

``submit`` never blocks: the queue is bounded and a full queue drops the record (counted), so a
slow or dead database can never slow down the traffic being observed. The writer thread waits
``linger_s`` after the first record for more to arrive, writes up to ``batch_size`` in one call,
retries a failed batch a few times with a growing delay, and drops it (counted) after that.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class WriterStats:
    submitted: int
    written: int
    dropped_queue_full: int
    dropped_write_failed: int
    batches: int
    write_errors: int
    queued: int


class BatchWriter(Generic[T]):
    """Background batched writer around ``write(batch)`` (e.g. ``sink.write_requests``)."""

    def __init__(
        self,
        write: Callable[[Sequence[T]], None],
        *,
        name: str = "records",
        max_queue: int = 10_000,
        batch_size: int = 500,
        flush_interval_s: float = 0.5,
        linger_s: float = 0.25,
        max_attempts: int = 3,
        retry_delay_s: float = 0.5,
    ) -> None:
        for label, value in (
            ("max_queue", max_queue),
            ("batch_size", batch_size),
            ("max_attempts", max_attempts),
        ):
            if value < 1:
                raise ValueError(f"{label} must be at least 1 but got {value}")
        if flush_interval_s <= 0:
            raise ValueError(f"flush_interval_s must be positive but got {flush_interval_s}")
        if linger_s < 0:
            raise ValueError(f"linger_s cannot be negative but got {linger_s}")
        if retry_delay_s < 0:
            raise ValueError(f"retry_delay_s cannot be negative but got {retry_delay_s}")
        self._write = write
        self.name = name
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.linger_s = linger_s
        self.max_attempts = max_attempts
        self.retry_delay_s = retry_delay_s
        self._queue: queue.Queue[T] = queue.Queue(maxsize=max_queue)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._submitted = 0
        self._written = 0
        self._dropped_full = 0
        self._dropped_failed = 0
        self._batches = 0
        self._write_errors = 0
        self._failing = False
        self._full_logged = False

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"spectuner-writer-{self.name}", daemon=True)
        self._thread.start()

    def submit(self, item: T) -> bool:
        """Queue one record; False (and counted) when the queue is full. Never blocks."""
        self._submitted += 1
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._dropped_full += 1
            if not self._full_logged:
                self._full_logged = True
                logger.warning(
                    "writer %s: queue full (%d records); dropping new records until it drains",
                    self.name,
                    self._queue.maxsize,
                )
            return False
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop after writing what is queued (up to ``timeout_s``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning(
                    "writer %s: %d record(s) still queued after %.1f s; giving up on them",
                    self.name,
                    self._queue.qsize(),
                    timeout_s,
                )
            self._thread = None
        else:
            self._drain_all()  # never started: write what was queued, synchronously

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything submitted so far is written or dropped; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.005)
        return False

    @property
    def stats(self) -> WriterStats:
        return WriterStats(
            submitted=self._submitted,
            written=self._written,
            dropped_queue_full=self._dropped_full,
            dropped_write_failed=self._dropped_failed,
            batches=self._batches,
            write_errors=self._write_errors,
            queued=self._queue.qsize(),
        )

    # -- the writer thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            batch = self._take(block=True)
            if batch:
                self._write_batch(batch)
        self._drain_all()

    def _drain_all(self) -> None:
        while True:
            batch = self._take(block=False)
            if not batch:
                return
            self._write_batch(batch)

    def _take(self, *, block: bool) -> list[T]:
        batch: list[T] = []
        try:
            batch.append(self._queue.get(timeout=self.flush_interval_s) if block else self._queue.get_nowait())
        except queue.Empty:
            return batch
        if block and self.linger_s > 0 and self._queue.qsize() < self.batch_size - 1:
            # Let a batch build up: one transaction for many records costs far less CPU (and GIL,
            # shared with the proxy's event loop) than one per record.
            self._stop.wait(self.linger_s)
        while len(batch) < self.batch_size:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _write_batch(self, batch: list[T]) -> None:
        try:
            for attempt in range(1, self.max_attempts + 1):
                try:
                    self._write(batch)
                except Exception as exc:  # the sink is a database: any failure must not kill the thread
                    self._write_errors += 1
                    if not self._failing:
                        self._failing = True
                        logger.warning(
                            "writer %s: writing %d record(s) failed (%s: %s); retrying",
                            self.name,
                            len(batch),
                            type(exc).__name__,
                            exc,
                        )
                    if attempt == self.max_attempts:
                        self._dropped_failed += len(batch)
                        logger.warning(
                            "writer %s: dropped %d record(s) after %d attempts",
                            self.name,
                            len(batch),
                            attempt,
                        )
                        return
                    # Wait before retrying, but not past a shutdown request.
                    self._stop.wait(self.retry_delay_s * attempt)
                else:
                    self._written += len(batch)
                    self._batches += 1
                    if self._failing:
                        self._failing = False
                        logger.warning("writer %s: writing works again", self.name)
                    if self._full_logged and self._queue.qsize() < self._queue.maxsize // 2:
                        self._full_logged = False
                    return
        finally:
            for _ in batch:
                self._queue.task_done()
