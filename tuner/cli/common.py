"""Shared CLI plumbing: exit codes from docs/architecture.md, JSON output, clear errors."""

from __future__ import annotations

import getpass
import json
import math
import os
import re
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2

err_console = Console(stderr=True)
out_console = Console()


def fail_usage(message: str) -> NoReturn:
    """A usage or configuration error: say what is wrong and how to fix it, exit 2."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(EXIT_USAGE)


def fail_runtime(message: str) -> NoReturn:
    """A runtime failure (engine down, database unreachable...): exit 1."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(EXIT_RUNTIME)


def require_range(
    option: str, value: float, *, low: float | None = None, high: float | None = None, low_open: bool = False
) -> None:
    """Exit 2 unless ``value`` is a finite number in ``[low, high]`` (``(low, high]`` with ``low_open``):
    NaN and infinities are refused by name, never compared (``nan <= 0`` is False)."""
    if math.isnan(value) or math.isinf(value):
        fail_usage(f"{option} must be a finite number but got {value}")
    if low is not None and (value <= low if low_open else value < low):
        bound = "positive" if low_open and low == 0 else f"{'above' if low_open else 'at least'} {low:g}"
        fail_usage(f"{option} must be {bound} but got {value:g}")
    if high is not None and value > high:
        fail_usage(f"{option} must be at most {high:g} but got {value:g}")


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


# --- shared by the admin commands (status, history, apply, pause/resume, drafts) -----------------
# Heavy modules (the store: sqlalchemy, alembic) are imported inside the functions so that importing
# this module stays cheap for every command.

USER_ENV_VAR = "SPECTUNER_USER"
DB_HELP = "Database URL (default: [database] url of --config, $SPECTUNER_DB, else spectuner.db beside --config)."
CONFIG_HELP = "The daemon's spectuner.toml: its database, engine URL and policy.k_max."
JSON_HELP = "Print one JSON document."
BY_HELP = "Who is acting, for the audit log (default: $SPECTUNER_USER, else the login name)."


def default_by(by: str | None) -> str:
    """``--by``, else ``$SPECTUNER_USER``, else the login name (``uid:N`` where there is none)."""
    if by is not None:
        if not by.strip():
            fail_usage("--by cannot be empty; give a name for the audit log")
        return by.strip()
    env = os.environ.get(USER_ENV_VAR, "").strip()
    if env:
        return env
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no login name and no passwd entry (some containers)
        return f"uid:{os.getuid()}"


def load_config_or_exit(config: Path | None) -> Any:
    """The validated ``SpectunerConfig`` of ``--config``, or None without one; a bad file exits 2."""
    if config is None:
        return None
    from tuner.config import ConfigError, load_config

    try:
        return load_config(config)
    except ConfigError as exc:
        fail_usage(str(exc))


def open_store(db: str | None, config: Path | None, cfg: Any = None, *, read_only: bool = False) -> Any:
    """Open the store the daemon uses: ``--db``, else ``[database] url`` of ``--config``, else
    ``$SPECTUNER_DB``, else ``spectuner.db`` beside ``--config`` (or here).

    A bad URL or a missing/old/newer schema exits 2 with the command that fixes it; a database that
    cannot be reached exits 1.
    """
    from sqlalchemy.exc import SQLAlchemyError

    from tuner.store import DatabaseUrlError, SchemaError, Store, resolve_db_url
    from tuner.store.url import render_url

    if cfg is None:
        cfg = load_config_or_exit(config)
    configured = cfg.database.url if cfg is not None else None
    try:
        url = resolve_db_url(db or configured, config)
    except DatabaseUrlError as exc:
        fail_usage(str(exc))
    try:
        return Store(url, read_only=read_only)
    except (DatabaseUrlError, SchemaError) as exc:
        fail_usage(str(exc))
    except SQLAlchemyError as exc:
        fail_runtime(f"cannot use the database at {render_url(url)}: {db_error_detail(exc)}")


def db_error_detail(exc: BaseException) -> str:
    """The driver's first line (refused, unknown host, auth...), without the SQL or a password."""
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


_AGO = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$", re.IGNORECASE)
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_since(text: str, now: datetime, option: str = "--since") -> datetime:
    """``90s``, ``30m``, ``24h``, ``7d``, ``2w`` (that long before ``now``) or an ISO 8601 time with a
    zone (as `spectuner report` reads them: a time without a zone is refused rather than guessed)."""
    m = _AGO.match(text)
    if m:
        try:
            return now - timedelta(seconds=float(m.group(1)) * _UNIT_S[m.group(2).lower()])
        except OverflowError:  # datetime stops at year 1
            fail_usage(f"{option} {text!r} reaches before year 1; give a shorter duration or an ISO time")
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        fail_usage(
            f"{option} must be a duration such as 30m, 24h, 7d or an ISO time such as 2026-12-01T08:00:00Z "
            f"but got {text!r}"
        )
    if when.tzinfo is None:
        fail_usage(f"{option} {text!r} has no time zone: add Z for UTC or an offset (2026-12-02T14:00:00+01:00)")
    return when.astimezone(UTC)


def iso(when: datetime | None) -> str | None:
    return None if when is None else when.astimezone(UTC).isoformat()


def ago(when: datetime | None, now: datetime) -> str:
    """``"3m12s ago"`` for a human; ``"—"`` for None."""
    if when is None:
        return "—"
    seconds = int((now - when).total_seconds())
    if seconds < 0:
        return "in the future"
    for big, big_s, small, small_s in (("d", 86400, "h", 3600), ("h", 3600, "m", 60), ("m", 60, "s", 1)):
        if seconds >= big_s:
            rest = (seconds % big_s) // small_s
            return f"{seconds // big_s}{big}{rest}{small} ago" if rest else f"{seconds // big_s}{big} ago"
    return f"{seconds}s ago"


def confirm_or_exit(question: str, yes: bool) -> None:
    """Ask on the terminal (on stderr, so --json stays one document); ``--yes`` skips. Without a
    terminal and without ``--yes``, exit 2: nobody can answer. A "no" exits 1 and writes nothing."""
    if yes:
        return
    if not sys.stdin.isatty():
        fail_usage("this changes what the controller does and there is no terminal to confirm on: pass --yes")
    if not typer.confirm(question, default=False, err=True):
        err_console.print("cancelled; nothing was written", highlight=False)
        raise typer.Exit(EXIT_RUNTIME)


def say(text: str, *, err: bool = False) -> None:
    """Print a plain sentence: no Rich markup (user text may hold [brackets]), no hard wrapping."""
    (err_console if err else out_console).print(text, markup=False, highlight=False, soft_wrap=True)


def note(text: str, *, label: str = "note", err: bool = False) -> None:
    """``note: ...`` with the label in yellow; ``text`` is printed as is."""
    from rich.markup import escape

    (err_console if err else out_console).print(f"[yellow]{label}:[/] {escape(text)}", highlight=False, soft_wrap=True)


def short_time(iso_text: str | None) -> str:
    """``2026-12-02 16:29:26`` from an ISO UTC time (tables)."""
    return "—" if not iso_text else iso_text[:19].replace("T", " ")
