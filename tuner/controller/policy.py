"""From a decision context to a proposal: spectuner's policy, composed from ``policies/``.

Purely computational given a :class:`~tuner.controller.context.DecisionContext`; every formula lives
in ``policies/`` (α̂ in ``acceptance``, K in ``choose_k``, the table in ``k_table``, the draft in
``draft_choice``), so the path goes down once and comes back once. The step-cost model T(B, K) is the
controller's (``context.step_cost``: the pinned ``[policy.step_cost]`` or the fit, with this engine's
measured cells laid over it), else the pinned model, else Leviathan's model from the cost ratio.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from policies.acceptance import AlphaEstimate
from policies.acceptance_model import (
    AcceptanceChoice,
    AcceptanceModel,
    ConstantAlphaModel,
    ModelChoice,
    choose_acceptance_model,
    is_head_method,
    sparse,
)
from policies.choose_k import KChoiceSnapshot, choose_k, choose_k_over_load, failed_k_ceiling
from policies.draft_choice import (
    CandidateScore,
    DraftCandidate,
    DraftChoiceSnapshot,
    DraftDecision,
    DraftReason,
    DraftTriggerConfig,
    capped_batch,
    choose_draft,
    choose_enable,
    running_speedup,
    spec_for,
)
from policies.k_table import (
    KTableSnapshot,
    goodput_over_load,
    k_table,
    off_gain_over_load,
    plain_goodput,
    table_gain_over_load,
)
from policies.memory import DraftFootprint
from policies.shadow_replay import with_shadow
from policies.spec_config import OFF, KRow, SpecConfig, k_at
from policies.speedup import independent_ratio_interval
from policies.step_cost import StepCostModel
from tuner.controller.context import DecisionContext
from tuner.controller.settings import PolicySettings

_ALPHA_EPS = 1e-6


class PolicyReason(StrEnum):
    CHANGE_K = "change_k"
    CHANGE_K_TABLE = "change_k_table"  # a new per-batch-size table
    SWAP_DRAFT = "swap_draft"  # acceptance stayed low; another candidate is predicted to do better
    FALLBACK_NGRAM = "fallback_ngram"
    DISABLE_SPECULATION = "disable_speculation"  # acceptance stayed low and nothing beats plain decoding
    DROP_DRAFT = "drop_draft"  # per-batch-size table: plain decoding surely beats the best table over the load
    ENABLE_SPECULATION = "enable_speculation"  # speculation is off and a draft surely beats plain decoding now
    KEEP = "keep"  # the current config is the best
    NO_SPECULATION = "no_speculation"  # nothing to estimate from (method off / no K)
    NO_DRAFTS = "no_drafts"  # speculation on but no drafts yet (no traffic)
    NO_ESTIMATE = "no_estimate"  # counters unusable (reason from the estimator)


@dataclass(frozen=True)
class PolicyOutcome:
    """A proposal (``target`` None: keep the config) with its reason and predicted gain.

    ``acceptance_low`` (why acceptance stays low, when the swap trigger fired) and ``swap_pending``
    (acceptance looks low, K is held while the trigger confirms) steer the controller; ``details`` is
    only recorded in the audit row."""

    reason: PolicyReason
    message: str
    target: SpecConfig | None = None
    predicted_gain: float | None = None  # goodput(target) / goodput(current)
    predicted_gain_ci: tuple[float, float] | None = None
    acceptance_low: str | None = None
    swap_pending: bool = False
    details: dict[str, Any] = field(default_factory=dict)
    # the α evidence behind the proposal when it is not the running config's (turning speculation back on:
    # the candidate's measured history), in drafts counted as independent trials
    evidence_drafts: int | None = None
    # restarts the change commits to (guardrails.Proposal.restarts): 2 when leaving a config that serves
    # every load for one that serves only the load now
    restarts: int = 1
    # the way back's serving lost, in seconds of the current goodput (guardrails.Proposal.way_back_share)
    way_back_share: float = 1.0
    way_back_lag_s: float = 0.0
    # what makes two proposals in a row the same change for the streak rail (None: the target's
    # fingerprint): a table's K at the batch sizes the load runs, not its rows elsewhere, which move with noise
    streak_key: str | None = None
    # a swap beyond failure's less disruptive alternative: the running draft's own K proposal. Its predicted
    # gain is part of the swap's (both are measured against the config in force), so when it applies without
    # a restart and passes the rails the controller takes it first and judges the swap again against it
    alternative: PolicyOutcome | None = None


def step_cost_model(ctx: DecisionContext, settings: PolicySettings) -> StepCostModel:
    """The controller's T(B, K) from the plugin's steps, else the pinned one, else Leviathan's."""
    if ctx.step_cost is not None:
        return ctx.step_cost
    return settings.pinned_step_cost or StepCostModel.from_cost_ratio(settings.policy.cost_ratio)


