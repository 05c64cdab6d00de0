"""The load one K is chosen for: the whole horizon, or a sustained load regime (policies/load_window.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from policies.load_window import choose_load_window, load_tracker
from policies.regime import RegimeTracker, observe

T0 = datetime(2026, 1, 5, tzinfo=UTC)
HOUR = 3600.0


def _track(loads: list[float], tracker: RegimeTracker | None = None, step_s: float = 60.0) -> RegimeTracker:
    """One observation per decide tick (a minute), the i-th at T0 + i minutes."""
    t = tracker or load_tracker(0.25)
    for i, v in enumerate(loads):
        t = observe(t, T0 + timedelta(seconds=step_s * i), v)
    return t


def _at(minute: int) -> datetime:
    return T0 + timedelta(seconds=60 * minute)


def test_a_steady_load_is_judged_over_the_whole_horizon() -> None:
    t = _track([16.0, 17.0, 15.0, 16.5] * 30)  # within 25 %: one regime whose start was not seen
    w = choose_load_window(t, _at(120), HOUR, 300.0)
    assert w.since == _at(120) - timedelta(seconds=HOUR) and not w.regime and w.remaining_s is None


def test_a_sustained_rise_is_judged_on_its_own_load_once_it_is_sustained() -> None:
    loads = [16.0] * 120 + [128.0] * 10  # the rise is first seen at minute 120
    t = _track(loads)
    young = choose_load_window(t, _at(123), HOUR, 300.0)  # 3 minutes in: not sustained yet, the hour
    assert not young.regime and young.since == _at(123) - timedelta(seconds=HOUR)
    assert "rose to ~128 requests 180 s ago, not sustained yet" in young.message
    w = choose_load_window(t, _at(125), HOUR, 300.0)  # 5 minutes in: the load since the rise
    assert w.regime and w.since == _at(120)
    assert w.remaining_s is None  # no rises on record: how long it lasts is unknown (the payback horizon)
    assert "rose to ~128 requests 300 s ago and stayed" in w.message
    # the same for a fall, and sustained_s ≥ the horizon keeps the whole horizon (the old behaviour)
    down = _track([128.0] * 10 + [16.0] * 6, t)
    fell = choose_load_window(down, _at(15), HOUR, 300.0)
    assert fell.regime and fell.since == _at(10) and "fell to ~16" in fell.message
    assert not choose_load_window(t, _at(125), HOUR, HOUR).regime


def test_a_regime_older_than_the_horizon_is_the_horizon() -> None:
    t = _track([16.0] * 5 + [128.0] * 70)
    w = choose_load_window(t, _at(75), HOUR, 300.0)  # 70 minutes at 128: it fills the hour
    assert not w.regime and w.since == _at(75) - timedelta(seconds=HOUR)


def test_a_burst_no_longer_than_the_bursts_on_record_is_expected_to_end_soon() -> None:
    """Hourly 6-minute bursts: one that outlived sustained_s is judged on its own load, but the engine's
    history says it has a minute left — what the switching-cost rail weighs a restart against."""
    hour = [8.0] * 54 + [160.0] * 6
    t = _track(hour * 4 + [8.0] * 54 + [160.0] * 5)  # 5 minutes into the 5th burst
    now = _at(60 * 4 + 54 + 5)
    w = choose_load_window(t, now, HOUR, 300.0)
    assert w.regime and w.remaining_s == pytest.approx(60.0)
    # a rise older than every burst on record: no longer a burst (Lindy: as long again as it has lasted)
    later = _track([160.0] * 5, t)
    w = choose_load_window(later, now + timedelta(seconds=300), HOUR, 300.0)
    assert w.regime and w.remaining_s == pytest.approx(600.0)


def test_one_burst_on_record_is_history_enough() -> None:
    """After one 5-minute burst, a rise 6 minutes old has outlived everything on record: it is expected to
    last as long again (Lindy), so a restart must repay within 6 minutes — not within the payback horizon."""
    t = _track([8.0] * 30 + [160.0] * 5 + [8.0] * 30 + [160.0] * 7)  # the second rise first seen at minute 65
    w = choose_load_window(t, _at(71), HOUR, 300.0)
    assert w.regime and w.since == _at(65) and w.remaining_s == pytest.approx(360.0)
    assert "expected to last another 360 s" in w.message


def test_one_request_more_or_less_at_a_low_load_is_not_a_regime() -> None:
    t = _track([1.0, 2.0, 1.0, 2.0, 2.0, 1.0] * 20)  # 100 % relative swings, one request
    assert t.direction == 0 and t.lengths_s == ()
