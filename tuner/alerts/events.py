"""Alert events: which stored event kinds are alerts (their category), the dedup key, the payloads.

Purely computational: a :class:`StoredEvent` in, a category, a key and JSON-ready payloads out.

Event kinds are data (the collector, controller and daemon write them; new kinds appear over time).
The built-in mapping puts the kinds known today into the issue's categories; ``[alerts] categories``
adds more. A kind that *resolves* a category (the collector recovered, the engine came back) is sent
too, marked ``resolved``, so an Alertmanager alert closes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from tuner.store.deliveries import StoredEvent

SEVERITY_ORDER = {"info": 0, "warning": 1, "critical": 2}


@dataclass(frozen=True)
class Category:
    name: str
    resolves: bool = False  # this kind ends the category's condition
    firing_severity: str | None = None  # the severity of the firing events (so a resolve matches them)


# kind → category. Conditions (collector_down, engine_unhealthy) have a resolving kind.
BUILTIN_CATEGORIES: dict[str, Category] = {
    "draft_swapped": Category("draft_swapped"),
    "k_changed": Category("k_changed"),
    "apply_rolled_back": Category("rollback"),
    "regression_rolled_back": Category("rollback"),
    "rollback_failed": Category("rollback"),
    "acceptance_low": Category("acceptance_low"),
    "collector_error": Category("collector_down", firing_severity="warning"),
    "scrape_stale": Category("collector_down", firing_severity="warning"),
    "collector_recovered": Category("collector_down", resolves=True, firing_severity="warning"),
    "engine_down": Category("engine_unhealthy", firing_severity="critical"),
    "engine_unhealthy": Category("engine_unhealthy", firing_severity="critical"),
    "engine_restarted": Category("engine_unhealthy", resolves=True, firing_severity="critical"),
    "apply_failed": Category("engine_unhealthy"),
    "budget_exceeded": Category("budget_exceeded"),
}


def categories(extra: Mapping[str, str] | None = None) -> dict[str, Category]:
    out = dict(BUILTIN_CATEGORIES)
    for kind, name in (extra or {}).items():
        out[kind] = Category(name)
    return out


def category_of(event: StoredEvent, mapping: Mapping[str, Category]) -> Category:
    """The event's category; an unmapped kind is its own category."""
    return mapping.get(event.kind, Category(event.kind))


def selects(
    event: StoredEvent, mapping: Mapping[str, Category], kinds: list[str] | tuple[str, ...], min_severity: str
) -> bool:
    """Does a sink with these filters want this event? ``kinds`` empty: every mapped kind; ``*``: all."""
    cat = category_of(event, mapping)
    if "*" in kinds:
        wanted = True
    elif kinds:
        wanted = event.kind in kinds or cat.name in kinds
    else:
        wanted = event.kind in mapping
    if not wanted:
        return False
    if cat.resolves:
        return True  # a resolve is sent whenever its category is (its own severity is info)
    return SEVERITY_ORDER.get(event.severity, 0) >= SEVERITY_ORDER.get(min_severity, 0)


def dedup_key(event: StoredEvent) -> str:
    """Same key within a sink's dedup window ⇒ sent once. ``data["dedup_key"]`` wins; otherwise the
    kind, the engine and what distinguishes two occurrences (the collector's reason, the decision)."""
    explicit = event.data.get("dedup_key")
    if isinstance(explicit, str) and explicit:
        return explicit
    parts = [event.kind]
    if event.engine is not None:
        parts += [event.engine.url, event.engine.model_name, event.engine.engine]
    elif isinstance(event.data.get("url"), str):
        parts.append(event.data["url"])
    for name in ("reason", "decision_id"):
        if event.data.get(name) is not None:
            parts.append(f"{name}={event.data[name]}")
    return "|".join(parts)


def _engine(event: StoredEvent) -> dict[str, str] | None:
    if event.engine is None:
        return None
    return {"url": event.engine.url, "model_name": event.engine.model_name, "engine": event.engine.engine}


def generic_payload(event: StoredEvent, mapping: Mapping[str, Category]) -> dict[str, Any]:
    """The webhook and command sinks' JSON (documented in docs/alerts.md)."""
    cat = category_of(event, mapping)
    return {
        "source": "spectuner",
        "event_id": event.id,
        "kind": event.kind,
        "category": cat.name,
        "resolved": cat.resolves,
        "severity": event.severity,
        "message": event.message,
        "ts": event.ts.isoformat(),
        "engine": _engine(event),
        "data": event.data,
    }


def impact_line(data: Mapping[str, Any]) -> str | None:
    """An apply's client impact in words (the actuator's ``ApplyImpact`` fields), None when absent."""
    strategy = data.get("strategy")
    if not isinstance(strategy, str):
        return None
    held, longest, failed = data.get("requests_held"), data.get("longest_hold_s"), data.get("requests_failed")
    parts = [f"{held} held" + (f" (longest {longest:.1f} s)" if isinstance(longest, int | float) and held else "")]
    parts.append(f"{failed} failed")
    return f"clients: {', '.join(parts)} [{strategy}]"


_ICONS = {"info": ":information_source:", "warning": ":warning:", "critical": ":rotating_light:"}


def slack_payload(event: StoredEvent, mapping: Mapping[str, Category]) -> dict[str, Any]:
    """Slack incoming-webhook JSON (``text`` is what Slack, Mattermost and Rocket.Chat all show)."""
    cat = category_of(event, mapping)
    where = f" — {event.engine.model_name} engine {event.engine.engine}" if event.engine else ""
    state = "resolved" if cat.resolves else event.severity
    icon = ":white_check_mark:" if cat.resolves else _ICONS.get(event.severity, "")
    impact = impact_line(event.data)
    text = f"{icon} spectuner {cat.name} ({state}){where}: {event.message}" + (f" — {impact}" if impact else "")
    return {"text": text.strip()}


def alertmanager_payload(
    event: StoredEvent, mapping: Mapping[str, Category], resolve_after_s: float
) -> list[dict[str, Any]]:
    """Alertmanager ``POST /api/v2/alerts`` body: a list with one alert. A resolving event sends the
    same labels with ``endsAt`` = now; a one-off event ends ``resolve_after_s`` after it started."""
    cat = category_of(event, mapping)
    severity = cat.firing_severity or event.severity
    labels = {"alertname": f"spectuner_{cat.name}", "service": "spectuner", "severity": severity}
    if event.engine is not None:
        labels.update(instance=event.engine.url, model_name=event.engine.model_name, engine=event.engine.engine)
    elif isinstance(event.data.get("url"), str):
        labels["instance"] = event.data["url"]
    ends = event.ts if cat.resolves else event.ts + timedelta(seconds=resolve_after_s)
    alert: dict[str, Any] = {
        "labels": labels,
        "annotations": {"summary": event.message, "kind": event.kind, "event_id": str(event.id)},
        "endsAt": ends.isoformat(),
    }
    impact = impact_line(event.data)
    if impact is not None:
        alert["annotations"]["client_impact"] = impact
    if not cat.resolves:
        alert["startsAt"] = event.ts.isoformat()
    return [alert]


def encode(obj: Any) -> bytes:
    """Stable JSON bytes (what a webhook signature covers)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
