"""A seeded simulator of draft acceptance, for tests, benchmarks and the estimator's self-checks.

Pure given its ``numpy.random.Generator``. A draft with K positions accepts position i with
conditional probability c_i given that all earlier positions were accepted and stops at the first
rejection; constant α is c_i = α. Vectorised: thousands of runs of thousands of drafts in one call.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from policies.counters import SpecCounters


def _conditional(acceptance: float | Sequence[float], k: int) -> NDArray[np.float64]:
    if isinstance(acceptance, int | float):
        return np.full(k, float(acceptance))
    c = np.asarray(acceptance, dtype=float)
    if c.size < k:
        raise ValueError(f"need conditional acceptance for {k} positions but got {c.size}")
    return c[:k]


def accepted_per_draft(
    rng: np.random.Generator, acceptance: float | Sequence[float], k: int, drafts: int, runs: int = 1
) -> NDArray[np.int64]:
    """Accepted tokens of every draft, shape (runs, drafts), each in 0..K."""
    if k < 0 or drafts < 0 or runs < 1:
        raise ValueError("need K ≥ 0, drafts ≥ 0 and runs ≥ 1")
    if k == 0:
        return np.zeros((runs, drafts), dtype=np.int64)
    if isinstance(acceptance, int | float):
        alpha = float(acceptance)
        if alpha >= 1.0:
            return np.full((runs, drafts), k, dtype=np.int64)
        if alpha <= 0.0:
            return np.zeros((runs, drafts), dtype=np.int64)
        # successes before the first failure, truncated at K
        return np.minimum(rng.geometric(1.0 - alpha, size=(runs, drafts)) - 1, k).astype(np.int64)
    c = _conditional(acceptance, k)
    survive = np.concatenate([[1.0], np.cumprod(c)])  # P(n ≥ j), j = 0..K
    u = rng.random((runs, drafts))
    # n = number of j ≥ 1 with u < P(n ≥ j): inverse-CDF sampling of the stopping position
    return (u[..., None] < survive[None, None, 1:]).sum(axis=-1).astype(np.int64)


def counters_from_accepted(accepted: NDArray[np.int64], k: int) -> SpecCounters:
    """The /metrics counters of one run (a 1-D array of accepted tokens per draft)."""
    n = np.asarray(accepted).ravel()
    return SpecCounters(
        drafts=int(n.size),
        draft_tokens=int(k * n.size),
        accepted_tokens=int(n.sum()),
        accepted_per_pos=tuple(int((n >= i + 1).sum()) for i in range(k)),
        num_spec_tokens=k,
        generated_tokens=int(n.sum() + n.size),
    )


def simulate_counters(
    rng: np.random.Generator, acceptance: float | Sequence[float], k: int, drafts: int
) -> SpecCounters:
    """One window of counters."""
    return counters_from_accepted(accepted_per_draft(rng, acceptance, k, drafts)[0], k)


def simulate_evidence(
    rng: np.random.Generator, acceptance: float | Sequence[float], k: int, drafts: int, runs: int
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """(S, F) per run: accepted tokens and drafts that ended in a rejection."""
    n = accepted_per_draft(rng, acceptance, k, drafts, runs)
    return n.sum(axis=1).astype(float), (n < k).sum(axis=1).astype(float)
