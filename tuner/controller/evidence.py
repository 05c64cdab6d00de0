"""Store reads behind a decision context (:mod:`tuner.controller.context`): windows under a config,
their sums, the load over a horizon, the swap trigger's windows and each candidate's measured α."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import numpy as np

from collectors.records import EngineKey, WindowRecord
from policies.acceptance import AcceptanceEvidence, effective_counters, evidence_from_counters
from policies.counters import SpecCounters
from policies.draft_choice import DraftCandidate, SpecWindow
from policies.last_regime import evidence_array, last_regime_of_arrays
from policies.spec_config import SpecConfig
from tuner.store import Store, StoredConfig


def windows_under(
    store: Store, keys: Sequence[EngineKey], started_at: datetime, since: datetime, until: datetime
) -> list[WindowRecord]:
    """Windows of ``keys`` ending in [since, until) that began at or after ``started_at``."""
    out: list[WindowRecord] = []
    for key in keys:
        out.extend(w for w in store.windows(key, since, until) if w.start >= started_at)
    return out


def runs_same_draft(a: SpecConfig, b: SpecConfig) -> bool:
    """Whether two speculative configs run one draft (method, model and every other key alike), whatever
    their K or K table: a draft model proposes the same tokens at every K, so its acceptance at each
    position is the draft's and the traffic's, not the K's."""
    return a.speculates and b.speculates and a.draft == b.draft and dict(a.extra) == dict(b.extra)


def earlier_windows_of_draft(
    store: Store, keys: Sequence[EngineKey], stored: StoredConfig, since: datetime
) -> tuple[list[WindowRecord], int]:
    """Windows ending in [``since``, the start of ``stored``) under each key's earlier configs that ran the
    same draft as ``stored`` at another K or table (a live table change or a restart), each window wholly
    inside its config; and how many such configs gave windows."""
    current, started = stored.config.spec, stored.config.started_at
    if since >= started or not current.speculates:
        return [], 0
    out: list[WindowRecord] = []
    configs = 0
    for key in keys:
        for cfg in store.configs_in_force(key, since, started):
            begun = cfg.config.started_at
            if cfg.id == stored.id or begun >= started or not runs_same_draft(cfg.config.spec, current):
                continue
            end = min(cfg.config.ended_at or started, started)
            # a window ending exactly at the change is wholly the earlier config's
            found = [w for w in store.windows(key, since, end + timedelta(microseconds=1)) if w.start >= begun]
            out.extend(found)
            configs += bool(found)
    return out, configs


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


def window_batches(windows: Sequence[WindowRecord]) -> tuple[float | None, ...]:
    """Requests running per window, aligned with :func:`summarize`'s rates (None where not scraped)."""
    return tuple(
        float(w.requests_running) if w.requests_running is not None and math.isfinite(w.requests_running) else None
        for w in windows
        if w.duration_s > 0
    )


class LoadProfile:
    """(duration s, requests running + waiting) of the engine's windows over the last ``horizon_s``, under
    any config: the load one K must serve (the demand; a config's memory cap decides how much of it runs).
    Kept between ticks and topped up with the windows that arrived since (re-reading a minute of overlap,
    so a window stored late is not missed)."""

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

    def since(self, start: datetime) -> tuple[tuple[float, float], ...]:
        """The samples of the last :meth:`update` whose windows ended after ``start``."""
        return tuple(v for (_, end), v in self._samples.items() if end > start)

    def mean_since(self, start: datetime) -> float | None:
        """Time-weighted mean requests running + waiting of the windows that ended after ``start``."""
        samples = self.since(start)
        seconds = sum(d for d, _ in samples)
        return sum(d * b for d, b in samples) / seconds if seconds > 0 else None


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


@dataclass(frozen=True)
class PeriodEvidence:
    """α evidence of some windows: rows (successes, failures, drafts), one per window in time order."""

    rows: np.ndarray = field(default_factory=lambda: np.zeros((0, 3)))

    def __add__(self, other: PeriodEvidence) -> PeriodEvidence:
        return PeriodEvidence(np.concatenate((self.rows, other.rows)))

    @property
    def trials(self) -> float:
        return float(self.rows[:, 0].sum() + self.rows[:, 1].sum())


