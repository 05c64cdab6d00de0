"""Typed records the store owns (the collectors' records live in ``collectors.records``):
engine configs, controller decisions, window totals and 1-minute rollups."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, NamedTuple

from collectors.records import EngineKey
from policies.counters import SpecCounters
from policies.spec_config import SpecConfig


class DecisionStatus(StrEnum):
    """Where a decision is in the controller's life cycle (stored as text; the vocabulary may grow)."""

    PROPOSED = "proposed"
    ADVISORY = "advisory"  # recommended only (advisory mode)
    BLOCKED = "blocked"  # a guardrail held it back
    APPLYING = "applying"
    APPLIED = "applied"
    VERIFIED = "verified"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"


class AppliedBy(StrEnum):
    """How a config came to be in force."""

    OBSERVED = "observed"  # read from the running engine, not set by us
    STARTUP = "startup"
    RESTART = "restart"
    LIVE = "live"
    COMMAND = "command"
    WEBHOOK = "webhook"
    MANUAL = "manual"
    ROLLBACK = "rollback"
    PROMOTED = "promoted"  # a change another replica's canary proved (tuner.controller.canary)


class StoredEngine(NamedTuple):
    """An engine series as stored. A named tuple: ``for engine_id, key, cache_config in
    store.engines()`` works as well as attribute access."""

    id: int
    key: EngineKey
    cache_config: dict[str, Any] | None  # ``vllm:cache_config_info`` labels, when captured


@dataclass(frozen=True)
class EngineConfigRecord:
    """A speculative-decoding config as applied to an engine from ``started_at``."""

    method: str  # "eagle", "eagle3", "draft_model", "ngram", "suffix", "off", ...
    started_at: datetime
    applied_by: str = AppliedBy.OBSERVED
    draft_model: str | None = None
    num_spec_tokens: int | None = None
    # vLLM's per-batch-size K table: rows (lo, hi, K), first row starts at 1.
    k_table: tuple[tuple[int, int, int], ...] | None = None
    spec_config: dict[str, Any] | None = None
    ended_at: datetime | None = None
    decision_id: int | None = None

    @classmethod
    def of(
        cls, spec: SpecConfig, started_at: datetime, applied_by: str, decision_id: int | None = None
    ) -> EngineConfigRecord:
        """The record of ``spec`` in force from ``started_at`` (columns for queries, the full config as JSON)."""
        return cls(
            method=spec.method,
            started_at=started_at,
            applied_by=applied_by,
            draft_model=spec.model,
            num_spec_tokens=spec.k,
            k_table=spec.k_table,
            spec_config=spec.to_vllm(),
            decision_id=decision_id,
        )

    @property
    def spec(self) -> SpecConfig:
        """The full config (rebuilt from the columns for a row stored without its JSON)."""
        if self.spec_config is not None:
            return SpecConfig.from_vllm(self.spec_config)
        return SpecConfig(self.method, self.draft_model, self.num_spec_tokens, self.k_table)


@dataclass(frozen=True)
class StoredConfig:
    id: int
    key: EngineKey
    config: EngineConfigRecord


@dataclass(frozen=True)
class DecisionRecord:
    """What the controller saw, chose and why (``reason`` machine-readable, ``message`` human)."""

    created_at: datetime
    action: str
    reason: str
    message: str
    inputs: dict[str, Any]
    mode: str = "advisory"
    engine: EngineKey | None = None
    proposed_config: dict[str, Any] | None = None  # vLLM's JSON (see ``proposed``)
    predicted_gain: float | None = None
    status: str = DecisionStatus.PROPOSED  # at creation; see StoredDecision

    @property
    def proposed(self) -> SpecConfig | None:
        """``proposed_config`` as a :class:`SpecConfig` (None when there is none or it is not one)."""
        if self.proposed_config is None:
            return None
        try:
            return SpecConfig.from_vllm(self.proposed_config)
        except ValueError:
            return None


@dataclass(frozen=True)
class StoredDecision:
    """A decision as stored: ``decision.status`` is its current status, moved on by
    ``Store.update_decision`` together with ``updated_at``, ``realized_gain`` and ``status_message``."""

    id: int
    decision: DecisionRecord
    updated_at: datetime
    realized_gain: float | None
    status_message: str | None

    @property
    def status(self) -> str:
        return self.decision.status


@dataclass(frozen=True)
class WindowTotals:
    """Windows summed over a time range for one engine (what the policies' snapshots are built from)."""

    key: EngineKey
    windows: int
    duration_s: float
    spec: SpecCounters
    generation_tokens: float
    prompt_tokens: float
    resets: int
    first_start: datetime | None
    last_end: datetime | None


@dataclass(frozen=True)
class GaugeSummary:
    avg: float | None = None
    max: float | None = None


@dataclass(frozen=True)
class LatencyRollup:
    count: float = 0.0
    sum_s: float = 0.0
    p99_max_s: float | None = None


@dataclass(frozen=True)
class RollupRecord:
    """One engine, one config, one UTC minute (windows assigned by their end time)."""

    key: EngineKey
    bucket_start: datetime
    config_id: int | None
    windows: int
    duration_s: float
    resets: int
    spec: SpecCounters
    generation_tokens: float
    prompt_tokens: float
    requests_running: GaugeSummary = field(default_factory=GaugeSummary)
    requests_waiting: GaugeSummary = field(default_factory=GaugeSummary)
    kv_cache_usage: GaugeSummary = field(default_factory=GaugeSummary)
    e2e_latency: LatencyRollup | None = None
    ttft: LatencyRollup | None = None
    itl: LatencyRollup | None = None
