"""Read the store into :mod:`tuner.exporters.values` snapshots, and advance the counters incrementally.

Every table a counter is built from is read by id after a cursor held here (decisions, engine configs,
events, alert deliveries), so one refresh costs the new rows only. The first refresh counts the history
the store still holds.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import Table, select

from collectors.records import EngineKey
from policies.fleet import FleetSettings
from policies.length_bands import LengthView
from tuner.controller.evidence import summarize
from tuner.exporters.values import (
    HEALTH_KINDS,
    UP_KINDS,
    CounterTotals,
    EngineLabels,
    EngineSnapshot,
    FleetSnapshot,
    Sample,
    engine_samples,
    fleet_samples,
)
from tuner.fleet import read_fleet
from tuner.store import Store
from tuner.store import deliveries as D
from tuner.store.lengths import context_length_view
from tuner.store.models import DecisionRow, EngineConfigRow, EventRow

_decisions_t = cast(Table, DecisionRow.__table__)
_configs_t = cast(Table, EngineConfigRow.__table__)
_events_t = cast(Table, EventRow.__table__)
_BATCH = 5000


@dataclass
class _Cursors:
    decisions: int = 0
    configs: int = 0
    events: int = 0
    deliveries: int = 0
    last_config: dict[int, tuple[str, str | None]] = field(default_factory=dict)  # engine id → (method, draft)


class StoreSource:
    """Values of the engine series at ``metrics_url`` (all engines when None) from ``store``."""

    def __init__(
        self,
        store: Store,
        *,
        metrics_url: str | None = None,
        model_name: str | None = None,
        window_s: float = 120.0,
        cost_ratio: float = 0.05,
        confidence: float = 0.95,
        length_window_s: float = 3600.0,
        length_refresh_s: float = 60.0,
        fleet: bool = False,
        fleet_window_s: float = 300.0,
        fleet_refresh_s: float = 60.0,
    ) -> None:
        self.store = store
        self.metrics_url = metrics_url
        self.model_name = model_name
        self.window_s = window_s
        self.cost_ratio = cost_ratio
        self.confidence = confidence
        self.length_window_s = length_window_s
        self.length_refresh_s = length_refresh_s
        self._length_cache: dict[str, tuple[datetime, LengthView | None]] = {}
        self.fleet = fleet
        self.fleet_window_s = fleet_window_s
        self.fleet_refresh_s = fleet_refresh_s
        self._fleet_cache: tuple[datetime, FleetSnapshot] | None = None
        self.totals = CounterTotals()
        self._cur = _Cursors()

    def engines(self) -> list[tuple[int, EngineKey]]:
        return sorted(
            (
                (e.id, e.key)
                for e in self.store.engines()
                if (self.metrics_url is None or e.key.url == self.metrics_url)
                and (self.model_name is None or e.key.model_name == self.model_name)
            ),
            key=lambda p: (p[1].url, p[1].model_name, p[1].engine),
        )

    # -- gauges ----------------------------------------------------------------------------------
    def snapshot(
        self,
        engine_id: int,
        key: EngineKey,
        server_ids: Sequence[int],
        now: datetime,
        server: tuple[tuple[float | None, float | None], bool] | None = None,
    ) -> EngineSnapshot:
        """``server``: the server-level (last verified gains, up) when already read for this refresh."""
        stored = self.store.current_config(key)
        config = None
        started = None
        if stored is not None:
            c = stored.config
            config = c.spec
            started = c.started_at
        since = now - timedelta(seconds=self.window_s)
        windows = [
            w
            for w in self.store.windows(key, since, now + timedelta(microseconds=1))
            if started is None or w.start >= started
        ]
        summed, duration_s, tokens, _, _ = summarize(windows)
        window_specs = tuple(w.spec for w in windows if w.spec is not None)
        latest = self.store.latest_window(key)
        (predicted, realized), up = server if server is not None else self.server_state(server_ids)
        lengths = self._lengths(key.model_name, now)
        return EngineSnapshot(
            key=key,
            now=now,
            config=config,
            spec=summed if window_specs else None,
            window_specs=window_specs,
            duration_s=duration_s,
            generation_tokens=tokens,
            last_window_end=latest.end if latest is not None else None,
            up=up,
            predicted_speedup=predicted,
            realized_speedup=realized,
            lengths=lengths,
        )

    def _lengths(self, model_name: str, now: datetime) -> LengthView | None:
        """α by context length over the last ``length_window_s`` (an hour: bands need many requests), read
        at most once per ``length_refresh_s`` per model (each read scans that hour of request records)."""
        cached = self._length_cache.get(model_name)
        if cached is not None and (now - cached[0]).total_seconds() < self.length_refresh_s:
            return cached[1]
        since = now - timedelta(seconds=self.length_window_s)
        view = context_length_view(
            self.store, model_name, since, now + timedelta(microseconds=1), confidence=self.confidence
        )
        result = view if view.bands and any(b.requests for b in view.bands) else None
        self._length_cache[model_name] = (now, result)
        return result

    def fleet_snapshot(self, now: datetime) -> FleetSnapshot:
        """Every engine of the database grouped (not only this sidecar's), over the last ``fleet_window_s``,
        read at most once per ``fleet_refresh_s`` (each read scans every engine's windows)."""
        cached = self._fleet_cache
        if cached is not None and (now - cached[0]).total_seconds() < self.fleet_refresh_s:
            return cached[1]
        since, until = now - timedelta(seconds=self.fleet_window_s), now + timedelta(microseconds=1)
        fleet = read_fleet(self.store, since, until, FleetSettings(confidence=self.confidence))
        snap = FleetSnapshot(
            groups=fleet.groups,
            keys={name: e.key for name, e in fleet.engines.items()},
            pending={g.key: len(fleet.pending_of(g)) for g in fleet.groups},
        )
        self._fleet_cache = (now, snap)
        return snap

    def server_state(self, server_ids: Sequence[int]) -> tuple[tuple[float | None, float | None], bool]:
        """What holds for the whole server: the last verified change's gains, and whether it is up."""
        return self._last_verified(server_ids), self._engine_up(server_ids)

    def _last_verified(self, server_ids: Sequence[int]) -> tuple[float | None, float | None]:
        c = _decisions_t.c
        query = (
            select(c.predicted_gain, c.realized_gain)
            .where(c.realized_gain.is_not(None), c.engine_id.in_(list(server_ids)))
            .order_by(c.updated_at.desc(), c.id.desc())
            .limit(1)
        )
        with self.store.read_connection() as conn:
            row = conn.execute(query).one_or_none()
        return (None, None) if row is None else (row[0], row[1])

    def _engine_up(self, server_ids: Sequence[int]) -> bool:
        c = _events_t.c
        query = (
            select(c.kind)
            .where(c.kind.in_(sorted(HEALTH_KINDS)), c.engine_id.in_(list(server_ids)))
            .order_by(c.id.desc())
            .limit(1)
        )
        with self.store.read_connection() as conn:
            kind = conn.execute(query).scalar_one_or_none()
        return kind is None or kind in UP_KINDS

    # -- counters --------------------------------------------------------------------------------
    def advance_counters(self) -> None:
        """Count rows added since the last call. Rows of engines not shown here are passed over;
        rows without an engine (a manual pause, a collector error) count with empty labels or,
        for collector errors, on every engine series of their server."""
        shown = {eid: (key.engine, key.model_name) for eid, key in self.engines()}

        def labels(engine_id: int | None) -> EngineLabels | None:
            if engine_id is None:
                return ("", "")
            return shown.get(engine_id)

        dc, cc, ec = _decisions_t.c, _configs_t.c, _events_t.c
        for r in self._new_rows(_decisions_t, (dc.id, dc.engine_id, dc.action, dc.status, dc.reason), "decisions"):
            lab = labels(r.engine_id)
            if lab is not None:
                self.totals.add_decision(lab, r.action, r.status, r.reason)
        for r in self._new_rows(_configs_t, (cc.id, cc.engine_id, cc.method, cc.draft_model, cc.applied_by), "configs"):
            current = (str(r.method), r.draft_model)
            previous = self._cur.last_config.get(r.engine_id)
            self._cur.last_config[r.engine_id] = current
            lab = labels(r.engine_id)
            if lab is not None:
                self.totals.add_config(lab, previous, current, str(r.applied_by))
        for r in self._new_rows(_events_t, (ec.id, ec.engine_id, ec.kind, ec.data), "events"):
            lab = labels(r.engine_id)
            if lab is not None:
                self.totals.add_event(lab, r.kind, dict(r.data or {}))
        top, counts = D.delivery_counts(self.store, self._cur.deliveries)
        for engine_id, sink, outcome, n in counts:
            lab = labels(engine_id)
            if lab is not None:
                self.totals.add_deliveries(lab, sink, outcome, n)
        self._cur.deliveries = top

    def _new_rows(self, table: Table, columns: Sequence[Any], cursor: str) -> Iterator[Any]:
        """Rows of ``table`` after the named cursor, in id order, in batches; moves the cursor."""
        id_col = table.c.id
        while True:
            with self.store.read_connection() as conn:
                rows = list(
                    conn.execute(
                        select(*columns).where(id_col > getattr(self._cur, cursor)).order_by(id_col).limit(_BATCH)
                    )
                )
            for r in rows:
                yield r
                setattr(self._cur, cursor, r.id)
            if len(rows) < _BATCH:
                return


    # -- everything ------------------------------------------------------------------------------
    def samples(self, now: datetime) -> list[Sample]:
        """All samples at ``now``: gauges of every engine series shown, then the counters."""
        engines = self.engines()
        by_url: dict[str, list[int]] = {}
        for eid, key in engines:
            by_url.setdefault(key.url, []).append(eid)
        servers = {url: self.server_state(ids) for url, ids in by_url.items()}
        out: list[Sample] = []
        for eid, key in engines:
            snap = self.snapshot(eid, key, by_url[key.url], now, servers[key.url])
            out.extend(engine_samples(snap, cost_ratio=self.cost_ratio, confidence=self.confidence))
        if self.fleet:
            out.extend(fleet_samples(self.fleet_snapshot(now)))
        self.advance_counters()
        out.extend(self.totals.samples([key for _, key in engines]))
        return out
