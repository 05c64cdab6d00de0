"""SQLAlchemy engines configured for spectuner's workload on each backend.

SQLite: WAL (readers never block the writer, a killed writer never corrupts the file), a busy
timeout (collector, tap and daemon are separate writers), foreign keys on, ``synchronous=NORMAL``
(WAL stays consistent on a crash; only the last commits may be lost on power failure). Transactions
are begun explicitly — ``BEGIN IMMEDIATE`` for writes, so a writer waits for the lock up front
instead of failing to upgrade a read lock mid-transaction.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event

from tuner.store.url import parse_db_url

SQLITE_BUSY_TIMEOUT_MS = 30_000
# Execution option a write transaction carries so the SQLite ``begin`` hook takes the lock at once.
WRITE_OPTION = "spectuner_write"


def make_engine(
    url: str, *, busy_timeout_ms: int = SQLITE_BUSY_TIMEOUT_MS, echo: bool = False, read_only: bool = False
) -> Engine:
    """An engine for ``url`` (already normalised or not); raises ``DatabaseUrlError`` on a bad URL.

    ``read_only`` (status, history, report, db current): a SQLite file in a directory this user cannot
    write is opened read-only, without the WAL set-up (which writes); see :func:`_read_only_creator`.
    """
    parsed = parse_db_url(url)
    if parsed.get_backend_name() == "sqlite":
        path = Path(parsed.database or "")
        if read_only and path.exists() and not os.access(path.parent, os.W_OK | os.X_OK):
            engine = create_engine(parsed, echo=echo, creator=_read_only_creator(path, busy_timeout_ms))
            _configure_sqlite(engine, busy_timeout_ms, wal=False)
            return engine
        engine = create_engine(
            parsed, echo=echo, connect_args={"timeout": busy_timeout_ms / 1000.0, "check_same_thread": False}
        )
        _configure_sqlite(engine, busy_timeout_ms)
        return engine
    return create_engine(parsed, echo=echo, pool_pre_ping=True, connect_args={"connect_timeout": 10})


def _read_only_creator(path: Path, busy_timeout_ms: int) -> Callable[[], sqlite3.Connection]:
    """Connections that never write. SQLite cannot create a WAL index (``-shm``) in a read-only
    directory: when a writer has it open (``-wal`` exists) a plain read-only open shares it; when none
    does, nothing can change the file, so it is opened as immutable."""
    wal = path.with_name(path.name + "-wal")

    def connect() -> sqlite3.Connection:
        flags = "mode=ro" if wal.exists() else "mode=ro&immutable=1"
        uri = f"{path.absolute().as_uri()}?{flags}"
        return sqlite3.connect(uri, uri=True, timeout=busy_timeout_ms / 1000.0, check_same_thread=False)

    return connect


def _configure_sqlite(engine: Engine, busy_timeout_ms: int, *, wal: bool = True) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Hand transaction control to SQLAlchemy (pysqlite's implicit BEGIN is deferred and skips
        # DDL); see the ``begin`` hook below.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            if wal:  # setting the journal mode writes to the file
                cursor.execute("PRAGMA journal_mode = WAL")
                cursor.execute("PRAGMA synchronous = NORMAL")
            cursor.execute("PRAGMA foreign_keys = ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        if conn.get_execution_options().get(WRITE_OPTION):
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            conn.exec_driver_sql("BEGIN")
