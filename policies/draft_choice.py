"""Which draft to speculate with, and when to give up on the current one.

Purely computational: ``choose_draft(snapshot) -> DraftDecision``.

Trigger (docs/architecture.md): acceptance that **stays** below a threshold (0.4). By default the statistic is α̂
(a property of the draft, independent of K); optionally vLLM's raw draft acceptance rate A/T. "Stays"
means, over the trailing ``duration_s``: the windows cover the period, hold at least ``min_drafts``
drafts, the upper end of the pooled interval is below the threshold, and no sub-period (``segments``
equal slices) has a point estimate at or above it — one noisy window cannot trigger, one good slice
cancels.

Ranking: each candidate's α is a Beta posterior of its prior α (worth ``prior_strength_trials``
pseudo-tokens) and its measured history on this target, so measurements dominate once there are
some. Its speedup is predicted with :func:`policies.choose_k.choose_k` at the current batch size with
its own cost ratio and memory footprint; candidates that fit no K are out. The current draft competes
with its measured α. Fallback: ngram/suffix candidates rank like the others; when nothing beats plain
decoding, speculation is switched off.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from scipy import stats

from policies.acceptance import AcceptanceEvidence, AlphaReason, evidence_from_counters
from policies.acceptance_model import AcceptanceModel, ConstantAlphaModel, sparse
from policies.choose_k import KChoiceSnapshot, KDecision, choose_k, evaluate_k
from policies.counters import SpecCounters
from policies.dispersion import DispersionSums
from policies.memory import FREE_METHODS, DraftFootprint, KvCapacity, MemoryBudget, weight_bytes
from policies.spec_config import OFF, RESERVED_KEYS, KRow, SpecConfig, is_mtp_method
from policies.speedup import check_alpha, independent_ratio_interval
from policies.step_cost import StepCostModel


@dataclass(frozen=True)
class DraftCandidate:
    """One entry of the candidate registry.

    ``cost_ratio``: draft forward pass / target forward pass; None estimates it as params / target
    params (compute-bound), 0 for ngram/suffix. ``draft_fixed_s`` / ``draft_per_seq_s``: the draft's pass
    as measured on its own (seconds per pass, and per sequence in the batch); when given, predictions use
    them instead of the ratio, which then serves only the step-cost fits that split a step between target
    and draft. ``speculative_config`` holds extra vLLM keys (e.g. ``prompt_lookup_max`` for ngram).
    """

    name: str
    method: str
    path: str | None = None
    params: int = 0
    kv_bytes_per_token: int = 0
    prior_alpha: float = 0.5
    dtype: str = "bfloat16"
    cost_ratio: float | None = None
    speculative_config: Mapping[str, Any] = field(default_factory=dict)
    draft_fixed_s: float | None = None
    draft_per_seq_s: float | None = None
    # Pseudo-tokens ``prior_alpha`` is worth; None: the trigger config's ``prior_strength_trials``. Set
    # with ``prior_source`` when the prior comes from elsewhere (the fleet: ``policies.fleet``).
    prior_strength_trials: float | None = None
    prior_source: str = "configured"
    # Share of the verify steps at which it drafts (``policies.shadow_replay.proposal_share``): below 1 for
    # a prompt lookup, which drafts only where it finds a match; it scales the tokens a step makes and the
    # tokens the target verifies (``SparseProposals``, ``StepCostModel.proposal_share``).
    proposal_share: float = 1.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a draft candidate needs a name")
        check_alpha(self.prior_alpha)
        strength = self.prior_strength_trials
        if strength is not None and not (math.isfinite(strength) and strength >= 0):
            raise ValueError(f"draft candidate {self.name!r}: prior strength must be ≥ 0 but got {strength!r}")
        if self.method not in FREE_METHODS and not self.path and not self.in_target:
            raise ValueError(f"draft candidate {self.name!r} ({self.method}) needs a model path")
        if self.params < 0 or self.kv_bytes_per_token < 0:
            raise ValueError(f"draft candidate {self.name!r}: params and KV bytes cannot be negative")
        if self.cost_ratio is not None and not (math.isfinite(self.cost_ratio) and self.cost_ratio >= 0):
            raise ValueError(f"draft candidate {self.name!r}: cost ratio must be ≥ 0 but got {self.cost_ratio!r}")
        if not (math.isfinite(self.proposal_share) and 0.0 < self.proposal_share <= 1.0):
            raise ValueError(
                f"draft candidate {self.name!r}: proposal share must be in (0, 1] but got {self.proposal_share!r}"
            )
        for key in ("draft_fixed_s", "draft_per_seq_s"):
            value = getattr(self, key)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"draft candidate {self.name!r}: {key} must be ≥ 0 seconds but got {value!r}")

    @property
    def free(self) -> bool:
        return self.method in FREE_METHODS

    @property
    def in_target(self) -> bool:
        """MTP: the draft modules ship inside the target's checkpoint (no path of their own, not free:
        size them with ``policies.memory.mtp_footprint`` into ``params`` / ``kv_bytes_per_token``)."""
        return is_mtp_method(self.method)

    def footprint(self) -> DraftFootprint:
        if self.free:
            return DraftFootprint(self.method)
        return DraftFootprint(self.method, weight_bytes(self.params, self.dtype), self.kv_bytes_per_token)

    @property
    def pass_measured(self) -> bool:
        """True when the draft's own pass cost is given in seconds (not as a ratio of the target's)."""
        return self.draft_fixed_s is not None or self.draft_per_seq_s is not None

    def beside(self, target: StepCostModel, target_params: int | None) -> StepCostModel | None:
        """``target``'s linear model with this draft's pass beside it: its measured pass when given, else
        its cost ratio × the target's; None when neither is known."""
        if self.pass_measured:
            model = target.with_draft_cost(self.draft_fixed_s or 0.0, self.draft_per_seq_s or 0.0)
        else:
            ratio = self.cost_ratio_for(target_params)
            if ratio is None:
                return None
            model = target.with_draft_ratio(ratio)
        if self.proposal_share >= 1.0 and not self.free:
            return model
        return replace(model, proposal_share=self.proposal_share, lookup_proposer=self.free)

    def cost_ratio_for(self, target_params: int | None) -> float | None:
        if self.cost_ratio is not None:
            return self.cost_ratio
        if self.free:
            return 0.0
        if target_params and self.params:
            return self.params / target_params
        return None


