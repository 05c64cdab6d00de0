"""Column types shared by the models and the migrations: UTC timestamps, portable JSON, 64-bit ids.

Kept apart from ``models`` so migration files can import them without importing the models (a
migration must keep working after the models move on).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, DateTime, Integer
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator, TypeEngine


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp on every backend.

    PostgreSQL stores ``timestamptz``. SQLite has no timezone type, so the value is stored as naive
    UTC (SQLAlchemy's fixed-width ISO text, which sorts correctly for range queries) and given back
    its UTC tzinfo on read. Naive datetimes are refused: a naive local time would silently shift.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(
                f"naive datetime {value.isoformat()!r}: spectuner stores UTC; "
                "pass a timezone-aware value, e.g. datetime.now(UTC)"
            )
        value = value.astimezone(UTC)
        if dialect.name == "sqlite":
            return value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def json_type() -> TypeEngine[Any]:
    """JSON everywhere, JSONB on PostgreSQL (indexable, compact)."""
    return JSON().with_variant(JSONB(), "postgresql")


def id_type() -> TypeEngine[int]:
    """64-bit ids on PostgreSQL; SQLite only auto-increments ``INTEGER PRIMARY KEY`` (the rowid)."""
    return BigInteger().with_variant(Integer(), "sqlite")
