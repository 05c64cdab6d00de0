"""Build the controller's frozen snapshot of evidence from the store (the only store reads a decision needs).

Evidence is the windows of the engine series under the config now in force, ending in the last
``evidence_window_s`` and starting after the config did (a window that spans a restart mixes two
configs and is left out).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from collectors.records import EngineKey, WindowRecord
from policies.counters import SpecCounters
from tuner.store import Store, StoredConfig


@dataclass(frozen=True)
class Evidence:
    """What was measured under the current config. Rates are generated tokens per second."""

    now: datetime
    keys: tuple[EngineKey, ...]
    config: StoredConfig
    spec: SpecCounters
    windows: int
    duration_s: float
    generation_tokens: float
    window_rates: tuple[float, ...]  # generated tokens / s, one per window (for the noise of a comparison)
    mean_batch_size: float | None  # mean requests running

    @property
    def goodput_tokens_per_s(self) -> float | None:
        return self.generation_tokens / self.duration_s if self.duration_s > 0 else None

    def to_inputs(self) -> dict[str, Any]:
        """The audit row's ``inputs``: enough to re-derive the decision."""
        return {
            "config_id": self.config.id,
            "current_config": spec_config_of(self.config),
            "drafts": self.spec.drafts,
            "draft_tokens": self.spec.draft_tokens,
            "accepted_tokens": self.spec.accepted_tokens,
            "accepted_per_pos": list(self.spec.accepted_per_pos),
            "windows": self.windows,
            "duration_s": self.duration_s,
            "goodput_tokens_per_s": self.goodput_tokens_per_s,
            "window_rates": list(self.window_rates),
            "mean_batch_size": self.mean_batch_size,
        }


def spec_config_of(stored: StoredConfig) -> dict[str, Any]:
    """The full ``--speculative-config`` of a stored config (rebuilt from columns when not stored)."""
    cfg = stored.config
    if cfg.spec_config is not None:
        return dict(cfg.spec_config)
    out: dict[str, Any] = {"method": cfg.method}
    if cfg.draft_model:
        out["model"] = cfg.draft_model
    if cfg.num_spec_tokens is not None:
        out["num_speculative_tokens"] = cfg.num_spec_tokens
    if cfg.k_table:
        out["num_speculative_tokens_per_batch_size"] = [list(r) for r in cfg.k_table]
    return out


def windows_under(
    store: Store, keys: Sequence[EngineKey], started_at: datetime, since: datetime, until: datetime
) -> list[WindowRecord]:
    """Windows of ``keys`` ending in [since, until) that began at or after ``started_at``."""
    out: list[WindowRecord] = []
    for key in keys:
        out.extend(w for w in store.windows(key, since, until) if w.start >= started_at)
    return out


def summarize(windows: Sequence[WindowRecord]) -> tuple[SpecCounters, float, float, tuple[float, ...], float | None]:
    """Summed spec counters, duration (s, per engine series summed), generated tokens, per-window
    rates and mean requests running."""
    spec = SpecCounters()
    duration_s = 0.0
    tokens = 0.0
    rates: list[float] = []
    running: list[float] = []
    for w in windows:
        if w.spec is not None:
            spec = spec + w.spec
        d = w.duration_s
        if d > 0:
            duration_s += d
            tokens += w.generation_tokens
            rates.append(w.generation_tokens / d)
        if w.requests_running is not None and math.isfinite(w.requests_running):
            running.append(w.requests_running)
    mean_running = sum(running) / len(running) if running else None
    return spec, duration_s, tokens, tuple(rates), mean_running


def gather_evidence(
    store: Store, keys: Sequence[EngineKey], config: StoredConfig, now: datetime, evidence_window_s: float
) -> Evidence:
    since = max(now - timedelta(seconds=evidence_window_s), config.config.started_at)
    wins = windows_under(store, keys, config.config.started_at, since, now + timedelta(microseconds=1))
    spec, duration_s, tokens, rates, running = summarize(wins)
    return Evidence(now, tuple(keys), config, spec, len(wins), duration_s, tokens, rates, running)
