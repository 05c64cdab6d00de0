"""Regime lengths of acceptance and load (policies/regime.py)."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from itertools import pairwise

import numpy as np
import pytest

from policies.regime import SAMPLED_SCATTER_Z, RegimeTracker, basis, left_band, observe, remaining_s, restart

T0 = datetime(2026, 1, 5, tzinfo=UTC)


def _track(values: list[float], step_s: float = 60.0, scatter_z: float = 0.0) -> RegimeTracker:
    t = RegimeTracker(abs_band=0.05, scatter_z=scatter_z)
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


def test_the_basis_says_what_the_remaining_length_went_by() -> None:
    dips = [0.7] * 57 + [0.4] * 3
    t = _track(dips * 6 + [0.7] * 57 + [0.4] * 2)
    now = T0 + timedelta(seconds=60 * (len(dips) * 6 + 57 + 2))
    assert basis(t, now, "acceptance") == (
        "the acceptance fell 120 s ago; 6 of 6 earlier falls lasted longer, by 60 s (median)"
    )
    later = now + timedelta(seconds=180)
    assert basis(t, later, "acceptance") == (
        "the acceptance fell 300 s ago; none of 6 earlier falls lasted that long: expected to last as long again"
    )
    young = _track([0.7] * 10 + [0.4] * 3)
    young_basis = basis(young, T0 + timedelta(seconds=60 * 13), "load")
    assert young_basis == "the load fell 180 s ago; 0 earlier falls on record, 3 needed"
    assert "our own change" in basis(restart(t, now), now, "acceptance")


def test_a_few_regimes_that_lasted_past_this_age_do_not_say_it_ends_soon() -> None:
    """Five 3-minute dips and one of 6 minutes on record, a dip now 5 minutes old: the one longer dip
    alone would say 1 more minute, and a minute later, past it, the age again. Fewer than ``min_history``
    (3) lasted this long: Lindy. With three such dips on record, their median."""
    short, long = [0.7] * 57 + [0.4] * 3, [0.7] * 54 + [0.4] * 6
    t = _track(short * 5 + long + [0.7] * 55 + [0.4] * 5)
    now = T0 + timedelta(seconds=60 * (len(short) * 5 + len(long) + 55 + 5))
    falls = [length for length, d in zip(t.lengths_s, t.directions, strict=True) if d < 0]
    assert t.age_s(now) == pytest.approx(300.0) and falls == [180.0] * 5 + [360.0]
    assert remaining_s(t, now) == pytest.approx(300.0)
    said = basis(t, now, "acceptance")
    assert said.endswith("only 1 of 6 earlier falls lasted that long: expected to last as long again")
    three = _track(short * 3 + long * 3 + [0.7] * 55 + [0.4] * 5)
    now = T0 + timedelta(seconds=60 * (len(short) * 3 + len(long) * 3 + 55 + 5))
    assert remaining_s(three, now) == pytest.approx(60.0)


def test_a_scatter_its_own_observations_show_is_not_a_new_regime_but_a_move_beyond_it_is() -> None:
    """One stream, one prompt mix: five-second α̂ scatters ±0.08 around 0.92 (one or two requests each).
    A fixed 0.05 band read that as the traffic moving every few minutes; the regime's own scatter (and
    each observation's interval) keeps it one regime, while a fall to 0.78 is still a new one."""
    rng = np.random.default_rng(7)
    noisy = list(np.clip(0.92 + rng.normal(0.0, 0.04, 240), 0.0, 0.999))
    beyond = [abs(v - 0.92) > 0.05 for v in noisy]
    assert sum(a and b for a, b in pairwise(beyond)) >= 3  # the band alone: false moves
    t = _track(noisy, step_s=5.0, scatter_z=SAMPLED_SCATTER_Z)
    assert t.lengths_s == () and t.scatter() == pytest.approx(0.04, abs=0.01)
    assert _track(noisy, step_s=5.0).lengths_s != ()  # the band alone (a quantity measured exactly)
    fell = t
    for i, v in enumerate(np.clip(0.78 + rng.normal(0.0, 0.02, 6), 0.0, 0.999)):
        fell = observe(fell, T0 + timedelta(seconds=5.0 * (240 + i)), v)
    assert fell.lengths_s == (1200.0,) and fell.direction == -1
    # an observation's own interval: two ticks 0.1 away but each ±0.15 wide are not a move
    wide = _track([0.9] * 3, scatter_z=SAMPLED_SCATTER_Z)
    for i in range(2):
        wide = observe(wide, T0 + timedelta(seconds=60 * (3 + i)), 0.8, noise=0.15)
    assert wide.lengths_s == () and wide.level == pytest.approx(0.86)
    for i in range(2):
        wide = observe(wide, T0 + timedelta(seconds=60 * (5 + i)), 0.6, noise=0.05)
    assert wide.lengths_s == (300.0,)


def test_a_regime_whose_last_observation_left_its_band_may_be_ending() -> None:
    """Hourly 20-minute rises on record, the current one 20 minutes old: none lasted longer, so Lindy
    says 20 minutes more — but once the last observation is outside the band the regime may be ending,
    and ``left_band`` says so (the controller then weighs no restart on it) until the next observation
    confirms the move (a new regime, with the level it rose from kept) or folds it back."""
    up = [0.4] * 40 + [0.7] * 20
    t = _track(up * 3 + [0.4] * 40 + [0.7] * 20)
    now = T0 + timedelta(seconds=60 * len(up) * 4)
    assert remaining_s(t, now) == pytest.approx(1200.0)  # Lindy: no rise on record lasted past 20 minutes
    assert left_band(t, "load") is None
    left = observe(t, now, 0.4)
    assert left.outside
    said = left_band(left, "load")
    assert said is not None and said.startswith("the load left its regime's band (0.7 ± 0.05)")
    assert said.endswith("at the last observation (0.4): the regime may be ending")
    later = now + timedelta(seconds=60)
    back = observe(left, later, 0.7)  # folded back: the regime goes on
    assert not back.outside and left_band(back, "load") is None
    fell = observe(left, later, 0.4)  # confirmed: a fall, from 0.7, begun at the first outside observation
    assert fell.direction == -1 and fell.previous_level == pytest.approx(0.7) and left_band(fell, "load") is None
    assert remaining_s(fell, later) == pytest.approx(40 * 60.0 - 60.0)  # falls on record lasted 40 minutes
    assert restart(fell, now).previous_level is None
