"""Store contents for the exporter tests: two engine series of one server, a draft swap, windows,
decisions of every kind, and the events counters are built from."""

from __future__ import annotations

from datetime import timedelta

from collectors.records import EventRecord
from policies.counters import SpecCounters
from tests.integration.store_factories import T0, A, B, window
from tuner.store import DecisionRecord, EngineConfigRecord, Store

SERVER = A.url
NOW = T0 + timedelta(seconds=52)
WINDOW_S = 30.0
WINDOWS = range(10)  # windows i end at T0 + 5·(i + 1) s


def windows_in_view() -> list[int]:
    """The windows an export at NOW over WINDOW_S covers (end within the last 30 s)."""
    return [i for i in WINDOWS if (T0 + timedelta(seconds=5 * i + 5)) >= NOW - timedelta(seconds=WINDOW_S)]


def expected_counters() -> tuple[SpecCounters, float, float]:
    """(summed spec counters, generated tokens, seconds) of the windows in view, from the factory."""
    spec = SpecCounters()
    tokens = 0.0
    for i in windows_in_view():
        w = window(i)
        assert w.spec is not None
        spec = spec + w.spec
        tokens += w.generation_tokens
    return spec, tokens, 5.0 * len(windows_in_view())


def fill(store: Store) -> dict[str, int]:
    ids: dict[str, int] = {}
    for key in (A, B):
        store.record_config(
            key,
            EngineConfigRecord(
                method="draft_model", draft_model="/m/medium", num_spec_tokens=3, started_at=T0 - timedelta(hours=1),
                applied_by="startup",
            ),
        )
        store.record_config(
            key,
            EngineConfigRecord(method="draft_model", draft_model="/m/good", num_spec_tokens=3, started_at=T0,
                               applied_by="restart"),
        )
        store.write_windows([window(i, key) for i in WINDOWS])
    common = {"inputs": {}, "engine": A, "message": "m"}
    store.record_decision(DecisionRecord(created_at=T0, action="change", reason="change_k", mode="advisory",
                                         status="advisory", **common))  # type: ignore[arg-type]
    store.record_decision(DecisionRecord(created_at=T0, action="change", reason="cooldown", mode="auto",
                                         status="blocked", **common))  # type: ignore[arg-type]
    applied = store.record_decision(
        DecisionRecord(created_at=T0, action="change", reason="change_k", mode="auto", status="applying",
                       predicted_gain=1.25, **common)  # type: ignore[arg-type]
    )
    store.update_decision(applied, status="verified", at=T0 + timedelta(seconds=10), realized_gain=1.18)
    ids["applied"] = applied
    store.write_events(
        [
            EventRecord(ts=T0, kind="collector_error", message="x", severity="warning",
                        data={"url": SERVER, "reason": "timeout"}),
            EventRecord(ts=T0, kind="scrape_stale", message="x", severity="warning", data={"url": SERVER}),
            EventRecord(ts=T0, kind="collector_error", message="x", severity="warning",
                        data={"url": "http://elsewhere/metrics", "reason": "timeout"}),
            EventRecord(ts=T0, kind="regression_rolled_back", message="x", severity="warning", engine=A),
            EventRecord(ts=T0, kind="engine_down", message="x", severity="critical", engine=A),
        ]
    )
    return ids
