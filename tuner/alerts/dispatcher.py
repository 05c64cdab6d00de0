"""The alert dispatcher: new events from the store → each sink, with retries, dedup and a rate limit.

Each sink keeps its own persisted cursor (the last event id it dealt with) and catches up on its own
thread, so a slow or broken sink never delays the others. For every event after its cursor a sink:

1. skips it when its filters (kinds, severity) do not select it;
2. drops it as ``deduplicated`` when an event with the same key was delivered within ``dedup_window_s``;
3. drops it as ``rate_limited`` when ``rate_limit_per_minute`` attempts were made in the last minute;
4. otherwise attempts delivery, retrying a retryable failure after ``backoff_s · 2^i`` (capped at
   ``backoff_max_s``, ± ``jitter``) up to ``retries`` times; the outcome is ``delivered`` or ``failed``.

Each outcome is logged in ``alert_deliveries`` in the same transaction that moves the cursor, so a
daemon restart neither loses nor re-sends an event (an event whose delivery was cut short by the stop
itself is sent again: at-least-once, with a stable ``X-Spectuner-Delivery`` id). Dedup and rate limits
are read from the delivery log, so they also hold across restarts. Time comes from ``clock``.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from tuner.alerts.events import Category, categories, dedup_key, selects
from tuner.alerts.settings import AlertsSection
from tuner.alerts.sinks import Attempt, Sink, build_sink
from tuner.store import Store
from tuner.store import deliveries as D
from tuner.store.deliveries import DeliveryRecord, StoredEvent

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]

DELIVERED = "delivered"
FAILED = "failed"
DEDUPLICATED = "deduplicated"
RATE_LIMITED = "rate_limited"
OUTCOMES = (DELIVERED, FAILED, DEDUPLICATED, RATE_LIMITED)


def backoff_delay_s(settings_backoff_s: float, cap_s: float, retry: int, jitter: float, unit: float) -> float:
    """Delay before retry number ``retry`` (0-based): ``backoff·2^retry`` capped, scaled by
    ``1 + jitter·(2·unit − 1)`` for ``unit`` in [0, 1), and never above the cap."""
    base = min(cap_s, settings_backoff_s * (2**retry))
    return max(0.0, min(cap_s, base * (1.0 + jitter * (2.0 * unit - 1.0))))


@dataclass
class PollResult:
    """What one poll did, per sink and outcome (skipped: not selected by the sink's filters)."""

    outcomes: dict[str, dict[str, int]] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)

    def count(self, outcome: str) -> int:
        return sum(o.get(outcome, 0) for o in self.outcomes.values())


