"""Over-dispersion: how much more acceptance varies between groups than the binomial model allows.

Purely computational. Real drafts are not i.i.d.: a request full of boilerplate accepts almost
everything, one of random words almost nothing, and consecutive tokens are correlated. Intervals that
assume independent tokens are then too narrow. Given the same quantity measured in several groups
(requests, or scrape windows), the Pearson statistic against the pooled per-position rates estimates
the quasi-likelihood dispersion φ = X² / dof; counts divided by φ give honest interval widths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from policies.positional import PositionData


class DispersionReason(StrEnum):
    ESTIMATED = "estimated"
    TOO_FEW_GROUPS = "too_few_groups"


@dataclass(frozen=True)
class DispersionEstimate:
    """φ ≥ 1 (1: binomial, no extra variation detected) with the Pearson statistic behind it."""

    dispersion: float
    statistic: float
    dof: int
    groups: int
    reason: DispersionReason
    message: str


def estimate_dispersion(groups: Sequence[PositionData]) -> DispersionEstimate:
    """φ = max(1, X²/dof) over (group, position) cells with trials. Purely computational."""
    used = [g for g in groups if g.observed_positions > 0]
    if len(used) < 2:
        return DispersionEstimate(
            1.0,
            0.0,
            0,
            len(used),
            DispersionReason.TOO_FEW_GROUPS,
            "Fewer than two groups with drafts: over-dispersion cannot be estimated; assuming none.",
        )
    width = max(len(g.trials) for g in used)
    n = np.zeros((len(used), width))
    s = np.zeros((len(used), width))
    for row, g in enumerate(used):
        n[row, : len(g.trials)] = g.trials
        s[row, : len(g.successes)] = g.successes
    total_n = n.sum(axis=0)
    pooled = np.divide(s.sum(axis=0), total_n, out=np.zeros(width), where=total_n > 0)
    informative = (pooled > 0) & (pooled < 1)
    cells = (n > 0) & informative[None, :]
    expected_var = n * pooled * (1 - pooled)
    resid2 = (s - n * pooled) ** 2
    statistic = float(np.sum(np.divide(resid2, expected_var, out=np.zeros_like(n), where=cells)))
    dof = int(cells.sum()) - int(np.sum(informative & (total_n > 0)))
    if dof <= 0:
        return DispersionEstimate(
            1.0,
            statistic,
            0,
            len(used),
            DispersionReason.TOO_FEW_GROUPS,
            "No degrees of freedom left for over-dispersion; assuming none.",
        )
    phi = max(1.0, statistic / dof)
    return DispersionEstimate(
        phi,
        statistic,
        dof,
        len(used),
        DispersionReason.ESTIMATED,
        f"Acceptance varies {phi:.2f}× more between the {len(used)} groups than independent tokens would; "
        "intervals are widened by √φ.",
    )
