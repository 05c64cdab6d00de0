"""Build the controller's frozen snapshot of evidence from the store (the only store reads a decision needs).

Evidence is the windows of the engine series under the config now in force, ending in the last
``evidence_window_s`` and starting after the config did (a window that spans a restart mixes two
configs and is left out).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from collectors.records import EngineKey, WindowRecord
from policies.acceptance import AcceptanceEvidence, evidence_from_counters
from policies.counters import SpecCounters
from policies.draft_choice import DraftCandidate, SpecWindow
from policies.step_cost import StepCostModel
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
    # (duration s, requests running) per window: the load profile a per-batch-size table is judged on
    batch_profile: tuple[tuple[float, float], ...] = ()
    # Each window's counters at its effective K (see effective_counters): α is pooled over these
    window_specs: tuple[SpecCounters, ...] = ()
    # For the draft-swap policy (filled by the controller when candidates are configured):
    trigger_windows: tuple[SpecWindow, ...] = ()  # the current config's windows over the swap duration
    candidates: tuple[DraftCandidate, ...] = ()
    history: Mapping[str, AcceptanceEvidence] = field(default_factory=dict)  # candidate name → measured α
    failed_configs: tuple[dict[str, Any], ...] = ()  # configs that failed to apply lately (not proposed again)
    # T(B, K) fitted from the plugin's per-step records (tuner.controller.step_cost); None: not enough steps
    step_cost: StepCostModel | None = None
    step_cost_note: str | None = None
    step_cost_source: str = "fitted"  # "fitted", "pinned" or either "+ measured cells"
    # (duration s, requests running) per window over the controller's load horizon, under any config:
    # the load one K must serve (empty: judge K at the mean batch of the evidence window)
    load_profile: tuple[tuple[float, float], ...] = ()
    window_batches: tuple[float | None, ...] = ()  # requests running per window, aligned with window_rates

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
            "window_batches": list(self.window_batches),
            "mean_batch_size": self.mean_batch_size,
            "step_cost": (
                {"source": self.step_cost_source, "model": self.step_cost.to_dict(), "message": self.step_cost_note}
                if self.step_cost is not None
                else None
            ),
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


def effective_counters(spec: SpecCounters) -> SpecCounters | None:
    """The counters at the K the engine actually drafted in the window.

    Under a per-batch-size table the engine starts at K_max but drafts fewer tokens per step, so the
    positions past the step's K stay zero and α̂ = A / (A + D − a_{K−1}) read at K_max would count every
    draft as rejected. When T / D is a whole number k, every step drafted k tokens: the counters are cut
    to k positions. A window mixing several K (T / D not whole) cannot be split from /metrics: None
    (its tokens still count for throughput; the plugin's per-step records have the exact K).
    """
    if spec.drafts <= 0:
        return spec
    k_eff = spec.draft_tokens / spec.drafts
    k = round(k_eff)
    if abs(k_eff - k) > 1e-9:
        return None
    if k >= len(spec.accepted_per_pos) or k < 1:
        return spec
    if any(spec.accepted_per_pos[k:]):  # a draft longer than k was accepted: the steps mixed several K
        return None
    return replace(spec, accepted_per_pos=spec.accepted_per_pos[:k], num_spec_tokens=k)


def pooled_alpha(windows: Sequence[SpecCounters]) -> AcceptanceEvidence | None:
    """α evidence pooled window by window (each at its own K); None if a window is unusable."""
    total = AcceptanceEvidence()
    for spec in windows:
        if spec.drafts == 0:
            continue
        result = evidence_from_counters(spec)
        if result.evidence is None:
            return None
        total = total + result.evidence
    return total


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
    # min(…, now): a config recorded a moment after ``now`` (a rollback that just finished) has no windows yet
    since = min(max(now - timedelta(seconds=evidence_window_s), config.config.started_at), now)
    wins = windows_under(store, keys, config.config.started_at, since, now + timedelta(microseconds=1))
    spec, duration_s, tokens, rates, running = summarize(wins)
    profile = tuple(
        (w.duration_s, float(w.requests_running))
        for w in wins
        if w.duration_s > 0 and w.requests_running is not None and math.isfinite(w.requests_running)
    )
    specs = tuple(e for e in (effective_counters(w.spec) for w in wins if w.spec is not None) if e is not None)
    return Evidence(
        now,
        tuple(keys),
        config,
        spec,
        len(wins),
        duration_s,
        tokens,
        rates,
        running,
        profile,
        specs,
        window_batches=window_batches(wins),
    )


def window_batches(windows: Sequence[WindowRecord]) -> tuple[float | None, ...]:
    """Requests running per window, aligned with :func:`summarize`'s rates (None where not scraped)."""
    return tuple(
        float(w.requests_running)
        if w.requests_running is not None and math.isfinite(w.requests_running)
        else None
        for w in windows
        if w.duration_s > 0
    )


class LoadProfile:
    """(duration s, requests running) of the engine's windows over the last ``horizon_s``, under any
    config: the load one K must serve. Kept between ticks and topped up with the windows that arrived
    since (re-reading a minute of overlap, so a window stored late is not missed)."""

    _OVERLAP = timedelta(seconds=60)

    def __init__(self) -> None:
        self._samples: dict[tuple[EngineKey, datetime], tuple[float, float]] = {}
        self._read_until: datetime | None = None
        self._keys: tuple[EngineKey, ...] = ()

    def update(
        self, store: Store, keys: Sequence[EngineKey], now: datetime, horizon_s: float
    ) -> tuple[tuple[float, float], ...]:
        since = now - timedelta(seconds=horizon_s)
        if tuple(keys) != self._keys or self._read_until is None or self._read_until > now:
            self._samples.clear()
            self._keys = tuple(keys)
            read_from = since
        else:
            read_from = max(since, self._read_until - self._OVERLAP)
        until = now + timedelta(microseconds=1)
        for key in keys:
            for end, d, b in store.load_samples(key, read_from, until):
                if d > 0 and math.isfinite(b):
                    self._samples[(key, end)] = (d, b)
        self._read_until = now
        for k in [k for k in self._samples if k[1] < since]:
            del self._samples[k]
        return tuple(self._samples.values())


def spec_windows(
    store: Store, keys: Sequence[EngineKey], config: StoredConfig, now: datetime, duration_s: float
) -> tuple[SpecWindow, ...]:
    """The current config's windows over the swap trigger's duration, data-parallel ranks merged per
    scrape (they share a scrape time), for :func:`policies.draft_choice.check_trigger`."""
    since = min(max(now - timedelta(seconds=duration_s), config.config.started_at), now)
    merged: dict[tuple[datetime, datetime], SpecCounters] = {}
    for w in windows_under(store, keys, config.config.started_at, since, now + timedelta(microseconds=1)):
        spec = effective_counters(w.spec) if w.spec is not None else None
        if spec is None:
            continue
        span = (w.start, w.end)
        merged[span] = merged[span] + spec if span in merged else spec
    return tuple(SpecWindow(s, e, c) for (s, e), c in sorted(merged.items(), key=lambda kv: kv[0][1]))


@dataclass
class HistoryCache:
    """What :func:`measured_history` has read: the α evidence of config periods that ended (they never
    change), and of the period still running up to ``SETTLE_S`` before the last read (windows can land
    a little late: the batch writer flushes every second, a scrape can take seconds)."""

    SETTLE_S = 120.0

    ended: dict[int, AcceptanceEvidence] = field(default_factory=dict)
    running: dict[int, tuple[AcceptanceEvidence, datetime]] = field(default_factory=dict)  # → (sum, read up to)


def measured_history(
    store: Store,
    keys: Sequence[EngineKey],
    now: datetime,
    horizon_s: float,
    candidates: Sequence[DraftCandidate],
    matches: Callable[[dict[str, Any], DraftCandidate], bool],
    cache: HistoryCache | None = None,
) -> dict[str, AcceptanceEvidence]:
    """α evidence each candidate earned on this engine under earlier configs (within ``horizon_s``).

    With a ``cache``, each tick reads only the windows of the running period that ended since the
    last read (less ``HistoryCache.SETTLE_S``), not a week of windows per candidate.
    """
    out: dict[str, AcceptanceEvidence] = {}
    if not keys:
        return out
    since = now - timedelta(seconds=horizon_s)
    for stored in store.configs(keys[0], since=since, until=now + timedelta(microseconds=1)):
        spec = spec_config_of(stored)
        owners = [c for c in candidates if matches(spec, c)]
        if not owners:
            continue
        total = _cached_period_evidence(store, keys, stored, now, cache)
        if total.trials == 0:
            continue
        for c in owners:
            out[c.name] = out[c.name] + total if c.name in out else total
    return out


def _cached_period_evidence(
    store: Store, keys: Sequence[EngineKey], stored: StoredConfig, now: datetime, cache: HistoryCache | None
) -> AcceptanceEvidence:
    if cache is None:
        return _period_evidence(store, keys, stored, stored.config.started_at, stored.config.ended_at or now)
    if stored.id in cache.ended:
        return cache.ended[stored.id]
    if stored.config.ended_at is not None:
        cache.running.pop(stored.id, None)
        total = _period_evidence(store, keys, stored, stored.config.started_at, stored.config.ended_at)
        cache.ended[stored.id] = total
        return total
    settled, read_until = cache.running.get(stored.id, (AcceptanceEvidence(), stored.config.started_at))
    settle_until = max(read_until, now - timedelta(seconds=HistoryCache.SETTLE_S))
    settled = settled + _period_evidence(store, keys, stored, read_until, settle_until)
    cache.running[stored.id] = (settled, settle_until)
    return settled + _period_evidence(store, keys, stored, settle_until, now)


def _period_evidence(
    store: Store, keys: Sequence[EngineKey], stored: StoredConfig, since: datetime, until: datetime
) -> AcceptanceEvidence:
    """α evidence of the windows of ``stored``'s period that ended in [since, until)."""
    total = AcceptanceEvidence()
    if until <= since or until < stored.config.started_at:
        return total
    for w in windows_under(store, keys, stored.config.started_at, since, until):
        counters = effective_counters(w.spec) if w.spec is not None else None
        if counters is None or counters.drafts == 0:
            continue
        result = evidence_from_counters(counters)
        if result.evidence is not None:
            total = total + result.evidence
    return total
