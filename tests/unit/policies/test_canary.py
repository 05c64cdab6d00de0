"""Canary judgement: Mann–Whitney U per metric, Hodges–Lehmann effect, same-time cut, Kayenta verdict.

The drifting-load cases pit the canary judgement against the before/after judgement the controller uses
on a single engine (``tuner.controller.verify.judge``) on the very same simulated fleet: load drifts
through the hour, so before/after blames (or credits) the change for the drift; the same-time comparison
against untouched replicas does not.
"""

from __future__ import annotations

import numpy as np
import pytest

from policies.canary import (
    DEFAULT_METRICS,
    ERROR_RATE,
    GOODPUT,
    CanaryDecision,
    CanarySettings,
    Direction,
    MetricOutcome,
    MetricSamples,
    MetricSpec,
    hodges_lehmann,
    judge_canary,
    same_time_span,
)
from tuner.controller.verify import VerifyReason, judge

MINUTE_S = 60.0
CHANGE_AT_MIN = 30


def _fleet(
    rng: np.random.Generator,
    *,
    goodput_effect: float = 1.0,
    ttft_effect: float = 1.0,
    load_drift: float = 0.0,
    minutes: int = 60,
    baseline_replicas: int = 3,
) -> tuple[dict[str, MetricSamples], list[float], list[float]]:
    """Per-minute samples: the canary replica changed at minute 30, the others never. ``load_drift``: the
    relative change of the load over the hour (+0.5: 50 % more at the end), which every replica feels at
    the same minute. Returns the same-time samples and the canary replica's goodput before/after."""
    load = 1.0 + load_drift * np.arange(minutes) / minutes

    def replica(changed: bool) -> dict[str, list[tuple[float, float]]]:
        effect = np.where(np.arange(minutes) >= CHANGE_AT_MIN, 1.0, 1.0) if not changed else None
        after = np.arange(minutes) >= CHANGE_AT_MIN
        g_eff = np.where(after, goodput_effect, 1.0) if changed else effect
        t_eff = np.where(after, ttft_effect, 1.0) if changed else effect
        assert g_eff is not None and t_eff is not None
        noise = lambda sd: rng.lognormal(0.0, sd, minutes)  # noqa: E731
        goodput = 900.0 * load * g_eff * noise(0.03)  # tokens/s per engine-second rise with the batch
        ttft = 0.4 * load**2 * t_eff * noise(0.08)
        tpot = 0.02 * load * noise(0.05)
        errors = rng.binomial(2000, 0.0002, minutes) / 2000
        times = np.arange(minutes) * MINUTE_S
        return {
            GOODPUT.name: list(zip(times, goodput, strict=True)),
            "ttft_p99_s": list(zip(times, ttft, strict=True)),
            "tpot_p99_s": list(zip(times, tpot, strict=True)),
            ERROR_RATE.name: list(zip(times, errors, strict=True)),
        }

    canary = replica(True)
    others = [replica(False) for _ in range(baseline_replicas)]
    samples = {
        name: MetricSamples(
            canary=[s for s in canary[name] if s[0] >= CHANGE_AT_MIN * MINUTE_S],
            baseline=[s for o in others for s in o[name]],  # the whole hour: the judge cuts it
        )
        for name in canary
    }
    before = [v for t, v in canary[GOODPUT.name] if t < CHANGE_AT_MIN * MINUTE_S]
    after = [v for t, v in canary[GOODPUT.name] if t >= CHANGE_AT_MIN * MINUTE_S]
    return samples, before, after


def test_better_change_under_falling_load_is_promoted_where_before_after_rolls_it_back() -> None:
    rng = np.random.default_rng(1)
    samples, before, after = _fleet(rng, goodput_effect=1.08, load_drift=-0.4)
    verdict = judge_canary(samples)
    assert verdict.decision is CanaryDecision.PROMOTE, verdict.reason
    goodput = verdict.metrics[0]
    assert goodput.improved and goodput.shift is not None and goodput.shift > 0
    assert "goodput_tokens_per_engine_s" in verdict.reason  # "Better on …"
    # the before/after judge on the canary replica alone blames the change for the falling load
    assert judge(before, after).reason is VerifyReason.REGRESSED


def test_worse_change_under_rising_load_is_rolled_back_where_before_after_credits_it() -> None:
    rng = np.random.default_rng(2)
    samples, before, after = _fleet(rng, goodput_effect=0.85, load_drift=0.6)
    verdict = judge_canary(samples)
    assert verdict.decision is CanaryDecision.ROLLBACK
    failed = [m.name for m in verdict.metrics if m.outcome is MetricOutcome.FAIL]
    assert failed == [GOODPUT.name]
    assert verdict.reason.startswith("critical metric failed: goodput_tokens_per_engine_s")
    assert judge(before, after).reason is VerifyReason.IMPROVED


