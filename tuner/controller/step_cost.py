"""The step-cost model T(B, K) a decision uses: fitted from the in-engine plugin's per-step records.

Without a measured T(B, K) the policy falls back on Leviathan's model (a draft pass costs c × a target
pass, verifying K + 1 tokens costs as much as 1): right at batch 1, too optimistic at large batches,
where scoring B·(K + 1) tokens is no longer free. The plugin ships every step's batch size, K and
duration, so the controller refits T(B, K) each tick from the last ``horizon_s`` of steps:

- steps under the running draft (same method and model) at any K, plus the steps of configs without
  speculation, which measure the target alone. A K = 0 step of an engine with a draft model ran the
  draft's catch-up pass (``draft_passes_at_k0``) and is fitted as such; K = 0 steps under other drafts
  are left out (their draft's cost is not the running one's);
- with two or more K the full model (``policies.step_cost.fit_step_cost``); with one K the target's
  two parameters, the draft's part taken as the running candidate's cost ratio c × the target's.

A ``[policy.step_cost]`` in the config pins the model instead of the fit (an operator's measurement wins
over a fit). Either way, (batch band, K) cells this engine has run often enough replace the model by
their measured mean: a linear T(B, K) misses engine quirks that decide K (see docs/controller.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from collectors.records import EngineKey
from policies.step_cost import MeasuredStepCost, StepCostFit, StepCostModel, fit_step_cost, with_measured_cells
from tuner.controller.evidence import spec_config_of
from tuner.store import Store


@dataclass(frozen=True)
class StepCostFitSettings:
    horizon_s: float = 86400.0  # how far back steps count (the target's cost does not drift; variety does help)
    min_steps: int = 30  # fewer decode steps with a time than this: no fit (the config's model is used)
    refit_interval_s: float = 300.0  # the fit and cells are kept this long (one grouped query per refit)
    cell_min_steps: int = 50  # steps a (batch band, K) cell needs before its measured mean replaces the model


def draft_identity(spec: Mapping[str, Any]) -> tuple[Any, Any]:
    return spec.get("method"), spec.get("model")


# vLLM methods whose proposer runs a model forward every step, K = 0 included, to keep the draft's KV
# cache in sync (SpeculativeConfig.uses_draft_kv_cache: use_eagle() or uses_draft_model() or
# uses_extract_hidden_states(); the MTP aliases are folded into "mtp" by vLLM).
_DRAFT_PASS_METHODS = frozenset({"draft_model", "eagle", "eagle3", "mtp", "dflash", "dspark", "extract_hidden_states"})


def method_drafts_at_k0(method: object) -> bool:
    """Does a K = 0 step under this speculative method still run a draft pass?"""
    return isinstance(method, str) and (method in _DRAFT_PASS_METHODS or method.endswith("_mtp"))


def draft_passes_at_k0(spec: Mapping[str, Any] | None) -> bool:
    """:func:`method_drafts_at_k0` of a speculative config (None: no speculation)."""
    return spec is not None and method_drafts_at_k0(spec.get("method"))


def step_cost_from_steps(
    store: Store,
    keys: Sequence[EngineKey],
    current: Mapping[str, Any],
    spec_of: Mapping[int, Mapping[str, Any]],
    now: datetime,
    settings: StepCostFitSettings,
    cost_ratio: float,
    pinned: StepCostModel | None = None,
) -> tuple[StepCostModel, str, str] | None:
    """(model, note, source) for the running draft from the last ``horizon_s`` of steps, or None when the
    steps are too few (or the plugin is not configured) and nothing is pinned. ``spec_of`` maps config
    id → its speculative config.

    The base is ``pinned`` when given, else T(B, K) fitted from the running draft's steps at any K plus
    steps without drafts under any config. Over it lie the measured cells of the running draft's engine
    (``policies.step_cost.with_measured_cells``): only its own steps, K = 0 included. The model returned
    has ``draft_pass_at_k0`` set when the running method runs its draft at K = 0.
    """
    since = now - timedelta(seconds=settings.horizon_s)
    until = now + timedelta(microseconds=1)
    draft = draft_identity(current)
    loaded = draft_passes_at_k0(current)
    fit_rows: list[tuple[float, float, float, float, bool]] = []  # B, K, mean s, steps, draft pass at K = 0
    cell_rows: list[tuple[float, float, float, float]] = []
    for key in keys:
        for config_id, b, k, mean_s, n in store.step_time_groups(key, since, until):
            spec = spec_of.get(config_id) if config_id is not None else None
            same_draft = spec is not None and draft_identity(spec) == draft
            if same_draft:
                cell_rows.append((float(b), float(k), mean_s, float(n)))
                fit_rows.append((float(b), float(k), mean_s, float(n), loaded))
            elif k == 0 and not draft_passes_at_k0(spec):  # no draft model ran: the target alone
                fit_rows.append((float(b), 0.0, mean_s, float(n), False))
    steps = int(sum(r[3] for r in fit_rows))
    if pinned is not None:
        base, note, source = pinned, "T(B, K) pinned by [policy.step_cost]", "pinned"
    elif steps < settings.min_steps:
        return None
    else:
        batch, ks, times, weights, at_k0 = (list(col) for col in zip(*fit_rows, strict=True))
        fit: StepCostFit = fit_step_cost(
            batch, ks, times, weights, draft_cost_ratio=cost_ratio, draft_pass_at_k0=at_k0
        )
        if fit.model is None:
            return None
        base, note, source = fit.model, f"T(B, K) fitted from {steps} steps: {fit.message}", "fitted"
    base = base.with_draft_pass_at_k0(loaded)
    if cell_rows:
        batch, ks, times, weights = (list(col) for col in zip(*cell_rows, strict=True))
        model = with_measured_cells(base, batch, ks, times, weights, settings.cell_min_steps)
        if isinstance(model, MeasuredStepCost):
            cells = ", ".join(
                f"B {c.mean_batch_size:.1f} K={c.k}: ×{c.factor:.2f} ({c.steps} steps)" for c in model.cells
            )
            note += (
                f"; measured on this engine ({len(model.cells)} cells; elsewhere the model × {model.scale:.2f}"
                f" with drafts, × {model.scale_no_draft:.2f} without): {cells}"
            )
            return model, note, f"{source} + measured cells"
    return base, note, source


def config_specs(store: Store, keys: Sequence[EngineKey], now: datetime, horizon_s: float) -> dict[int, dict[str, Any]]:
    """Config id → speculative config, for the configs in force over the last ``horizon_s``."""
    out: dict[int, dict[str, Any]] = {}
    for key in keys:
        out.update(
            {c.id: spec_config_of(c) for c in store.configs_in_force(key, now - timedelta(seconds=horizon_s), now)}
        )
    return out
