"""`spectuner status --fleet`: every engine in the store grouped by (target, draft, config), each group's
pooled α̂ with its interval, the configs in force, pending changes and outliers (``policies.fleet``).
Reads only; heavy modules are imported inside the functions."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from tuner.cli.common import iso, out_console, say


def gather_fleet(store: Any, now: datetime, window_s: float, confidence: float = 0.95) -> dict[str, Any]:
    """The fleet document (the ``--fleet --json`` output)."""
    from policies.fleet import FleetSettings, fleet_prior
    from tuner.cli.status import config_view, decision_view
    from tuner.fleet import engine_name, read_fleet
    from tuner.store.url import render_url

    since = now - timedelta(seconds=window_s)
    fleet = read_fleet(store, since, now + timedelta(microseconds=1), FleetSettings(confidence=confidence))
    info: dict[str, dict[str, Any]] = {}
    for name, e in fleet.engines.items():
        info[name] = {
            **_engine_view(e.key, name),
            "config": config_view(store, e.config),
            "windows": e.windows,
            "pending": [decision_view(d) for d in e.pending],
        }
    out = []
    for g in fleet.groups:
        checks = {c.engine: c for c in g.checks}
        engines = []
        for a in g.engines:
            est, c = a.estimate, checks[a.engine]
            engines.append(
                {
                    **info[a.engine],
                    "alpha": est.alpha,
                    "alpha_ci": list(est.alpha_ci) if est.alpha_ci else None,
                    "drafts": est.drafts,
                    "outlier": {
                        "verdict": c.verdict.value,
                        "rest_alpha": c.rest_alpha,
                        "z": c.z,
                        "p_value": c.p_value,
                        "threshold": c.threshold,
                        "reason": c.reason,
                    },
                }
            )
        prior = fleet_prior(fleet.members, g.key.target, (g.key.method, g.key.draft_model))
        out.append(
            {
                "target": g.key.target,
                "method": g.key.method,
                "draft_model": g.key.draft_model,
                "fingerprint": g.key.fingerprint,
                "spec_config": g.config.to_vllm(),
                "engines": engines,
                "alpha": g.alpha,
                "alpha_ci": list(g.alpha_ci) if g.alpha_ci else None,
                "alpha_ci_binomial": list(g.pooled.alpha_ci) if g.pooled.alpha_ci else None,
                "alpha_reason": g.pooled.reason.value,
                "drafts": g.pooled.drafts,
                "dispersion": g.dispersion.dispersion,
                "dispersion_message": g.dispersion.message,
                "outliers": [c.engine for c in g.outliers],
                "pending": [p for e in engines for p in e["pending"]],
                "draft_prior": prior.to_dict(),
                "message": g.message,
            }
        )
    unknown = [
        {**_engine_view(key, engine_name(key)), "message": "no config recorded yet: not grouped"}
        for key in fleet.ungrouped
    ]
    return {
        "db": render_url(store.url),
        "now": iso(now),
        "window_s": window_s,
        "confidence": confidence,
        "engines": len(fleet.members) + len(unknown),
        "groups": out,
        "ungrouped": unknown,
        # a change or override without an engine applies to every engine the sidecar drives
        "pending_for_all": [decision_view(d) for d in fleet.pending_for_all],
        "pending_overrides": [decision_view(d) for d in fleet.pending_overrides],
    }


def _engine_view(key: Any, name: str) -> dict[str, Any]:
    return {"name": name, "url": key.url, "model_name": key.model_name, "engine": key.engine}


def print_fleet(data: dict[str, Any]) -> None:
    from rich.markup import escape
    from rich.table import Table

    from tuner.cli.status import describe_config

    if not data["groups"] and not data["ungrouped"]:
        say(f"no engine series in {data['db']} yet: start the collectors (`spectuner run` or `collect`)")
        return
    say(
        f"{data['engines']} engine(s) in {len(data['groups'])} group(s) by (target, draft, config); "
        f"α̂ over the last {data['window_s']:g} s"
    )
    for p in [*data["pending_for_all"], *data["pending_overrides"]]:
        say(f"pending for every engine: {p['action']} {p['status']} (audit id {p['id']}): {p['message']}")
    for g in data["groups"]:
        title = escape(f"{g['target']} / {describe_config(g['spec_config'])} — {len(g['engines'])} engine(s)")
        table = Table(title=title, title_justify="left")
        for column in ("engine", "α̂ [interval]", "drafts", "outlier", "pending"):
            table.add_column(column)
        for e in g["engines"]:
            o = e["outlier"]
            flag = "OUTLIER: " + o["reason"] if o["verdict"] == "outlier" else o["verdict"].replace("_", " ")
            pending = "; ".join(f"{p['action']} {p['status']} (audit id {p['id']})" for p in e["pending"]) or "—"
            table.add_row(
                escape(e["name"]), _alpha(e["alpha"], e["alpha_ci"]), f"{e['drafts']:,}", escape(flag), pending
            )
        table.add_row("pooled", _alpha(g["alpha"], g["alpha_ci"]), f"{g['drafts']:,}", f"φ = {g['dispersion']:.2f}", "")
        out_console.print(table)
        say(f"  {g['message']}")
        say(f"  prior for a new engine with this draft: {g['draft_prior']['message']}")
    for u in data["ungrouped"]:
        say(f"{u['name']}: {u['message']}")


def _alpha(alpha: float | None, ci: list[float] | None) -> str:
    if alpha is None:
        return "—"
    return f"{alpha:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