def test_a_worse_tail_latency_alone_fails_the_canary() -> None:
    rng = np.random.default_rng(3)
    samples, _, _ = _fleet(rng, ttft_effect=1.5, load_drift=0.3)
    verdict = judge_canary(samples)
    assert verdict.decision is CanaryDecision.ROLLBACK
    by_name = {m.name: m for m in verdict.metrics}
    assert by_name["ttft_p99_s"].outcome is MetricOutcome.FAIL
    assert by_name[GOODPUT.name].outcome is MetricOutcome.PASS


def test_verdicts_over_many_changes_on_drifting_load() -> None:
    """Wrong verdicts per 40 changes of each kind: same-time canary vs before/after, same fleets."""
    rng = np.random.default_rng(4)
    wrong_canary = wrong_before_after = 0
    for i in range(40):
        drift = float(rng.uniform(-0.5, 0.5))
        truly_better = i % 2 == 0
        samples, before, after = _fleet(rng, goodput_effect=1.10 if truly_better else 0.88, load_drift=drift)
        verdict = judge_canary(samples, final=True)
        wrong_canary += verdict.decision is not (CanaryDecision.PROMOTE if truly_better else CanaryDecision.ROLLBACK)
        rolled_back = judge(before, after).rollback
        wrong_before_after += rolled_back == truly_better
    assert wrong_canary <= 2
    assert wrong_before_after >= 6  # 10 with this seed: a quarter of the verdicts follow the drift


def test_no_change_is_rarely_rolled_back() -> None:
    rng = np.random.default_rng(5)
    rollbacks = sum(
        judge_canary(_fleet(rng, load_drift=float(rng.uniform(-0.5, 0.5)))[0]).decision is CanaryDecision.ROLLBACK
        for _ in range(40)
    )
    assert rollbacks <= 2


def test_too_few_samples_wait_then_roll_back_when_time_is_up() -> None:
    rng = np.random.default_rng(6)
    samples, _, _ = _fleet(rng, minutes=CHANGE_AT_MIN + 3)  # three canary minutes
    verdict = judge_canary(samples)
    assert verdict.decision is CanaryDecision.UNDECIDED
    assert verdict.reason.startswith("need more data")
    assert all(m.outcome is MetricOutcome.NO_DATA for m in verdict.metrics)
    final = judge_canary(samples, final=True)
    assert final.decision is CanaryDecision.ROLLBACK and "time is up" in final.reason


def test_baseline_outside_the_canary_minutes_is_ignored() -> None:
    canary = [(t * MINUTE_S, 100.0 + (t % 3)) for t in range(30, 40)]
    baseline_then = [(t * MINUTE_S, 10.0) for t in range(0, 30)]  # a different load long before
    baseline_now = [(t * MINUTE_S, 100.0 + ((t + 1) % 3)) for t in range(30, 40)]
    samples = {GOODPUT.name: MetricSamples(canary, baseline_then + baseline_now)}
    assert same_time_span(samples) == (30 * MINUTE_S, 39 * MINUTE_S)
    verdict = judge_canary(samples, (GOODPUT,))
    (m,) = verdict.metrics
    assert m.baseline_n == 10 and m.canary_n == 10
    assert m.outcome is MetricOutcome.PASS and not m.improved
    assert verdict.decision is CanaryDecision.PROMOTE


def test_no_overlap_is_no_data() -> None:
    samples = {GOODPUT.name: MetricSamples([(100.0 + t, 1.0) for t in range(10)], [(t, 1.0) for t in range(10)])}
    assert same_time_span(samples) is None
    assert judge_canary(samples, (GOODPUT,)).decision is CanaryDecision.UNDECIDED


def test_an_error_rate_of_zero_everywhere_passes() -> None:
    zeros = [(float(t), 0.0) for t in range(10)]
    verdict = judge_canary({ERROR_RATE.name: MetricSamples(zeros, zeros * 3)}, (ERROR_RATE,))
    (m,) = verdict.metrics
    assert m.outcome is MetricOutcome.PASS and m.p_value == 1.0 and m.shift == 0.0
    assert verdict.decision is CanaryDecision.PROMOTE


