"""Regime lengths of acceptance and load (policies/regime.py)."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest

from policies.regime import RegimeTracker, observe, remaining_s, restart

T0 = datetime(2026, 1, 5, tzinfo=UTC)


def _track(values: list[float], step_s: float = 60.0) -> RegimeTracker:
    t = RegimeTracker(abs_band=0.05)
    for i, v in enumerate(values):
        t = observe(t, T0 + timedelta(seconds=step_s * i), v)
    return t


def test_regimes_are_recorded_and_one_noisy_tick_is_not_a_regime() -> None:
    t = _track([0.7] * 60 + [0.4] + [0.7] * 10 + [0.4] * 3 + [0.7] * 30)
    assert t.lengths_s == (60 * 71.0, 180.0)  # the lone tick did not start a regime; the 3-minute dip did
    assert t.level == pytest.approx(0.7)


def test_remaining_length_is_the_median_of_longer_past_regimes_else_the_age() -> None:
    dips = [0.7] * 57 + [0.4] * 3
    t = _track(dips * 6 + [0.7] * 57 + [0.4] * 2)  # hourly 3-minute dips; now 2 minutes into the 7th
    now = T0 + timedelta(seconds=60 * (len(dips) * 6 + 57 + 2))
    assert t.age_s(now) == pytest.approx(120.0)
    assert remaining_s(t, now) == pytest.approx(60.0)  # past falls (the dips) lasted 3 minutes
    later = now + timedelta(seconds=180)  # a fall older than any past dip: no longer a dip, Lindy
    assert remaining_s(t, later) == pytest.approx(300.0)
    young = _track([0.7] * 10 + [0.4] * 3)  # a fall 3 minutes old, no falls on record: nothing to go by
    assert remaining_s(young, T0 + timedelta(seconds=60 * 13)) == math.inf
    # a regime whose beginning was not seen (the first; one our own change began) has no age to go by
    fresh = _track([0.7] * 10)
    assert remaining_s(fresh, T0 + timedelta(seconds=540)) == math.inf
    again = restart(t, now)
    assert again.lengths_s == t.lengths_s and again.level is None
    assert remaining_s(observe(again, now, 0.7), now + timedelta(seconds=60)) == math.inf
