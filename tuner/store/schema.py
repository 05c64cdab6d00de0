"""Schema versions: Alembic driven from code, and the check that refuses an out-of-date database.

The Alembic environment ships inside the package (``migrations/``); there is no alembic.ini. Every
upgrade and downgrade runs in one transaction (PostgreSQL and SQLite both have transactional DDL), so
a failed migration leaves the previous version intact.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Engine, func, inspect, select, table
from sqlalchemy.exc import DatabaseError

import migrations
from tuner.store.connect import WRITE_OPTION, make_engine
from tuner.store.models import Base
from tuner.store.url import normalize_db_url, parse_db_url, render_url, sqlite_path


class SchemaError(RuntimeError):
    """The database schema cannot be used as it is. ``fix`` is the command that repairs it."""

    def __init__(self, message: str, fix: str | None = None) -> None:
        super().__init__(message)
        self.fix = fix


class SchemaMissingError(SchemaError):
    """No spectuner schema at that URL (no file, or no tables yet)."""


class SchemaOutOfDateError(SchemaError):
    """The schema is older than this spectuner needs."""


class SchemaTooNewError(SchemaError):
    """The schema was written by a newer spectuner; this one must not touch it."""


class SchemaUnreadableError(SchemaError):
    """The database cannot be read as a spectuner database (not a database file, a version table
    with several rows...)."""


class RevisionError(ValueError):
    """A revision argument that names nothing (``spectuner db downgrade NOPE``)."""


@dataclass(frozen=True)
class MigrationResult:
    url: str  # password hidden
    from_revision: str | None
    to_revision: str | None


def upgrade_command(url: str) -> str:
    """The exact command that brings ``url`` up to date (password hidden)."""
    return f"spectuner db upgrade --db {render_url(url)}"


def alembic_config(url: str | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    if url is not None:
        # ConfigParser interpolation would eat a '%' in a password.
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def script_directory() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config())


def head_revision() -> str:
    """The revision this code expects. There is exactly one head (a test holds us to it)."""
    head = script_directory().get_current_head()
    if head is None:  # pragma: no cover - the package always ships versions
        raise RuntimeError("migrations/versions is empty: the installed spectuner package is broken")
    return head


def current_revision(url: str) -> str | None:
    """The revision stamped in the database, or ``None`` when it has no schema.

    A SQLite file that does not exist is reported as ``None`` and is not created.
    """
    normalized = normalize_db_url(url)
    path = sqlite_path(normalized)
    if path is not None and not path.exists():
        return None
    engine = make_engine(normalized, read_only=True)
    try:
        return _current(engine)
    finally:
        engine.dispose()


def _current(engine: Engine) -> str | None:
    shown = render_url(engine.url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    except CommandError as exc:  # alembic: more than one row in alembic_version
        raise SchemaUnreadableError(
            f"the database at {shown} has several revisions in its alembic_version table ({exc}); spectuner "
            "never writes that: it was edited by hand or is another application's. Restore it from a backup "
            "or point --db at another database"
        ) from None
    except DatabaseError as exc:
        detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        if engine.dialect.name == "sqlite" and ("not a database" in detail or "encrypted" in detail):
            raise SchemaUnreadableError(
                f"{shown} is not a SQLite database ({detail}); point --db at a spectuner database or a new file"
            ) from None
        raise


def _refuse_unknown(url: str, current: str | None, verb: str) -> None:
    """A revision this code does not know was written by a newer spectuner: never migrate it."""
    if current is None or current in {rev.revision for rev in script_directory().walk_revisions()}:
        return
    raise SchemaTooNewError(
        f"cannot {verb} {render_url(url)}: its schema revision {current!r} is not one this spectuner knows "
        f"(its newest is {head_revision()!r}); it was written by a newer spectuner: {verb} with that version"
    )


def check_schema(url_or_engine: str | Engine, *, read_only: bool = False) -> str:
    """Return the current revision if it is this code's head; otherwise raise a :class:`SchemaError`
    whose message names the command that fixes it."""
    if isinstance(url_or_engine, str):
        url = normalize_db_url(url_or_engine)
        path = sqlite_path(url)
        if path is not None and not path.exists():
            raise SchemaMissingError(
                f"no database at {render_url(url)} (file {path} does not exist): "
                f"create it with `{upgrade_command(url)}`",
                upgrade_command(url),
            )
        engine = make_engine(url, read_only=read_only)
        try:
            return _check(engine, url)
        finally:
            engine.dispose()
    return _check(url_or_engine, url_or_engine.url.render_as_string(hide_password=False))


def _check(engine: Engine, url: str) -> str:
    current = _current(engine)
    head = head_revision()
    fix = upgrade_command(url)
    if current is None:
        raise SchemaMissingError(
            f"the database at {render_url(url)} has no spectuner schema: create it with `{fix}`", fix
        )
    if current == head:
        return current
    known = {rev.revision for rev in script_directory().walk_revisions()}
    if current not in known:
        raise SchemaTooNewError(
            f"the database at {render_url(url)} has schema revision {current!r}, which this "
            f"spectuner does not know (its newest is {head!r}): it was written by a newer spectuner; "
            "upgrade spectuner, or point --db at another database"
        )
    raise SchemaOutOfDateError(
        f"the database at {render_url(url)} has schema revision {current!r} but this spectuner "
        f"needs {head!r}: run `{fix}`",
        fix,
    )


def upgrade(url: str, revision: str = "head") -> MigrationResult:
    """Upgrade (creating a SQLite file if needed) to ``revision``; one transaction."""
    normalized = normalize_db_url(url)
    path = sqlite_path(normalized)
    if path is not None and not path.parent.exists():
        raise RevisionError(
            f"cannot create {path}: directory {path.parent} does not exist; create it or choose another --db"
        )
    if path is not None and not os.access(path.parent, os.W_OK | os.X_OK):
        # SQLite writes its journal beside the file: a read-only directory fails even for an existing file.
        raise RevisionError(
            f"cannot write {path}: directory {path.parent} is not writable by this user; "
            "fix its permissions or choose another --db"
        )
    return _migrate(normalized, revision, up=True)


def downgrade(url: str, revision: str = "-1") -> MigrationResult:
    """Downgrade to ``revision`` (an id, ``base``, or relative like ``-1``); one transaction."""
    normalized = normalize_db_url(url)
    path = sqlite_path(normalized)
    if path is not None and not path.exists():
        raise SchemaMissingError(f"no database at {render_url(normalized)}: nothing to downgrade")
    return _migrate(normalized, revision, up=False)


@dataclass(frozen=True)
class DowngradePlan:
    """What a downgrade would remove: each table it drops with its row count (found by running the
    downgrade in a transaction that is rolled back)."""

    url: str  # password hidden
    from_revision: str | None
    to_revision: str | None
    dropped: tuple[tuple[str, int], ...]

    @property
    def rows_lost(self) -> int:
        return sum(n for _, n in self.dropped)


def downgrade_plan(url: str, revision: str = "-1") -> DowngradePlan:
    """What :func:`downgrade` to ``revision`` would drop, without changing anything."""
    normalized = normalize_db_url(url)
    path = sqlite_path(normalized)
    if path is not None and not path.exists():
        raise SchemaMissingError(f"no database at {render_url(normalized)}: nothing to downgrade")
    cfg = alembic_config(normalized)
    engine = make_engine(normalized)
    try:
        before = _current(engine)
        _refuse_unknown(normalized, before, "downgrade")
        with engine.execution_options(**{WRITE_OPTION: True}).connect() as conn:
            trans = conn.begin()
            try:
                tables = set(inspect(conn).get_table_names())
                counts = {t: int(conn.execute(select(func.count()).select_from(table(t))).scalar_one()) for t in tables}
                cfg.attributes["connection"] = conn
                command.downgrade(cfg, revision)
                after_tables = set(inspect(conn).get_table_names())
                after = MigrationContext.configure(conn).get_current_revision()
            except CommandError as exc:
                known = ", ".join(rev.revision for rev in script_directory().walk_revisions())
                raise RevisionError(
                    f"cannot downgrade {render_url(normalized)} to {revision!r} from {before!r}: {exc}. Known "
                    f"revisions: {known}, plus 'head', 'base' and relative steps like -1"
                ) from exc
            finally:
                trans.rollback()
    finally:
        engine.dispose()
    dropped = tuple(sorted((t, counts[t]) for t in tables - after_tables - {"alembic_version"}))
    return DowngradePlan(render_url(normalized), before, after, dropped)


def foreign_tables(url: str) -> list[str]:
    """Tables in the database that are not spectuner's (another application's), sorted."""
    normalized = normalize_db_url(url)
    path = sqlite_path(normalized)
    if path is not None and not path.exists():
        return []
    engine = make_engine(normalized)
    try:
        with engine.connect() as conn:
            names = set(inspect(conn).get_table_names())
    finally:
        engine.dispose()
    return sorted(names - set(Base.metadata.tables) - {"alembic_version"})


def _migrate(url: str, revision: str, *, up: bool) -> MigrationResult:
    parse_db_url(url)
    cfg = alembic_config(url)
    engine = make_engine(url)
    try:
        before = _current(engine)
        _refuse_unknown(url, before, "upgrade" if up else "downgrade")
        with engine.execution_options(**{WRITE_OPTION: True}).begin() as conn:
            cfg.attributes["connection"] = conn
            try:
                if up:
                    command.upgrade(cfg, revision)
                else:
                    command.downgrade(cfg, revision)
            except CommandError as exc:
                known = ", ".join(rev.revision for rev in script_directory().walk_revisions())
                raise RevisionError(
                    f"cannot {'upgrade' if up else 'downgrade'} {render_url(url)} to {revision!r} "
                    f"from {before!r}: {exc}. Known revisions: {known}, plus 'head', 'base' and "
                    "relative steps like -1"
                ) from exc
        after = _current(engine)
    finally:
        engine.dispose()
    return MigrationResult(url=render_url(url), from_revision=before, to_revision=after)
