"""Each guardrail alone, with a fake clock (Ray Serve style), then the fixed order of the chain."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, time, timedelta

import pytest

from tests.fakes import FakeClock
from tuner.config import GuardrailsSection, MaintenanceWindow
from tuner.controller.guardrails import (
    RAILS,
    BlockReason,
    ControllerState,
    Proposal,
    check_cooldown,
    check_evidence,
    check_gain,
    check_guardrails,
    check_known_bad,
    check_maintenance,
    check_paused,
    check_pending,
    check_rate,
    check_streak,
    check_switching_cost,
    in_window,
    live_lower_end,
    next_streak,
    payback_s,
)

T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)  # a Wednesday
SETTINGS = GuardrailsSection(
    min_drafts=200,
    min_evidence_s=60,
    min_gain=0.03,
    hysteresis_ticks=2,
    cooldown_s=600,
    max_changes_per_hour=2,
    restart_downtime_s=60,
    payback_horizon_s=3600,
)
# A state and proposal every rail lets through; each test overrides one thing.
STATE = ControllerState(streak_target="k=5", streak_count=1)
GOOD = Proposal(target="k=5", predicted_gain=1.3, predicted_gain_ci=(1.2, 1.4), drafts=5000, evidence_s=300)


def test_base_case_passes_every_rail() -> None:
    for rail in RAILS:
        assert rail(SETTINGS, STATE, GOOD, T0) is None, rail.__name__
    assert check_guardrails(SETTINGS, STATE, GOOD, T0) is None


def test_paused() -> None:
    block = check_paused(SETTINGS, replace(STATE, paused=True), GOOD, T0)
    assert block is not None and block.reason is BlockReason.PAUSED and "spectuner resume" in block.message


def test_pending_verification() -> None:
    block = check_pending(SETTINGS, replace(STATE, pending_verification=True), GOOD, T0)
    assert block is not None and block.reason is BlockReason.PENDING_VERIFICATION


def test_known_bad() -> None:
    block = check_known_bad(SETTINGS, replace(STATE, failed_targets=frozenset({"k=5"})), GOOD, T0)
    assert block is not None and block.reason is BlockReason.KNOWN_BAD
    assert check_known_bad(SETTINGS, replace(STATE, failed_targets=frozenset({"k=6"})), GOOD, T0) is None


@pytest.mark.parametrize(("drafts", "evidence_s", "blocked"), [(199, 300, True), (200, 59, True), (200, 60, False)])
def test_minimum_evidence(drafts: int, evidence_s: float, blocked: bool) -> None:
    block = check_evidence(SETTINGS, STATE, replace(GOOD, drafts=drafts, evidence_s=evidence_s), T0)
    assert (block is not None) is blocked
    if block:
        assert block.reason is BlockReason.INSUFFICIENT_EVIDENCE and f"have {drafts} drafts" in block.message


def test_the_evidence_message_names_only_what_is_missing() -> None:
    time_short = check_evidence(SETTINGS, STATE, replace(GOOD, drafts=2000, evidence_s=30), T0)
    assert time_short is not None
    assert "30 s of the 60 s of evidence needed" in time_short.message and "drafts of the" not in time_short.message
    drafts_short = check_evidence(SETTINGS, STATE, replace(GOOD, drafts=50, evidence_s=600), T0)
    assert drafts_short is not None
    assert "50 drafts of the 200 needed" in drafts_short.message and "s of evidence" not in drafts_short.message
    both = check_evidence(SETTINGS, STATE, replace(GOOD, drafts=50, evidence_s=30), T0)
    assert both is not None and "50 drafts of the 200 needed and 30 s of the 60 s" in both.message


def test_a_change_that_keeps_serving_needs_less_evidence() -> None:
    # min_drafts_live (50 by default): a wrong live change costs one verification window, then rolls back
    assert SETTINGS.min_drafts_live == 50
    restart = check_evidence(SETTINGS, STATE, replace(GOOD, drafts=120), T0)
    assert restart is not None and "120 drafts of the 200 needed (have" in restart.message
    assert check_evidence(SETTINGS, STATE, replace(GOOD, drafts=120, needs_restart=False), T0) is None
    short = check_evidence(SETTINGS, STATE, replace(GOOD, drafts=49, needs_restart=False), T0)
    assert short is not None and "49 drafts of the 50 needed for a change that does not interrupt serving" in (
        short.message
    )
    # never more than min_drafts, and equal bars treat every change alike
    loose = SETTINGS.model_copy(update={"min_drafts": 20})
    assert check_evidence(loose, STATE, replace(GOOD, drafts=20, needs_restart=False), T0) is None
    strict = SETTINGS.model_copy(update={"min_drafts_live": 200})
    assert check_evidence(strict, STATE, replace(GOOD, drafts=120, needs_restart=False), T0) is not None
    # the time bar is the same for both
    assert check_evidence(SETTINGS, STATE, replace(GOOD, evidence_s=30, needs_restart=False), T0) is not None


def test_gain_uses_the_lower_end_of_the_interval() -> None:
    # A big point estimate with an interval reaching below 1.03 is not enough.
    block = check_gain(SETTINGS, STATE, replace(GOOD, predicted_gain=1.5, predicted_gain_ci=(1.02, 2.0)), T0)
    assert block is not None and block.reason is BlockReason.GAIN_TOO_SMALL
    assert check_gain(SETTINGS, STATE, replace(GOOD, predicted_gain_ci=(1.031, 1.5)), T0) is None


def test_a_change_that_keeps_serving_needs_a_smaller_sure_gain() -> None:
    # min_gain_live (0.01 by default): no downtime to repay, and verification rolls back a loss
    live = replace(GOOD, predicted_gain=1.05, predicted_gain_ci=(1.015, 1.09), needs_restart=False)
    assert SETTINGS.min_gain_live == 0.01
    assert check_gain(SETTINGS, STATE, live, T0) is None
    restart = check_gain(SETTINGS, STATE, replace(live, needs_restart=True), T0)
    assert restart is not None and "1.030×" in restart.message and "does not interrupt" not in restart.message
    low = check_gain(SETTINGS, STATE, replace(live, predicted_gain=1.02, predicted_gain_ci=(0.96, 1.09)), T0)
    assert low is not None and low.reason is BlockReason.GAIN_TOO_SMALL
    assert "1.010×" in low.message and "does not interrupt serving" in low.message
    assert "lower end 0.994× at 80% confidence" in low.message
    # an operator who wants every change alike sets both the same
    strict = SETTINGS.model_copy(update={"min_gain_live": SETTINGS.min_gain, "live_gain_confidence": 0.975})
    assert check_gain(strict, STATE, live, T0) is not None


def test_a_change_that_keeps_serving_is_judged_at_a_lower_confidence() -> None:
    """1.05× with a 95 % interval reaching 1.005×: not surely above 1.01× at 95 %, but at the 80 % a live
    change is judged at (lower end 1.05 × (1.005/1.05)^(0.842/1.960) = 1.030×) it is — a wrong one costs a
    verification window, a missed one the regime (lab_phases: K = 3 → 5 at one stream, 1.06× predicted
    with an interval down to 0.99×, waited 5 minutes). A restart still needs the interval's own lower end."""
    live = replace(GOOD, predicted_gain=1.05, predicted_gain_ci=(1.005, 1.09), needs_restart=False)
    assert SETTINGS.live_gain_confidence == 0.8
    assert live_lower_end(live, 0.8) == pytest.approx(1.05 * (1.005 / 1.05) ** (0.8416 / 1.9600), rel=1e-3)
    assert check_gain(SETTINGS, STATE, live, T0) is None
    assert live_lower_end(live, 0.975) == pytest.approx(1.005, rel=1e-4)
    as_sure = SETTINGS.model_copy(update={"live_gain_confidence": 0.975})
    assert check_gain(as_sure, STATE, live, T0) is not None
    # the interval's own confidence is what is rescaled: a 99 % interval at the same lower end is narrower
    # per standard deviation, so its 80 % end is higher
    assert live_lower_end(replace(live, confidence=0.99), 0.8) > live_lower_end(live, 0.8)
    no_change = replace(GOOD, predicted_gain=1.05, predicted_gain_ci=(1.005, 1.09), needs_restart=True)
    assert check_gain(SETTINGS, STATE, no_change, T0) is not None


