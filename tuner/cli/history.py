"""`spectuner history`: the audit log (decisions, events, config changes), newest first."""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

import typer

from tuner.cli.common import (
    CONFIG_HELP,
    DB_HELP,
    JSON_HELP,
    db_error_detail,
    fail_runtime,
    fail_usage,
    iso,
    open_store,
    out_console,
    parse_since,
    print_json,
    say,
    short_time,
)


class Kind(StrEnum):
    DECISIONS = "decisions"
    EVENTS = "events"
    CONFIGS = "configs"
    ALL = "all"


def history(
    since: str = typer.Option(
        "24h", "--since", help="How far back: 30m, 24h, 7d, or an ISO time with a zone (2026-12-02T08:00:00Z)."
    ),
    limit: int = typer.Option(50, "--limit", help="Most rows shown (the newest)."),
    kind: Kind = typer.Option(Kind.ALL, "--kind", help="Which rows: decisions, events, configs or all."),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    config: Path | None = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """The audit log, newest first: decisions (with who, status and predicted/realized gain), events
    and config changes."""
    if limit < 1:
        fail_usage(f"--limit must be at least 1 but got {limit}")
    now = datetime.now(UTC)
    start = parse_since(since, now)
    from sqlalchemy.exc import SQLAlchemyError

    from tuner.store.url import render_url

    store = open_store(db, config, read_only=True)
    try:
        with store:
            rows = gather(store, start, kind, limit)
    except SQLAlchemyError as exc:
        fail_runtime(f"cannot read the database {store!r}: {db_error_detail(exc)}")
    data = {"db": render_url(store.url), "since": iso(start), "kind": kind.value, "limit": limit, "rows": rows}
    if as_json:
        print_json(data)
        return
    _print_human(data)


def _engine(key: Any) -> dict[str, str] | None:
    return None if key is None else {"url": key.url, "model_name": key.model_name, "engine": key.engine}


def gather(store: Any, since: datetime, kind: Kind, limit: int) -> list[dict[str, Any]]:
    """Rows of the chosen kinds created at or after ``since``, newest first, at most ``limit``."""
    rows: list[dict[str, Any]] = []
    until = None
    if kind in (Kind.DECISIONS, Kind.ALL):
        for d in store.decisions(since, until, limit=limit, newest_first=True):
            rec = d.decision
            rows.append(
                {
                    "kind": "decision",
                    "id": d.id,
                    "ts": iso(rec.created_at),
                    "engine": _engine(rec.engine),
                    "action": rec.action,
                    "reason": rec.reason,
                    "mode": rec.mode,
                    "status": rec.status,
                    "by": rec.inputs.get("by") if rec.mode == "manual" else None,
                    "message": rec.message,
                    "status_message": d.status_message,
                    "updated_at": iso(d.updated_at),
                    "proposed_config": rec.proposed_config,
                    "predicted_gain": rec.predicted_gain,
                    "realized_gain": d.realized_gain,
                }
            )
    if kind in (Kind.EVENTS, Kind.ALL):
        events = store.events(since, until)  # oldest first; the store has no newest-first order for events
        for e in events[-limit:]:
            rows.append(
                {
                    "kind": "event",
                    "ts": iso(e.ts),
                    "engine": _engine(e.engine),
                    "event_kind": e.kind,
                    "severity": e.severity,
                    "message": e.message,
                    "data": e.data,
                }
            )
    if kind in (Kind.CONFIGS, Kind.ALL):
        for engine in store.engines():
            for c in store.configs(engine.key, since, until)[-limit:]:
                cfg = c.config
                rows.append(
                    {
                        "kind": "config",
                        "id": c.id,
                        "ts": iso(cfg.started_at),
                        "engine": _engine(c.key),
                        "method": cfg.method,
                        "draft_model": cfg.draft_model,
                        "num_spec_tokens": cfg.num_spec_tokens,
                        "k_table": [list(r) for r in cfg.k_table] if cfg.k_table else None,
                        "applied_by": str(cfg.applied_by),
                        "decision_id": cfg.decision_id,
                        "ended_at": iso(cfg.ended_at),
                    }
                )
    # Ties: decisions before events before configs, higher id first.
    order = {"decision": 0, "event": 1, "config": 2}
    rows.sort(key=lambda r: (datetime.fromisoformat(r["ts"]), -order[r["kind"]], r.get("id") or 0), reverse=True)
    return rows[:limit]


def _gain(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}×"


def _gains(predicted: float | None, realized: float | None) -> str:
    return "" if predicted is None and realized is None else f"{_gain(predicted)} → {_gain(realized)}"


def _print_human(data: dict[str, Any]) -> None:
    from rich.markup import escape
    from rich.table import Table

    from tuner.cli.status import describe_config

    rows = data["rows"]
    if not rows:
        say(f"nothing in {data['db']} since {data['since']} ({data['kind']})")
        return
    show_gains = any(r.get("predicted_gain") is not None or r.get("realized_gain") is not None for r in rows)
    table = Table(title=f"audit log since {short_time(data['since'])} UTC, newest first", title_justify="left")
    table.add_column("when (UTC)", no_wrap=True)
    for col in ("what", "id", "status", "who"):
        table.add_column(col, overflow="fold")
    if show_gains:
        table.add_column("gain pred → real", overflow="fold")
    table.add_column("details", overflow="fold", ratio=1)
    for r in rows:
        when = short_time(r["ts"])
        if r["kind"] == "decision":
            detail = r["message"]
            if r["proposed_config"]:
                detail += f" → {describe_config(r['proposed_config'])}"
            if r["status_message"]:
                detail += f" [{r['status_message']}]"
            cells = [when, r["action"], str(r["id"]), r["status"], r["by"] or r["mode"]]
            gains = _gains(r["predicted_gain"], r["realized_gain"])
        elif r["kind"] == "event":
            cells, gains, detail = [when, r["event_kind"], "", r["severity"], ""], "", r["message"]
        else:
            ended = f", ended {short_time(r['ended_at'])}" if r["ended_at"] else ""
            cells, gains = [when, "config", str(r["id"]), f"by {r['applied_by']}", ""], ""
            detail = describe_config(r) + ended
        table.add_row(*cells, *([gains] if show_gains else []), escape(detail))
    out_console.print(table)
    if len(rows) == data["limit"]:
        say(f"(the newest {data['limit']} rows; --limit or --since show more)")


def register(app: typer.Typer) -> None:
    app.command("history")(history)