class TriggerStatistic(StrEnum):
    ALPHA = "alpha"
    DRAFT_ACCEPTANCE_RATE = "draft_acceptance_rate"


@dataclass(frozen=True)
class DraftTriggerConfig:
    threshold: float = 0.4
    """Acceptance below which the draft is not worth its cost (docs/architecture.md)."""
    duration_s: float = 600.0
    """How long acceptance must stay low: ten minutes outlasts a burst of unusual prompts."""
    min_drafts: int = 2000
    """Minimum evidence over the duration (α to about ±0.02)."""
    statistic: TriggerStatistic = TriggerStatistic.ALPHA
    segments: int = 3
    """Sub-periods that must each be below the threshold (no recovery inside the duration)."""
    coverage: float = 0.9
    """Share of the duration the windows must cover (tolerates a short collector gap)."""
    prior_strength_trials: float = 200.0
    """Pseudo-tokens a candidate's prior α is worth against its measured history."""
    confidence: float = 0.95
    shadow_error_sd: float = 0.02
    """A shadow replay's α̂ error against the traffic until replays measure it (policies.replay_error)."""

    def __post_init__(self) -> None:
        if not 0 < self.threshold < 1:
            raise ValueError(f"trigger threshold must lie in (0, 1) but got {self.threshold!r}")
        if self.duration_s <= 0 or self.min_drafts < 0 or self.segments < 1:
            raise ValueError("trigger duration must be > 0 s, min drafts ≥ 0 and segments ≥ 1")
        if not 0 < self.coverage <= 1 or not 0 < self.confidence < 1 or self.prior_strength_trials < 0:
            raise ValueError("coverage in (0, 1], confidence in (0, 1), prior strength ≥ 0 required")
        if not 0 <= self.shadow_error_sd < 0.5:
            raise ValueError(f"shadow_error_sd must lie in [0, 0.5) but got {self.shadow_error_sd!r}")


@dataclass(frozen=True)
class SpecWindow:
    start: datetime
    end: datetime
    counters: SpecCounters


