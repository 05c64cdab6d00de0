"""Acceptance by context length: bands, the dependence test, the collapse alert and the cut-off."""

from __future__ import annotations

import numpy as np
import pytest

from policies.length_bands import LengthSettings, RequestAcceptance, length_view

pytestmark = pytest.mark.unit
K = 3


def request(rng: np.random.Generator, prompt: int, alpha: float, steps: int = 40) -> RequestAcceptance:
    accepted = []
    for _ in range(steps):
        n = 0
        while n < K and rng.random() < alpha:
            n += 1
        accepted.append(n)
    return RequestAcceptance(prompt, 2 * steps, K, steps, sum(accepted), (), tuple(accepted), (K,) * steps)


def test_a_collapse_on_long_inputs_is_detected_with_a_cutoff() -> None:
    rng = np.random.default_rng(0)
    # α 0.8 below 2 k tokens, 0.55 at 4 k, 0.2 from 16 k on (the EAGLE-3 reports' shape)
    plan = [(600, 0.8), (1500, 0.8), (3000, 0.7), (6000, 0.55), (12000, 0.4), (20000, 0.2), (40000, 0.15)]
    reqs = [request(rng, p, a) for p, a in plan for _ in range(30)]
    view = length_view(reqs)
    assert view.slope_per_doubling is not None and view.slope_ci is not None
    assert view.slope_ci[1] < 0
    assert view.collapse
    assert view.cutoff_tokens == 16384
    assert "collapses" in view.message and "16,384" in view.message
    # every request lands in exactly one band
    assert sum(b.requests for b in view.bands) == len(reqs)
    band = next(b for b in view.bands if b.lo_tokens == 1024)
    assert band.alpha_ci is not None and band.alpha_ci[0] < 0.8 < band.alpha_ci[1]


def test_no_dependence_is_not_flagged() -> None:
    rng = np.random.default_rng(1)
    reqs = [request(rng, p, 0.7) for p in (300, 900, 1800, 5000, 9000) for _ in range(30)]
    view = length_view(reqs)
    assert view.slope_ci is not None and view.slope_ci[0] < 0 < view.slope_ci[1]
    assert not view.collapse and view.cutoff_tokens is None
    assert view.message.startswith("No length dependence")


def test_histogram_only_requests_count_and_unusable_ones_are_skipped() -> None:
    # summary metrics: 10 steps at K=3, 4 accepted all 3, the rest accepted 1 → A = 4·3 + 6·1 = 18, F = 6
    hist = RequestAcceptance(100, 20, K, 10, 18, (0, 6, 0, 4))
    none = RequestAcceptance(100, 20)  # speculation off
    view = length_view([hist, none], LengthSettings(edges_tokens=(64, 128), min_trials=1))
    band = next(b for b in view.bands if b.lo_tokens == 64)
    assert (band.evidence.successes, band.evidence.failures, band.requests) == (18.0, 6.0, 1)
    assert view.skipped_requests == 1
    assert view.slope_per_doubling is None and "Not enough evidence" in view.message


def test_bad_edges_are_refused() -> None:
    with pytest.raises(ValueError, match="increasing"):
        LengthSettings(edges_tokens=(100, 50))
