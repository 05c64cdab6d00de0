"""Per-position acceptance: goodness of fit of constant α, and a decay model that extrapolates K.

Purely computational. Position i (0-based) of a draft is *tried* when positions 0..i−1 were all
accepted and the draft had a position i; with a fixed K the trials are n_0 = D and n_i = a_{i−1}, the
successes s_i = a_i, and the likelihood factorises into independent binomials per position with
conditional acceptance c_i. Constant α is the special case c_i = α for every i.

- :func:`check_constant_alpha`: likelihood-ratio (G²) test of c_i = α against free c_i, χ² with
  m − 1 degrees of freedom (m positions with trials), optionally divided by an over-dispersion factor.
- :func:`fit_decay`: logit c_i = β0 + β1·i, fitted by penalised Newton (a N(0, 0.5²) prior on the slope
  keeps one-position data identifiable and makes extrapolation uncertain when no decay was observed).
- :class:`PositionalModel`: empirical c_i (Beta posteriors) at observed positions; beyond them the
  logit continues from the last observed position with the fitted slope times u ∈ [0, 1] (keep
  decaying, or level off), u uniform in the draws, plus a wandering slope (random walk with
  per-position sd ``CURVATURE_PRIOR_SD``); E(K) and its interval come from seeded draws, so the
  interval widens with the distance beyond the observed K.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np
from numpy.typing import NDArray
from scipy import special, stats

from policies.counters import SpecCounters
from policies.speedup import check_k

SLOPE_PRIOR_SD = 0.5  # logits per position: decays seen in practice are within ±1
# Logits per position²: how far the decay may bend beyond the last observed position.
CURVATURE_PRIOR_SD = 0.1
_DRAWS = 4000
_SEED = 20240611  # fixed: the model is a pure function of its data


@dataclass(frozen=True)
class PositionData:
    """Trials n_i and successes s_i per 0-based position; adds across windows and K values."""

    trials: tuple[float, ...]
    successes: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.trials) != len(self.successes):
            raise ValueError("trials and successes need one entry per position")
        for n, s in zip(self.trials, self.successes, strict=True):
            if not (0 <= s <= n):
                raise ValueError(f"per-position counts need 0 ≤ successes ≤ trials but got {s} of {n}")

    @property
    def observed_positions(self) -> int:
        """Positions 0..m−1 with at least one trial."""
        m = 0
        for n in self.trials:
            if n <= 0:
                break
            m += 1
        return m

    def __add__(self, other: PositionData) -> PositionData:
        size = max(len(self.trials), len(other.trials))

        def pad(x: tuple[float, ...]) -> list[float]:
            return list(x) + [0.0] * (size - len(x))

        return PositionData(
            tuple(a + b for a, b in zip(pad(self.trials), pad(other.trials), strict=True)),
            tuple(a + b for a, b in zip(pad(self.successes), pad(other.successes), strict=True)),
        )

    @classmethod
    def from_counters(cls, counters: SpecCounters) -> PositionData:
        """n_0 = D, n_i = a_{i−1} (scaled by D_i/D_{i−1} when K varied and D_i is known), s_i = a_i
        (:meth:`from_windows` of one window)."""
        return cls.from_windows((counters,))

    @classmethod
    def from_windows(cls, windows: Iterable[SpecCounters]) -> PositionData:
        """Pooled over windows: per position the trials n_i and successes s_i summed, as
        :meth:`from_counters` reads each window.

        Where K varied inside a window, n_i = a_{i−1}·D_i/D_{i−1} is the drafts *expected* to reach position
        i, and a small window can accept more there than expected (live, 6 Dec 2026: a 2-s window split at
        K = 4 / 5 accepted 5 drafts at position 5 where 3.66 were expected; ``PositionData`` refused it and
        every decision whose evidence held the window failed). The sums are unbiased, so n_i ≥ s_i is
        enforced on them only, not window by window: raised per window to s_i, 2-s windows read c_5 0.02
        low (0.884 for a true 0.9)."""
        trials: list[float] = []
        successes: list[float] = []
        for counters in windows:
            per_pos = counters.accepted_per_pos
            if counters.drafts <= 0 or not per_pos:
                continue
            drafted = counters.draft_tokens_per_pos
            prev_accepted, prev_drafted = float(counters.drafts), float(counters.drafts)
            for i, a_i in enumerate(per_pos):
                d_i = float(drafted[i]) if drafted is not None and i < len(drafted) else float(counters.drafts)
                reach = prev_accepted * (d_i / prev_drafted) if prev_drafted > 0 else 0.0
                if i == len(trials):
                    trials.append(0.0)
                    successes.append(0.0)
                trials[i] += reach
                successes[i] += float(a_i)
                prev_accepted, prev_drafted = float(a_i), d_i
        return cls(tuple(max(n, s) for n, s in zip(trials, successes, strict=True)), tuple(successes))

    @classmethod
    def from_histogram(cls, histogram: Iterable[float]) -> PositionData:
        """From a per-request acceptance histogram h_n (drafts that accepted exactly n of K, n = 0..K)."""
        h = [float(x) for x in histogram]
        if any(x < 0 for x in h):
            raise ValueError(f"acceptance histogram counts cannot be negative but got {h}")
        k = len(h) - 1
        if k < 1:
            return cls((), ())
        at_least = [sum(h[j:]) for j in range(len(h))]  # drafts that accepted ≥ j
        return cls(tuple(at_least[i] for i in range(k)), tuple(at_least[i + 1] for i in range(k)))

    def conditional(self) -> tuple[float | None, ...]:
        return tuple(s / n if n > 0 else None for n, s in zip(self.trials, self.successes, strict=True))


class FitReason(StrEnum):
    CONSTANT_ALPHA_FITS = "constant_alpha_fits"
    CONSTANT_ALPHA_REJECTED = "constant_alpha_rejected"
    TOO_FEW_POSITIONS = "too_few_positions"


@dataclass(frozen=True)
class ConstantAlphaCheck:
    """G² test of constant α against free per-position acceptance."""

    reason: FitReason
    message: str
    statistic: float
    dof: int
    p_value: float | None
    alpha: float | None
    conditional: tuple[float | None, ...]
    max_abs_deviation: float


def check_constant_alpha(data: PositionData, significance: float = 0.01, dispersion: float = 1.0) -> ConstantAlphaCheck:
    """Does one α explain every position? Purely computational.

    ``dispersion`` (≥ 1, see ``policies.dispersion``) divides G²: correlated tokens inflate the
    statistic and would reject everything on a large sample otherwise.
    """
    if not 0 < significance < 1:
        raise ValueError(f"significance must lie in (0, 1) but got {significance!r}")
    if dispersion < 1.0 or not math.isfinite(dispersion):
        raise ValueError(f"dispersion must be a finite number ≥ 1 but got {dispersion!r}")
    m = data.observed_positions
    n = np.array(data.trials[:m])
    s = np.array(data.successes[:m])
    cond = data.conditional()
    if m == 0 or n.sum() <= 0:
        return ConstantAlphaCheck(
            FitReason.TOO_FEW_POSITIONS, "No drafts: nothing to test.", 0.0, 0, None, None, cond, 0.0
        )
    alpha = float(s.sum() / n.sum())
    c = s / n
    dev = float(np.max(np.abs(c - alpha)))
    if m < 2:
        return ConstantAlphaCheck(
            FitReason.TOO_FEW_POSITIONS,
            "One position observed (K = 1): constant α cannot be tested; run at K ≥ 2.",
            0.0,
            0,
            None,
            alpha,
            cond,
            dev,
        )
    f = n - s
    g2 = 0.0  # α = 0 or 1 forces every c_i to equal it
    if 0 < alpha < 1:
        g2 = 2.0 * float(np.sum(special.xlogy(s, c / alpha) + special.xlogy(f, (1 - c) / (1 - alpha))))
    g2 /= dispersion
    dof = m - 1
    p = float(stats.chi2.sf(g2, dof))
    shown = ", ".join(f"{x:.3f}" for x in c)
    if p >= significance:
        return ConstantAlphaCheck(
            FitReason.CONSTANT_ALPHA_FITS,
            f"Constant α = {alpha:.3f} fits the per-position acceptance ({shown}; p = {p:.2g}).",
            g2,
            dof,
            p,
            alpha,
            cond,
            dev,
        )
    return ConstantAlphaCheck(
        FitReason.CONSTANT_ALPHA_REJECTED,
        f"Acceptance depends on position ({shown}; constant α = {alpha:.3f} rejected, p = {p:.2g}): "
        "predict other K from the per-position model.",
        g2,
        dof,
        p,
        alpha,
        cond,
        dev,
    )


@dataclass(frozen=True)
class DecayFit:
    """logit c_i = intercept + slope·i with its covariance (dispersion-inflated)."""

    intercept: float
    slope: float
    covariance: tuple[tuple[float, float], tuple[float, float]]
    observed_positions: int
    dispersion: float

    def conditional(self, position: int) -> float:
        return float(special.expit(self.intercept + self.slope * position))


def fit_decay(
    data: PositionData,
    dispersion: float = 1.0,
    slope_prior_sd: float = SLOPE_PRIOR_SD,
    first_position: int = 0,
) -> DecayFit:
    """Penalised maximum-likelihood logistic decay over positions ``first_position``..m−1.

    Purely computational. Skipping position 0 (``first_position=1``) gives the trend of the later
    positions, which is what extrapolation needs: the first drafted token is often much easier.
    """
    m = data.observed_positions
    if m == 0:
        raise ValueError("no drafts: cannot fit a per-position decay")
    if not 0 <= first_position < m:
        raise ValueError(f"first position {first_position} is outside the {m} observed positions")
    n = np.array(data.trials[first_position:m], dtype=float)
    s = np.array(data.successes[first_position:m], dtype=float)
    x = np.column_stack([np.ones(m - first_position), np.arange(first_position, m, dtype=float)])
    prior_precision = np.diag([1e-6, 1.0 / slope_prior_sd**2])
    # Start from the pooled rate, lightly shrunk off 0 and 1 so the logit is finite.
    pooled = (s.sum() + 0.5) / (n.sum() + 1.0)
    beta = np.array([math.log(pooled / (1 - pooled)), 0.0])
    info = prior_precision
    for _ in range(100):
        p = special.expit(x @ beta)
        grad = x.T @ (s - n * p) - prior_precision @ beta
        w = n * p * (1 - p)
        info = x.T @ (x * w[:, None]) + prior_precision
        step = np.linalg.solve(info, grad)
        beta = beta + step
        if float(np.max(np.abs(step))) < 1e-10:
            break
    cov = np.linalg.inv(info) * dispersion
    return DecayFit(
        float(beta[0]),
        float(beta[1]),
        ((float(cov[0, 0]), float(cov[0, 1])), (float(cov[1, 0]), float(cov[1, 1]))),
        m,
        dispersion,
    )


@dataclass(frozen=True)
class AcceptancePrediction:
    """What a run at ``k`` should measure, with intervals (prediction intervals when ``drafts`` given)."""

    k: int
    extrapolated: bool
    expected_tokens_per_step: float
    expected_tokens_ci: tuple[float, float]
    mean_acceptance_length: float
    mean_acceptance_length_ci: tuple[float, float]
    draft_acceptance_rate: float
    draft_acceptance_rate_ci: tuple[float, float]
    drafts: int | None
    message: str


@dataclass(frozen=True, eq=False)
class PositionalModel:
    """Empirical conditional acceptance where observed, fitted decay beyond. Implements AcceptanceModel.

    Build with :meth:`fit`; ``draws`` holds seeded posterior draws of c_0..c_{max_k−1} (rows = draws).
    """

    data: PositionData
    decay: DecayFit
    dispersion: float
    confidence: float
    point: NDArray[np.float64] = field(repr=False)
    draws: NDArray[np.float64] = field(repr=False)
    # E(K) and its interval per K, computed once: a K table asks the same model for every batch size
    # (64 × K_max + 1 percentiles over the draws per decision were half the decide tick's CPU live)
    _tokens: dict[int, tuple[float, tuple[float, float]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @classmethod
    def fit(
        cls, data: PositionData, max_k: int = 32, dispersion: float = 1.0, confidence: float = 0.95
    ) -> PositionalModel:
        if dispersion < 1.0 or not math.isfinite(dispersion):
            raise ValueError(f"dispersion must be a finite number ≥ 1 but got {dispersion!r}")
        if not 0 < confidence < 1:
            raise ValueError(f"confidence must lie in (0, 1) but got {confidence!r}")
        # With three or more positions the trend for extrapolation leaves position 0 out.
        m_seen = data.observed_positions
        decay = fit_decay(data, dispersion, first_position=1 if m_seen >= 3 else 0) if m_seen else fit_decay(data)
        m = min(decay.observed_positions, max_k)
        rng = np.random.default_rng(_SEED)
        n = np.array(data.trials[:m], dtype=float) / dispersion
        s = np.array(data.successes[:m], dtype=float) / dispersion
        point = np.empty(max_k)
        draws = np.empty((_DRAWS, max_k))
        point[:m] = s / np.maximum(n, 1e-300)
        draws[:, :m] = rng.beta(s + 0.5, n - s + 0.5, size=(_DRAWS, m))
        if max_k > m:
            # Beyond the data, start from the last observed position and follow the fitted slope
            # scaled by u ∈ [0, 1]: drafts' acceptance may keep decaying at the observed rate or
            # level off (often: position 0 is easy, later ones alike). Point: u = 1/2. The draws
            # take u ~ U(0, 1), the slope's own uncertainty, and a slope that wanders (curvature
            # increments ~ N(0, τ²) per position), so the interval widens with the distance.
            dist = np.arange(1, max_k - m + 1, dtype=float)
            last_n, last_s = float(data.trials[m - 1]) / dispersion, float(data.successes[m - 1]) / dispersion
            anchor = special.logit((last_s + 0.5) / (last_n + 1.0))
            point[m:] = special.expit(anchor + 0.5 * decay.slope * dist)
            slopes = rng.normal(decay.slope, math.sqrt(decay.covariance[1][1]), size=(_DRAWS, 1))
            shrink = rng.uniform(0.0, 1.0, size=(_DRAWS, 1))
            bend = rng.normal(0.0, CURVATURE_PRIOR_SD, size=(_DRAWS, max_k - m))
            bend = np.cumsum(np.cumsum(bend, axis=1), axis=1)
            start = special.logit(np.clip(draws[:, m - 1 : m], 1e-9, 1 - 1e-9))
            draws[:, m:] = special.expit(start + shrink * slopes * dist[None, :] + bend)
        return cls(data, decay, dispersion, confidence, point, draws)

    @property
    def max_k(self) -> int:
        return int(self.point.size)

    def _check(self, k: int) -> None:
        check_k(k)
        if k > self.max_k:
            raise ValueError(f"K = {k} is beyond this model's max_k = {self.max_k}; fit with a larger max_k")

    def _moments(self, c: NDArray[np.float64], k: int) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Mean and variance of accepted tokens per draft (rows of c: survival S_j = Π_{i<j} c_i)."""
        if k == 0:
            zero = np.zeros(c.shape[0])
            return zero, zero
        surv = np.cumprod(c[:, :k], axis=1)
        mean = surv.sum(axis=1)
        second = (surv * (2 * np.arange(1, k + 1) - 1)).sum(axis=1)
        return mean, np.maximum(second - mean**2, 0.0)

    def _expected(self, k: int) -> tuple[float, tuple[float, float]]:
        cached = self._tokens.get(k)
        if cached is None:
            self._check(k)
            point = float(1.0 + self._moments(self.point[None, :], k)[0][0])
            mean, _ = self._moments(self.draws, k)
            tail = (1 - self.confidence) / 2 * 100
            lo, hi = np.percentile(1.0 + mean, [tail, 100 - tail])
            cached = self._tokens[k] = (point, (float(lo), float(hi)))
        return cached

    def expected_tokens(self, k: int) -> float:
        return self._expected(k)[0]

    def expected_tokens_interval(self, k: int) -> tuple[float, float]:
        return self._expected(k)[1]

    def predict(self, k: int, drafts: int | None = None) -> AcceptancePrediction:
        """What a run at K will show. With ``drafts`` the intervals also carry that run's sampling noise
        (inflated by the dispersion), so a measured value should fall inside them at the stated rate."""
        self._check(k)
        if k == 0:
            raise ValueError("K = 0 has no acceptance to predict")
        mean, var = self._moments(self.draws, k)
        tail = (1 - self.confidence) / 2 * 100
        e_lo, e_hi = (1.0 + float(v) for v in np.percentile(mean, [tail, 100 - tail]))
        if drafts is not None:
            if drafts <= 0:
                raise ValueError(f"drafts must be > 0 but got {drafts}")
            rng = np.random.default_rng(_SEED + 1)
            mean = mean + rng.standard_normal(mean.size) * np.sqrt(var * self.dispersion / drafts)
        lo, hi = (float(v) for v in np.percentile(mean, [tail, 100 - tail]))
        point = float(self._moments(self.point[None, :], k)[0][0])
        extrapolated = k > self.decay.observed_positions
        kind = "prediction" if drafts is not None else "confidence"
        message = (
            f"At K = {k} expect draft acceptance rate {point / k:.3f} ({self.confidence:.0%} {kind} interval "
            f"{max(lo, 0) / k:.3f}–{min(hi, k) / k:.3f}) and mean acceptance length {1 + point:.2f}"
            + (f"; extrapolated beyond the observed K = {self.decay.observed_positions}" if extrapolated else "")
            + "."
        )
        return AcceptancePrediction(
            k=k,
            extrapolated=extrapolated,
            expected_tokens_per_step=1.0 + point,
            expected_tokens_ci=(e_lo, e_hi),
            mean_acceptance_length=1.0 + point,
            mean_acceptance_length_ci=(1.0 + max(lo, 0.0), 1.0 + min(hi, k)),
            draft_acceptance_rate=point / k,
            draft_acceptance_rate_ci=(max(lo, 0.0) / k, min(hi, k) / k),
            drafts=drafts,
            message=message,
        )
