"""What a K-choice needs from acceptance: E(K) with an interval, for any K.

Purely computational. Two implementations: :class:`ConstantAlphaModel` (the i.i.d. model, E(α, K) with
α's interval mapped through the monotone E) here, and ``policies.positional.PositionalModel``
(per-position conditional acceptance with a fitted decay beyond the observed K).
:func:`choose_acceptance_model` picks between them for a speculative method and its per-position
evidence; the controller uses it for head methods (EAGLE, EAGLE-3, MTP), one α for the rest.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from policies.acceptance import AlphaEstimate
from policies.positional import FitReason, PositionalModel, PositionData, check_constant_alpha
from policies.speedup import check_alpha, check_k, expected_tokens_per_step


class AcceptanceModel(Protocol):
    """Expected tokens emitted per verify step at K, and an interval for it."""

    def expected_tokens(self, k: int) -> float: ...

    def expected_tokens_interval(self, k: int) -> tuple[float, float]: ...


@dataclass(frozen=True)
class ConstantAlphaModel:
    """i.i.d. acceptance α with interval (lo, hi); E is increasing in α, so E's interval is exact."""

    alpha: float
    alpha_lo: float
    alpha_hi: float

    def __post_init__(self) -> None:
        for value in (self.alpha, self.alpha_lo, self.alpha_hi):
            check_alpha(value)
        if not self.alpha_lo <= self.alpha <= self.alpha_hi:
            raise ValueError(
                f"alpha interval must contain alpha but got {self.alpha_lo} ≤ {self.alpha} ≤ {self.alpha_hi}"
            )

    @classmethod
    def exact(cls, alpha: float) -> ConstantAlphaModel:
        """A known α (no uncertainty): what ``spectuner recommend --alpha`` means."""
        return cls(alpha, alpha, alpha)

    @classmethod
    def from_estimate(cls, estimate: AlphaEstimate) -> ConstantAlphaModel:
        if estimate.alpha is None or estimate.alpha_ci is None:
            raise ValueError(f"no α to model acceptance with: {estimate.message}")
        return cls(estimate.alpha, estimate.alpha_ci[0], estimate.alpha_ci[1])

    def expected_tokens(self, k: int) -> float:
        check_k(k)
        return expected_tokens_per_step(self.alpha, k)

    def expected_tokens_interval(self, k: int) -> tuple[float, float]:
        check_k(k)
        return (expected_tokens_per_step(self.alpha_lo, k), expected_tokens_per_step(self.alpha_hi, k))


@dataclass(frozen=True)
class SparseProposals:
    """A proposer that drafts only at a share of the steps (a prompt lookup drafts where it finds a match;
    at the other steps a sequence verifies its one token alone): E = 1 + share·(E_inner − 1), where
    ``inner`` models the steps that drafted (vLLM's acceptance counts only those). Without it, ngram with
    α̂ 0.91 over its drafts at K = 3 read as 3.5 tokens a step on the lab's predictable prompts, where it
    drafted at 37 % of the steps and made 2.0."""

    inner: AcceptanceModel
    share: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.share) and 0.0 < self.share <= 1.0):
            raise ValueError(f"proposal share must be in (0, 1] but got {self.share!r}")

    def expected_tokens(self, k: int) -> float:
        return 1.0 + self.share * (self.inner.expected_tokens(k) - 1.0)

    def expected_tokens_interval(self, k: int) -> tuple[float, float]:
        lo, hi = self.inner.expected_tokens_interval(k)
        return (1.0 + self.share * (lo - 1.0), 1.0 + self.share * (hi - 1.0))


def sparse(model: AcceptanceModel, share: float) -> AcceptanceModel:
    """``model`` at a proposal share (itself at share 1)."""
    return model if share >= 1.0 else SparseProposals(model, share)


# Methods whose draft is a head on the target's hidden states (EAGLE, EAGLE-3, MTP modules, Medusa,
# MLP speculator, DFlash): each further position drafts from the head's own, drifting features — an MTP
# module trained for depth 1 is reused for the rest — so conditional acceptance falls with position and
# one α fitted on short drafts overstates long ones. A separate draft model or a lookup (draft_model,
# ngram, suffix) has no such built-in decline; for those one α is kept unless the data reject it.
HEAD_METHODS = frozenset({"eagle", "eagle3", "mtp", "medusa", "mlp_speculator", "dflash", "dspark"})


def is_head_method(method: object) -> bool:
    return isinstance(method, str) and (method in HEAD_METHODS or method.endswith("_mtp"))


class ModelChoice(StrEnum):
    CONSTANT_ALPHA = "constant_alpha"
    POSITIONAL_REJECTED = "positional_constant_alpha_rejected"
    POSITIONAL_HEAD_METHOD = "positional_head_method"


@dataclass(frozen=True, eq=False)
class AcceptanceChoice:
    """The acceptance model to plan K with, and why (a decision with its reason)."""

    model: AcceptanceModel
    choice: ModelChoice
    message: str


def position_data_from_draft_steps(accepted: Iterable[int], drafted: Iterable[int]) -> PositionData:
    """Per-position trials and successes from per-verify-step pairs: position i is tried in a step that
    drafted more than i tokens and accepted the first i, and succeeds when it accepted more than i."""
    pairs = list(zip(accepted, drafted, strict=True))
    width = max((d for _, d in pairs), default=0)
    trials = tuple(float(sum(1 for a, d in pairs if d > i and a >= i)) for i in range(width))
    successes = tuple(float(sum(1 for a, _ in pairs if a > i)) for i in range(width))
    return PositionData(trials, successes)


def choose_acceptance_model(
    method: object,
    estimate: AlphaEstimate,
    data: PositionData,
    *,
    max_k: int,
    dispersion: float = 1.0,
    significance: float = 0.01,
) -> AcceptanceChoice:
    """Constant α, or per-position acceptance (``PositionalModel``) when the positions disagree with one
    α or the method is a head (EAGLE/MTP: acceptance falls with position by construction).

    ``data`` is the per-position evidence of the same window as ``estimate`` (``PositionData``), from
    /metrics, per-step records or per-request histograms; ``max_k`` the largest K to plan for.
    """
    check = check_constant_alpha(data, significance=significance, dispersion=dispersion)
    if check.reason is FitReason.CONSTANT_ALPHA_REJECTED:
        return AcceptanceChoice(
            PositionalModel.fit(data, max_k=max_k, dispersion=dispersion, confidence=estimate.confidence),
            ModelChoice.POSITIONAL_REJECTED,
            f"per-position acceptance is not one α ({check.message}); planning K with per-position acceptance",
        )
    if is_head_method(method) and data.observed_positions >= 1:
        return AcceptanceChoice(
            PositionalModel.fit(data, max_k=max_k, dispersion=dispersion, confidence=estimate.confidence),
            ModelChoice.POSITIONAL_HEAD_METHOD,
            f"{method} drafts from the target's hidden states, whose acceptance falls with position; "
            "planning K with per-position acceptance (a decay beyond the observed K, not one α)",
        )
    return AcceptanceChoice(
        ConstantAlphaModel.from_estimate(estimate),
        ModelChoice.CONSTANT_ALPHA,
        "one α explains every position" if check.reason is FitReason.CONSTANT_ALPHA_FITS else check.message,
    )