def propose(ctx: DecisionContext, settings: PolicySettings) -> PolicyOutcome:
    """spectuner's policy: replace a draft whose acceptance stays low, else tune K (one K, or the
    per-batch-size table when ``[policy] per_batch_size``); with speculation off, turn it back on when a
    draft surely beats plain decoding at the load now."""
    if not ctx.current.speculates:
        return propose_enable(ctx, settings)
    swap = propose_swap(ctx, settings)
    if swap is not None and swap.target is not None and swap.acceptance_low is None:
        # beyond failure, the running draft is still good: what a K change of its own would gain is no
        # reason to restart onto another draft (5 Dec 14:39 live: medium at K = 3 under 64 streams, where
        # its table would run K = 1, restarted onto good for 1.02x at equal K)
        tuned = _tune_k(ctx, settings)
        if tuned.target is not None and tuned.predicted_gain_ci is not None and tuned.predicted_gain_ci[0] > 1.0:
            return replace(swap, alternative=tuned)
        return swap
    if swap is not None and (swap.target is not None or swap.swap_pending):
        return swap
    tuned = _tune_k(ctx, settings)
    if swap is not None and swap.details:
        # acceptance is low but nothing beats the running draft: say so next to the K decision
        return PolicyOutcome(
            tuned.reason,
            f"{swap.message} {tuned.message}",
            tuned.target,
            tuned.predicted_gain,
            tuned.predicted_gain_ci,
            acceptance_low=swap.acceptance_low,
            details={**tuned.details, **swap.details},
        )
    return tuned


def _tune_k(ctx: DecisionContext, settings: PolicySettings) -> PolicyOutcome:
    return propose_k_table(ctx, settings) if settings.policy.per_batch_size else propose_k(ctx, settings)


def _measured(ctx: DecisionContext, settings: PolicySettings) -> PolicyOutcome | AcceptanceChoice:
    """The acceptance model of the running config — or why K cannot be tuned now.

    For a head on the target's hidden states (EAGLE, EAGLE-3, MTP) per-position acceptance, whose decline
    with position one α would overstate at a larger K. For a separate draft model or a lookup one α,
    unless its positions disagree with one α beyond what the windows' own spread (φ) explains: prompt
    lookup's copied spans end, a small draft drifts — one α then over-speculates (gpu_code_rag: ngram at
    α̂ 0.82 from K = 3 went to K = 8, the best K being 5)."""
    if not ctx.current.speculates:
        return PolicyOutcome(PolicyReason.NO_SPECULATION, "Speculation is off: there is no acceptance to measure.")
    if ctx.spec.drafts == 0:
        return PolicyOutcome(PolicyReason.NO_DRAFTS, "No drafts under the current config yet (no traffic?).")
    model = alpha_model(ctx.alpha)
    if model is None:
        return PolicyOutcome(PolicyReason.NO_ESTIMATE, ctx.alpha.message)
    k_max = max(settings.policy.k_max, ctx.current.k or 0, 1)
    if is_head_method(ctx.current.method) and ctx.positions.observed_positions >= 1:
        return choose_acceptance_model(ctx.current.method, ctx.alpha, ctx.positions, max_k=k_max)
    if ctx.positions.observed_positions >= 2:
        phi = max(ctx.alpha.dispersion, 1.0)
        choice = choose_acceptance_model(ctx.current.method, ctx.alpha, ctx.positions, max_k=k_max, dispersion=phi)
        if choice.choice is not ModelChoice.CONSTANT_ALPHA:
            if ctx.positions_earlier_configs:
                n = ctx.positions_earlier_configs
                choice = replace(
                    choice,
                    message=f"{choice.message} (positions pooled over this draft's runs at every K in the evidence "
                    f"window: this config and {n} earlier one{'s' if n > 1 else ''})",
                )
            return choice
    return AcceptanceChoice(model, ModelChoice.CONSTANT_ALPHA, "one α")


def _acceptance_details(ctx: DecisionContext, choice: AcceptanceChoice, details: dict[str, Any]) -> str:
    """Record a per-position model in ``details`` and return a sentence for the message ("" for one α)."""
    if ctx.positions_earlier_configs:
        details["positions"] = {
            "trials": [round(n, 1) for n in ctx.positions.trials],
            "successes": [round(x, 1) for x in ctx.positions.successes],
            "earlier_configs": ctx.positions_earlier_configs,
        }
    if choice.choice is ModelChoice.CONSTANT_ALPHA:
        return ""
    details["acceptance_model"] = {"choice": choice.choice.value, "message": choice.message}
    return f" K planned with per-position acceptance: {choice.message}."


def alpha_model(estimate: AlphaEstimate) -> ConstantAlphaModel | None:
    if estimate.alpha is None or estimate.alpha_ci is None:
        return None
    clamp = lambda x: min(max(x, _ALPHA_EPS), 1.0 - _ALPHA_EPS)  # noqa: E731 — α̂ may hit 0 or 1 exactly
    lo, hi = estimate.alpha_ci
    return ConstantAlphaModel(clamp(estimate.alpha), clamp(min(lo, estimate.alpha)), clamp(max(hi, estimate.alpha)))


