"""policies.last_regime: the evidence since a draft's acceptance last changed."""

from __future__ import annotations

import numpy as np
import pytest

from policies.acceptance import AcceptanceEvidence
from policies.last_regime import last_regime


def windows(alphas: list[float], trials: int = 600, spread: float = 0.0, seed: int = 1) -> list[AcceptanceEvidence]:
    """Binomial windows at the given α, each window's α moved by N(0, spread) (a prompt mix that wanders)."""
    rng = np.random.default_rng(seed)
    out = []
    for a in alphas:
        p = float(np.clip(a + rng.normal(0.0, spread), 0.01, 0.99)) if spread else a
        s = float(rng.binomial(trials, p))
        out.append(AcceptanceEvidence(s, trials - s, trials / 3))
    return out


def test_a_fall_at_the_end_leaves_only_the_windows_after_it() -> None:
    ws = windows([0.75] * 720 + [0.3] * 30)
    r = last_regime(ws)
    assert r.cuts == 1 and 715 <= r.start <= 725, r
    assert r.evidence.successes / r.evidence.trials == pytest.approx(0.3, abs=0.03)


def test_the_newest_of_several_changes_wins() -> None:
    r = last_regime(windows([0.8] * 200 + [0.4] * 200 + [0.65] * 100))
    assert r.cuts >= 2 and 395 <= r.start <= 405
    assert r.evidence.successes / r.evidence.trials == pytest.approx(0.65, abs=0.03)


@pytest.mark.parametrize("seed", range(20))
def test_a_stationary_history_with_wandering_windows_is_not_cut(seed: int) -> None:
    """Windows whose α wanders ±0.05 around 0.7 (φ ≈ 10): one regime, evidence divided by φ."""
    ws = windows([0.7] * 2000, spread=0.05, seed=seed)
    r = last_regime(ws)
    assert r.cuts == 0 and r.start == 0
    assert r.phi > 3  # the wandering is counted: far fewer effective trials than 2000 × 600
    assert r.evidence.trials == pytest.approx(sum(w.trials for w in ws) / r.phi)


def test_few_windows_and_empty_windows() -> None:
    assert last_regime([]).evidence.trials == 0
    few = windows([0.9, 0.1, 0.9])
    r = last_regime([*few, AcceptanceEvidence()])
    assert (r.start, r.cuts, r.phi) == (0, 0, 1.0)  # too few windows to cut or to measure φ
    assert r.evidence.trials == sum(w.trials for w in few)
