"""`spectuner status`: what each engine series runs, how speculation is doing, what the controller
is about to do. Reads only; heavy modules are imported inside the command."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import typer

from tuner.cli.common import (
    CONFIG_HELP,
    DB_HELP,
    JSON_HELP,
    ago,
    db_error_detail,
    fail_runtime,
    fail_usage,
    iso,
    load_config_or_exit,
    note,
    open_store,
    out_console,
    print_json,
    require_range,
    say,
    short_time,
)


def status(
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    config: Path | None = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    engine: str | None = typer.Option(
        None, "--engine", help="Only the series scraped from this vLLM server (http://HOST:PORT or its /metrics URL)."
    ),
    window_s: float = typer.Option(300.0, "--window-s", help="Seconds of windows behind α̂ and throughput."),
    events_window_s: float = typer.Option(86400.0, "--events-window-s", help="Seconds of events to count."),
    length_window_s: float = typer.Option(
        3600.0, "--length-window-s", help="Seconds of per-request records behind α by context length."
    ),
    length_edges: str | None = typer.Option(
        None,
        "--length-edges",
        help="Context-length band edges in tokens, e.g. 2048,8192,32768 (default 512, 1024, … 32768).",
    ),
    fleet: bool = typer.Option(
        False,
        "--fleet",
        help="Every engine in the store grouped by (target, draft, config): pooled α̂ with its "
        "interval, configs, pending changes, outliers.",
    ),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Per engine series: the config in force, α̂ and throughput over the last window, pause, pending
    changes, the last decision and recent events. ``--fleet``: the engines grouped, with outliers."""
    year_s = 366 * 86400.0  # further back than a year is a typo (and past what datetime can subtract)
    require_range("--window-s", window_s, low=0.0, high=year_s, low_open=True)
    require_range("--events-window-s", events_window_s, low=0.0, high=year_s, low_open=True)
    require_range("--length-window-s", length_window_s, low=0.0, high=year_s, low_open=True)
    edges = _length_edges(length_edges)
    if fleet and engine is not None:
        fail_usage("--fleet shows every engine in the store; drop --engine (or drop --fleet for one engine)")
    from sqlalchemy.exc import SQLAlchemyError

    cfg = load_config_or_exit(config)
    if fleet:
        _fleet_status(db, config, cfg, window_s, as_json)
        return
    url_filter = _engine_url(engine or (cfg.engine.metrics_url if cfg is not None else None))
    store = open_store(db, config, cfg, read_only=True)
    now = datetime.now(UTC)
    try:
        with store:
            confidence = cfg.policy.confidence if cfg is not None else 0.95  # the controller's, when configured
            data = gather(store, now, window_s, events_window_s, url_filter, confidence, length_window_s, edges)
    except SQLAlchemyError as exc:
        fail_runtime(f"cannot read the database {store!r}: {db_error_detail(exc)}")
    if engine is not None and not data["engines"]:
        fail_usage(f"no engine series scraped from {url_filter} in {data['db']}; `spectuner status` lists them all")
    if as_json:
        print_json(data)
        return
    _print_human(data, now)


def _fleet_status(db: str | None, config: Path | None, cfg: Any, window_s: float, as_json: bool) -> None:
    from sqlalchemy.exc import SQLAlchemyError

    from tuner.cli.status_fleet import gather_fleet, print_fleet

    store = open_store(db, config, cfg, read_only=True)
    now = datetime.now(UTC)
    try:
        with store:
            confidence = cfg.policy.confidence if cfg is not None else 0.95
            data = gather_fleet(store, now, window_s, confidence)
    except SQLAlchemyError as exc:
        fail_runtime(f"cannot read the database {store!r}: {db_error_detail(exc)}")
    if as_json:
        print_json(data)
    else:
        print_fleet(data)


def _engine_url(text: str | None) -> str | None:
    """The series' URL as the collector stores it (the /metrics URL)."""
    if text is None:
        return None
    from collectors.scrape import metrics_url

    try:
        return metrics_url(text)
    except ValueError as exc:
        fail_usage(f"--engine: {exc}")