@dataclass(frozen=True)
class DraftChoiceSnapshot:
    """Everything :func:`choose_draft` reads. ``windows`` are the current draft's, at its config."""

    now: datetime
    current: str | None
    current_k: int
    windows: Sequence[SpecWindow]
    candidates: Sequence[DraftCandidate]
    history: Mapping[str, AcceptanceEvidence]
    batch_size: int
    k_max: int
    step_cost: StepCostModel
    """The target's step cost (its fixed_s and per_token_s are used; the draft part is per candidate)."""
    target_params: int | None = None
    memory: MemoryBudget | None = None
    config: DraftTriggerConfig = field(default_factory=DraftTriggerConfig)
    # When KV memory caps the batch: requests running + waiting, and the engine's measured KV pool. Each
    # candidate is then scored at the batch it could run (the demand up to its memory cap) and its speedup
    # is over plain decoding at the batch plain decoding could run (capped_batch).
    demand: float | None = None
    kv: KvCapacity | None = None
    # candidates not proposed beyond failure (the floor swapped them out and acceptance has not moved since);
    # the floor's own ranking still sees them
    not_opportunistic: frozenset[str] = frozenset()
    # candidate name → its own T(B, K) (the target's with that draft, corrected by the cells this engine
    # measured while it ran it): the K it is proposed at; every candidate is still ranked on ``step_cost``
    # at its cost ratio, so one that ran here and one that never did are compared alike
    step_cost_of: Mapping[str, StepCostModel] = field(default_factory=dict)


class TriggerReason(StrEnum):
    TRIGGERED = "acceptance_stays_low"
    NOT_COVERED = "duration_not_covered"
    TOO_FEW_DRAFTS = "too_few_drafts"
    ABOVE_THRESHOLD = "not_clearly_below_threshold"
    RECOVERED = "recovered_within_duration"
    UNUSABLE = "unusable_counters"


@dataclass(frozen=True)
class TriggerCheck:
    triggered: bool
    reason: TriggerReason
    message: str
    value: float | None
    upper: float | None
    drafts: int
    covered_s: float


def check_trigger(windows: Sequence[SpecWindow], now: datetime, config: DraftTriggerConfig) -> TriggerCheck:
    """Has acceptance *stayed* below the threshold for the configured duration? Purely computational."""
    since = now - timedelta(seconds=config.duration_s)
    recent = [w for w in windows if w.end > since and w.start < now]
    covered = sum((min(w.end, now) - max(w.start, since)).total_seconds() for w in recent)
    drafts = sum(w.counters.drafts for w in recent)
    need = config.coverage * config.duration_s
    if covered < need:
        return TriggerCheck(
            False,
            TriggerReason.NOT_COVERED,
            f"Only {covered:.0f} s of the last {config.duration_s:.0f} s have data.",
            None,
            None,
            drafts,
            covered,
        )
    value, upper, problem = _statistic(recent, config)
    if problem:
        return TriggerCheck(False, TriggerReason.UNUSABLE, problem, None, None, drafts, covered)
    if drafts < config.min_drafts:
        return TriggerCheck(
            False,
            TriggerReason.TOO_FEW_DRAFTS,
            f"{drafts} drafts in the last {config.duration_s:.0f} s; {config.min_drafts} needed.",
            value,
            upper,
            drafts,
            covered,
        )
    name = config.statistic.value.replace("_", " ")
    if value is None or upper is None or upper >= config.threshold:
        return TriggerCheck(
            False,
            TriggerReason.ABOVE_THRESHOLD,
            f"{name} {_fmt(value)} (upper {_fmt(upper)}) is not clearly below {config.threshold}.",
            value,
            upper,
            drafts,
            covered,
        )
    span = config.duration_s / config.segments
    for i in range(config.segments):
        lo, hi = since + timedelta(seconds=i * span), since + timedelta(seconds=(i + 1) * span)
        part = [w for w in recent if w.end > lo and w.end <= hi] or [w for w in recent if w.start < hi and w.end > lo]
        part_value, _, _ = _statistic(part, config)
        if part_value is None or part_value >= config.threshold:
            return TriggerCheck(
                False,
                TriggerReason.RECOVERED,
                f"{name} was {_fmt(part_value)} in slice {i + 1} of {config.segments}: not staying low.",
                value,
                upper,
                drafts,
                covered,
            )
    return TriggerCheck(
        True,
        TriggerReason.TRIGGERED,
        f"{name} stayed below {config.threshold} for {config.duration_s:.0f} s: {value:.3f} "
        f"(upper {upper:.3f}) over {drafts} drafts.",
        value,
        upper,
        drafts,
        covered,
    )


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _statistic(windows: Sequence[SpecWindow], config: DraftTriggerConfig) -> tuple[float | None, float | None, str]:
    """(point, upper end of the interval, problem) of the configured statistic over the windows."""
    tail = 1 - (1 - config.confidence) / 2
    if config.statistic is TriggerStatistic.DRAFT_ACCEPTANCE_RATE:
        a = sum(w.counters.accepted_tokens for w in windows)
        t = sum(w.counters.draft_tokens for w in windows)
        if t == 0:
            return None, None, ""
        upper = 1.0 if a == t else float(stats.beta.ppf(tail, a + 0.5, t - a + 0.5))
        return a / t, upper, ""
    total = AcceptanceEvidence()
    spread = DispersionSums()
    for w in windows:
        result = evidence_from_counters(w.counters)
        if result.reason is AlphaReason.NO_DRAFTS:
            continue
        if result.evidence is None:
            return None, None, f"window ending {w.end.isoformat()}: {result.message}"
        total = total + result.evidence
        spread = spread.add(result.evidence.successes, result.evidence.trials)
    if total.trials == 0:
        return None, None, ""
    # windows that vary more than independent tokens carry less information: counts divided by φ
    s, f = total.successes / spread.phi, total.failures / spread.phi
    upper = 1.0 if f == 0 else float(stats.beta.ppf(tail, s + 0.5, f + 0.5))
    return total.successes / total.trials, upper, ""


