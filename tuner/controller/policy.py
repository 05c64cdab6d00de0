"""From evidence to a proposal: the K policy (``policies.choose_k``) applied to the current config.

Purely computational given an :class:`~tuner.controller.evidence.Evidence`. The step-cost model T(B, K)
is the one the controller built from the plugin's per-step records (``evidence.step_cost``: the config's
pinned ``[policy.step_cost]`` or the fit, with this engine's measured cells laid over it), else the pinned
model, else Leviathan's model from the cost ratio.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from policies.acceptance import AlphaEstimate, estimate_alpha, estimate_alpha_from_evidence
from policies.acceptance_model import ConstantAlphaModel
from policies.choose_k import KChoiceSnapshot, choose_k, evaluate_k, goodput_over_load, load_bins
from policies.draft_choice import DraftCandidate, DraftChoiceSnapshot, DraftReason, DraftTriggerConfig, choose_draft
from policies.k_table import KTableSnapshot, k_table
from policies.memory import DraftFootprint, MemoryBudget
from policies.step_cost import StepCostModel
from tuner.actuators.base import config_fingerprint
from tuner.controller.candidates import current_candidate, same_draft, spec_config_for
from tuner.controller.evidence import Evidence, pooled_alpha, spec_config_of
from tuner.controller.step_cost import draft_identity, draft_passes_at_k0, method_drafts_at_k0

_ALPHA_EPS = 1e-6
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class PolicyReason(StrEnum):
    CHANGE_K = "change_k"
    CHANGE_K_TABLE = "change_k_table"  # a new per-batch-size table
    SWAP_DRAFT = "swap_draft"  # acceptance stayed low; another candidate is predicted to do better
    FALLBACK_NGRAM = "fallback_ngram"
    DISABLE_SPECULATION = "disable_speculation"  # acceptance stayed low and nothing beats plain decoding
    KEEP = "keep"  # the current config is the best
    NO_SPECULATION = "no_speculation"  # nothing to estimate from (method off / no K)
    NO_DRAFTS = "no_drafts"  # speculation on but no drafts yet (no traffic)
    NO_ESTIMATE = "no_estimate"  # counters unusable (reason from the estimator)


@dataclass(frozen=True)
class PolicySettings:
    k_max: int = 8
    cost_ratio: float = 0.05
    confidence: float = 0.95
    step_cost: StepCostModel | None = None  # a measured T(B, K); else Leviathan's model from cost_ratio
    per_batch_size: bool = False  # choose vLLM's per-batch-size K table instead of one K
    max_batch_size: int = 16
    target_params: int | None = None
    memory: MemoryBudget | None = None
    swap: DraftTriggerConfig | None = None  # None: never swap drafts

    def step_cost_model(self, evidence: Evidence | None = None) -> StepCostModel:
        """The controller's T(B, K) from the plugin's steps (the pinned model or the fit, under this engine's
        measured cells), else the config's pinned one, else Leviathan's."""
        if evidence is not None and evidence.step_cost is not None:
            return evidence.step_cost
        if self.step_cost is not None:
            return self.step_cost
        return StepCostModel.from_cost_ratio(self.cost_ratio)


@dataclass(frozen=True)
class PolicyOutcome:
    reason: PolicyReason
    message: str
    target: dict[str, Any] | None = None  # the proposed --speculative-config; None: keep
    predicted_gain: float | None = None  # goodput(target) / goodput(current)
    predicted_gain_ci: tuple[float, float] | None = None
    details: dict[str, Any] | None = None


def _measured(
    evidence: Evidence, settings: PolicySettings
) -> PolicyOutcome | tuple[dict[str, Any], int, AlphaEstimate, ConstantAlphaModel]:
    """The running config, its K, α̂ and the acceptance model — or why K cannot be tuned now."""
    current = spec_config_of(evidence.config)
    k_now = current.get("num_speculative_tokens")
    if current.get("method") in (None, "off") or not isinstance(k_now, int) or k_now < 1:
        return PolicyOutcome(PolicyReason.NO_SPECULATION, "Speculation is off: there is no acceptance to measure.")
    if evidence.spec.drafts == 0:
        return PolicyOutcome(PolicyReason.NO_DRAFTS, "No drafts under the current config yet (no traffic?).")
    estimate = _estimate(evidence, settings)
    model = _alpha_model(estimate)
    if model is None:
        return PolicyOutcome(PolicyReason.NO_ESTIMATE, estimate.message)
    return current, k_now, estimate, model


def propose_k(evidence: Evidence, settings: PolicySettings) -> PolicyOutcome:
    measured = _measured(evidence, settings)
    if isinstance(measured, PolicyOutcome):
        return measured
    current, k_now, estimate, model = measured
    assert estimate.alpha_ci is not None  # _measured returns a model only with an interval
    lo, hi = estimate.alpha_ci
    batch = max(1, round(evidence.mean_batch_size or 1.0))
    k_max = max(settings.k_max, k_now)
    step_cost = settings.step_cost_model(evidence)
    decision = choose_k(
        KChoiceSnapshot(
            now=evidence.now,
            acceptance=model,
            step_cost=step_cost,
            batch_size=batch,
            k_max=k_max,  # never below the current K, so its goodput is comparable
            current_k=k_now,
            confidence=settings.confidence,
        )
    )
    details: dict[str, Any] = {"alpha": estimate.alpha, "alpha_ci": [lo, hi], "batch_size": batch}
    # Score every K: over the load profile when the load varied (one K must serve all of it), else at
    # the mean batch of the evidence window (choose_k's own ranking).
    bins = load_bins(evidence.load_profile)
    if len(bins) >= 2:
        scores = {o.k: goodput_over_load(model, step_cost, bins, o.k) for o in decision.by_k}
        value = {k: g.tokens_per_s for k, g in scores.items()}
        interval = {k: g.interval for k, g in scores.items()}
        seconds = sum(s for s, _ in bins)
        over = (
            f"Over the load of the last {seconds:.0f} s (batch {bins[0][1]:.0f}–{bins[-1][1]:.0f}, weighted by "
            "time)"
        )
        details["load_bins"] = [[round(s, 1), round(b, 2)] for s, b in bins]
    else:
        value = {o.k: o.speedup for o in decision.by_k}
        interval = {o.k: o.speedup_ci for o in decision.by_k}
        over = ""
    failed = {config_fingerprint(c) for c in evidence.failed_configs}
    # A K of this draft that failed lately (did not start, or regressed) caps K: a larger K needs more
    # memory and drafts more, so it would most likely fail too — the fallback searches below it.
    ceiling = min(
        (
            int(c["num_speculative_tokens"])
            for c in evidence.failed_configs
            if draft_identity(c) == draft_identity(current)
            and isinstance(c.get("num_speculative_tokens"), int)
            and c["num_speculative_tokens"] > 0
            and not c.get("num_speculative_tokens_per_batch_size")
        ),
        default=None,
    )
    allowed = [
        o.k
        for o in decision.by_k
        if o.fits_memory
        and (ceiling is None or o.k < ceiling or o.k == k_now)
        and (not failed or config_fingerprint(_with_k(current, o.k)) not in failed)
    ]
    best = max(allowed, key=lambda k: (value[k], -k)) if allowed else 0
    ranked_best = max((o.k for o in decision.by_k if o.fits_memory), key=lambda k: (value[k], -k))
    if over or best != decision.k:
        speedup = value[best] / value[0] if value[0] > 0 else float("nan")
        message = f"{over}, K = {best} maximises goodput: {speedup:.2f}× no speculation." if over else ""
        if best != ranked_best:
            why = (
                f"K = {ranked_best} failed lately"
                if config_fingerprint(_with_k(current, ranked_best)) in failed
                else f"K = {ranked_best} is above K = {ceiling}, which failed lately"
            )
            capped = f" (K ≥ {ceiling} is not proposed while that failure is recent)" if ceiling is not None else ""
            message = f"{why}{capped}; the best other K is {best}. {message}".strip()
        elif not over:
            message = decision.message
        cur_lo = interval[k_now][0] if k_now in interval else 0.0
        gain = value[best] / value[k_now] if k_now in value and value[k_now] > 0 else None
        gain_ci = (
            (interval[best][0] / interval[k_now][1], interval[best][1] / cur_lo)
            if gain is not None and cur_lo > 0 and interval[k_now][1] > 0
            else None
        )
        decision = replace(decision, k=best, message=message, gain_vs_current=gain, gain_vs_current_ci=gain_ci)
    details["k_reason"] = decision.reason.value
    if decision.k == k_now or decision.gain_vs_current is None or decision.gain_vs_current_ci is None:
        return PolicyOutcome(
            PolicyReason.KEEP, f"K = {k_now} is already the best choice. {decision.message}", details=details
        )
    target = _with_k(current, decision.k)
    return PolicyOutcome(
        PolicyReason.CHANGE_K,
        f"{estimate.message} Change K {k_now} → {decision.k}: {decision.message}",
        target,
        decision.gain_vs_current,
        decision.gain_vs_current_ci,
        details,
    )


def _with_k(current: dict[str, Any], k: int) -> dict[str, Any]:
    if k == 0:
        return {"method": "off", "num_speculative_tokens": 0}
    return {**current, "num_speculative_tokens": k}


# -- the full spectuner policy: draft swap, then K or the per-batch-size table ------------------------

_SWAP_REASONS = {
    DraftReason.SWITCH_DRAFT: PolicyReason.SWAP_DRAFT,
    DraftReason.FALLBACK_NGRAM: PolicyReason.FALLBACK_NGRAM,
    DraftReason.DISABLE_SPECULATION: PolicyReason.DISABLE_SPECULATION,
}


def propose(evidence: Evidence, settings: PolicySettings) -> PolicyOutcome:
    """spectuner's policy: replace a draft whose acceptance stays low, else tune K (one K, or the
    per-batch-size table when ``settings.per_batch_size``). Purely computational given the evidence."""
    swap = propose_swap(evidence, settings)
    if swap is not None and (swap.target is not None or (swap.details or {}).get("swap_pending")):
        return swap
    tuned = propose_k_table(evidence, settings) if settings.per_batch_size else propose_k(evidence, settings)
    if swap is not None and swap.details:
        # acceptance is low but nothing beats the running draft: say so next to the K decision
        tuned = PolicyOutcome(
            tuned.reason,
            f"{swap.message} {tuned.message}",
            tuned.target,
            tuned.predicted_gain,
            tuned.predicted_gain_ci,
            {**(tuned.details or {}), **swap.details},
        )
    return tuned


def _estimate(evidence: Evidence, settings: PolicySettings) -> AlphaEstimate:
    """α̂ from the summed counters, or pooled window by window when windows ran at different K (a
    per-batch-size table): the summed counters would read every short draft as rejected."""
    estimate = estimate_alpha(evidence.spec, confidence=settings.confidence)
    ks = {s.k for s in evidence.window_specs if s.drafts > 0}
    if len(ks) <= 1 and (not ks or ks == {evidence.spec.k}):
        return estimate
    pooled = pooled_alpha(evidence.window_specs)
    if pooled is None or pooled.trials <= 0:
        return estimate
    alpha, ci = estimate_alpha_from_evidence(pooled, settings.confidence)
    return replace(
        estimate,
        alpha=alpha,
        alpha_ci=ci,
        message=f"α = {alpha:.3f} (interval {ci[0]:.3f}–{ci[1]:.3f}) pooled over windows at K = {sorted(ks)}."
        if alpha is not None and ci is not None
        else estimate.message,
    )


def _alpha_model(estimate: AlphaEstimate) -> ConstantAlphaModel | None:
    if estimate.alpha is None or estimate.alpha_ci is None:
        return None
    clamp = lambda x: min(max(x, _ALPHA_EPS), 1.0 - _ALPHA_EPS)  # noqa: E731 — α̂ may hit 0 or 1 exactly
    lo, hi = estimate.alpha_ci
    return ConstantAlphaModel(clamp(estimate.alpha), clamp(min(lo, estimate.alpha)), clamp(max(hi, estimate.alpha)))


def _footprint(candidate: DraftCandidate | None, settings: PolicySettings) -> DraftFootprint | None:
    return candidate.footprint() if candidate is not None and settings.memory is not None else None


def propose_swap(evidence: Evidence, settings: PolicySettings) -> PolicyOutcome | None:
    """None when swapping is off or cannot apply; an outcome without target when the draft stays
    (``details["acceptance_low"]`` set when the trigger fired but no candidate is better)."""
    current = spec_config_of(evidence.config)
    k_now = current.get("num_speculative_tokens")
    if settings.swap is None or not evidence.candidates or not isinstance(k_now, int) or k_now < 1:
        return None
    if evidence.spec.drafts == 0:
        return None
    running, everyone = current_candidate(current, evidence.candidates, settings.cost_ratio)
    if running is None:
        return None
    failed_models = [c for c in evidence.failed_configs if isinstance(c, dict)]
    allowed = [
        c for c in everyone if c is running or not any(same_draft(f, c) for f in failed_models)
    ]  # a candidate that failed to start is not tried again within the retry horizon
    batch = _swap_batch(evidence, settings)
    decision = choose_draft(
        DraftChoiceSnapshot(
            now=evidence.now,
            current=running.name,
            current_k=k_now,
            windows=evidence.trigger_windows,
            candidates=allowed,
            history=evidence.history,
            batch_size=batch,
            k_max=settings.k_max,
            step_cost=settings.step_cost_model(evidence),
            target_params=settings.target_params,
            memory=settings.memory,
            config=settings.swap,
        )
    )
    trigger = decision.trigger
    details: dict[str, Any] = {
        "draft_reason": decision.reason.value,
        "trigger": {
            "triggered": trigger.triggered,
            "reason": trigger.reason.value,
            "value": trigger.value,
            "upper": trigger.upper,
            "drafts": trigger.drafts,
            "covered_s": trigger.covered_s,
            "threshold": settings.swap.threshold,
            "statistic": settings.swap.statistic.value,
        },
        "ranking": [
            {
                "name": r.name,
                "alpha": r.alpha,
                "alpha_ci": list(r.alpha_ci),
                "source": r.source,
                "k": r.k,
                "speedup": r.speedup,
                "speedup_ci": list(r.speedup_ci),
                "fits_memory": r.fits_memory,
            }
            for r in decision.ranking
        ],
    }
    reason = _SWAP_REASONS.get(decision.reason)
    if reason is None:
        if not trigger.triggered:
            return _swap_pending(evidence, settings, settings.swap, len(allowed) > 1, trigger.message)
        details["acceptance_low"] = trigger.message
        return PolicyOutcome(PolicyReason.KEEP, decision.message, details=details)
    details["acceptance_low"] = trigger.message
    cur_speedup, cur_ci = _running_speedup(decision.current, running, k_now, batch, settings, evidence)
    if decision.candidate is None:  # switch speculation off
        target: dict[str, Any] = {"method": "off", "num_speculative_tokens": 0}
        new_speedup, new_ci = 1.0, (1.0, 1.0)
    else:
        table = None
        k = decision.k
        if settings.per_batch_size:
            table, k = _table_for(decision.candidate, evidence, settings, decision.ranking)
        target = spec_config_for(decision.candidate, k, table)
        new_speedup, new_ci = decision.predicted_speedup, decision.predicted_speedup_ci
        details["candidate"] = decision.candidate.name
    if cur_speedup is None or cur_ci is None or cur_ci[0] <= 0:
        return PolicyOutcome(PolicyReason.KEEP, f"{decision.message} (no speedup estimate for the running draft)")
    gain = new_speedup / cur_speedup
    gain_ci = (new_ci[0] / cur_ci[1], new_ci[1] / cur_ci[0])
    return PolicyOutcome(reason, decision.message, target, gain, gain_ci, details)


def _swap_batch(evidence: Evidence, settings: PolicySettings) -> int:
    """The batch size candidates are ranked at: the mean load for one K; under a per-batch-size table the
    low end of the load seen (10th percentile), where the table speculates — above it the table turns
    speculation off, so a busy spell must not make every draft look worse than plain decoding."""
    if settings.per_batch_size and evidence.batch_profile:
        loads = sorted(b for _, b in evidence.batch_profile)
        return max(1, round(loads[len(loads) // 10]))
    return max(1, round(evidence.mean_batch_size or 1.0))


def _swap_pending(
    evidence: Evidence, settings: PolicySettings, swap: DraftTriggerConfig, has_alternative: bool, why: str
) -> PolicyOutcome | None:
    """While acceptance looks low but has not *stayed* low long enough, K is left alone: tuning K for a
    draft about to be replaced would restart the engine for nothing, and a K = 0 table would stop the
    drafts that the swap decision needs as evidence."""
    if not has_alternative:
        return None
    est = _estimate(evidence, settings)
    if est.alpha is None or est.alpha_ci is None or est.alpha_ci[1] >= swap.threshold:
        return None
    return PolicyOutcome(
        PolicyReason.KEEP,
        f"Acceptance looks low (α = {est.alpha:.3f}, upper {est.alpha_ci[1]:.3f} < {swap.threshold}); confirming "
        f"over {swap.duration_s:.0f} s before a draft swap, K unchanged meanwhile ({why})",
        details={"swap_pending": True, "alpha": est.alpha, "alpha_ci": list(est.alpha_ci)},
    )


def _running_speedup(
    score: Any, running: DraftCandidate, k_now: int, batch: int, settings: PolicySettings, evidence: Evidence
) -> tuple[float | None, tuple[float, float] | None]:
    """The running config's speedup over plain decoding at the K it runs now (the gain of a swap is
    measured against what is in force, not against the running draft at its best K)."""
    if score is None:
        return None, None
    ratio = running.cost_ratio_for(settings.target_params)
    if ratio is None:
        ratio = settings.cost_ratio
    target = settings.step_cost_model(evidence)
    model = StepCostModel(
        fixed_s=target.fixed_s,
        per_token_s=target.per_token_s,
        draft_fixed_s=ratio * target.fixed_s,
        draft_per_seq_s=ratio * target.per_token_s,
    )
    lo, hi = score.alpha_ci
    option = evaluate_k(
        KChoiceSnapshot(
            now=_EPOCH,  # evaluate_k does not read the time
            acceptance=ConstantAlphaModel(score.alpha, min(lo, score.alpha), max(hi, score.alpha)),
            step_cost=model,
            batch_size=batch,
            k_max=max(k_now, 1),
            confidence=settings.confidence,
        ),
        k_now,
    )
    return (option.speedup, option.speedup_ci) if option.speedup > 0 else (None, None)


def _table_for(
    candidate: DraftCandidate, evidence: Evidence, settings: PolicySettings, ranking: Any
) -> tuple[list[list[int]], int]:
    """A per-batch-size table for a candidate about to be swapped in (α from its ranking entry)."""
    score = next((r for r in ranking if r.name == candidate.name), None)
    alpha = score.alpha if score is not None else candidate.prior_alpha
    lo, hi = score.alpha_ci if score is not None else (alpha, alpha)
    model = ConstantAlphaModel(alpha, min(lo, alpha), max(hi, alpha))
    table = k_table(
        KTableSnapshot(
            now=evidence.now,
            acceptance=model,
            # the running draft's cells are not its; its K = 0 steps run its own draft pass
            step_cost=settings.step_cost_model(evidence).linear().with_draft_pass_at_k0(
                method_drafts_at_k0(candidate.method)
            ),
            max_batch_size=settings.max_batch_size,
            k_max=settings.k_max,
            draft=_footprint(candidate, settings),
            memory=settings.memory,
            confidence=settings.confidence,
        )
    )
    return table.as_vllm(), settings.k_max


def current_table(spec: dict[str, Any], max_batch_size: int) -> list[list[int]] | None:
    """The table in force: vLLM's rows, or one row at the engine's K when there is none."""
    rows = spec.get("num_speculative_tokens_per_batch_size")
    if isinstance(rows, list) and rows:
        return [[int(x) for x in r] for r in rows]
    k = spec.get("num_speculative_tokens")
    return [[1, max_batch_size, int(k)]] if isinstance(k, int) else None


def _k_at(rows: list[list[int]], batch: int) -> int:
    for lo, hi, k in rows:
        if lo <= batch <= hi:
            return k
    return rows[-1][2] if batch > rows[-1][1] else rows[0][2]


def propose_k_table(evidence: Evidence, settings: PolicySettings) -> PolicyOutcome:
    """The best K for every batch size 1..max_batch_size; the gain is judged on the load profile seen
    in the evidence window (each window's requests running, weighted by its duration)."""
    measured = _measured(evidence, settings)
    if isinstance(measured, PolicyOutcome):
        return measured
    current, k_now, estimate, model = measured
    running, _ = current_candidate(current, evidence.candidates, settings.cost_ratio)
    footprint = _footprint(running, settings)
    k_engine = max(k_now, settings.k_max)
    # a table's K = 0 keeps the draft loaded: with a draft model each step still runs its catch-up pass
    step_cost = settings.step_cost_model(evidence).with_draft_pass_at_k0(draft_passes_at_k0(current))
    table = k_table(
        KTableSnapshot(
            now=evidence.now,
            acceptance=model,
            step_cost=step_cost,
            max_batch_size=settings.max_batch_size,
            k_max=k_engine,
            draft=footprint,
            memory=settings.memory if footprint is not None else None,
            confidence=settings.confidence,
        )
    )
    new_rows = table.as_vllm()
    old_rows = current_table(current, settings.max_batch_size) or new_rows
    details: dict[str, Any] = {
        "alpha": estimate.alpha,
        "alpha_ci": list(estimate.alpha_ci or ()),
        "table": new_rows,
        "table_reason": table.reason.value,
        "current_table": old_rows,
    }
    if new_rows == old_rows and current.get("num_speculative_tokens_per_batch_size") is not None:
        return PolicyOutcome(
            PolicyReason.KEEP, f"The per-batch-size table is already the best. {table.message}", details=details
        )
    profile = evidence.batch_profile or ((1.0, float(evidence.mean_batch_size or 1.0)),)
    new_tokens = old_tokens = 0.0
    new_lo = new_hi = old_lo = old_hi = 0.0
    for dur, running_seqs in profile:
        b = min(max(1, round(running_seqs)), settings.max_batch_size)
        snap = KChoiceSnapshot(
            now=evidence.now,
            acceptance=model,
            step_cost=step_cost,
            batch_size=b,
            k_max=k_engine,
            confidence=settings.confidence,
            k0_is_off=False,
        )
        new, old = evaluate_k(snap, _k_at(new_rows, b)), evaluate_k(snap, _k_at(old_rows, b))
        new_tokens += dur * new.speedup
        old_tokens += dur * old.speedup
        new_lo, new_hi = new_lo + dur * new.speedup_ci[0], new_hi + dur * new.speedup_ci[1]
        old_lo, old_hi = old_lo + dur * old.speedup_ci[0], old_hi + dur * old.speedup_ci[1]
    if old_tokens <= 0 or old_lo <= 0:
        return PolicyOutcome(PolicyReason.KEEP, "No load profile to judge a table on yet.", details=details)
    gain = new_tokens / old_tokens
    gain_ci = (new_lo / old_hi, new_hi / old_lo)
    target = dict(current)
    target["num_speculative_tokens"] = k_engine
    target["num_speculative_tokens_per_batch_size"] = new_rows
    rows_text = ", ".join(f"{lo}–{hi}: K={k}" for lo, hi, k in new_rows)
    return PolicyOutcome(
        PolicyReason.CHANGE_K_TABLE,
        f"{estimate.message} New per-batch-size table {rows_text}: {table.message} Predicted {gain:.2f}× the "
        f"current table on the load seen in the last {evidence.duration_s:.0f} s.",
        target,
        gain,
        gain_ci,
        details,
    )
