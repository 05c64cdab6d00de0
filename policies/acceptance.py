"""α, the draft's per-token acceptance probability, estimated from speculation counters.

Purely computational, no side effects. Notation (docs/architecture.md, "The quantities"): over a window with K
speculative tokens there are D drafts, T = K·D draft tokens, A accepted tokens and a_i drafts that
accepted at least i+1 tokens (vLLM's ``num_accepted_tokens_per_pos``).

Under the i.i.d. model one draft that accepted n < K tokens has likelihood α^n (1 − α) and one that
accepted all K has α^K, so the log-likelihood of a window is

    ℓ(α) = A·log α + (D − a_{K−1})·log(1 − α)

i.e. a Bernoulli likelihood with S = A successes and F = D − a_{K−1} failures (a draft ends in at most
one rejection). The MLE is α̂ = S / (S + F) = A / (A + D − a_{K−1}). The observed information at α̂
equals that of a binomial with S + F trials, which is why the Beta (Jeffreys) interval and the profile
likelihood interval are both correct to first order here even though the number of trials is random.

vLLM's *draft acceptance rate* A/T and *mean acceptance length* 1 + A/D are reported alongside and are
never confused with α: both depend on K, α does not (under the model).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from scipy import optimize, stats

from policies.counters import SpecCounters
from policies.dispersion import window_dispersion


class AlphaReason(StrEnum):
    """Why an :class:`AlphaEstimate` has (or lacks) an α."""

    OK = "ok"
    NO_DRAFTS = "no_drafts"
    NO_PER_POSITION = "no_per_position"
    DYNAMIC_K_UNRESOLVED = "dynamic_k_unresolved"
    INCONSISTENT_COUNTERS = "inconsistent_counters"


class IntervalMethod(StrEnum):
    """How the confidence interval for α is built from (S, F)."""

    BETA = "beta"  # Jeffreys: equal-tailed quantiles of Beta(S + 1/2, F + 1/2)
    PROFILE = "profile"  # likelihood ratio: 2·(ℓ(α̂) − ℓ(α)) ≤ χ²₁(confidence)


@dataclass(frozen=True)
class AcceptanceEvidence:
    """The sufficient statistics of the i.i.d. model: S accepted tokens, F rejections.

    Evidence from different windows, engines or K values adds (the log-likelihoods add), and may be
    down-weighted (exponential forgetting) by scaling; counts are floats for that reason.
    """

    successes: float = 0.0
    failures: float = 0.0
    drafts: float = 0.0

    @property
    def trials(self) -> float:
        """Bernoulli trials: every drafted token that was actually checked against the target."""
        return self.successes + self.failures

    def __add__(self, other: AcceptanceEvidence) -> AcceptanceEvidence:
        return AcceptanceEvidence(
            successes=self.successes + other.successes,
            failures=self.failures + other.failures,
            drafts=self.drafts + other.drafts,
        )

    def scaled(self, weight: float) -> AcceptanceEvidence:
        """The same evidence counted ``weight`` times (0 ≤ weight; forgetting uses weight ≤ 1)."""
        if weight < 0 or not math.isfinite(weight):
            raise ValueError(f"evidence weight must be a finite number ≥ 0 but got {weight!r}")
        return AcceptanceEvidence(self.successes * weight, self.failures * weight, self.drafts * weight)


@dataclass(frozen=True)
class EvidenceResult:
    """Evidence extracted from counters, or the reason none could be."""

    evidence: AcceptanceEvidence | None
    reason: AlphaReason
    message: str


def evidence_from_counters(counters: SpecCounters) -> EvidenceResult:
    """Turn one window's counters into (S, F), or say precisely why that is impossible.

    With a fixed K: S = A and F = D − a_{K−1}. When K varied inside the window (vLLM's
    per-batch-size table) and the per-position draft counts D_i are known (in-engine plugin), the
    number of full acceptances among drafts with exactly k positions is estimated as
    (D_{k−1} − D_k)·a_{k−1}/D_{k−1}; /metrics alone cannot resolve that case and we say so.
    """
    _check_non_negative(counters)
    d, t, a = counters.drafts, counters.draft_tokens, counters.accepted_tokens
    per_pos = counters.accepted_per_pos
    if d == 0 or t == 0:  # K = 0 steps draft nothing
        return EvidenceResult(None, AlphaReason.NO_DRAFTS, "No drafts in this window: nothing to estimate α from.")
    k = counters.k
    problem = _inconsistency(counters)
    if problem is not None:
        return EvidenceResult(None, AlphaReason.INCONSISTENT_COUNTERS, problem)
    if not per_pos:
        if a == 0:
            return EvidenceResult(AcceptanceEvidence(0.0, float(d), float(d)), AlphaReason.OK, "")
        return EvidenceResult(
            None,
            AlphaReason.NO_PER_POSITION,
            "The per-position accepted counts are missing, so rejections cannot be told from full "
            "acceptances; scrape vllm:spec_decode_num_accepted_tokens_per_pos_total as well.",
        )
    per_pos_drafts = counters.draft_tokens_per_pos
    if per_pos_drafts is not None and any(x != d for x in per_pos_drafts):
        full = 0.0
        dk = [*list(per_pos_drafts), 0]
        for i in range(len(per_pos_drafts)):
            ended_here = dk[i] - dk[i + 1]  # drafts with exactly i+1 positions
            if ended_here > 0 and dk[i] > 0:
                full += ended_here * per_pos[i] / dk[i]
        return EvidenceResult(AcceptanceEvidence(float(a), d - full, float(d)), AlphaReason.OK, "")
    if t != k * d:
        return EvidenceResult(
            None,
            AlphaReason.DYNAMIC_K_UNRESOLVED,
            f"Draft tokens ({t}) are not K·drafts ({k}·{d}): K changed inside the window, or the method "
            "drafts fewer than K tokens at times (ngram, suffix), and /metrics has no per-position draft "
            "counts; estimate from per-step records or per-request per-step arrays instead.",
        )
    full_acceptances = per_pos[k - 1]
    return EvidenceResult(AcceptanceEvidence(float(a), float(d - full_acceptances), float(d)), AlphaReason.OK, "")


def _check_non_negative(counters: SpecCounters) -> None:
    values = [counters.drafts, counters.draft_tokens, counters.accepted_tokens, *counters.accepted_per_pos]
    if counters.draft_tokens_per_pos is not None:
        values += list(counters.draft_tokens_per_pos)
    if any(v < 0 for v in values):
        raise ValueError(
            f"speculation counters cannot be negative but got {counters!r}; "
            "a counter that went down is an engine restart and must be handled as a reset"
        )


def _inconsistency(c: SpecCounters) -> str | None:
    """The first broken invariant of the counters, as a sentence, or None."""
    per_pos = c.accepted_per_pos
    if c.accepted_tokens > c.draft_tokens:
        return f"accepted tokens ({c.accepted_tokens}) exceed draft tokens ({c.draft_tokens})."
    if per_pos:
        if sum(per_pos) != c.accepted_tokens:
            return (
                f"per-position accepted counts sum to {sum(per_pos)} but accepted tokens are "
                f"{c.accepted_tokens}; the counters come from different moments (re-scrape)."
            )
        if per_pos[0] > c.drafts:
            return f"drafts accepting position 0 ({per_pos[0]}) exceed drafts ({c.drafts})."
        if any(later > earlier for earlier, later in itertools.pairwise(per_pos)):
            return f"per-position accepted counts must not increase with position but are {list(per_pos)}."
        if c.num_spec_tokens is not None and len(per_pos) != c.num_spec_tokens:
            return (
                f"{len(per_pos)} per-position counters for K = {c.num_spec_tokens}; every position "
                "0..K−1 must be reported (zeros included)."
            )
    return None


def alpha_interval(
    evidence: AcceptanceEvidence, confidence: float = 0.95, method: IntervalMethod = IntervalMethod.BETA
) -> tuple[float, float]:
    """A ``confidence`` interval for α from (S, F).

    BETA is the Jeffreys interval (lower end 0 when S = 0, upper end 1 when F = 0); PROFILE inverts
    the likelihood-ratio test. Both are exact in the limit and differ in the tails for small counts.
    """
    _check_confidence(confidence)
    s, f = evidence.successes, evidence.failures
    if s + f <= 0:
        return (0.0, 1.0)
    if method is IntervalMethod.BETA:
        tail = (1.0 - confidence) / 2.0
        lo = 0.0 if s == 0 else float(stats.beta.ppf(tail, s + 0.5, f + 0.5))
        hi = 1.0 if f == 0 else float(stats.beta.ppf(1.0 - tail, s + 0.5, f + 0.5))
        return (lo, hi)
    return _profile_interval(s, f, confidence)


def _profile_interval(s: float, f: float, confidence: float) -> tuple[float, float]:
    cut = float(stats.chi2.ppf(confidence, 1)) / 2.0
    mle = s / (s + f)

    def loglik(x: float) -> float:
        return (s * math.log(x) if s > 0 else 0.0) + (f * math.log1p(-x) if f > 0 else 0.0)

    top = loglik(mle) if 0.0 < mle < 1.0 else 0.0

    def drop(x: float) -> float:
        return top - loglik(x) - cut

    eps = 1e-12
    lo = 0.0 if s == 0 else float(optimize.brentq(drop, eps, mle))
    hi = 1.0 if f == 0 else float(optimize.brentq(drop, mle, 1.0 - eps))
    return (lo, hi)


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie strictly between 0 and 1 but got {confidence!r}")


@dataclass(frozen=True)
class AlphaEstimate:
    """α̂ with its interval and the K-dependent rates vLLM reports, for one window of counters.

    ``alpha`` and ``alpha_ci`` are None when there is nothing to estimate from (``reason`` says why,
    ``message`` says what to do). The rates are None only when there were no drafts.
    """

    num_spec_tokens: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    draft_acceptance_rate: float | None
    mean_acceptance_length: float | None
    alpha: float | None
    alpha_ci: tuple[float, float] | None
    conditional_acceptance_by_position: tuple[float | None, ...]
    reason: AlphaReason
    message: str
    confidence: float = 0.95
    evidence: AcceptanceEvidence | None = None
    dispersion: float = 1.0  # between-window φ ≥ 1 behind alpha_ci (policies.dispersion)

    def to_dict(self) -> dict[str, Any]:
        """Exactly the keys of ``spectuner estimate --json``."""
        return {
            "num_spec_tokens": self.num_spec_tokens,
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "alpha": self.alpha,
            "alpha_ci": list(self.alpha_ci) if self.alpha_ci is not None else None,
            "conditional_acceptance_by_position": list(self.conditional_acceptance_by_position),
        }


def conditional_acceptance(counters: SpecCounters) -> tuple[float | None, ...]:
    """c_0 = a_0/D, c_i = a_i/a_{i−1}: P(accept position i | accepted all before). None: no trials."""
    out: list[float | None] = []
    prev = counters.drafts
    for a_i in counters.accepted_per_pos:
        out.append(a_i / prev if prev > 0 else None)
        prev = a_i
    return tuple(out)


def estimate_alpha(
    counters: SpecCounters, confidence: float = 0.95, method: IntervalMethod = IntervalMethod.BETA
) -> AlphaEstimate:
    """α̂ = A / (A + D − a_{K−1}) with a ``confidence`` interval, plus A/T and 1 + A/D.

    Purely computational. D = 0 gives ``alpha=None`` with reason ``no_drafts``.
    """
    _check_confidence(confidence)
    result = evidence_from_counters(counters)
    d = counters.drafts
    rate = counters.accepted_tokens / counters.draft_tokens if counters.draft_tokens > 0 else None
    mal = 1.0 + counters.accepted_tokens / d if d > 0 else None
    alpha: float | None = None
    ci: tuple[float, float] | None = None
    message = result.message
    if result.evidence is not None:
        ev = result.evidence
        alpha = ev.successes / ev.trials if ev.trials > 0 else None
        ci = alpha_interval(ev, confidence, method) if ev.trials > 0 else None
        if alpha is not None and ci is not None:
            message = (
                f"α = {alpha:.3f} ({confidence:.0%} interval {ci[0]:.3f}–{ci[1]:.3f}) from {d} drafts at "
                f"K = {counters.k}; draft acceptance rate {rate:.3f}, mean acceptance length {mal:.2f}."
            )
    return AlphaEstimate(
        num_spec_tokens=counters.k,
        drafts=d,
        draft_tokens=counters.draft_tokens,
        accepted_tokens=counters.accepted_tokens,
        draft_acceptance_rate=rate,
        mean_acceptance_length=mal,
        alpha=alpha,
        alpha_ci=ci,
        conditional_acceptance_by_position=conditional_acceptance(counters),
        reason=result.reason,
        message=message,
        confidence=confidence,
        evidence=result.evidence,
    )


def evidence_from_draft_steps(accepted: Iterable[int], drafted: Iterable[int]) -> AcceptanceEvidence:
    """Exact (S, F) from per-verify-step pairs — vLLM's per-request ``per_step_accepted`` and
    ``per_step_drafted`` (``--per-request-spec-decode-metrics detailed``).

    A step that accepted every token it drafted is a full acceptance even when it drafted fewer than
    K (ngram and suffix decoding propose what their lookup finds, EAGLE trees may stop early); the
    acceptance histogram cannot tell that from a rejection at that position, per-step pairs can.
    Steps that drafted nothing are no trials.
    """
    acc, drf = list(accepted), list(drafted)
    if len(acc) != len(drf):
        raise ValueError(f"per-step accepted ({len(acc)}) and drafted ({len(drf)}) need one entry per step")
    successes = failures = drafts = 0
    for a, d in zip(acc, drf, strict=True):
        if not 0 <= a <= d:
            raise ValueError(f"a verify step needs 0 ≤ accepted ≤ drafted but got {a} of {d}")
        if d == 0:
            continue
        drafts += 1
        successes += a
        failures += a < d
    return AcceptanceEvidence(float(successes), float(failures), float(drafts))


def estimate_alpha_from_evidence(
    evidence: AcceptanceEvidence, confidence: float = 0.95, method: IntervalMethod = IntervalMethod.BETA
) -> tuple[float | None, tuple[float, float] | None]:
    """(α̂, interval) from pooled or discounted evidence; (None, None) without trials."""
    if evidence.trials <= 0:
        return None, None
    return evidence.successes / evidence.trials, alpha_interval(evidence, confidence, method)


def pool_evidence(items: Iterable[SpecCounters]) -> EvidenceResult:
    """Sum the evidence of several windows (possibly at different K: the likelihoods multiply).

    Windows without drafts are skipped; the first window whose evidence cannot be extracted makes the
    whole pool fail with its reason, so a bad window is never silently dropped.
    """
    total = AcceptanceEvidence()
    for counters in items:
        result = evidence_from_counters(counters)
        if result.reason is AlphaReason.NO_DRAFTS:
            continue
        if result.evidence is None:
            return result
        total = total + result.evidence
    if total.drafts == 0:
        return EvidenceResult(None, AlphaReason.NO_DRAFTS, "No drafts in any window: nothing to estimate α from.")
    return EvidenceResult(total, AlphaReason.OK, "")


def effective_counters(spec: SpecCounters) -> SpecCounters | None:
    """The counters at the K the engine actually drafted in the window.

    Under a per-batch-size table the engine starts at K_max but drafts fewer tokens per step, so the
    positions past the step's K stay zero and α̂ = A / (A + D − a_{K−1}) read at K_max would count every
    draft as rejected. When T / D is a whole number k, every step drafted k tokens: the counters are cut
    to k positions. A window whose steps drafted at two neighbouring K is split (:func:`_two_ks`); one
    mixing K otherwise cannot be split from /metrics: None (its tokens still count for throughput; the
    plugin's per-step records have the exact K).
    """
    if spec.drafts <= 0:
        return spec
    k_eff = spec.draft_tokens / spec.drafts
    k = round(k_eff)
    if abs(k_eff - k) > 1e-9:
        return _two_ks(spec)
    if k >= len(spec.accepted_per_pos) or k < 1:
        return spec
    if any(spec.accepted_per_pos[k:]):  # a draft longer than k was accepted: the steps mixed several K
        return None
    return replace(spec, accepted_per_pos=spec.accepted_per_pos[:k], num_spec_tokens=k)


def _two_ks(spec: SpecCounters) -> SpecCounters | None:
    """A window whose steps drafted at k and k + 1 tokens (k < T / D < k + 1), cut to k + 1 positions with
    its per-position draft counts: D at positions 1..k and T − k·D at k + 1, exact when those were the
    only two K. That is what a per-batch-size table does while the batch moves across one of its row
    boundaries (live, 6 Dec 16:06: 4 streams under a table drafting K = 5 at 1–3 sequences and 4 at 4–5,
    every 2-s window mixed the two; all were left out and α came from the K = 1 windows of the phase
    before). :func:`evidence_from_counters` then counts the full acceptances among the shorter drafts by
    their share of the drafts (K follows the batch size, not the tokens). None when a draft longer than
    k + 1 was accepted, position k + 1 accepted more drafts than drafted there, or the per-position draft
    counts are known already (they may mix more than two K)."""
    d, t, per_pos = spec.drafts, spec.draft_tokens, spec.accepted_per_pos
    k = t // d
    longer = t - k * d  # drafts at k + 1 tokens
    if spec.draft_tokens_per_pos is not None or k < 1 or k + 1 > len(per_pos):
        return None
    if any(per_pos[k + 1 :]) or per_pos[k] > longer:
        return None
    return replace(
        spec, accepted_per_pos=per_pos[: k + 1], num_spec_tokens=k + 1, draft_tokens_per_pos=(d,) * k + (longer,)
    )


def alpha_of_windows(windows: Sequence[SpecCounters], confidence: float = 0.95) -> AlphaEstimate:
    """α̂ and its interval for one config's windows: THE estimate every surface reports (the controller's
    decision, ``spectuner status``, the exporters, the report, the demo).

    The summed counters give it when every window drafted at the config's K. When windows drafted at
    different K (a per-batch-size table), each window is cut to the K it drafted
    (:func:`effective_counters`: one mixing two neighbouring K is split, one mixing more is left out) and
    the likelihoods are pooled:
    the summed counters would read every short draft as a rejection at K_max. The rates (A/T, 1 + A/D)
    are always the summed counters'.
    """
    summed = SpecCounters()
    for spec in windows:
        summed = summed + spec
    estimate = estimate_alpha(summed, confidence=confidence)
    effective = [e for e in (effective_counters(w) for w in windows) if e is not None]
    phi = window_dispersion(
        (ev.successes, ev.trials)
        for ev in (evidence_from_counters(e).evidence for e in effective if e.drafts > 0)
        if ev is not None
    )
    ks = {e.k for e in effective if e.drafts > 0}
    # the summed counters, unless a window mixing several K (left out above) makes them unreadable: then
    # the windows that drafted at one K still say what α is (live, 6 Dec 12:52: one window spanning a
    # 64 → 1 stream step left the running draft with no α for a tick)
    if len(ks) <= 1 and (not ks or ks == {summed.k}) and (estimate.alpha is not None or not ks):
        return _honest(estimate, phi, confidence)
    pooled = pool_evidence(effective)
    if pooled.evidence is None:
        return _honest(estimate, phi, confidence)
    alpha, ci = estimate_alpha_from_evidence(pooled.evidence, confidence)
    if alpha is None or ci is None:
        return _honest(estimate, phi, confidence)
    return _honest(
        replace(
            estimate,
            alpha=alpha,
            alpha_ci=ci,
            evidence=pooled.evidence,
            message=f"α = {alpha:.3f} (interval {ci[0]:.3f}–{ci[1]:.3f}) pooled over windows at K = {sorted(ks)}.",
        ),
        phi,
        confidence,
    )


def _honest(estimate: AlphaEstimate, phi: float, confidence: float) -> AlphaEstimate:
    """The estimate with its interval widened by the windows' over-dispersion φ (counts divided by φ):
    windows that vary more than binomial sampling explains carry less information than their drafts."""
    if phi <= 1.0 or estimate.evidence is None or estimate.alpha is None:
        return replace(estimate, dispersion=phi)
    ci = alpha_interval(estimate.evidence.scaled(1.0 / phi), confidence)
    return replace(
        estimate,
        alpha_ci=ci,
        dispersion=phi,
        message=f"{estimate.message} Windows vary {phi:.1f}× more than independent tokens would: interval "
        f"{ci[0]:.3f}–{ci[1]:.3f}.",
    )
