"""Tag records with the engine config in force: the one place a record gets its ``config_id``.

Windows and steps name their engine series, so :class:`ConfigTaggingSink` looks the config up per
series at the record's time (``Store.config_at``), and remembers an answer that holds from its
config's start on (see :class:`ConfigTaggingSink`). Requests are tagged by :class:`RequestConfigTagger`
(below), which the sink also uses when it knows the server's metrics URL.

Per-request records, tagged with the engine config in force when they finished:

The tap sees requests, not engine series: a request names its model and the upstream it went to.
Configs are recorded per engine series (metrics URL × model × vLLM ``engine`` label), so a request
is tagged with the config in force at its ``ts`` on the series of its model at the engine's metrics
URL. Data-parallel engines of one server run one config; when several series of the model exist, the
lowest ``engine`` label that has a config in force is used. No engine or no config: ``config_id``
stays None (the collector may not have seen the engine yet).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, TypeVar

from collectors.records import EngineKey, EngineSample, EventRecord, RequestRecord, StepRecord, WindowRecord
from tuner.store.records import StoredConfig
from tuner.store.store import Store


def config_id_at(configs: Sequence[StoredConfig], at: datetime) -> int | None:
    """The id of the config in force at ``at`` (latest start at or before it, not yet ended)."""
    found: StoredConfig | None = None
    for stored in configs:
        cfg = stored.config
        in_force = cfg.started_at <= at and (cfg.ended_at is None or cfg.ended_at > at)
        if in_force and (found is None or (cfg.started_at, stored.id) >= (found.config.started_at, found.id)):
            found = stored
    return None if found is None else found.id


class RequestConfigTagger:
    """A ``write(batch)`` for the tap's ``BatchWriter``: tags each request that has no ``config_id``
    (see the module doc) and writes the batch with ``store.write_requests``. A few queries per
    batch (engines, then each series' configs over the batch's time span), never per record."""

    def __init__(self, store: Store, metrics_url: str) -> None:
        self.store = store
        self.metrics_url = metrics_url

    def __call__(self, records: Sequence[RequestRecord]) -> None:
        self.store.write_requests(self.tag(records))

    def tag(self, records: Sequence[RequestRecord]) -> list[RequestRecord]:
        untagged = [r for r in records if r.config_id is None]
        if not untagged:
            return list(records)
        series: dict[str, list[EngineKey]] = {}
        for engine in self.store.engines():
            if engine.key.url == self.metrics_url:
                series.setdefault(engine.key.model_name, []).append(engine.key)
        since = min(r.ts for r in untagged)
        until = max(r.ts for r in untagged)
        configs: dict[str, list[list[StoredConfig]]] = {
            model: [self.store.configs_in_force(key, since, until) for key in sorted(keys, key=_engine_order)]
            for model, keys in series.items()
            if any(r.model_name == model for r in untagged)
        }
        out = []
        for rec in records:
            if rec.config_id is None and rec.model_name in configs:
                for per_engine in configs[rec.model_name]:
                    config_id = config_id_at(per_engine, rec.ts)
                    if config_id is not None:
                        rec = replace(rec, config_id=config_id)
                        break
            out.append(rec)
        return out


def _engine_order(key: EngineKey) -> tuple[int, str]:
    # vLLM's engine labels are data-parallel ranks ("0", "1", ...): numeric order, not text order.
    return (int(key.engine), "") if key.engine.isdigit() else (1 << 30, key.engine)


_Tagged = TypeVar("_Tagged", WindowRecord, StepRecord)

CONFIG_CACHE_TTL_S = 2.0
"""How long :class:`ConfigTaggingSink` trusts a remembered config before asking the database again.
Writes through the sink's own :class:`Store` (the daemon's controller, the simulator) invalidate at
once (``Store.config_generation``); a config written by another process on a shared database is
seen only by asking, so such a write can mis-tag at most this long of records. 2 s is four of the
step writer's 0.5 s batches: a quarter of the queries, for a lag of a couple of seconds on a change
that in-tree code never makes from outside the daemon (the CLI asks the daemon to apply)."""


@dataclass(frozen=True)
class _Known:
    """A config that is :meth:`Store.config_at`'s answer at every time from its start on: it is open
    and no other config of its series started at or after it (checked when ``generation`` was read
    and the monotonic clock said ``checked_at``)."""

    config: StoredConfig
    generation: int
    checked_at: float


class ConfigTaggingSink:
    """Passes records to the store, stamping windows with the id of the config in force for their
    engine series (so rollups and later analysis can split by config).

    Looked up per batch and series (a query every 0.5 s per series was most of the step writer's
    CPU), the answer is remembered per series while it provably holds for every later time: the
    config is open and nothing of its series started at or after it. A record before its start, a
    config write through ``store`` or ``cache_ttl_s`` seconds asks the database again (one query
    re-checks a remembered config). ``cache_ttl_s=0``: every lookup queries (``config_at``)."""

    def __init__(
        self,
        store: Store,
        metrics_url: str | None = None,
        *,
        cache_ttl_s: float = CONFIG_CACHE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        # requests name a model, not a series: tagged per model at the server's metrics URL when known
        self.requests = RequestConfigTagger(store, metrics_url) if metrics_url is not None else None
        self.cache_ttl_s = cache_ttl_s
        self.clock = clock
        self._known: dict[EngineKey, _Known] = {}

    def _config_id(self, key: EngineKey, at: datetime) -> int | None:
        """``Store.config_at(key, at)``'s id, from the remembered config when it still holds."""
        if self.cache_ttl_s <= 0:
            found = self.store.config_at(key, at)
            return None if found is None else found.id
        # both read before any query: a write that lands during it leaves a stale generation behind
        generation, now = self.store.config_generation, self.clock()
        known = self._known.get(key)
        if known is not None and known.config.config.started_at <= at:
            if known.generation == generation and 0 <= now - known.checked_at < self.cache_ttl_s:
                return known.config.id
            fresh = self._holds_from_start(known.config)
            if fresh is not None:
                self._known[key] = _Known(fresh, generation, now)
                return fresh.id
            self._known.pop(key, None)
        found = self.store.config_at(key, at)
        if found is not None and found.config.ended_at is None:
            fresh = self._holds_from_start(found)
            if fresh is not None:
                self._known[key] = _Known(fresh, generation, now)
        return None if found is None else found.id

    def _holds_from_start(self, stored: StoredConfig) -> StoredConfig | None:
        """The config as stored now if it answers ``config_at`` at every time from its start: still
        open, and no other config of its series started at or after it (``config_at`` takes the
        latest start in force, so only such a config could win), else None."""
        since = self.store.configs(stored.key, since=stored.config.started_at)
        if len(since) == 1 and since[0].id == stored.id and since[0].config.ended_at is None:
            return since[0]
        return None

    def _tag(
        self, records: Sequence[_Tagged], at: Callable[[_Tagged], datetime], ids: dict[Any, int | None] | None = None
    ) -> list[_Tagged]:
        """Each record's ``config_id``: the config in force for its series at the first record's time."""
        ids = {} if ids is None else ids
        tagged = []
        for r in records:
            if r.key not in ids:
                ids[r.key] = self._config_id(r.key, at(r))
            tagged.append(replace(r, config_id=ids[r.key]) if r.config_id is None else r)
        return tagged

    def write_windows(self, records: Sequence[WindowRecord]) -> None:
        self.store.write_windows(self._tag(records, lambda w: w.start))

    def write_scrape(
        self,
        windows: Sequence[WindowRecord],
        events: Sequence[EventRecord] = (),
        baselines: Sequence[EngineSample] = (),
    ) -> None:
        self.store.write_scrape(self._tag(windows, lambda w: w.start), events, baselines)

    def baselines(self, url: str) -> Sequence[EngineSample]:
        return self.store.baselines(url)

    def write_requests(self, records: Sequence[RequestRecord]) -> None:
        self.store.write_requests(self.requests.tag(records) if self.requests is not None else records)

    def write_steps(self, records: Sequence[StepRecord]) -> None:
        self.store.write_steps(self._tag(records, lambda s: s.ts))

    def write_windows_and_steps(self, windows: Sequence[WindowRecord], steps: Sequence[StepRecord]) -> None:
        """Windows and the steps of the same interval, tagged with one config lookup per series (the
        simulator's flush: one decide interval under one config)."""
        ids: dict[Any, int | None] = {}
        self.store.write_windows(self._tag(windows, lambda w: w.start, ids))
        if steps:
            self.store.write_steps(self._tag(steps, lambda s: s.ts, ids))

    def write_events(self, records: Sequence[EventRecord]) -> None:
        self.store.write_events(records)
