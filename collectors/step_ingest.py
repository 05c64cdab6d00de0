"""The sidecar's ingest endpoint for the in-engine plugin's per-step records.

A small threaded HTTP server on 127.0.0.1 (stdlib ``http.server``: a few POSTs a second, each a batch
of hundreds of steps). ``POST /v1/steps`` takes a batch in the wire format of
``collectors.vllm_plugin.wire``, validates each step, turns it into a :class:`StepRecord` keyed by the
engine series the scraper uses (the configured metrics URL, the plugin's model name, the engine
index), queues it to a :class:`BatchWriter` around ``sink.write_steps`` and publishes it to a
:class:`StepFeed` (in-process observers: the live actuator's verification). ``GET /v1/steps/stats``
shows the counters, the plugin's own drop counts included.

Answers: 200 with ``{"accepted": n, "rejected": m, "errors": [...]}`` (bad steps are named and
skipped, good ones kept); 400 for a body that is not a batch; 401 for a wrong token; 413 for a body
over ``max_body_bytes``. When the plugin reports more dropped steps than before, an
``EventRecord(kind="plugin_steps_dropped")`` is written (at most once per ``drop_event_interval_s``).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from collectors.batch_writer import BatchWriter
from collectors.records import EngineKey, EventRecord, RecordSink, StepRecord
from collectors.vllm_plugin.wire import STATS_PATH, STEPS_PATH, TOKEN_HEADER, WIRE_VERSION
from policies.counters import SpecCounters

log = logging.getLogger(__name__)

_MAX_ERRORS_REPORTED = 5


class StepError(ValueError):
    """One wire step that cannot be stored: the message names the field."""


def _count(step: dict[str, Any], name: str) -> int:
    value = step.get(name)
    if type(value) is not int or value < 0:
        raise StepError(f"field {name!r} must be a non-negative integer, got {value!r}")
    return value


def _counts(step: dict[str, Any], name: str) -> tuple[int, ...]:
    value = step.get(name)
    if not isinstance(value, list) or not all(type(x) is int and x >= 0 for x in value):
        raise StepError(f"field {name!r} must be a list of non-negative integers, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class StepBounds:
    """What a real step can look like; anything outside is rejected (and counted), never stored.

    ``now_s``: the sidecar's clock (Unix seconds); a step is stamped within ``max_age_s`` before it
    (the plugin's queue may hold steps while the sidecar is down) and ``max_future_s`` after it
    (clock skew between processes). ``max_batch_size``: the engine's --max-num-seqs.
    """

    now_s: float
    max_age_s: float = 3600.0
    max_future_s: float = 60.0
    max_batch_size: int = 4096
    max_step_time_s: float = 300.0
    max_k: int = 64


def step_from_wire(step: Any, url: str, model: str, bounds: StepBounds | None = None) -> StepRecord:
    """One wire step → :class:`StepRecord`; :class:`StepError` names what is wrong. ``bounds``
    (the ingest endpoint always gives them) also rejects times, batch sizes and step times no engine
    produces, and counts that contradict each other."""
    if not isinstance(step, dict):
        raise StepError(f"a step must be a JSON object, got {type(step).__name__}")
    b = bounds or StepBounds(now_s=time.time(), max_age_s=float("inf"), max_future_s=float("inf"))
    t = step.get("t")
    if not isinstance(t, int | float) or isinstance(t, bool) or not 0 < t < 1e11:
        raise StepError(f"field 't' must be a Unix time in seconds, got {t!r}")
    if not b.now_s - b.max_age_s <= t <= b.now_s + b.max_future_s:
        raise StepError(
            f"field 't' ({t:.0f}) is {t - b.now_s:+.0f} s from the sidecar's clock: steps must be stamped "
            f"within {b.max_age_s:g} s before and {b.max_future_s:g} s after now"
        )
    dt = step.get("dt")
    if dt is not None and (not isinstance(dt, int | float) or isinstance(dt, bool) or not 0 <= dt <= b.max_step_time_s):
        raise StepError(f"field 'dt' must be null or seconds in [0, {b.max_step_time_s:g}], got {dt!r}")
    k = _count(step, "k")
    if k > b.max_k:
        raise StepError(f"field 'k' ({k}) is above {b.max_k}")
    batch = _count(step, "b")
    if batch > b.max_batch_size:
        raise StepError(f"field 'b' (batch size {batch}) is above the engine's {b.max_batch_size} sequences")
    accepted_per_pos = _counts(step, "ap")
    draft_per_pos = _counts(step, "dp")
    if len(accepted_per_pos) != k or len(draft_per_pos) != k:
        raise StepError(
            f"fields 'ap' and 'dp' must have k={k} entries, got {len(accepted_per_pos)} and {len(draft_per_pos)}"
        )
    drafts, draft_tokens, accepted = _count(step, "d"), _count(step, "dn"), _count(step, "a")
    if accepted > draft_tokens:
        raise StepError(f"accepted tokens ({accepted}) exceed draft tokens ({draft_tokens})")
    if drafts > batch or draft_tokens > drafts * k:
        raise StepError(f"{drafts} drafts of {draft_tokens} tokens cannot come from a batch of {batch} at K={k}")
    if sum(accepted_per_pos) != accepted or any(a > d for a, d in zip(accepted_per_pos, draft_per_pos, strict=True)):
        raise StepError(f"per-position counts 'ap' {list(accepted_per_pos)} and 'dp' disagree with 'a' = {accepted}")
    scheduled = step.get("s")
    if scheduled is not None:
        scheduled = _count(step, "s")
    return StepRecord(
        ts=datetime.fromtimestamp(float(t), UTC),
        key=EngineKey(url=url, model_name=model, engine=str(_count(step, "e"))),
        batch_size=batch,
        step_time_s=None if dt is None else float(dt),
        spec=SpecCounters(
            drafts=drafts,
            draft_tokens=draft_tokens,
            accepted_tokens=accepted,
            accepted_per_pos=accepted_per_pos,
            num_spec_tokens=k,
            draft_tokens_per_pos=draft_per_pos,
            generated_tokens=_count(step, "g"),
        ),
        num_scheduled_tokens=scheduled,
    )


def drafted_k(record: StepRecord) -> int:
    """K a stored step's drafts were made with (0: none): the last position any draft reached."""
    per_pos = record.spec.draft_tokens_per_pos or ()
    k = 0
    for i, n in enumerate(per_pos):
        if n:
            k = i + 1
    return k


class StepSubscription:
    """Steps published after :meth:`StepFeed.subscribe`; bounded (old ones fall off when nobody reads)."""

    def __init__(self, feed: StepFeed, maxlen: int) -> None:
        self._feed = feed
        self._items: deque[StepRecord] = deque(maxlen=maxlen)
        self._cond = threading.Condition()

    def _push(self, records: Sequence[StepRecord]) -> None:
        with self._cond:
            self._items.extend(records)
            self._cond.notify_all()

    def get(self, timeout_s: float) -> list[StepRecord]:
        """Everything queued, waiting up to ``timeout_s`` for at least one step."""
        with self._cond:
            if not self._items:
                self._cond.wait(timeout_s)
            items = list(self._items)
            self._items.clear()
        return items

    def close(self) -> None:
        self._feed._unsubscribe(self)

    def __enter__(self) -> StepSubscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StepFeed:
    """In-process fan-out of freshly ingested steps (the live actuator watches it to verify a change)."""

    def __init__(self) -> None:
        self._subs: list[StepSubscription] = []
        self._lock = threading.Lock()
        self.last_step_at: datetime | None = None

    def subscribe(self, maxlen: int = 100_000) -> StepSubscription:
        sub = StepSubscription(self, maxlen)
        with self._lock:
            self._subs.append(sub)
        return sub

    def _unsubscribe(self, sub: StepSubscription) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._subs.remove(sub)

    def publish(self, records: Sequence[StepRecord]) -> None:
        if not records:
            return
        self.last_step_at = records[-1].ts
        with self._lock:
            subs = list(self._subs)
        for sub in subs:
            sub._push(records)


@dataclass
class IngestStats:
    batches: int = 0
    accepted: int = 0
    rejected: int = 0
    bad_requests: int = 0
    unauthorized: int = 0
    # Per plugin process (pid): its latest cumulative counters.
    plugins: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def plugin_dropped(self) -> int:
        return sum(
            int(c.get("dropped_queue_full", 0)) + int(c.get("dropped_send_failed", 0)) for c in self.plugins.values()
        )

    @property
    def plugin_unconfirmed(self) -> int:
        """Steps the plugins sent whole but got no answer for (a slow sidecar has usually stored them)."""
        return sum(int(c.get("unconfirmed", 0)) for c in self.plugins.values())


class StepIngestServer:
    """HTTP ingest of per-step records on 127.0.0.1. ``start()`` / ``stop()``, or a context manager."""

    def __init__(
        self,
        sink: RecordSink,
        engine_url: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str,
        feed: StepFeed | None = None,
        max_batch_size: int = 4096,
        max_body_bytes: int = 16 * 1024 * 1024,
        drop_event_interval_s: float = 60.0,
        writer: BatchWriter[StepRecord] | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        if host not in ("127.0.0.1", "::1", "localhost"):
            raise ValueError(f"the ingest endpoint binds loopback only (127.0.0.1 or ::1), not {host!r}")
        self.sink = sink
        self.engine_url = engine_url
        self.host = host
        self.port = port
        if not token or not token.strip():
            # Any local process could otherwise write steps (fake engines, dates in 1970, drop alerts).
            raise ValueError("the ingest endpoint needs a non-empty token ([plugin] token_file)")
        self._token = token.strip().encode()
        self.max_batch_size = max_batch_size
        self.feed = feed or StepFeed()
        self.max_body_bytes = max_body_bytes
        self.drop_event_interval_s = drop_event_interval_s
        self.writer = writer or BatchWriter(sink.write_steps, name="steps", max_queue=100_000, batch_size=2000)
        self.clock = clock
        self.stats = IngestStats()
        self._stats_lock = threading.Lock()
        self._last_drop_event = 0.0
        self._reported_dropped = 0
        # The plugin_steps_dropped event is written here, off the request path: an answer waits for no
        # database (the batch is acknowledged once queued).
        self._events = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spectuner-ingest-events")
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        # Open keep-alive connections: stop() must close them too, or a plugin would go on posting
        # into a stopped server's handler threads.
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._stopped = False

    @property
    def url(self) -> str:
        """The URL the plugin posts to: give it to the engine as SPECTUNER_INGEST_URL."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{STEPS_PATH}"

    # -- handling --------------------------------------------------------------------------------
    def authorized(self, header: str | None) -> bool:
        return header is not None and hmac.compare_digest(header.strip().encode(), self._token)

    def ingest(self, body: bytes) -> tuple[int, dict[str, Any]]:
        """Handle one POST body; returns (HTTP status, JSON answer). Public for tests and benchmarks."""
        try:
            batch = json.loads(body)
        except ValueError:
            return self._bad("body is not JSON; expected a step batch (see collectors/vllm_plugin/wire.py)")
        if not isinstance(batch, dict) or not isinstance(batch.get("steps"), list):
            return self._bad('body must be a JSON object with a "steps" list')
        if batch.get("v") != WIRE_VERSION:
            return self._bad(f"wire version {batch.get('v')!r} is not {WIRE_VERSION}; upgrade spectuner on both sides")
        raw_source = batch.get("source")
        source: dict[str, Any] = raw_source if isinstance(raw_source, dict) else {}
        model = str(source.get("model") or "")
        if not model:
            return self._bad('"source.model" (the served model name) is missing')
        records: list[StepRecord] = []
        errors: list[str] = []
        bounds = StepBounds(now_s=self.clock().timestamp(), max_batch_size=self.max_batch_size)
        for i, raw in enumerate(batch["steps"]):
            try:
                records.append(step_from_wire(raw, self.engine_url, model, bounds))
            except StepError as exc:
                if len(errors) < _MAX_ERRORS_REPORTED:
                    errors.append(f"steps[{i}]: {exc}")
        rejected = len(batch["steps"]) - len(records)
        for rec in records:
            self.writer.submit(rec)
        self.feed.publish(records)
        counters = batch.get("counters")
        with self._stats_lock:
            self.stats.batches += 1
            self.stats.accepted += len(records)
            self.stats.rejected += rejected
            if isinstance(counters, dict):
                self.stats.plugins[str(source.get("pid", "?"))] = {
                    k: v for k, v in counters.items() if isinstance(v, int)
                } | {"model": model, "vllm": str(source.get("vllm", ""))}
        if rejected and errors:
            log.warning(
                "step ingest: rejected %d of %d step(s) from %s: %s", rejected, len(batch["steps"]), model, errors[0]
            )
        self._maybe_report_drops(model)
        return 200, {"accepted": len(records), "rejected": rejected, "errors": errors}

    def _bad(self, message: str) -> tuple[int, dict[str, Any]]:
        with self._stats_lock:
            self.stats.bad_requests += 1
        return 400, {"error": message}

    def _maybe_report_drops(self, model: str) -> None:
        dropped = self.stats.plugin_dropped
        now = time.monotonic()
        if dropped <= self._reported_dropped or now - self._last_drop_event < self.drop_event_interval_s:
            return
        new = dropped - self._reported_dropped
        self._reported_dropped, self._last_drop_event = dropped, now
        event = EventRecord(
            ts=self.clock(),
            kind="plugin_steps_dropped",
            message=f"the in-engine plugin dropped {new} step record(s) ({dropped} in all): the sidecar was "
            "unreachable or slow; per-step statistics have a gap",
            severity="warning",
            data={"dropped_total": dropped, "model": model},
        )
        with contextlib.suppress(RuntimeError):  # stopped meanwhile: the counters stay on /v1/steps/stats
            self._events.submit(self._write_event, event)

    def _write_event(self, event: EventRecord) -> None:
        try:
            self.sink.write_events([event])
        except Exception as exc:  # the store may be down too; the counters stay visible on /v1/steps/stats
            log.warning("step ingest: could not record dropped steps (%s)", exc)

    def stats_json(self) -> dict[str, Any]:
        w = self.writer.stats
        with self._stats_lock:
            s = self.stats
            return {
                "batches": s.batches,
                "accepted": s.accepted,
                "rejected": s.rejected,
                "bad_requests": s.bad_requests,
                "unauthorized": s.unauthorized,
                "plugin_dropped": s.plugin_dropped,
                "plugin_unconfirmed": s.plugin_unconfirmed,
                "plugins": dict(s.plugins),
                "writer": {
                    "written": w.written,
                    "queued": w.queued,
                    "dropped_queue_full": w.dropped_queue_full,
                    "dropped_write_failed": w.dropped_write_failed,
                },
            }

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> StepIngestServer:
        ingest = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: the plugin reuses one connection

            def setup(self) -> None:
                super().setup()
                with ingest._conns_lock:
                    ingest._conns.add(self.connection)

            def handle(self) -> None:
                try:
                    super().handle()
                except (BrokenPipeError, ConnectionResetError):
                    # the plugin hung up (its 2 s timeout on a starved host, or its engine exiting) while we
                    # answered or waited for its next request: a batch already read is stored all the same
                    # (the plugin, which never resends, counts it as dropped); nothing for socketserver to print
                    self.close_connection = True
                    log.info("step ingest: the plugin reset its connection")

            def finish(self) -> None:
                with ingest._conns_lock:
                    ingest._conns.discard(self.connection)
                with contextlib.suppress(OSError):
                    super().finish()

            def _answer(self, status: int, payload: dict[str, Any]) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)  # a plugin that hung up meanwhile: handle() absorbs the reset

            def do_POST(self) -> None:
                if ingest._stopped:
                    self.close_connection = True
                    self._answer(503, {"error": "the ingest endpoint is shutting down"})
                    return
                if self.path != STEPS_PATH:
                    self._answer(404, {"error": f"unknown path {self.path!r}; POST step batches to {STEPS_PATH}"})
                    return
                if not self._authorized():
                    return
                length = int(self.headers.get("Content-Length") or 0)
                if length > ingest.max_body_bytes:
                    self.close_connection = True
                    self._answer(413, {"error": f"body of {length} bytes is over {ingest.max_body_bytes}"})
                    return
                body = self.rfile.read(length)
                status, payload = ingest.ingest(body)
                self._answer(status, payload)

            def _authorized(self) -> bool:
                """Every path needs the token; a refused request's body is never read (the
                connection is closed instead)."""
                if ingest.authorized(self.headers.get(TOKEN_HEADER)):
                    return True
                with ingest._stats_lock:
                    ingest.stats.unauthorized += 1
                self.close_connection = True
                self._answer(401, {"error": f"wrong or missing {TOKEN_HEADER} header"})
                return False

            def do_GET(self) -> None:
                if not self._authorized():
                    return
                if self.path != STATS_PATH:
                    self._answer(404, {"error": f"unknown path {self.path!r}; GET {STATS_PATH} for counters"})
                    return
                self._answer(200, ingest.stats_json())

            def log_message(self, format: str, *args: Any) -> None:
                return  # one line per POST would flood the sidecar's log

        self.writer.start()
        server = ThreadingHTTPServer((self.host, self.port), Handler)
        server.daemon_threads = True
        self.port = int(server.server_address[1])
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="spectuner-step-ingest", daemon=True)
        self._thread.start()
        log.info("step ingest: listening on %s", self.url)
        return self

    def stop(self) -> None:
        self._stopped = True
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._events.shutdown(wait=True)
        self.writer.close()

    def __enter__(self) -> StepIngestServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
