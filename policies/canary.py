"""Canary judgement: the changed replica against the untouched ones over the same minutes. Pure: no I/O.

Replicas behind one router see the same load and the same prompt mix at the same time, so a same-time
comparison cancels the drift that fools a before/after comparison (load rising through the evaluation
window, prompts turning hard). The judgement follows Kayenta: each metric is compared on its own, as
samples (one per engine per interval, e.g. per minute) from the canary against samples from the
untouched replicas, restricted to the time span both sides cover.

Per metric:

- the Mann–Whitney U test (two-sided): does the canary's distribution differ at all;
- the effect: the Hodges–Lehmann shift (median of all canary − baseline differences) with its
  distribution-free confidence interval (Moses: the order statistics of the pairwise differences cut at
  the U test's normal critical value), expressed as *harm* (how much worse the canary is, in the metric's
  unit; negative harm is an improvement);
- the allowed harm: the larger of ``tolerance_abs`` and ``tolerance_rel`` × |baseline median|;
- FAIL when the U test rejects, the whole interval lies on the harmful side (lower end > 0) and the
  point harm exceeds the allowed harm; PASS (non-inferior) when even the upper end of the harm interval
  is within the allowed harm; INCONCLUSIVE otherwise; NO_DATA below ``min_samples`` on a side.

Same-time levelling (``bucket_s`` > 0, the default): drift inflates both sides' spread, which costs the
U test its power over a long canary. Each sample is therefore read against the untouched replicas' mean
in its own time bucket (for an untouched replica's sample, the mean of the *other* untouched samples in
the bucket, so its residual carries the replica-to-replica noise a canary's does), and the U test and
the shift are taken on those residuals; the shift stays in the metric's unit. Buckets need two untouched
samples; with a single untouched replica the raw same-time samples are compared instead (and the
judgement says so).

The verdict: a critical metric that FAILs rolls back. A critical metric not yet PASSing leaves the canary
UNDECIDED (it needs more minutes) — or rolls back when ``final`` (the canary's time is up: a change that
could not be shown safe is not spread). With every critical metric PASSing, the Kayenta score (share of
metrics that PASS) promotes at ≥ ``pass_score`` and rolls back below it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
from scipy import stats


class Direction(StrEnum):
    HIGHER_IS_BETTER = "higher_is_better"
    LOWER_IS_BETTER = "lower_is_better"


@dataclass(frozen=True)
class MetricSpec:
    """One judged metric: its direction, whether it alone can fail the canary, and its tolerance."""

    name: str
    direction: Direction
    critical: bool = True
    tolerance_rel: float = 0.0  # allowed harm as a share of the baseline median
    tolerance_abs: float = 0.0  # allowed harm in the metric's own unit (a floor, for medians near 0)

    def __post_init__(self) -> None:
        for name in ("tolerance_rel", "tolerance_abs"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"metric {self.name}: {name} must be a finite number ≥ 0 but got {value!r}")


# The four: goodput per engine-second, TTFT and TPOT p99, error rate. All critical.
GOODPUT = MetricSpec("goodput_tokens_per_engine_s", Direction.HIGHER_IS_BETTER, tolerance_rel=0.02)
TTFT_P99 = MetricSpec("ttft_p99_s", Direction.LOWER_IS_BETTER, tolerance_rel=0.10)
TPOT_P99 = MetricSpec("tpot_p99_s", Direction.LOWER_IS_BETTER, tolerance_rel=0.10)
ERROR_RATE = MetricSpec("error_rate", Direction.LOWER_IS_BETTER, tolerance_abs=0.001)
DEFAULT_METRICS = (GOODPUT, TTFT_P99, TPOT_P99, ERROR_RATE)


@dataclass(frozen=True)
class CanarySettings:
    confidence: float = 0.95  # of the Hodges–Lehmann interval
    significance: float = 0.05  # of the Mann–Whitney U test, per metric
    min_samples: int = 5  # per side, after the same-time cut
    pass_score: float = 0.75  # Kayenta score (share of metrics passing) needed to promote
    bucket_s: float = 60.0  # same-time levelling buckets; 0 compares the raw same-time samples

    def __post_init__(self) -> None:
        checks = (
            ("confidence", 0.0 < self.confidence < 1.0),
            ("significance", 0.0 < self.significance < 1.0),
            ("min_samples", self.min_samples >= 2),
            ("pass_score", 0.0 <= self.pass_score <= 1.0),
            ("bucket_s", self.bucket_s >= 0.0 and math.isfinite(self.bucket_s)),
        )
        for name, ok in checks:
            if not ok:
                raise ValueError(f"canary setting {name} = {getattr(self, name)!r} is out of range")


Sample = tuple[float, float]  # (time in seconds on any common clock, value)


@dataclass(frozen=True)
class MetricSamples:
    """One metric's samples: the canary's, and the untouched replicas' pooled."""

    canary: Sequence[Sample]
    baseline: Sequence[Sample]


class MetricOutcome(StrEnum):
    PASS = "pass"  # non-inferior: even the worst end of the interval is within tolerance
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"
    NO_DATA = "no_data"


