"""What the report plots, read from the store and reduced to plain numbers (no plotting here).

Every figure of the HTML page comes from one :class:`ReportData`, which is also written verbatim to
``report.json`` so a reader can check a plot against its numbers.

- α̂ over time: the windows of each engine series are grouped into time buckets (by window end, as
  the store places them) and each bucket's α̂ is ``policies.acceptance.alpha_of_windows`` of its
  windows — the controller's estimate, so buckets that straddle a K change stay correct; vLLM's draft
  acceptance rate A/T beside it.
- per-position acceptance: per config in force, a_i / D (vLLM's "per-position acceptance rate") and
  the conditional c_i = a_i / a_{i−1}.
- goodput against K: busy windows (generated tokens > 0, no counter reset) grouped by the K they ran
  at; goodput = generated tokens / window duration. The K in force at the end of the range is marked.
- predicted against realized gain: decisions that carry both.
- the fleet: engines grouped by (target, draft, config), pooled α̂, outliers (``tuner.report.fleet``).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from collectors.records import EngineKey, EventRecord, WindowRecord
from policies.acceptance import (
    AlphaReason,
    alpha_of_windows,
    conditional_acceptance,
)
from policies.counters import SpecCounters
from policies.spec_config import SpecConfig
from tuner.report.fleet import FleetSection, fleet_section
from tuner.store import Store, StoredConfig, StoredDecision
from tuner.store.lengths import context_length_view
from tuner.store.shadow import latest_shadow_results

# Bucket widths to choose from (seconds): the smallest that gives at most MAX_BUCKETS buckets.
_BUCKET_LADDER_S = (10, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400, 7 * 86400)
MAX_BUCKETS = 60
ALPHA_THRESHOLD = 0.4  # the swap rule: "acceptance stays below 0.4" (on α̂ by default)
CONFIDENCE = 0.95
# Events worth a row in the report's table (severity warning or critical are always shown).
_NOTABLE_EVENT_KINDS = {
    "config_applied",
    "apply_rolled_back",
    "regression_rolled_back",
    "apply_failed",
    "rollback_failed",
    "engine_down",
    "engine_restarted",
    "draft_swapped",
    "k_changed",
    "acceptance_low",
    "counter_reset",
}
MAX_EVENTS = 100
_MINUTE = timedelta(minutes=1)


@dataclass(frozen=True)
class EngineInfo:
    label: str  # "model/engine", plus the URL's host:port when two servers serve the same model
    url: str
    model_name: str
    engine: str
    windows: int  # raw scrape windows in range
    rollup_minutes: int = 0  # 1-minute rollups standing in for raw windows already pruned


@dataclass(frozen=True)
class AlphaBucket:
    engine: str  # EngineInfo.label
    start: datetime
    end: datetime
    windows: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    alpha: float | None
    alpha_lower: float | None
    alpha_upper: float | None
    draft_acceptance_rate: float | None
    reason: str  # AlphaReason value: why alpha is None when it is


@dataclass(frozen=True)
class PositionAcceptance:
    engine: str
    config_id: int | None
    config: str  # "draft K=3"
    k: int
    drafts: int
    accepted_per_pos: list[int]
    rate_by_position: list[float]  # a_i / D
    conditional_by_position: list[float | None]  # c_i


@dataclass(frozen=True)
class ConfigSpan:
    engine: str
    config_id: int
    method: str
    draft: str  # short name of the draft (last path component), method for ngram/suffix/off
    k: int | None
    start: datetime
    end: datetime | None  # None: still in force
    applied_by: str
    decision_id: int | None


@dataclass(frozen=True)
class KPoint:
    """K as the windows saw it (used when no config rows exist, e.g. a `spectuner collect` database)."""

    engine: str
    at: datetime
    k: int


@dataclass(frozen=True)
class DecisionPoint:
    id: int
    created_at: datetime
    updated_at: datetime
    engine: str | None
    action: str
    reason: str
    status: str
    mode: str
    message: str
    predicted_gain: float | None
    realized_gain: float | None
    proposed: str | None  # "draft K=5"


@dataclass(frozen=True)
class GoodputByK:
    engine: str
    k: int
    windows: int
    mean_tokens_per_s: float
    stderr_tokens_per_s: float | None  # None for one window
    chosen: bool  # the K in force at the end of the range


@dataclass(frozen=True)
class EventRow:
    ts: datetime
    engine: str | None
    kind: str
    severity: str
    message: str


@dataclass
class ReportData:
    generated_at: datetime
    db: str  # rendered URL (password hidden)
    since: datetime | None
    until: datetime | None
    first: datetime | None  # first window start in range
    last: datetime | None  # last window end in range
    bucket_s: int | None
    alpha_threshold: float = ALPHA_THRESHOLD
    confidence: float = CONFIDENCE
    engines: list[EngineInfo] = field(default_factory=list)
    alpha: list[AlphaBucket] = field(default_factory=list)
    positions: list[PositionAcceptance] = field(default_factory=list)
    configs: list[ConfigSpan] = field(default_factory=list)
    k_points: list[KPoint] = field(default_factory=list)
    decisions: list[DecisionPoint] = field(default_factory=list)
    goodput: list[GoodputByK] = field(default_factory=list)
    events: list[EventRow] = field(default_factory=list)
    # engine label -> α by context length over the range (policies.length_bands.LengthView.to_dict)
    context_length: dict[str, dict[str, Any]] = field(default_factory=dict)
    shadow: list[dict[str, Any]] = field(default_factory=list)  # each candidate's newest shadow result
    fleet: FleetSection = field(default_factory=FleetSection)
    missing: dict[str, str] = field(default_factory=dict)  # section -> why it is empty
    notes: dict[str, str] = field(default_factory=dict)  # section -> what a drawn figure leaves out

    @property
    def gains(self) -> list[DecisionPoint]:
        """Decisions with both a predicted and a realized gain (the scatter plot's points)."""
        return [d for d in self.decisions if d.predicted_gain is not None and d.realized_gain is not None]

    def to_json(self) -> dict[str, Any]:
        return _jsonable({**asdict(self), "gains": [d.id for d in self.gains]})


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def draft_name(method: str, model: str | None) -> str:
    """A short, readable draft name: the last path component of the draft model, else the method."""
    if model:
        return model.rstrip("/").rsplit("/", 1)[-1]
    return method


def describe_config(spec: dict[str, Any] | None) -> str | None:
    """A short label for a proposed config in the decisions table: the draft's short name and K."""
    if not spec:
        return None
    try:
        config = SpecConfig.from_vllm(spec)
    except ValueError:
        return str(spec.get("method", "?"))
    name = draft_name(config.method, config.model)
    return f"{name} K={config.k}" if config.k is not None else name


def choose_bucket_s(span_s: float, window_s: float) -> int:
    """The smallest ladder width ≥ the typical window that yields at most ``MAX_BUCKETS`` buckets."""
    for width in _BUCKET_LADDER_S:
        if width >= window_s and span_s / width <= MAX_BUCKETS:
            return width
    return _BUCKET_LADDER_S[-1]


def _labels(keys: Sequence[EngineKey]) -> dict[EngineKey, str]:
    short = [f"{k.model_name}/{k.engine}" for k in keys]
    out = {}
    for key, name in zip(keys, short, strict=True):
        if short.count(name) > 1:
            host = key.url.split("//", 1)[-1].split("/", 1)[0]
            name = f"{name}@{host}"
        out[key] = name
    return out


def gather(
    store: Store,
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    now: datetime | None = None,
    db_label: str = "",
) -> ReportData:
    """Read one time range ``[since, until)`` of the store and reduce it to the report's numbers."""
    now = now or datetime.now(UTC)
    data = ReportData(generated_at=now, db=db_label, since=since, until=until, first=None, last=None, bucket_s=None)
    engines = store.engines()
    keys = [e.key for e in engines]
    labels = _labels(keys)

    per_engine: dict[EngineKey, list[WindowRecord]] = {}
    for key in keys:
        windows, from_rollups = _history(store, key, since, until)
        per_engine[key] = windows
        data.engines.append(
            EngineInfo(labels[key], key.url, key.model_name, key.engine, len(windows) - from_rollups, from_rollups)
        )
    all_windows = [w for ws in per_engine.values() for w in ws]
    if all_windows:
        data.first = min(w.start for w in all_windows)
        data.last = max(w.end for w in all_windows)
        typical_s = statistics.median(w.duration_s for w in all_windows)
        data.bucket_s = choose_bucket_s((data.last - data.first).total_seconds(), typical_s)

    configs_by_key: dict[EngineKey, list[StoredConfig]] = {}
    for key in keys:
        configs_by_key[key] = _configs_overlapping(store, key, since, until)
        for c in configs_by_key[key]:
            cfg = c.config
            data.configs.append(
                ConfigSpan(
                    engine=labels[key],
                    config_id=c.id,
                    method=cfg.method,
                    draft=draft_name(cfg.method, cfg.draft_model),
                    k=c.config.spec.largest_k(),
                    start=cfg.started_at,
                    end=cfg.ended_at,
                    applied_by=cfg.applied_by,
                    decision_id=cfg.decision_id,
                )
            )

    for key, windows in per_engine.items():
        if data.bucket_s is not None and data.first is not None:
            data.alpha.extend(_alpha_buckets(labels[key], windows, data.first, data.bucket_s))
        data.positions.extend(_positions(labels[key], windows, configs_by_key[key]))
        data.goodput.extend(_goodput(labels[key], windows, configs_by_key[key]))
        if not configs_by_key[key]:
            data.k_points.extend(_k_points(labels[key], windows))

    for d in store.decisions(since, until):
        data.decisions.append(_decision_point(d, labels))
    data.events = _events(store.events(since, until), labels)
    for key in keys:
        view = context_length_view(store, key.model_name, since, until)
        if any(b.requests for b in view.bands):
            data.context_length[labels[key]] = view.to_dict()
    data.shadow = [r.to_json() for r in latest_shadow_results(store).values()]
    data.fleet = fleet_section(store, since, until, labels, CONFIDENCE)
    data.missing = _missing(data)
    data.notes = _notes(data)
    return data


def _history(
    store: Store, key: EngineKey, since: datetime | None, until: datetime | None
) -> tuple[list[WindowRecord], int]:
    """Raw windows in range, preceded by the 1-minute rollups of the minutes whose raw windows
    retention has already pruned (each rollup becomes one window record; counts sum exactly).
    Returns the records, oldest first, and how many came from rollups."""
    raw = store.windows(key, since, until)
    cutoff = raw[0].end.replace(second=0, microsecond=0) if raw else None
    older = [
        r
        for r in store.rollups(key, since, until)
        if r.duration_s > 0 and (cutoff is None or r.bucket_start + _MINUTE <= cutoff)
    ]
    stand_ins = [
        WindowRecord(
            key=key,
            start=r.bucket_start + _MINUTE - timedelta(seconds=r.duration_s),
            end=r.bucket_start + _MINUTE,
            spec=r.spec if r.spec.drafts or r.spec.accepted_per_pos else None,
            generation_tokens=r.generation_tokens,
            prompt_tokens=r.prompt_tokens,
            reset=r.resets > 0,
            config_id=r.config_id,
        )
        for r in older
    ]
    return stand_ins + raw, len(stand_ins)


def _configs_overlapping(
    store: Store, key: EngineKey, since: datetime | None, until: datetime | None
) -> list[StoredConfig]:
    """Configs in force at some time in ``[since, until)``: those that started inside it, plus the one
    already in force at ``since``."""
    inside = store.configs(key, since, until)
    if since is None:
        return inside
    before = store.config_at(key, since)
    if before is not None and all(c.id != before.id for c in inside):
        return [before, *inside]
    return inside


def _k_of(w: WindowRecord, configs: Sequence[StoredConfig]) -> int:
    """K as the timeline shows it: the config's (the largest K of a per-batch-size table, as the
    exporter's K gauge), else what the window's counters say."""
    cfg = _config_of(w, configs)
    k = cfg.config.spec.largest_k() if cfg is not None else None
    return k if k is not None else _window_k(w)


def _window_k(w: WindowRecord) -> int:
    """The K a window ran at: 0 without speculation (no spec counters on the page)."""
    if w.spec is None:
        return 0
    return w.spec.k


def _alpha_buckets(label: str, windows: Sequence[WindowRecord], origin: datetime, bucket_s: int) -> list[AlphaBucket]:
    groups: dict[int, list[WindowRecord]] = defaultdict(list)
    for w in windows:
        if w.spec is None or w.spec.drafts == 0:
            continue
        # Window ends are the store's placement; a bucket is half-open (start, start + width].
        index = max(0, math.ceil((w.end - origin).total_seconds() / bucket_s) - 1)
        groups[index].append(w)
    out = []
    for index in sorted(groups):
        group = groups[index]
        specs = [w.spec for w in group if w.spec is not None]
        # the controller's α̂ (windows at different K of a per-batch-size table each read at their own K)
        est = alpha_of_windows(specs, CONFIDENCE)
        drafts = sum(s.drafts for s in specs)
        tokens = sum(s.draft_tokens for s in specs)
        accepted = sum(s.accepted_tokens for s in specs)
        alpha, ci = est.alpha, est.alpha_ci
        start = origin + timedelta(seconds=index * bucket_s)
        out.append(
            AlphaBucket(
                engine=label,
                start=start,
                end=start + timedelta(seconds=bucket_s),
                windows=len(group),
                drafts=drafts,
                draft_tokens=tokens,
                accepted_tokens=accepted,
                alpha=alpha,
                alpha_lower=None if ci is None else ci[0],
                alpha_upper=None if ci is None else ci[1],
                draft_acceptance_rate=accepted / tokens if tokens else None,
                reason=est.reason.value if alpha is None else AlphaReason.OK.value,
            )
        )
    return out


def _config_of(w: WindowRecord, configs: Sequence[StoredConfig]) -> StoredConfig | None:
    """The window's config: its ``config_id`` tag, else the config in force at its end."""
    if w.config_id is not None:
        for c in configs:
            if c.id == w.config_id:
                return c
    chosen = None
    for c in configs:  # oldest first: the last one started at or before the window end wins
        if c.config.started_at < w.end and (c.config.ended_at is None or c.config.ended_at >= w.end):
            chosen = c
    return chosen


def _positions(
    label: str, windows: Sequence[WindowRecord], configs: Sequence[StoredConfig]
) -> list[PositionAcceptance]:
    """Per config (or, without configs, per K seen in the windows): summed per-position counts."""
    sums: dict[tuple[int | None, int], SpecCounters] = {}
    names: dict[tuple[int | None, int], str] = {}
    for w in windows:
        if w.spec is None or w.spec.drafts == 0 or not w.spec.accepted_per_pos:
            continue
        cfg = _config_of(w, configs)
        group = (cfg.id if cfg else None, w.spec.k)
        spec = SpecCounters(
            drafts=w.spec.drafts,
            draft_tokens=w.spec.draft_tokens,
            accepted_tokens=w.spec.accepted_tokens,
            accepted_per_pos=w.spec.accepted_per_pos,
        )
        sums[group] = sums[group] + spec if group in sums else spec
        if cfg is not None:
            names[group] = f"#{cfg.id} {draft_name(cfg.config.method, cfg.config.draft_model)} K={w.spec.k}"
        else:
            names[group] = f"K={w.spec.k}"
    out = []
    for (config_id, k), spec in sums.items():
        d = spec.drafts
        out.append(
            PositionAcceptance(
                engine=label,
                config_id=config_id,
                config=names[(config_id, k)],
                k=k,
                drafts=d,
                accepted_per_pos=list(spec.accepted_per_pos),
                rate_by_position=[a / d for a in spec.accepted_per_pos],
                conditional_by_position=list(conditional_acceptance(spec)),
            )
        )
    return out


def _goodput(label: str, windows: Sequence[WindowRecord], configs: Sequence[StoredConfig]) -> list[GoodputByK]:
    by_k: dict[int, list[float]] = defaultdict(list)
    for w in windows:
        # Idle windows say nothing about K; a reset window's delta covers an unknown span.
        if w.reset or w.generation_tokens <= 0 or w.duration_s <= 0:
            continue
        by_k[_k_of(w, configs)].append(w.generation_tokens / w.duration_s)
    chosen_k: int | None = None
    if configs:
        chosen_k = configs[-1].config.spec.largest_k()
    if chosen_k is None and windows:
        chosen_k = _k_of(windows[-1], configs)
    out = []
    for k in sorted(by_k):
        rates = by_k[k]
        stderr = statistics.stdev(rates) / math.sqrt(len(rates)) if len(rates) > 1 else None
        out.append(GoodputByK(label, k, len(rates), statistics.fmean(rates), stderr, k == chosen_k))
    return out


def _k_points(label: str, windows: Sequence[WindowRecord]) -> list[KPoint]:
    """K changes seen in the windows (one point per change, plus the last window)."""
    out: list[KPoint] = []
    for w in windows:
        k = _window_k(w)
        if not out or out[-1].k != k:
            out.append(KPoint(label, w.start, k))
    if windows:
        out.append(KPoint(label, windows[-1].end, _window_k(windows[-1])))
    return out


def _decision_point(d: StoredDecision, labels: dict[EngineKey, str]) -> DecisionPoint:
    rec = d.decision
    return DecisionPoint(
        id=d.id,
        created_at=rec.created_at,
        updated_at=d.updated_at,
        engine=labels.get(rec.engine) if rec.engine is not None else None,
        action=rec.action,
        reason=rec.reason,
        status=d.status,
        mode=rec.mode,
        message=d.status_message or rec.message,
        predicted_gain=rec.predicted_gain,
        realized_gain=d.realized_gain,
        proposed=describe_config(rec.proposed_config),
    )


def _events(events: Sequence[EventRecord], labels: dict[EngineKey, str]) -> list[EventRow]:
    notable = [e for e in events if e.kind in _NOTABLE_EVENT_KINDS or e.severity in ("warning", "critical")]
    return [
        EventRow(e.ts, labels.get(e.engine) if e.engine else None, e.kind, e.severity, e.message)
        for e in notable[-MAX_EVENTS:]
    ]


_REASON_TEXT = {
    AlphaReason.DYNAMIC_K_UNRESOLVED.value: "K varied inside the bucket (a per-batch-size table) and /metrics has "
    "no per-position draft counts (the in-engine plugin's per-step records have them; this report reads windows)",
    AlphaReason.NO_PER_POSITION.value: "the per-position accepted counts were missing",
    AlphaReason.INCONSISTENT_COUNTERS.value: "the counters were inconsistent (scraped at different moments)",
    AlphaReason.NO_DRAFTS.value: "there were no drafts",
}


def _notes(data: ReportData) -> dict[str, str]:
    """Sentences for figures that are drawn but leave something out."""
    notes: dict[str, str] = {}
    unresolved: dict[str, int] = defaultdict(int)
    for b in data.alpha:
        if b.alpha is None:
            unresolved[b.reason] += 1
    if unresolved and any(b.alpha is not None for b in data.alpha):
        parts = [f"{n} bucket(s) because {_REASON_TEXT.get(r, r)}" for r, n in sorted(unresolved.items())]
        notes["alpha"] = "α̂ is not shown for " + "; ".join(parts) + ". The draft acceptance rate is."
    return notes


def _missing(data: ReportData) -> dict[str, str]:
    """Per section, a sentence saying why it is empty and what would fill it."""
    missing: dict[str, str] = {}
    no_windows = (
        "No scrape windows in this range: run `spectuner collect --url URL --db URL` or `spectuner run` "
        "to record some, or widen --since."
    )
    if not data.engines or not any(e.windows or e.rollup_minutes for e in data.engines):
        for section in ("alpha", "positions", "goodput"):
            missing[section] = no_windows
    else:
        if not any(b.alpha is not None for b in data.alpha):
            reasons = sorted({b.reason for b in data.alpha}) or [AlphaReason.NO_DRAFTS.value]
            missing["alpha"] = (
                f"The windows hold no speculation counters α̂ can be estimated from ({', '.join(reasons)}): "
                "speculation is off or the engine was idle."
            )
        if not data.positions:
            missing["positions"] = "No window has per-position acceptance counts (speculation off or idle)."
        if not data.goodput:
            missing["goodput"] = "No busy window (every window generated 0 tokens)."
    if not data.configs and not data.k_points:
        missing["timeline"] = (
            "No configs recorded and no windows: nothing to show. `spectuner run` records the config in force."
        )
    if not data.fleet.groups:
        missing["fleet"] = (
            "No engine with a recorded config: the fleet groups engines by the config in force, which "
            "`spectuner run` records."
        )
    if not data.decisions:
        missing["decisions"] = (
            "No decisions in this range: the controller (`spectuner run`) has not recorded any (it writes a "
            "row only when it proposes a change)."
        )
    if not data.gains:
        missing["gains"] = (
            "No decision with both a predicted and a realized gain: a change gets its realized gain when "
            "verification ends (`[controller] verify_window_s` after it was applied)."
        )
    return missing
