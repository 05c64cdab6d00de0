"""Window deltas between two samples of one engine, restarts as resets, latency summaries."""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from collectors.exposition import E2E_LATENCY, parse_metrics_page
from collectors.histogram import histogram_delta, quantile, summarize
from collectors.records import EngineSample
from collectors.window import detect_reset, since_start, window_between
from policies.counters import SpecCounters

DATA = Path(__file__).resolve().parents[2] / "data"
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
T1 = T0 + timedelta(seconds=10)


def samples(name: str, ts: datetime) -> list[EngineSample]:
    return parse_metrics_page((DATA / name).read_text(), url="http://e/metrics", ts=ts)


def test_window_is_the_difference_of_the_two_pages() -> None:
    before, after = samples("synthetic_dp2_k3_a.prom", T0), samples("synthetic_dp2_k3_b.prom", T1)
    for prev, cur in zip(before, after, strict=True):
        window, events = window_between(prev, cur)
        assert events == []
        assert not window.reset
        assert (window.start, window.end, window.duration_s) == (T0, T1, 10.0)
        assert prev.spec is not None and cur.spec is not None and window.spec is not None
        assert window.spec.drafts == cur.spec.drafts - prev.spec.drafts > 0
        assert window.spec.draft_tokens == cur.spec.draft_tokens - prev.spec.draft_tokens
        assert window.spec.accepted_tokens == cur.spec.accepted_tokens - prev.spec.accepted_tokens
        assert window.spec.accepted_per_pos == tuple(
            c - p for p, c in zip(prev.spec.accepted_per_pos, cur.spec.accepted_per_pos, strict=True)
        )
        assert window.generation_tokens == cur.generation_tokens - prev.generation_tokens
        assert window.spec.generated_tokens == window.generation_tokens
        assert window.prompt_tokens == cur.prompt_tokens - prev.prompt_tokens
        assert window.requests_running == cur.requests_running
        assert window.e2e_latency is not None
        assert window.e2e_latency.count == cur.histograms[E2E_LATENCY][1] - prev.histograms[E2E_LATENCY][1] == 60
        assert window.ttft is not None and window.itl is not None


def test_windows_add_up_to_the_totals() -> None:
    a, b = samples("synthetic_dp2_k3_a.prom", T0), samples("synthetic_dp2_k3_b.prom", T1)
    for first, second in zip(a, b, strict=True):
        start = since_start(first)
        window, _ = window_between(first, second)
        assert start.spec is not None and window.spec is not None and second.spec is not None
        assert start.spec + window.spec == second.spec
        assert start.start == datetime.fromtimestamp(1_765_000_000, UTC)


def test_restart_with_new_created_time_is_a_reset_with_an_event() -> None:
    before = samples("synthetic_dp2_k3_b.prom", T0)
    after = samples("synthetic_dp2_k3_restarted.prom", T1)
    for prev, cur in zip(before, after, strict=True):
        window, events = window_between(prev, cur)
        assert window.reset
        assert window.spec == cur.spec  # delta is the new value: counts since the restart
        assert window.generation_tokens == cur.generation_tokens
        (event,) = events
        assert event.kind == "counter_reset"
        assert event.engine == cur.key
        assert event.severity == "warning"
        assert event.data["cause"] == "created_changed"
        assert "restarted" in event.message


def test_a_counter_that_goes_down_is_a_reset_even_without_created_times() -> None:
    prev, cur = samples("synthetic_dp2_k3_b.prom", T0)[0], samples("synthetic_dp2_k3_a.prom", T1)[0]
    prev, cur = replace(prev, created_s=None), replace(cur, created_s=None)
    window, events = window_between(prev, cur)
    assert window.reset and window.spec == cur.spec
    assert events[0].data["cause"] == "counter_decreased"
    assert "went down" in events[0].data["detail"]


def test_restart_time_inside_the_window_starts_the_window() -> None:
    prev = samples("synthetic_dp2_k3_b.prom", T0)[0]
    restart = T0 + timedelta(seconds=4)
    cur = replace(samples("synthetic_dp2_k3_restarted.prom", T1)[0], created_s=restart.timestamp())
    window, _ = window_between(prev, cur)
    assert window.reset and window.start == restart and window.end == T1


@pytest.mark.parametrize("change", ["spec_off", "spec_on", "k_changed"])
def test_a_changed_speculative_config_is_a_restart(change: str) -> None:
    base = samples("synthetic_dp2_k3_a.prom", T0)[0]
    grown = samples("synthetic_dp2_k3_b.prom", T1)[0]
    assert base.spec is not None and grown.spec is not None
    if change == "spec_off":
        prev, cur = base, replace(grown, spec=None)
    elif change == "spec_on":
        prev, cur = replace(base, spec=None), grown
    else:
        prev, cur = (
            base,
            replace(grown, spec=replace(grown.spec, accepted_per_pos=(*grown.spec.accepted_per_pos, 0))),
        )
    prev, cur = replace(prev, created_s=None), replace(cur, created_s=None)
    cause = detect_reset(prev, cur)
    assert cause is not None and cause.kind == "spec_config_changed"
    window, events = window_between(prev, cur)
    assert window.reset and window.spec == cur.spec and len(events) == 1


