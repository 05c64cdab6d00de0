"""Alert events (pure): categories, filters, dedup keys, payload shapes, the signature, back-off
bounds and the sink config's errors."""

from __future__ import annotations

import hashlib
import hmac
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from collectors.records import EngineKey
from collectors.redact import scrub
from tuner.alerts.dispatcher import backoff_delay_s
from tuner.alerts.events import (
    alertmanager_payload,
    categories,
    category_of,
    dedup_key,
    generic_payload,
    selects,
    slack_payload,
)
from tuner.alerts.settings import AlertsSection, SinkSection
from tuner.alerts.sinks import signature
from tuner.store.deliveries import StoredEvent

TS = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
KEY = EngineKey("http://h:8000/metrics", "llama", "1")
MAP = categories()


def ev(kind: str, severity: str = "warning", engine: EngineKey | None = KEY, **data: Any) -> StoredEvent:
    return StoredEvent(id=42, ts=TS, kind=kind, severity=severity, message=f"{kind}!", engine=engine, engine_id=3,
                       data=data)


@pytest.mark.parametrize(
    ("kind", "category"),
    [
        ("draft_swapped", "draft_swapped"),
        ("k_changed", "k_changed"),
        ("apply_rolled_back", "rollback"),
        ("regression_rolled_back", "rollback"),
        ("acceptance_low", "acceptance_low"),
        ("collector_error", "collector_down"),
        ("scrape_stale", "collector_down"),
        ("engine_down", "engine_unhealthy"),
        ("budget_exceeded", "budget_exceeded"),
        ("something_new", "something_new"),
    ],
)
def test_the_issue_list_maps_onto_stored_kinds(kind: str, category: str) -> None:
    assert category_of(ev(kind), MAP).name == category


def test_config_adds_kinds() -> None:
    mapping = categories({"my_kind": "budget_exceeded"})
    assert category_of(ev("my_kind"), mapping).name == "budget_exceeded"
    assert selects(ev("my_kind"), mapping, [], "info")


def test_filters() -> None:
    assert not selects(ev("counter_reset", "info"), MAP, [], "info")  # not an alert kind
    assert selects(ev("counter_reset", "info"), MAP, ["*"], "info")
    assert selects(ev("apply_rolled_back"), MAP, ["rollback"], "info")
    assert selects(ev("apply_rolled_back"), MAP, ["apply_rolled_back"], "info")
    assert not selects(ev("engine_down", "critical"), MAP, ["rollback"], "info")
    assert not selects(ev("apply_rolled_back", "warning"), MAP, [], "critical")
    # A resolve goes wherever its category goes, whatever its own (info) severity.
    assert selects(ev("collector_recovered", "info"), MAP, ["collector_down"], "critical")


def test_dedup_key() -> None:
    a = dedup_key(ev("collector_error", engine=None, url="http://h/metrics", reason="timeout"))
    b = dedup_key(ev("collector_error", engine=None, url="http://h/metrics", reason="connection"))
    assert a != b and "timeout" in a
    assert dedup_key(ev("apply_rolled_back", decision_id=1)) != dedup_key(ev("apply_rolled_back", decision_id=2))
    assert dedup_key(ev("engine_down")) == dedup_key(ev("engine_down"))
    assert dedup_key(ev("engine_down", dedup_key="mine")) == "mine"


def test_payloads() -> None:
    body = generic_payload(ev("engine_down", "critical", detail="log"), MAP)
    assert body == {
        "source": "spectuner",
        "event_id": 42,
        "kind": "engine_down",
        "category": "engine_unhealthy",
        "resolved": False,
        "severity": "critical",
        "message": "engine_down!",
        "ts": TS.isoformat(),
        "engine": {"url": KEY.url, "model_name": "llama", "engine": "1"},
        "data": {"detail": "log"},
    }
    text = slack_payload(ev("engine_down", "critical"), MAP)["text"]
    assert text == ":rotating_light: spectuner engine_unhealthy (critical) — llama engine 1: engine_down!"
    [alert] = alertmanager_payload(ev("engine_restarted", "warning"), MAP, 3600)
    assert alert["labels"]["severity"] == "critical"  # the firing severity, so the resolve matches
    assert alert["endsAt"] == TS.isoformat()
    [alert] = alertmanager_payload(ev("acceptance_low"), MAP, 600)
    assert alert["endsAt"] == (TS + timedelta(seconds=600)).isoformat() and alert["startsAt"] == TS.isoformat()
    assert alert["labels"] == {"alertname": "spectuner_acceptance_low", "service": "spectuner", "severity": "warning",
                               "instance": KEY.url, "model_name": "llama", "engine": "1"}


