"""The step-cost model T(B, K) a decision uses: fitted from the in-engine plugin's per-step records.

Without a measured T(B, K) the policy falls back on Leviathan's model (a draft pass costs c × a target
pass, verifying K + 1 tokens costs as much as 1): right at batch 1, too optimistic at large batches,
where scoring B·(K + 1) tokens is no longer free. The plugin ships every step's batch size, K and
duration, so the controller refits T(B, K) every ``[policy] step_cost_refit_s`` from the last
``step_cost_horizon_s`` of steps:

- steps under the running draft (same method and model) at any K, plus the steps of configs without
  speculation, which measure the target alone. A K = 0 step of an engine with a draft model ran the
  draft's catch-up pass (``SpecConfig.drafts_at_k0``) and is fitted as such; K = 0 steps under other drafts
  are left out (their draft's cost is not the running one's);
- with two or more K the full model (``policies.step_cost.fit_step_cost``); with one K the target's
  two parameters, the draft's part taken as the running candidate's cost ratio c × the target's.

A ``[policy.step_cost]`` in the config pins the model instead of the fit (an operator's measurement wins
over a fit). Either way, (batch band, K) cells this engine has run often enough replace the model by
their measured mean: a linear T(B, K) misses engine quirks that decide K (see docs/controller.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from collectors.records import EngineKey
from policies.draft_choice import DraftCandidate
from policies.spec_config import SpecConfig, method_drafts_at_k0
from policies.step_cost import (
    MeasuredStepCost,
    StepCostFit,
    StepCostModel,
    StepCostReason,
    fit_step_cost,
    fit_target_cost,
    with_measured_cells,
)
from tuner.config import PolicySection
from tuner.controller.candidates import same_draft
from tuner.store import Store


@dataclass(frozen=True)
class StepGroup:
    """Decode steps of one config at one (batch size, K): ``Store.step_time_groups`` with the config's spec."""

    spec: SpecConfig | None  # None: the config is not known (outside the horizon's configs)
    batch_size: float
    k: float
    mean_s: float
    steps: float


def step_groups(
    store: Store, keys: Sequence[EngineKey], spec_of: Mapping[int, SpecConfig], now: datetime, horizon_s: float
) -> list[StepGroup]:
    """Every engine's step groups over the last ``horizon_s``: one grouped query per engine."""
    since = now - timedelta(seconds=horizon_s)
    until = now + timedelta(microseconds=1)
    return [
        StepGroup(spec_of.get(config_id) if config_id is not None else None, float(b), float(k), mean_s, float(n))
        for key in keys
        for config_id, b, k, mean_s, n in store.step_time_groups(key, since, until)
    ]


def candidate_step_costs(
    groups: Sequence[StepGroup],
    target: StepCostModel,
    candidates: Sequence[DraftCandidate],
    target_params: int | None,
    min_steps: int,
    drafts_at_k0: Callable[[object], bool] = method_drafts_at_k0,
    k0_skip_output_tokens: float = 0.0,
) -> dict[str, StepCostModel]:
    """Candidate name → T(B, K) with the cells this engine measured while it ran that draft (within the
    horizon), over ``target``'s linear model with the candidate's draft pass (``beside``): the model a swap
    picks the candidate's K on (``policies.draft_choice``; the ranking itself stays on the linear model).
    Only candidates with a qualifying cell; the others get their K from the linear model too.

    Why: a linear T(B, K) misses what the engine measured (a per-sequence KV read, CPU quirks), and a swap
    that ranks a draft on it picks a K that the K policy, reading that draft's cells once it runs,
    changes minutes later — a second restart (gpu_memory_bound: back to the 8B at K = 2, then K = 3)."""
    out: dict[str, StepCostModel] = {}
    for cand in candidates:
        beside = cand.beside(target.linear(), target_params)
        rows = [g for g in groups if g.spec is not None and same_draft(g.spec, cand)]
        if beside is None or not rows:
            continue
        skip = k0_skip_output_tokens if method_drafts_at_k0(cand.method) else 0.0
        base = beside.with_draft_pass_at_k0(drafts_at_k0(cand.method)).with_k0_skip(skip)
        model = with_measured_cells(
            base,
            [g.batch_size for g in rows],
            [g.k for g in rows],
            [g.mean_s for g in rows],
            [g.steps for g in rows],
            min_steps,
        )
        if isinstance(model, MeasuredStepCost):
            out[cand.name] = model
    return out


