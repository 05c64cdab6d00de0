"""The scrape collector and `spectuner collect` against a real HTTP server on 127.0.0.1.

The server serves saved vLLM pages, and on cue the faults a real engine can show: a 500, a stall
past the timeout, a body cut short of its Content-Length, a connection dropped mid-chunked-body.
Records go to the real store (SQLite and PostgreSQL, via the ``store`` fixture).
"""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from sqlalchemy.exc import IntegrityError
from typer.testing import CliRunner

from collectors.errors import ScrapeErrorReason
from collectors.exposition import parse_metrics_page
from collectors.records import EngineKey, EngineSample, EventRecord, RequestRecord, StepRecord, WindowRecord
from collectors.scrape import Collector, metrics_url
from tests.fakes import FakeClock
from tuner.cli.main import app
from tuner.store import Store, upgrade
from tuner.store.url import sqlite_path

DATA = Path(__file__).parents[1] / "data"
PAGE_A = (DATA / "synthetic_dp2_k3_a.prom").read_text()
PAGE_B = (DATA / "synthetic_dp2_k3_b.prom").read_text()
PAGE_RESTARTED = (DATA / "synthetic_dp2_k3_restarted.prom").read_text()


@dataclass
class Reply:
    """One scripted answer: ``kind`` is ok | status | stall | short | chunked_cut | garbage."""

    kind: str = "ok"
    page: str = PAGE_A
    status: int = 200
    stall_s: float = 0.0


@dataclass
class PageServer:
    """A real HTTP server answering GET /metrics from a script (the last reply repeats)."""

    script: list[Reply] = field(default_factory=list)
    hits: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next_reply(self) -> Reply:
        with self.lock:
            self.hits += 1
            return self.script.pop(0) if len(self.script) > 1 else self.script[0]


