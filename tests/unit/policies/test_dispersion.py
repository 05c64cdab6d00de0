"""Over-dispersion φ (policies/dispersion.py): between scrape windows, for decisions."""

from __future__ import annotations

import numpy as np

from policies.dispersion import DispersionSums, window_dispersion


def test_binomial_windows_have_no_overdispersion() -> None:
    rng = np.random.default_rng(1)
    phi = window_dispersion((float(s), 5000.0) for s in rng.binomial(5000, 0.6, size=200))
    assert phi < 1.3


def test_too_few_windows_assume_binomial() -> None:
    assert DispersionSums().add(10, 20).add(19, 20).phi == 1.0
