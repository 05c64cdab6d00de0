"""The store: records in, snapshots out. Implements ``collectors.records.RecordSink``.

Each write call is one transaction with one batched insert (windows and events: a Core
``insert()`` executemany; the high-volume requests and steps: ``tuner.store.ingest``), so a
collector's batch either lands whole or not at all. Reads return the same record types the
collectors write, so a round trip is an equality. Time ranges are half-open ``[since, until)``;
windows are placed by their end time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from types import TracebackType
from typing import Any, cast

from sqlalchemy import Connection, Engine, Table, and_, case, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite

from collectors.records import EngineKey, EngineSample, EventRecord, RequestRecord, StepRecord, WindowRecord
from policies.counters import SpecCounters
from tuner.store import rows as R
from tuner.store.connect import WRITE_OPTION, make_engine
from tuner.store.ingest import (
    REQUEST_COLUMNS,
    STEP_COLUMNS,
    FastInsert,
    request_values,
    step_values,
)
from tuner.store.models import (
    CollectorBaselineRow,
    DecisionRow,
    EngineConfigRow,
    EngineRow,
    EventRow,
    RequestRow,
    ScrapeWindowRow,
    StepRow,
    WindowRollupRow,
)
from tuner.store.records import (
    DecisionRecord,
    EngineConfigRecord,
    RollupRecord,
    StoredConfig,
    StoredDecision,
    StoredEngine,
    WindowTotals,
)
from tuner.store.schema import check_schema as _check_schema
from tuner.store.url import normalize_db_url, render_url

engines_t = cast(Table, EngineRow.__table__)
configs_t = cast(Table, EngineConfigRow.__table__)
windows_t = cast(Table, ScrapeWindowRow.__table__)
rollups_t = cast(Table, WindowRollupRow.__table__)
requests_t = cast(Table, RequestRow.__table__)
steps_t = cast(Table, StepRow.__table__)
decisions_t = cast(Table, DecisionRow.__table__)
events_t = cast(Table, EventRow.__table__)
baselines_t = cast(Table, CollectorBaselineRow.__table__)


class UnknownRecordError(LookupError):
    """An id (decision, config) that is not in the database."""


class Store:
    """Spectuner's time-series store on one database URL.

    ``check_schema`` (default on) refuses a database whose schema is missing, older or newer than
    this code, with the command that fixes it. The engine-id cache only learns ids after their
    transaction commits, so a rolled-back batch cannot leave a dangling id behind.
    """

    def __init__(self, url: str, *, check_schema: bool = True, echo: bool = False, read_only: bool = False) -> None:
        self.url = normalize_db_url(url)
        if check_schema:
            # before creating the engine: never create an empty SQLite file
            _check_schema(self.url, read_only=read_only)
        # read_only: for commands that only read (status, history, report), a SQLite file in a
        # read-only directory is opened without writing (tuner.store.connect.make_engine).
        self.engine: Engine = make_engine(self.url, echo=echo, read_only=read_only)
        self._writer = self.engine.execution_options(**{WRITE_OPTION: True})
        self._engine_ids: dict[EngineKey, int] = {}
        self._engine_keys: dict[int, EngineKey] = {}
        self._fast_steps = FastInsert(steps_t, STEP_COLUMNS, self.dialect)
        self._fast_requests = FastInsert(requests_t, REQUEST_COLUMNS, self.dialect)
        # Bumped after every write to engine_configs through this object: in-process caches of config
        # answers (tuner.store.tagging) compare it to drop what a write may have changed.
        self._config_generation = 0
        self._config_generation_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Store({render_url(self.url)!r})"

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- transactions (also used by tuner.store.retention) --------------------------------------

    @contextmanager
    def write_transaction(self) -> Iterator[Connection]:
        """One write transaction (SQLite: ``BEGIN IMMEDIATE``). Engine ids learnt inside it are
        cached only if it commits."""
        pending: dict[EngineKey, int] = {}
        with self._writer.begin() as conn:
            conn.info["spectuner_pending_ids"] = pending
            yield conn
        self._remember(pending)

    @contextmanager
    def read_connection(self) -> Iterator[Connection]:
        with self.engine.connect() as conn:
            yield conn

    def _remember(self, ids: dict[EngineKey, int]) -> None:
        for key, engine_id in ids.items():
            self._engine_ids[key] = engine_id
            self._engine_keys[engine_id] = key

    # --- engines --------------------------------------------------------------------------------

    def _insert_ignore(self, table: Any) -> Any:
        dialect = postgresql if self.dialect == "postgresql" else sqlite
        return dialect.insert(table).on_conflict_do_nothing()

    def _resolve_ids(self, conn: Connection, keys: set[EngineKey], now: datetime) -> dict[EngineKey, int]:
        """Ids for ``keys``, inserting engines not seen before (safe against concurrent writers)."""
        ids = {key: self._engine_ids[key] for key in keys if key in self._engine_ids}
        missing = [R.check_key(key) for key in keys if key not in ids]
        if missing:
            conn.execute(
                self._insert_ignore(engines_t),
                [
                    {"url": k.url, "model_name": k.model_name, "engine_index": k.engine, "first_seen_at": now}
                    for k in missing
                ],
            )
            for key in missing:
                ids[key] = conn.execute(
                    select(engines_t.c.id).where(
                        engines_t.c.url == key.url,
                        engines_t.c.model_name == key.model_name,
                        engines_t.c.engine_index == key.engine,
                    )
                ).scalar_one()
            conn.info["spectuner_pending_ids"].update({k: ids[k] for k in missing})
        return ids

    def upsert_engine(self, key: EngineKey, *, seen_at: datetime, cache_config: dict[str, str] | None = None) -> int:
        """The engine's id, creating the row if needed; ``cache_config`` (``vllm:cache_config_info``
        labels) replaces the stored one when given."""
        R.check_fields("upsert_engine", seen_at=(seen_at, "when"))
        checked = None
        if cache_config is not None:
            checked = R.check_single("cache_config", R.check_json, dict(cache_config), "cache_config")
        with self.write_transaction() as conn:
            engine_id = self._resolve_ids(conn, {R.check_key(key)}, seen_at)[key]
            if checked is not None:
                conn.execute(update(engines_t).where(engines_t.c.id == engine_id).values(cache_config=checked))
        return engine_id

    def engine_id(self, key: EngineKey) -> int | None:
        """The id of a known engine, or ``None`` (never creates one)."""
        if key in self._engine_ids:
            return self._engine_ids[key]
        with self.read_connection() as conn:
            found = conn.execute(
                select(engines_t.c.id).where(
                    engines_t.c.url == key.url,
                    engines_t.c.model_name == key.model_name,
                    engines_t.c.engine_index == key.engine,
                )
            ).scalar_one_or_none()
        if found is not None:
            self._remember({key: found})
        return found

    def engines(self) -> list[StoredEngine]:
        """Every engine, in id order."""
        with self.read_connection() as conn:
            result = conn.execute(select(engines_t).order_by(engines_t.c.id)).all()
        out = []
        for row in result:
            key = EngineKey(url=row.url, model_name=row.model_name, engine=row.engine_index)
            self._remember({key: row.id})
            out.append(StoredEngine(row.id, key, row.cache_config))
        return out

    def _key_for(self, conn: Connection, engine_id: int | None) -> EngineKey | None:
        if engine_id is None:
            return None
        if engine_id not in self._engine_keys:
            row = conn.execute(select(engines_t).where(engines_t.c.id == engine_id)).one()
            self._remember({EngineKey(row.url, row.model_name, row.engine_index): row.id})
        return self._engine_keys[engine_id]

    # --- RecordSink -----------------------------------------------------------------------------

    def _write(
        self,
        kind: str,
        table: Any,
        records: Sequence[Any],
        convert: Callable[[Any, dict[EngineKey, int]], dict[str, Any]],
        key_of: Callable[[Any], EngineKey | None],
        now_of: Callable[[Any], datetime],
    ) -> None:
        """Low-volume tables (windows, events): Core ``insert()`` executemany of validated dicts."""
        if not records:
            return
        # Validate everything before taking the write lock, with placeholder ids; a bad record
        # costs no lock and a bad batch writes nothing.
        keys = {key for key in map(key_of, records) if key is not None}
        for key in keys:
            R.check_key(key)
        rows = R.convert_batch(kind, records, convert, dict.fromkeys(keys, 0))
        with self.write_transaction() as conn:
            ids = self._resolve_ids(conn, keys, now_of(records[0])) if keys else {}
            for rec, row in zip(records, rows, strict=True):
                row_key = key_of(rec)
                row["engine_id"] = None if row_key is None else ids[row_key]
            conn.execute(insert(table), rows)

    def write_windows(self, records: Sequence[WindowRecord]) -> None:
        self._write("window", windows_t, records, R.window_row, lambda r: r.key, lambda r: r.end)

    def write_events(self, records: Sequence[EventRecord]) -> None:
        self._write("event", events_t, records, R.event_row, lambda r: r.engine, lambda r: r.ts)

    def write_scrape(
        self,
        windows: Sequence[WindowRecord],
        events: Sequence[EventRecord] = (),
        baselines: Sequence[EngineSample] = (),
    ) -> None:
        """One scrape's results in ONE transaction: its windows, the events they raised (counter
        resets) and, per engine, the cumulative sample the windows end at (the collector's
        baseline, read back by :meth:`baselines` after a restart). A window is never stored
        without its reset event, nor a baseline moved past a window that was not stored."""
        keys = {w.key for w in windows} | {e.engine for e in events if e.engine is not None}
        keys |= {b.key for b in baselines}
        for key in keys:
            R.check_key(key)
        placeholder = dict.fromkeys(keys, 0)
        window_rows = R.convert_batch("window", windows, R.window_row, placeholder)
        event_rows = R.convert_batch("event", events, R.event_row, placeholder)
        baseline_rows = R.convert_batch(
            "baseline",
            baselines,
            lambda b, _ids: {"ts": R.check_when(b.ts, "ts"), "sample": R.sample_json(b)},
            placeholder,
        )
        if not (window_rows or event_rows or baseline_rows):
            return
        # First-seen time for an engine that is new to the database.
        now = windows[0].end if windows else baselines[0].ts if baselines else events[0].ts
        with self.write_transaction() as conn:
            ids = self._resolve_ids(conn, keys, now) if keys else {}
            if window_rows:
                for rec, row in zip(windows, window_rows, strict=True):
                    row["engine_id"] = ids[rec.key]
                conn.execute(insert(windows_t), window_rows)
            if event_rows:
                for ev, row in zip(events, event_rows, strict=True):
                    row["engine_id"] = None if ev.engine is None else ids[ev.engine]
                conn.execute(insert(events_t), event_rows)
            if baseline_rows:
                for b, row in zip(baselines, baseline_rows, strict=True):
                    row["engine_id"] = ids[b.key]
                stmt = (postgresql if self.dialect == "postgresql" else sqlite).insert(baselines_t)
                conn.execute(
                    stmt.on_conflict_do_update(
                        index_elements=[baselines_t.c.engine_id],
                        set_={"ts": stmt.excluded.ts, "sample": stmt.excluded.sample},
                    ),
                    baseline_rows,
                )

    def baselines(self, url: str) -> list[EngineSample]:
        """The last stored cumulative sample of every engine scraped from ``url`` (see
        :meth:`write_scrape`), in engine id order. A row in a format this code cannot read is
        skipped (the collector then starts that engine from a fresh baseline)."""
        query = (
            select(
                engines_t.c.id, engines_t.c.model_name, engines_t.c.engine_index, baselines_t.c.ts, baselines_t.c.sample
            )
            .join(baselines_t, baselines_t.c.engine_id == engines_t.c.id)
            .where(engines_t.c.url == url)
            .order_by(engines_t.c.id)
        )
        out = []
        with self.read_connection() as conn:
            rows = conn.execute(query).all()
        for row in rows:
            key = EngineKey(url, row.model_name, row.engine_index)
            self._remember({key: row.id})
            try:
                out.append(R.sample_from_json(row.sample, key, row.ts))
            except (ValueError, KeyError, TypeError):
                continue
        return out

    def write_requests(self, records: Sequence[RequestRecord]) -> None:
        """Per-request rows from the tap: one transaction, one driver ``executemany``."""
        if not records:
            return
        fast = self._fast_requests
        values = _encode_batch("request", records, lambda rec: request_values(rec, fast.ts))
        with self.write_transaction() as conn:
            fast.execute(conn, values)

    def write_steps(self, records: Sequence[StepRecord]) -> None:
        """Per-step rows from the in-engine plugin: one transaction, one driver ``executemany``."""
        if not records:
            return
        fast = self._fast_steps
        cached = self._engine_ids
        # Unknown engines get id 0 here and the real id inside the transaction.
        values = _encode_batch("step", records, lambda rec: step_values(rec, cached.get(rec.key, 0), fast.ts))
        unknown = {rec.key for rec in records if rec.key not in cached}
        for key in unknown:
            R.check_key(key)
        with self.write_transaction() as conn:
            if unknown:
                ids = self._resolve_ids(conn, unknown, records[0].ts)
                for rec, row in zip(records, values, strict=True):
                    if rec.key in ids:
                        row[0] = ids[rec.key]
            fast.execute(conn, values)

    # --- reads: windows -------------------------------------------------------------------------

    def windows(
        self,
        key: EngineKey,
        since: datetime | None = None,
        until: datetime | None = None,
        *,
        limit: int | None = None,
    ) -> list[WindowRecord]:
        """Windows of one engine whose end lies in ``[since, until)``, oldest first."""
        _bounds(since, until)
        engine_id = self.engine_id(key)
        if engine_id is None:
            return []
        query = _range(
            select(windows_t).where(windows_t.c.engine_id == engine_id), windows_t.c.end_ts, since, until
        ).order_by(windows_t.c.end_ts)
        if limit is not None:
            query = query.limit(limit)
        with self.read_connection() as conn:
            return [R.window_from_row(row, key) for row in conn.execute(query)]

    def load_samples(self, key: EngineKey, since: datetime, until: datetime) -> list[tuple[datetime, float, float]]:
        """(end, window seconds, requests running + waiting) of one engine's windows ending in ``[since, until)``:
        the load profile alone (the demand: what runs, and what waits for a batch slot when memory caps the
        batch), a few columns instead of whole windows (it is read every decide tick)."""
        _bounds(since, until)
        engine_id = self.engine_id(key)
        if engine_id is None:
            return []
        c = windows_t.c
        query = _range(
            select(c.start_ts, c.end_ts, c.requests_running, c.requests_waiting).where(
                c.engine_id == engine_id, c.requests_running.is_not(None)
            ),
            c.end_ts,
            since,
            until,
        )
        with self.read_connection() as conn:
            return [
                (row[1], (row[1] - row[0]).total_seconds(), float(row[2]) + float(row[3] or 0.0))
                for row in conn.execute(query)
            ]

    def latest_window(self, key: EngineKey) -> WindowRecord | None:
        engine_id = self.engine_id(key)
        if engine_id is None:
            return None
        query = select(windows_t).where(windows_t.c.engine_id == engine_id).order_by(windows_t.c.end_ts.desc()).limit(1)
        with self.read_connection() as conn:
            row = conn.execute(query).one_or_none()
        return None if row is None else R.window_from_row(row, key)

    def window_totals(
        self,
        key: EngineKey,
        since: datetime | None = None,
        until: datetime | None = None,
        *,
        config_id: int | None = None,
    ) -> WindowTotals:
        """Sums over the engine's windows ending in ``[since, until)`` (one config if given).

        Scalars are summed by the database; per-position counts in Python (JSON columns).
        """
        _bounds(since, until)
        engine_id = self.engine_id(key)
        empty = WindowTotals(key, 0, 0.0, SpecCounters(), 0.0, 0.0, 0, None, None)
        if engine_id is None:
            return empty
        c = windows_t.c
        where = [c.engine_id == engine_id]
        if config_id is not None:
            where.append(c.config_id == config_id)
        agg = _range(
            select(
                func.count(),
                func.sum(c.drafts),
                func.sum(c.draft_tokens),
                func.sum(c.accepted_tokens),
                func.sum(c.spec_generated_tokens),
                func.sum(c.generation_tokens),
                func.sum(c.prompt_tokens),
                func.min(c.start_ts),
                func.max(c.end_ts),
            ).where(*where),
            c.end_ts,
            since,
            until,
        )
        per_pos = _range(
            select(
                c.accepted_per_pos,
                c.draft_tokens_per_pos,
                c.num_spec_tokens,
                c.start_ts,
                c.end_ts,
                c.reset,
                c.spec_enabled,
            ).where(*where),
            c.end_ts,
            since,
            until,
        )
        with self.read_connection() as conn:
            count, drafts, draft_tokens, accepted, spec_gen, gen, prompt, first, last = conn.execute(agg).one()
            if not count:
                return empty
            accepted_pos: list[int] = []
            drafted_pos: list[int] | None = []
            ks: set[int | None] = set()
            duration_s = 0.0
            resets = 0
            for row in conn.execute(per_pos):
                _add_into(accepted_pos, row.accepted_per_pos)
                if drafted_pos is not None and row.spec_enabled:
                    if row.draft_tokens_per_pos is None:
                        drafted_pos = None
                    else:
                        _add_into(drafted_pos, row.draft_tokens_per_pos)
                if row.spec_enabled:
                    ks.add(row.num_spec_tokens)
                duration_s += (row.end_ts - row.start_ts).total_seconds()
                resets += int(row.reset)
        spec = SpecCounters(
            drafts=int(drafts or 0),
            draft_tokens=int(draft_tokens or 0),
            accepted_tokens=int(accepted or 0),
            accepted_per_pos=tuple(accepted_pos),
            num_spec_tokens=next(iter(ks)) if len(ks) == 1 else None,
            draft_tokens_per_pos=tuple(drafted_pos) if drafted_pos else None,
            generated_tokens=int(spec_gen or 0),
        )
        return WindowTotals(
            key=key,
            windows=int(count),
            duration_s=duration_s,
            spec=spec,
            generation_tokens=float(gen or 0.0),
            prompt_tokens=float(prompt or 0.0),
            resets=resets,
            first_start=first,
            last_end=last,
        )

    def rollups(
        self, key: EngineKey, since: datetime | None = None, until: datetime | None = None
    ) -> list[RollupRecord]:
        """1-minute rollups of one engine with ``bucket_start`` in ``[since, until)``, oldest first."""
        _bounds(since, until)
        engine_id = self.engine_id(key)
        if engine_id is None:
            return []
        query = _range(
            select(rollups_t).where(rollups_t.c.engine_id == engine_id),
            rollups_t.c.bucket_start,
            since,
            until,
        ).order_by(rollups_t.c.bucket_start, rollups_t.c.config_id)
        with self.read_connection() as conn:
            return [R.rollup_from_row(row, key) for row in conn.execute(query)]

    # --- reads: requests, steps, events ---------------------------------------------------------

    def requests(
        self,
        since: datetime | None = None,
        until: datetime | None = None,
        *,
        model_name: str | None = None,
        config_id: int | None = None,
        limit: int | None = None,
    ) -> list[RequestRecord]:
        """Finished requests with ``ts`` in ``[since, until)``, oldest first."""
        _bounds(since, until)
        query = _range(select(requests_t), requests_t.c.ts, since, until)
        if model_name is not None:
            query = query.where(requests_t.c.model_name == model_name)
        if config_id is not None:
            query = query.where(requests_t.c.config_id == config_id)
        query = query.order_by(requests_t.c.ts, requests_t.c.id)
        if limit is not None:
            query = query.limit(limit)
        with self.read_connection() as conn:
            return [R.request_from_row(row) for row in conn.execute(query)]

    def steps(
        self,
        key: EngineKey,
        since: datetime | None = None,
        until: datetime | None = None,
        *,
        limit: int | None = None,
    ) -> list[StepRecord]:
        """One engine's steps with ``ts`` in ``[since, until)``, oldest first."""
        _bounds(since, until)
        engine_id = self.engine_id(key)
        if engine_id is None:
            return []
        query = _range(select(steps_t).where(steps_t.c.engine_id == engine_id), steps_t.c.ts, since, until).order_by(
            steps_t.c.ts, steps_t.c.id
        )
        if limit is not None:
            query = query.limit(limit)
        with self.read_connection() as conn:
            return [R.step_from_row(row, key) for row in conn.execute(query)]

    def step_time_groups(
        self, key: EngineKey, since: datetime, until: datetime
    ) -> list[tuple[int | None, int, int, float, int]]:
        """Decode steps of one engine in ``[since, until)`` grouped for a step-cost fit: rows
        ``(config_id, batch_size, K, mean step time s, steps)``. K is the tokens each sequence drafted
        (0 for a step without drafts); steps without a time, and steps that also ran a prefill (more
        tokens scheduled than B·(K+1)), are left out. One grouped query: a day of per-step records is
        millions of rows, the groups a few hundred."""
        _bounds(since, until)
        engine_id = self.engine_id(key)
        if engine_id is None:
            return []
        c = steps_t.c
        k = case((c.drafts > 0, c.draft_tokens / c.drafts), else_=0)
        query = (
            select(c.config_id, c.batch_size, k.label("k"), func.avg(c.step_time_s), func.count())
            .where(
                c.engine_id == engine_id,
                c.ts >= since,
                c.ts < until,
                c.step_time_s.is_not(None),
                c.step_time_s > 0,
                c.batch_size > 0,
                c.num_scheduled_tokens.is_(None) | (c.num_scheduled_tokens <= c.batch_size * (k + 1)),
            )
            .group_by(c.config_id, c.batch_size, k)
        )
        with self.read_connection() as conn:
            return [
                (row[0], int(row[1]), int(row[2]), float(row[3]), int(row[4]))
                for row in conn.execute(query)
                if row[3] is not None
            ]

    def events(
        self,
        since: datetime | None = None,
        until: datetime | None = None,
        *,
        key: EngineKey | None = None,
        kind: str | None = None,
        limit: int | None = None,
    ) -> list[EventRecord]:
        """Events with ``ts`` in ``[since, until)``, oldest first; optionally one engine or kind."""
        _bounds(since, until)
        query = _range(select(events_t), events_t.c.ts, since, until)
        if key is not None:
            engine_id = self.engine_id(key)
            if engine_id is None:
                return []
            query = query.where(events_t.c.engine_id == engine_id)
        if kind is not None:
            query = query.where(events_t.c.kind == kind)
        query = query.order_by(events_t.c.ts, events_t.c.id)
        if limit is not None:
            query = query.limit(limit)
        with self.read_connection() as conn:
            return [R.event_from_row(row, self._key_for(conn, row.engine_id)) for row in conn.execute(query)]

    # --- engine configs -------------------------------------------------------------------------

    @property
    def config_generation(self) -> int:
        """Changes after each config write through this object (not by other processes): read it
        before a config query, and an answer cached under it is stale once it differs."""
        return self._config_generation

    def _configs_written(self) -> None:
        # After the commit (finally), so a reader that saw the old generation re-asks; a lock, so two
        # writers' bumps cannot collapse into one that a reader has already seen.
        with self._config_generation_lock:
            self._config_generation += 1

    def record_config(self, key: EngineKey, config: EngineConfigRecord) -> int:
        """Store a config that took effect at ``config.started_at``; any config of that engine still
        open at that time is ended there. Returns the new config's id."""
        row = R.check_single("engine config", R.config_row, config, 0)
        try:
            with self.write_transaction() as conn:
                engine_id = self._resolve_ids(conn, {R.check_key(key)}, config.started_at)[key]
                row["engine_id"] = engine_id
                conn.execute(
                    update(configs_t)
                    .where(
                        configs_t.c.engine_id == engine_id,
                        configs_t.c.ended_at.is_(None),
                        configs_t.c.started_at <= config.started_at,
                    )
                    .values(ended_at=config.started_at)
                )
                new_id: int = conn.execute(insert(configs_t).returning(configs_t.c.id), row).scalar_one()
        finally:
            self._configs_written()
        return new_id

    def end_config(self, config_id: int, ended_at: datetime) -> None:
        values = R.check_fields("end_config", ended_at=(ended_at, "when"))
        try:
            with self.write_transaction() as conn:
                started = conn.execute(
                    select(configs_t.c.started_at).where(configs_t.c.id == config_id)
                ).scalar_one_or_none()
                if started is None:
                    raise UnknownRecordError(f"no engine config with id {config_id}")
                if ended_at < started:
                    raise R.InvalidRecordError(
                        f"end_config: ended_at ({ended_at.isoformat()}) is before the config started "
                        f"({started.isoformat()}); nothing was written"
                    )
                conn.execute(update(configs_t).where(configs_t.c.id == config_id).values(**values))
        finally:
            self._configs_written()

    def config(self, config_id: int) -> StoredConfig:
        with self.read_connection() as conn:
            row = conn.execute(select(configs_t).where(configs_t.c.id == config_id)).one_or_none()
            if row is None:
                raise UnknownRecordError(f"no engine config with id {config_id}")
            key = self._key_for(conn, row.engine_id)
        assert key is not None
        return R.config_from_row(row, key)

    def config_at(self, key: EngineKey, at: datetime) -> StoredConfig | None:
        """The config in force on the engine at ``at`` (started at or before, not yet ended)."""
        engine_id = self.engine_id(key)
        if engine_id is None:
            return None
        c = configs_t.c
        query = (
            select(configs_t)
            .where(c.engine_id == engine_id, c.started_at <= at, (c.ended_at.is_(None)) | (c.ended_at > at))
            .order_by(c.started_at.desc(), c.id.desc())
            .limit(1)
        )
        with self.read_connection() as conn:
            row = conn.execute(query).one_or_none()
        return None if row is None else R.config_from_row(row, key)

    def current_config(self, key: EngineKey) -> StoredConfig | None:
        """The engine's open config (no ``ended_at``), latest start first."""
        engine_id = self.engine_id(key)
        if engine_id is None:
            return None
        c = configs_t.c
        query = (
            select(configs_t)
            .where(c.engine_id == engine_id, c.ended_at.is_(None))
            .order_by(c.started_at.desc(), c.id.desc())
            .limit(1)
        )
        with self.read_connection() as conn:
            row = conn.execute(query).one_or_none()
        return None if row is None else R.config_from_row(row, key)

    def configs_in_force(self, key: EngineKey, since: datetime, until: datetime) -> list[StoredConfig]:
        """Configs of one engine in force at some time in ``[since, until]`` (started by
        ``until``, not ended by ``since``), oldest first: one query to tag a batch of records."""
        _bounds(since, until)
        engine_id = self.engine_id(key)
        if engine_id is None:
            return []
        c = configs_t.c
        query = (
            select(configs_t)
            .where(c.engine_id == engine_id, c.started_at <= until, (c.ended_at.is_(None)) | (c.ended_at > since))
            .order_by(c.started_at, c.id)
        )
        with self.read_connection() as conn:
            return [R.config_from_row(row, key) for row in conn.execute(query)]

    def configs(
        self, key: EngineKey, since: datetime | None = None, until: datetime | None = None
    ) -> list[StoredConfig]:
        """Configs of one engine that started in ``[since, until)``, oldest first."""
        _bounds(since, until)
        engine_id = self.engine_id(key)
        if engine_id is None:
            return []
        query = _range(
            select(configs_t).where(configs_t.c.engine_id == engine_id), configs_t.c.started_at, since, until
        ).order_by(configs_t.c.started_at, configs_t.c.id)
        with self.read_connection() as conn:
            return [R.config_from_row(row, key) for row in conn.execute(query)]

    # --- decisions (the audit log) --------------------------------------------------------------

    def record_decision(self, decision: DecisionRecord) -> int:
        row = R.check_single("decision", R.decision_row, decision, None)
        with self.write_transaction() as conn:
            if decision.engine is not None:
                row["engine_id"] = self._resolve_ids(conn, {R.check_key(decision.engine)}, decision.created_at)[
                    decision.engine
                ]
            new_id: int = conn.execute(insert(decisions_t).returning(decisions_t.c.id), row).scalar_one()
        return new_id

    def update_decision(
        self,
        decision_id: int,
        *,
        status: str,
        at: datetime,
        realized_gain: float | None = None,
        status_message: str | None = None,
        inputs: dict[str, Any] | None = None,
    ) -> None:
        """Move a decision on (applied, verified, rolled back...); ``realized_gain``, ``status_message``
        and ``inputs`` are kept when not given (``inputs`` replaces the whole dict: a canary's plan added
        to an operator's override when the controller takes it)."""
        values = R.check_fields(
            "update_decision",
            status=(status, "status"),
            updated_at=(at, "when"),
            realized_gain=(realized_gain, "real"),
            status_message=(status_message, "text"),
        )
        if realized_gain is None:
            del values["realized_gain"]
        if status_message is None:
            del values["status_message"]
        if inputs is not None:
            try:
                values["inputs"] = R.check_json(dict(inputs), "inputs")
            except R.FieldError as exc:
                raise R.InvalidRecordError(f"update_decision: {exc}; nothing was written") from None
        with self.write_transaction() as conn:
            result = conn.execute(update(decisions_t).where(decisions_t.c.id == decision_id).values(**values))
            if result.rowcount == 0:
                raise UnknownRecordError(f"no decision with id {decision_id}")

    def decision(self, decision_id: int) -> StoredDecision:
        with self.read_connection() as conn:
            row = conn.execute(select(decisions_t).where(decisions_t.c.id == decision_id)).one_or_none()
            if row is None:
                raise UnknownRecordError(f"no decision with id {decision_id}")
            return R.decision_from_row(row, self._key_for(conn, row.engine_id))

    def decisions(
        self,
        since: datetime | None = None,
        until: datetime | None = None,
        *,
        key: EngineKey | None = None,
        status: str | Sequence[str] | None = None,
        limit: int | None = None,
        newest_first: bool = False,
    ) -> list[StoredDecision]:
        """Decisions created in ``[since, until)``; optionally one engine, one status or any of several."""
        _bounds(since, until)
        query = _range(select(decisions_t), decisions_t.c.created_at, since, until)
        if key is not None:
            engine_id = self.engine_id(key)
            if engine_id is None:
                return []
            query = query.where(decisions_t.c.engine_id == engine_id)
        if isinstance(status, str):
            query = query.where(decisions_t.c.status == status)
        elif status is not None:
            query = query.where(decisions_t.c.status.in_(list(status)))
        order = (decisions_t.c.created_at, decisions_t.c.id)
        query = query.order_by(*(col.desc() for col in order) if newest_first else order)
        if limit is not None:
            query = query.limit(limit)
        with self.read_connection() as conn:
            return [R.decision_from_row(row, self._key_for(conn, row.engine_id)) for row in conn.execute(query)]