def gather(
    store: Any,
    now: datetime,
    window_s: float,
    events_window_s: float,
    url: str | None,
    confidence: float = 0.95,
    length_window_s: float = 3600.0,
    length_edges: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """The status document (the ``--json`` output)."""
    from policies.acceptance import alpha_of_windows
    from tuner.controller import manual
    from tuner.fleet import changes_in_flight
    from tuner.store.lengths import context_length_view
    from tuner.store.url import render_url

    since = now - timedelta(seconds=window_s)
    events_since = now - timedelta(seconds=events_window_s)
    pauses = manual.active_pauses(store)
    overrides = manual.pending_overrides(store)
    in_flight = changes_in_flight(store)
    engines = []
    for stored in store.engines():
        key = stored.key
        if url is not None and key.url != url:
            continue
        current = store.current_config(key)
        latest = store.latest_window(key)
        until = now + timedelta(microseconds=1)
        totals = store.window_totals(key, since, until)
        # α̂ as the controller and the exporters read it: the config in force's windows within the
        # window, each read at the K it drafted (a swap must not pool two drafts' acceptance)
        started = current.config.started_at if current is not None else None
        est = alpha_of_windows(
            [
                w.spec
                for w in store.windows(key, since, until)
                if w.spec is not None and (started is None or w.start >= started)
            ],
            confidence,
        )
        last = store.decisions(key=key, limit=1, newest_first=True)
        severities = Counter(e.severity for e in store.events(events_since, None, key=key))
        lengths = context_length_view(
            store,
            key.model_name,
            now - timedelta(seconds=length_window_s),
            now + timedelta(microseconds=1),
            config_id=current.id if current is not None else None,
            confidence=confidence,
            edges=length_edges,
        )
        engines.append(
            {
                "url": key.url,
                "model_name": key.model_name,
                "engine": key.engine,
                "config": config_view(store, current),
                "last_window_end": iso(latest.end) if latest else None,
                "last_window_age_s": round((now - latest.end).total_seconds(), 1) if latest else None,
                "window": {
                    "window_s": window_s,
                    "windows": totals.windows,
                    "duration_s": round(totals.duration_s, 3),
                    "generation_tokens": totals.generation_tokens,
                    "throughput_tokens_per_s": (
                        totals.generation_tokens / totals.duration_s if totals.duration_s > 0 else None
                    ),
                    "resets": totals.resets,
                    **est.to_dict(),
                    "alpha_reason": est.reason.value,
                    "alpha_since": iso(max(since, started)) if started is not None else iso(since),
                },
                "pending": [decision_view(d) for d in in_flight if d.decision.engine in (None, key)],
                "last_decision": decision_view(last[0]) if last else None,
                "events": {
                    "since": iso(events_since),
                    **{s: severities.get(s, 0) for s in ("info", "warning", "critical")},
                },
                "by_context_length": {
                    "window_s": length_window_s,
                    **lengths.to_dict(),
                },
            }
        )
    return {
        "db": render_url(store.url),
        "window_s": window_s,
        "events_window_s": events_window_s,
        "now": iso(now),
        "paused": bool(pauses),
        "pauses": [decision_view(d) for d in pauses],
        "pending_overrides": [decision_view(d) for d in overrides],
        "engines": engines,
    }


def _length_edges(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    from policies.length_bands import LengthSettings

    try:
        edges = tuple(int(x) for x in text.split(",") if x.strip())
        LengthSettings(edges_tokens=edges)
    except ValueError as exc:
        fail_usage(f"--length-edges {text!r}: {exc}; write increasing token counts, e.g. 2048,8192,32768")
    return edges


def config_view(store: Any, stored: Any) -> dict[str, Any] | None:
    if stored is None:
        return None
    c = stored.config
    by = None
    if c.decision_id is not None:
        try:
            by = store.decision(c.decision_id).decision.inputs.get("by")
        except LookupError:
            by = None
    return {
        "id": stored.id,
        "method": c.method,
        "draft_model": c.draft_model,
        "num_spec_tokens": c.num_spec_tokens,
        "k_table": [list(r) for r in c.k_table] if c.k_table else None,
        "since": iso(c.started_at),
        "applied_by": str(c.applied_by),
        "decision_id": c.decision_id,
        "by": by,
        "spec_config": c.spec_config,
    }


def decision_view(d: Any) -> dict[str, Any]:
    rec = d.decision
    return {
        "id": d.id,
        "created_at": iso(rec.created_at),
        "updated_at": iso(d.updated_at),
        "action": rec.action,
        "reason": rec.reason,
        "status": rec.status,
        "mode": rec.mode,
        "by": rec.inputs.get("by") if rec.mode == "manual" else None,
        "message": rec.message,
        "status_message": d.status_message,
        "proposed_config": rec.proposed_config,
        "predicted_gain": rec.predicted_gain,
        "realized_gain": d.realized_gain,
        "engine": None
        if rec.engine is None
        else {"url": rec.engine.url, "model_name": rec.engine.model_name, "engine": rec.engine.engine},
    }


def describe_config(c: dict[str, Any] | None) -> str:
    """One line for a config as ``_config`` (stored columns) or vLLM's speculative config gives it."""
    from policies.spec_config import SpecConfig

    if c is None:
        return "unknown (nothing recorded yet)"
    if isinstance(c.get("spec_config"), dict):
        c = c["spec_config"]
    elif "num_spec_tokens" in c or "draft_model" in c:
        table = c.get("k_table")
        spec = SpecConfig(
            str(c.get("method", "?")),
            c.get("draft_model"),
            c.get("num_spec_tokens"),
            tuple(tuple(r) for r in table) if table else None,
        )
        return spec.describe()
    try:
        return SpecConfig.from_vllm(c).describe()
    except ValueError as exc:
        return f"unreadable config ({exc})"


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _print_human(data: dict[str, Any], now: datetime) -> None:
    from rich.markup import escape
    from rich.table import Table

    class _EscapingTable(Table):
        """Cells hold user text (paths, messages): never read it as Rich markup."""

        def add_row(self, *cells: Any, **kwargs: Any) -> None:
            super().add_row(*(escape(c) if isinstance(c, str) else c for c in cells), **kwargs)

    if data["paused"]:
        for p in data["pauses"]:
            how_long = ago(datetime.fromisoformat(p["created_at"]), now)
            note(
                f"since {short_time(p['created_at'])} UTC ({how_long}): {p['message']} "
                f"(audit id {p['id']}; `spectuner resume` lifts it)",
                label="PAUSED",
            )
    else:
        say("controller: not paused")
    for o in data["pending_overrides"]:
        note(
            f"audit id {o['id']}, by {o['by']}, {short_time(o['created_at'])} UTC: "
            f"{describe_config(o['proposed_config'])}",
            label="override waiting",
        )
    if not data["engines"]:
        say(f"no engine series in {data['db']} yet: start the collector (`spectuner run` or `collect`)")
        return
    for e in data["engines"]:
        title = escape(f"{e['model_name']} / engine {e['engine']} @ {e['url']}")
        table = _EscapingTable(title=title, title_justify="left", show_header=False)
        table.add_column("what")
        table.add_column("value")
        c = e["config"]
        table.add_row("config", describe_config(c))
        if c is not None:
            who = f" by {c['by']}" if c["by"] else ""
            started = datetime.fromisoformat(c["since"])
            since = f"{short_time(c['since'])} UTC ({ago(started, now)})"
            table.add_row("in force since", f"{since}, applied by {c['applied_by']}{who}")
        last_end = e["last_window_end"]
        table.add_row("last window", "none" if last_end is None else ago(datetime.fromisoformat(last_end), now))
        w = e["window"]
        if w["windows"]:
            ci = w["alpha_ci"]
            alpha = "—" if w["alpha"] is None else f"{w['alpha']:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
            evidence = f"from {w['drafts']:,} drafts in {w['windows']} windows"
            table.add_row(f"α̂ (last {w['window_s']:g} s)", f"{alpha}  {evidence}")
            table.add_row("draft acceptance rate A/T", _fmt(w["draft_acceptance_rate"]))
            table.add_row("mean acceptance length", _fmt(w["mean_acceptance_length"], 2))
            table.add_row("throughput", f"{_fmt(w['throughput_tokens_per_s'], 1)} generated tokens/s")
        else:
            table.add_row(f"last {w['window_s']:g} s", "no windows (is the collector running?)")
        for p in e["pending"]:
            table.add_row(
                "pending", f"{p['action']} {p['status']} (audit id {p['id']}): {describe_config(p['proposed_config'])}"
            )
        d = e["last_decision"]
        if d is not None:
            what = f"{d['action']} / {d['reason']} → {d['status']} (audit id {d['id']})"
            table.add_row("last decision", f"{short_time(d['created_at'])} UTC {what}: {d['message']}")
        lengths = e["by_context_length"]
        for b in lengths["bands"]:
            if b["alpha"] is None:
                continue
            span = f"{b['lo_tokens']:,}–{b['hi_tokens']:,}" if b["hi_tokens"] else f"≥ {b['lo_tokens']:,}"
            ci = b["alpha_ci"]
            table.add_row(
                f"α̂ at {span} tokens",
                f"{b['alpha']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]  from {b['drafts']:,} drafts, {b['requests']} requests",
            )
        if any(b["alpha"] is not None for b in lengths["bands"]):
            table.add_row("by context length", lengths["message"])
        ev = e["events"]
        table.add_row(
            f"events (last {data['events_window_s'] / 3600:g} h)",
            f"{ev['critical']} critical, {ev['warning']} warning, {ev['info']} info",
        )
        out_console.print(table)


def register(app: typer.Typer) -> None:
    app.command("status")(status)