@dataclass(frozen=True)
class MetricJudgement:
    name: str
    outcome: MetricOutcome
    critical: bool
    canary_n: int
    baseline_n: int
    p_value: float | None  # Mann–Whitney U, two-sided
    shift: float | None  # Hodges–Lehmann: canary − baseline, in the metric's unit
    shift_ci: tuple[float, float] | None
    harm: float | None  # the shift turned so that positive is worse for this metric
    harm_ci: tuple[float, float] | None
    allowed_harm: float | None
    baseline_median: float | None
    improved: bool  # significantly better: the whole interval on the good side
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "outcome": self.outcome.value,
            "critical": self.critical,
            "canary_n": self.canary_n,
            "baseline_n": self.baseline_n,
            "p_value": self.p_value,
            "shift": self.shift,
            "shift_ci": list(self.shift_ci) if self.shift_ci else None,
            "harm": self.harm,
            "allowed_harm": self.allowed_harm,
            "baseline_median": self.baseline_median,
            "improved": self.improved,
            "reason": self.reason,
        }


class CanaryDecision(StrEnum):
    PROMOTE = "promote"
    ROLLBACK = "rollback"
    UNDECIDED = "undecided"  # needs more data: keep the canary running


@dataclass(frozen=True)
class CanaryVerdict:
    decision: CanaryDecision
    score: float  # share of judged metrics that PASS
    metrics: tuple[MetricJudgement, ...]
    span_s: tuple[float, float] | None  # the same-time span both sides were cut to
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "decision": self.decision.value,
            "score": self.score,
            "span_s": list(self.span_s) if self.span_s else None,
            "reason": self.reason,
            "metrics": [m.to_dict() for m in self.metrics],
        }


def same_time_span(samples: Mapping[str, MetricSamples]) -> tuple[float, float] | None:
    """The span every side of every metric covers: [latest first sample, earliest last sample]."""
    sides = [side for s in samples.values() for side in (s.canary, s.baseline) if side]
    if not sides:
        return None
    lo = max(min(t for t, _ in side) for side in sides)
    hi = min(max(t for t, _ in side) for side in sides)
    return (lo, hi) if lo <= hi else None


def hodges_lehmann(
    canary: Sequence[float], baseline: Sequence[float], confidence: float = 0.95
) -> tuple[float, tuple[float, float]]:
    """Median of the pairwise differences canary − baseline, with Moses' distribution-free interval."""
    if not canary or not baseline:
        raise ValueError("the Hodges–Lehmann shift needs samples on both sides")
    diffs = np.sort(np.subtract.outer(np.asarray(canary, float), np.asarray(baseline, float)).ravel())
    n, m = len(canary), len(baseline)
    z = float(stats.norm.ppf(0.5 + confidence / 2.0))
    # Hollander & Wolfe: the C-th smallest and C-th largest differences, C = U's critical value (≥ 1)
    c = max(math.floor(n * m / 2.0 - z * math.sqrt(n * m * (n + m + 1) / 12.0)), 1)
    lo, hi = float(diffs[c - 1]), float(diffs[diffs.size - c])
    return float(np.median(diffs)), (lo, hi)


def level_by_time(
    canary: Sequence[Sample], baseline: Sequence[Sample], bucket_s: float
) -> tuple[list[float], list[float]] | None:
    """Residuals against the untouched replicas' same-bucket mean (leave-one-out for their own samples);
    None when no bucket holds two untouched samples."""
    buckets: dict[int, list[float]] = {}
    for t, v in baseline:
        buckets.setdefault(math.floor(t / bucket_s), []).append(v)
    shared = {b: vs for b, vs in buckets.items() if len(vs) >= 2}
    if not shared:
        return None
    base_res = [v - (sum(vs) - v) / (len(vs) - 1) for vs in shared.values() for v in vs]
    can_res = []
    for t, v in canary:
        vs = shared.get(math.floor(t / bucket_s))
        if vs is not None:
            can_res.append(v - sum(vs) / len(vs))
    return can_res, base_res


