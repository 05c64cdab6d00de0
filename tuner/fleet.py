"""The fleet as the store holds it: every engine series, its config and windows, grouped by
``policies.fleet.group_fleet``. One read shared by `spectuner status --fleet`, the report's Fleet
section and the exporter's fleet gauges, so the three always show the same groups and outliers.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from collectors.records import EngineKey
from policies.fleet import EngineWindows, FleetGroup, FleetSettings, group_fleet
from tuner.controller import manual
from tuner.controller.audit import CHANGE
from tuner.store import DecisionStatus, Store, StoredConfig, StoredDecision


def engine_name(key: EngineKey) -> str:
    """One engine series as one string: its /metrics URL and vLLM's engine label."""
    return f"{key.url}#{key.engine}"


def changes_in_flight(store: Store) -> list[StoredDecision]:
    """Changes and overrides applied (or being applied) and not yet verified or rolled back: what
    `status` calls pending, per engine and for the fleet."""
    return [
        d
        for status in (DecisionStatus.APPLYING, DecisionStatus.APPLIED)
        for d in store.decisions(status=status)
        if d.decision.action in (CHANGE, manual.OVERRIDE)
    ]


@dataclass(frozen=True)
class FleetEngine:
    """One grouped engine: its config in force and the changes in flight on it."""

    key: EngineKey
    name: str  # engine_name(key): the name the groups use
    config: StoredConfig
    windows: int  # windows behind its α̂
    pending: tuple[StoredDecision, ...]


@dataclass(frozen=True)
class FleetRead:
    groups: tuple[FleetGroup, ...]  # largest first (group_fleet's order)
    members: tuple[EngineWindows, ...]  # group_fleet's input (for fleet_prior)
    engines: dict[str, FleetEngine]  # by name
    ungrouped: tuple[EngineKey, ...]  # engine series without a recorded config
    pending_for_all: tuple[StoredDecision, ...]  # changes in flight without an engine: every engine's
    pending_overrides: tuple[StoredDecision, ...]  # overrides not yet acted on (any engine, or none)

    def pending_of(self, group: FleetGroup) -> list[StoredDecision]:
        """Changes in flight on the group's engines, then overrides proposed for them."""
        names = [a.engine for a in group.engines]
        keys = {self.engines[n].key for n in names}
        in_flight = [d for n in names for d in self.engines[n].pending]
        return in_flight + [d for d in self.pending_overrides if d.decision.engine in keys]


def read_fleet(
    store: Store,
    since: datetime | None,
    until: datetime | None,
    settings: FleetSettings | None = None,
) -> FleetRead:
    """Every engine series of the store with the windows in ``[since, until)`` of the config in force
    at ``until`` (the open config when ``until`` is None), grouped. A window that began before that
    config started is left out, as `status` and the controller read α̂."""
    in_flight = changes_in_flight(store)
    members: list[EngineWindows] = []
    engines: dict[str, FleetEngine] = {}
    ungrouped: list[EngineKey] = []
    for stored in store.engines():
        key = stored.key
        current = store.current_config(key) if until is None else store.config_at(key, until)
        if current is None:
            ungrouped.append(key)
            continue
        name = engine_name(key)
        started = current.config.started_at
        windows = tuple(w.spec for w in store.windows(key, since, until) if w.spec is not None and w.start >= started)
        members.append(EngineWindows(name, key.model_name, current.config.spec, windows))
        pending = tuple(d for d in in_flight if d.decision.engine == key)
        engines[name] = FleetEngine(key, name, current, len(windows), pending)
    return FleetRead(
        groups=group_fleet(members, settings),
        members=tuple(members),
        engines=engines,
        ungrouped=tuple(ungrouped),
        pending_for_all=tuple(d for d in in_flight if d.decision.engine is None),
        pending_overrides=tuple(manual.pending_overrides(store)),
    )