def propose_k(ctx: DecisionContext, settings: PolicySettings) -> PolicyOutcome:
    """One K for the running draft, scored over the load profile, below what failed lately."""
    choice = _measured(ctx, settings)
    if isinstance(choice, PolicyOutcome):
        return choice
    model = choice.model
    p = settings.policy
    k_now = ctx.current.k or 0
    k_max = max(p.k_max, k_now)  # never below the current K, so its goodput is comparable
    caps = _batch_caps(ctx, k_max)
    # when memory caps the batch, every K is judged at the demand up to its own cap (K = 0: the draft dropped)
    load = ctx.mean_demand if caps is not None else ctx.mean_batch_size
    batch = max(1, round(load or 1.0))
    step_cost = step_cost_model(ctx, settings)
    decision = choose_k(
        KChoiceSnapshot(
            now=ctx.now,
            acceptance=model,
            step_cost=step_cost,
            batch_size=batch,
            k_max=k_max,
            current_k=k_now,
            confidence=p.confidence,
            batch_caps=caps,
        )
    )
    failed = set(ctx.failed)
    decision, bins = choose_k_over_load(
        decision,
        model,
        step_cost,
        ctx.load_profile,
        k_now,
        failed_ks=frozenset(o.k for o in decision.by_k if ctx.current.with_k(o.k) in failed),
        ceiling=failed_k_ceiling(ctx.failed, ctx.current),
        batch_caps=caps,
        per_token_assumed=step_cost.per_token_assumed,
    )
    details: dict[str, Any] = {
        "alpha": ctx.alpha.alpha,
        "alpha_ci": list(ctx.alpha.alpha_ci or ()),
        "batch_size": batch,
    }
    planned = _acceptance_details(ctx, choice, details)
    if bins:
        details["load_bins"] = [[round(s, 1), round(b, 2)] for s, b in bins]
    if ctx.load_window is not None and ctx.load_window.regime:
        details["load_window"] = ctx.load_window.to_json()
    if caps is not None:
        details["batch_caps"] = list(caps)  # sequences that fit KV memory at K = 0, 1, …
    details["k_reason"] = decision.reason.value
    if decision.k == k_now or decision.gain_vs_current is None or decision.gain_vs_current_ci is None:
        return PolicyOutcome(
            PolicyReason.KEEP, f"K = {k_now} is already the best choice. {decision.message}", details=details
        )
    return PolicyOutcome(
        PolicyReason.CHANGE_K,
        f"{ctx.alpha.message}{planned} Change K {k_now} → {decision.k}: {decision.message}",
        ctx.current.with_k(decision.k),
        decision.gain_vs_current,
        decision.gain_vs_current_ci,
        details=details,
    )


def _batch_caps(ctx: DecisionContext, k_max: int) -> tuple[int, ...] | None:
    """Sequences the engine's measured KV pool fits at K = 0 (the draft dropped) .. k_max with the running
    draft; None when the pool is not known. While the demand is below every cap, every K runs the demand."""
    kv, running = ctx.kv_capacity, ctx.running
    if kv is None or running is None or ctx.mean_demand is None:
        return None
    return tuple(kv.max_batch(None if k == 0 else running.footprint(), k) for k in range(k_max + 1))


def propose_k_table(ctx: DecisionContext, settings: PolicySettings) -> PolicyOutcome:
    """The best K for every batch size 1..max_batch_size; the gain is judged on the load profile seen
    in the evidence window (each window's requests running, weighted by its duration)."""
    choice = _measured(ctx, settings)
    if isinstance(choice, PolicyOutcome):
        return choice
    model = choice.model
    p = settings.policy
    k_engine = max(ctx.current.k or 0, p.k_max)
    # a table's K = 0 keeps the draft loaded: with a draft model each step still runs its catch-up pass,
    # unless the plugin skips it ([plugin] skip_draft_pass_at_k0)
    step_cost = settings.engine_step_cost(
        step_cost_model(ctx, settings), ctx.current.method, ctx.output_tokens_per_request
    )
    footprint = _footprint(ctx.running, settings)
    table = k_table(
        KTableSnapshot(
            now=ctx.now,
            acceptance=model,
            step_cost=step_cost,
            max_batch_size=p.max_batch_size,
            k_max=k_engine,
            draft=footprint,
            memory=settings.memory if footprint is not None else None,
            confidence=p.confidence,
        )
    )
    new_rows = table.rows
    old_rows = ctx.current.table_rows(p.max_batch_size) or new_rows
    details: dict[str, Any] = {
        "alpha": ctx.alpha.alpha,
        "alpha_ci": list(ctx.alpha.alpha_ci or ()),
        "table": [list(r) for r in new_rows],
        "table_reason": table.reason.value,
        "current_table": [list(r) for r in old_rows],
    }
    planned = _acceptance_details(ctx, choice, details)
    drop = _drop_draft(ctx, settings, model, step_cost, new_rows, old_rows, k_engine, details)
    if drop is not None:
        return drop
    if new_rows == old_rows and ctx.current.k_table is not None:
        return PolicyOutcome(
            PolicyReason.KEEP, f"The per-batch-size table is already the best. {table.message}", details=details
        )
    profile = ctx.batch_profile or ((1.0, float(ctx.mean_batch_size or 1.0)),)
    gain = table_gain_over_load(
        ctx.now, model, step_cost, new_rows, old_rows, profile, p.max_batch_size, k_engine, p.confidence
    )
    if gain is None:
        return PolicyOutcome(PolicyReason.KEEP, "No load profile to judge a table on yet.", details=details)
    rows_text = ", ".join(f"{lo}–{hi}: K={k}" for lo, hi, k in new_rows)
    target = ctx.current.with_table(new_rows, k_engine)
    return PolicyOutcome(
        PolicyReason.CHANGE_K_TABLE,
        f"{ctx.alpha.message}{planned} New per-batch-size table {rows_text}: {table.message} "
        f"Predicted {gain.gain:.2f}× the current table on the load seen in the last {ctx.duration_s:.0f} s.",
        target,
        gain.gain,
        gain.interval,
        details=details,
        streak_key=_table_streak_key(target, new_rows, profile),
    )