@dataclass(frozen=True)
class CandidateScore:
    name: str
    source: str  # "measured", "prior", "measured+prior"
    alpha: float
    alpha_ci: tuple[float, float]
    fits_memory: bool
    k: int
    speedup: float
    speedup_ci: tuple[float, float]
    message: str
    prior: str = ""  # where the prior α came from, e.g. "configured 0.50 worth 200 tokens"
    proposal_share: float = 1.0  # the candidate's (DraftCandidate.proposal_share)

    def alpha_model(self) -> AcceptanceModel:
        """The candidate's α as an acceptance model, its interval widened to contain the point, at its
        proposal share."""
        lo, hi = self.alpha_ci
        return sparse(ConstantAlphaModel(self.alpha, min(lo, self.alpha), max(hi, self.alpha)), self.proposal_share)


class DraftReason(StrEnum):
    KEEP_NOT_TRIGGERED = "keep_not_triggered"
    KEEP_NO_BETTER_CANDIDATE = "keep_no_better_candidate"
    SWITCH_DRAFT = "switch_draft"
    FALLBACK_NGRAM = "fallback_ngram"
    DISABLE_SPECULATION = "disable_speculation"
    ENABLE_SPECULATION = "enable_speculation"
    KEEP_OFF = "keep_off"


@dataclass(frozen=True)
class DraftDecision:
    """What to speculate with next, why, and the predicted speedup over plain decoding."""

    reason: DraftReason
    message: str
    candidate: DraftCandidate | None  # None: no speculation (or keep the current one)
    k: int
    predicted_speedup: float
    predicted_speedup_ci: tuple[float, float]
    trigger: TriggerCheck
    ranking: tuple[CandidateScore, ...] = ()
    current: CandidateScore | None = None
    # a candidate beats the running draft on its newest slice of evidence but not yet over the trigger's
    # duration: K is held (a restart would throw the evidence away and delay the swap by a duration)
    swap_pending: str | None = None


def _posterior(
    prior_alpha: float, strength: float, measured: AcceptanceEvidence | None, confidence: float
) -> tuple[float, tuple[float, float], str]:
    s = measured.successes if measured else 0.0
    f = measured.failures if measured else 0.0
    a = strength * prior_alpha + s + 0.5
    b = strength * (1 - prior_alpha) + f + 0.5
    tail = (1 - confidence) / 2
    source = "prior" if s + f == 0 else ("measured" if strength == 0 else "measured+prior")
    return a / (a + b), (float(stats.beta.ppf(tail, a, b)), float(stats.beta.ppf(1 - tail, a, b))), source


def capped_batch(
    kv: KvCapacity | None,
    demand: float | None,
    draft: DraftFootprint | None,
    k: int,
    target: StepCostModel,
    batch_size: int,
) -> tuple[int, float]:
    """(batch, scale) of ``draft`` at K when KV memory caps the batch: the demand (requests running +
    waiting) up to the sequences this config fits, and the throughput of plain decoding at that batch
    over plain decoding at the batch plain decoding could run (B/T(B, 0) against B₀/T(B₀, 0)); a speedup
    at the capped batch times the scale is a speedup over plain decoding as it would run. Without a
    measured capacity or demand: (``batch_size``, 1)."""
    if kv is None or demand is None or demand <= 0:
        return batch_size, 1.0
    want = max(1, round(demand))
    plain = max(1, min(want, kv.max_batch(None, 0)))
    batch = max(1, min(want, kv.max_batch(draft, k)))
    scale = (batch / target.plain_step_time_s(batch)) / (plain / target.plain_step_time_s(plain))
    return batch, scale


