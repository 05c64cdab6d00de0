"""Issue 20: between-window over-dispersion (policies/dispersion.py) in α̂'s interval and the change
detector; regime lengths (policies/regime.py); the regime-aware switching-cost rail."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from policies.acceptance import AcceptanceEvidence, alpha_of_windows
from policies.change import ChangeDetectorConfig, ChangeDetectorState, update_change_detector
from policies.counters import SpecCounters
from policies.dispersion import DispersionSums, window_dispersion
from policies.regime import RegimeTracker, observe, remaining_s, restart
from tuner.config import GuardrailsSection
from tuner.controller.guardrails import BlockReason, ControllerState, Proposal, check_switching_cost

T0 = datetime(2026, 1, 5, tzinfo=UTC)


def counters(rng: np.random.Generator, alpha: float, k: int, drafts: int) -> SpecCounters:
    """One window of i.i.d. acceptance at ``alpha``: accepted length per draft, truncated at K."""
    surv = np.concatenate([[1.0], np.cumprod(np.full(k, alpha))])
    p = surv - np.append(surv[1:], 0.0)
    exact = rng.multinomial(drafts, p)
    at_least = np.cumsum(exact[::-1])[::-1]
    per_pos = tuple(int(x) for x in at_least[1:])
    return SpecCounters(drafts, drafts * k, sum(per_pos), per_pos, k)


def test_binomial_windows_have_no_overdispersion() -> None:
    rng = np.random.default_rng(1)
    phi = window_dispersion((float(s), 5000.0) for s in rng.binomial(5000, 0.6, size=200))
    assert phi < 1.3


def test_wandering_windows_are_overdispersed_and_widen_the_interval() -> None:
    rng = np.random.default_rng(2)
    steady = [counters(rng, 0.7, 3, 4000) for _ in range(30)]
    noisy = [counters(rng, float(np.clip(0.7 + 0.04 * rng.standard_normal(), 0, 0.99)), 3, 4000) for _ in range(30)]
    a, b = alpha_of_windows(steady), alpha_of_windows(noisy)
    assert a.dispersion < 1.5 < 10 < b.dispersion
    assert a.alpha_ci is not None and b.alpha_ci is not None
    width = lambda ci: ci[1] - ci[0]  # noqa: E731
    assert width(b.alpha_ci) > 3 * width(a.alpha_ci)
    assert b.alpha_ci[0] < 0.7 < b.alpha_ci[1]


def test_too_few_windows_assume_binomial() -> None:
    assert DispersionSums().add(10, 20).add(19, 20).phi == 1.0


def _alarms(alphas: list[float], seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    cfg = ChangeDetectorConfig(window_s=10.0)
    state = ChangeDetectorState()
    fired = []
    for i, a in enumerate(alphas):
        s = int(rng.binomial(12000, a))
        decision, state = update_change_detector(
            state, AcceptanceEvidence(s, 12000 - s, 4000), T0 + timedelta(seconds=10 * i), cfg
        )
        if decision.changed:
            fired.append(i)
    return fired


def test_detector_does_not_cry_wolf_on_window_noise_but_sees_a_real_shift() -> None:
    rng = np.random.default_rng(3)
    n = 8640  # one day of 10 s windows
    noise = 0.04 * rng.standard_normal(n)
    stationary = list(np.clip(0.7 + noise, 0.01, 0.99))
    assert len(_alarms(stationary, 4)) <= 2  # configured: 1 per day (binomial LLR alone: thousands)
    shifted = list(np.clip(np.where(np.arange(n) < 4000, 0.7, 0.5) + noise, 0.01, 0.99))
    fired = _alarms(shifted, 5)
    assert any(4000 <= i < 4030 for i in fired)  # within 5 minutes of the shift


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
    fresh = _track([0.7] * 10)
    assert remaining_s(fresh, T0 + timedelta(seconds=540)) == pytest.approx(540.0)  # no history: Lindy
    again = restart(t, now)
    assert again.lengths_s == t.lengths_s and again.level is None


def test_switching_cost_is_weighed_over_the_remaining_regime() -> None:
    rails = GuardrailsSection(restart_downtime_s=90.0, payback_horizon_s=3600.0)
    p = Proposal("x", 1.2, (1.1, 1.3), 10_000, 300.0)  # payback 450 s
    assert check_switching_cost(rails, ControllerState(), p, T0) is None
    short = check_switching_cost(
        rails, ControllerState(), Proposal("x", 1.2, (1.1, 1.3), 10_000, 300.0, horizon_s=120.0), T0
    )
    assert short is not None and short.reason is BlockReason.SWITCHING_COST
    assert "remaining length" in short.message
    long = Proposal("x", 1.2, (1.1, 1.3), 10_000, 300.0, horizon_s=600.0)
    assert check_switching_cost(rails, ControllerState(), long, T0) is None
