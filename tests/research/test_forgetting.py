"""Exponential forgetting and sliding windows (bench/research/forgetting.py, research code)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from bench.research.forgetting import TimedEvidence, discounted_evidence, windowed_evidence
from bench.research.simulate import simulate_evidence
from policies.acceptance import AcceptanceEvidence

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_discounting_halves_per_half_life() -> None:
    ev = AcceptanceEvidence(100.0, 50.0, 60.0)
    windows = [TimedEvidence(T0, ev), TimedEvidence(T0 + timedelta(seconds=60), ev)]
    now = T0 + timedelta(seconds=120)
    total = discounted_evidence(windows, now, half_life_s=60)
    assert total.successes == pytest.approx(100 * (0.25 + 0.5))
    assert total.drafts == pytest.approx(60 * 0.75)
    assert windowed_evidence(windows, now, window_s=60) == ev
    with pytest.raises(ValueError, match="after now"):
        discounted_evidence(windows, T0, half_life_s=60)
    with pytest.raises(ValueError, match="positive number of seconds"):
        discounted_evidence(windows, now, half_life_s=0)


def test_forgetting_tracks_a_moved_alpha() -> None:
    rng = np.random.default_rng(0)
    s1, f1 = simulate_evidence(rng, 0.8, 3, 200, 60)
    s2, f2 = simulate_evidence(rng, 0.4, 3, 200, 30)
    s, f = np.concatenate([s1, s2]), np.concatenate([f1, f2])
    windows = [
        TimedEvidence(T0 + timedelta(seconds=10 * i), AcceptanceEvidence(a, b, 200))
        for i, (a, b) in enumerate(zip(s, f, strict=True))
    ]
    now = windows[-1].end
    forgetful = discounted_evidence(windows, now, half_life_s=30)
    everything = discounted_evidence(windows, now, half_life_s=1e9)
    assert forgetful.successes / forgetful.trials == pytest.approx(0.4, abs=0.03)
    assert everything.successes / everything.trials > 0.55
