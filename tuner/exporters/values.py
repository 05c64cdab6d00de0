"""Snapshot → metric values: the one place that decides what spectuner exports (docs/exporters.md).

Purely computational: frozen snapshots of what the store holds go in, :class:`Sample` s come out; the
Prometheus collector and the OpenTelemetry callbacks only copy them. Counters are kept as running
totals (:class:`CounterTotals`), advanced by rows seen for the first time, so they only grow within a
process even when retention prunes the rows they were counted from.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from collectors.records import EngineKey
from policies.acceptance import alpha_of_windows
from policies.counters import SpecCounters
from policies.fleet import FleetGroup, GroupKey
from policies.length_bands import LengthView
from policies.spec_config import SpecConfig

Kind = Literal["gauge", "counter"]
BASE_LABELS = ("engine", "model_name")
# A fleet group (policies.fleet.GroupKey): model_name is its target, config its fingerprint (vLLM's JSON).
GROUP_LABELS = ("model_name", "method", "draft", "config")
# An engine of a group: its /metrics URL and vLLM's engine label name it across the fleet.
GROUP_ENGINE_LABELS = (*GROUP_LABELS, "metrics_url", "engine")


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Kind
    help: str
    unit: str = ""
    extra_labels: tuple[str, ...] = ()
    base_labels: tuple[str, ...] = BASE_LABELS

    @property
    def labels(self) -> tuple[str, ...]:
        return self.base_labels + self.extra_labels


METRICS: dict[str, MetricSpec] = {
    m.name: m
    for m in (
        MetricSpec("spectuner_alpha", "gauge", "Estimated per-token draft acceptance probability (alpha-hat, MLE)"),
        MetricSpec("spectuner_alpha_lower", "gauge", "Lower end of alpha-hat's 95% interval"),
        MetricSpec("spectuner_alpha_upper", "gauge", "Upper end of alpha-hat's 95% interval"),
        MetricSpec("spectuner_draft_acceptance_rate", "gauge", "vLLM draft acceptance rate A/T (depends on K)"),
        MetricSpec("spectuner_mean_acceptance_length", "gauge", "Tokens per verify step, 1 + A/D", "tokens"),
        MetricSpec(
            "spectuner_effective_throughput_tokens_per_second", "gauge", "Generated tokens per second", "tokens/s"
        ),
        MetricSpec(
            "spectuner_speculation_overhead_ratio",
            "gauge",
            "Modelled share of step time spent drafting and verifying rejected draft tokens",
        ),
        MetricSpec("spectuner_num_speculative_tokens", "gauge", "K of the config in force", "tokens"),
        MetricSpec("spectuner_config_info", "gauge", "The config in force (value 1)", "", ("method", "draft")),
        MetricSpec("spectuner_predicted_speedup", "gauge", "Predicted gain of the last verified change", "ratio"),
        MetricSpec("spectuner_realized_speedup", "gauge", "Realized gain of the last verified change", "ratio"),
        MetricSpec("spectuner_last_scrape_age_seconds", "gauge", "Age of the newest stored window", "s"),
        MetricSpec("spectuner_engine_up", "gauge", "1 unless the health job reported the engine down"),
        MetricSpec(
            "spectuner_daemon_job_failures_total",
            "counter",
            "Runs of a daemon job (collect, decide, health, ...) that raised, in this process",
            "",
            ("daemon_job",),
            (),
        ),
        MetricSpec(
            "spectuner_daemon_job_failing",
            "gauge",
            "1 while a daemon job's last run raised (decide: the controller is not deciding)",
            "",
            ("daemon_job",),
            (),
        ),
        MetricSpec(
            "spectuner_decisions_total", "counter", "Decisions recorded, by action and reason", "", ("action", "reason")
        ),
        MetricSpec("spectuner_draft_swaps_total", "counter", "Draft model changes applied"),
        MetricSpec("spectuner_rollbacks_total", "counter", "Rollbacks (apply failed to come up, or regression)"),
        MetricSpec("spectuner_collector_errors_total", "counter", "Collector failure episodes by kind", "", ("kind",)),
        MetricSpec(
            "spectuner_apply_requests_held_total",
            "counter",
            "Client requests held by the front door during applies",
            "",
            ("strategy",),
        ),
        MetricSpec(
            "spectuner_apply_requests_failed_total",
            "counter",
            "Client requests failed during applies (errors of spectuner's making)",
            "",
            ("strategy",),
        ),
        MetricSpec(
            "spectuner_apply_longest_hold_seconds",
            "gauge",
            "Longest a request was held in the last apply",
            "s",
            ("strategy",),
        ),
        MetricSpec(
            "spectuner_alpha_by_context_length",
            "gauge",
            "alpha-hat of the requests whose context (prompt + half the output) falls in a length band",
            "",
            ("band",),
        ),
        MetricSpec(
            "spectuner_context_length_collapse",
            "gauge",
            "1 when acceptance collapses on long contexts (a band clearly below 0.6 x the shortest band's, slope < 0)",
        ),
        MetricSpec(
            "spectuner_speculation_cutoff_context_tokens",
            "gauge",
            "Context length from which speculation should be off (alpha clearly below 0.4); absent: nowhere",
            "tokens",
        ),
        MetricSpec(
            "spectuner_alert_deliveries_total",
            "counter",
            "Alert deliveries by sink and outcome",
            "",
            ("sink", "outcome"),
        ),
        # the fleet view ([exporters] fleet = true): engines grouped by (target, draft, config)
        MetricSpec(
            "spectuner_fleet_group_alpha",
            "gauge",
            "Pooled alpha-hat of a fleet group (every window of its engines)",
            base_labels=GROUP_LABELS,
        ),
        MetricSpec(
            "spectuner_fleet_group_alpha_lower",
            "gauge",
            "Lower end of the group's pooled alpha-hat interval, widened by sqrt(phi) for the variation among engines",
            base_labels=GROUP_LABELS,
        ),
        MetricSpec(
            "spectuner_fleet_group_alpha_upper",
            "gauge",
            "Upper end of the group's pooled alpha-hat interval, widened by sqrt(phi)",
            base_labels=GROUP_LABELS,
        ),
        MetricSpec(
            "spectuner_fleet_group_dispersion",
            "gauge",
            "Quasi-binomial dispersion phi of acceptance between the group's engines (1: binomial)",
            base_labels=GROUP_LABELS,
        ),
        MetricSpec("spectuner_fleet_group_engines", "gauge", "Engines in the fleet group", base_labels=GROUP_LABELS),
        MetricSpec(
            "spectuner_fleet_group_pending_changes",
            "gauge",
            "Changes in flight and overrides proposed on the group's engines",
            base_labels=GROUP_LABELS,
        ),
        MetricSpec(
            "spectuner_fleet_engine_alpha",
            "gauge",
            "alpha-hat of one engine of a fleet group (over the fleet window)",
            base_labels=GROUP_ENGINE_LABELS,
        ),
        MetricSpec(
            "spectuner_fleet_outlier",
            "gauge",
            "1 when the engine's alpha-hat is far from the rest of its group (an outlier), else 0",
            base_labels=GROUP_ENGINE_LABELS,
        ),
    )
}

ROLLBACK_KINDS = frozenset({"apply_rolled_back", "regression_rolled_back"})
DOWN_KINDS = frozenset({"engine_down", "engine_unhealthy"})
UP_KINDS = frozenset({"engine_restarted", "engine_up"})
HEALTH_KINDS = DOWN_KINDS | UP_KINDS
CHANGE_SOURCES = frozenset({"restart", "live", "command", "webhook", "manual", "rollback"})
_NO_DRAFT_METHODS = frozenset({"off", "ngram", "suffix", "none", ""})


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]  # in the metric's label order
    value: float


@dataclass(frozen=True)
class EngineSnapshot:
    """What the store says about one engine series at ``now`` (window figures: current config only)."""

    key: EngineKey
    now: datetime
    config: SpecConfig | None
    spec: SpecCounters | None  # summed over the windows in the export window under the current config
    duration_s: float  # summed window durations
    generation_tokens: float
    last_window_end: datetime | None
    up: bool = True
    predicted_speedup: float | None = None
    realized_speedup: float | None = None
    # the windows of ``spec`` one by one: α̂ is policies.acceptance.alpha_of_windows of these, as the controller's
    window_specs: tuple[SpecCounters, ...] = ()
    # α by context length of the model's requests (the tap's records), when any were stored
    lengths: LengthView | None = None


def overhead_ratio(counters: SpecCounters, k: int, cost_ratio: float) -> float | None:
    """(K·c + (T − A)/(T + D)) / (1 + K·c): drafting plus the target's work on rejected positions, as a
    share of a step costing one target pass (T/D + 1 positions) and K draft passes (c each)."""
    d, t, a = counters.drafts, counters.draft_tokens, counters.accepted_tokens
    if d <= 0 or k <= 0 or t + d <= 0:
        return None
    draft = k * cost_ratio
    rejected_share = max(0.0, t - a) / (t + d)
    return (draft + rejected_share) / (1.0 + draft)


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def engine_samples(snap: EngineSnapshot, *, cost_ratio: float, confidence: float = 0.95) -> list[Sample]:
    """The gauges of one engine series. A figure that cannot be computed is left out (no false 0)."""
    base = (("engine", snap.key.engine), ("model_name", snap.key.model_name))
    out: list[Sample] = []

    def put(name: str, value: float | None, *extra: tuple[str, str]) -> None:
        if value is not None and _finite(float(value)):
            out.append(Sample(name, base + extra, float(value)))

    config_k = (snap.config.largest_k() or 0) if snap.config is not None else 0
    if snap.config is not None:
        # the largest K of a per-batch-size table: what the engine may draft at its quietest
        put("spectuner_num_speculative_tokens", config_k)
        put("spectuner_config_info", 1.0, ("method", snap.config.method), ("draft", snap.config.model or ""))
    spec = snap.spec
    if spec is not None and spec.drafts > 0:
        est = alpha_of_windows(snap.window_specs or (spec,), confidence)
        put("spectuner_alpha", est.alpha)
        if est.alpha_ci is not None:
            put("spectuner_alpha_lower", est.alpha_ci[0])
            put("spectuner_alpha_upper", est.alpha_ci[1])
        put("spectuner_draft_acceptance_rate", est.draft_acceptance_rate)
        put("spectuner_mean_acceptance_length", est.mean_acceptance_length)
        k = config_k if config_k > 0 else spec.k
        put("spectuner_speculation_overhead_ratio", overhead_ratio(spec, k, cost_ratio))
    if snap.duration_s > 0:
        put("spectuner_effective_throughput_tokens_per_second", snap.generation_tokens / snap.duration_s)
    put("spectuner_predicted_speedup", snap.predicted_speedup)
    put("spectuner_realized_speedup", snap.realized_speedup)
    if snap.last_window_end is not None:
        put("spectuner_last_scrape_age_seconds", max(0.0, (snap.now - snap.last_window_end).total_seconds()))
    put("spectuner_engine_up", 1.0 if snap.up else 0.0)
    if snap.lengths is not None and snap.lengths.bands:
        usable = [b for b in snap.lengths.bands if b.evidence.trials >= snap.lengths.settings.min_trials]
        for b in usable:
            band = f"{b.lo_tokens}-{b.hi_tokens}" if b.hi_tokens is not None else f"{b.lo_tokens}-"
            put("spectuner_alpha_by_context_length", b.alpha, ("band", band))
        if usable:
            put("spectuner_context_length_collapse", 1.0 if snap.lengths.collapse else 0.0)
        put("spectuner_speculation_cutoff_context_tokens", snap.lengths.cutoff_tokens)
    return out


# --- the fleet --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FleetSnapshot:
    """The fleet's groups (``tuner.fleet.read_fleet``) with what the gauges need beside them."""

    groups: tuple[FleetGroup, ...]
    keys: Mapping[str, EngineKey]  # engine name (as the groups use it) → its series
    pending: Mapping[GroupKey, int]  # changes in flight and overrides proposed, per group