def test_a_streak_key_makes_proposals_that_differ_only_elsewhere_the_same_change() -> None:
    a = replace(GOOD, target="table rows A", streak_key="K=5 at 1")
    b = replace(GOOD, target="table rows B", streak_key="K=5 at 1")
    target, count = next_streak(ControllerState(), a.streak_target)
    state = replace(STATE, streak_target=target, streak_count=count)
    assert check_streak(SETTINGS, state, b, T0) is None  # second in a row, though the fingerprints differ
    assert check_streak(SETTINGS, state, replace(b, streak_key="K=4 at 1"), T0) is not None
    assert GOOD.streak_target == GOOD.target  # no key: the fingerprint


def test_streak_counts_consecutive_identical_proposals_and_resets_on_a_flip() -> None:
    state = ControllerState()
    assert check_streak(SETTINGS, state, GOOD, T0) is not None  # first time: 1 of 2
    target, count = next_streak(state, GOOD.target)
    state = replace(state, streak_target=target, streak_count=count)
    assert check_streak(SETTINGS, state, GOOD, T0) is None  # second in a row
    flipped = replace(GOOD, target="k=2")
    block = check_streak(SETTINGS, state, flipped, T0)
    assert block is not None and block.reason is BlockReason.NOT_PERSISTENT
    assert next_streak(state, "k=2") == ("k=2", 1)
    assert next_streak(state, None) == (None, 0)


