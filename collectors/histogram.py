"""Cumulative Prometheus histograms: window deltas and quantiles (Prometheus' own interpolation)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from collectors.records import LatencySummary

Buckets = tuple[tuple[float, float], ...]  # (upper bound ``le``, cumulative count), +Inf last
Histogram = tuple[Buckets, float, float]  # (buckets, count, sum)


def histogram_delta(prev: Histogram, cur: Histogram) -> Histogram | None:
    """cur − prev, bucket by bucket; None when the bucket bounds differ (not the same histogram)
    or any part went down (a reset, which the caller handles)."""
    pb, pc, ps = prev
    cb, cc, cs = cur
    if [le for le, _ in pb] != [le for le, _ in cb]:
        return None
    if cc < pc or any(c < p for (_, p), (_, c) in zip(pb, cb, strict=True)):
        return None
    # Sums are floats accumulated by the engine; a tiny decrease is rounding, not a reset.
    return (
        tuple((le, c - p) for (le, p), (_, c) in zip(pb, cb, strict=True)),
        cc - pc,
        max(cs - ps, 0.0),
    )


def quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The q-quantile by linear interpolation inside the bucket that holds it, as PromQL's
    ``histogram_quantile`` does; None with no observations. A quantile in the +Inf bucket returns
    the highest finite bound (all we know is "at least this")."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be within [0, 1] but got {q}")
    if not buckets:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for le, cum in buckets:
        if cum >= rank:
            if math.isinf(le):
                return lower_bound
            if cum == lower_count:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (cum - lower_count)
        lower_bound, lower_count = le, cum
    return lower_bound


def summarize(h: Histogram | None) -> LatencySummary | None:
    """Reduce a (delta) histogram to the count, sum and p50/p90/p99 we store per window."""
    if h is None:
        return None
    buckets, count, total = h
    return LatencySummary(
        count=count,
        sum_s=total,
        p50_s=quantile(0.5, buckets),
        p90_s=quantile(0.9, buckets),
        p99_s=quantile(0.99, buckets),
    )
