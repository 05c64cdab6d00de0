"""Tag records with the engine config in force: the one place a record gets its ``config_id``.

Windows and steps name their engine series, so :class:`ConfigTaggingSink` looks the config up per
series at the record's time (``Store.config_at``). Requests are tagged by :class:`RequestConfigTagger`
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

from collections.abc import Callable, Sequence
from dataclasses import replace
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


class ConfigTaggingSink:
    """Passes records to the store, stamping windows with the id of the config in force for their
    engine series (so rollups and later analysis can split by config)."""

    def __init__(self, store: Store, metrics_url: str | None = None) -> None:
        self.store = store
        # requests name a model, not a series: tagged per model at the server's metrics URL when known
        self.requests = RequestConfigTagger(store, metrics_url) if metrics_url is not None else None

    def _tag(
        self, records: Sequence[_Tagged], at: Callable[[_Tagged], datetime], ids: dict[Any, int | None] | None = None
    ) -> list[_Tagged]:
        """Each record's ``config_id``: the config in force for its series at the first record's time."""
        ids = {} if ids is None else ids
        tagged = []
        for r in records:
            if r.key not in ids:
                cfg = self.store.config_at(r.key, at(r))
                ids[r.key] = cfg.id if cfg is not None else None
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