def step_cost_from_steps(
    store: Store,
    keys: Sequence[EngineKey],
    current: SpecConfig,
    spec_of: Mapping[int, SpecConfig],
    now: datetime,
    settings: PolicySection,
    cost_ratio: float,
    pinned: StepCostModel | None = None,
    cost_ratio_of: Callable[[SpecConfig], float | None] | None = None,
    groups: Sequence[StepGroup] | None = None,
    drafts_at_k0: Callable[[object], bool] = method_drafts_at_k0,
    k0_skip_output_tokens: float = 0.0,
) -> tuple[StepCostModel, str, str] | None:
    """(model, note, source) for the running draft from the last ``step_cost_horizon_s`` of steps, or None when the
    steps are too few (or the plugin is not configured) and nothing is pinned. ``spec_of`` maps config
    id → its speculative config.

    The base is ``pinned`` when given, else T(B, K) fitted from the running draft's steps at any K plus
    steps without drafts under any config. Over it lie the measured cells of the running draft's engine
    (``policies.step_cost.with_measured_cells``): only its own steps, K = 0 included. The model returned
    has ``draft_pass_at_k0`` set when the running method runs its draft at K = 0.

    When the running draft's own steps cannot separate the target's per-token cost from its fixed cost
    (one K at one batch size: right after a swap), the target's two parameters are fitted from the steps
    under every draft whose cost ratio ``cost_ratio_of`` knows (``policies.step_cost.fit_target_cost``):
    the target costs the same whatever draft runs beside it.

    ``groups``: the steps already read (:func:`step_groups`), else they are read here. ``drafts_at_k0``:
    whether a method's K = 0 steps run a draft pass on this engine (``PolicySettings.drafts_at_k0``: not
    when the plugin skips it); ``k0_skip_output_tokens`` > 0: then the running draft's K = 0 steps keep it
    in the share of steps a prompt enters (``StepCostModel.k0_skip_output_tokens``), which the fit reads
    them with.
    """
    if groups is None:
        groups = step_groups(store, keys, spec_of, now, settings.step_cost_horizon_s)
    draft = current.draft
    loaded = drafts_at_k0(current.method)
    skip = k0_skip_output_tokens if not loaded and method_drafts_at_k0(current.method) else 0.0

    # the running draft's passes in a K = 0 step at B, as the model prices them
    k0_passes = StepCostModel(1.0, 0.0, 0.0, 0.0, draft_pass_at_k0=loaded, k0_skip_output_tokens=skip).k0_passes
    fit_rows: list[tuple[float, float, float, float, float]] = []  # B, K, mean s, steps, draft passes at K = 0
    cell_rows: list[tuple[float, float, float, float]] = []
    # every step whose draft's cost ratio is known: B, K, mean s, steps, draft pass at K = 0, cost ratio
    target_rows: list[tuple[float, float, float, float, float, float]] = []
    for g in groups:
        spec, b, k, mean_s, n = g.spec, g.batch_size, g.k, g.mean_s, g.steps
        same_draft = spec is not None and spec.draft == draft
        if same_draft:
            cell_rows.append((b, k, mean_s, n))
            fit_rows.append((b, k, mean_s, n, k0_passes(b)))
            target_rows.append((b, k, mean_s, n, k0_passes(b), cost_ratio))
        elif k == 0 and not (spec is not None and drafts_at_k0(spec.method)):  # no draft model ran: the target alone
            fit_rows.append((b, 0.0, mean_s, n, 0.0))
            target_rows.append((b, 0.0, mean_s, n, 0.0, 0.0))
        elif spec is not None and cost_ratio_of is not None:
            other = cost_ratio_of(spec)
            if other is not None:
                target_rows.append((b, k, mean_s, n, float(drafts_at_k0(spec.method)), other))
    steps = int(sum(r[3] for r in fit_rows))
    if pinned is not None:
        base, note, source = pinned, "T(B, K) pinned by [policy.step_cost]", "pinned"
    else:
        fit: StepCostFit | None = None
        if steps >= settings.step_cost_min_steps:
            batch, ks, times, weights, at_k0 = (list(col) for col in zip(*fit_rows, strict=True))
            fit = fit_step_cost(batch, ks, times, weights, draft_cost_ratio=cost_ratio, draft_pass_at_k0=at_k0)
        all_steps = int(sum(r[3] for r in target_rows))
        if (
            (fit is None or fit.reason is StepCostReason.FIXED_COST_RATIO)
            and len(target_rows) > len(fit_rows)
            and all_steps >= settings.step_cost_min_steps
        ):
            batch, ks, times, weights, at_k0, ratios = (list(col) for col in zip(*target_rows, strict=True))
            fit, steps = fit_target_cost(batch, ks, times, weights, ratios, cost_ratio, at_k0), all_steps
        if fit is None or fit.model is None:
            return None
        base, note, source = fit.model, f"T(B, K) fitted from {steps} steps: {fit.message}", "fitted"
    base = base.with_draft_pass_at_k0(loaded).with_k0_skip(skip)
    if cell_rows:
        batch, ks, times, weights = (list(col) for col in zip(*cell_rows, strict=True))
        model = with_measured_cells(base, batch, ks, times, weights, settings.step_cost_cell_min_steps)
        if isinstance(model, MeasuredStepCost):
            cells = ", ".join(
                f"B {c.mean_batch_size:.1f} K={c.k}: ×{c.factor:.2f} ({c.steps} steps)" for c in model.cells
            )
            note += (
                f"; measured on this engine ({len(model.cells)} cells; elsewhere the model × the level of the"
                f" cells nearest in batch size, over all × {model.scale:.2f} with drafts, × {model.scale_no_draft:.2f}"
                f" without): {cells}"
            )
            return model, note, f"{source} + measured cells"
    return base, note, source


def config_specs(store: Store, keys: Sequence[EngineKey], now: datetime, horizon_s: float) -> dict[int, SpecConfig]:
    """Config id → speculative config, for the configs in force over the last ``horizon_s``."""
    out: dict[int, SpecConfig] = {}
    for key in keys:
        out.update(
            {c.id: c.config.spec for c in store.configs_in_force(key, now - timedelta(seconds=horizon_s), now)}
        )
    return out
