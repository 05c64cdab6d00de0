"""The interval of a ratio of two independently estimated speedups (policies.speedup)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from policies.speedup import independent_ratio_interval


def test_the_interval_of_a_ratio_of_independent_estimates_covers_at_the_stated_confidence() -> None:
    # two independent log-normal estimates, each with its own 95 % interval: the ratio's interval combines
    # them in quadrature and covers the true ratio ~95 % of the time; opposite ends cover ~99.8 %
    rng = np.random.default_rng(7)
    sd_num, sd_den, true_num, true_den = 0.04, 0.03, 2.0, 1.8
    z = 1.959964
    hits = wide_hits = 0
    n = 4000
    for _ in range(n):
        num = true_num * math.exp(rng.normal(0, sd_num))
        den = true_den * math.exp(rng.normal(0, sd_den))
        num_ci = (num * math.exp(-z * sd_num), num * math.exp(z * sd_num))
        den_ci = (den * math.exp(-z * sd_den), den * math.exp(z * sd_den))
        lo, hi = independent_ratio_interval(num, num_ci, den, den_ci)
        hits += lo <= true_num / true_den <= hi
        wide_hits += num_ci[0] / den_ci[1] <= true_num / true_den <= num_ci[1] / den_ci[0]
        assert num_ci[0] / den_ci[1] < lo < num / den < hi < num_ci[1] / den_ci[0]
    assert 0.93 < hits / n < 0.97 and wide_hits / n > 0.99


def test_the_interval_of_a_ratio_with_an_exact_or_undefined_side() -> None:
    assert independent_ratio_interval(2.0, (1.8, 2.2), 1.0, (1.0, 1.0)) == pytest.approx((1.8, 2.2))
    assert independent_ratio_interval(1.0, (1.0, 1.0), 2.0, (1.6, 2.5)) == pytest.approx((0.4, 0.625))
    assert independent_ratio_interval(2.0, (0.0, 3.0), 1.0, (0.9, 1.1))[0] == 0.0  # no lower end: none for the ratio
    assert independent_ratio_interval(0.0, (0.0, 0.0), 1.0, (0.9, 1.1)) == (0.0, math.inf)
