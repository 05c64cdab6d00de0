"""How far a shadow replay's α̂ lies from the draft's acceptance on the traffic it serves. Pure.

A replay (``policies.shadow_replay``) measures a candidate on a sample of recorded requests: thousands of
verify steps, so its binomial interval is a few thousandths wide. But the sample's prompt mix moves each
run off the traffic's acceptance by more than that, and every draft of one run moves together (they
replay the same requests). Live on the gpu-like lab (7 Dec 2026, five replays of the predictable prompts):
good read 0.955-0.989 and medium 0.930-0.968, each scattering ~0.013 around its mean while good − medium
stayed 0.016-0.025. Counted as its trials, such a run is false precision: a candidate 0.02 above the
running draft on one run looks surely better, and the swap it proposes is decided by that run's luck
(the simulator's lab_phases swapped medium → good → medium → good, 3 restarts, where live runs made 1).

So a run's evidence counts at most as many trials as its error allows, α̂(1 − α̂) / σ², σ being the
run-to-run error measured from consecutive runs of the same draft within one acceptance regime
(var(α̂₂ − α̂₁) = 2σ² + each run's binomial variance), shrunk toward a configured σ₀ worth
``PRIOR_PAIRS`` pairs (few runs measure σ poorly).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from itertools import pairwise

from policies.acceptance import AcceptanceEvidence

PRIOR_PAIRS = 2.0  # pairs of consecutive runs the configured σ₀ is worth
_MIN_TRIALS = 1.0


@dataclass(frozen=True)
class ReplayRun:
    """One shadow run's evidence for one candidate."""

    candidate: str
    computed_at: datetime
    evidence: AcceptanceEvidence


@dataclass(frozen=True)
class ReplayError:
    """σ of a run's α̂ against the traffic's acceptance, and what it went by."""

    sd: float
    pairs: int  # consecutive same-regime pairs measured (0: σ₀ alone)
    measured_sd: float | None  # the pairs' own σ before shrinking (None: no pair)

    def describe(self) -> str:
        if self.sd == 0:
            return "replay error not counted (shadow_error_sd = 0)"
        if self.measured_sd is None:
            return f"replay error σ {self.sd:.3f} (configured; no two replays of one regime yet)"
        return f"replay error σ {self.sd:.3f} ({self.pairs} consecutive pair(s) read {self.measured_sd:.3f})"


def replay_error(runs: Sequence[ReplayRun], regime_start: datetime | None, prior_sd: float) -> ReplayError:
    """σ from consecutive runs of each candidate that lie on the same side of ``regime_start`` (the start
    of the running acceptance regime: runs across it measured different traffic), shrunk toward
    ``prior_sd``. ``prior_sd`` = 0 turns the cap off: σ = 0 whatever the runs say."""
    if not math.isfinite(prior_sd) or prior_sd < 0:
        raise ValueError(f"prior_sd must be a finite number ≥ 0 but got {prior_sd!r}")
    if prior_sd == 0:
        return ReplayError(0.0, 0, None)
    by_candidate: dict[str, list[ReplayRun]] = {}
    for run in sorted(runs, key=lambda r: r.computed_at):
        if run.evidence.trials >= _MIN_TRIALS:
            by_candidate.setdefault(run.candidate, []).append(run)
    excess: list[float] = []  # per pair: (α̂₂ − α̂₁)² − both binomial variances = 2σ² in expectation
    for seq in by_candidate.values():
        for a, b in pairwise(seq):
            if regime_start is not None and (a.computed_at < regime_start) != (b.computed_at < regime_start):
                continue
            pa, pb = _alpha(a.evidence), _alpha(b.evidence)
            excess.append((pb - pa) ** 2 - _binomial_var(a.evidence) - _binomial_var(b.evidence))
    if not excess:
        return ReplayError(prior_sd, 0, None)
    measured_var = max(sum(excess) / (2.0 * len(excess)), 0.0)
    var = (len(excess) * measured_var + PRIOR_PAIRS * prior_sd**2) / (len(excess) + PRIOR_PAIRS)
    return ReplayError(math.sqrt(var), len(excess), math.sqrt(measured_var))


def capped(evidence: AcceptanceEvidence, sd: float) -> AcceptanceEvidence:
    """``evidence`` counted at most α̂(1 − α̂) / sd² trials: what a run off by sd can stand for."""
    if sd <= 0 or evidence.trials <= 0:
        return evidence
    p = min(max(_alpha(evidence), 0.01), 0.99)
    limit = p * (1.0 - p) / sd**2
    return evidence.scaled(limit / evidence.trials) if evidence.trials > limit else evidence


def _alpha(evidence: AcceptanceEvidence) -> float:
    return evidence.successes / evidence.trials


def _binomial_var(evidence: AcceptanceEvidence) -> float:
    p = _alpha(evidence)
    return p * (1.0 - p) / evidence.trials
