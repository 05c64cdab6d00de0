"""Alert hooks against real local receivers: signed webhook, slow receiver (timeout → retry), failing
receiver (500 → exponential back-off → failed), a 4xx (no retry), Slack and Alertmanager shapes, the
command sink, dedup, rate limit, the persisted cursor across a dispatcher restart, and no secret in
logs or the database."""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from collectors.records import EngineKey, EventRecord
from tests.fakes import FakeClock
from tests.integration.receivers import Receiver
from tuner.alerts.dispatcher import AlertDispatcher, build_dispatcher
from tuner.alerts.settings import AlertsSection, SinkSection
from tuner.alerts.sinks import SIGNATURE_HEADER, SinkConfigError
from tuner.store import Store, upgrade
from tuner.store import deliveries as D

ENGINE = EngineKey("http://127.0.0.1:8000/metrics", "llama", "0")
SECRET = "s3cr3t-hmac-key-do-not-log"
T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[Store]:
    url = f"sqlite:///{tmp_path / 'alerts.db'}"
    upgrade(url)
    with Store(url) as store:
        yield store


def event(kind: str = "regression_rolled_back", severity: str = "warning", **data: Any) -> EventRecord:
    engine = None if kind.startswith(("collector", "scrape")) else ENGINE
    return EventRecord(ts=T0, kind=kind, message=f"{kind} happened", severity=severity, engine=engine, data=data)


def sink(name: str, kind: str = "webhook", **fields: Any) -> SinkSection:
    defaults: dict[str, Any] = {"timeout_s": 2.0, "retries": 0, "backoff_s": 0.05, "jitter": 0.0}
    return SinkSection.model_validate({"name": name, "kind": kind, **defaults, **fields})


def dispatcher(
    store: Store, *sinks: SinkSection, clock: FakeClock | None = None, start: str = "oldest"
) -> AlertDispatcher:
    settings = AlertsSection(sinks=list(sinks), new_sink_start=start)  # type: ignore[arg-type]
    return build_dispatcher(store, settings, clock or FakeClock(T0))