def _table_streak_key(target: SpecConfig, rows: tuple[KRow, ...], profile: Sequence[tuple[float, float]]) -> str:
    """The change a table proposal makes where the load runs: its draft and K_max, and its K at each batch
    size holding ≥ 5 % of the profile's weight. Rows at batch sizes the load does not visit move from tick
    to tick with α's noise (a boundary at 10 or 11 when the load is at 1) and must not restart the streak."""
    weight: dict[int, float] = {}
    for w, b in profile:
        size = max(round(b), 1)
        weight[size] = weight.get(size, 0.0) + w
    total = sum(weight.values()) or 1.0
    visited = sorted(b for b, w in weight.items() if w >= 0.05 * total) or [1]
    ks = ",".join(f"{b}:{k_at(rows, b)}" for b in visited)
    return f"table {target.method} {target.model or ''} K_max={target.k} at {ks}"


def _draft_streak_key(target: SpecConfig) -> str:
    """A draft change's streak key: the draft it runs, whatever K or table comes with it. The table is
    recomputed every tick and its boundaries move with α's noise: keyed on the whole config, the simulator's
    lab_phases proposed a swap to good "1 time(s) in a row" four ticks running, a different table each time."""
    if not target.speculates:
        return "off"
    # the draft's own settings (a lookup's n-gram sizes) tell two candidates of one method apart
    extra = json.dumps(dict(target.extra), sort_keys=True, default=str) if target.extra else ""
    return f"draft {target.method} {target.model or ''} {extra}".rstrip()


def _drop_draft(
    ctx: DecisionContext,
    settings: PolicySettings,
    model: AcceptanceModel,
    step_cost: StepCostModel,
    new_rows: tuple[KRow, ...],
    old_rows: tuple[KRow, ...],
    k_engine: int,
    details: dict[str, Any],
) -> PolicyOutcome | None:
    """Speculation off, when an engine without the draft surely beats the best table over the load that
    one config must serve (the load window, as :func:`propose_k` judges one K): a table's K = 0 rows still
    run a draft model's pass and its K = 1 rows verify twice the tokens, so under a sustained full batch
    only dropping the draft reaches plain decoding. It is a restart: the switching-cost rail weighs it over
    the load regime's expected remaining length, and :func:`propose_enable` brings the draft back."""
    p = settings.policy
    profile = ctx.load_profile or ctx.batch_profile
    if not profile:
        return None
    args = (ctx.now, model, step_cost)
    over_best = off_gain_over_load(*args, new_rows, profile, p.max_batch_size, k_engine, p.confidence)
    if over_best is None or over_best.interval[0] <= 1.0:
        return None
    over_current = off_gain_over_load(*args, old_rows, profile, p.max_batch_size, k_engine, p.confidence)
    if over_current is None:
        return None
    seconds = sum(s for s, _ in profile)
    mean = sum(s * b for s, b in profile) / seconds
    share, lag_s, way_back = _way_back(ctx, settings, model, step_cost, old_rows, new_rows, profile, k_engine, mean)
    details["drop_draft"] = {
        "over_best_table": over_best.gain,
        "over_best_table_ci": list(over_best.interval),
        "load_s": seconds,
        "mean_load": mean,
        "way_back_share": share,
        "way_back_lag_s": lag_s,
    }
    return PolicyOutcome(
        PolicyReason.DROP_DRAFT,
        f"{ctx.alpha.message} Drop the draft (speculation off): over the load of the last {seconds:.0f} s "
        f"(mean {mean:.1f} requests), plain decoding makes {over_best.gain:.2f}× "
        f"({over_best.interval[0]:.2f}–{over_best.interval[1]:.2f}×) the tokens of the best table, whose "
        f"K = 0 rows still pay the draft's pass.{way_back}",
        OFF,
        over_current.gain,
        over_current.interval,
        details=details,
        # the table served every load; plain decoding serves only this one, and coming back is a restart
        restarts=2,
        way_back_share=share,
        way_back_lag_s=lag_s,
    )


