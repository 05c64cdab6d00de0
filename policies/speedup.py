"""Expected tokens per verify step and the Leviathan et al. speedup model.

Purely computational. Under the i.i.d. model with acceptance α and K speculative tokens one verify
step emits E(α, K) = (1 − α^{K+1}) / (1 − α) tokens (bonus token included); at batch 1 the wall-time
improvement over plain decoding is E(α, K) / (K·c + 1) with c = draft step time / target step time
(Leviathan, Kalman & Matias 2023, Theorem 3.8).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def check_alpha(alpha: float) -> None:
    """α must be a probability; 1 is allowed here (a draft identical to the target)."""
    if not (isinstance(alpha, int | float) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha must lie in [0, 1] but got {alpha!r}")


def check_k(k: int, name: str = "K") -> None:
    if not isinstance(k, int | np.integer) or k < 0:
        raise ValueError(f"{name} must be an integer ≥ 0 but got {k!r}")


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """E(α, K) = (1 − α^{K+1}) / (1 − α); K + 1 at α = 1, 1 at K = 0."""
    check_alpha(alpha)
    check_k(k)
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_tokens_from_conditional(conditional: Sequence[float]) -> float:
    """E for a non-i.i.d. draft: 1 + Σ_{j=1..K} Π_{i<j} c_i, with c_i the conditional acceptance."""
    total, survive = 1.0, 1.0
    for c in conditional:
        survive *= c
        total += survive
    return total


def leviathan_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Wall-time improvement at batch 1: E(α, K) / (K·c + 1)."""
    check_cost_ratio(cost_ratio)
    return expected_tokens_per_step(alpha, k) / (k * cost_ratio + 1.0)


def check_cost_ratio(cost_ratio: float) -> None:
    if not (isinstance(cost_ratio, int | float) and math.isfinite(cost_ratio) and cost_ratio >= 0.0):
        raise ValueError(f"cost ratio c (draft step / target step) must be a finite number ≥ 0 but got {cost_ratio!r}")


def independent_ratio_interval(
    num: float, num_ci: tuple[float, float], den: float, den_ci: tuple[float, float]
) -> tuple[float, float]:
    """The interval of ``num / den`` when the two come from independent evidence, each with an interval at
    the same confidence (two drafts' speedups: each from its own α evidence). The log-scale distances to
    each end add in quadrature (the delta method on log num − log den). Dividing opposite ends instead
    holds the ratio to a far higher confidence than either interval (~99.8 % for two 95 % ones), which
    keeps a clearly better draft out. Non-positive inputs give ``(0, inf)`` where undefined."""
    if num <= 0 or den <= 0:
        return (0.0, math.inf)

    def below(x: float, lo: float) -> float:  # log-distance from the point to its interval's lower end
        return math.inf if lo <= 0 else max(0.0, math.log(x / lo))

    def above(x: float, hi: float) -> float:
        return max(0.0, math.log(hi / x)) if math.isfinite(hi) and hi > 0 else math.inf

    ratio = num / den
    down = math.hypot(below(num, num_ci[0]), above(den, den_ci[1]))
    up = math.hypot(above(num, num_ci[1]), below(den, den_ci[0]))
    lo = ratio * math.exp(-down) if math.isfinite(down) else 0.0
    return (lo, ratio * math.exp(up) if math.isfinite(up) else math.inf)
