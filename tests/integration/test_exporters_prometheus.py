"""The Prometheus endpoint over a real store (SQLite and PostgreSQL): scrape the real HTTP server on
127.0.0.1 and check every figure against what the policies compute from the same windows."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from collectors.records import EngineKey, EventRecord
from policies.acceptance import alpha_of_windows, estimate_alpha
from tests.fakes import FakeClock
from tests.integration import fleet_factories as FF
from tests.integration.exporter_fixtures import NOW, SERVER, WINDOW_S, expected_counters, fill
from tests.integration.store_factories import A, B
from tuner.cli.status_fleet import gather_fleet
from tuner.controller import manual
from tuner.exporters.service import ExportService
from tuner.exporters.settings import ExportersSection
from tuner.exporters.values import METRICS, overhead_ratio
from tuner.store import DecisionRecord, Store

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> tuple[Series, str]:
    response = httpx.get(url, timeout=5)
    assert response.status_code == 200
    series: Series = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            series[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return series, response.text


def labels(key: EngineKey, **extra: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"engine": key.engine, "model_name": key.model_name, **extra}.items()))


@pytest.fixture
def service(store: Store) -> Iterator[ExportService]:
    settings = ExportersSection.model_validate(
        {"window_s": WINDOW_S, "prometheus": {"enabled": True, "host": "127.0.0.1", "port": 0}}
    )
    svc = ExportService(store, settings, clock=FakeClock(NOW), metrics_url=SERVER, cost_ratio=0.05)
    svc.start()
    try:
        yield svc
    finally:
        svc.stop()


def test_scrape_shows_every_figure_from_the_store(store: Store, service: ExportService) -> None:
    fill(store)
    service.refresh()
    assert service.prometheus is not None and service.prometheus.port > 0
    series, text = scrape(f"http://127.0.0.1:{service.prometheus.port}/metrics")

    for name, metric in METRICS.items():  # every family is described, with its type
        assert re.search(rf"^# TYPE {name.removesuffix('_total')}(_total)? {metric.kind}$", text, re.M), name

    spec, tokens, seconds = expected_counters()
    est = estimate_alpha(spec)
    assert est.alpha is not None and est.alpha_ci is not None
    for key in (A, B):
        lab = labels(key)
        assert series[("spectuner_alpha", lab)] == pytest.approx(est.alpha)
        assert series[("spectuner_alpha_lower", lab)] == pytest.approx(est.alpha_ci[0])
        assert series[("spectuner_alpha_upper", lab)] == pytest.approx(est.alpha_ci[1])
        rate, mal = spec.accepted_tokens / spec.draft_tokens, 1 + spec.accepted_tokens / spec.drafts
        assert series[("spectuner_draft_acceptance_rate", lab)] == pytest.approx(rate)
        assert series[("spectuner_mean_acceptance_length", lab)] == pytest.approx(mal)
        assert series[("spectuner_effective_throughput_tokens_per_second", lab)] == pytest.approx(tokens / seconds)
        assert series[("spectuner_speculation_overhead_ratio", lab)] == pytest.approx(overhead_ratio(spec, 3, 0.05))
        assert series[("spectuner_num_speculative_tokens", lab)] == 3
        assert series[("spectuner_config_info", labels(key, method="draft_model", draft="/m/good"))] == 1
        assert series[("spectuner_predicted_speedup", lab)] == pytest.approx(1.25)
        assert series[("spectuner_realized_speedup", lab)] == pytest.approx(1.18)
        assert series[("spectuner_last_scrape_age_seconds", lab)] == pytest.approx(2.0)
        assert series[("spectuner_engine_up", lab)] == 0  # engine_down is the last health event
        assert series[("spectuner_draft_swaps_total", lab)] == 1  # /m/medium → /m/good by restart
    # A server-level count, on the server's first engine series (sums stay right); the other server's is not here.
    assert series[("spectuner_collector_errors_total", labels(A, kind="timeout"))] == 1
    assert series[("spectuner_collector_errors_total", labels(A, kind="stale"))] == 1
    assert not [k for k in series if k[0] == "spectuner_collector_errors_total" and ("engine", "1") in k[1]]
    assert series[("spectuner_rollbacks_total", labels(A))] == 1
    assert series[("spectuner_rollbacks_total", labels(B))] == 0
    assert series[("spectuner_decisions_total", labels(A, action="advisory", reason="change_k"))] == 1
    assert series[("spectuner_decisions_total", labels(A, action="blocked", reason="cooldown"))] == 1
    assert series[("spectuner_decisions_total", labels(A, action="apply", reason="change_k"))] == 1


def test_counters_grow_and_gauges_follow_the_store(store: Store, service: ExportService) -> None:
    fill(store)
    service.refresh()
    assert service.prometheus is not None
    url = f"http://127.0.0.1:{service.prometheus.port}/metrics"
    before, _ = scrape(url)
    store.record_decision(
        DecisionRecord(created_at=NOW, action="change", reason="cooldown", message="m", inputs={}, mode="auto",
                       engine=A, status="blocked")
    )
    store.write_events([EventRecord(ts=NOW, kind="engine_restarted", message="up", severity="warning", engine=A)])
    # A scrape serves the last refresh: nothing moves until the export job runs.
    assert scrape(url)[0] == before
    service.refresh()
    after, _ = scrape(url)
    blocked = ("spectuner_decisions_total", labels(A, action="blocked", reason="cooldown"))
    assert after[blocked] == before[blocked] + 1
    assert after[("spectuner_engine_up", labels(A))] == 1

    # No windows in view (the engine went idle): the window figures disappear instead of reading 0.
    service.clock.now = NOW + timedelta(hours=1)  # type: ignore[attr-defined]
    service.refresh()
    idle, _ = scrape(url)
    assert ("spectuner_alpha", labels(A)) not in idle
    assert ("spectuner_effective_throughput_tokens_per_second", labels(A)) not in idle
    assert idle[("spectuner_last_scrape_age_seconds", labels(A))] == pytest.approx(3600 + 2)
    assert idle[blocked] == after[blocked]  # counters never go down


def test_a_busy_port_is_a_clear_error(store: Store, service: ExportService) -> None:
    from tuner.exporters.prometheus import PrometheusExporter

    assert service.prometheus is not None
    other = PrometheusExporter(service.samples, "127.0.0.1", service.prometheus.port)
    with pytest.raises(OSError):
        other.start()


def test_the_fleet_gauges_are_opt_in_and_show_the_groups_status_shows(store: Store) -> None:
    """One sidecar of a fleet (its own engine only for the engine gauges) with ``[exporters] fleet = true``
    exports every engine of the database grouped: the same groups, intervals and outlier as
    `spectuner status --fleet`, re-read at most once per ``fleet_refresh_s``."""
    clock = FakeClock(NOW)
    written = FF.write_fleet(store, NOW)
    fleet_on = ExportersSection.model_validate(
        {"fleet": True, "fleet_window_s": 600, "fleet_refresh_s": 60,
         "prometheus": {"enabled": True, "host": "127.0.0.1", "port": 0}}
    )
    off = ExportService(store, ExportersSection(), clock=clock, metrics_url=FF.key("10.0.0.1").url)
    assert not [s for s in off.refresh() if s.name.startswith("spectuner_fleet_")]  # off by default

    svc = ExportService(store, fleet_on, clock=clock, metrics_url=FF.key("10.0.0.1").url)
    svc.start()
    try:
        assert svc.prometheus is not None
        url = f"http://127.0.0.1:{svc.prometheus.port}/metrics"
        series, _ = scrape(url)
        status = gather_fleet(store, NOW, 600)
        big = status["groups"][0]
        group = tuple(sorted({"model_name": FF.TARGET, "method": "draft_model", "draft": "/drafts/good",
                              "config": FF.K3.fingerprint}.items()))
        assert series[("spectuner_fleet_group_alpha", group)] == pytest.approx(big["alpha"])
        assert series[("spectuner_fleet_group_alpha_lower", group)] == pytest.approx(big["alpha_ci"][0])
        assert series[("spectuner_fleet_group_alpha_upper", group)] == pytest.approx(big["alpha_ci"][1])
        assert series[("spectuner_fleet_group_dispersion", group)] == pytest.approx(big["dispersion"])
        assert series[("spectuner_fleet_group_engines", group)] == 5
        assert series[("spectuner_fleet_group_pending_changes", group)] == 1  # the change K 3 → 4 in flight
        flags = {dict(k[1])["metrics_url"]: v for k, v in series.items() if k[0] == "spectuner_fleet_outlier"}
        assert flags == {FF.key(h).url: float(h == FF.BROKEN) for h in FF.REPLICAS}
        broken = tuple(sorted({**dict(group), "metrics_url": FF.key(FF.BROKEN).url, "engine": "0"}.items()))
        assert series[("spectuner_fleet_engine_alpha", broken)] == pytest.approx(
            alpha_of_windows(written[FF.BROKEN]).alpha
        )
        # the engine gauges stay this sidecar's own
        assert {dict(k[1]).get("engine") for k in series if k[0] == "spectuner_alpha"} == {"0"}

        # an override for the broken replica: not seen until fleet_refresh_s has passed
        manual.request_override(store, NOW, FF.NGRAM.to_vllm(), engine=FF.key(FF.BROKEN))
        clock.advance(30)
        svc.refresh()
        assert scrape(url)[0][("spectuner_fleet_group_pending_changes", group)] == 1
        clock.advance(31)
        svc.refresh()
        assert scrape(url)[0][("spectuner_fleet_group_pending_changes", group)] == 2
    finally:
        svc.stop()