def _score(
    snapshot: DraftChoiceSnapshot,
    cand: DraftCandidate,
    alpha: float,
    alpha_ci: tuple[float, float],
    source: str,
) -> CandidateScore:
    name, footprint = cand.name, cand.footprint()
    target = snapshot.step_cost
    model = cand.beside(target, snapshot.target_params)
    if model is None:
        return CandidateScore(
            name,
            source,
            alpha,
            alpha_ci,
            False,
            0,
            0.0,
            (0.0, 0.0),
            f"{name}: cost ratio unknown (give cost_ratio, draft_fixed_s or params and the target's params).",
        )
    own = snapshot.step_cost_of.get(name)

    def best_k(batch: int, step_cost: StepCostModel) -> KDecision:
        return choose_k(
            KChoiceSnapshot(
                now=snapshot.now,
                acceptance=sparse(
                    ConstantAlphaModel(alpha, min(alpha_ci[0], alpha), max(alpha_ci[1], alpha)), cand.proposal_share
                ),
                step_cost=step_cost,
                batch_size=batch,
                k_max=snapshot.k_max,
                draft=footprint if snapshot.memory is not None else None,
                memory=snapshot.memory,
                confidence=snapshot.config.confidence,
            )
        )

    def ranked(batch: int) -> KDecision:
        # Every candidate is ranked on the linear model, so a draft that ran here (whose cells correct it)
        # and one that never did are compared alike; but it is proposed at the K its own cells favour, the K
        # the K policy would move it to once it runs — else a second restart follows the swap.
        linear = best_k(batch, model)
        if own is None:
            return _half_way(linear, snapshot.current_k) if target.per_token_assumed else linear
        k_own = best_k(batch, own).k
        at = next((o for o in linear.by_k if o.k == k_own), None)
        if at is None or k_own == linear.k:
            return linear
        note = f"{linear.message} At K = {k_own}, which this engine's steps under it favour."
        return replace(linear, k=k_own, speedup=at.speedup, speedup_ci=at.speedup_ci, message=note)

    # the batch depends on K only through its lookahead slots: cap at K = 1, choose K there, cap again
    batch, _ = capped_batch(snapshot.kv, snapshot.demand, footprint, 1, target, snapshot.batch_size)
    decision = ranked(batch)
    k = max(decision.k, 1)
    batch, scale = capped_batch(snapshot.kv, snapshot.demand, footprint, k, target, snapshot.batch_size)
    if scale != 1.0:
        decision = ranked(batch)
    fits = any(o.fits_memory for o in decision.by_k if o.k > 0)
    lo, hi = decision.speedup_ci
    capped = f" at batch {batch} (memory cap; {scale:.2f}× plain decoding's throughput)" if scale != 1.0 else ""
    share = cand.proposal_share
    drafts_at = f", drafting at {share:.0%} of its steps" if share < 1.0 else ""
    return CandidateScore(
        name,
        source,
        alpha,
        alpha_ci,
        fits,
        decision.k,
        decision.speedup * scale,
        (lo * scale, hi * scale),
        f"{name}: α ≈ {alpha:.2f} ({source}){drafts_at}{capped}; {decision.message}",
        proposal_share=share,
    )


def _half_way(decision: KDecision, current_k: int) -> KDecision:
    """``decision`` with K at most half-way up from the running K (at least one step) to the K it predicts
    best, as the K policy moves under a step-cost model fitted from steps at one K and one batch size
    (``StepCostModel.per_token_assumed``: verification's per-token cost is 0 by assumption, which overrates
    larger K; ``policies.choose_k.choose_k_over_load``). A swap planned there takes the same step: the
    candidate's steps then measure the cost, and the K policy goes on from them (gpu_code_rag: ngram swapped
    in at K = 8 on free verification, its best K 5)."""
    if decision.k <= current_k:
        return decision
    cap = current_k + max(1, math.ceil((decision.k - current_k) / 2))
    allowed = [o for o in decision.by_k if 0 < o.k <= cap and o.fits_memory]
    pick = max(allowed, key=lambda o: (o.speedup, -o.k), default=None)
    if pick is None or pick.k == decision.k:
        return decision
    note = (
        f"{decision.message} Proposed at K = {pick.k} ({pick.speedup:.2f}×), half-way up from the running K = "
        f"{current_k}: K = {decision.k} is best only with verification taken as free (the steps so far ran one K "
        "at one batch size); its steps measure it."
    )
    return replace(
        decision, k=pick.k, speedup=pick.speedup, speedup_ci=pick.speedup_ci,
        expected_tokens_per_step=pick.expected_tokens_per_step, message=note,
    )