def _way_back(
    ctx: DecisionContext,
    settings: PolicySettings,
    model: AcceptanceModel,
    step_cost: StepCostModel,
    old_rows: tuple[KRow, ...],
    new_rows: tuple[KRow, ...],
    profile: Sequence[tuple[float, float]],
    k_engine: int,
    mean_load: float,
) -> tuple[float, float, str]:
    """What bringing the draft back will cost, in the current config's goodput: the share of a second of
    it that each second of that restart loses, the seconds of it lost while the draft is not back yet, and
    a sentence saying so (empty when it is charged as a restart at the current goodput).

    The draft comes back when the load falls to where speculation pays again; its restart then stops an
    engine without a draft serving that lower load, which makes fewer tokens a second than this one does
    now (charged at the current goodput, a restart back to one stream cost 10× what it does: the
    simulator's lab_gpu_like, 263 against ~23 tokens/s). And the draft comes back only once that load is
    sustained (``load_regime_sustained_s``): until then plain decoding serves it, short of the table. The
    best guess of that lower load is the level the load rose from (policies.regime); unknown, or not
    lower, it is charged as a restart at the current rate."""
    back = ctx.load_before
    if back is None or not back < mean_load:
        return 1.0, 0.0, ""
    p = settings.policy
    now_rate = goodput_over_load(ctx.now, model, step_cost, old_rows, profile, p.max_batch_size, k_engine)
    back_off = plain_goodput(step_cost, back, p.max_batch_size)
    back_table = goodput_over_load(ctx.now, model, step_cost, new_rows, ((1.0, back),), p.max_batch_size, k_engine)
    if now_rate is None or back_table is None or not (now_rate > 0 and back_off > 0):
        return 1.0, 0.0, ""
    share = min(back_off / now_rate, 1.0)
    lag_s = p.load_regime_sustained_s * max(back_table - back_off, 0.0) / now_rate
    return share, lag_s, (
        f" Bringing the draft back is a restart at the load this one rose from ({back:.1f} requests), where "
        f"plain decoding makes {share:.2f}× the tokens a second the current config makes now, after "
        f"{p.load_regime_sustained_s:.0f} s of it short of the table (~{lag_s:.0f} s of the current goodput)."
    )


# -- the draft ----------------------------------------------------------------------------------------

_SWAP_REASONS = {
    DraftReason.SWITCH_DRAFT: PolicyReason.SWAP_DRAFT,
    DraftReason.FALLBACK_NGRAM: PolicyReason.FALLBACK_NGRAM,
    DraftReason.DISABLE_SPECULATION: PolicyReason.DISABLE_SPECULATION,
}


def _footprint(candidate: DraftCandidate | None, settings: PolicySettings) -> DraftFootprint | None:
    return candidate.footprint() if candidate is not None and settings.memory is not None else None