class AlertDispatcher:
    def __init__(
        self,
        store: Store,
        sinks: Sequence[Sink],
        *,
        mapping: Mapping[str, Category] | None = None,
        clock: Clock,
        max_events_per_poll: int = 200,
        new_sink_start: str = "latest",
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.store = store
        self.sinks = list(sinks)
        self.mapping = dict(mapping) if mapping is not None else categories()
        self.clock = clock
        self.max_events_per_poll = max_events_per_poll
        self.new_sink_start = new_sink_start
        self.rng = rng
        self.stop_event = threading.Event()
        self._limited: set[str] = set()  # sinks currently rate limited (log once per episode)
        self._failing: set[str] = set()  # sinks whose last attempt failed (log once per episode)
        self._poll_failing: set[str] = set()  # sinks whose poll itself failed (store down...)
        self._lock = threading.Lock()  # one poll at a time

    # -- the job ---------------------------------------------------------------------------------
    def poll_once(self) -> PollResult:
        """Let every sink catch up on new events (in parallel). Returns the outcomes."""
        result = PollResult()
        if not self.sinks:
            return result
        with self._lock, ThreadPoolExecutor(max_workers=len(self.sinks), thread_name_prefix="alerts") as pool:
            for sink, (outcomes, skipped) in zip(self.sinks, pool.map(self._catch_up, self.sinks), strict=True):
                result.outcomes[sink.name] = outcomes
                result.skipped[sink.name] = skipped
        return result

    def stop(self) -> None:
        """Cut retry waits short (the event being retried is sent again after a restart)."""
        self.stop_event.set()

    def close(self) -> None:
        self.stop()
        for sink in self.sinks:
            sink.close()

    def init_cursors(self) -> None:
        """Give every sink seen for the first time its starting cursor now (at daemon start), so
        events written before the first poll are not mistaken for history."""
        for sink in self.sinks:
            self._start_cursor(sink)

    # -- one sink --------------------------------------------------------------------------------
    def _start_cursor(self, sink: Sink) -> int:
        cur = D.cursor(self.store, sink.name)
        if cur is not None:
            return cur
        cur = D.latest_event_id(self.store) if self.new_sink_start == "latest" else 0
        D.set_cursor(self.store, sink.name, cur, self.clock())
        log.info("alert sink %s: new; starting after event %d", sink.name, cur)
        return cur

    def _catch_up(self, sink: Sink) -> tuple[dict[str, int], int]:
        outcomes: dict[str, int] = {}
        skipped = 0
        try:
            cur = self._start_cursor(sink)
            events = D.events_after(self.store, cur, self.max_events_per_poll)
            passed = cur
            for event in events:
                if self.stop_event.is_set():
                    break
                s = sink.settings
                if not selects(event, self.mapping, s.kinds, s.min_severity):
                    skipped += 1
                    passed = event.id
                    continue
                outcome = self._handle(sink, event)
                if outcome is None:  # stopped mid-retry: leave the cursor before this event
                    break
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
                passed = event.id
            if passed > cur and (D.cursor(self.store, sink.name) or 0) < passed:
                D.set_cursor(self.store, sink.name, passed, self.clock())  # after skipped events
        except Exception:
            # The store is unreachable or a sink bug: the next poll retries from the cursor.
            if sink.name not in self._poll_failing:
                log.exception("alert sink %s: poll failed; retrying at every poll (logged once)", sink.name)
                self._poll_failing.add(sink.name)
            return outcomes, skipped
        if sink.name in self._poll_failing:
            log.warning("alert sink %s: polling works again", sink.name)
            self._poll_failing.discard(sink.name)
        return outcomes, skipped

    def _handle(self, sink: Sink, event: StoredEvent) -> str | None:
        s = sink.settings
        now = self.clock()
        key = dedup_key(event)
        base = DeliveryRecord(
            event_id=event.id,
            engine_id=event.engine_id,
            sink=sink.name,
            kind=event.kind,
            dedup_key=key,
            outcome=DEDUPLICATED,
            attempts=0,
            duration_s=0.0,
            created_at=now,
        )
        since = now - timedelta(seconds=s.dedup_window_s)
        if s.dedup_window_s > 0 and D.last_delivered_at(self.store, sink.name, key, since) is not None:
            log.debug("alert sink %s: event %d (%s) deduplicated", sink.name, event.id, event.kind)
            D.record_delivery(self.store, base)
            return DEDUPLICATED
        if D.attempts_since(self.store, sink.name, now - timedelta(seconds=60)) >= s.rate_limit_per_minute:
            if sink.name not in self._limited:
                log.warning(
                    "alert sink %s: over %d deliveries per minute; dropping events until the rate falls",
                    sink.name,
                    s.rate_limit_per_minute,
                )
                self._limited.add(sink.name)
            D.record_delivery(self.store, _with(base, outcome=RATE_LIMITED))
            return RATE_LIMITED
        if sink.name in self._limited:
            log.warning("alert sink %s: back under its rate limit", sink.name)
            self._limited.discard(sink.name)

        started = time.monotonic()
        attempt = Attempt(False)
        tries = 0
        for retry in range(s.retries + 1):
            if retry:
                delay = backoff_delay_s(s.backoff_s, s.backoff_max_s, retry - 1, s.jitter, self.rng())
                if self.stop_event.wait(delay):
                    return None
            tries += 1
            attempt = sink.send(event)
            if attempt.ok or not attempt.retryable:
                break
            log.debug("alert sink %s: event %d attempt %d failed: %s", sink.name, event.id, tries, attempt.error)
        outcome = DELIVERED if attempt.ok else FAILED
        D.record_delivery(
            self.store,
            _with(
                base,
                outcome=outcome,
                attempts=tries,
                status_code=attempt.status_code,
                error=attempt.error,
                duration_s=time.monotonic() - started,
                created_at=self.clock(),
            ),
        )
        if outcome == FAILED and sink.name not in self._failing:
            log.warning(
                "alert sink %s: event %d (%s) not delivered after %d attempt(s): %s",
                sink.name,
                event.id,
                event.kind,
                tries,
                attempt.error,
            )
            self._failing.add(sink.name)
        elif outcome == DELIVERED and sink.name in self._failing:
            log.warning("alert sink %s: delivering again", sink.name)
            self._failing.discard(sink.name)
        return outcome


def _with(record: DeliveryRecord, **changes: object) -> DeliveryRecord:
    return replace(record, **changes)  # type: ignore[arg-type]


def build_dispatcher(store: Store, settings: AlertsSection, clock: Clock) -> AlertDispatcher:
    """Raises :class:`tuner.alerts.sinks.SinkConfigError` when a sink's environment variable is missing."""
    mapping = categories(settings.categories)
    sinks = [build_sink(s, mapping) for s in settings.sinks]
    dispatcher = AlertDispatcher(
        store,
        sinks,
        mapping=mapping,
        clock=clock,
        max_events_per_poll=settings.max_events_per_poll,
        new_sink_start=settings.new_sink_start,
    )
    dispatcher.init_cursors()
    return dispatcher
