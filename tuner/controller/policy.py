"""From evidence to a proposal: the K policy (``policies.choose_k``) applied to the current config.

Purely computational given an :class:`~tuner.controller.evidence.Evidence`. The step-cost model is
Leviathan's cost ratio from the config until a fitted model is wired in (see docs/controller.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from policies.acceptance import estimate_alpha
from policies.acceptance_model import ConstantAlphaModel
from policies.choose_k import KChoiceSnapshot, choose_k
from policies.step_cost import StepCostModel
from tuner.controller.evidence import Evidence, spec_config_of

_ALPHA_EPS = 1e-6


class PolicyReason(StrEnum):
    CHANGE_K = "change_k"
    KEEP = "keep"  # the current config is the best
    NO_SPECULATION = "no_speculation"  # nothing to estimate from (method off / no K)
    NO_DRAFTS = "no_drafts"  # speculation on but no drafts yet (no traffic)
    NO_ESTIMATE = "no_estimate"  # counters unusable (reason from the estimator)


@dataclass(frozen=True)
class PolicySettings:
    k_max: int = 8
    cost_ratio: float = 0.05
    confidence: float = 0.95


@dataclass(frozen=True)
class PolicyOutcome:
    reason: PolicyReason
    message: str
    target: dict[str, Any] | None = None  # the proposed --speculative-config; None: keep
    predicted_gain: float | None = None  # goodput(target) / goodput(current)
    predicted_gain_ci: tuple[float, float] | None = None
    details: dict[str, Any] | None = None


def propose_k(evidence: Evidence, settings: PolicySettings) -> PolicyOutcome:
    current = spec_config_of(evidence.config)
    k_now = current.get("num_speculative_tokens")
    if current.get("method") in (None, "off") or not isinstance(k_now, int) or k_now < 1:
        return PolicyOutcome(PolicyReason.NO_SPECULATION, "Speculation is off: there is no acceptance to measure.")
    if evidence.spec.drafts == 0:
        return PolicyOutcome(PolicyReason.NO_DRAFTS, "No drafts under the current config yet (no traffic?).")
    estimate = estimate_alpha(evidence.spec, confidence=settings.confidence)
    if estimate.alpha is None or estimate.alpha_ci is None:
        return PolicyOutcome(PolicyReason.NO_ESTIMATE, estimate.message)
    clamp = lambda x: min(max(x, _ALPHA_EPS), 1.0 - _ALPHA_EPS)  # noqa: E731 — α̂ may hit 0 or 1 exactly
    lo, hi = estimate.alpha_ci
    model = ConstantAlphaModel(clamp(estimate.alpha), clamp(min(lo, estimate.alpha)), clamp(max(hi, estimate.alpha)))
    batch = max(1, round(evidence.mean_batch_size or 1.0))
    k_max = max(settings.k_max, k_now)
    decision = choose_k(
        KChoiceSnapshot(
            now=evidence.now,
            acceptance=model,
            step_cost=StepCostModel.from_cost_ratio(settings.cost_ratio),
            batch_size=batch,
            k_max=k_max,  # never below the current K, so its goodput is comparable
            current_k=k_now,
            confidence=settings.confidence,
        )
    )
    details = {"alpha": estimate.alpha, "alpha_ci": [lo, hi], "batch_size": batch, "k_reason": decision.reason.value}
    if decision.k == k_now or decision.gain_vs_current is None or decision.gain_vs_current_ci is None:
        return PolicyOutcome(
            PolicyReason.KEEP, f"K = {k_now} is already the best choice. {decision.message}", details=details
        )
    target = dict(current)
    target["num_speculative_tokens"] = decision.k
    if decision.k == 0:
        target = {"method": "off", "num_speculative_tokens": 0}
    return PolicyOutcome(
        PolicyReason.CHANGE_K,
        f"{estimate.message} Change K {k_now} → {decision.k}: {decision.message}",
        target,
        decision.gain_vs_current,
        decision.gain_vs_current_ci,
        details,
    )