def test_cooldown_with_a_fake_clock() -> None:
    clock = FakeClock(T0)
    state = replace(STATE, change_times=(T0,))
    assert check_cooldown(SETTINGS, state, GOOD, clock.advance(1)) is not None
    block = check_cooldown(SETTINGS, state, GOOD, clock.advance(598))  # 599 s after
    assert block is not None and block.reason is BlockReason.COOLDOWN and "1 s left" in block.message
    assert check_cooldown(SETTINGS, state, GOOD, clock.advance(1)) is None  # 600 s after


def test_max_changes_per_hour_slides_with_the_clock() -> None:
    clock = FakeClock(T0)
    state = replace(STATE, change_times=(T0, T0 + timedelta(minutes=30)))
    block = check_rate(SETTINGS, state, GOOD, clock.advance(45 * 60))
    assert block is not None and block.reason is BlockReason.TOO_MANY_CHANGES
    assert check_rate(SETTINGS, state, GOOD, clock.advance(15 * 60)) is None  # T0 left the hour


def test_switching_cost_payback() -> None:
    assert payback_s(1.5, 60) == pytest.approx(120)
    assert payback_s(1.0, 60) == float("inf")
    assert payback_s(0.9, 0) == 0.0
    # 60 s downtime at 1.01× takes 6000 s to repay: more than the 3600 s horizon.
    block = check_switching_cost(SETTINGS, STATE, replace(GOOD, predicted_gain=1.01), T0)
    assert block is not None and block.reason is BlockReason.SWITCHING_COST and "6000 s" in block.message
    assert check_switching_cost(SETTINGS, STATE, replace(GOOD, predicted_gain=1.02), T0) is None  # 3060 s
    # a change without a restart costs nothing
    assert check_switching_cost(SETTINGS, STATE, replace(GOOD, predicted_gain=1.001, needs_restart=False), T0) is None


def test_maintenance_windows() -> None:
    nightly = MaintenanceWindow(start=time(2, 0), end=time(4, 0), days=[0, 1, 2, 3, 4])  # weekdays 02:00-04:00
    settings = SETTINGS.model_copy(update={"maintenance_windows": [nightly]})
    wed_3am = datetime(2026, 12, 2, 3, 0, tzinfo=UTC)
    assert check_maintenance(settings, STATE, GOOD, wed_3am) is None
    assert check_maintenance(settings, STATE, GOOD, wed_3am.replace(hour=4)) is not None  # end is exclusive
    block = check_maintenance(settings, STATE, GOOD, T0)
    assert (
        block is not None and block.reason is BlockReason.OUTSIDE_MAINTENANCE_WINDOW and "02:00–04:00" in block.message
    )
    saturday_3am = datetime(2026, 12, 5, 3, 0, tzinfo=UTC)
    assert check_maintenance(settings, STATE, GOOD, saturday_3am) is not None
    assert check_maintenance(settings, STATE, replace(GOOD, needs_restart=False), T0) is None
    assert check_maintenance(SETTINGS, STATE, GOOD, T0) is None  # no windows configured: any time