def _rank(snapshot: DraftChoiceSnapshot) -> list[CandidateScore]:
    """Every other candidate scored with its posterior α (prior + measured history on this target)."""
    cfg = snapshot.config
    ranking: list[CandidateScore] = []
    for cand in snapshot.candidates:
        if cand.name == snapshot.current:
            continue
        strength = cfg.prior_strength_trials if cand.prior_strength_trials is None else cand.prior_strength_trials
        alpha, ci, source = _posterior(cand.prior_alpha, strength, snapshot.history.get(cand.name), cfg.confidence)
        score = _score(snapshot, cand, alpha, ci, source)
        prior = f"{cand.prior_source} {cand.prior_alpha:.2f} worth {strength:.0f} tokens"
        ranking.append(replace(score, prior=prior))
    return ranking


def _confidently_better(
    ranking: Sequence[CandidateScore], current: CandidateScore | None, trigger: TriggerCheck
) -> CandidateScore | None:
    """Beyond failure: the best candidate surely faster than the running draft (:func:`_beating`), once the
    running draft's evidence is as complete as the floor asks (the trigger's duration covered,
    ``min_drafts`` drafts; the gain rail then asks for ``min_gain`` on top, the switching-cost rail for the
    payback); None: the running draft stays."""
    judged = trigger.reason in (TriggerReason.ABOVE_THRESHOLD, TriggerReason.RECOVERED)
    if current is None or current.k <= 0 or not judged:
        return None
    return _beating(ranking, current)


def _beating(ranking: Sequence[CandidateScore], current: CandidateScore) -> CandidateScore | None:
    """The candidate with the highest lower end among those surely faster than ``current``: the interval of
    their speedups' ratio is above 1. The two come from independent evidence (each draft's own α), so the
    ratio's interval combines theirs in quadrature (:func:`independent_ratio_interval`), not at opposite
    ends, which would ask for far more than the stated confidence."""
    usable = [
        s for s in ranking
        if s.fits_memory and s.k > 0
        and independent_ratio_interval(s.speedup, s.speedup_ci, current.speedup, current.speedup_ci)[0] > 1.0
    ]
    return max(usable, key=lambda s: s.speedup_ci[0], default=None)


def _measured_score(
    snapshot: DraftChoiceSnapshot, current: DraftCandidate, windows: Sequence[SpecWindow]
) -> CandidateScore | None:
    """The running draft scored on its pooled α over ``windows``, its interval as wide as their spread says
    (counts divided by φ); None without usable counters."""
    pooled, spread = AcceptanceEvidence(), DispersionSums()
    for w in windows:
        result = evidence_from_counters(w.counters)
        if result.evidence is not None:
            pooled = pooled + result.evidence
            spread = spread.add(result.evidence.successes, result.evidence.trials)
    if pooled.trials <= 0:
        return None
    _, ci, _ = _posterior(0.5, 0.0, pooled.scaled(1.0 / spread.phi), snapshot.config.confidence)
    return _score(snapshot, current, pooled.successes / pooled.trials, ci, "measured")


def _beaten_lately(
    snapshot: DraftChoiceSnapshot, current: DraftCandidate, ranking: Sequence[CandidateScore]
) -> str | None:
    """Why K should wait for a swap: on the newest slice of the trigger's duration (``segments``), covered
    and holding its share of ``min_drafts``, a candidate's predicted speedup's lower end is above the
    running draft's upper end (φ-widened) — the acceptance just moved and the older windows still vouch
    for the running draft. None otherwise. Tuning K now would restart the engine under a new config whose
    evidence starts from nothing, delaying the swap by a whole duration (gpu_code_rag: K 5 → 2 at the
    start of the code period, the swap to ngram 720 s later)."""
    cfg = snapshot.config
    span = cfg.duration_s / cfg.segments
    since = snapshot.now - timedelta(seconds=span)
    part = [w for w in snapshot.windows if w.end > since and w.start < snapshot.now]
    covered = sum((min(w.end, snapshot.now) - max(w.start, since)).total_seconds() for w in part)
    drafts = sum(w.counters.drafts for w in part)
    if covered < cfg.coverage * span or drafts < cfg.min_drafts / cfg.segments:
        return None
    lately = _measured_score(snapshot, current, part)
    if lately is None or lately.k <= 0:
        return None
    best = _beating(ranking, lately)
    if best is None:
        return None
    return (
        f"over the last {span:.0f} s the running draft is at {_current(lately)}, below {best.name}'s "
        f"{best.speedup:.2f}× (interval {best.speedup_ci[0]:.2f}–{best.speedup_ci[1]:.2f}×)"
    )


