"""SQLAlchemy engines configured for spectuner's workload on each backend.

SQLite: WAL (readers never block the writer, a killed writer never corrupts the file), a busy
timeout (collector, tap and daemon are separate writers), foreign keys on, ``synchronous=NORMAL``
(WAL stays consistent on a crash; only the last commits may be lost on power failure). Transactions
are begun explicitly — ``BEGIN IMMEDIATE`` for writes, so a writer waits for the lock up front
instead of failing to upgrade a read lock mid-transaction.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine, event

from tuner.store.url import parse_db_url

SQLITE_BUSY_TIMEOUT_MS = 30_000
# Execution option a write transaction carries so the SQLite ``begin`` hook takes the lock at once.
WRITE_OPTION = "spectuner_write"


def make_engine(url: str, *, busy_timeout_ms: int = SQLITE_BUSY_TIMEOUT_MS, echo: bool = False) -> Engine:
    """An engine for ``url`` (already normalised or not); raises ``DatabaseUrlError`` on a bad URL."""
    parsed = parse_db_url(url)
    if parsed.get_backend_name() == "sqlite":
        engine = create_engine(
            parsed, echo=echo, connect_args={"timeout": busy_timeout_ms / 1000.0, "check_same_thread": False}
        )
        _configure_sqlite(engine, busy_timeout_ms)
        return engine
    return create_engine(parsed, echo=echo, pool_pre_ping=True, connect_args={"connect_timeout": 10})


def _configure_sqlite(engine: Engine, busy_timeout_ms: int) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Hand transaction control to SQLAlchemy (pysqlite's implicit BEGIN is deferred and skips
        # DDL); see the ``begin`` hook below.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
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
