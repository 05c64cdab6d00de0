"""The CUSUM change detector (policies/change.py)."""

from __future__ import annotations

from dataclasses import FrozenInstanceError
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from bench.research.simulate import simulate_evidence
from policies.acceptance import AcceptanceEvidence
from policies.change import ChangeDetectorConfig, ChangeDetectorState, ChangeReason, update_change_detector

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def run(config: ChangeDetectorConfig, s: np.ndarray, f: np.ndarray) -> list[int]:
    """Indices of windows that raised an alarm."""
    state = ChangeDetectorState()
    alarms = []
    for i, (a, b) in enumerate(zip(s, f, strict=True)):
        decision, state = update_change_detector(
            state,
            AcceptanceEvidence(float(a), float(b), 0.0),
            T0 + timedelta(seconds=config.window_s * i),
            config,
        )
        if decision.changed:
            alarms.append(i)
    return alarms


def test_stationary_alpha_alarms_less_often_than_configured() -> None:
    config = ChangeDetectorConfig(window_s=10, false_alarms_per_day=48, shift=0.1, min_reference_trials=1000)
    s, f = simulate_evidence(np.random.default_rng(1), 0.6, 3, 100, 8000)
    alarms = run(config, s, f)
    allowed = 8000 / config.in_control_run_length_windows  # ≈ 44
    assert len(alarms) <= allowed


def test_a_drop_is_detected_quickly_and_the_new_alpha_reported() -> None:
    config = ChangeDetectorConfig(window_s=10, false_alarms_per_day=1, shift=0.1)
    rng = np.random.default_rng(2)
    s1, f1 = simulate_evidence(rng, 0.7, 4, 200, 100)
    s2, f2 = simulate_evidence(rng, 0.5, 4, 200, 100)
    state = ChangeDetectorState()
    fired = None
    for i, (a, b) in enumerate(zip(np.concatenate([s1, s2]), np.concatenate([f1, f2]), strict=True)):
        decision, state = update_change_detector(
            state, AcceptanceEvidence(a, b, 200), T0 + timedelta(seconds=10 * i), config
        )
        if decision.changed:
            fired = (i, decision)
            break
    assert fired is not None
    i, decision = fired
    assert 100 <= i <= 105
    assert decision.reason is ChangeReason.ALPHA_FELL
    assert decision.alpha_reference == pytest.approx(0.7, abs=0.02)
    assert decision.alpha_recent == pytest.approx(0.5, abs=0.06)
    assert decision.change_started is not None and decision.change_started >= T0 + timedelta(seconds=10 * 95)
    # after the alarm the reference is the post-change evidence and the statistics restart
    assert state.up == 0.0 and state.down == 0.0 and state.last_alarm is not None
    assert state.reference.successes / state.reference.trials == pytest.approx(decision.alpha_recent)


def test_a_rise_is_detected() -> None:
    config = ChangeDetectorConfig(window_s=5, shift=0.1)
    rng = np.random.default_rng(3)
    s1, f1 = simulate_evidence(rng, 0.4, 2, 300, 50)
    s2, f2 = simulate_evidence(rng, 0.6, 2, 300, 20)
    state = ChangeDetectorState()
    reasons = []
    for i, (a, b) in enumerate(zip(np.concatenate([s1, s2]), np.concatenate([f1, f2]), strict=True)):
        decision, state = update_change_detector(
            state, AcceptanceEvidence(a, b, 300), T0 + timedelta(seconds=5 * i), config
        )
        reasons.append(decision.reason)
    assert ChangeReason.ALPHA_ROSE in reasons[50:]
    assert ChangeReason.ALPHA_ROSE not in reasons[:50] and ChangeReason.ALPHA_FELL not in reasons


def test_warm_up_then_stable() -> None:
    config = ChangeDetectorConfig(window_s=10, min_reference_trials=500, min_reference_windows=2)
    state = ChangeDetectorState()
    decision, state = update_change_detector(state, AcceptanceEvidence(200, 100, 100), T0, config)
    assert decision.reason is ChangeReason.WARMING_UP and "300 of 500" in decision.message
    decision, state = update_change_detector(state, AcceptanceEvidence(200, 100, 100), T0, config)
    decision, state = update_change_detector(state, AcceptanceEvidence(200, 100, 100), T0, config)
    assert decision.reason is ChangeReason.STABLE and not decision.changed


def test_warm_up_also_waits_for_enough_windows_to_estimate_their_spread() -> None:
    config = ChangeDetectorConfig(window_s=10, min_reference_trials=500, min_reference_windows=4)
    state = ChangeDetectorState()
    for _ in range(4):
        decision, state = update_change_detector(state, AcceptanceEvidence(2000, 1000, 1000), T0, config)
        assert decision.reason is ChangeReason.WARMING_UP  # trials are plenty, windows are not
    assert "4 of 4 windows" in decision.message
    decision, state = update_change_detector(state, AcceptanceEvidence(2000, 1000, 1000), T0, config)
    assert decision.reason is ChangeReason.STABLE


def test_overdispersion_damps_the_statistic() -> None:
    plain = ChangeDetectorConfig(window_s=10)
    damped = ChangeDetectorConfig(window_s=10, dispersion=4.0)
    state = ChangeDetectorState(reference=AcceptanceEvidence(6000, 4000, 0))
    a, _ = update_change_detector(state, AcceptanceEvidence(50, 50, 0), T0, plain)
    b, _ = update_change_detector(state, AcceptanceEvidence(50, 50, 0), T0, damped)
    assert b.statistic_down == pytest.approx(a.statistic_down / 4)


def test_config_and_state_are_validated_and_frozen() -> None:
    with pytest.raises(ValueError, match="shift"):
        ChangeDetectorConfig(window_s=10, shift=0)
    with pytest.raises(ValueError, match="window_s"):
        ChangeDetectorConfig(window_s=0)
    state = ChangeDetectorState()
    with pytest.raises(FrozenInstanceError):
        state.up = 1.0  # type: ignore[misc]


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
