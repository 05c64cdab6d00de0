"""Acceptance by context length: α per length band, a length-dependence test, a collapse alert and a
recommended cut-off above which speculation should be off. Pure.

A request's context length is ``prompt_tokens + output_tokens / 2``: the mean number of tokens its
verify steps attended to. Each request's evidence is exact from vLLM's per-step pairs
(``per_step_accepted`` / ``per_step_drafted``, ``detailed`` metrics), else read from its acceptance
histogram at K (``summary`` metrics: A accepted tokens, D − h[K] rejections).

The dependence test is a weighted least-squares slope of band α̂ on log₂(band's mean length) — α's
change per doubling of the context — with a normal interval (weights: trials / α̂(1 − α̂), the
binomial information). A *collapse* is a slope whose whole interval is below zero together with a
band whose interval lies wholly below ``collapse_ratio`` × the shortest band's α̂ (users report
EAGLE-3 falling from ~2.3 to ~1.1 tokens per step between 2 k and 20 k tokens). The cut-off is the
lower edge of the first band from which every longer band with evidence is clearly below
``off_below_alpha`` (its interval's upper end under it): speculation does not pay there.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from scipy import stats

from policies.acceptance import AcceptanceEvidence, alpha_interval, evidence_from_draft_steps

DEFAULT_EDGES_TOKENS: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass(frozen=True)
class RequestAcceptance:
    """What one finished request says about acceptance (from the tap's record)."""

    prompt_tokens: int
    output_tokens: int
    num_spec_tokens: int | None = None
    drafts: int = 0
    accepted_tokens: int = 0
    acceptance_histogram: tuple[int, ...] = ()
    per_step_accepted: tuple[int, ...] | None = None
    per_step_drafted: tuple[int, ...] | None = None

    @property
    def context_tokens(self) -> float:
        return self.prompt_tokens + self.output_tokens / 2

    def evidence(self) -> AcceptanceEvidence | None:
        if self.per_step_accepted is not None and self.per_step_drafted is not None:
            return evidence_from_draft_steps(self.per_step_accepted, self.per_step_drafted)
        k = self.num_spec_tokens
        if self.drafts <= 0 or not k or len(self.acceptance_histogram) != k + 1:
            return None
        full = self.acceptance_histogram[k]
        return AcceptanceEvidence(float(self.accepted_tokens), float(self.drafts - full), float(self.drafts))


@dataclass(frozen=True)
class LengthBand:
    lo_tokens: int
    hi_tokens: int | None  # None: open-ended
    requests: int
    evidence: AcceptanceEvidence
    mean_context_tokens: float | None
    alpha: float | None
    alpha_ci: tuple[float, float] | None

    def to_dict(self) -> dict[str, object]:
        return {
            "lo_tokens": self.lo_tokens,
            "hi_tokens": self.hi_tokens,
            "requests": self.requests,
            "drafts": int(self.evidence.drafts),
            "accepted_tokens": int(self.evidence.successes),
            "mean_context_tokens": None if self.mean_context_tokens is None else round(self.mean_context_tokens, 1),
            "alpha": self.alpha,
            "alpha_ci": list(self.alpha_ci) if self.alpha_ci else None,
        }


@dataclass(frozen=True)
class LengthSettings:
    edges_tokens: tuple[int, ...] = DEFAULT_EDGES_TOKENS
    """Band edges (context tokens, increasing); bands are [0, e₀), [e₀, e₁), …, [e_last, ∞)."""
    min_trials: int = 200
    """Draft-token trials a band needs to count in the test, the alert and the cut-off."""
    collapse_ratio: float = 0.6
    """A band clearly below this share of the shortest band's α̂ is a collapse (with a negative slope)."""
    off_below_alpha: float = 0.4
    """Acceptance below which speculation does not pay (the swap threshold, docs/architecture.md)."""
    confidence: float = 0.95

    def __post_init__(self) -> None:
        edges = self.edges_tokens
        if not edges or any(b <= a for a, b in itertools.pairwise(edges)) or edges[0] <= 0:
            raise ValueError(f"length band edges must be positive and increasing but got {list(edges)}")
        if not 0 < self.collapse_ratio < 1 or not 0 < self.off_below_alpha < 1 or not 0 < self.confidence < 1:
            raise ValueError("collapse_ratio, off_below_alpha and confidence must lie in (0, 1)")
        if self.min_trials < 1:
            raise ValueError(f"min_trials must be ≥ 1 but got {self.min_trials}")


@dataclass(frozen=True)
class LengthView:
    bands: tuple[LengthBand, ...]
    slope_per_doubling: float | None  # Δα per doubling of the context; None: fewer than two usable bands
    slope_ci: tuple[float, float] | None
    collapse: bool
    cutoff_tokens: int | None  # speculation off from this context length on; None: nowhere
    message: str
    skipped_requests: int = 0
    settings: LengthSettings = field(default_factory=LengthSettings)

    def to_dict(self) -> dict[str, object]:
        return {
            "bands": [b.to_dict() for b in self.bands],
            "slope_per_doubling": self.slope_per_doubling,
            "slope_ci": list(self.slope_ci) if self.slope_ci else None,
            "collapse": self.collapse,
            "cutoff_tokens": self.cutoff_tokens,
            "message": self.message,
            "skipped_requests": self.skipped_requests,
        }


def length_view(requests: Sequence[RequestAcceptance], settings: LengthSettings | None = None) -> LengthView:
    s = settings or LengthSettings()
    edges = (0, *s.edges_tokens)
    evid = [AcceptanceEvidence() for _ in edges]
    count = [0] * len(edges)
    ctx_sum = [0.0] * len(edges)
    skipped = 0
    for r in requests:
        ev = r.evidence()
        if ev is None or ev.trials == 0:
            skipped += 1
            continue
        i = max(j for j, lo in enumerate(edges) if r.context_tokens >= lo)
        evid[i] = evid[i] + ev
        count[i] += 1
        ctx_sum[i] += r.context_tokens * ev.trials
    bands = []
    for i, lo in enumerate(edges):
        ev = evid[i]
        alpha = ev.successes / ev.trials if ev.trials > 0 else None
        bands.append(
            LengthBand(
                lo,
                edges[i + 1] if i + 1 < len(edges) else None,
                count[i],
                ev,
                ctx_sum[i] / ev.trials if ev.trials > 0 else None,
                alpha,
                alpha_interval(ev, s.confidence) if ev.trials > 0 else None,
            )
        )
    usable = [b for b in bands if b.evidence.trials >= s.min_trials and b.alpha is not None]
    slope, slope_ci = _slope(usable, s.confidence)
    collapse = False
    if slope_ci is not None and slope_ci[1] < 0 and usable:
        first = usable[0].alpha
        assert first is not None
        collapse = any(b.alpha_ci is not None and b.alpha_ci[1] < s.collapse_ratio * first for b in usable[1:])
    cutoff = None
    for i, b in enumerate(usable):
        if all(x.alpha_ci is not None and x.alpha_ci[1] < s.off_below_alpha for x in usable[i:]):
            cutoff = b.lo_tokens
            break
    return LengthView(tuple(bands), slope, slope_ci, collapse, cutoff, _message(usable, slope, slope_ci, collapse,
                                                                               cutoff, s), skipped, s)


def _slope(bands: Sequence[LengthBand], confidence: float) -> tuple[float | None, tuple[float, float] | None]:
    if len(bands) < 2:
        return None, None
    xs, ys, ws = [], [], []
    for b in bands:
        assert b.alpha is not None and b.mean_context_tokens is not None
        p = min(max(b.alpha, 1e-3), 1 - 1e-3)
        xs.append(math.log2(max(b.mean_context_tokens, 1.0)))
        ys.append(b.alpha)
        ws.append(b.evidence.trials / (p * (1 - p)))
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs, strict=True)) / sw
    my = sum(w * y for w, y in zip(ws, ys, strict=True)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs, strict=True))
    if sxx <= 0:
        return None, None
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys, strict=True)) / sxx
    se = math.sqrt(1 / sxx)  # the weights are inverse variances
    z = float(stats.norm.ppf(0.5 + confidence / 2))
    return slope, (slope - z * se, slope + z * se)


def _message(
    usable: Sequence[LengthBand],
    slope: float | None,
    ci: tuple[float, float] | None,
    collapse: bool,
    cutoff: int | None,
    s: LengthSettings,
) -> str:
    if slope is None or ci is None:
        return f"Not enough evidence for a length trend: {len(usable)} band(s) with ≥ {s.min_trials} draft tokens."
    trend = f"α changes by {slope:+.3f} per doubling of the context [{ci[0]:+.3f}, {ci[1]:+.3f}]"
    if collapse:
        trend = "Acceptance collapses on long contexts: " + trend
    elif ci[1] < 0:
        trend = "Acceptance falls with context length: " + trend
    elif ci[0] > 0:
        trend = "Acceptance rises with context length: " + trend
    else:
        trend = "No length dependence detected: " + trend
    if cutoff is not None:
        trend += f"; turn speculation off above {cutoff:,} tokens (α clearly below {s.off_below_alpha:g} there)"
    return trend + "."