def fleet_samples(snap: FleetSnapshot) -> list[Sample]:
    """The fleet gauges: per group its pooled α̂, widened interval, φ, engines and pending changes; per
    engine of a group its α̂ and outlier flag. A figure that cannot be computed is left out."""
    out: list[Sample] = []
    for g in snap.groups:
        group = (
            ("model_name", g.key.target),
            ("method", g.key.method),
            ("draft", g.key.draft_model or ""),
            ("config", g.key.fingerprint),
        )

        def put(name: str, value: float | None, labels: tuple[tuple[str, str], ...] = group) -> None:
            if value is not None and _finite(float(value)):
                out.append(Sample(name, labels, float(value)))

        put("spectuner_fleet_group_alpha", g.alpha)
        if g.alpha_ci is not None:
            put("spectuner_fleet_group_alpha_lower", g.alpha_ci[0])
            put("spectuner_fleet_group_alpha_upper", g.alpha_ci[1])
        if g.alpha is not None:
            put("spectuner_fleet_group_dispersion", g.dispersion.dispersion)
        put("spectuner_fleet_group_engines", len(g.engines))
        put("spectuner_fleet_group_pending_changes", snap.pending.get(g.key, 0))
        flagged = {c.engine for c in g.outliers}
        for a in g.engines:
            key = snap.keys[a.engine]
            engine = (*group, ("metrics_url", key.url), ("engine", key.engine))
            put("spectuner_fleet_engine_alpha", a.estimate.alpha, engine)
            put("spectuner_fleet_outlier", 1.0 if a.engine in flagged else 0.0, engine)
    return out