def test_signature_is_hmac_sha256_of_the_body() -> None:
    body = b'{"a":1}'
    assert signature(b"k", body) == "sha256=" + hmac.new(b"k", body, hashlib.sha256).hexdigest()
    assert signature(b"k", body) != signature(b"k", body + b" ")


def test_scrub() -> None:
    assert scrub("failed for http://h/x?token=abc with abc", ["http://h/x?token=abc", "abc"]) == (
        "failed for <redacted> with <redacted>"
    )
    assert len(scrub("x" * 10_000, [])) == 500


@given(
    backoff=st.floats(0, 10),
    cap=st.floats(0, 60),
    retry=st.integers(0, 20),
    jitter=st.floats(0, 0.5),
    unit=st.floats(0, 1, exclude_max=True),
)
def test_backoff_is_bounded(backoff: float, cap: float, retry: int, jitter: float, unit: float) -> None:
    delay = backoff_delay_s(backoff, cap, retry, jitter, unit)
    base = min(cap, backoff * 2**retry)
    assert 0 <= delay <= cap
    assert base * (1 - jitter) - 1e-9 <= delay <= base * (1 + jitter) + 1e-9


def test_backoff_doubles_without_jitter() -> None:
    assert [backoff_delay_s(0.5, 3.0, i, 0.0, 0.5) for i in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kind": "webhook"}, "needs exactly one of url or url_env"),
        ({"kind": "webhook", "url": "ftp://x"}, "not an http(s) URL"),
        ({"kind": "command"}, "set argv"),
        ({"kind": "slack", "url": "http://x", "secret_env": "S"}, "only for webhook sinks"),
        ({"kind": "webhook", "url": "http://x", "secret_env": "hunter2!"}, "not an environment variable name"),
        ({"kind": "webhook", "url": "http://x", "backoff_s": 5, "backoff_max_s": 1}, "below backoff_s"),
        ({"kind": "webhook", "url": "http://x", "name": "bad name"}, "not a sink name"),
        ({"kind": "pager", "url": "http://x"}, "'webhook', 'slack', 'alertmanager' or 'command'"),
    ],
)
def test_sink_config_errors_say_what_to_fix(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        SinkSection.model_validate({"name": "s", **fields})


def test_sink_names_are_unique() -> None:
    sink = {"name": "s", "kind": "webhook", "url": "http://x"}
    with pytest.raises(ValidationError, match="s appear more than once"):
        AlertsSection.model_validate({"sinks": [sink, sink]})


def test_an_apply_event_carries_its_client_impact_to_every_sink() -> None:
    e = ev("draft_swapped", "info", strategy="drain_hold", requests_held=4, longest_hold_s=33.2, requests_failed=0)
    assert generic_payload(e, MAP)["data"]["requests_held"] == 4
    assert slack_payload(e, MAP)["text"].endswith("clients: 4 held (longest 33.2 s), 0 failed [drain_hold]")
    am = alertmanager_payload(e, MAP, 3600)[0]["annotations"]
    assert am["client_impact"] == "clients: 4 held (longest 33.2 s), 0 failed [drain_hold]"
    plain = ev("draft_swapped", "info")
    assert "client_impact" not in alertmanager_payload(plain, MAP, 3600)[0]["annotations"]
    assert "clients:" not in slack_payload(plain, MAP)["text"]