def test_deltas_are_never_negative_whatever_the_order() -> None:
    pages = ["synthetic_dp2_k3_a.prom", "synthetic_dp2_k3_b.prom", "synthetic_dp2_k3_restarted.prom"]
    loaded = [samples(p, T0)[0] for p in pages]
    for prev in loaded:
        for cur in loaded:
            window, _ = window_between(prev, replace(cur, ts=T1))
            assert window.generation_tokens >= 0 and window.prompt_tokens >= 0
            assert window.spec is not None
            assert min(window.spec.drafts, window.spec.draft_tokens, window.spec.accepted_tokens) >= 0
            assert min(window.spec.accepted_per_pos) >= 0
            for summary in (window.e2e_latency, window.ttft, window.itl):
                assert summary is not None and summary.count >= 0 and summary.sum_s >= 0


def test_samples_of_different_engines_are_refused() -> None:
    a, b = samples("synthetic_dp2_k3_a.prom", T0)
    with pytest.raises(ValueError, match="different engines"):
        window_between(a, b)


def test_idle_window_has_zero_counts_and_no_latency_quantiles() -> None:
    s = samples("synthetic_k5.prom", T0)[0]
    window, events = window_between(s, replace(s, ts=T1))
    assert events == [] and not window.reset
    assert window.spec == SpecCounters(accepted_per_pos=(0, 0, 0, 0, 0))
    assert window.e2e_latency is not None and window.e2e_latency.count == 0
    assert window.e2e_latency.p50_s is None


# --- histograms -----------------------------------------------------------------------------------

BUCKETS = ((0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (math.inf, 40.0))


def test_quantile_interpolates_inside_the_bucket_like_promql() -> None:
    assert quantile(0.25, BUCKETS) == pytest.approx(0.1)  # rank 10 = top of the first bucket
    assert quantile(0.5, BUCKETS) == pytest.approx(0.1 + 0.4 * (20 - 10) / 20)
    assert quantile(1.0, BUCKETS) == pytest.approx(1.0)
    assert quantile(0.0, BUCKETS) == pytest.approx(0.0)


def test_quantile_in_the_inf_bucket_is_the_last_finite_bound() -> None:
    assert quantile(0.99, ((0.1, 1.0), (1.0, 2.0), (math.inf, 10.0))) == 1.0


def test_quantile_without_observations_is_none_and_bad_q_is_refused() -> None:
    assert quantile(0.5, ((1.0, 0.0), (math.inf, 0.0))) is None
    assert quantile(0.5, ()) is None
    with pytest.raises(ValueError, match=r"got 1\.5"):
        quantile(1.5, BUCKETS)


def test_histogram_delta_and_summary() -> None:
    prev = (((0.1, 5.0), (1.0, 10.0), (math.inf, 10.0)), 10.0, 3.0)
    cur = (((0.1, 7.0), (1.0, 20.0), (math.inf, 21.0)), 21.0, 9.5)
    delta = histogram_delta(prev, cur)
    assert delta == (((0.1, 2.0), (1.0, 10.0), (math.inf, 11.0)), 11.0, 6.5)
    summary = summarize(delta)
    assert summary is not None and summary.count == 11.0 and summary.sum_s == 6.5
    assert summary.p50_s is not None and 0.1 < summary.p50_s <= 1.0
    assert histogram_delta(cur, prev) is None  # went down: a reset, not a negative delta
    assert histogram_delta(prev, (((0.2, 5.0), (math.inf, 10.0)), 10.0, 3.0)) is None  # other buckets


def _have(*names: str) -> bool:
    return all((DATA / n).exists() for n in names)


@pytest.mark.skipif(
    not _have("lab_good_k3_loaded.prom", "lab_good_k3_loaded_more.prom", "lab_good_k3_restarted.prom"),
    reason="real lab pages not saved (tests/data/save_lab_pages.py)",
)
def test_real_engine_pages_delta_and_restart() -> None:
    (loaded,) = samples("lab_good_k3_loaded.prom", T0)
    (more,) = samples("lab_good_k3_loaded_more.prom", T1)
    (restarted,) = samples("lab_good_k3_restarted.prom", T1 + timedelta(seconds=60))
    window, events = window_between(loaded, more)
    assert not window.reset and events == []
    assert loaded.spec is not None and more.spec is not None and window.spec is not None
    assert window.spec.drafts == more.spec.drafts - loaded.spec.drafts > 0
    assert window.generation_tokens == more.generation_tokens - loaded.generation_tokens
    assert window.e2e_latency is not None and window.e2e_latency.count > 0
    assert window.e2e_latency.p50_s is not None and window.e2e_latency.p50_s > 0
    assert more.cache_config, "vllm:cache_config_info is captured"
    window, events = window_between(replace(more, ts=T1), restarted)
    assert window.reset and window.spec == restarted.spec
    assert events[0].data["cause"] == "created_changed"