def test_window_wrapping_midnight_belongs_to_its_start_day() -> None:
    friday_night = MaintenanceWindow(start=time(23, 0), end=time(1, 0), days=[4])  # Fri 23:00 → Sat 01:00
    assert in_window(friday_night, datetime(2026, 12, 4, 23, 30, tzinfo=UTC))  # Friday
    assert in_window(friday_night, datetime(2026, 12, 5, 0, 30, tzinfo=UTC))  # Saturday morning
    assert not in_window(friday_night, datetime(2026, 12, 5, 23, 30, tzinfo=UTC))  # Saturday night
    assert not in_window(friday_night, datetime(2026, 12, 4, 0, 30, tzinfo=UTC))  # Friday morning


def test_chain_order_first_block_wins() -> None:
    state = replace(STATE, paused=True, change_times=(T0,))
    weak = replace(GOOD, drafts=0)
    block = check_guardrails(SETTINGS, state, weak, T0)
    assert block is not None and block.reason is BlockReason.PAUSED
    block = check_guardrails(SETTINGS, replace(state, paused=False), weak, T0)
    assert block is not None and block.reason is BlockReason.INSUFFICIENT_EVIDENCE
    block = check_guardrails(SETTINGS, replace(state, paused=False), GOOD, T0 + timedelta(seconds=10))
    assert block is not None and block.reason is BlockReason.COOLDOWN


def test_naive_now_is_refused() -> None:
    with pytest.raises(ValueError, match="aware"):
        check_guardrails(SETTINGS, STATE, GOOD, datetime(2026, 1, 1))


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


def test_the_restarts_own_downtime_comes_out_of_the_remaining_regime() -> None:
    # 90 s down, then 450 s at 1.2× to repay it: 540 s of regime needed. A regime with 500 s left repays
    # the 90 s only if the new config served from the moment of the decision, which it cannot.
    rails = GuardrailsSection(restart_downtime_s=90.0, payback_horizon_s=3600.0)
    p = Proposal("x", 1.2, (1.1, 1.3), 10_000, 300.0, horizon_s=500.0)
    block = check_switching_cost(rails, ControllerState(), p, T0)
    assert block is not None and "450 s to repay after the 90-s restart (540 s in all)" in block.message
    assert check_switching_cost(rails, ControllerState(), replace(p, horizon_s=541.0), T0) is None


def test_a_change_that_commits_to_a_way_back_repays_both_restarts() -> None:
    # 1.2× repays one 90 s restart in 450 s, two in 900 s: within a 600 s regime only the first
    rails = GuardrailsSection(restart_downtime_s=90.0, payback_horizon_s=3600.0)
    one = Proposal("x", 1.2, (1.1, 1.3), 10_000, 300.0, horizon_s=600.0)
    assert check_switching_cost(rails, ControllerState(), one, T0) is None
    both = check_switching_cost(rails, ControllerState(), replace(one, restarts=2), T0)
    assert both is not None and both.reason is BlockReason.SWITCHING_COST
    assert "2 restarts (there and back) cost ~180 s" in both.message and "900 s to repay" in both.message
    assert check_switching_cost(rails, ControllerState(), replace(one, restarts=2, horizon_s=1000.0), T0) is None


def test_the_way_back_is_charged_at_the_load_it_comes_at() -> None:
    # Plain decoding at 1.2× for a 600 s regime: two 90-s restarts at today's goodput need 900 s to repay.
    # The way back comes at a lower load, where an engine makes a quarter of today's tokens a second, after
    # 30 s' worth of today's goodput lost waiting for that load to be sustained: 90 + 22.5 + 30 s to repay
    rails = GuardrailsSection(restart_downtime_s=90.0, payback_horizon_s=3600.0)
    both = Proposal("x", 1.2, (1.1, 1.3), 10_000, 300.0, horizon_s=1000.0, restarts=2)
    cheap = replace(both, way_back_share=0.25, way_back_lag_s=30.0)
    assert check_switching_cost(rails, ControllerState(), replace(both, horizon_s=900.0), T0) is not None
    assert check_switching_cost(rails, ControllerState(), replace(cheap, horizon_s=900.0), T0) is None
    block = check_switching_cost(rails, ControllerState(), replace(cheap, horizon_s=700.0), T0)
    assert block is not None and block.reason is BlockReason.SWITCHING_COST
    assert "the way back at 0.25× the current goodput, after ~30 s of it lost waiting" in block.message
    assert "cost ~142 s of serving" in block.message and "(803 s in all)" in block.message
