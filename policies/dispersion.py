"""Over-dispersion: how much more acceptance varies between groups than the binomial model allows.

Purely computational. Real drafts are not i.i.d.: a request full of boilerplate accepts almost
everything, one of random words almost nothing, consecutive tokens are correlated, and the prompt mix
changes from one scrape window to the next. Intervals that assume independent tokens are then too
narrow (an interval from 492 k drafts pooled as independent trials is false precision when windows
wander). Given the same quantity measured in several groups (requests, or scrape windows), the
quasi-likelihood dispersion is Pearson's statistic against the pooled rate over its degrees of freedom,

    X² = Σ_i (s_i − n_i·p)² / (n_i·p·(1 − p)),   p = Σ s_i / Σ n_i,   φ = max(1, X² / dof),

summed per draft position for per-position data. Counts divided by φ give honest interval widths, and a
likelihood-ratio statistic divided by φ keeps a change detector's false-alarm rate near its target.

Two entry points share the one statistic (:class:`DispersionSums`, four running sums that can be kept
window by window): :func:`window_dispersion` for one rate per scrape window (decisions: α̂'s interval,
the change detector, the swap trigger) and :func:`estimate_dispersion` for per-position groups (the
per-position acceptance model).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from policies.positional import PositionData

MIN_WINDOWS = 5  # fewer windows: between-window φ is not estimated (1, binomial sampling alone)


@dataclass(frozen=True)
class DispersionSums:
    """Σ n, Σ s, Σ s²/n over groups with trials, and how many there were."""

    windows: int = 0
    trials: float = 0.0
    successes: float = 0.0
    successes_sq_per_trial: float = 0.0

    def add(self, successes: float, trials: float) -> DispersionSums:
        """The sums with one more group (a group without trials adds nothing)."""
        if trials <= 0:
            return self
        return DispersionSums(
            self.windows + 1,
            self.trials + trials,
            self.successes + successes,
            self.successes_sq_per_trial + successes * successes / trials,
        )

    @property
    def informative(self) -> bool:
        """Some trials and a pooled rate strictly between 0 and 1 (else X² is undefined)."""
        return self.trials > 0 and 0.0 < self.successes < self.trials

    @property
    def statistic(self) -> float:
        """Pearson's X² against the pooled rate; 0 when not :attr:`informative`."""
        if not self.informative:
            return 0.0
        p = self.successes / self.trials
        # Σ (s − n p)² / n = Σ s²/n − 2 p Σ s + p² Σ n
        return max(0.0, self.successes_sq_per_trial - 2 * p * self.successes + p * p * self.trials) / (p * (1 - p))

    @property
    def dof(self) -> int:
        """Groups − 1 when :attr:`informative`, else 0."""
        return self.windows - 1 if self.informative else 0

    @property
    def phi(self) -> float:
        """Between-window φ ≥ 1; 1 when fewer than :data:`MIN_WINDOWS` windows or a rate of exactly 0 or 1."""
        if self.windows < MIN_WINDOWS or self.dof <= 0:
            return 1.0
        return max(1.0, self.statistic / self.dof)


def window_dispersion(windows: Iterable[tuple[float, float]]) -> float:
    """Between-window φ of (successes, trials) per window (see the module doc)."""
    sums = DispersionSums()
    for s, n in windows:
        sums = sums.add(s, n)
    return sums.phi


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
    """φ = max(1, ΣX²/Σdof) over draft positions, each position's groups against its pooled rate."""
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
    per_position = [DispersionSums() for _ in range(width)]
    for g in used:
        for j, (n, s) in enumerate(zip(g.trials, g.successes, strict=True)):
            per_position[j] = per_position[j].add(s, n)
    statistic = sum(p.statistic for p in per_position)
    dof = sum(p.dof for p in per_position)
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


__all__ = [
    "MIN_WINDOWS",
    "DispersionEstimate",
    "DispersionReason",
    "DispersionSums",
    "estimate_dispersion",
    "window_dispersion",
]