def test_webhook_is_signed_and_logged_without_the_secret(
    sqlite_store: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("HOOK_SECRET", SECRET)
    caplog.set_level(logging.DEBUG)
    sqlite_store.write_events([event(decision_id=7)])
    with Receiver() as rx:
        d = dispatcher(sqlite_store, sink("hook", url=rx.url + "/hook", secret_env="HOOK_SECRET"))
        result = d.poll_once()
        d.close()
        [req] = rx.wait_for(1)
    assert result.count("delivered") == 1
    expected = "sha256=" + hmac.new(SECRET.encode(), req.body, hashlib.sha256).hexdigest()
    assert hmac.compare_digest(req.headers[SIGNATURE_HEADER.lower()], expected)
    body = json.loads(req.body)
    assert body["kind"] == "regression_rolled_back" and body["category"] == "rollback"
    assert body["engine"] == {"url": ENGINE.url, "model_name": "llama", "engine": "0"}
    assert body["data"] == {"decision_id": 7} and body["severity"] == "warning" and body["resolved"] is False
    assert req.headers["x-spectuner-delivery"] == f"hook-{body['event_id']}"
    [row] = D.deliveries(sqlite_store)
    assert (row.record.outcome, row.record.attempts, row.record.status_code) == ("delivered", 1, 200)
    assert SECRET not in caplog.text
    assert SECRET not in json.dumps([r.record.__dict__ for r in D.deliveries(sqlite_store)], default=str)


def test_slow_receiver_times_out_then_the_retry_succeeds(sqlite_store: Store) -> None:
    sqlite_store.write_events([event()])
    with Receiver(["slow", "ok"], slow_s=3.0) as rx:
        d = dispatcher(sqlite_store, sink("hook", url=rx.url, timeout_s=0.4, retries=2, backoff_s=0.2))
        d.poll_once()
        d.close()
        first, second = rx.wait_for(2)
    assert second.at - first.at >= 0.4 + 0.2 - 0.05  # the timeout, then the first back-off
    [row] = D.deliveries(sqlite_store)
    assert (row.record.outcome, row.record.attempts, row.record.status_code) == ("delivered", 2, 200)


def test_failing_receiver_backs_off_exponentially_then_gives_up(sqlite_store: Store) -> None:
    sqlite_store.write_events([event()])
    with Receiver(["fail"]) as rx:
        d = dispatcher(sqlite_store, sink("hook", url=rx.url, retries=3, backoff_s=0.1, backoff_max_s=1.0))
        result = d.poll_once()
        d.close()
        reqs = rx.wait_for(4)
    assert len(reqs) == 4 and result.count("failed") == 1
    gaps = [b.at - a.at for a, b in itertools.pairwise(reqs)]
    for gap, delay in zip(gaps, (0.1, 0.2, 0.4), strict=True):
        assert delay - 0.02 <= gap < delay + 1.0, gaps
    assert gaps[2] > gaps[0] * 2.5, gaps  # doubling, not a fixed delay
    [row] = D.deliveries(sqlite_store)
    assert (row.record.outcome, row.record.attempts, row.record.status_code) == ("failed", 4, 500)
    assert row.record.error is not None and row.record.error.startswith("HTTP 500")


def test_a_client_error_is_not_retried(sqlite_store: Store) -> None:
    sqlite_store.write_events([event()])
    with Receiver(["reject"]) as rx:
        d = dispatcher(sqlite_store, sink("hook", url=rx.url, retries=3))
        d.poll_once()
        d.close()
        time.sleep(0.2)
        assert len(rx.requests) == 1
    [row] = D.deliveries(sqlite_store)
    assert (row.record.outcome, row.record.attempts, row.record.status_code) == ("failed", 1, 400)


def test_slack_and_alertmanager_shapes_and_resolution(sqlite_store: Store) -> None:
    url = "http://127.0.0.1:9/metrics"
    sqlite_store.write_events(
        [event("collector_error", url=url, reason="timeout"), event("collector_recovered", "info", url=url)]
    )
    with Receiver() as slack, Receiver() as am:
        d = dispatcher(sqlite_store, sink("slack", "slack", url=slack.url + "/services/T1/B2/abcdefgh"),
                       sink("am", "alertmanager", url=am.url))
        d.poll_once()
        d.close()
        s1, s2 = slack.wait_for(2)
        a1, a2 = am.wait_for(2)
    assert json.loads(s1.body)["text"].startswith(":warning: spectuner collector_down (warning)")
    assert "collector_recovered happened" in json.loads(s2.body)["text"] and "resolved" in json.loads(s2.body)["text"]
    assert a1.path == "/api/v2/alerts"
    [fire], [resolve] = json.loads(a1.body), json.loads(a2.body)
    assert fire["labels"] == resolve["labels"] == {
        "alertname": "spectuner_collector_down",
        "service": "spectuner",
        "severity": "warning",
        "instance": url,
    }
    assert fire["startsAt"] == T0.isoformat() and fire["endsAt"] == (T0 + timedelta(hours=1)).isoformat()
    assert resolve["endsAt"] == T0.isoformat() and "startsAt" not in resolve


def test_command_sink_gets_the_event_on_stdin_and_is_killed_on_timeout(sqlite_store: Store, tmp_path: Path) -> None:
    out = tmp_path / "event.json"
    pid_file = tmp_path / "pid"
    write = f"import sys, pathlib; pathlib.Path({str(out)!r}).write_bytes(sys.stdin.buffer.read())"
    writer = [sys.executable, "-c", write]
    failing = [sys.executable, "-c", "import sys; sys.stderr.write('no route to pager'); sys.exit(3)"]
    hang = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    hanging = [sys.executable, "-c", hang]
    sqlite_store.write_events([event("engine_down", "critical")])
    d = dispatcher(
        sqlite_store,
        sink("write", "command", argv=writer),
        sink("fail", "command", argv=failing, retries=1),
        sink("hang", "command", argv=hanging, timeout_s=1.0),
    )
    result = d.poll_once()
    d.close()
    assert result.outcomes == {"write": {"delivered": 1}, "fail": {"failed": 1}, "hang": {"failed": 1}}
    body = json.loads(out.read_text())
    assert body["kind"] == "engine_down" and body["category"] == "engine_unhealthy" and body["severity"] == "critical"
    rows = {r.record.sink: r.record for r in D.deliveries(sqlite_store)}
    assert rows["fail"].attempts == 2 and rows["fail"].error == "exit status 3: no route to pager"
    assert rows["hang"].error is not None and "timed out" in rows["hang"].error
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)  # the hung command was killed, not left behind