def propose_swap(ctx: DecisionContext, settings: PolicySettings) -> PolicyOutcome | None:
    """None when swapping is off or cannot apply; an outcome without target when the draft stays
    (``acceptance_low`` set when the trigger fired but no candidate is better)."""
    swap = settings.swap
    running = ctx.running
    if swap is None or not ctx.candidates or not ctx.current.speculates or ctx.spec.drafts == 0 or running is None:
        return None
    p = settings.policy
    k_now = ctx.current.k or 0  # what the engine is configured with: its lookahead slots take KV memory
    # a candidate that failed to start is not tried again within the retry horizon
    allowed = [c for c in ctx.candidates if c is running or c.name not in ctx.failed_candidates]
    batch = _swap_batch(ctx, settings)
    step_cost = step_cost_model(ctx, settings)
    decision = choose_draft(
        replace(
            _draft_snapshot(ctx, settings, allowed, batch, step_cost, swap),
            current=running.name,
            current_k=ctx.current.k_at(batch),
            windows=ctx.trigger_windows,
            not_opportunistic=ctx.floored,
        )
    )
    trigger = decision.trigger
    details = _draft_details(decision, swap, _shadow_weight(ctx, decision))
    reason = _SWAP_REASONS.get(decision.reason)
    if reason is None:
        if not trigger.triggered and decision.swap_pending is not None:
            return PolicyOutcome(
                PolicyReason.KEEP,
                f"A swap looks likely ({decision.swap_pending}); confirming over {swap.duration_s:.0f} s, K "
                "unchanged meanwhile.",
                swap_pending=True,
                details={**details, "swap_pending": True},
            )
        if not trigger.triggered:
            return _swap_pending(ctx, settings, len(allowed) > 1, trigger.message)
        details["acceptance_low"] = trigger.message
        return PolicyOutcome(PolicyReason.KEEP, decision.message, acceptance_low=trigger.message, details=details)
    low = trigger.message if trigger.triggered else None  # a swap beyond failure: acceptance is not low
    if low is not None:
        details["acceptance_low"] = low
    with_running = running.beside(step_cost, p.target_params) or step_cost.with_draft_ratio(p.cost_ratio)
    # the running config at the batch its memory lets it run (all of the demand when memory is no limit)
    cur_batch, cur_scale = capped_batch(ctx.kv_capacity, ctx.mean_demand, running.footprint(), k_now, step_cost, batch)
    current = (
        running_speedup(
            decision.current,
            with_running,
            # the K it drafts at that batch: a per-batch-size table's row, not the engine's K_max (5 Dec
            # simulator, lab_phases: medium's table drafting K = 2 at 16 streams was scored at K = 5, so good
            # at K = 3 read as 1.075x it, not the 1.017x it was, and restarted the engine at 64 streams)
            ctx.current.k_at(cur_batch),
            cur_batch,
            p.confidence,
            cur_scale,
        )
        if decision.current is not None
        else None
    )
    if decision.candidate is None:  # switch speculation off
        target: SpecConfig = OFF
        new_speedup, new_ci = 1.0, (1.0, 1.0)
    else:
        table: tuple[KRow, ...] | None = None
        k = decision.k
        if p.per_batch_size:
            table, k = _table_for(decision.candidate, ctx, settings, decision.ranking)
        target = spec_for(decision.candidate, k, table)
        new_speedup, new_ci = decision.predicted_speedup, decision.predicted_speedup_ci
        details["candidate"] = decision.candidate.name
    if current is None or current[1][0] <= 0:
        return PolicyOutcome(PolicyReason.KEEP, f"{decision.message} (no speedup estimate for the running draft)")
    cur_speedup, cur_ci = current
    gain = new_speedup / cur_speedup
    # the two speedups rest on independent evidence (each draft's own α): their intervals combine in
    # quadrature; a K change's gain (one draft, one α) keeps dividing opposite ends
    gain_ci = independent_ratio_interval(new_speedup, new_ci, cur_speedup, cur_ci)
    message = decision.message
    if decision.candidate is not None and decision.candidate.name in ctx.shadow and ctx.shadow_weight:
        message = f"{message} Its shadow replays counted with {ctx.shadow_weight}."
    return PolicyOutcome(
        reason, message, target, gain, gain_ci, acceptance_low=low, details=details,
        streak_key=_draft_streak_key(target),
    )  # fmt: skip


def propose_enable(ctx: DecisionContext, settings: PolicySettings) -> PolicyOutcome:
    """Speculation is off (the K policy chose K = 0 under load, a swap found nothing better than plain
    decoding, or the operator started without it): turn it back on with the candidate whose speedup over
    plain decoding is surely above 1 at the load now — its α from its measured history on this engine and
    its prior, K chosen over the load profile as :func:`propose_k` would. The guardrails then ask for
    ``min_gain``, the evidence behind that α and the restart's payback, as for any change."""
    allowed = [c for c in ctx.candidates if c.name not in ctx.failed_candidates]
    if not allowed:
        return PolicyOutcome(
            PolicyReason.NO_SPECULATION,
            "Speculation is off and no draft is known to turn it back on with (none registered, none run "
            "within the swap history).",
        )
    p = settings.policy
    trigger = settings.swap or DraftTriggerConfig()
    step_cost = step_cost_model(ctx, settings)
    batch = _enable_batch(ctx)
    decision = choose_enable(_draft_snapshot(ctx, settings, allowed, batch, step_cost, trigger))
    details = _draft_details(decision, trigger, _shadow_weight(ctx, decision))
    details["batch_size"] = batch
    chosen = decision.candidate
    score = next((r for r in decision.ranking if chosen is not None and r.name == chosen.name), None)
    if chosen is None or score is None:
        return PolicyOutcome(PolicyReason.NO_SPECULATION, decision.message, details=details)
    k, gain, gain_ci = decision.k, decision.predicted_speedup, decision.predicted_speedup_ci
    table: tuple[KRow, ...] | None = None
    message = decision.message
    if p.per_batch_size:
        table, k = _table_for(chosen, ctx, settings, decision.ranking)
        over_table = _table_over_load(chosen, table, ctx, settings, decision.ranking)
        if over_table is not None:
            gain, gain_ci = over_table
            message = f"{message} Its table over the load seen: {gain:.2f}× ({gain_ci[0]:.2f}–{gain_ci[1]:.2f}×)."
    elif ctx.load_profile:
        over = _k_over_load(chosen, score, ctx, settings, step_cost, batch)
        if over is not None:
            k_over, gain, gain_ci, text = over
            if text.startswith("Over the load") or k_over != k:
                message = f"{message} {text}"
            k = k_over
    if k <= 0 or gain_ci[0] <= 1.0:
        return PolicyOutcome(PolicyReason.NO_SPECULATION, f"{message} Over the load seen, it does not pay.")
    measured = ctx.history.get(chosen.name)
    shadow = ctx.shadow.get(chosen.name)
    trials = (measured.trials if measured else 0.0) + (shadow.trials if shadow else 0.0)
    # an operator's or the fleet's prior strength is evidence they vouch for; the default prior is not
    vouched = chosen.prior_strength_trials or 0.0
    details["candidate"] = chosen.name
    if trials == 0 and vouched == 0:
        message += (
            f" (α from its configured prior alone: the evidence rail wants measured drafts, or a "
            f"prior_strength_trials on {chosen.name} that vouches for the prior)"
        )
    target = spec_for(chosen, k, table)
    return PolicyOutcome(
        PolicyReason.ENABLE_SPECULATION,
        message,
        target,
        gain,
        gain_ci,
        details=details,
        evidence_drafts=int(trials + vouched),
        streak_key=_draft_streak_key(target),
    )


