"""Snapshot → samples (pure): every figure against its formula, absent figures, counters, and the
Prometheus exposition of a fixed set of samples (fresh registry, no HTTP)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest

from collectors.records import EngineKey
from policies.acceptance import alpha_of_windows, estimate_alpha
from policies.counters import SpecCounters
from policies.spec_config import OFF, SpecConfig
from tuner.exporters.prometheus import PrometheusExporter
from tuner.exporters.values import (
    CounterTotals,
    EngineSnapshot,
    Sample,
    collector_error_kind,
    decision_action,
    engine_samples,
    is_draft_swap,
    overhead_ratio,
)

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
KEY = EngineKey("http://h:8000/metrics", "llama", "0")
K3 = SpecCounters(drafts=100, draft_tokens=300, accepted_tokens=180, accepted_per_pos=(80, 60, 40), num_spec_tokens=3)


def snap(**changes: object) -> EngineSnapshot:
    base = EngineSnapshot(
        key=KEY,
        now=NOW,
        config=SpecConfig("draft_model", "/m/good", 3),
        spec=K3,
        duration_s=10.0,
        generation_tokens=2800.0,
        last_window_end=NOW - timedelta(seconds=4),
        predicted_speedup=1.3,
        realized_speedup=1.2,
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def values(samples: list[Sample]) -> dict[str, float]:
    return {s.name: s.value for s in samples}


def test_every_gauge_matches_its_formula() -> None:
    out = engine_samples(snap(), cost_ratio=0.05)
    v = values(out)
    est = estimate_alpha(K3)
    assert est.alpha is not None and est.alpha_ci is not None
    assert v["spectuner_alpha"] == pytest.approx(180 / (180 + 100 - 40))  # A / (A + D − a_{K−1})
    assert v["spectuner_alpha"] == pytest.approx(est.alpha)
    assert (v["spectuner_alpha_lower"], v["spectuner_alpha_upper"]) == pytest.approx(est.alpha_ci)
    assert v["spectuner_alpha_lower"] < v["spectuner_alpha"] < v["spectuner_alpha_upper"]
    assert v["spectuner_draft_acceptance_rate"] == pytest.approx(180 / 300)
    assert v["spectuner_mean_acceptance_length"] == pytest.approx(1 + 180 / 100)
    assert v["spectuner_effective_throughput_tokens_per_second"] == pytest.approx(280.0)
    # (K·c + (T − A)/(T + D)) / (1 + K·c) = (0.15 + 120/400) / 1.15
    assert v["spectuner_speculation_overhead_ratio"] == pytest.approx((0.15 + 0.3) / 1.15)
    assert v["spectuner_num_speculative_tokens"] == 3
    assert v["spectuner_predicted_speedup"] == 1.3 and v["spectuner_realized_speedup"] == 1.2
    assert v["spectuner_last_scrape_age_seconds"] == pytest.approx(4.0)
    assert v["spectuner_engine_up"] == 1.0
    info = next(s for s in out if s.name == "spectuner_config_info")
    assert dict(info.labels) == {"engine": "0", "model_name": "llama", "method": "draft_model", "draft": "/m/good"}
    assert all(dict(s.labels)["engine"] == "0" and dict(s.labels)["model_name"] == "llama" for s in out)


def test_figures_that_cannot_be_computed_are_absent_not_zero() -> None:
    idle = values(engine_samples(snap(spec=None, duration_s=0.0, predicted_speedup=None, realized_speedup=None,
                                      last_window_end=None, up=False), cost_ratio=0.05))
    for name in ("spectuner_alpha", "spectuner_draft_acceptance_rate", "spectuner_mean_acceptance_length",
                 "spectuner_effective_throughput_tokens_per_second", "spectuner_speculation_overhead_ratio",
                 "spectuner_predicted_speedup", "spectuner_last_scrape_age_seconds"):
        assert name not in idle
    assert idle["spectuner_engine_up"] == 0.0 and idle["spectuner_num_speculative_tokens"] == 3
    # Drafts but no per-position counters (α not identifiable): the rates stay, α goes.
    flat = SpecCounters(drafts=10, draft_tokens=30, accepted_tokens=12)
    v = values(engine_samples(snap(spec=flat), cost_ratio=0.05))
    assert "spectuner_alpha" not in v and v["spectuner_draft_acceptance_rate"] == pytest.approx(0.4)


def test_k_of_a_table_and_of_speculation_off() -> None:
    table = SpecConfig("draft_model", "/m/good", 5, ((1, 4, 5), (5, 16, 2), (17, 64, 0)))
    assert table.largest_k() == 5
    assert SpecConfig("off", None, None).largest_k() == 0 and OFF.largest_k() == 0
    assert values(engine_samples(snap(config=table), cost_ratio=0.05))["spectuner_num_speculative_tokens"] == 5
    v = values(engine_samples(snap(config=SpecConfig("ngram", None, 4)), cost_ratio=0.05))
    assert v["spectuner_num_speculative_tokens"] == 4


def test_alpha_of_a_table_is_pooled_over_the_windows_at_their_effective_k() -> None:
    # one config at K_max = 4 under a table: windows drafted 4 and 2 per step (α = 0.8 i.i.d.)
    at4 = SpecCounters(1000, 4000, 800 + 640 + 512 + 410, (800, 640, 512, 410), num_spec_tokens=4)
    at2 = SpecCounters(1000, 2000, 800 + 640, (800, 640, 0, 0), num_spec_tokens=4)
    table = SpecConfig("draft_model", "/m/good", 4, ((1, 4, 4), (5, 16, 2)))
    summed = at4 + at2
    v = values(engine_samples(snap(config=table, spec=summed, window_specs=(at4, at2)), cost_ratio=0.05))
    est = alpha_of_windows([at4, at2])
    assert est.alpha is not None and est.alpha_ci is not None
    assert v["spectuner_alpha"] == pytest.approx(est.alpha) and v["spectuner_alpha"] == pytest.approx(0.8, abs=0.01)
    assert (v["spectuner_alpha_lower"], v["spectuner_alpha_upper"]) == pytest.approx(est.alpha_ci)
    assert estimate_alpha(summed).alpha is None  # the summed counters alone give no α̂ (T/D = 3 ≠ K_max)


def test_overhead_ratio_extremes() -> None:
    perfect = SpecCounters(drafts=10, draft_tokens=30, accepted_tokens=30, accepted_per_pos=(10, 10, 10))
    assert overhead_ratio(perfect, 3, 0.1) == pytest.approx(0.3 / 1.3)  # drafting only
    useless = SpecCounters(drafts=10, draft_tokens=30, accepted_tokens=0, accepted_per_pos=(0, 0, 0))
    assert overhead_ratio(useless, 3, 0.1) == pytest.approx((0.3 + 0.75) / 1.3)
    assert overhead_ratio(SpecCounters(), 3, 0.1) is None


@given(
    d=st.integers(1, 10_000),
    k=st.integers(1, 8),
    frac=st.floats(0, 1),
    c=st.floats(0.001, 2.0),
)
def test_overhead_is_a_share(d: int, k: int, frac: float, c: float) -> None:
    t = d * k
    a = round(t * frac)
    ratio = overhead_ratio(SpecCounters(drafts=d, draft_tokens=t, accepted_tokens=a), k, c)
    assert ratio is not None and 0.0 <= ratio < 1.0


def test_decision_labels_and_event_kinds() -> None:
    assert decision_action("change", "advisory") == "advisory"
    assert decision_action("change", "blocked") == "blocked"
    for status in ("applying", "applied", "verified", "rolled_back", "failed"):
        assert decision_action("change", status) == "apply"
    assert decision_action("pause", "verified") == "pause"
    assert collector_error_kind("collector_error", {"reason": "timeout"}) == "timeout"
    assert collector_error_kind("scrape_stale", {}) == "stale"
    assert collector_error_kind("counter_reset", {}) is None


def test_draft_swaps_are_changes_of_draft_by_our_hand() -> None:
    good, medium = ("draft_model", "/m/good"), ("draft_model", "/m/medium")
    assert is_draft_swap(medium, good, "restart")
    assert is_draft_swap(("ngram", None), good, "manual")
    assert not is_draft_swap(good, good, "restart")  # K change only
    assert not is_draft_swap(medium, good, "observed")  # someone else changed it
    assert not is_draft_swap(None, good, "restart")  # the first config
    assert not is_draft_swap(("off", None), ("off", None), "restart")


def test_counter_samples_put_server_level_counts_on_the_first_engine() -> None:
    totals = CounterTotals()
    totals.add_event(("0", "llama"), "regression_rolled_back", {})
    totals.add_event(("", ""), "collector_error", {"url": KEY.url, "reason": "timeout"})
    totals.add_event(("", ""), "collector_error", {"url": "http://other/metrics", "reason": "timeout"})
    totals.add_decision(("0", "llama"), "change", "blocked", "cooldown")
    totals.add_deliveries(("0", "llama"), "hook", "delivered", 3)
    other = EngineKey(KEY.url, "llama", "1")
    out = {(s.name, tuple(sorted(s.labels))): s.value for s in totals.samples([other, KEY])}
    errors = [v for (name, labels), v in out.items() if name == "spectuner_collector_errors_total"]
    assert errors == [1]  # once per server (the other server is not shown), on its first engine series:
    assert out[("spectuner_collector_errors_total", (("engine", "0"), ("kind", "timeout"), ("model_name", "llama")))]
    for e in ("0", "1"):
        assert ("spectuner_draft_swaps_total", (("engine", e), ("model_name", "llama"))) in out  # zero from the start
    assert out[("spectuner_rollbacks_total", (("engine", "0"), ("model_name", "llama")))] == 1
    assert out[("spectuner_rollbacks_total", (("engine", "1"), ("model_name", "llama")))] == 0
    key = ("spectuner_alert_deliveries_total",
           (("engine", "0"), ("model_name", "llama"), ("outcome", "delivered"), ("sink", "hook")))
    assert out[key] == 3


def test_prometheus_exposition_of_fixed_samples() -> None:
    samples = [
        Sample("spectuner_alpha", (("engine", "0"), ("model_name", "llama")), 0.75),
        Sample("spectuner_decisions_total",
               (("engine", "0"), ("model_name", "llama"), ("action", "apply"), ("reason", "change_k")), 2.0),
    ]
    exporter = PrometheusExporter(lambda: samples)
    text = generate_latest(exporter.registry).decode()
    assert 'spectuner_alpha{engine="0",model_name="llama"} 0.75' in text
    assert 'spectuner_decisions_total{action="apply",engine="0",model_name="llama",reason="change_k"} 2.0' in text
    assert "# TYPE spectuner_engine_up gauge" in text  # described even with no sample


def test_apply_events_carry_their_client_impact_into_counters() -> None:
    from tuner.exporters.values import METRICS, CounterTotals

    totals = CounterTotals()
    labels = ("0", "m")
    data = {"strategy": "drain_hold", "requests_held": 4, "requests_failed": 0, "longest_hold_s": 33.2}
    totals.add_event(labels, "draft_swapped", data)
    totals.add_event(labels, "draft_swapped", {**data, "requests_held": 2, "longest_hold_s": 20.0})
    totals.add_event(labels, "k_changed", {"status": "applied"})  # no impact: counted nowhere
    samples = {(s.name, s.labels[-1][1]): s.value for s in totals.samples([]) if s.name.startswith("spectuner_apply")}
    assert samples == {
        ("spectuner_apply_requests_held_total", "drain_hold"): 6.0,
        ("spectuner_apply_requests_failed_total", "drain_hold"): 0.0,
        ("spectuner_apply_longest_hold_seconds", "drain_hold"): 20.0,
    }
    assert all(name in METRICS for name, _ in samples)


def test_context_length_gauges_carry_each_usable_band_the_collapse_and_the_cutoff() -> None:
    """α̂ per length band (bands with too few draft tokens left out), the collapse flag and the cut-off, from
    the same view ``spectuner status`` shows; nothing at all without request records."""
    from policies.length_bands import length_view
    from tests.unit.policies.test_length_bands import request

    rng = np.random.default_rng(0)
    plan = [(600, 0.8), (1500, 0.8), (3000, 0.7), (6000, 0.55), (12000, 0.4), (20000, 0.2), (40000, 0.15)]
    view = length_view([request(rng, p, a) for p, a in plan for _ in range(30)])
    assert view.collapse and view.cutoff_tokens == 16384
    samples = engine_samples(snap(lengths=view), cost_ratio=0.05)
    bands = {dict(s.labels)["band"]: s.value for s in samples if s.name == "spectuner_alpha_by_context_length"}
    usable = [b for b in view.bands if b.evidence.trials >= view.settings.min_trials]
    assert len(bands) == len(usable) >= 5
    assert bands["16384-32768"] == pytest.approx(next(b.alpha for b in usable if b.lo_tokens == 16384))
    flat = values(samples)
    assert flat["spectuner_context_length_collapse"] == 1.0
    assert flat["spectuner_speculation_cutoff_context_tokens"] == 16384.0
    quiet = values(engine_samples(snap(), cost_ratio=0.05))
    assert "spectuner_context_length_collapse" not in quiet and "spectuner_alpha_by_context_length" not in quiet


def test_fleet_gauges_carry_each_group_its_engines_and_the_outlier() -> None:
    """Per group: the pooled α̂ with its √φ-widened interval, φ, engines and pending changes, labelled by
    (target, method, draft, config); per engine its α̂ and an outlier flag (1 only for the far one). Every
    family's exposition has exactly the labels the metric table declares."""
    from bench.research.simulate import simulate_counters
    from policies.fleet import EngineWindows, GroupKey, group_fleet
    from tuner.exporters.values import GROUP_ENGINE_LABELS, GROUP_LABELS, METRICS, FleetSnapshot, fleet_samples

    rng = np.random.default_rng(5)
    config = SpecConfig("draft_model", "/m/good", 3)
    truths = {"a": 0.72, "b": 0.70, "c": 0.71, "d": 0.40}
    members = [
        EngineWindows(f"http://{n}:8000/metrics#0", "llama", config,
                      tuple(simulate_counters(rng, alpha, 3, 400) for _ in range(6)))
        for n, alpha in truths.items()
    ]
    members.append(EngineWindows("http://e:8000/metrics#0", "llama", SpecConfig("ngram", None, 2), ()))
    groups = group_fleet(members)
    keys = {m.engine: EngineKey(m.engine.split("#")[0], "llama", "0") for m in members}
    out = fleet_samples(FleetSnapshot(groups, keys, {GroupKey.of(members[0]): 2}))

    big, idle = groups
    assert big.alpha is not None and big.alpha_ci is not None
    group = {"model_name": "llama", "method": "draft_model", "draft": "/m/good", "config": config.fingerprint}
    got = {(s.name, tuple(sorted(s.labels))): s.value for s in out}

    def at(name: str, labels: dict[str, str]) -> float:
        return got[(name, tuple(sorted(labels.items())))]

    assert at("spectuner_fleet_group_alpha", group) == pytest.approx(big.alpha)
    assert at("spectuner_fleet_group_alpha_lower", group) == pytest.approx(big.alpha_ci[0])
    assert at("spectuner_fleet_group_alpha_upper", group) == pytest.approx(big.alpha_ci[1])
    assert at("spectuner_fleet_group_dispersion", group) == pytest.approx(big.dispersion.dispersion)
    assert at("spectuner_fleet_group_engines", group) == 4
    assert at("spectuner_fleet_group_pending_changes", group) == 2
    flags = {dict(s.labels)["metrics_url"]: s.value for s in out if s.name == "spectuner_fleet_outlier"}
    assert flags == {"http://a:8000/metrics": 0, "http://b:8000/metrics": 0, "http://c:8000/metrics": 0,
                     "http://d:8000/metrics": 1, "http://e:8000/metrics": 0}
    d = {**group, "metrics_url": "http://d:8000/metrics", "engine": "0"}
    assert at("spectuner_fleet_engine_alpha", d) == pytest.approx(big.engines[3].estimate.alpha)
    # the ngram engine without windows: its group is counted, its α̂ left out (no false 0)
    ngram = {"model_name": "llama", "method": "ngram", "draft": "", "config": idle.key.fingerprint}
    assert at("spectuner_fleet_group_engines", ngram) == 1 and at("spectuner_fleet_group_pending_changes", ngram) == 0
    assert not [s for s in out if s.name.startswith("spectuner_fleet_group_alpha") and dict(s.labels) == ngram]
    for s in out:
        want = GROUP_LABELS if s.name.startswith("spectuner_fleet_group_") else GROUP_ENGINE_LABELS
        assert METRICS[s.name].labels == want and tuple(k for k, _ in s.labels) == want

    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(PrometheusExporter(lambda: out).registry).decode()
    scraped = {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for family in text_string_to_metric_families(text)
        for x in family.samples
    }
    assert scraped[("spectuner_fleet_outlier", tuple(sorted(d.items())))] == 1.0  # the JSON config survives
    assert scraped[("spectuner_fleet_group_engines", tuple(sorted(group.items())))] == 4