def test_dedup_window_and_rate_limit(sqlite_store: Store) -> None:
    clock = FakeClock(T0)
    with Receiver() as rx:
        d = dispatcher(sqlite_store, sink("hook", url=rx.url, dedup_window_s=300), clock=clock)
        same = event("collector_error", url="http://x/metrics", reason="timeout")
        sqlite_store.write_events([same, same, same])
        assert d.poll_once().outcomes["hook"] == {"delivered": 1, "deduplicated": 2}
        clock.advance(301)
        sqlite_store.write_events([same])
        assert d.poll_once().outcomes["hook"] == {"delivered": 1}
        d.close()

        limited = dispatcher(sqlite_store, sink("limited", url=rx.url, dedup_window_s=0, rate_limit_per_minute=2),
                             clock=clock, start="latest")
        sqlite_store.write_events([event(decision_id=i) for i in range(4)])
        assert limited.poll_once().outcomes["limited"] == {"delivered": 2, "rate_limited": 2}
        clock.advance(61)
        sqlite_store.write_events([event(decision_id=99)])
        assert limited.poll_once().outcomes["limited"] == {"delivered": 1}
        limited.close()
        assert len(rx.wait_for(5)) == 5


def test_filters_by_kind_category_and_severity(sqlite_store: Store) -> None:
    sqlite_store.write_events(
        [
            event("counter_reset", "info"),  # not an alert kind: not sent by default
            event("apply_rolled_back"),
            event("engine_down", "critical"),
            event("config_applied", "info"),
        ]
    )
    with Receiver() as rx:
        d = dispatcher(
            sqlite_store,
            sink("default", url=rx.url + "/default"),
            sink("rollbacks", url=rx.url + "/rollbacks", kinds=["rollback"]),
            sink("critical", url=rx.url + "/critical", min_severity="critical"),
            sink("everything", url=rx.url + "/everything", kinds=["*"]),
        )
        result = d.poll_once()
        d.close()
    assert result.outcomes == {
        "default": {"delivered": 2},
        "rollbacks": {"delivered": 1},
        "critical": {"delivered": 1},
        "everything": {"delivered": 4},
    }
    assert result.skipped == {"default": 2, "rollbacks": 3, "critical": 3, "everything": 0}


def test_cursor_survives_a_restart_without_loss_or_resend(store: Store) -> None:
    """On SQLite and PostgreSQL: a new sink starts after the newest event; a restarted dispatcher
    resumes after its cursor."""
    store.write_events([event(decision_id=0)])  # before the sink existed: not sent
    with Receiver() as rx:
        first = dispatcher(store, sink("hook", url=rx.url), start="latest")
        assert first.poll_once().outcomes["hook"] == {}
        store.write_events([event(decision_id=1), event(decision_id=2)])
        assert first.poll_once().outcomes["hook"] == {"delivered": 2}
        first.close()
        store.write_events([event(decision_id=3)])  # written while "down"
        second = dispatcher(store, sink("hook", url=rx.url), start="latest")
        assert second.poll_once().outcomes["hook"] == {"delivered": 1}
        assert second.poll_once().outcomes["hook"] == {}
        second.close()
        got = [json.loads(r.body)["data"]["decision_id"] for r in rx.wait_for(3)]
    assert got == [1, 2, 3]
    assert [r.record.outcome for r in D.deliveries(store, sink="hook")] == ["delivered"] * 3
    # Pruning the delivery log keeps the cursor: nothing is re-sent.
    assert D.prune_deliveries(store, T0 + timedelta(days=1)) == 3 and D.deliveries(store) == []
    assert D.cursor(store, "hook") == D.latest_event_id(store)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_secret_url_never_reaches_logs_or_the_database(
    sqlite_store: Store, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.DEBUG)
    token = "T0000/B0000/XXXXsecretXXXX"
    monkeypatch.setenv("SLACK_URL", f"http://127.0.0.1:{_closed_port()}/services/{token}")
    sqlite_store.write_events([event()])
    d = dispatcher(sqlite_store, sink("slack", "slack", url_env="SLACK_URL", retries=1))
    assert d.poll_once().count("failed") == 1
    d.close()
    [row] = D.deliveries(sqlite_store)
    assert row.record.error and "XXXXsecretXXXX" not in row.record.error
    assert "XXXXsecretXXXX" not in caplog.text and "slack" in caplog.text


def test_a_missing_secret_env_is_a_clear_error(sqlite_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_SUCH_SECRET", raising=False)
    with pytest.raises(SinkConfigError, match=r"NO_SUCH_SECRET .*not set; export it"):
        dispatcher(sqlite_store, sink("hook", url="http://127.0.0.1:1", secret_env="NO_SUCH_SECRET"))