def _current(score: CandidateScore | None) -> str:
    if score is None:
        return "the running draft (no estimate)"
    return f"{score.speedup:.2f}× (interval {score.speedup_ci[0]:.2f}–{score.speedup_ci[1]:.2f}×) at K = {score.k}"


def choose_draft(snapshot: DraftChoiceSnapshot) -> DraftDecision:
    """Keep, switch, fall back to ngram, or switch speculation off. Purely computational."""
    cfg = snapshot.config
    trigger = check_trigger(snapshot.windows, snapshot.now, cfg)
    by_name = {c.name: c for c in snapshot.candidates}
    current = by_name.get(snapshot.current) if snapshot.current else None
    current_score = _measured_score(snapshot, current, snapshot.windows) if current is not None else None
    ranking = _rank(snapshot)
    if not trigger.triggered:
        opportunistic = [s for s in ranking if s.name not in snapshot.not_opportunistic]
        beats = _confidently_better(opportunistic, current_score, trigger)
        pending = None if beats is not None or current is None else _beaten_lately(snapshot, current, opportunistic)
        if beats is not None:
            chosen = by_name[beats.name]
            return DraftDecision(
                DraftReason.FALLBACK_NGRAM if chosen.free else DraftReason.SWITCH_DRAFT,
                f"{chosen.name} ({chosen.method}) at K = {beats.k} is predicted to beat the running draft: "
                f"{beats.speedup:.2f}× plain decoding (interval {beats.speedup_ci[0]:.2f}–{beats.speedup_ci[1]:.2f}×, "
                f"α ≈ {beats.alpha:.2f} from {beats.source}) against {_current(current_score)}.",
                chosen,
                beats.k,
                beats.speedup,
                beats.speedup_ci,
                trigger,
                tuple(ranking),
                current_score,
            )
        keep_speedup = current_score.speedup if current_score else 1.0
        keep_ci = current_score.speedup_ci if current_score else (1.0, 1.0)
        return DraftDecision(
            DraftReason.KEEP_NOT_TRIGGERED,
            f"Keep the current draft: {trigger.message}",
            None,
            snapshot.current_k,
            keep_speedup,
            keep_ci,
            trigger,
            (),
            current_score,
            pending,
        )
    usable = [s for s in ranking if s.fits_memory and s.k > 0]
    # Measured history first among equals: sort by speedup, then by how much of α was measured.
    usable.sort(key=lambda s: (s.speedup, s.source != "prior"), reverse=True)
    ranking.sort(key=lambda s: (s.fits_memory and s.k > 0, s.speedup), reverse=True)
    best = usable[0] if usable and usable[0].speedup > 1.0 else None
    if (
        current_score is not None
        and current_score.k > 0
        and current_score.speedup > 1.0
        and (best is None or current_score.speedup >= best.speedup)
    ):
        return DraftDecision(
            DraftReason.KEEP_NO_BETTER_CANDIDATE,
            f"{trigger.message} No candidate beats the current draft ({current_score.speedup:.2f}× at "
            f"K = {current_score.k}); keeping it.",
            None,
            current_score.k,
            current_score.speedup,
            current_score.speedup_ci,
            trigger,
            tuple(ranking),
            current_score,
        )
    if best is None:
        return DraftDecision(
            DraftReason.DISABLE_SPECULATION,
            f"{trigger.message} No candidate is predicted to beat plain decoding that fits memory: "
            "switching speculation off (K = 0).",
            None,
            0,
            1.0,
            (1.0, 1.0),
            trigger,
            tuple(ranking),
            current_score,
        )
    chosen = by_name[best.name]
    reason = DraftReason.FALLBACK_NGRAM if chosen.free else DraftReason.SWITCH_DRAFT
    verb = "Falling back to" if chosen.free else "Switching to"
    return DraftDecision(
        reason,
        f"{trigger.message} {verb} {chosen.name} ({chosen.method}) at K = {best.k}: predicted "
        f"{best.speedup:.2f}× plain decoding (interval {best.speedup_ci[0]:.2f}–{best.speedup_ci[1]:.2f}×, "
        f"α ≈ {best.alpha:.2f} from {best.source}).",
        chosen,
        best.k,
        best.speedup,
        best.speedup_ci,
        trigger,
        tuple(ranking),
        current_score,
    )


