"""The queries in ``dashboards/spectuner.json``, with Grafana's variables replaced so that Prometheus'
HTTP API can run them (shared by the dashboard unit test and the live Prometheus test)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DASHBOARDS = Path(__file__).resolve().parents[1] / "dashboards"
DASHBOARD = DASHBOARDS / "spectuner.json"
ALERTS = DASHBOARDS / "alerts.yml"
ALERT_TESTS = DASHBOARDS / "alerts_test.yml"

# What Grafana would substitute on a 1-second scrape interval over a short range.
DEFAULT_VARS = {
    "__rate_interval": "10s",  # Grafana: max(4 × scrape interval, $__interval + scrape interval)
    "__interval": "5s",
    "__range": "5m",
    "model_name": ".*",
    "engine": ".*",
}


@dataclass(frozen=True)
class Query:
    where: str  # "panel 3 'title' target A" or "annotation 'Decisions'" or "variable engine"
    expr: str  # as written in the dashboard
    kind: str  # "panel" | "annotation" | "variable"


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows keep their panels inside
    return out


def queries(dashboard: dict[str, Any] | None = None) -> list[Query]:
    dashboard = dashboard or load()
    out = []
    for p in panels(dashboard):
        for t in p.get("targets", []):
            out.append(Query(f"panel {p['id']} {p['title']!r} target {t['refId']}", t["expr"], "panel"))
    for a in dashboard.get("annotations", {}).get("list", []):
        if "expr" in a:
            out.append(Query(f"annotation {a['name']!r}", a["expr"], "annotation"))
    for v in dashboard.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            out.append(Query(f"variable {v['name']}", q, "variable"))
    return out


def substitute(expr: str, variables: dict[str, str] | None = None) -> str:
    """Replace ``$name`` and ``${name}`` by their values; an unknown variable is an error."""
    values = {**DEFAULT_VARS, **(variables or {})}

    def repl(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"dashboard variable ${name} has no test value")
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", repl, expr)


_LABEL_VALUES = re.compile(r"^label_values\((?:(.+),\s*)?(\w+)\)$")


def label_values(expr: str) -> tuple[str | None, str]:
    """``label_values(selector, label)`` → (selector or None, label)."""
    match = _LABEL_VALUES.match(expr.strip())
    if not match:
        raise ValueError(f"not a label_values() query: {expr!r}")
    return match.group(1), match.group(2)


METRIC = re.compile(r"\b((?:spectuner|vllm)[:_][a-zA-Z0-9_:]+)")


def metric_names(expr: str) -> set[str]:
    return set(METRIC.findall(expr))
