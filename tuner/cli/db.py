"""`spectuner db upgrade|current|downgrade`: the store's schema, driven from code (no alembic.ini)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer
from sqlalchemy.exc import SQLAlchemyError

from tuner.cli.common import confirm_or_exit, fail_runtime, fail_usage, out_console, print_json, say
from tuner.store import schema
from tuner.store.url import DatabaseUrlError, render_url, resolve_db_url

_DB_HELP = "Database URL (default: $SPECTUNER_DB, else sqlite:///spectuner.db beside --config)."
_CONFIG_HELP = "spectuner.toml whose directory holds the default SQLite file."

db_app = typer.Typer(
    name="db",
    help="Database schema: create or upgrade it, show its revision, step it back.",
    no_args_is_help=True,
)


def _url(db: str | None, config: Path | None) -> str:
    try:
        return resolve_db_url(db, config)
    except DatabaseUrlError as exc:
        fail_usage(str(exc))


def _db_failure(url: str, exc: SQLAlchemyError) -> None:
    # The driver's first line says what went wrong (refused, unknown host, auth...).
    detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
    fail_runtime(f"cannot use the database at {render_url(url)}: {detail}")


@db_app.command("upgrade")
def upgrade_cmd(
    db: str | None = typer.Option(None, "--db", help=_DB_HELP),
    config: Path | None = typer.Option(None, "--config", help=_CONFIG_HELP),
    revision: str = typer.Option("head", "--revision", help="Target revision (default: the newest)."),
    allow_foreign_tables: bool = typer.Option(
        False, "--allow-foreign-tables", help="Create spectuner's tables beside another application's."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Create the schema, or bring it up to this spectuner's revision. One transaction."""
    url = _url(db, config)
    try:
        if not allow_foreign_tables and schema.current_revision(url) is None:
            others = schema.foreign_tables(url)
            if others:
                fail_usage(
                    f"{render_url(url)} holds {len(others)} table(s) that are not spectuner's "
                    f"({', '.join(others[:5])}{', ...' if len(others) > 5 else ''}): it looks like another "
                    "application's database. Point --db at a database of its own, or pass --allow-foreign-tables"
                )
        result = schema.upgrade(url, revision)
    except (schema.RevisionError, schema.SchemaError) as exc:
        fail_usage(str(exc))
    except SQLAlchemyError as exc:
        _db_failure(url, exc)
    _report("upgraded", result, as_json)


@db_app.command(
    "downgrade",
    # So that `spectuner db downgrade -1` reads -1 as the revision, not an unknown option.
    context_settings={"ignore_unknown_options": True},
)
def downgrade_cmd(
    revision: str = typer.Argument("-1", help="Revision id, 'base', or a relative step like -1."),
    db: str | None = typer.Option(None, "--db", help=_DB_HELP),
    config: Path | None = typer.Option(None, "--config", help=_CONFIG_HELP),
    yes: bool = typer.Option(False, "--yes", "-y", help="Drop tables that hold rows without asking."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Step the schema back (default one revision). Tables a step removes lose their rows: it says
    which and how many, and asks first (``--yes`` skips)."""
    url = _url(db, config)
    try:
        plan = schema.downgrade_plan(url, revision)
        if plan.rows_lost:
            lost = ", ".join(f"{name} ({rows} rows)" for name, rows in plan.dropped if rows)
            say(
                f"downgrading {plan.url} from {plan.from_revision} to {plan.to_revision or 'empty'} drops "
                f"{len(plan.dropped)} table(s); these hold data: {lost}. Back it up first "
                f"({_backup_hint(url)}).",
                err=True,
            )
            if not yes and not sys.stdin.isatty():
                fail_usage(
                    f"this downgrade would delete {plan.rows_lost} row(s) and there is no terminal to confirm on: "
                    "back the database up, then pass --yes"
                )
            confirm_or_exit(f"Drop {plan.rows_lost} row(s)?", yes)
        result = schema.downgrade(url, revision)
    except (schema.RevisionError, schema.SchemaError) as exc:
        fail_usage(str(exc))
    except SQLAlchemyError as exc:
        _db_failure(url, exc)
    _report("downgraded", result, as_json)


@db_app.command("current")
def current_cmd(
    db: str | None = typer.Option(None, "--db", help=_DB_HELP),
    config: Path | None = typer.Option(None, "--config", help=_CONFIG_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show the database's schema revision and whether it is what this spectuner needs."""
    url = _url(db, config)
    try:
        current = schema.current_revision(url)
    except schema.SchemaError as exc:
        fail_usage(str(exc))
    except SQLAlchemyError as exc:
        _db_failure(url, exc)
    head = schema.head_revision()
    known = [rev.revision for rev in schema.script_directory().walk_revisions()]
    if current == head:
        state, advice = "up_to_date", None
    elif current is None:
        state, advice = "missing", f"create it with `{schema.upgrade_command(url)}`"
    elif current in known:
        state, advice = "behind", f"run `{schema.upgrade_command(url)}`"
    else:
        state, advice = "ahead", "written by a newer spectuner: upgrade spectuner"
    data: dict[str, Any] = {
        "db": render_url(url),
        "revision": current,
        "head": head,
        "state": state,
        "up_to_date": state == "up_to_date",
    }
    if as_json:
        if advice:
            data["fix"] = advice
        print_json(data)
        return
    shown = current or "none (no schema)"
    out_console.print(
        f"{render_url(url)}: revision {shown}; this spectuner needs {head}", highlight=False, soft_wrap=True
    )
    if advice:
        out_console.print(advice, highlight=False, soft_wrap=True)


def _backup_hint(url: str) -> str:
    from tuner.store.url import sqlite_path

    path = sqlite_path(url)
    if path is not None:
        return f'sqlite3 {path} ".backup {path}.bak"'
    return "pg_dump -Fc -f spectuner.dump DBNAME"


def _report(verb: str, result: schema.MigrationResult, as_json: bool) -> None:
    if as_json:
        print_json({"db": result.url, "from": result.from_revision, "to": result.to_revision})
        return
    if result.from_revision == result.to_revision:
        out_console.print(f"{result.url}: already at revision {result.to_revision}", highlight=False, soft_wrap=True)
    else:
        out_console.print(
            f"{result.url}: {verb} from {result.from_revision or 'empty'} to {result.to_revision or 'empty'}",
            highlight=False,
            soft_wrap=True,
        )


def register(app: typer.Typer) -> None:
    app.add_typer(db_app, name="db")