def choose_enable(snapshot: DraftChoiceSnapshot) -> DraftDecision:
    """Speculation is off: turn it back on with the candidate whose predicted speedup over plain decoding
    is surely above 1 (the lower end of its interval) at the load now, else stay off. Each candidate's α is
    its prior and its measured history on this engine (:func:`_posterior`), as for a swap. The load that
    made speculation lose (a busy spell) can end; nothing else would ever turn it back on. Purely
    computational; ``snapshot.current`` and ``windows`` are not read (there is no running draft)."""
    trigger = TriggerCheck(False, TriggerReason.NOT_COVERED, "Speculation is off.", None, None, 0, 0.0)
    ranking = _rank(replace(snapshot, current=None))
    usable = [s for s in ranking if s.fits_memory and s.k > 0]
    ranking.sort(key=lambda s: (s.fits_memory and s.k > 0, s.speedup), reverse=True)
    best = max(usable, key=lambda s: (s.speedup_ci[0], s.source != "prior"), default=None)
    if best is None or best.speedup_ci[0] <= 1.0:
        if best is not None:
            why = (
                f"the best, {best.name} at K = {best.k}, is predicted {best.speedup:.2f}× plain decoding (interval "
                f"{best.speedup_ci[0]:.2f}–{best.speedup_ci[1]:.2f}×, α ≈ {best.alpha:.2f} from {best.source}), "
                "not surely above 1"
            )
        elif any(s.fits_memory for s in ranking):
            why = "no K pays for any candidate (" + " ".join(s.message for s in ranking if s.fits_memory) + ")"
        else:
            why = "no candidate fits memory at any K"
        return DraftDecision(
            DraftReason.KEEP_OFF,
            f"Speculation stays off at batch {snapshot.batch_size}: {why}.",
            None,
            0,
            1.0,
            (1.0, 1.0),
            trigger,
            tuple(ranking),
        )
    chosen = next(c for c in snapshot.candidates if c.name == best.name)
    return DraftDecision(
        DraftReason.ENABLE_SPECULATION,
        f"Speculation is off; {chosen.name} ({chosen.method}) at K = {best.k} is predicted "
        f"{best.speedup:.2f}× plain decoding at batch {snapshot.batch_size} (interval "
        f"{best.speedup_ci[0]:.2f}–{best.speedup_ci[1]:.2f}×, α ≈ {best.alpha:.2f} from {best.source}): turning it "
        "back on.",
        chosen,
        best.k,
        best.speedup,
        best.speedup_ci,
        trigger,
        tuple(ranking),
    )


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def spec_for(candidate: DraftCandidate, k: int, table: Sequence[KRow] | None = None) -> SpecConfig:
    """The config running ``candidate`` at K (and a per-batch-size table); K = 0 without a table is off."""
    if k <= 0 and table is None:
        return OFF
    extra = {key: v for key, v in candidate.speculative_config.items() if key not in RESERVED_KEYS}
    config = SpecConfig(candidate.method, candidate.path or None, int(k), extra=extra)
    return config if table is None else config.with_table(table, int(k))


def running_speedup(
    score: CandidateScore,
    with_draft: StepCostModel,
    current_k: int,
    batch_size: int,
    confidence: float = 0.95,
    scale: float = 1.0,
) -> tuple[float, tuple[float, float]] | None:
    """The running config's speedup over plain decoding at the K it runs now, from its ranking entry: a
    swap's gain is measured against what is in force, not against the running draft at its best K.
    ``with_draft``: the target's linear model with the running draft's pass (``DraftCandidate.beside``);
    ``scale``: :func:`capped_batch`'s, when memory caps the batch."""
    option = evaluate_k(
        KChoiceSnapshot(
            now=_EPOCH,  # evaluate_k does not read the time
            acceptance=score.alpha_model(),
            step_cost=with_draft,
            batch_size=batch_size,
            k_max=max(current_k, 1),
            confidence=confidence,
        ),
        current_k,
    )
    lo, hi = option.speedup_ci
    return (option.speedup * scale, (lo * scale, hi * scale)) if option.speedup > 0 else None