def _draft_snapshot(
    ctx: DecisionContext,
    settings: PolicySettings,
    candidates: list[DraftCandidate],
    batch: int,
    step_cost: StepCostModel,
    trigger: DraftTriggerConfig,
) -> DraftChoiceSnapshot:
    """What the draft choice reads of the context, with no running draft (a swap sets it with ``replace``)."""
    p = settings.policy
    return DraftChoiceSnapshot(
        now=ctx.now,
        current=None,
        current_k=0,
        windows=(),
        candidates=candidates,
        history=with_shadow(ctx.history, ctx.shadow),
        batch_size=batch,
        k_max=p.k_max,
        step_cost=step_cost,
        target_params=p.target_params,
        memory=settings.memory,
        config=trigger,
        demand=ctx.mean_demand,
        kv=ctx.kv_capacity,
        step_cost_of=ctx.candidate_step_cost,
    )


def _enable_batch(ctx: DecisionContext) -> int:
    """The batch a draft turned back on would run: the mean demand of the load window (the current load
    regime once it is sustained), else the mean batch of the evidence window."""
    if ctx.load_profile:
        seconds = sum(s for s, _ in ctx.load_profile)
        if seconds > 0:
            return max(1, round(sum(s * b for s, b in ctx.load_profile) / seconds))
    return max(1, round(ctx.mean_demand or ctx.mean_batch_size or 1.0))


def _k_over_load(
    candidate: DraftCandidate,
    score: CandidateScore,
    ctx: DecisionContext,
    settings: PolicySettings,
    step_cost: StepCostModel,
    batch: int,
) -> tuple[int, float, tuple[float, float], str] | None:
    """(K, speedup, interval, message) of ``candidate`` over the load profile, as :func:`propose_k` would
    choose K for it once running (its pass as ``DraftCandidate.beside`` prices it; memory caps per K)."""
    p = settings.policy
    model = candidate.beside(step_cost, p.target_params)
    if model is None:
        return None
    alpha = score.alpha_model()
    kv = ctx.kv_capacity
    caps = (
        tuple(kv.max_batch(None if k == 0 else candidate.footprint(), k) for k in range(p.k_max + 1))
        if kv is not None and ctx.mean_demand is not None
        else None
    )
    decision = choose_k(
        KChoiceSnapshot(
            now=ctx.now,
            acceptance=alpha,
            step_cost=model,
            batch_size=batch,
            k_max=p.k_max,
            current_k=0,
            confidence=p.confidence,
            batch_caps=caps,
        )
    )
    decision, _ = choose_k_over_load(decision, alpha, model, ctx.load_profile, 0, batch_caps=caps)
    if decision.gain_vs_current is None or decision.gain_vs_current_ci is None:
        return None
    return decision.k, decision.gain_vs_current, decision.gain_vs_current_ci, decision.message


def _shadow_weight(ctx: DecisionContext, decision: DraftDecision) -> str | None:
    """The replay error the shadow evidence was weighed with, where a ranked candidate has some."""
    ranked = {r.name for r in decision.ranking}
    return ctx.shadow_weight if ctx.shadow_weight and ranked & set(ctx.shadow) else None


def _draft_details(
    decision: DraftDecision, swap: DraftTriggerConfig, shadow_weight: str | None = None
) -> dict[str, Any]:
    """What the audit row keeps of a draft decision: the trigger's reading, the ranking, and how much a
    shadow replay counted where one ranked a candidate."""
    trigger = decision.trigger
    shadow = {"shadow_weight": shadow_weight} if shadow_weight else {}
    return {
        **shadow,
        "draft_reason": decision.reason.value,
        "trigger": {
            "triggered": trigger.triggered,
            "reason": trigger.reason.value,
            "value": trigger.value,
            "upper": trigger.upper,
            "drafts": trigger.drafts,
            "covered_s": trigger.covered_s,
            "threshold": swap.threshold,
            "statistic": swap.statistic.value,
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
                "prior": r.prior,
            }
            for r in decision.ranking
        ],
    }