@dataclass
class HistoryCache:
    """What :func:`measured_history` has read: the α evidence of config periods that ended (they never
    change), and of the period still running up to ``SETTLE_S`` before the last read (windows can land
    a little late: the batch writer flushes every second, a scrape can take seconds)."""

    SETTLE_S = 120.0

    ended: dict[int, PeriodEvidence] = field(default_factory=dict)
    running: dict[int, tuple[PeriodEvidence, datetime]] = field(default_factory=dict)  # → (sum, read up to)


def measured_history(
    store: Store,
    keys: Sequence[EngineKey],
    now: datetime,
    horizon_s: float,
    candidates: Sequence[DraftCandidate],
    matches: Callable[[SpecConfig, DraftCandidate], bool],
    cache: HistoryCache | None = None,
) -> dict[str, AcceptanceEvidence]:
    """α evidence each candidate earned on this engine under earlier configs (within ``horizon_s``): its
    windows since its acceptance last changed (``policies.last_regime``), divided by their φ.

    A draft's acceptance moves with the traffic; a week of windows pooled as independent tokens makes a
    draft that was good for hours and then fell look precisely good (α̂ 0.72 ± 0.005 from 100 k drafts
    when it accepted 0.3 as it left), and ranking it on that swaps straight back to it. With a
    ``cache``, each tick reads only the windows of the running period that ended since the last read
    (less ``HistoryCache.SETTLE_S``), not a week of windows per candidate.
    """
    pooled: dict[str, PeriodEvidence] = {}
    if not keys:
        return {}
    since = now - timedelta(seconds=horizon_s)
    # every period in force within the horizon, also one that started before it (a config that ran for
    # weeks), read from the horizon's start
    for stored in store.configs_in_force(keys[0], since, now):
        spec = stored.config.spec
        owners = [c for c in candidates if matches(spec, c)]
        if not owners:
            continue
        total = _cached_period_evidence(store, keys, stored, now, cache, since)
        if total.trials == 0:
            continue
        for c in owners:
            pooled[c.name] = pooled[c.name] + total if c.name in pooled else total
    return {name: last_regime_of_arrays(p.rows).evidence for name, p in pooled.items()}


def evidence_before_end(
    store: Store, keys: Sequence[EngineKey], stored: StoredConfig, seconds: float
) -> AcceptanceEvidence:
    """α evidence of the last ``seconds`` of an ended config period (how it was doing when it left)."""
    end = stored.config.ended_at
    if end is None:
        return AcceptanceEvidence()
    total = _period_evidence(store, keys, stored, end - timedelta(seconds=seconds), end).rows.sum(axis=0)
    return AcceptanceEvidence(float(total[0]), float(total[1]), float(total[2]))


def _cached_period_evidence(
    store: Store,
    keys: Sequence[EngineKey],
    stored: StoredConfig,
    now: datetime,
    cache: HistoryCache | None,
    since: datetime | None = None,
) -> PeriodEvidence:
    """The period's α evidence from its start, or from ``since`` when it started earlier."""
    start = stored.config.started_at if since is None else max(stored.config.started_at, since)
    if cache is None:
        return _period_evidence(store, keys, stored, start, stored.config.ended_at or now)
    if stored.id in cache.ended:
        return cache.ended[stored.id]
    if stored.config.ended_at is not None:
        cache.running.pop(stored.id, None)
        total = _period_evidence(store, keys, stored, start, stored.config.ended_at)
        cache.ended[stored.id] = total
        return total
    settled, read_until = cache.running.get(stored.id, (PeriodEvidence(), start))
    settle_until = max(read_until, now - timedelta(seconds=HistoryCache.SETTLE_S))
    settled = settled + _period_evidence(store, keys, stored, read_until, settle_until)
    cache.running[stored.id] = (settled, settle_until)
    return settled + _period_evidence(store, keys, stored, settle_until, now)


def _period_evidence(
    store: Store, keys: Sequence[EngineKey], stored: StoredConfig, since: datetime, until: datetime
) -> PeriodEvidence:
    """α evidence of the windows of ``stored``'s period that ended in [since, until)."""
    out: list[AcceptanceEvidence] = []
    if until <= since or until < stored.config.started_at:
        return PeriodEvidence()
    for w in windows_under(store, keys, stored.config.started_at, since, until):
        counters = effective_counters(w.spec) if w.spec is not None else None
        if counters is None or counters.drafts == 0:
            continue
        result = evidence_from_counters(counters)
        if result.evidence is not None:
            out.append(result.evidence)
    return PeriodEvidence(evidence_array(out))
