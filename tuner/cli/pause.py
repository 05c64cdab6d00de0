"""`spectuner pause` / `spectuner resume`: stop and restart the controller's changes.

A pause is an ``in_force`` row in the audit log; the controller reads it on every tick (it keeps
collecting and verifying, but applies nothing, not even a manual override). ``resume`` lifts every
pause in force and writes its own row.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import typer

from tuner.cli.common import (
    BY_HELP,
    CONFIG_HELP,
    DB_HELP,
    JSON_HELP,
    db_error_detail,
    default_by,
    fail_runtime,
    iso,
    open_store,
    print_json,
    say,
)
from tuner.cli.common import note as print_note


def pause(
    note: str = typer.Option("", "--note", help="Why (kept in the audit log)."),
    by: str | None = typer.Option(None, "--by", help=BY_HELP),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    config: Path | None = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Pause the controller: it keeps measuring but changes nothing until `spectuner resume`."""
    from sqlalchemy.exc import SQLAlchemyError

    from tuner.controller import manual

    who = default_by(by)
    store = open_store(db, config)
    try:
        with store:
            already = manual.active_pauses(store)
            audit_id = manual.pause(store, datetime.now(UTC), by=who, note=note.strip())
            row = store.decision(audit_id)
    except SQLAlchemyError as exc:
        fail_runtime(f"cannot use the database {store!r}: {db_error_detail(exc)}")
    result = {
        "audit_id": audit_id,
        "action": row.decision.action,
        "status": row.decision.status,
        "by": who,
        "created_at": iso(row.decision.created_at),
        "message": row.decision.message,
        "already_paused_by": [_who(d) for d in already],
    }
    if as_json:
        print_json(result)
        return
    say(
        f"paused (audit id {audit_id}) by {who} at {result['created_at']}: the controller changes nothing until "
        "`spectuner resume`"
    )
    if already:
        print_note(f"already paused by {', '.join(_who(d) for d in already)}; `resume` lifts every pause")


def resume(
    by: str | None = typer.Option(None, "--by", help=BY_HELP),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    config: Path | None = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Lift every pause in force; the controller acts again on its next tick."""
    from sqlalchemy.exc import SQLAlchemyError

    from tuner.controller import manual

    who = default_by(by)
    store = open_store(db, config)
    try:
        with store:
            lifted = manual.active_pauses(store)
            audit_id = row = None
            if lifted:  # nothing paused: write nothing (a resume row would record nothing that happened)
                audit_id = manual.resume(store, datetime.now(UTC), by=who)
                row = store.decision(audit_id)
    except SQLAlchemyError as exc:
        fail_runtime(f"cannot use the database {store!r}: {db_error_detail(exc)}")
    lifted_rows = [
        {"audit_id": d.id, "by": d.decision.inputs.get("by"), "since": iso(d.decision.created_at)} for d in lifted
    ]
    result: dict[str, Any] = {
        "audit_id": audit_id,
        "action": "resume",
        "status": None if row is None else row.decision.status,
        "by": who,
        "created_at": None if row is None else iso(row.decision.created_at),
        "lifted": lifted_rows,
    }
    if as_json:
        print_json(result)
        return
    if row is None:
        say("the controller is not paused; nothing was written")
        return
    say(
        f"resumed (audit id {audit_id}) by {who} at {result['created_at']}; lifted pause(s) "
        + ", ".join(f"{d['audit_id']} (by {d['by']})" for d in lifted_rows)
    )


def _who(d: Any) -> str:
    return f"{d.decision.inputs.get('by', '?')} since {iso(d.decision.created_at)} (audit id {d.id})"


def register(app: typer.Typer) -> None:
    app.command("pause")(pause)
    app.command("resume")(resume)
