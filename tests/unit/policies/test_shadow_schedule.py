"""When the shadow replay runs again: backing off while runs agree, at once when the traffic moves."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from policies.shadow_schedule import ShadowSchedule, after_run, shadow_due

T0 = datetime(2026, 12, 7, 4, 0, tzinfo=UTC)
GOOD = (0.98, 0.975, 0.985)
MEDIUM = (0.96, 0.95, 0.97)


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def test_agreeing_runs_double_the_wait_up_to_the_cap_and_a_move_brings_it_back() -> None:
    sched = ShadowSchedule(90.0, 360.0)
    assert shadow_due(sched, T0, ["good", "medium"], None).due  # no replay yet
    sched = after_run(sched, T0, {"good": GOOD, "medium": MEDIUM})
    assert sched.current_wait_s == 90.0  # nothing to compare with: the configured wait
    waits = []
    t = 0.0
    for _ in range(4):
        assert not shadow_due(sched, at(t + sched.current_wait_s - 1), ["good", "medium"], None).due
        t += sched.current_wait_s
        assert shadow_due(sched, at(t), ["good", "medium"], None).due
        # the same α within the scatter of small replays (0.975 against 0.98: the intervals still overlap)
        sched = after_run(sched, at(t), {"good": (0.975, 0.97, 0.98), "medium": MEDIUM})
        waits.append(sched.current_wait_s)
    assert waits == [180.0, 360.0, 360.0, 360.0]
    moved = after_run(sched, at(t + 360), {"good": (0.90, 0.89, 0.91), "medium": MEDIUM})
    assert moved.current_wait_s == 90.0


def test_the_traffic_moving_or_new_candidates_make_a_run_due_at_once() -> None:
    sched = after_run(ShadowSchedule(90.0, 360.0), T0, {"good": GOOD, "medium": MEDIUM})
    sched = after_run(sched, at(10), {"good": GOOD, "medium": MEDIUM})
    assert sched.current_wait_s == 180.0
    quiet = shadow_due(sched, at(100), ["good", "medium"], traffic_moved_at=at(5))  # moved before the run began
    assert not quiet.due and "next at" in quiet.reason
    moved = shadow_due(sched, at(100), ["good", "medium"], traffic_moved_at=at(60))
    assert moved.due and "acceptance moved" in moved.reason
    assert shadow_due(sched, at(100), ["good", "medium", "ngram"], None).due  # a candidate registered
    assert shadow_due(sched, at(100), ["good"], None).due


def test_a_candidate_that_stays_skipped_agrees_one_that_starts_measuring_does_not() -> None:
    sched = after_run(ShadowSchedule(60.0, 240.0), T0, {"good": GOOD, "odd": None})
    assert after_run(sched, at(60), {"good": GOOD, "odd": None}).current_wait_s == 120.0
    assert after_run(sched, at(60), {"good": GOOD, "odd": MEDIUM}).current_wait_s == 60.0


def test_a_cap_below_the_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        ShadowSchedule(90.0, 60.0)


def test_the_cpu_budget_holds_two_runs_and_refills_at_its_share_whatever_made_a_run_due() -> None:
    sched = ShadowSchedule.configured(60.0, None, machine_share=0.02)
    assert shadow_due(sched, T0, ["good"], None).due  # no replay yet: nothing measured, nothing binds
    sched = after_run(sched, T0, {"good": GOOD}, cost_s=6.0)  # 6 machine-s: the bucket held 12, 6 left
    assert sched.credit(T0) == pytest.approx(6.0)
    sched = after_run(sched, at(60), {"good": GOOD}, cost_s=6.0)  # the clock's run: 6 + 1.2 − 6
    assert sched.credit(at(60)) == pytest.approx(1.2)
    # the traffic moved: due by the rules above, but the budget holds 1.2 + 0.02 t of the 6 a run costs
    blocked = shadow_due(sched, at(100), ["good"], traffic_moved_at=at(90))
    assert not blocked.due and "max_machine_share = 0.02" in blocked.reason and "04:05:00" in blocked.reason
    assert sched.budget_allows_at(at(100)) == at(60 + (6.0 - 1.2) / 0.02)
    assert shadow_due(sched, at(300), ["good"], traffic_moved_at=at(90)).due
    # it refills to two runs, no more: a long quiet spell buys a burst of two, not of ten
    assert sched.credit(at(86_400)) == pytest.approx(12.0)
    # no budget, or runs that cost nothing (a GPU host's replays beside the engine): never binds
    free = after_run(ShadowSchedule.configured(60.0, None), T0, {"good": GOOD}, cost_s=6.0)
    assert free.credit(at(1)) is None and shadow_due(free, at(61), ["good"], None).due
    gpu = after_run(ShadowSchedule.configured(60.0, None, 0.02), T0, {"good": GOOD}, cost_s=0.0)
    assert shadow_due(gpu, at(61), ["good"], None).due
    with pytest.raises(ValueError, match="machine_share"):
        ShadowSchedule.configured(60.0, None, machine_share=1.5)
