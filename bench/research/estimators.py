"""α from other sources than one /metrics window: per-request histograms, per-step records, pools.

Purely computational. The tuner hands plain values (histogram tuples, per-step ``SpecCounters``); this
module does not know the store's records.

- A per-request acceptance histogram h_0..h_K (drafts that accepted exactly n of K tokens) is a
  complete summary under the i.i.d. model: D = Σh, A = Σ n·h_n, a_i = Σ_{n>i} h_n.
- Per-step records carry each step's K, so steps of a per-batch-size table pool exactly by K (the
  log-likelihoods of different K add), which /metrics windows cannot do.
- Several groups (requests, windows) also give the over-dispersion, which widens the interval.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from policies.acceptance import (
    AcceptanceEvidence,
    AlphaEstimate,
    AlphaReason,
    IntervalMethod,
    alpha_interval,
    estimate_alpha,
    evidence_from_counters,
)
from policies.counters import SpecCounters
from policies.dispersion import estimate_dispersion
from policies.positional import PositionData


def counters_from_histogram(histogram: Iterable[int]) -> SpecCounters:
    """Exact counters of one request (or a sum of requests at the same K) from its histogram."""
    h = [int(x) for x in histogram]
    if len(h) < 2:
        raise ValueError(f"an acceptance histogram has K + 1 ≥ 2 entries (accepted 0..K) but got {h}")
    if any(x < 0 for x in h):
        raise ValueError(f"acceptance histogram counts cannot be negative but got {h}")
    k = len(h) - 1
    d = sum(h)
    return SpecCounters(
        drafts=d,
        draft_tokens=k * d,
        accepted_tokens=sum(n * x for n, x in enumerate(h)),
        accepted_per_pos=tuple(sum(h[i + 1 :]) for i in range(k)),
        num_spec_tokens=k,
    )


def estimate_alpha_pooled(
    items: Iterable[SpecCounters],
    confidence: float = 0.95,
    method: IntervalMethod = IntervalMethod.BETA,
    widen_for_dispersion: bool = True,
) -> AlphaEstimate:
    """One α from many windows/steps/requests, possibly at different K. Purely computational.

    Each item's (S, F) is extracted at its own K and summed. With ``widen_for_dispersion`` the interval
    uses counts divided by the between-item over-dispersion φ (items are the groups). The rates and
    per-position acceptance are of the pooled counts; ``num_spec_tokens`` is the largest K seen.
    """
    items = list(items)
    evidence = AcceptanceEvidence()
    positions = PositionData((), ())
    groups: list[PositionData] = []
    total = SpecCounters()
    for counters in items:
        result = evidence_from_counters(counters)
        if result.reason is AlphaReason.NO_DRAFTS:
            continue
        if result.evidence is None:
            failed = estimate_alpha(counters, confidence, method)
            return replace(failed, message=f"One of the pooled items cannot be used: {failed.message}")
        evidence = evidence + result.evidence
        group = PositionData.from_counters(counters)
        groups.append(group)
        positions = positions + group
        total = SpecCounters(
            drafts=total.drafts + counters.drafts,
            draft_tokens=total.draft_tokens + counters.draft_tokens,
            accepted_tokens=total.accepted_tokens + counters.accepted_tokens,
            generated_tokens=total.generated_tokens + counters.generated_tokens,
        )
    k_max = max((c.k for c in items), default=0)
    if total.drafts == 0:
        return replace(estimate_alpha(SpecCounters(), confidence, method), num_spec_tokens=k_max)
    phi = estimate_dispersion(groups).dispersion if widen_for_dispersion else 1.0
    alpha = evidence.successes / evidence.trials
    ci = alpha_interval(evidence.scaled(1.0 / phi), confidence, method)
    rate = total.accepted_tokens / total.draft_tokens if total.draft_tokens else None
    mal = 1.0 + total.accepted_tokens / total.drafts
    note = f", intervals widened for over-dispersion φ = {phi:.2f}" if phi > 1.0 else ""
    return AlphaEstimate(
        num_spec_tokens=k_max,
        drafts=total.drafts,
        draft_tokens=total.draft_tokens,
        accepted_tokens=total.accepted_tokens,
        draft_acceptance_rate=rate,
        mean_acceptance_length=mal,
        alpha=alpha,
        alpha_ci=ci,
        conditional_acceptance_by_position=positions.conditional(),
        reason=AlphaReason.OK,
        message=(
            f"α = {alpha:.3f} ({confidence:.0%} interval {ci[0]:.3f}–{ci[1]:.3f}) pooled from {len(groups)} "
            f"groups, {total.drafts} drafts{note}."
        ),
        confidence=confidence,
        evidence=evidence,
    )


def estimate_alpha_from_histograms(
    histograms: Iterable[Iterable[int]], confidence: float = 0.95, widen_for_dispersion: bool = True
) -> AlphaEstimate:
    """α from per-request acceptance histograms (each its own K); requests are the dispersion groups."""
    return estimate_alpha_pooled(
        (counters_from_histogram(h) for h in histograms),
        confidence,
        widen_for_dispersion=widen_for_dispersion,
    )


def estimate_alpha_from_steps(steps: Iterable[SpecCounters], confidence: float = 0.95) -> AlphaEstimate:
    """α from per-step counters (the in-engine plugin). Steps are pooled per K first (each step's
    counters have one K), so a per-batch-size table is handled exactly; no dispersion widening, as
    single steps are too small to be groups."""
    by_k: dict[int, SpecCounters] = {}
    for raw in steps:
        if raw.drafts == 0:
            continue
        step = _at_effective_k(raw)
        k = step.k
        by_k[k] = by_k[k] + step if k in by_k else step
    return estimate_alpha_pooled(by_k.values(), confidence, widen_for_dispersion=False)


def _at_effective_k(step: SpecCounters) -> SpecCounters:
    """A step that drafted K' < K_max tokens per draft reports K_max positions, the last ones zero:
    restate it at K' so the fixed-K likelihood applies."""
    if step.draft_tokens % step.drafts:
        return step
    k_eff = step.draft_tokens // step.drafts
    per_pos = step.accepted_per_pos
    if k_eff >= len(per_pos) or any(per_pos[k_eff:]):
        return step
    return replace(
        step,
        accepted_per_pos=per_pos[:k_eff],
        num_spec_tokens=k_eff,
        draft_tokens_per_pos=None,
    )
