"""Between-window over-dispersion φ of acceptance: how much more α̂ varies from window to window than
binomial sampling of independent tokens explains (the prompt mix changes between windows).

Purely computational. The quasi-likelihood estimate is Pearson's statistic against the pooled rate,

    X² = Σ_i (s_i − n_i·p)² / (n_i·p·(1 − p)),   p = Σ s_i / Σ n_i,   φ = max(1, X² / (m − 1)),

over m windows of n_i checked tokens with s_i accepted. Counts divided by φ give honest interval widths
(an interval from 492 k drafts pooled as independent trials is far too narrow when windows wander), and
a likelihood-ratio statistic divided by φ keeps a change detector's false-alarm rate near its target.
:class:`DispersionSums` holds the four running sums, so the estimate can be kept window by window.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MIN_WINDOWS = 5  # fewer windows: φ is not estimated (1, binomial sampling alone)


@dataclass(frozen=True)
class DispersionSums:
    """Σ n, Σ s, Σ s²/n over windows with checked tokens, and how many there were."""

    windows: int = 0
    trials: float = 0.0
    successes: float = 0.0
    successes_sq_per_trial: float = 0.0

    def add(self, successes: float, trials: float) -> DispersionSums:
        """The sums with one more window (a window without checked tokens adds nothing)."""
        if trials <= 0:
            return self
        return DispersionSums(
            self.windows + 1,
            self.trials + trials,
            self.successes + successes,
            self.successes_sq_per_trial + successes * successes / trials,
        )

    @property
    def phi(self) -> float:
        """φ ≥ 1; 1 when fewer than :data:`MIN_WINDOWS` windows or a rate of exactly 0 or 1."""
        if self.windows < MIN_WINDOWS or self.trials <= 0:
            return 1.0
        p = self.successes / self.trials
        if not 0.0 < p < 1.0:
            return 1.0
        # Σ (s − n p)² / n = Σ s²/n − 2 p Σ s + p² Σ n
        x2 = (self.successes_sq_per_trial - 2 * p * self.successes + p * p * self.trials) / (p * (1 - p))
        return max(1.0, x2 / (self.windows - 1))


def window_dispersion(windows: Iterable[tuple[float, float]]) -> float:
    """φ of (successes, trials) per window (see the module doc)."""
    sums = DispersionSums()
    for s, n in windows:
        sums = sums.add(s, n)
    return sums.phi


__all__ = ["MIN_WINDOWS", "DispersionSums", "window_dispersion"]