def test_errors_on_the_canary_fail_it_by_the_absolute_tolerance() -> None:
    base = [(float(t), 0.0) for t in range(20)]
    canary = [(float(t), 0.01 if t % 2 else 0.02) for t in range(20)]
    verdict = judge_canary({ERROR_RATE.name: MetricSamples(canary, base)}, (ERROR_RATE,))
    assert verdict.metrics[0].outcome is MetricOutcome.FAIL
    assert verdict.metrics[0].allowed_harm == pytest.approx(0.001)
    assert verdict.decision is CanaryDecision.ROLLBACK


def test_a_non_critical_metric_lowers_the_score_only() -> None:
    rng = np.random.default_rng(7)
    samples, _, _ = _fleet(rng, ttft_effect=1.5)
    soft_ttft = tuple(
        MetricSpec(m.name, m.direction, critical=False, tolerance_rel=m.tolerance_rel) if m.name == "ttft_p99_s" else m
        for m in DEFAULT_METRICS
    )
    verdict = judge_canary(samples, soft_ttft)
    assert verdict.score == pytest.approx(0.75)
    assert verdict.decision is CanaryDecision.PROMOTE
    strict = judge_canary(samples, soft_ttft, CanarySettings(pass_score=1.0))
    assert strict.decision is CanaryDecision.ROLLBACK and "score 0.75" in strict.reason


def test_hodges_lehmann_by_hand_and_its_coverage() -> None:
    shift, (lo, hi) = hodges_lehmann([3.0, 5.0, 7.0], [1.0, 2.0])
    # differences: 2 1 4 3 6 5 → sorted 1 2 3 4 5 6, median 3.5; tiny samples: the interval is their range
    assert shift == pytest.approx(3.5) and (lo, hi) == (1.0, 6.0)
    rng = np.random.default_rng(8)
    covered = 0
    for _ in range(300):
        a, b = rng.normal(0.7, 1.0, 25), rng.normal(0.0, 1.0, 40)
        _, (lo, hi) = hodges_lehmann(list(a), list(b), 0.9)
        covered += lo <= 0.7 <= hi
    assert 0.85 <= covered / 300 <= 0.96


def test_directions_turn_the_shift_into_harm() -> None:
    lower = MetricSpec("latency_s", Direction.LOWER_IS_BETTER, tolerance_rel=0.05)
    up = [(float(t), 2.0 + 0.01 * (t % 5)) for t in range(20)]
    down = [(float(t), 1.0 + 0.01 * (t % 5)) for t in range(20)]
    worse = judge_canary({"latency_s": MetricSamples(up, down)}, (lower,)).metrics[0]
    assert worse.harm is not None and worse.harm > 0 and worse.outcome is MetricOutcome.FAIL
    better = judge_canary({"latency_s": MetricSamples(down, up)}, (lower,)).metrics[0]
    assert better.harm is not None and better.harm < 0 and better.improved


def test_bad_calls_are_refused() -> None:
    with pytest.raises(ValueError, match="no MetricSpec"):
        judge_canary({"nope": MetricSamples([], [])})
    with pytest.raises(ValueError, match="judged once"):
        judge_canary({}, (GOODPUT, GOODPUT))
    with pytest.raises(ValueError, match="min_samples"):
        CanarySettings(min_samples=1)
    with pytest.raises(ValueError, match="tolerance_rel"):
        MetricSpec("x", Direction.HIGHER_IS_BETTER, tolerance_rel=-1.0)
    with pytest.raises(ValueError, match="both sides"):
        hodges_lehmann([], [1.0])
    assert judge_canary({}, ()).decision is CanaryDecision.UNDECIDED


def test_levelling_by_time_recovers_the_power_drift_takes_away() -> None:
    rng = np.random.default_rng(9)
    samples, _, _ = _fleet(rng, load_drift=0.5)
    raw = judge_canary(samples, settings=CanarySettings(bucket_s=0.0)).metrics[0]
    levelled = judge_canary(samples).metrics[0]
    assert raw.shift_ci is not None and levelled.shift_ci is not None
    # the drift spreads both sides' raw samples: a far wider interval on the same data
    assert (raw.shift_ci[1] - raw.shift_ci[0]) > 1.5 * (levelled.shift_ci[1] - levelled.shift_ci[0])
    assert "raw samples" in raw.reason and "levelled by time bucket" in levelled.reason


def test_one_untouched_replica_compares_raw_same_time_samples() -> None:
    rng = np.random.default_rng(10)
    samples, _, _ = _fleet(rng, goodput_effect=0.8, load_drift=0.1, baseline_replicas=1)
    verdict = judge_canary(samples)
    assert verdict.decision is CanaryDecision.ROLLBACK
    assert "raw samples" in verdict.metrics[0].reason