def judge_metric(
    spec: MetricSpec,
    canary: Sequence[float],
    baseline: Sequence[float],
    settings: CanarySettings,
    *,
    levelled: tuple[Sequence[float], Sequence[float]] | None = None,
) -> MetricJudgement:
    """One metric's outcome from samples already cut to the same time span; ``levelled``: the same
    samples as residuals against their time bucket (:func:`level_by_time`), compared instead when given."""
    median = float(np.median(baseline)) if baseline else None
    how = "levelled by time bucket" if levelled is not None else "raw"
    if levelled is not None:
        canary, baseline = levelled
    n, m = len(canary), len(baseline)
    if n < settings.min_samples or m < settings.min_samples:
        return MetricJudgement(
            spec.name, MetricOutcome.NO_DATA, spec.critical, n, m, None, None, None, None, None, None, None, False,
            f"{spec.name}: {n} canary and {m} baseline sample(s) over the same time; {settings.min_samples} each "
            "are needed.",
        )  # fmt: skip
    p_value = float(stats.mannwhitneyu(canary, baseline, alternative="two-sided").pvalue)
    if math.isnan(p_value):  # no variation at all on either side: nothing differs
        p_value = 1.0
    shift, (lo, hi) = hodges_lehmann(canary, baseline, settings.confidence)
    sign = -1.0 if spec.direction is Direction.HIGHER_IS_BETTER else 1.0
    harm = sign * shift
    harm_ci = (min(sign * lo, sign * hi), max(sign * lo, sign * hi))
    assert median is not None  # m ≥ min_samples ≥ 2 raw samples behind the levelled ones
    allowed = max(spec.tolerance_abs, spec.tolerance_rel * abs(median))
    significant = p_value < settings.significance
    improved = significant and harm_ci[1] < 0
    where = (
        f"{spec.name}: canary − baseline = {shift:+.4g} ({settings.confidence:.0%} interval {lo:+.4g} to {hi:+.4g}; "
        f"baseline median {median:.4g}; U test p = {p_value:.2g}, {how} samples)"
    )
    if significant and harm_ci[0] > 0 and harm > allowed:
        outcome = MetricOutcome.FAIL
        reason = f"{where}: worse by more than the allowed {allowed:.4g}."
    elif harm_ci[1] <= allowed:
        outcome = MetricOutcome.PASS
        reason = f"{where}: " + ("better." if improved else f"no worse than the allowed {allowed:.4g}.")
    else:
        outcome = MetricOutcome.INCONCLUSIVE
        reason = f"{where}: could still be worse than the allowed {allowed:.4g}."
    return MetricJudgement(
        spec.name, outcome, spec.critical, n, m, p_value, shift, (lo, hi), harm, harm_ci, allowed, median, improved,
        reason,
    )  # fmt: skip


def judge_canary(
    samples: Mapping[str, MetricSamples],
    metrics: Sequence[MetricSpec] = DEFAULT_METRICS,
    settings: CanarySettings | None = None,
    *,
    final: bool = False,
) -> CanaryVerdict:
    """Promote, roll back, or wait: the canary against the untouched replicas over the same time.

    ``samples`` maps a metric name to its samples; a metric in ``metrics`` without samples is NO_DATA.
    ``final``: the canary's time is up, so an undecided canary rolls back."""
    settings = settings or CanarySettings()
    names = [m.name for m in metrics]
    if len(set(names)) != len(names):
        raise ValueError(f"each metric may be judged once but got {names}")
    unknown = sorted(set(samples) - set(names))
    if unknown:
        raise ValueError(f"samples for metric(s) {unknown} that have no MetricSpec; judged are {names}")
    span = same_time_span(samples)
    judged = []
    for spec in metrics:
        s = samples.get(spec.name, MetricSamples((), ()))
        canary = _within(s.canary, span)
        baseline = _within(s.baseline, span)
        levelled = None
        if settings.bucket_s > 0:
            levelled = level_by_time(canary, baseline, settings.bucket_s)
        raw_canary, raw_baseline = [v for _, v in canary], [v for _, v in baseline]
        judged.append(judge_metric(spec, raw_canary, raw_baseline, settings, levelled=levelled))
    passing = sum(j.outcome is MetricOutcome.PASS for j in judged)
    score = passing / len(judged) if judged else 0.0
    decision, reason = _decide(judged, score, settings, final)
    return CanaryVerdict(decision, score, tuple(judged), span, reason)


def _within(side: Sequence[Sample], span: tuple[float, float] | None) -> list[Sample]:
    if span is None:
        return []
    lo, hi = span
    return [(t, v) for t, v in side if lo <= t <= hi and math.isfinite(v)]


def _decide(
    judged: Sequence[MetricJudgement], score: float, settings: CanarySettings, final: bool
) -> tuple[CanaryDecision, str]:
    if not judged:
        return CanaryDecision.UNDECIDED, "no metric to judge the canary by."
    failed = [j for j in judged if j.critical and j.outcome is MetricOutcome.FAIL]
    if failed:
        return CanaryDecision.ROLLBACK, "critical metric failed: " + " ".join(j.reason for j in failed)
    open_ = [j for j in judged if j.critical and j.outcome is not MetricOutcome.PASS]
    if open_:
        what = ", ".join(f"{j.name} ({j.outcome.value})" for j in open_)
        if final:
            return CanaryDecision.ROLLBACK, f"the canary's time is up and {what} could not be shown safe; not spread."
        return CanaryDecision.UNDECIDED, f"need more data: {what} not yet judged safe."
    better = [j.name for j in judged if j.improved]
    gains = f" Better on {', '.join(better)}." if better else ""
    if score >= settings.pass_score:
        return (
            CanaryDecision.PROMOTE,
            f"every critical metric no worse; score {score:.2f} ≥ {settings.pass_score:.2f}.{gains}",
        )
    return CanaryDecision.ROLLBACK, f"score {score:.2f} < {settings.pass_score:.2f}: too many metrics not shown safe."
