"""The report's Fleet section: engines grouped by (target, draft, config) with each group's pooled α̂ and
its interval widened for the variation between engines, φ, outliers and pending changes.

The groups are ``tuner.fleet.read_fleet``'s — the same as `spectuner status --fleet` shows — over the
report's range, for the config each engine had at the range's end (the open one without --until).
Pending changes are those in flight when the report is generated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from collectors.records import EngineKey
from policies.fleet import FleetGroup, FleetSettings, OutlierVerdict
from tuner.fleet import FleetRead, read_fleet
from tuner.store import Store, StoredDecision


@dataclass(frozen=True)
class FleetEngineRow:
    engine: str  # the report's engine label
    url: str
    alpha: float | None
    alpha_lower: float | None  # the engine's own (binomial) interval
    alpha_upper: float | None
    drafts: int
    verdict: str  # policies.fleet.OutlierVerdict value
    reason: str


@dataclass(frozen=True)
class FleetPending:
    id: int
    engine: str | None  # None: for every engine
    action: str
    status: str
    proposed_config: dict[str, Any] | None  # vLLM's speculative config proposed
    message: str


@dataclass(frozen=True)
class FleetGroupRow:
    target: str
    method: str
    draft_model: str | None
    config: str  # SpecConfig.describe()
    spec_config: dict[str, Any]  # vLLM's speculative config (its fingerprint identifies the group)
    engines: list[FleetEngineRow]
    alpha: float | None  # pooled: alpha_of_windows over every window of the group
    alpha_lower: float | None  # the interval widened by √φ
    alpha_upper: float | None
    alpha_binomial: list[float] | None  # the pooled interval as if every token were independent
    dispersion: float  # φ
    drafts: int
    outliers: list[FleetEngineRow]
    pending: list[FleetPending]
    message: str


@dataclass
class FleetSection:
    groups: list[FleetGroupRow] = field(default_factory=list)
    ungrouped: list[str] = field(default_factory=list)  # engine labels without a recorded config
    pending_for_all: list[FleetPending] = field(default_factory=list)  # changes and overrides without an engine


def fleet_section(
    store: Store,
    since: datetime | None,
    until: datetime | None,
    labels: dict[EngineKey, str],
    confidence: float,
) -> FleetSection:
    fleet = read_fleet(store, since, until, FleetSettings(confidence=confidence))
    return FleetSection(
        groups=[_group_row(g, fleet, labels) for g in fleet.groups],
        ungrouped=[_label(labels, k) for k in fleet.ungrouped],
        pending_for_all=[
            _pending(labels, d)
            for d in (*fleet.pending_for_all, *fleet.pending_overrides)
            if d.decision.engine is None
        ],
    )


def _label(labels: dict[EngineKey, str], key: EngineKey) -> str:
    return labels.get(key, f"{key.model_name}/{key.engine}@{key.url}")


def _pending(labels: dict[EngineKey, str], d: StoredDecision) -> FleetPending:
    rec = d.decision
    engine = None if rec.engine is None else _label(labels, rec.engine)
    return FleetPending(d.id, engine, rec.action, rec.status, rec.proposed_config, d.status_message or rec.message)


def _group_row(g: FleetGroup, fleet: FleetRead, labels: dict[EngineKey, str]) -> FleetGroupRow:
    checks = {c.engine: c for c in g.checks}
    rows = []
    for a in g.engines:
        key = fleet.engines[a.engine].key
        ci = a.estimate.alpha_ci
        check = checks[a.engine]
        rows.append(
            FleetEngineRow(
                _label(labels, key),
                key.url,
                a.estimate.alpha,
                ci[0] if ci else None,
                ci[1] if ci else None,
                a.estimate.drafts,
                check.verdict.value,
                check.reason,
            )
        )
    return FleetGroupRow(
        target=g.key.target,
        method=g.key.method,
        draft_model=g.key.draft_model,
        config=g.config.describe(),
        spec_config=g.config.to_vllm(),
        engines=rows,
        alpha=g.alpha,
        alpha_lower=g.alpha_ci[0] if g.alpha_ci else None,
        alpha_upper=g.alpha_ci[1] if g.alpha_ci else None,
        alpha_binomial=list(g.pooled.alpha_ci) if g.pooled.alpha_ci else None,
        dispersion=g.dispersion.dispersion,
        drafts=g.pooled.drafts,
        outliers=[r for r in rows if r.verdict == OutlierVerdict.OUTLIER.value],
        pending=[_pending(labels, d) for d in fleet.pending_of(g)],
        message=g.message,
    )