def _bounds(since: datetime | None, until: datetime | None) -> None:
    """Refuse naive or reversed bounds up front, even when the answer would be empty anyway."""
    for name, value in (("since", since), ("until", until)):
        if value is not None:
            R.check_fields("time range", **{name: (value, "when")})
    if since is not None and until is not None and until < since:
        raise R.InvalidRecordError(f"time range: until ({until.isoformat()}) is before since ({since.isoformat()})")


def _range(query: Any, column: Any, since: datetime | None, until: datetime | None) -> Any:
    """``query`` restricted to ``since <= column < until`` (either bound optional)."""
    conditions = []
    if since is not None:
        conditions.append(column >= R.check_fields("range", since=(since, "when"))["since"])
    if until is not None:
        conditions.append(column < R.check_fields("range", until=(until, "when"))["until"])
    return query.where(and_(*conditions)) if conditions else query


def _add_into(total: list[int], values: Sequence[int]) -> None:
    if len(values) > len(total):
        total.extend([0] * (len(values) - len(total)))
    for i, v in enumerate(values):
        total[i] += v


def _encode_batch(kind: str, records: Sequence[Any], encode: Callable[[Any], list[Any]]) -> list[list[Any]]:
    try:
        return [encode(rec) for rec in records]
    except (R.FieldError, AttributeError):
        pass
    # Find and name the first bad record (the fast path does not track the index).
    for index, rec in enumerate(records):
        try:
            encode(rec)
        except (R.FieldError, AttributeError) as exc:
            raise R.batch_error(kind, index, len(records), rec, exc) from None
    raise AssertionError("unreachable: a record failed once and then passed")  # pragma: no cover
