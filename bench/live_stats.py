"""Ratios of the live benchmark with 95 % intervals (pure code: samples in, estimates out).

The fixed configs are measured as short *cells* (one config, one phase's prompts and concurrency,
``cell_s`` seconds), interleaved and repeated; spectuner runs each phase once, for its whole length.
Two sources of noise enter every ratio:

- a cell's rate scatters (prompt mix, prefill bursts, machine drift between visits). Its relative
  spread is estimated per phase from the repeats of every config (pooled log-rate residuals), so
  configs with two repeats still get an honest spread;
- spectuner's phase rate is one long measurement of the same kind: its relative spread is the
  phase's cell spread scaled by ``sqrt(cell_s / phase_s)`` (noise averages down with time).

The intervals come from a parametric bootstrap over both, which also carries the oracle's
"best of several noisy configs" bias into its interval instead of hiding it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Estimate:
    value: float
    lo: float
    hi: float

    def to_json(self) -> dict[str, float]:
        return {"value": round(self.value, 4), "lo": round(self.lo, 4), "hi": round(self.hi, 4)}


def pooled_log_sd(samples: Mapping[str, Sequence[float]]) -> float | None:
    """Relative spread of one cell of a phase: the pooled sd of log rates around each config's mean.

    ``samples`` maps a config to its cell rates in this phase. None when no config was repeated."""
    ss = 0.0
    dof = 0
    for rates in samples.values():
        logs = [math.log(r) for r in rates if r > 0]
        if len(logs) < 2:
            continue
        mean = sum(logs) / len(logs)
        ss += sum((x - mean) ** 2 for x in logs)
        dof += len(logs) - 1
    return math.sqrt(ss / dof) if dof else None


@dataclass(frozen=True)
class LiveSummary:
    oracle_per_phase: dict[str, str]  # phase → the best fixed config's name (point estimates)
    best_fixed: str  # the best single fixed config over the whole run
    vs_oracle: Estimate
    vs_best_fixed: Estimate
    vs_reference: Estimate | None  # ÷ the reference fixed config (the usual K = 3 start)
    worst_phase_vs_off: Estimate | None
    worst_phase: str | None
    cell_log_sd: dict[str, float]  # phase → relative spread of one cell


def summarize_live(
    cells: Mapping[str, Mapping[str, Sequence[float]]],
    spectuner: Mapping[str, float],
    phase_s: Mapping[str, float],
    cell_s: float,
    *,
    off: str | None = "off",
    reference: str | None = None,
    draws: int = 4000,
    seed: int = 0,
    default_log_sd: float = 0.1,
) -> LiveSummary:
    """``cells[phase][config]`` = rates (tokens/s) of that config's cells; ``spectuner[phase]`` = its
    rate over the phase; ``phase_s[phase]`` = the phase's length (the weights of the totals).

    A phase without repeats takes ``default_log_sd`` (10 %) as its cell spread: wide, not false precision.
    """
    phases = list(spectuner)
    if not phases:
        raise ValueError("no phases to summarize")
    for p in phases:
        if p not in cells or not cells[p]:
            raise ValueError(f"phase {p!r} has no fixed-config cells")
        if phase_s.get(p, 0.0) <= 0:
            raise ValueError(f"phase {p!r} has no positive length")
    configs = sorted(set.intersection(*(set(cells[p]) for p in phases)))
    if not configs:
        raise ValueError("no fixed config was measured in every phase")
    if cell_s <= 0:
        raise ValueError(f"cell_s must be > 0 but got {cell_s}")
    pooled = {p: pooled_log_sd(cells[p]) for p in phases}
    sd = {p: default_log_sd if v is None else v for p, v in pooled.items()}
    weights = np.array([phase_s[p] for p in phases], dtype=float)
    weights /= weights.sum()
    # point estimates: geometric means of the cells (the noise is multiplicative)
    means = np.array([[math.exp(np.mean(np.log(np.maximum(cells[p][c], 1e-9)))) for p in phases] for c in configs])
    counts = np.array([[len(cells[p][c]) for p in phases] for c in configs], dtype=float)
    sp = np.array([spectuner[p] for p in phases], dtype=float)
    cell_sd = np.array([sd[p] for p in phases])
    sp_sd = np.array([sd[p] * math.sqrt(min(1.0, cell_s / phase_s[p])) for p in phases])

    rng = np.random.default_rng(seed)
    m = means[None] * np.exp(rng.standard_normal((draws, *means.shape)) * cell_sd[None, None] / np.sqrt(counts)[None])
    s = sp[None] * np.exp(rng.standard_normal((draws, len(phases))) * sp_sd[None])
    m = np.concatenate([means[None], m])  # draw 0: the point estimate
    s = np.concatenate([sp[None], s])

    sp_total = s @ weights
    oracle_total = m.max(axis=1) @ weights
    fixed_totals = m @ weights  # (draws, configs)
    best_total = fixed_totals.max(axis=1)

    def est(x: np.ndarray) -> Estimate:
        lo, hi = np.quantile(x[1:], [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2])
        return Estimate(float(x[0]), float(lo), float(hi))

    ref = None
    if reference is not None and reference in configs:
        ref = est(sp_total / fixed_totals[:, configs.index(reference)])
    worst = worst_name = None
    if off is not None and off in configs:
        per_phase = s / m[:, configs.index(off), :]
        worst = est(per_phase.min(axis=1))
        worst_name = phases[int(np.argmin(per_phase[0]))]
    return LiveSummary(
        oracle_per_phase={p: configs[int(np.argmax(means[:, j]))] for j, p in enumerate(phases)},
        best_fixed=configs[int(np.argmax(fixed_totals[0]))],
        vs_oracle=est(sp_total / oracle_total),
        vs_best_fixed=est(sp_total / best_total),
        vs_reference=ref,
        worst_phase_vs_off=worst,
        worst_phase=worst_name,
        cell_log_sd={p: round(sd[p], 4) for p in phases},
    )


def fixed_means(cells: Mapping[str, Mapping[str, Sequence[float]]]) -> dict[str, dict[str, float]]:
    """Geometric mean rate per phase and config (what the tables print)."""
    return {
        p: {c: math.exp(sum(math.log(max(r, 1e-9)) for r in rates) / len(rates)) for c, rates in by.items() if rates}
        for p, by in cells.items()
    }
