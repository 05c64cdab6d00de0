"""Poll a vLLM ``/metrics`` URL and hand per-engine window deltas to a ``RecordSink``.

The first good scrape is the baseline; every later good scrape yields one ``WindowRecord`` per
engine (deltas since the previous good scrape). A bad scrape — HTTP error, timeout, cut or
malformed page — is counted by reason, produces no record and leaves the baseline where it was, so
the next good window covers the gap and nothing is lost. Failures are logged once when they start
(and when the reason changes) and once on recovery, not every tick.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import httpx

from collectors.errors import ScrapeError, ScrapeErrorReason
from collectors.exposition import parse_metrics_page
from collectors.records import EngineKey, EngineSample, EventRecord, RecordSink, WindowRecord
from collectors.redact import redact_url, scrub, url_secrets
from collectors.window import window_between

logger = logging.getLogger(__name__)

Clock = Callable[[], datetime]

# Ask for the classic text format (not OpenMetrics) and no compression: it is loopback traffic and
# an uncompressed body lets us compare it with Content-Length to catch a short read.
_REQUEST_HEADERS = {"Accept": "text/plain; version=0.0.4", "Accept-Encoding": "identity"}
SINK_ERROR = "sink_error"
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


def utc_now() -> datetime:
    return datetime.now(UTC)


def metrics_url(url: str) -> str:
    """``http://host:port`` → ``http://host:port/metrics``; a URL with a path is kept as given.

    Raises ``ValueError`` naming what is wrong with the URL.
    """
    try:
        parsed = httpx.URL(url.strip())
    except httpx.InvalidURL as exc:
        raise ValueError(
            f"cannot parse URL {url!r} ({exc}); write http://HOST:PORT or http://HOST:PORT/metrics"
        ) from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"{url!r} is not an http(s) URL; write http://HOST:PORT or http://HOST:PORT/metrics")
    if parsed.path in ("", "/"):
        parsed = parsed.copy_with(path="/metrics")
    return str(parsed)


@dataclass(frozen=True)
class CollectResult:
    """What one ``collect_once`` did."""

    ok: bool
    samples: tuple[EngineSample, ...] = ()
    windows: tuple[WindowRecord, ...] = ()
    events: tuple[EventRecord, ...] = ()
    error: ScrapeError | None = None
    sink_error: str | None = None


class Collector:
    """Scrapes one vLLM metrics URL every ``interval_s`` seconds into ``sink``.

    ``clock`` stamps samples (UTC); tests pass a fake one. ``stale_after_s`` (default three
    intervals) is how long without a good scrape before a ``scrape_stale`` event is raised.
    """

    def __init__(
        self,
        url: str,
        sink: RecordSink,
        interval_s: float = 10.0,
        timeout_s: float = 5.0,
        clock: Clock = utc_now,
        *,
        stale_after_s: float | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        client: httpx.Client | None = None,
        resume_max_age_s: float = 900.0,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive but got {interval_s}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive but got {timeout_s}")
        if max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be positive but got {max_body_bytes}")
        if resume_max_age_s < 0:
            raise ValueError(f"resume_max_age_s cannot be negative but got {resume_max_age_s}")
        # ``url`` may carry credentials (http://user:pass@host/metrics): it is fetched as given, but
        # logs, errors and the database (the engine series' URL) only ever see it redacted.
        self._fetch_url = url
        self.url = redact_url(url)
        self._url_secrets = url_secrets(url)
        self.sink = sink
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.clock = clock
        self.stale_after_s = stale_after_s if stale_after_s is not None else 3 * interval_s
        self.max_body_bytes = max_body_bytes
        self._client = client or httpx.Client(timeout=httpx.Timeout(timeout_s), follow_redirects=True)
        self._owns_client = client is None
        self._baseline: dict[EngineKey, EngineSample] = {}
        # Stored baselines (from an earlier run of a collector on this URL) are read once, at the
        # first good scrape; older than this, they are not resumed from (one window spanning a long
        # outage would blur what happened in it, e.g. which config was running).
        self.resume_max_age_s = resume_max_age_s
        self._resume_pending = True
        self.errors: Counter[str] = Counter()  # failed scrapes by reason (ScrapeErrorReason or sink_error)
        self.scrapes_ok = 0
        self.last_success: datetime | None = None
        self._first_attempt: datetime | None = None
        self._failing_reason: str | None = None
        self._failures_in_row = 0
        self._stale_reported = False

    # -- one scrape ---------------------------------------------------------------------------
    def fetch(self) -> str:
        """GET the page; any way it can fail becomes a ``ScrapeError``."""
        started = time.monotonic()
        try:
            with self._client.stream("GET", self._fetch_url, headers=_REQUEST_HEADERS) as response:
                if response.status_code != 200:
                    response.read()
                    raise ScrapeError(
                        ScrapeErrorReason.HTTP_STATUS,
                        scrub(
                            f"HTTP {response.status_code} (expected 200): {response.text[:200]!r}", self._url_secrets
                        ),
                        source=self.url,
                    )
                chunks: list[bytes] = []
                size = 0
                for chunk in response.iter_bytes():
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        raise ScrapeError(
                            ScrapeErrorReason.TOO_LARGE,
                            f"body over {self.max_body_bytes} bytes; raise max_body_bytes "
                            "(collect --max-body-bytes) if this is real",
                            source=self.url,
                        )
                    # httpx times each read, not the whole body: a trickling server must still stop.
                    if time.monotonic() - started > self.timeout_s:
                        raise ScrapeError(
                            ScrapeErrorReason.TIMEOUT,
                            f"body not complete after {self.timeout_s:g} s",
                            source=self.url,
                        )
                    chunks.append(chunk)
                body = b"".join(chunks)
                declared = response.headers.get("content-length")
                encoded = response.headers.get("content-encoding", "identity") != "identity"
                if declared is not None and not encoded and declared.isdigit() and int(declared) != len(body):
                    raise ScrapeError(
                        ScrapeErrorReason.TRUNCATED,
                        f"got {len(body)} bytes of the {declared} announced",
                        source=self.url,
                    )
        except httpx.TimeoutException as exc:
            raise ScrapeError(
                ScrapeErrorReason.TIMEOUT,
                f"no answer within {self.timeout_s:g} s ({type(exc).__name__})",
                source=self.url,
            ) from exc
        except httpx.RemoteProtocolError as exc:
            raise ScrapeError(
                ScrapeErrorReason.TRUNCATED,
                scrub(f"connection closed mid-response ({exc})", self._url_secrets),
                source=self.url,
            ) from exc
        except httpx.HTTPError as exc:
            raise ScrapeError(
                ScrapeErrorReason.CONNECTION,
                scrub(
                    f"cannot reach the engine ({type(exc).__name__}: {exc}); is vLLM running at this URL?",
                    self._url_secrets,
                ),
                source=self.url,
            ) from exc
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ScrapeError(ScrapeErrorReason.MALFORMED, f"body is not UTF-8 ({exc})", source=self.url) from exc

    def scrape(self) -> list[EngineSample]:
        """Fetch and parse one page; raises ``ScrapeError``. Does not touch the baseline."""
        text = self.fetch()
        return parse_metrics_page(text, url=self.url, ts=self.clock())

    def collect_once(self) -> CollectResult:
        """Scrape once; on success write this window's records to the sink and move the baseline."""
        if self._first_attempt is None:
            self._first_attempt = self.clock()
        try:
            samples = self.scrape()
        except ScrapeError as err:
            self._on_failure(err.reason.value, str(err))
            return CollectResult(ok=False, error=err)

        if self._resume_pending and samples:
            self._resume(samples[0].ts)
        windows: list[WindowRecord] = []
        events: list[EventRecord] = []
        for sample in samples:
            prev = self._baseline.get(sample.key)
            if prev is None:
                logger.info(
                    "collector %s: baseline for engine %s (%s), speculation %s",
                    self.url,
                    sample.key.engine,
                    sample.key.model_name,
                    "on" if sample.spec is not None else "off",
                )
                continue
            window, new_events = window_between(prev, sample)
            windows.append(window)
            events.extend(new_events)
        for event in events:
            logger.warning("collector %s: %s", self.url, event.message)
        try:
            if samples:
                # One transaction: the windows, their reset events and the new baselines.
                self.sink.write_scrape(windows, events, samples)
        except Exception as exc:  # the sink is the store; any failure there must not kill the loop
            message = f"could not store {len(windows)} window(s): {type(exc).__name__}: {exc}"
            self._on_failure(SINK_ERROR, f"{self.url}: {message}")
            return CollectResult(ok=False, samples=tuple(samples), sink_error=message)
        for sample in samples:
            self._baseline[sample.key] = sample
        self._on_success(samples[0].ts if samples else self.clock(), [])
        return CollectResult(ok=True, samples=tuple(samples), windows=tuple(windows), events=tuple(events))

    def _resume(self, now: datetime) -> None:
        """Take up the baselines an earlier collector stored for this URL, for engines this one has
        no baseline of yet: the first scrape after a restart is then a window, not a gap. An
        engine that restarted meanwhile is still seen as a reset (counters down, new ``_created``)."""
        try:
            stored = self.sink.baselines(self.url)
        except Exception as exc:  # no stored baselines is the old behaviour: a fresh baseline
            logger.warning(
                "collector %s: could not read stored baselines (%s: %s); will try again next scrape",
                self.url,
                type(exc).__name__,
                exc,
            )
            return
        self._resume_pending = False
        for sample in stored:
            if sample.key in self._baseline or sample.ts >= now:
                continue
            age_s = (now - sample.ts).total_seconds()
            if age_s > self.resume_max_age_s:
                logger.info(
                    "collector %s: stored baseline of engine %s (%s) is %.0f s old (over %.0f s): starting afresh",
                    self.url,
                    sample.key.engine,
                    sample.key.model_name,
                    age_s,
                    self.resume_max_age_s,
                )
                continue
            logger.info(
                "collector %s: resuming engine %s (%s) from its stored baseline of %s",
                self.url,
                sample.key.engine,
                sample.key.model_name,
                sample.ts.isoformat(),
            )
            self._baseline[sample.key] = sample

    # -- the loop -----------------------------------------------------------------------------
    def run(self, stop: threading.Event | None = None, max_scrapes: int | None = None) -> None:
        """Scrape every ``interval_s`` until ``stop`` is set (or ``max_scrapes`` scrapes were made)."""
        stop = stop or threading.Event()
        done = 0
        while not stop.is_set():
            started = time.monotonic()
            self.collect_once()
            done += 1
            if max_scrapes is not None and done >= max_scrapes:
                break
            stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def staleness_s(self, now: datetime | None = None) -> float | None:
        """Seconds since the last good scrape, or since the first attempt if none succeeded yet
        (None before any attempt)."""
        since = self.last_success or self._first_attempt
        if since is None:
            return None
        return ((now or self.clock()) - since).total_seconds()

    def close(self) -> None:
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> Collector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- bookkeeping --------------------------------------------------------------------------
    def _on_failure(self, reason: str, message: str) -> None:
        self.errors[reason] += 1
        self._failures_in_row += 1
        events: list[EventRecord] = []
        if reason != self._failing_reason:
            logger.warning("collector %s: scrape failed: %s", self.url, message)
            self._failing_reason = reason
            if reason != SINK_ERROR:
                events.append(
                    EventRecord(
                        ts=self.clock(),
                        kind="collector_error",
                        message=f"scraping {self.url} failed: {message}",
                        severity="warning",
                        data={"url": self.url, "reason": reason},
                    )
                )
        else:
            logger.debug("collector %s: scrape failed again: %s", self.url, message)
        staleness = self.staleness_s()
        if staleness is not None and staleness > self.stale_after_s and not self._stale_reported:
            self._stale_reported = True
            text = f"no good scrape of {self.url} for {staleness:.0f} s (last error: {message})"
            logger.warning("collector %s: %s", self.url, text)
            events.append(
                EventRecord(
                    ts=self.clock(),
                    kind="scrape_stale",
                    message=text,
                    severity="warning",
                    data={"url": self.url, "staleness_s": staleness, "reason": reason},
                )
            )
        self._write_events(events)

    def _on_success(self, ts: datetime, events: list[EventRecord]) -> None:
        self.scrapes_ok += 1
        if self._failing_reason is not None:
            text = f"scraping {self.url} recovered after {self._failures_in_row} failed attempt(s)"
            logger.warning("collector %s: %s", self.url, text)
            events = [
                *events,
                EventRecord(
                    ts=ts,
                    kind="collector_recovered",
                    message=text,
                    data={"url": self.url, "failed_attempts": self._failures_in_row},
                ),
            ]
        self._failing_reason = None
        self._failures_in_row = 0
        self._stale_reported = False
        self.last_success = ts
        self._write_events(events)

    def _write_events(self, events: list[EventRecord]) -> None:
        if not events:
            return
        try:
            self.sink.write_events(events)
        except Exception as exc:  # an event lost is logged; it must not stop the collector
            self.errors[SINK_ERROR] += 1
            logger.warning(
                "collector %s: could not store %d event(s): %s: %s",
                self.url,
                len(events),
                type(exc).__name__,
                exc,
            )
