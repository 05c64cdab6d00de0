"""A shadow replay counts no more trials than its run-to-run error allows (policies.replay_error)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from policies.acceptance import AcceptanceEvidence
from policies.replay_error import PRIOR_PAIRS, ReplayRun, capped, replay_error

T0 = datetime(2026, 12, 7, tzinfo=UTC)


def ev(alpha: float, trials: float = 3000.0) -> AcceptanceEvidence:
    return AcceptanceEvidence(alpha * trials, (1.0 - alpha) * trials, trials / 3.0)


def runs(name: str, alphas: list[float], start: datetime = T0, every_s: float = 90.0) -> list[ReplayRun]:
    return [ReplayRun(name, start + timedelta(seconds=i * every_s), ev(a)) for i, a in enumerate(alphas)]


def test_runs_that_scatter_beyond_their_binomial_width_measure_the_error() -> None:
    # replays drawn with a known per-run error of 0.015 (beyond 3000 trials' binomial ~0.003): many pairs
    # of two drafts recover it, shrunk a little toward the configured 0.02
    rng = np.random.default_rng(3)
    shift = rng.normal(0.0, 0.015, 200)
    good = [min(0.97 + s, 0.999) for s in shift]
    medium = [0.95 + s for s in shift]
    error = replay_error(runs("good", good) + runs("medium", medium), None, 0.02)
    assert error.pairs == 2 * 199
    assert error.measured_sd == pytest.approx(0.015, rel=0.12)
    assert error.measured_sd is not None and error.measured_sd < error.sd < 0.02
    assert "398 consecutive pair(s)" in error.describe()


def test_without_two_runs_of_one_regime_the_configured_error_stands() -> None:
    lone = replay_error(runs("good", [0.97]), None, 0.02)
    assert (lone.sd, lone.pairs, lone.measured_sd) == (0.02, 0, None)
    # two runs either side of the regime's start measured different traffic: not a pair
    across = replay_error(runs("good", [0.97, 0.75]), T0 + timedelta(seconds=45), 0.02)
    assert (across.sd, across.pairs) == (0.02, 0)
    # the same two runs within one regime: their 0.22 apart says the replays are that unsure
    within = replay_error(runs("good", [0.97, 0.75]), None, 0.02)
    assert within.pairs == 1 and within.measured_sd == pytest.approx(0.155, abs=0.001) and within.sd > 0.09


def test_identical_runs_shrink_the_error_toward_zero_by_their_number() -> None:
    error = replay_error(runs("good", [0.9] * 9), None, 0.02)  # 8 pairs agreeing exactly (binomial alone)
    assert error.measured_sd == 0.0
    assert error.sd == pytest.approx(0.02 * (PRIOR_PAIRS / (8 + PRIOR_PAIRS)) ** 0.5)


def test_a_replay_counts_at_most_what_its_error_allows() -> None:
    full = ev(0.9, 3000.0)
    cut = capped(full, 0.02)
    assert cut.trials == pytest.approx(0.9 * 0.1 / 0.02**2)  # 225 trials
    assert cut.successes / cut.trials == pytest.approx(0.9)  # what it measured, at less weight
    assert cut.drafts == pytest.approx(full.drafts * cut.trials / full.trials)
    assert capped(ev(0.9, 100.0), 0.02) == ev(0.9, 100.0)  # already less than that: unchanged
    assert capped(full, 0.0) == full


def test_zero_turns_the_cap_off_and_a_negative_error_is_refused() -> None:
    assert replay_error(runs("good", [0.97, 0.75]), None, 0.0).sd == 0.0
    with pytest.raises(ValueError, match="prior_sd"):
        replay_error([], None, -0.1)
