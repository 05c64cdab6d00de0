"""Ship step records to the sidecar from a background thread: never block, never raise, count drops.

The engine's output loop calls :meth:`Shipper.submit` (an append to a bounded deque: O(1), no lock
held across I/O). A daemon thread wakes every ``flush_interval_s``, takes up to ``batch_max``
records and POSTs them as JSON over one keep-alive connection. When the sidecar is down or slow,
a batch that fails is dropped and counted, the thread backs off (up to ``max_backoff_s``), and new
records beyond ``queue_max`` are dropped and counted: the engine never waits for the sidecar. A batch
whose request went out whole but whose answer never came (timeout, reset) is counted as *unconfirmed*,
not dropped: a slow sidecar has usually stored it. The counters travel with every batch, so the
sidecar reports drops when it comes back.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import threading
import time
import urllib.parse
from collections import deque
from dataclasses import dataclass
from typing import Any

from collectors.vllm_plugin.wire import TOKEN_HEADER, WIRE_VERSION

# Under "vllm." so that vLLM's own log handler and level apply inside its processes.
log = logging.getLogger("vllm.spectuner." + __name__.rsplit(".", 1)[-1])


@dataclass(frozen=True)
class ShipperStats:
    submitted: int
    sent: int
    dropped_queue_full: int
    dropped_send_failed: int
    unconfirmed: int  # sent whole, no answer: most likely stored by a slow sidecar
    batches: int
    send_errors: int
    queued: int


class Shipper:
    """Bounded, batched, non-blocking HTTP shipping of JSON-able step dicts."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        source: dict[str, Any] | None = None,
        queue_max: int = 20_000,
        batch_max: int = 512,
        flush_interval_s: float = 0.25,
        # Generous: the sidecar answers once the batch is queued, but on a starved host (2 cores under
        # load) even that can take seconds, and a batch without an answer is only "unconfirmed".
        timeout_s: float = 10.0,
        max_backoff_s: float = 5.0,
    ) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"ingest URL {url!r} must be http://HOST:PORT/PATH")
        if queue_max < 1 or batch_max < 1:
            raise ValueError(f"queue_max and batch_max must be at least 1 but got {queue_max}, {batch_max}")
        self.url = url
        self._host = parsed.hostname
        self._port = parsed.port or 80
        self._path = parsed.path or "/"
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers[TOKEN_HEADER] = token
        self.source = dict(source or {})
        self.queue_max = queue_max
        self.batch_max = batch_max
        self.flush_interval_s = flush_interval_s
        self.timeout_s = timeout_s
        self.max_backoff_s = max_backoff_s
        self._queue: deque[dict[str, Any]] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._conn: http.client.HTTPConnection | None = None
        self._submitted = 0
        self._sent = 0
        self._dropped_full = 0
        self._dropped_failed = 0
        self._unconfirmed = 0
        self._batches = 0
        self._send_errors = 0
        self._failing = False
        self._backoff_until = 0.0
        self._backoff_s = 0.0

    # -- the engine side -------------------------------------------------------------------------
    def submit(self, record: dict[str, Any]) -> bool:
        """Queue one record; False (counted) when the queue is full. Never blocks, never raises."""
        self._submitted += 1
        if len(self._queue) >= self.queue_max:
            self._dropped_full += 1
            return False
        self._queue.append(record)
        if self._thread is None:
            self._start()
        return True

    def _start(self) -> None:
        # Started lazily on the first record, so no thread exists before vLLM forks its workers.
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="spectuner-shipper", daemon=True)
                self._thread.start()

    @property
    def stats(self) -> ShipperStats:
        return ShipperStats(
            submitted=self._submitted,
            sent=self._sent,
            dropped_queue_full=self._dropped_full,
            dropped_send_failed=self._dropped_failed,
            unconfirmed=self._unconfirmed,
            batches=self._batches,
            send_errors=self._send_errors,
            queued=len(self._queue),
        )

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (best effort, up to ``timeout_s``) and stop the thread."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._close_conn()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every record submitted so far has an outcome — sent, dropped or unconfirmed —
        not merely left the queue (a batch in flight has neither); False on timeout."""
        deadline = time.monotonic() + timeout_s
        self._wake.set()
        while not self._settled() and time.monotonic() < deadline:
            time.sleep(0.01)
        return self._settled()

    def _settled(self) -> bool:
        done = self._sent + self._dropped_full + self._dropped_failed + self._unconfirmed
        return not self._queue and done >= self._submitted

    # -- the shipping thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            self._drain()
        self._drain(final=True)

    def _drain(self, final: bool = False) -> None:
        while self._queue:
            if not final and time.monotonic() < self._backoff_until:
                return  # the sidecar failed recently: let the queue absorb (and drop) for a while
            batch: list[dict[str, Any]] = []
            while self._queue and len(batch) < self.batch_max:
                batch.append(self._queue.popleft())
            if not self._send(batch) and final:
                return

    def _send(self, batch: list[dict[str, Any]]) -> bool:
        counters = {
            "sent": self._sent,
            "dropped_queue_full": self._dropped_full,
            "dropped_send_failed": self._dropped_failed,
            "unconfirmed": self._unconfirmed,
        }
        body = json.dumps(
            {"v": WIRE_VERSION, "source": self.source, "counters": counters, "steps": batch},
            separators=(",", ":"),
        ).encode()
        sent_whole = False
        try:
            self._send_request(body)
            sent_whole = True
            status = self._read_status()
        except Exception as exc:  # any failure to reach the sidecar: drop (or leave unconfirmed), count, back off
            self._close_conn()
            return self._failed(batch, f"{type(exc).__name__}: {exc}", unconfirmed=sent_whole)
        if status >= 300:
            return self._failed(batch, f"HTTP {status}")
        self._sent += len(batch)
        self._batches += 1
        self._backoff_s = 0.0
        if self._failing:
            self._failing = False
            log.info("spectuner plugin: the sidecar at %s accepts steps again", self.url)
        return True

    def _failed(self, batch: list[dict[str, Any]], why: str, unconfirmed: bool = False) -> bool:
        self._send_errors += 1
        if unconfirmed:
            self._unconfirmed += len(batch)
        else:
            self._dropped_failed += len(batch)
        self._backoff_s = min(self.max_backoff_s, max(0.1, self._backoff_s * 2))
        self._backoff_until = time.monotonic() + self._backoff_s
        if not self._failing:
            self._failing = True
            log.warning(
                "spectuner plugin: cannot ship steps to %s (%s); dropping and counting them until it is back",
                self.url,
                why,
            )
        return False

    def _send_request(self, body: bytes) -> None:
        if self._conn is None:
            self._conn = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout_s)
        self._conn.request("POST", self._path, body=body, headers=self._headers)

    def _read_status(self) -> int:
        assert self._conn is not None
        resp = self._conn.getresponse()
        resp.read()
        if resp.will_close:
            self._close_conn()
        return resp.status

    def _close_conn(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None
