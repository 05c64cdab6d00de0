"""The decision context: everything one decision may read, built from the store in one call.

:func:`build_context` is the only place a decision reads the store. It returns a frozen
:class:`DecisionContext` (the policy's whole input, like Ray Serve's autoscaling context) and the
controller's :class:`ControllerMemory` for the next tick: what matters between ticks is a value passed
in and handed back, never hidden state. :class:`DecisionInputs` is what the audit row keeps of a
context, typed both ways, so verification reads back exactly what the decision saw.

Evidence is the windows of the engine series under the config now in force, ending in the last
``evidence_window_s`` and starting after the config did (a window that spans a restart mixes two
configs and is left out) and after the acceptance last moved with the traffic (windows from before
measured another prompt mix; pooled with the new, they held α̂ near the old level until they aged out).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from collectors.records import EngineKey, WindowRecord
from policies.acceptance import AcceptanceEvidence, AlphaEstimate, alpha_of_windows, effective_counters
from policies.counters import SpecCounters
from policies.draft_choice import DraftCandidate, DraftTriggerConfig, SpecWindow
from policies.load_window import LoadWindow, choose_load_window, load_tracker
from policies.memory import FREE_METHODS, KvCapacity
from policies.positional import PositionData
from policies.regime import SAMPLED_SCATTER_Z, RegimeTracker, basis, left_band, observe, remaining_s, restart
from policies.replay_error import ReplayError, ReplayRun, capped, replay_error
from policies.spec_config import SpecConfig
from policies.step_cost import StepCostModel
from tuner.controller.candidates import current_candidate, same_draft
from tuner.controller.evidence import (
    HistoryCache,
    LoadProfile,
    earlier_windows_of_draft,
    evidence_before_end,
    measured_history,
    spec_windows,
    summarize,
    window_batches,
    windows_under,
)
from tuner.controller.fleet_prior import with_fleet_priors
from tuner.controller.settings import ControllerSettings, PolicySettings
from tuner.controller.step_cost import candidate_step_costs, config_specs, step_cost_from_steps, step_groups
from tuner.store import Store, StoredConfig
from tuner.store.shadow import latest_shadow_results, shadow_evidence, shadow_results


@dataclass(frozen=True)
class DecisionContext:
    """What was measured under the current config, and what a decision may choose from. Rates are
    generated tokens per second; batch sizes are requests running."""

    now: datetime
    keys: tuple[EngineKey, ...]
    config_id: int
    current: SpecConfig
    spec: SpecCounters  # the evidence window's counters, summed
    alpha: AlphaEstimate  # policies.acceptance.alpha_of_windows of the evidence window: THE α̂
    windows: int
    duration_s: float  # per engine series, summed
    generation_tokens: float
    # per-position trials and successes of the same windows, each at the K it drafted (head methods'
    # acceptance falls with position: policies.acceptance_model.choose_acceptance_model)
    positions: PositionData = field(default_factory=lambda: PositionData((), ()))
    # how many earlier configs of the running draft (another K or table, inside the evidence window) added
    # their windows to ``positions`` (evidence.earlier_windows_of_draft); 0: the current config's alone
    positions_earlier_configs: int = 0
    window_rates: tuple[float, ...] = ()  # one per window (the noise of a comparison)
    window_batches: tuple[float | None, ...] = ()  # aligned with window_rates (None: not scraped)
    mean_batch_size: float | None = None
    # (duration s, requests running) per window: the load profile a per-batch-size table is judged on
    batch_profile: tuple[tuple[float, float], ...] = ()
    # (duration s, requests running + waiting) over the load window under any config: the demand one K
    # must serve (empty: judge K at the mean batch of the evidence window)
    load_profile: tuple[tuple[float, float], ...] = ()
    # the load horizon, or the current load regime once it is sustained (policies.load_window)
    load_window: LoadWindow | None = None
    # requests running + waiting in the load regime before the current one (policies.regime): where the load
    # came from, so where a change that serves only this load will likely be undone (None: none observed)
    load_before: float | None = None
    # T(B, K) from the plugin's per-step records (tuner.controller.step_cost); None: not enough steps
    step_cost: StepCostModel | None = None
    step_cost_note: str | None = None
    step_cost_source: str = "fitted"  # "fitted", "pinned" or either "+ measured cells"
    # candidate name → T(B, K) over step_cost's linear model with the cells measured under that draft: the
    # K a swap proposes it at (tuner.controller.step_cost.candidate_step_costs)
    candidate_step_cost: Mapping[str, StepCostModel] = field(default_factory=dict)
    running: DraftCandidate | None = None  # the candidate the engine runs now (None: speculation off)
    # For the draft-swap policy (set when swapping is on and candidates are configured):
    candidates: tuple[DraftCandidate, ...] = ()  # every candidate, the running one included
    trigger_windows: tuple[SpecWindow, ...] = ()  # the current config's windows over the swap duration
    history: Mapping[str, AcceptanceEvidence] = field(default_factory=dict)  # candidate name → measured α
    # candidate name → α evidence from shadow replay of recorded traffic (tuner.shadow), within history_s;
    # the draft choice adds it to ``history`` (both are this target's acceptance of that draft)
    shadow: Mapping[str, AcceptanceEvidence] = field(default_factory=dict)
    # how much a replay counted, in words (policies.replay_error's σ: "replay error σ 0.013 (3 pairs ...)");
    # the swap decision's message and audit row carry it. None: no shadow evidence
    shadow_weight: str | None = None
    failed: tuple[SpecConfig, ...] = ()  # configs that failed to apply or regressed lately (not proposed again)
    failed_candidates: frozenset[str] = frozenset()  # candidates whose draft is among them
    # the draft the 0.4 floor swapped out for the running one, while the running draft's acceptance has
    # not moved since: its pooled history predates the fall that made it leave (not proposed beyond failure)
    floored: frozenset[str] = frozenset()
    # α̂ of the running config over the last decide interval (what the acceptance regime tracks), and half
    # the width of its interval: a move smaller than that is sampling, not the traffic
    recent_alpha: float | None = None
    recent_alpha_noise: float = 0.0
    # expected remaining length of the current acceptance regime (policies.regime), or of the load regime K
    # is chosen for when that is shorter; None: unknown
    regime_remaining_s: float | None = None
    regime_basis: str | None = None  # what that estimate went by, in words (policies.regime.basis)
    # where the evidence starts when the acceptance regime the traffic began cut it short (None: not cut)
    evidence_since: datetime | None = None
    # the evidence window's requests running + waiting (time-weighted) and mean KV usage (0..1): when KV
    # memory caps the batch, requests wait and each config could run a different batch (kv_capacity)
    mean_demand: float | None = None
    kv_usage: float | None = None
    # the engine's KV pool (cache_config_info × KV bytes per token) and the context a sequence holds;
    # None: not scraped or the target's KV bytes per token not configured
    kv_capacity: KvCapacity | None = None
    # mean output tokens of the requests that finished in the evidence windows: their tokens over vLLM's e2e
    # latency count, windows that carry one only (None: no request counted, e.g. the histogram not scraped)
    output_tokens_per_request: float | None = None

    @property
    def goodput_tokens_per_s(self) -> float | None:
        return self.generation_tokens / self.duration_s if self.duration_s > 0 else None

    def to_inputs(self, policy_details: Mapping[str, Any] | None = None) -> DecisionInputs:
        return DecisionInputs(
            config_id=self.config_id,
            current_config=self.current,
            drafts=self.spec.drafts,
            draft_tokens=self.spec.draft_tokens,
            accepted_tokens=self.spec.accepted_tokens,
            accepted_per_pos=tuple(self.spec.accepted_per_pos),
            windows=self.windows,
            duration_s=self.duration_s,
            goodput_tokens_per_s=self.goodput_tokens_per_s,
            window_rates=self.window_rates,
            window_batches=self.window_batches,
            mean_batch_size=self.mean_batch_size,
            step_cost=(
                {"source": self.step_cost_source, "model": self.step_cost.to_dict(), "message": self.step_cost_note}
                if self.step_cost is not None
                else None
            ),
            policy=dict(policy_details or {}),
        )


@dataclass(frozen=True)
class DecisionInputs:
    """The audit row's ``inputs``: enough to re-derive the decision and to verify it afterwards.

    :meth:`from_json` is the one reader of stored inputs; a row written by an older spectuner, or edited
    by hand, reads with the unusable fields empty (verification then judges on raw rates)."""

    config_id: int | None = None
    current_config: SpecConfig | None = None
    drafts: int | None = None
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    accepted_per_pos: tuple[int, ...] = ()
    windows: int | None = None
    duration_s: float | None = None
    goodput_tokens_per_s: float | None = None
    window_rates: tuple[float, ...] = ()
    window_batches: tuple[float | None, ...] = ()
    mean_batch_size: float | None = None
    step_cost: dict[str, Any] | None = None
    policy: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "config_id": self.config_id,
            "current_config": self.current_config.to_vllm() if self.current_config is not None else None,
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "windows": self.windows,
            "duration_s": self.duration_s,
            "goodput_tokens_per_s": self.goodput_tokens_per_s,
            "window_rates": list(self.window_rates),
            "window_batches": list(self.window_batches),
            "mean_batch_size": self.mean_batch_size,
            "step_cost": self.step_cost,
            "policy": self.policy,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DecisionInputs:
        def number(key: str) -> float | None:
            v = data.get(key)
            return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

        def whole(key: str) -> int | None:
            v = data.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) else None

        def listed(key: str) -> list[Any]:
            v = data.get(key)
            return v if isinstance(v, list) else []

        current = None
        raw = data.get("current_config")
        if isinstance(raw, dict):
            try:
                current = SpecConfig.from_vllm(raw)
            except ValueError:
                current = None
        rates = listed("window_rates")
        per_pos = listed("accepted_per_pos")
        step_cost = data.get("step_cost")
        policy = data.get("policy")
        return cls(
            config_id=whole("config_id"),
            current_config=current,
            drafts=whole("drafts"),
            draft_tokens=whole("draft_tokens"),
            accepted_tokens=whole("accepted_tokens"),
            accepted_per_pos=tuple(int(x) for x in per_pos)
            if all(isinstance(x, int | float) and not isinstance(x, bool) for x in per_pos)
            else (),
            windows=whole("windows"),
            duration_s=number("duration_s"),
            goodput_tokens_per_s=number("goodput_tokens_per_s"),
            window_rates=tuple(float(r) for r in rates if isinstance(r, int | float))
            if all(isinstance(r, int | float) for r in rates)
            else (),
            window_batches=tuple(float(b) if isinstance(b, int | float) else None for b in listed("window_batches")),
            mean_batch_size=number("mean_batch_size"),
            step_cost=step_cost if isinstance(step_cost, dict) else None,
            policy=policy if isinstance(policy, dict) else {},
        )


@dataclass(frozen=True)
class ControllerMemory:
    """What the controller carries from one tick to the next; everything else is read from the database
    on every tick, so a restarted daemon carries on where it stopped (this memory only starts empty,
    which delays a change by the hysteresis ticks and costs a few more store reads).

    The three caches hold store reads that never change the outcome, only what a tick costs to read."""

    streak: tuple[str | None, int] = (None, 0)  # (streak key: the target fingerprint or a table's, decisions in a row)
    last_recorded: tuple[str, str] | None = None  # (target, status:reason) of the last held/advisory row
    history: HistoryCache = field(default_factory=HistoryCache)  # α evidence read so far, per config period
    fleet_history: dict[str, HistoryCache] = field(default_factory=dict)  # the same, per other engine's URL
    load: LoadProfile = field(default_factory=LoadProfile)  # requests running over the load horizon
    # (read at, running draft, (T(B, K), note, source), candidate name → T(B, K) with its measured cells):
    # re-read every refit interval or on a swap
    step_cost: (
        tuple[
            datetime,
            tuple[str, str | None],
            tuple[StepCostModel, str, str] | None,
            Mapping[str, StepCostModel],
        ]
        | None
    ) = None
    # acceptance regimes of the running draft (named beside it), measured tick by tick
    alpha_regime: tuple[tuple[str, str | None] | None, RegimeTracker] | None = None
    # load regimes (requests running + waiting over a decide interval, under any config)
    load_regime: RegimeTracker | None = None
    # when the running draft's acceptance last moved with the traffic (a regime the traffic began; kept
    # across our own swaps, which restart the tracker): candidates' shadow replays before it are stale
    alpha_moved_at: datetime | None = None
    # (running config's id, the draft the floor swapped away from before it, or None): read once per
    # config — what ran before a config and how it left do not change while it runs
    floored_previous: tuple[int, SpecConfig | None] | None = None


def build_context(
    store: Store,
    keys: Sequence[EngineKey],
    stored: StoredConfig,
    now: datetime,
    settings: ControllerSettings,
    configured: Sequence[DraftCandidate],
    failed: Sequence[SpecConfig],
    memory: ControllerMemory,
) -> tuple[DecisionContext, ControllerMemory]:
    """The policy's snapshot (see the module doc) and the memory for the next tick.

    ``configured``: the swap candidates as configured now (the config file's and the registry's);
    ``failed``: the configs that failed or regressed within the retry horizon."""
    p = settings.policy.policy
    ctx = measure(store, keys, stored, now, p.evidence_window_s, p.confidence, settings.controller.decide_interval_s)
    running, everyone = current_candidate(ctx.current, configured, p.cost_ratio)
    running, everyone = with_proposal_shares(store, now, settings, running, everyone)
    ctx, memory = _with_regimes(ctx, settings, memory)
    ctx = _since_the_traffic_moved(ctx, store, keys, stored, settings, memory)
    # one K, speculation off under a table, or back on: each serves whatever load comes
    ctx, memory = _with_load(ctx, store, settings, memory)
    ctx = replace(ctx, running=running, failed=tuple(failed))
    ctx = replace(ctx, kv_capacity=kv_capacity(ctx, cache_config(store, keys), settings.policy))
    if not ctx.current.speculates:
        # the drafts it could come back with; their cost ratios also let their steps measure the target
        # (steps without speculation at one batch size cannot tell its per-token cost from its fixed cost)
        revivable = revival_candidates(store, keys, now, settings, configured)
        _, everyone = with_proposal_shares(store, now, settings, None, revivable)
    ctx, memory = _with_step_cost(ctx, store, settings, running, everyone, memory)
    if not ctx.current.speculates:
        return _with_revival(ctx, store, keys, now, settings, everyone, failed, memory), memory
    if settings.policy.swap is None or not configured:
        return ctx, memory
    if settings.fleet_prior:
        fleet, _ = with_fleet_priors(store, keys, now, settings.history_s, everyone, memory.fleet_history)
        everyone = list(fleet)
        # the policy tells the running draft by identity: the same object as in the candidates
        running = next((c for c in everyone if running is not None and c.name == running.name), running)
        ctx = replace(ctx, running=running)
    memory = _with_floored_previous(memory, store, keys, stored, settings)
    shadow, error = candidate_shadow(store, now, settings, memory, [c.name for c in everyone])
    return replace(
        ctx,
        candidates=tuple(everyone),
        trigger_windows=spec_windows(store, keys, stored, now, settings.policy.swap.duration_s),
        history=measured_history(store, keys, now, settings.history_s, everyone, same_draft, memory.history),
        shadow=shadow,
        shadow_weight=error.describe() if shadow else None,
        failed_candidates=frozenset(c.name for c in everyone if any(same_draft(f, c) for f in failed)),
        floored=floored_out(everyone, settings, memory),
    ), memory


def with_proposal_shares(
    store: Store,
    now: datetime,
    settings: ControllerSettings,
    running: DraftCandidate | None,
    candidates: Sequence[DraftCandidate],
) -> tuple[DraftCandidate | None, list[DraftCandidate]]:
    """The candidates, each at the share of steps its newest shadow replay within ``history_s`` drafted at
    (a prompt lookup drafts only where it finds a match; a draft model at every step, share 1). ``running``
    is returned as the same object as its entry in the list (the policy tells it by identity)."""
    if not any(c.free for c in candidates):
        return running, list(candidates)  # only a lookup drafts at some steps: no store read for the others
    results = latest_shadow_results(store, now - timedelta(seconds=settings.history_s))
    out: list[DraftCandidate] = []
    new_running = running
    for cand in candidates:
        result = results.get(cand.name)
        share = result.proposal_share if result is not None else None
        new = cand if not cand.free or share is None or share >= 1.0 else replace(cand, proposal_share=share)
        if cand is running:
            new_running = new
        out.append(new)
    return new_running, out


REPLAY_ERROR_WINDOW_S = 86400.0  # how far back consecutive replays measure their run-to-run error


def candidate_shadow(
    store: Store, now: datetime, settings: ControllerSettings, memory: ControllerMemory, names: Sequence[str]
) -> tuple[dict[str, AcceptanceEvidence], ReplayError]:
    """Each candidate's newest shadow result within ``history_s`` (and the replay error it was weighed
    with), counted at most α̂(1 − α̂)/σ² trials, σ
    the run-to-run error of the replays (``policies.replay_error``: a run's sample of requests moves every
    draft's α̂ together, beyond its binomial width). One from before the running draft's
    acceptance last moved with the traffic (``ControllerMemory.alpha_moved_at``; a regime our own swap
    began does not count) measured the candidates on another prompt mix: it weighs at most as much as
    the candidate's prior (``[swap] prior_strength_trials``). At full weight, set against the running
    draft's α now, it swaps to whichever draft was better there (lab_phases in the simulator, shadow on:
    good on hard prompts swapped back to medium on medium's replay of the predictable prompts, and again);
    dropped, an optimistic prior stands alone again (a draft measured at 0.15 tried on its prior of 0.9).
    Moving it by the running draft's own log-odds move, or not proposing it beyond failure until a fresh
    replay lands, measured worse (docs/shadow.md)."""
    wanted = set(names)
    moved_at, swap = memory.alpha_moved_at, settings.policy.swap
    # the replays' own scatter, from the last day's runs (a few hundred rows at most)
    recent = shadow_results(store, now - timedelta(seconds=min(settings.history_s, REPLAY_ERROR_WINDOW_S)))
    error = replay_error(
        [ReplayRun(r.candidate, r.computed_at, r.evidence) for r in recent],
        moved_at,
        swap.shadow_error_sd if swap is not None else DraftTriggerConfig().shadow_error_sd,
    )
    evidence = {}
    for name, result in latest_shadow_results(store, now - timedelta(seconds=settings.history_s)).items():
        if name not in wanted:
            continue
        ev = capped(result.evidence, error.sd)  # a run's sample of requests moves it off the traffic
        if swap is not None and moved_at is not None and result.computed_at < moved_at:
            ev = ev.scaled(min(1.0, swap.prior_strength_trials / ev.trials)) if ev.trials > 0 else ev
        evidence[name] = ev
    return evidence, error


def revival_candidates(
    store: Store,
    keys: Sequence[EngineKey],
    now: datetime,
    settings: ControllerSettings,
    configured: Sequence[DraftCandidate],
) -> list[DraftCandidate]:
    """The drafts speculation could be turned back on with: every configured candidate and the last
    speculative config this engine ran within ``history_s`` (named after it, its cost ratio the policy's)."""
    everyone = list(configured)
    last = last_speculative(store, keys, now, settings.history_s)
    if last is not None and not any(same_draft(last, c) for c in configured):
        revived, _ = current_candidate(last, (), settings.policy.policy.cost_ratio)
        if revived is not None:
            everyone.append(replace(revived, speculative_config=dict(last.extra)))
    return everyone


def _with_revival(
    ctx: DecisionContext,
    store: Store,
    keys: Sequence[EngineKey],
    now: datetime,
    settings: ControllerSettings,
    everyone: Sequence[DraftCandidate],
    failed: Sequence[SpecConfig],
    memory: ControllerMemory,
) -> DecisionContext:
    """Speculation is off: the candidates it could be turned back on with (:func:`revival_candidates`) and
    their α history on this engine. The swap section need not be on: a K policy that chose K = 0 under load
    must be able to come back."""
    if not everyone:
        return ctx
    return replace(
        ctx,
        candidates=tuple(everyone),
        history=measured_history(store, keys, now, settings.history_s, everyone, same_draft, memory.history),
        shadow=shadow_evidence(store, now - timedelta(seconds=settings.history_s), [c.name for c in everyone]),
        failed_candidates=frozenset(c.name for c in everyone if any(same_draft(f, c) for f in failed)),
    )


def last_speculative(store: Store, keys: Sequence[EngineKey], now: datetime, horizon_s: float) -> SpecConfig | None:
    """The newest speculative config (K ≥ 1) in force on the engine within ``horizon_s`` (it may have started
    earlier); None if none."""
    if not keys:
        return None
    since = now - timedelta(seconds=horizon_s)
    for stored in reversed(store.configs_in_force(keys[0], since, now)):
        if stored.config.spec.speculates:
            return stored.config.spec
    return None


def floored_out(
    candidates: Sequence[DraftCandidate], settings: ControllerSettings, memory: ControllerMemory
) -> frozenset[str]:
    """The candidate whose draft ran before the running one and left with acceptance below the swap floor
    (over its last trigger duration), until the running draft's acceptance falls into a new regime
    (``memory.alpha_regime``: the traffic moved, perhaps back to what the other draft liked); empty
    otherwise. Its measured history pools the period it was good in with the fall that made it leave, so
    ranking it beyond failure would swap straight back. The running draft's acceptance settling or rising
    says nothing in the other draft's favour."""
    regime = memory.alpha_regime
    if settings.policy.swap is None or regime is None or regime[1].direction < 0:
        return frozenset()
    previous = memory.floored_previous  # (:func:`previous_floored`, read once per running config)
    spec = previous[1] if previous is not None else None
    return frozenset() if spec is None else frozenset(c.name for c in candidates if same_draft(spec, c))


def _with_floored_previous(
    memory: ControllerMemory,
    store: Store,
    keys: Sequence[EngineKey],
    stored: StoredConfig,
    settings: ControllerSettings,
) -> ControllerMemory:
    """``memory`` with :func:`previous_floored`'s answer for ``stored`` (read once per running config)."""
    cached = memory.floored_previous
    if cached is not None and cached[0] == stored.id:
        return memory
    return replace(memory, floored_previous=(stored.id, previous_floored(store, keys, stored, settings)))


def previous_floored(
    store: Store, keys: Sequence[EngineKey], stored: StoredConfig, settings: ControllerSettings
) -> SpecConfig | None:
    """The config that ran before ``stored`` when it was another draft that left by the floor (applied by a
    triggered swap, or with acceptance below the threshold over its last trigger duration); else None."""
    swap = settings.policy.swap
    if swap is None or not keys:
        return None
    started = stored.config.started_at
    since = started - timedelta(seconds=settings.history_s)
    before = [c for c in store.configs(keys[0], since=since, until=started) if c.id != stored.id]
    if not before or before[-1].config.spec.draft == stored.config.spec.draft:
        return None  # nothing ran before, or a K change: not a swap
    previous = before[-1]
    floored = _applied_by_the_floor(store, stored)
    if not (floored or _left_low(store, keys, previous, swap.threshold, swap.duration_s)):
        return None
    return previous.config.spec


def _applied_by_the_floor(store: Store, stored: StoredConfig) -> bool:
    """The running config was applied by a decision whose swap trigger fired (acceptance stayed low)."""
    if stored.config.decision_id is None:
        return False
    try:
        inputs = store.decision(stored.config.decision_id).decision.inputs
    except LookupError:
        return False
    trigger = inputs.get("policy", {}).get("trigger") if isinstance(inputs, dict) else None
    return isinstance(trigger, dict) and trigger.get("triggered") is True


def _recent(recent: Sequence[WindowRecord], confidence: float) -> tuple[float | None, float]:
    """α̂ over the last decide interval and half its interval's width (its own windows' dispersion). Not
    the evidence window's dispersion: when the traffic moves, the window mixing old and new acceptance
    varies most, and would hide the very move it measures (lab_phases: 0.97 → 0.85 read as noise ±0.18)."""
    est = alpha_of_windows([w.spec for w in recent if w.spec is not None], confidence)
    if est.alpha is None or est.alpha_ci is None:
        return est.alpha, 0.0
    return est.alpha, (est.alpha_ci[1] - est.alpha_ci[0]) / 2.0


def _left_low(
    store: Store, keys: Sequence[EngineKey], previous: StoredConfig, threshold: float, seconds: float
) -> bool:
    """The previous config's acceptance over its last ``seconds`` was below the floor (a swap not recorded
    by this controller: an operator's, or before an audit row existed)."""
    last = evidence_before_end(store, keys, previous, seconds)
    return last.trials > 0 and last.successes / last.trials < threshold


def measure(
    store: Store,
    keys: Sequence[EngineKey],
    stored: StoredConfig,
    now: datetime,
    evidence_window_s: float,
    confidence: float = 0.95,
    recent_s: float = 60.0,
    not_before: datetime | None = None,
) -> DecisionContext:
    """The measured part of a context: the windows under ``stored`` over the last ``evidence_window_s``,
    none starting before ``not_before`` (what the simulator's baseline policies read too)."""
    current = stored.config.spec
    started = stored.config.started_at
    # min(…, now): a config recorded a moment after ``now`` (a rollback that just finished) has no windows yet
    first = max(started, not_before or started)
    since = min(max(now - timedelta(seconds=evidence_window_s), first), now)
    wins = windows_under(store, keys, first, since, now + timedelta(microseconds=1))
    spec, duration_s, tokens, rates, running_mean = summarize(wins)
    # Per position, the draft's evidence at every K it ran inside the window, earlier configs of the same draft
    # included: a table that runs K = 1 measures position 0 alone, and one α from it plans K = 2 as if the
    # second position accepted as often as the first. Live (7 Dec, hard prompts at 4 streams) the table went
    # K 1 → 2 → 1 → 2 → 1 in 150 s: α̂ 0.89 at K = 1, 0.81 at K = 2, each change undoing the last.
    # Pooled, not window by window: a window that drafted at two K has estimated trials
    # (PositionData.from_windows)
    window_start = now - timedelta(seconds=evidence_window_s)
    earlier, earlier_configs = earlier_windows_of_draft(
        store, keys, stored, max(window_start, not_before) if not_before is not None else window_start
    )
    positions = PositionData.from_windows(
        e for e in (effective_counters(w.spec) for w in (*earlier, *wins) if w.spec is not None) if e is not None
    )
    recent = [w for w in wins if w.end > now - timedelta(seconds=recent_s)]
    alpha = alpha_of_windows([w.spec for w in wins if w.spec is not None], confidence)
    recent_alpha, recent_noise = _recent(recent, confidence)
    load = [w for w in wins if w.duration_s > 0 and _finite(w.requests_running)]
    load_s = sum(w.duration_s for w in load)
    demand_s = sum(w.duration_s * ((w.requests_running or 0.0) + (w.requests_waiting or 0.0)) for w in load)
    usage = [w for w in load if _finite(w.kv_cache_usage)]
    usage_s = sum(w.duration_s for w in usage)
    return DecisionContext(
        now=now,
        keys=tuple(keys),
        config_id=stored.id,
        current=current,
        spec=spec,
        alpha=alpha,
        windows=len(wins),
        duration_s=duration_s,
        positions=positions,
        positions_earlier_configs=earlier_configs if positions.observed_positions else 0,
        generation_tokens=tokens,
        window_rates=rates,
        window_batches=window_batches(wins),
        mean_batch_size=running_mean,
        batch_profile=tuple(
            (w.duration_s, float(w.requests_running))
            for w in wins
            if w.duration_s > 0 and w.requests_running is not None and math.isfinite(w.requests_running)
        ),
        recent_alpha=recent_alpha,
        recent_alpha_noise=recent_noise,
        mean_demand=demand_s / load_s if load_s > 0 else None,
        kv_usage=sum(w.duration_s * (w.kv_cache_usage or 0.0) for w in usage) / usage_s if usage_s > 0 else None,
        output_tokens_per_request=_output_tokens_per_request(wins),
    )


def _output_tokens_per_request(wins: Sequence[WindowRecord]) -> float | None:
    counted = [w for w in wins if w.e2e_latency is not None]
    finished = sum(w.e2e_latency.count for w in counted if w.e2e_latency is not None)
    return sum(w.generation_tokens for w in counted) / finished if finished > 0 else None


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def cache_config(store: Store, keys: Sequence[EngineKey]) -> Mapping[str, Any] | None:
    """The first of ``keys``' stored ``vllm:cache_config_info`` labels (data-parallel ranks share one)."""
    wanted = set(keys)
    for engine in store.engines():
        if engine.key in wanted and engine.cache_config:
            return engine.cache_config
    return None


def kv_capacity(ctx: DecisionContext, cache: Mapping[str, Any] | None, settings: PolicySettings) -> KvCapacity | None:
    """The engine's KV pool from its cache_config_info (num_gpu_blocks × block_size tokens) and the target's
    KV bytes per token (``[memory]``); the context per sequence from KV usage × pool / requests running,
    less the running config's K lookahead slots (else ``[memory] tokens_per_seq``). None when any is missing,
    or when the running draft model is not registered with its size (``[[drafts]]`` num_params)."""
    p = settings
    try:
        tokens = float((cache or {})["num_gpu_blocks"]) * float((cache or {})["block_size"])
    except (KeyError, TypeError, ValueError):
        return None
    k = (ctx.current.k or 0) if ctx.current.speculates else 0
    per_seq: float = float(p.tokens_per_seq)
    if ctx.kv_usage is not None and ctx.mean_batch_size and ctx.mean_batch_size > 0 and ctx.kv_usage > 0:
        per_seq = ctx.kv_usage * tokens / ctx.mean_batch_size - k
    if not (math.isfinite(tokens) and tokens > 0 and p.target_kv_bytes_per_token > 0 and per_seq > 0):
        return None
    running = ctx.running.footprint() if ctx.running is not None and k > 0 else None
    if running is not None and running.method not in FREE_METHODS and running.weights_bytes <= 0:
        return None  # the running draft is not registered with its size: the pool it shares is unknown
    return KvCapacity(tokens, p.target_kv_bytes_per_token, per_seq, running, k)


def _with_regimes(
    ctx: DecisionContext, settings: ControllerSettings, memory: ControllerMemory
) -> tuple[DecisionContext, ControllerMemory]:
    """The acceptance regime after this tick's observation and its expected remaining length (what a
    change's switching cost is weighed over). The load regime bounds it only when K is chosen for a
    sustained one (:func:`_with_load`): a diurnal load, always drifting, would make every load regime short
    and hold back the changes that follow it."""
    p = settings.policy.policy
    draft = ctx.current.draft
    if memory.alpha_regime is None:
        alpha = RegimeTracker(p.alpha_regime_band, scatter_z=SAMPLED_SCATTER_Z)
    else:
        seen, alpha = memory.alpha_regime
        if seen != draft:  # another draft is another α: a regime we began, not one the traffic ended
            alpha = restart(alpha, ctx.now)
    alpha = observe(alpha, ctx.now, ctx.recent_alpha, ctx.recent_alpha_noise)
    moved_at = memory.alpha_moved_at
    if alpha.direction != 0 and alpha.started is not None and (moved_at is None or alpha.started > moved_at):
        moved_at = alpha.started
    memory = replace(memory, alpha_regime=(draft, alpha), alpha_moved_at=moved_at)
    remaining = remaining_s(alpha, ctx.now)
    if not math.isfinite(remaining):
        return replace(ctx, regime_remaining_s=None, regime_basis=None), memory
    return replace(ctx, regime_remaining_s=remaining, regime_basis=basis(alpha, ctx.now, "acceptance")), memory


def _since_the_traffic_moved(
    ctx: DecisionContext,
    store: Store,
    keys: Sequence[EngineKey],
    stored: StoredConfig,
    settings: ControllerSettings,
    memory: ControllerMemory,
) -> DecisionContext:
    """The measured part again from the start of the acceptance regime the traffic began, when that is
    inside the evidence window (our own swap begins a regime too, but the config's start already cuts
    there). The regime starts at the first of its confirming ticks, each of which measured the last decide
    interval: that interval is the first evidence of it. Live, from predictable to hard prompts at one
    stream: pooled α̂ stayed at 0.91 for the whole 60-s window while the new prompts ran at 0.6, and mixing
    the two inflated the over-dispersion that discounts the drafts, so no change had the evidence it
    needed until the old windows aged out.

    Only while the engine's history says how long such a regime lasts (``regime_remaining_s`` known), so
    that the switching-cost rail weighs a restart on it: cut on every move, the first three 3-minute dips
    of the simulator's gpu_transients each restarted the engine there and back (9 restarts, 3 unpaid; the
    pooled window had hidden them)."""
    if memory.alpha_regime is None or ctx.regime_remaining_s is None:
        return ctx
    regime = memory.alpha_regime[1]
    p, interval_s = settings.policy.policy, settings.controller.decide_interval_s
    if regime.direction == 0 or regime.started is None:
        return ctx
    moved = regime.started - timedelta(seconds=interval_s)
    if moved <= max(ctx.now - timedelta(seconds=p.evidence_window_s), stored.config.started_at):
        return ctx
    fresh = measure(store, keys, stored, ctx.now, p.evidence_window_s, p.confidence, interval_s, not_before=moved)
    note = f" Evidence from {moved:%H:%M:%S} UTC, when the acceptance moved (earlier windows saw other traffic)."
    return replace(
        fresh,
        alpha=replace(fresh.alpha, message=fresh.alpha.message + note),
        recent_alpha=ctx.recent_alpha,
        recent_alpha_noise=ctx.recent_alpha_noise,
        regime_remaining_s=ctx.regime_remaining_s,
        regime_basis=ctx.regime_basis,
        evidence_since=moved,
    )


def _with_load(
    ctx: DecisionContext, store: Store, settings: ControllerSettings, memory: ControllerMemory
) -> tuple[DecisionContext, ControllerMemory]:
    """The load profile K is chosen over: the windows of the last ``load_horizon_s`` under any config, or
    those of the current load regime once it is ``load_regime_sustained_s`` old (policies.load_window).
    The load regime is observed every tick (requests running + waiting of the last decide interval) and
    is not restarted by our own changes: the demand is the traffic's, not the config's. When K is chosen
    for a sustained regime, its expected remaining length bounds the switching-cost rail too."""
    p = settings.policy.policy
    memory.load.update(store, ctx.keys, ctx.now, p.load_horizon_s)
    recent = memory.load.mean_since(ctx.now - timedelta(seconds=settings.controller.decide_interval_s))
    tracker = observe(memory.load_regime or load_tracker(p.load_regime_band), ctx.now, recent)
    window = choose_load_window(tracker, ctx.now, p.load_horizon_s, p.load_regime_sustained_s)
    remaining, why = ctx.regime_remaining_s, ctx.regime_basis
    if window.remaining_s is not None and (remaining is None or window.remaining_s < remaining):
        remaining, why = window.remaining_s, basis(tracker, ctx.now, "load")
    ending = left_band(tracker, "load") if window.regime else None
    if ending is not None:  # K is chosen for a load regime that may have just ended: nothing to repay over
        remaining, why = 0.0, ending
    ctx = replace(
        ctx,
        load_profile=memory.load.since(window.since),
        load_window=window,
        load_before=tracker.previous_level if tracker.direction != 0 else None,
        regime_remaining_s=remaining,
        regime_basis=why,
    )
    return ctx, replace(memory, load_regime=tracker)


def _with_step_cost(
    ctx: DecisionContext,
    store: Store,
    settings: ControllerSettings,
    running: DraftCandidate | None,
    candidates: Sequence[DraftCandidate],
    memory: ControllerMemory,
) -> tuple[DecisionContext, ControllerMemory]:
    """T(B, K) of the running draft from the plugin's steps, refit every ``step_cost_refit_s`` or on a swap.
    ``candidates`` give the cost ratios of the other drafts whose steps also measure the target."""
    p = settings.policy.policy
    if not p.step_cost_fit:
        return ctx, memory
    cached = memory.step_cost
    draft = ctx.current.draft
    if cached is not None and cached[1] == draft and ctx.now - cached[0] < timedelta(seconds=p.step_cost_refit_s):
        fitted, by_candidate = cached[2], cached[3]
    else:
        ratio = running.cost_ratio_for(p.target_params) if running is not None else None
        specs = config_specs(store, ctx.keys, ctx.now, p.step_cost_horizon_s)
        groups = step_groups(store, ctx.keys, specs, ctx.now, p.step_cost_horizon_s)
        fitted = step_cost_from_steps(
            store,
            ctx.keys,
            ctx.current,
            specs,
            ctx.now,
            p,
            p.cost_ratio if ratio is None else ratio,
            pinned=settings.policy.pinned_step_cost,
            cost_ratio_of=lambda spec: next(
                (c.cost_ratio_for(p.target_params) for c in candidates if same_draft(spec, c)), None
            ),
            groups=groups,
            drafts_at_k0=settings.policy.drafts_at_k0,
            k0_skip_output_tokens=settings.policy.k0_skip_output_tokens(ctx.output_tokens_per_request),
        )
        by_candidate = (
            candidate_step_costs(
                groups,
                fitted[0],
                candidates,
                p.target_params,
                p.step_cost_cell_min_steps,
                drafts_at_k0=settings.policy.drafts_at_k0,
                k0_skip_output_tokens=settings.policy.k0_skip_output_tokens(ctx.output_tokens_per_request),
            )
            if fitted is not None
            else {}
        )
        memory = replace(memory, step_cost=(ctx.now, draft, fitted, by_candidate))
    if fitted is None:
        return ctx, memory
    model, note, source = fitted
    return (
        replace(ctx, step_cost=model, step_cost_note=note, step_cost_source=source, candidate_step_cost=by_candidate),
        memory,
    )


__all__ = [
    "ControllerMemory",
    "DecisionContext",
    "DecisionInputs",
    "build_context",
    "measure",
]
