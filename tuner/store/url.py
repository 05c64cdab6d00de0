"""Which database: ``--db``, else ``$SPECTUNER_DB``, else ``sqlite:///spectuner.db`` beside the config.

Also normalises the URL (PostgreSQL always through psycopg 3) and renders it for messages with any
password hidden.
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

ENV_VAR = "SPECTUNER_DB"
DEFAULT_FILENAME = "spectuner.db"

_SUPPORTED = ("sqlite", "postgresql")


class DatabaseUrlError(ValueError):
    """The database URL cannot be used; the message says why and what to write instead."""


def resolve_db_url(cli_value: str | None, config_path: str | os.PathLike[str] | None = None) -> str:
    """The database URL to use, by the precedence in docs/architecture.md, normalised (see :func:`normalize_db_url`).

    ``cli_value`` is ``--db`` as given (``None`` or empty when absent). The default SQLite file sits
    beside ``config_path`` when there is one, else in the current directory; it is made absolute so
    the daemon and the CLI agree whatever directory they run from.
    """
    if cli_value:
        return normalize_db_url(cli_value)
    env_value = os.environ.get(ENV_VAR, "").strip()
    if env_value:
        return normalize_db_url(env_value)
    base = Path(config_path).resolve().parent if config_path is not None else Path.cwd()
    return f"sqlite:///{base / DEFAULT_FILENAME}"


def parse_db_url(url: str) -> URL:
    """Parse and check a URL; raise :class:`DatabaseUrlError` naming what is wrong."""
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise DatabaseUrlError(
            f"cannot parse database URL {url!r}: use sqlite:///path/to/spectuner.db or "
            "postgresql://user@host:5432/dbname"
        ) from exc
    backend = parsed.get_backend_name()
    if backend == "postgres":  # Heroku-style alias
        parsed = parsed.set(drivername="postgresql+psycopg")
        backend = "postgresql"
    if backend not in _SUPPORTED:
        raise DatabaseUrlError(
            f"unsupported database {backend!r} in {render_url(parsed)!r}: spectuner supports "
            "sqlite:///path/to/spectuner.db and postgresql://user@host:5432/dbname"
        )
    if backend == "postgresql":
        if "+" not in parsed.drivername:
            parsed = parsed.set(drivername="postgresql+psycopg")
        elif parsed.drivername != "postgresql+psycopg":
            raise DatabaseUrlError(
                f"{render_url(parsed)!r} asks for driver {parsed.drivername.split('+', 1)[1]!r}; "
                "spectuner uses psycopg 3: write postgresql://... or postgresql+psycopg://..."
            )
    if backend == "sqlite" and parsed.database in (None, "", ":memory:"):
        raise DatabaseUrlError(
            "an in-memory SQLite database disappears between the migration and the store; "
            "give a file: sqlite:///path/to/spectuner.db"
        )
    return parsed


def normalize_db_url(url: str) -> str:
    """The URL as spectuner connects to it (``postgresql://`` becomes ``postgresql+psycopg://``)."""
    return parse_db_url(url).render_as_string(hide_password=False)


def render_url(url: str | URL) -> str:
    """For messages and logs: the URL with any password replaced by ``***``."""
    if isinstance(url, str):
        try:
            url = make_url(url)
        except ArgumentError:
            return "<unparseable URL>"
    return url.render_as_string(hide_password=True)


def sqlite_path(url: str | URL) -> Path | None:
    """The file of a SQLite URL, or ``None`` for other backends."""
    parsed = make_url(url) if isinstance(url, str) else url
    if parsed.get_backend_name() != "sqlite" or not parsed.database:
        return None
    return Path(parsed.database)
