"""`spectuner report`: a self-contained HTML report (plots embedded) and report.json from the store."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import typer

from tuner.cli.common import fail_runtime, fail_usage, out_console, print_json

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class TimeArgumentError(ValueError):
    """A --since/--until value that is neither a duration nor an ISO 8601 time."""


def parse_time(text: str, option: str, now: datetime) -> datetime:
    """``90s``/``15m``/``2h``/``7d``/``1w`` (that long before ``now``) or an ISO 8601 time. A time
    without a zone is refused rather than guessed."""
    match = _DURATION.match(text)
    if match:
        return now - timedelta(seconds=float(match.group(1)) * _UNIT_S[match.group(2)])
    try:
        value = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise TimeArgumentError(
            f"{option} {text!r} is neither a duration (90s, 15m, 2h, 7d, 1w) nor an ISO 8601 time "
            "(2026-12-02T14:00:00Z)"
        ) from None
    if value.tzinfo is None:
        raise TimeArgumentError(
            f"{option} {text!r} has no time zone: add Z for UTC or an offset (2026-12-02T14:00:00+01:00)"
        )
    return value.astimezone(UTC)


def report(
    out: Path = typer.Option(..., "--out", help="Directory to write index.html and report.json into (created)."),
    db: str | None = typer.Option(
        None, "--db", help="Database URL (default: $SPECTUNER_DB, else sqlite:///spectuner.db here)."
    ),
    since: str | None = typer.Option(None, "--since", help="Start of the range: 2h, 7d, ... or an ISO time."),
    until: str | None = typer.Option(None, "--until", help="End of the range (exclusive): a duration ago or ISO."),
    as_json: bool = typer.Option(False, "--json", help="Print what was written as JSON."),
) -> None:
    """Write a self-contained HTML report (α̂ over time, per-position acceptance, K/draft/decisions,
    goodput against K, predicted against realized gain) and report.json.

    --since/--until take a duration before now (90s, 15m, 2h, 7d, 1w) or an ISO 8601 time with a zone.
    """
    from sqlalchemy.exc import SQLAlchemyError

    from tuner.report import write_report
    from tuner.store import DatabaseUrlError, SchemaError, Store, resolve_db_url
    from tuner.store.rows import InvalidRecordError
    from tuner.store.url import render_url

    now = datetime.now(UTC)
    try:
        since_t = parse_time(since, "--since", now) if since else None
        until_t = parse_time(until, "--until", now) if until else None
    except TimeArgumentError as exc:
        fail_usage(str(exc))
    if since_t is not None and until_t is not None and until_t <= since_t:
        fail_usage(f"--until ({until_t.isoformat()}) must be after --since ({since_t.isoformat()})")
    if out.exists() and not out.is_dir():
        fail_usage(f"--out {out} exists and is not a directory: give a directory to write the report into")
    try:
        url = resolve_db_url(db)
    except DatabaseUrlError as exc:
        fail_usage(str(exc))
    try:
        store = Store(url, read_only=True)
    except SchemaError as exc:
        fail_usage(str(exc))
    except SQLAlchemyError as exc:
        fail_runtime(f"cannot open the database at {render_url(url)}: {_first_line(exc)}")
    try:
        with store:
            result = write_report(store, out, since=since_t, until=until_t, now=now)
    except InvalidRecordError as exc:
        fail_usage(str(exc))
    except SQLAlchemyError as exc:
        fail_runtime(f"cannot read the database at {render_url(url)}: {_first_line(exc)}")
    except OSError as exc:
        fail_runtime(f"cannot write the report into {out}: {exc}")

    summary = {
        "out": str(result.out_dir),
        "index_html": str(result.index_html),
        "report_json": str(result.report_json),
        "images": list(result.images),
        "missing": result.missing,
        "engines": [e.label for e in result.data.engines],
        "windows": sum(e.windows for e in result.data.engines),
        "decisions": len(result.data.decisions),
    }
    if as_json:
        print_json(summary)
        return
    out_console.print(
        f"wrote {result.index_html} ({len(result.images)} plot(s), {summary['windows']} window(s), "
        f"{summary['decisions']} decision(s))",
        highlight=False,
    )
    for section, why in result.missing.items():
        out_console.print(f"[yellow]no {section} plot:[/] {why}", highlight=False)


def _first_line(exc: Exception) -> str:
    return str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]


def register(app: typer.Typer) -> None:
    app.command("report")(report)