def _swap_batch(ctx: DecisionContext, settings: PolicySettings) -> int:
    """The batch size candidates are ranked at: the mean load for one K; under a per-batch-size table the
    low end of the load seen (10th percentile), where the table speculates — above it the table turns
    speculation off, so a busy spell must not make every draft look worse than plain decoding."""
    if settings.policy.per_batch_size and ctx.batch_profile:
        loads = sorted(b for _, b in ctx.batch_profile)
        return max(1, round(loads[len(loads) // 10]))
    return max(1, round(ctx.mean_batch_size or 1.0))


def _swap_pending(
    ctx: DecisionContext, settings: PolicySettings, has_alternative: bool, why: str
) -> PolicyOutcome | None:
    """While acceptance looks low but has not *stayed* low long enough, K is left alone: tuning K for a
    draft about to be replaced would restart the engine for nothing, and a K = 0 table would stop the
    drafts that the swap decision needs as evidence."""
    swap = settings.swap
    est = ctx.alpha
    if swap is None or not has_alternative:
        return None
    if est.alpha is None or est.alpha_ci is None or est.alpha_ci[1] >= swap.threshold:
        return None
    return PolicyOutcome(
        PolicyReason.KEEP,
        f"Acceptance looks low (α = {est.alpha:.3f}, upper {est.alpha_ci[1]:.3f} < {swap.threshold}); confirming "
        f"over {swap.duration_s:.0f} s before a draft swap, K unchanged meanwhile ({why})",
        swap_pending=True,
        details={"swap_pending": True, "alpha": est.alpha, "alpha_ci": list(est.alpha_ci)},
    )


def _table_inputs(
    candidate: DraftCandidate, ctx: DecisionContext, settings: PolicySettings, ranking: tuple[CandidateScore, ...]
) -> tuple[AcceptanceModel, StepCostModel]:
    """α (from the candidate's ranking entry, at its proposal share) and T(B, K) a per-batch-size table for a
    candidate about to be swapped in or turned on is chosen with: the target's linear model with the
    candidate's own pass beside it, as the ranking priced it (``DraftCandidate.beside``) — not the running
    draft's pass nor its cells — and its K = 0 steps run its own draft pass.

    Why the candidate's pass: the table is what the swap applies. Built on the running draft's (6 Dec live
    run: ngram ranked at K = 5 for 4 streams, but its table, priced as K passes of the good draft's 14 ms + 0.5
    ms a sequence and drafting at every step, put K = 2 there and K = 0 from 22 streams: 76 tok/s where
    ngram/K = 5 made 106)."""
    score = next((r for r in ranking if r.name == candidate.name), None)
    if score is not None:
        alpha: AcceptanceModel = score.alpha_model()
    else:
        prior = candidate.prior_alpha
        alpha = sparse(ConstantAlphaModel(prior, prior, prior), candidate.proposal_share)
    linear = step_cost_model(ctx, settings).linear()
    priced = candidate.beside(linear, settings.policy.target_params) or linear
    return alpha, settings.engine_step_cost(priced, candidate.method, ctx.output_tokens_per_request)


def _table_for(
    candidate: DraftCandidate, ctx: DecisionContext, settings: PolicySettings, ranking: tuple[CandidateScore, ...]
) -> tuple[tuple[KRow, ...], int]:
    """A per-batch-size table for a candidate about to be swapped in or turned on."""
    p = settings.policy
    alpha, step_cost = _table_inputs(candidate, ctx, settings, ranking)
    table = k_table(
        KTableSnapshot(
            now=ctx.now,
            acceptance=alpha,
            step_cost=step_cost,
            max_batch_size=p.max_batch_size,
            k_max=p.k_max,
            draft=_footprint(candidate, settings),
            memory=settings.memory,
            confidence=p.confidence,
        )
    )
    return table.rows, p.k_max


def _table_over_load(
    candidate: DraftCandidate,
    table: tuple[KRow, ...],
    ctx: DecisionContext,
    settings: PolicySettings,
    ranking: tuple[CandidateScore, ...],
) -> tuple[float, tuple[float, float]] | None:
    """A table's speedup over plain decoding on the load profile (the load window), with its interval —
    what :func:`_drop_draft` weighs the other way; None without a profile."""
    p = settings.policy
    alpha, step_cost = _table_inputs(candidate, ctx, settings, ranking)
    profile = ctx.load_profile or ctx.batch_profile
    off = off_gain_over_load(ctx.now, alpha, step_cost, table, profile, p.max_batch_size, p.k_max, p.confidence)
    if off is None:
        return None
    return 1.0 / off.gain, (1.0 / off.interval[1], 1.0 / off.interval[0])


__all__ = [
    "PolicyOutcome",
    "PolicyReason",
    "alpha_model",
    "propose",
    "propose_enable",
    "propose_k",
    "propose_k_table",
    "step_cost_model",
]