def _handler(state: PageServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet
            return

        def do_GET(self) -> None:
            reply = state.next_reply()
            body = reply.page.encode()
            if reply.kind == "stall":
                time.sleep(reply.stall_s)
            if reply.kind == "status":
                body = b"Internal Server Error: engine core died"
                self.send_response(reply.status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            if reply.kind == "chunked_cut":
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                half = body[: len(body) // 2]
                self.wfile.write(f"{len(half):x}\r\n".encode() + half + b"\r\n")
                self.wfile.flush()
                self.close_connection = True
                return  # no terminating 0-chunk: the body is cut
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if reply.kind == "short":
                self.wfile.write(body[: len(body) // 3])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(body)

    return Handler


@pytest.fixture
def page_server() -> Iterator[tuple[PageServer, str]]:
    state = PageServer(script=[Reply()])
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


class ListSink:
    """A RecordSink at our own seam, for tests of the collector's own logic."""

    def __init__(self) -> None:
        self.windows: list[WindowRecord] = []
        self.events: list[EventRecord] = []
        self.stored_baselines: dict[EngineKey, EngineSample] = {}
        self.scrape_calls: list[tuple[int, list[str]]] = []  # (windows, event kinds) per transaction
        self.fail_windows = False

    def write_windows(self, records: Sequence[WindowRecord]) -> None:
        raise AssertionError("the collector writes windows through write_scrape")

    def write_scrape(
        self,
        windows: Sequence[WindowRecord],
        events: Sequence[EventRecord] = (),
        baselines: Sequence[EngineSample] = (),
    ) -> None:
        if self.fail_windows:
            raise RuntimeError("database is locked")
        self.scrape_calls.append((len(windows), [e.kind for e in events]))
        self.windows.extend(windows)
        self.events.extend(events)
        self.stored_baselines.update({b.key: b for b in baselines})

    def baselines(self, url: str) -> list[EngineSample]:
        return [b for b in self.stored_baselines.values() if b.key.url == url]

    def write_requests(self, records: Sequence[RequestRecord]) -> None:
        raise AssertionError("the scrape collector writes no requests")

    def write_steps(self, records: Sequence[StepRecord]) -> None:
        raise AssertionError("the scrape collector writes no steps")

    def write_events(self, records: Sequence[EventRecord]) -> None:
        self.events.extend(records)


def test_good_scrapes_become_windows_in_the_store(page_server: tuple[PageServer, str], store: Store) -> None:
    state, url = page_server
    state.script = [Reply(page=PAGE_A), Reply(page=PAGE_B)]
    clock = FakeClock()
    with Collector(url, store, interval_s=10, timeout_s=2, clock=clock) as collector:
        first = collector.collect_once()
        assert first.ok and first.windows == ()  # the baseline
        clock.advance(10)
        second = collector.collect_once()
    assert second.ok and len(second.windows) == 2
    expected_a = parse_metrics_page(PAGE_A, url=url, ts=clock.now)
    expected_b = parse_metrics_page(PAGE_B, url=url, ts=clock.now)
    for a, b in zip(expected_a, expected_b, strict=True):
        (stored,) = store.windows(b.key)
        assert stored.spec is not None and a.spec is not None and b.spec is not None
        assert stored.spec.drafts == b.spec.drafts - a.spec.drafts
        assert stored.spec.accepted_tokens == b.spec.accepted_tokens - a.spec.accepted_tokens
        assert stored.spec.accepted_per_pos == tuple(
            y - x for x, y in zip(a.spec.accepted_per_pos, b.spec.accepted_per_pos, strict=True)
        )
        assert stored.generation_tokens == b.generation_tokens - a.generation_tokens
        assert stored.end - stored.start == timedelta(seconds=10)
        assert not stored.reset
    assert collector.errors == {}


# A good scrape must fit the timeout on a loaded 2-core machine (0.5 s did not); a stall far exceeds it.
SCRAPE_TIMEOUT_S = 3.0
STALL_S = 5.0


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        (Reply(kind="status", status=500), ScrapeErrorReason.HTTP_STATUS),
        (Reply(kind="stall", stall_s=STALL_S), ScrapeErrorReason.TIMEOUT),
        (Reply(kind="short"), ScrapeErrorReason.TRUNCATED),
        (Reply(kind="chunked_cut"), ScrapeErrorReason.TRUNCATED),
        (
            Reply(page=PAGE_B.replace("vllm:num_requests_running{", "vllm:num_requests_running{{", 1)),
            ScrapeErrorReason.MALFORMED,
        ),
        (Reply(page=PAGE_B.replace(" 1440.0\n", " NaN\n", 1)), ScrapeErrorReason.INVALID_VALUE),
        (Reply(page=PAGE_B + PAGE_B.splitlines()[2] + "\n"), ScrapeErrorReason.DUPLICATE_SERIES),
    ],
    ids=["500", "timeout", "short-body", "chunked-cut", "malformed", "nan", "duplicate"],
)
def test_a_bad_scrape_writes_nothing_is_counted_and_loses_nothing(
    page_server: tuple[PageServer, str], fault: Reply, reason: ScrapeErrorReason
) -> None:
    state, url = page_server
    state.script = [Reply(page=PAGE_A), fault, Reply(page=PAGE_B)]
    sink, clock = ListSink(), FakeClock()
    with Collector(url, sink, interval_s=10, timeout_s=SCRAPE_TIMEOUT_S, clock=clock) as collector:
        assert collector.collect_once().ok
        clock.advance(10)
        bad = collector.collect_once()
        assert not bad.ok and bad.error is not None and bad.error.reason is reason
        assert bad.windows == () and sink.windows == []
        assert collector.errors == {reason.value: 1}
        assert [e.kind for e in sink.events] == ["collector_error"]
        assert sink.events[0].data["reason"] == reason.value
        clock.advance(10)
        good = collector.collect_once()
    assert good.ok
    # The window after the fault spans both intervals: nothing between the good scrapes is lost.
    a = {s.key: s for s in parse_metrics_page(PAGE_A, url=url, ts=clock.now)}
    for w in sink.windows:
        b = next(s for s in parse_metrics_page(PAGE_B, url=url, ts=clock.now) if s.key == w.key)
        assert w.spec is not None and b.spec is not None and a[w.key].spec is not None
        assert w.spec.drafts == b.spec.drafts - a[w.key].spec.drafts  # type: ignore[union-attr]
        assert w.duration_s == 20.0
    assert [e.kind for e in sink.events] == ["collector_error", "collector_recovered"]


def test_failures_are_reported_once_and_staleness_once(
    page_server: tuple[PageServer, str], caplog: pytest.LogCaptureFixture
) -> None:
    state, url = page_server
    state.script = [Reply(page=PAGE_A), *[Reply(kind="status", status=500)] * 6, Reply(page=PAGE_B)]
    sink, clock = ListSink(), FakeClock()
    caplog.set_level("WARNING", logger="collectors.scrape")
    with Collector(url, sink, interval_s=10, timeout_s=1, clock=clock) as collector:
        collector.collect_once()
        for _ in range(6):
            clock.advance(10)
            collector.collect_once()
        assert collector.staleness_s() == 60.0
        clock.advance(10)
        collector.collect_once()
        assert collector.staleness_s() == 0.0
    kinds = [e.kind for e in sink.events]
    assert kinds == ["collector_error", "scrape_stale", "collector_recovered"]
    assert collector.errors == {"http_status": 6}
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("scrape failed" in m for m in warnings) == 1
    assert sum("recovered after 6 failed" in m for m in warnings) == 1


def test_an_engine_restart_is_stored_as_a_reset_with_an_event(
    page_server: tuple[PageServer, str], store: Store
) -> None:
    state, url = page_server
    state.script = [Reply(page=PAGE_B), Reply(page=PAGE_RESTARTED)]
    clock = FakeClock()
    with Collector(url, store, interval_s=10, timeout_s=2, clock=clock) as collector:
        collector.collect_once()
        clock.advance(10)
        result = collector.collect_once()
    assert result.ok
    restarted = {s.key: s for s in parse_metrics_page(PAGE_RESTARTED, url=url, ts=clock.now)}
    for key, sample in restarted.items():
        (w,) = store.windows(key)
        assert w.reset and w.spec == sample.spec
    assert sorted(e.kind for e in store.events()) == ["counter_reset", "counter_reset"]


def test_a_restart_window_and_its_reset_event_are_one_transaction(
    page_server: tuple[PageServer, str], store: Store
) -> None:
    """The window that counts from an engine restart and its counter_reset event land together or
    not at all: a window already stored for that time fails the transaction, and no event is left."""
    state, url = page_server
    state.script = [Reply(page=PAGE_B), Reply(page=PAGE_RESTARTED)]
    clock = FakeClock()
    sink = ListSink()
    with Collector(url, sink, interval_s=10, timeout_s=2, clock=clock) as collector:
        collector.collect_once()
        clock.advance(10)
        assert collector.collect_once().ok
    assert sink.scrape_calls == [(0, []), (2, ["counter_reset", "counter_reset"])]
    # The same transaction against the real store, once more over an existing window: all rolled back.
    (reset_window, *_) = sink.windows
    store.write_windows([reset_window])
    with pytest.raises(IntegrityError):
        store.write_scrape(sink.windows, sink.events, list(sink.stored_baselines.values()))
    assert store.events() == [] and len(store.windows(reset_window.key)) == 1
    assert store.baselines(url) == []
    store.write_scrape(sink.windows[1:], sink.events, list(sink.stored_baselines.values()))
    assert sorted(e.kind for e in store.events()) == ["counter_reset", "counter_reset"]


def test_a_restarted_collector_resumes_from_the_stored_baseline_without_a_gap(
    page_server: tuple[PageServer, str], store: Store
) -> None:
    state, url = page_server
    state.script = [Reply(page=PAGE_A), Reply(page=PAGE_B)]
    clock = FakeClock()
    with Collector(url, store, interval_s=10, timeout_s=2, clock=clock) as first:
        baseline = first.collect_once()
    assert baseline.ok and baseline.windows == ()  # the baseline, stored
    stored = {s.key: s for s in store.baselines(url)}
    assert stored == {s.key: s for s in parse_metrics_page(PAGE_A, url=url, ts=clock.now)}  # an exact round trip
    clock.advance(30)  # the collector is down for 30 s, the engine keeps counting
    with Collector(url, store, interval_s=10, timeout_s=2, clock=clock) as second:
        resumed = second.collect_once()
    assert resumed.ok and len(resumed.windows) == 2  # a window at once, not a new baseline
    a = {s.key: s for s in parse_metrics_page(PAGE_A, url=url, ts=clock.now)}
    for b in parse_metrics_page(PAGE_B, url=url, ts=clock.now):
        (w,) = store.windows(b.key)
        assert not w.reset and w.duration_s == 30.0
        assert w.spec is not None and b.spec is not None and a[b.key].spec is not None
        assert w.spec.drafts == b.spec.drafts - a[b.key].spec.drafts  # type: ignore[union-attr]
        assert w.generation_tokens == b.generation_tokens - a[b.key].generation_tokens
        e2e = "vllm:e2e_request_latency_seconds"
        assert w.e2e_latency is not None
        assert w.e2e_latency.count == b.histograms[e2e][1] - a[b.key].histograms[e2e][1] > 0
    assert {s.ts for s in store.baselines(url)} == {clock.now}


def test_a_resumed_collector_still_sees_an_engine_restart_as_a_reset(
    page_server: tuple[PageServer, str], store: Store
) -> None:
    state, url = page_server
    state.script = [Reply(page=PAGE_B), Reply(page=PAGE_RESTARTED)]
    clock = FakeClock()
    with Collector(url, store, interval_s=10, timeout_s=2, clock=clock) as first:
        first.collect_once()
    clock.advance(10)
    with Collector(url, store, interval_s=10, timeout_s=2, clock=clock) as second:
        result = second.collect_once()
    assert result.ok and len(result.windows) == 2 and all(w.reset for w in result.windows)
    restarted = {s.key: s for s in parse_metrics_page(PAGE_RESTARTED, url=url, ts=clock.now)}
    for key, sample in restarted.items():
        (w,) = store.windows(key)
        assert w.reset and w.spec == sample.spec
    assert sorted(e.kind for e in store.events()) == ["counter_reset", "counter_reset"]


def test_a_stale_stored_baseline_is_not_resumed(page_server: tuple[PageServer, str]) -> None:
    state, url = page_server
    state.script = [Reply(page=PAGE_A), Reply(page=PAGE_B)]
    sink, clock = ListSink(), FakeClock()
    with Collector(url, sink, interval_s=10, timeout_s=2, clock=clock) as first:
        first.collect_once()
    clock.advance(901)
    with Collector(url, sink, interval_s=10, timeout_s=2, clock=clock, resume_max_age_s=900) as second:
        assert second.collect_once().windows == ()  # a fresh baseline: one window over 15 min would blur it
    with pytest.raises(ValueError, match="resume_max_age_s"):
        Collector(url, sink, resume_max_age_s=-1)


def test_a_failing_store_keeps_the_baseline_so_the_next_window_covers_the_gap(
    page_server: tuple[PageServer, str],
) -> None:
    state, url = page_server
    state.script = [Reply(page=PAGE_A), Reply(page=PAGE_A), Reply(page=PAGE_B)]
    sink, clock = ListSink(), FakeClock()
    with Collector(url, sink, interval_s=10, timeout_s=2, clock=clock) as collector:
        collector.collect_once()
        clock.advance(10)
        sink.fail_windows = True
        assert not collector.collect_once().ok
        assert collector.errors == {"sink_error": 1}
        sink.fail_windows = False
        clock.advance(10)
        assert collector.collect_once().ok
    assert {w.duration_s for w in sink.windows} == {20.0}


def test_the_loop_scrapes_every_interval_until_stopped(page_server: tuple[PageServer, str]) -> None:
    state, url = page_server
    state.script = [Reply(page=PAGE_A)]
    sink = ListSink()
    stop = threading.Event()
    collector = Collector(url, sink, interval_s=0.05, timeout_s=1)
    runner = threading.Thread(target=collector.run, args=(stop,))
    runner.start()
    time.sleep(0.5)
    stop.set()
    runner.join(5)
    collector.close()
    assert not runner.is_alive()
    assert 4 <= collector.scrapes_ok <= 12
    assert len(sink.windows) == 2 * (collector.scrapes_ok - 1)


def test_unreachable_engine_is_a_connection_error(tmp_path: Path) -> None:
    sink = ListSink()
    with Collector("http://127.0.0.1:9/metrics", sink, interval_s=1, timeout_s=1) as collector:
        result = collector.collect_once()
    assert result.error is not None and result.error.reason is ScrapeErrorReason.CONNECTION
    assert "is vLLM running" in str(result.error)


def test_metrics_url_accepts_a_base_url_and_refuses_junk() -> None:
    assert metrics_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000/metrics"
    assert metrics_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000/metrics"
    assert metrics_url("http://h:1/custom/metrics") == "http://h:1/custom/metrics"
    for bad in ("ftp://h/metrics", "not a url", "127.0.0.1:8000"):
        with pytest.raises(ValueError, match="http"):
            metrics_url(bad)


# --- the CLI --------------------------------------------------------------------------------------


def test_collect_once_cli_stores_one_window_per_engine(page_server: tuple[PageServer, str], db_url: str) -> None:
    state, url = page_server
    state.script = [Reply(page=PAGE_A), Reply(page=PAGE_B)]
    base = url.removesuffix("/metrics")
    result = CliRunner().invoke(
        app, ["collect", "--url", base, "--db", db_url, "--once", "--interval-s", "0.2", "--json"]
    )
    assert result.exit_code == 0, result.output
    with Store(db_url) as store:
        keys = [key for _, key, _ in store.engines()]
        assert sorted(k.engine for k in keys) == ["0", "1"]
        for key in keys:
            (w,) = store.windows(key)
            assert w.spec is not None and w.spec.drafts > 0
    assert '"scrapes_ok": 2' in result.output


def test_collect_once_cli_fails_with_exit_1_on_a_500(page_server: tuple[PageServer, str], db_url: str) -> None:
    state, url = page_server
    state.script = [Reply(kind="status", status=500)]
    result = CliRunner().invoke(app, ["collect", "--url", url, "--db", db_url, "--once", "--interval-s", "0.1"])
    assert result.exit_code == 1
    assert "HTTP 500" in result.output


def test_collect_cli_refuses_an_unmigrated_database_with_the_fix(
    page_server: tuple[PageServer, str], tmp_path: Path
) -> None:
    _, url = page_server
    db = f"sqlite:///{tmp_path / 'new.db'}"
    result = CliRunner().invoke(app, ["collect", "--url", url, "--db", db, "--once"])
    assert result.exit_code == 2
    assert "spectuner db upgrade" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--url", "ftp://x", "--once"], "http"),
        (["--url", "http://127.0.0.1:1", "--interval-s", "0"], "--interval-s"),
        (["--url", "http://127.0.0.1:1", "--timeout-s", "-1"], "--timeout-s"),
    ],
)
def test_collect_cli_usage_errors(args: list[str], message: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["collect", "--db", f"sqlite:///{tmp_path / 'x.db'}", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_kill_9_mid_collection_leaves_a_consistent_database(
    page_server: tuple[PageServer, str], tmp_path: Path
) -> None:
    """The real `spectuner collect` loop, SIGKILLed while writing every 20 ms; the file stays sound."""
    state, url = page_server
    state.script = [Reply(page=PAGE_A), Reply(page=PAGE_B), Reply(page=PAGE_RESTARTED)] * 50 + [Reply(page=PAGE_A)]
    db_path = tmp_path / "killed.db"
    db = f"sqlite:///{db_path}"
    upgrade(db)
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tuner.cli.main", "collect", "--url", url, "--db", db, "--interval-s", "0.02"],
        cwd=repo,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while state.hits < 40:
            assert proc.poll() is None, "collect exited early"
            assert time.monotonic() < deadline, "collect never scraped"
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    with Store(db) as store:
        keys = [key for _, key, _ in store.engines()]
        assert keys
        windows = [w for key in keys for w in store.windows(key)]
        assert len(windows) >= 10
        for w in windows:  # every stored window is whole: all its fields, never a negative count
            assert w.spec is not None and w.spec.drafts >= 0 and len(w.spec.accepted_per_pos) == 3
            assert w.end > w.start and w.generation_tokens >= 0
        # Each reset window has its event: they are written right after it.
        resets = sum(w.reset for w in windows)
        assert resets >= 1
        assert len(store.events(kind="counter_reset")) in (resets, resets - 1, resets - 2)


def test_collect_never_logs_or_stores_the_urls_password(
    page_server: tuple[PageServer, str], db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    state, url = page_server
    state.script = [Reply(page=PAGE_A), Reply(page=PAGE_B)]
    with_password = url.replace("http://", "http://scraper:hunter2secret@") + "?api_key=querysecret99"
    caplog.set_level("DEBUG", logger="collectors")
    result = CliRunner().invoke(
        app, ["collect", "--url", with_password, "--db", db_url, "--once", "--interval-s", "0.2", "--json"]
    )
    assert result.exit_code == 0, result.output
    with Store(db_url) as store:
        urls = {key.url for _, key, _ in store.engines()}
        events = [e.message for e in store.events()]
    assert urls == {"http://scraper:***@" + url.removeprefix("http://") + "?api_key=***"}
    for text in [result.output, caplog.text, *urls, *events]:
        assert "hunter2secret" not in text and "querysecret99" not in text
    path = sqlite_path(db_url)
    if path is not None:  # nothing anywhere in the file, WAL included
        for f in (path, path.with_name(path.name + "-wal")):
            if f.exists():
                assert b"hunter2secret" not in f.read_bytes() and b"querysecret99" not in f.read_bytes()


def test_collect_max_body_bytes_is_the_flag_its_error_names(page_server: tuple[PageServer, str], db_url: str) -> None:
    state, url = page_server
    state.script = [Reply(page=PAGE_A)]
    small = CliRunner().invoke(
        app, ["collect", "--url", url, "--db", db_url, "--once", "--interval-s", "0.1", "--max-body-bytes", "100"]
    )
    assert small.exit_code == 1 and "--max-body-bytes" in small.stderr
    big = CliRunner().invoke(
        app, ["collect", "--url", url, "--db", db_url, "--once", "--interval-s", "0.1", "--max-body-bytes", "10000000"]
    )
    assert big.exit_code == 0, big.output
