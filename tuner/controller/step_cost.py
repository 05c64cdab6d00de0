"""The step-cost model T(B, K) a decision uses: fitted from the in-engine plugin's per-step records.

Without a measured T(B, K) the policy falls back on Leviathan's model (a draft pass costs c × a target
pass, verifying K + 1 tokens costs as much as 1): right at batch 1, too optimistic at large batches,
where scoring B·(K + 1) tokens is no longer free. The plugin ships every step's batch size, K and
duration, so the controller refits T(B, K) each tick from the last ``horizon_s`` of steps:

- steps under the running draft (same method and model) at any K, plus steps without drafts (K = 0)
  under any config, which measure the target alone;
- with two or more K the full model (``policies.step_cost.fit_step_cost``); with one K the target's
  two parameters, the draft's part taken as the running candidate's cost ratio c × the target's.

A ``[policy.step_cost]`` in the config pins the model instead (an operator's measurement wins).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from collectors.records import EngineKey
from policies.step_cost import StepCostFit, StepCostModel, fit_step_cost
from tuner.controller.evidence import spec_config_of
from tuner.store import Store


@dataclass(frozen=True)
class StepCostFitSettings:
    horizon_s: float = 86400.0  # how far back steps count (the target's cost does not drift; variety does help)
    min_steps: int = 30  # fewer decode steps with a time than this: no fit (the config's model is used)
    refit_interval_s: float = 900.0  # the fit is kept this long (a day of steps is not reread every tick)


def draft_identity(spec: Mapping[str, Any]) -> tuple[Any, Any]:
    return spec.get("method"), spec.get("model")


def fitted_step_cost(
    store: Store,
    keys: Sequence[EngineKey],
    current: Mapping[str, Any],
    spec_of: Mapping[int, Mapping[str, Any]],
    now: datetime,
    settings: StepCostFitSettings,
    cost_ratio: float,
) -> tuple[StepCostModel, str] | None:
    """T(B, K) of the running draft fitted from the last ``horizon_s`` of steps, or None when the steps
    are too few (or the plugin is not configured). ``spec_of`` maps config id → its speculative config."""
    since = now - timedelta(seconds=settings.horizon_s)
    until = now + timedelta(microseconds=1)
    draft = draft_identity(current)
    batch: list[float] = []
    ks: list[float] = []
    times: list[float] = []
    weights: list[float] = []
    for key in keys:
        for config_id, b, k, mean_s, n in store.step_time_groups(key, since, until):
            spec = spec_of.get(config_id) if config_id is not None else None
            if k > 0 and (spec is None or draft_identity(spec) != draft):
                continue  # another draft's cost
            batch.append(float(b))
            ks.append(float(k))
            times.append(mean_s)
            weights.append(float(n))
    steps = int(sum(weights))
    if steps < settings.min_steps:
        return None
    fit: StepCostFit = fit_step_cost(batch, ks, times, weights, draft_cost_ratio=cost_ratio)
    if fit.model is None:
        return None
    return fit.model, f"T(B, K) fitted from {steps} steps: {fit.message}"


def config_specs(store: Store, keys: Sequence[EngineKey], now: datetime, horizon_s: float) -> dict[int, dict[str, Any]]:
    """Config id → speculative config, for the configs in force over the last ``horizon_s``."""
    out: dict[int, dict[str, Any]] = {}
    for key in keys:
        out.update(
            {c.id: spec_config_of(c) for c in store.configs_in_force(key, now - timedelta(seconds=horizon_s), now)}
        )
    return out
