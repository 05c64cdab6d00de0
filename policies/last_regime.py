"""Where a draft's current acceptance regime began, from its per-window evidence.

Purely computational. A draft that served for two hours at α 0.75 and then for five minutes at 0.3
(the traffic moved) has a pooled α̂ of 0.72 with a narrow interval: ranking it on that swaps straight
back to it. What speaks for the draft now is its evidence since its acceptance last changed.

Binary segmentation on the windows, newest segment first: for every split the binomial likelihood
ratio of "two rates" against "one rate",

    G²(i) = 2 [ℓ(S_<i, T_<i) + ℓ(S_≥i, T_≥i) − ℓ(S, T)],   ℓ(s, t) = s log(s/t) + (t − s) log(1 − s/t),

divided by the between-window φ within the two segments (``policies.dispersion``: windows wander more
than binomial sampling allows, and a split must beat that wandering, not only the binomial noise). The
largest G²/φ over the splits is a changepoint when it exceeds the χ²₁ quantile at ``false_rate`` divided
by the number of splits tried (Bonferroni: the maximum over many splits is not one test). The search
then repeats on the windows after it, so the newest change wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from policies.acceptance import AcceptanceEvidence
from policies.dispersion import MIN_WINDOWS

FALSE_RATE = 1e-3  # chance that a stationary history is cut somewhere (per search)


@dataclass(frozen=True)
class LastRegime:
    """The windows ``[start, n)`` are the current regime; ``evidence`` their sum divided by their φ."""

    start: int
    evidence: AcceptanceEvidence
    phi: float
    cuts: int  # changepoints found (0: one regime)


def _loglik(s: np.ndarray, t: np.ndarray) -> np.ndarray:
    p = np.divide(s, t, out=np.zeros_like(s), where=t > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(s > 0, s * np.log(np.where(p > 0, p, 1.0)), 0.0)
        b = np.where(t - s > 0, (t - s) * np.log(np.where(p < 1, 1 - p, 1.0)), 0.0)
    return np.asarray(a + b)


def _pearson(s: np.ndarray, t: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Pearson's X² of each segment from its sums Σs, Σt, Σs²/t (0 where the rate is 0 or 1)."""
    p = np.divide(s, t, out=np.zeros_like(s), where=t > 0)
    var = p * (1 - p)
    x2 = np.maximum(0.0, q - 2 * p * s + p * p * t)
    return np.asarray(np.divide(x2, var, out=np.zeros_like(x2), where=var > 0))


def _best_split(s: np.ndarray, t: np.ndarray, false_rate: float) -> int | None:
    """The split index of the strongest change in ``(s, t)`` per window, or None when none is clear."""
    n = len(s)
    if n < 2 * MIN_WINDOWS:
        return None
    q = np.divide(s * s, t, out=np.zeros_like(s), where=t > 0)
    cs, ct, cq = np.cumsum(s), np.cumsum(t), np.cumsum(q)
    idx = np.arange(MIN_WINDOWS, n - MIN_WINDOWS + 1)  # both segments keep MIN_WINDOWS windows
    s1, t1, q1 = cs[idx - 1], ct[idx - 1], cq[idx - 1]
    s2, t2, q2 = cs[-1] - s1, ct[-1] - t1, cq[-1] - q1
    g2 = 2 * (_loglik(s1, t1) + _loglik(s2, t2) - _loglik(np.array([cs[-1]]), np.array([ct[-1]])))
    phi = np.maximum(1.0, (_pearson(s1, t1, q1) + _pearson(s2, t2, q2)) / max(n - 2, 1))
    score = g2 / phi
    best = int(np.argmax(score))
    threshold = float(stats.chi2.isf(false_rate / len(idx), df=1))
    return int(idx[best]) if score[best] > threshold else None


def last_regime(windows: Sequence[AcceptanceEvidence], false_rate: float = FALSE_RATE) -> LastRegime:
    """The current regime of a time-ordered run of per-window evidence (windows without trials skipped)."""
    return last_regime_of_arrays(evidence_array(windows), false_rate)


def evidence_array(windows: Sequence[AcceptanceEvidence]) -> np.ndarray:
    """Per-window evidence as rows (successes, failures, drafts): what :func:`last_regime_of_arrays` reads."""
    return np.array([(w.successes, w.failures, w.drafts) for w in windows], dtype=float).reshape(-1, 3)


def last_regime_of_arrays(rows: np.ndarray, false_rate: float = FALSE_RATE) -> LastRegime:
    """:func:`last_regime` on rows of (successes, failures, drafts), one per window in time order."""
    kept = rows[rows[:, 0] + rows[:, 1] > 0]
    s = kept[:, 0]
    t = kept[:, 0] + kept[:, 1]
    start = cuts = 0
    while (split := _best_split(s[start:], t[start:], false_rate)) is not None:
        start += split
        cuts += 1
    total = kept[start:].sum(axis=0)
    tail = AcceptanceEvidence(float(total[0]), float(total[1]), float(total[2]))
    m = len(s) - start
    phi = 1.0
    if m >= MIN_WINDOWS and tail.trials > 0:
        q = float((s[start:] ** 2 / t[start:]).sum())
        x2 = float(_pearson(np.array([tail.successes]), np.array([tail.trials]), np.array([q]))[0])
        phi = max(1.0, x2 / (m - 1))
    return LastRegime(start, tail.scaled(1.0 / phi), phi, cuts)