# --- counters ---------------------------------------------------------------------------------------


def decision_action(action: str, status: str) -> str:
    """The ``action`` label: what became of a controller proposal when recorded; else the order."""
    if action == "change":
        if status in ("advisory", "blocked"):
            return status
        return "apply"
    return action


def collector_error_kind(kind: str, data: Mapping[str, object]) -> str | None:
    """The ``kind`` label of a collector failure event, or None for other events."""
    if kind == "collector_error":
        return str(data.get("reason") or "unknown")
    if kind == "scrape_stale":
        return "stale"
    return None


def is_draft_swap(previous: tuple[str, str | None] | None, current: tuple[str, str | None], applied_by: str) -> bool:
    """A config (method, draft) that replaces a different draft by our (or an operator's) hand."""
    if previous is None or applied_by not in CHANGE_SOURCES:
        return False
    if previous[0] in _NO_DRAFT_METHODS and current[0] in _NO_DRAFT_METHODS and previous[0] == current[0]:
        return False
    return previous != current


EngineLabels = tuple[str, str]  # (engine, model_name); ("", "") for rows without an engine


@dataclass
class CounterTotals:
    """Running totals; a server-level count (collector errors) is kept by metrics URL and shown on
    the first engine series of that server."""

    decisions: dict[tuple[EngineLabels, str, str], int] = field(default_factory=dict)
    swaps: dict[EngineLabels, int] = field(default_factory=dict)
    rollbacks: dict[EngineLabels, int] = field(default_factory=dict)
    collector_errors: dict[tuple[str, str], int] = field(default_factory=dict)  # (url, kind)
    deliveries: dict[tuple[EngineLabels, str, str], int] = field(default_factory=dict)
    # (labels, strategy) -> held / failed requests summed over applies; the last apply's longest hold
    apply_held: dict[tuple[EngineLabels, str], int] = field(default_factory=dict)
    apply_failed: dict[tuple[EngineLabels, str], int] = field(default_factory=dict)
    apply_longest_hold_s: dict[tuple[EngineLabels, str], float] = field(default_factory=dict)

    @staticmethod
    def _add(table: dict[Any, int], key: object, n: int = 1) -> None:
        table[key] = table.get(key, 0) + n

    def add_decision(self, labels: EngineLabels, action: str, status: str, reason: str) -> None:
        self._add(self.decisions, (labels, decision_action(action, status), reason))

    def add_config(
        self, labels: EngineLabels, previous: tuple[str, str | None] | None, current: tuple[str, str | None], by: str
    ) -> None:
        if is_draft_swap(previous, current, by):
            self._add(self.swaps, labels)

    def add_event(self, labels: EngineLabels, kind: str, data: Mapping[str, object]) -> None:
        if kind in ROLLBACK_KINDS:
            self._add(self.rollbacks, labels)
        err = collector_error_kind(kind, data)
        if err is not None:
            self._add(self.collector_errors, (str(data.get("url") or ""), err))
        strategy = data.get("strategy")
        if isinstance(strategy, str):  # an apply's audit event with its client impact (ApplyImpact)
            held, failed, longest = data.get("requests_held"), data.get("requests_failed"), data.get("longest_hold_s")
            self._add(self.apply_held, (labels, strategy), held if isinstance(held, int) else 0)
            self._add(self.apply_failed, (labels, strategy), failed if isinstance(failed, int) else 0)
            if isinstance(longest, int | float):
                self.apply_longest_hold_s[(labels, strategy)] = float(longest)

    def add_deliveries(self, labels: EngineLabels, sink: str, outcome: str, n: int) -> None:
        self._add(self.deliveries, (labels, sink, outcome), n)

    def samples(self, engines: Sequence[EngineKey]) -> list[Sample]:
        """Counter samples. Every engine series shown gets a zero for its unlabelled counters, so
        ``rate()`` has a series from the start."""
        out: list[Sample] = []

        def lab(labels: EngineLabels) -> tuple[tuple[str, str], ...]:
            return (("engine", labels[0]), ("model_name", labels[1]))

        shown = {(k.engine, k.model_name) for k in engines}
        for labels in sorted(shown | set(self.swaps)):
            out.append(Sample("spectuner_draft_swaps_total", lab(labels), float(self.swaps.get(labels, 0))))
        for labels in sorted(shown | set(self.rollbacks)):
            out.append(Sample("spectuner_rollbacks_total", lab(labels), float(self.rollbacks.get(labels, 0))))
        for name, table in (
            ("spectuner_apply_requests_held_total", self.apply_held),
            ("spectuner_apply_requests_failed_total", self.apply_failed),
            ("spectuner_apply_longest_hold_seconds", self.apply_longest_hold_s),
        ):
            for (labels, strategy), value in sorted(table.items()):
                out.append(Sample(name, (*lab(labels), ("strategy", strategy)), float(value)))
        for (labels, action, reason), n in sorted(self.decisions.items()):
            out.append(Sample("spectuner_decisions_total", (*lab(labels), ("action", action), ("reason", reason)), n))
        # A server-level count goes on the server's first engine series (as the controller records its
        # decisions): a sum over engine series stays right, and it moves with no engine's restart.
        first: dict[str, EngineKey] = {}
        for key in sorted(engines, key=lambda k: (k.model_name, k.engine)):
            first.setdefault(key.url, key)
        for (url, kind), n in sorted(self.collector_errors.items()):
            if url in first:
                labels = (first[url].engine, first[url].model_name)
                out.append(Sample("spectuner_collector_errors_total", (*lab(labels), ("kind", kind)), float(n)))
        for (labels, sink, outcome), n in sorted(self.deliveries.items()):
            out.append(
                Sample("spectuner_alert_deliveries_total", (*lab(labels), ("sink", sink), ("outcome", outcome)), n)
            )
        return out


def job_samples(failures: Mapping[str, int], failing: Mapping[str, bool]) -> list[Sample]:
    """The daemon's jobs as seen by this process: runs that raised, and whether the last one did (the daemon
    logs a failing job once, so without these a controller that stopped deciding shows only in its log)."""
    out: list[Sample] = []
    for job in sorted(set(failures) | set(failing)):
        out.append(Sample("spectuner_daemon_job_failures_total", (("daemon_job", job),), float(failures.get(job, 0))))
        out.append(Sample("spectuner_daemon_job_failing", (("daemon_job", job),), 1.0 if failing.get(job) else 0.0))
    return out


def by_name(samples: Iterable[Sample]) -> dict[str, list[Sample]]:
    out: dict[str, list[Sample]] = {name: [] for name in METRICS}
    for s in samples:
        out.setdefault(s.name, []).append(s)
    return out
