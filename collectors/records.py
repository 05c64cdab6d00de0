"""Typed records that collectors produce and the store persists.

This is the seam between ``collectors/`` (which may not import the store) and ``tuner/store``
(which implements :class:`RecordSink`). Times are UTC ``datetime``s; durations carry ``_s``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from policies.counters import SpecCounters


@dataclass(frozen=True)
class EngineKey:
    """One engine series: vLLM labels ``model_name`` and ``engine`` (data-parallel rank), plus the
    metrics URL it was scraped from so two servers serving the same model stay apart."""

    url: str
    model_name: str
    engine: str = "0"


@dataclass(frozen=True)
class LatencySummary:
    """A histogram reduced to what we store per window: count, sum and a few quantiles (seconds)."""

    count: float = 0.0
    sum_s: float = 0.0
    p50_s: float | None = None
    p90_s: float | None = None
    p99_s: float | None = None


@dataclass(frozen=True)
class EngineSample:
    """Cumulative values read from one /metrics page for one engine at ``ts``."""

    key: EngineKey
    ts: datetime
    spec: SpecCounters | None  # None: no spec-decode metrics on the page (speculation off)
    generation_tokens: float = 0.0
    prompt_tokens: float = 0.0
    requests_running: float | None = None
    requests_waiting: float | None = None
    kv_cache_usage: float | None = None  # fraction 0..1
    cache_config: dict[str, str] = field(default_factory=dict)
    # Cumulative histograms keyed by metric name -> (buckets [(le, cumulative count)], count, sum).
    histograms: dict[str, tuple[tuple[tuple[float, float], ...], float, float]] = field(
        default_factory=dict
    )
    # Earliest ``_created`` Unix time among this engine's counters: when its stats began. A change
    # means the engine restarted, even if the new counters already exceed the old ones.
    created_s: float | None = None


@dataclass(frozen=True)
class WindowRecord:
    """Deltas for one engine between two scrapes. A counter reset (engine restart) makes the delta
    the new cumulative value and sets ``reset``; deltas are never negative."""

    key: EngineKey
    start: datetime
    end: datetime
    spec: SpecCounters | None
    generation_tokens: float
    prompt_tokens: float = 0.0
    requests_running: float | None = None
    requests_waiting: float | None = None
    kv_cache_usage: float | None = None
    e2e_latency: LatencySummary | None = None
    ttft: LatencySummary | None = None
    itl: LatencySummary | None = None
    reset: bool = False
    config_id: int | None = None

    @property
    def duration_s(self) -> float:
        return (self.end - self.start).total_seconds()


@dataclass(frozen=True)
class RequestRecord:
    """One finished request's ``metrics.speculative_decoding`` plus token counts (from the tap)."""

    ts: datetime
    request_id: str
    model_name: str
    prompt_tokens: int
    output_tokens: int
    latency_s: float
    num_spec_tokens: int | None = None
    num_spec_steps: int = 0  # drafts
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    acceptance_histogram: tuple[int, ...] = ()  # len K+1: steps that accepted 0..K tokens
    mean_acceptance_length: float | None = None
    draft_acceptance_rate: float | None = None
    per_step_accepted: tuple[int, ...] | None = None
    per_step_drafted: tuple[int, ...] | None = None
    upstream_url: str = ""
    streamed: bool = False
    status_code: int = 200
    config_id: int | None = None


@dataclass(frozen=True)
class StepRecord:
    """One engine step's speculation stats, shipped by the in-engine plugin."""

    ts: datetime
    key: EngineKey
    batch_size: int
    step_time_s: float | None
    spec: SpecCounters
    num_scheduled_tokens: int | None = None
    config_id: int | None = None


@dataclass(frozen=True)
class EventRecord:
    """Something an operator may want to know: a counter reset, a collector error, a swap..."""

    ts: datetime
    kind: str  # e.g. "counter_reset", "collector_error", "scrape_stale", "draft_swapped"
    message: str
    severity: str = "info"  # info | warning | critical
    engine: EngineKey | None = None
    data: dict[str, Any] = field(default_factory=dict)


class RecordSink(Protocol):
    """Where collectors hand records. ``tuner.store`` implements it; tests may use a list-backed one.

    Each call is one transaction: either every record in it is stored, or none is.
    """

    def write_windows(self, records: Sequence[WindowRecord]) -> None: ...

    def write_scrape(
        self,
        windows: Sequence[WindowRecord],
        events: Sequence[EventRecord] = (),
        baselines: Sequence[EngineSample] = (),
    ) -> None:
        """One scrape: its windows, the events they raised (counter resets) and the cumulative
        samples they end at (the collector's new baselines), all in one transaction."""
        ...

    def baselines(self, url: str) -> Sequence[EngineSample]:
        """The baselines last stored by :meth:`write_scrape` for the engines scraped from ``url``."""
        ...

    def write_requests(self, records: Sequence[RequestRecord]) -> None: ...

    def write_steps(self, records: Sequence[StepRecord]) -> None: ...

    def write_events(self, records: Sequence[EventRecord]) -> None: ...
