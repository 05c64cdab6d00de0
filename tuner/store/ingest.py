"""Fast batched ingest for the high-volume tables: per-request and per-step rows.

A busy engine produces thousands of step records a minute. Going through a Core ``insert()`` with
one dict per row costs about twice the database's own insert time on SQLite (SQLAlchemy builds the
parameters and runs each column's bind processor per value: see ``bench/bench_store.py``). Here each
record becomes one list of driver-ready values in a single pass that also validates it, and the batch
goes to the driver inside the caller's SQLAlchemy transaction. The encodings
match what the models' types write and read: UTC timestamps as SQLAlchemy's SQLite text format
(or aware datetimes for psycopg), JSON integer lists as compact JSON text.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from itertools import chain
from typing import Any

from sqlalchemy import Connection, Table
from sqlalchemy.exc import DBAPIError

from collectors.records import RequestRecord, StepRecord
from tuner.store.rows import FieldError, check_count, check_measure, check_when

_INF = math.inf

STEP_COLUMNS = (
    "engine_id",
    "config_id",
    "ts",
    "batch_size",
    "step_time_s",
    "num_scheduled_tokens",
    "num_spec_tokens",
    "drafts",
    "draft_tokens",
    "accepted_tokens",
    "accepted_per_pos",
    "draft_tokens_per_pos",
    "generated_tokens",
)
REQUEST_COLUMNS = (
    "ts",
    "request_id",
    "model_name",
    "upstream_url",
    "config_id",
    "prompt_tokens",
    "output_tokens",
    "latency_s",
    "num_spec_tokens",
    "drafts",
    "draft_tokens",
    "accepted_tokens",
    "acceptance_histogram",
    "mean_acceptance_length",
    "draft_acceptance_rate",
    "per_step_accepted",
    "per_step_drafted",
    "streamed",
    "status_code",
)


# "YYYY-MM-DD HH:MM:SS." per whole second: a batch spans a few seconds, and formatting a datetime
# is the single most expensive part of encoding a row. Keyed by the calendar fields (cheaper than
# ``timestamp()``, and right for any date).
_SECOND_PREFIX_CACHE: dict[tuple[int, int, int, int], str] = {}
_SECOND_PREFIX_CACHE_MAX = 4096


def sqlite_ts(value: Any, field: str = "ts") -> str:
    """SQLAlchemy's SQLite DATETIME storage format, in UTC: ``YYYY-MM-DD HH:MM:SS.ffffff``."""
    if type(value) is not datetime or value.tzinfo is not UTC:
        value = check_when(value, field).astimezone(UTC)
    key = (value.toordinal(), value.hour, value.minute, value.second)
    prefix = _SECOND_PREFIX_CACHE.get(key)
    if prefix is None:
        if len(_SECOND_PREFIX_CACHE) >= _SECOND_PREFIX_CACHE_MAX:
            _SECOND_PREFIX_CACHE.clear()
        prefix = _SECOND_PREFIX_CACHE[key] = value.isoformat(" ")[:19] + "."
    return prefix + str(1_000_000 + value.microsecond)[1:]


def pg_ts(value: Any, field: str = "ts") -> datetime:
    if type(value) is datetime and value.tzinfo is UTC:
        return value
    return check_when(value, field).astimezone(UTC)


# Per-position counts repeat a lot (each entry is at most the batch size), so their encoded form is
# cached: a tuple hash is several times cheaper than encoding and checking it again. Bounded; a
# full cache is simply dropped. (Python's 1 == 1.0 == True means an equal tuple of integral floats
# or bools hits too; both are stored as the ints they equal, as the slow path would for floats.)
_INT_LIST_CACHE: dict[tuple[Any, ...], str] = {}
_INT_LIST_CACHE_MAX = 65_536


def int_list(values: Any, field: str) -> str:
    """A sequence of non-negative ints as JSON text. ``repr`` of a list of ints is valid JSON, and
    it is all digits once the brackets and separators go: one C-speed check for the whole list
    (a float, a negative, a bool or a string element all fail it and take the slow path)."""
    if type(values) is tuple:
        cached = _INT_LIST_CACHE.get(values)
        if cached is not None:
            return cached
    try:
        text = str(list(values))
    except TypeError:
        raise FieldError(field, f"is {values!r}; expected a sequence of counts") from None
    if len(text) > 2 and not text[1:-1].replace(", ", "").isdigit():
        return str([check_count(v, f"{field}[{i}]") for i, v in enumerate(values)])
    if type(values) is tuple:
        if len(_INT_LIST_CACHE) >= _INT_LIST_CACHE_MAX:
            _INT_LIST_CACHE.clear()
        _INT_LIST_CACHE[values] = text
    return text


def _text(value: Any, field: str, max_len: int) -> str:
    if type(value) is not str:
        raise FieldError(field, f"is {value!r}; expected a string")
    if len(value) > max_len:
        raise FieldError(field, f"is {len(value)} characters long; at most {max_len} are stored")
    return value


# Bound parameters per SQLite statement: 999 was the compile-time limit before SQLite 3.32 and is
# still safe everywhere a Python's sqlite3 may link against.
SQLITE_MAX_PARAMS = 999


class FastInsert:
    """One table's batched insert in the driver's fastest form, inside the caller's transaction.

    SQLite: one prepared multi-row ``INSERT ... VALUES (...), (...), ...`` of as many rows as fit in
    999 parameters, run by ``executemany`` over the batch (the remainder row by row). Each executed
    statement costs a reset, a bind and a virtual-machine start, so ~50 rows per statement take
    about a third less CPU per row than one row per statement. PostgreSQL: ``COPY ... FROM STDIN``
    (psycopg's executemany costs a round trip per row; COPY streams the batch)."""

    def __init__(self, table: Table, columns: Sequence[str], dialect: str) -> None:
        self.dialect = dialect
        names = ", ".join(columns)
        self.width = len(columns)
        self.rows_per_statement = max(1, SQLITE_MAX_PARAMS // self.width)
        if dialect == "sqlite":
            one = f"({', '.join(['?'] * self.width)})"
            self.sql = f"INSERT INTO {table.name} ({names}) VALUES {one}"
            self.multi_sql = f"INSERT INTO {table.name} ({names}) VALUES {', '.join([one] * self.rows_per_statement)}"
        else:
            self.sql = self.multi_sql = f"COPY {table.name} ({names}) FROM STDIN"
        self.ts: Callable[[Any, str], Any] = sqlite_ts if dialect == "sqlite" else pg_ts

    def execute(self, conn: Connection, rows: list[list[Any]]) -> None:
        """Insert ``rows`` (each ``len(columns)`` values, in order). Driver errors come out as
        SQLAlchemy's (``IntegrityError``...), as they would from ``conn.execute``; the caller's
        transaction then rolls the batch back."""
        dbapi_error = conn.dialect.loaded_dbapi.Error
        cursor: Any = conn.connection.cursor()
        try:
            if self.dialect == "sqlite":
                self._sqlite(cursor, rows)
            else:
                with cursor.copy(self.sql) as copy:
                    for row in rows:
                        copy.write_row(row)
        except dbapi_error as exc:
            raise DBAPIError.instance(self.sql, None, exc, dbapi_error, dialect=conn.dialect) from exc
        finally:
            cursor.close()

    def _sqlite(self, cursor: Any, rows: list[list[Any]]) -> None:
        per, width = self.rows_per_statement, self.width
        whole = len(rows) - len(rows) % per
        if whole:
            flat = list(chain.from_iterable(rows[:whole]))
            if len(flat) != whole * width:  # a short row would shift every value after it
                raise ValueError(f"rows must have {width} values each")
            step = per * width
            cursor.executemany(self.multi_sql, [flat[i : i + step] for i in range(0, len(flat), step)])
        if whole < len(rows):
            cursor.executemany(self.sql, rows[whole:])


def step_values(rec: StepRecord, engine_id: int, ts: Callable[[Any, str], Any]) -> list[Any]:
    """Validated driver values in ``STEP_COLUMNS`` order. The inline type tests are the fast path;
    anything unusual goes through the full validator, which coerces integral floats or raises."""
    sp = rec.spec
    if sp is None:
        raise FieldError("spec", "is None; a step record always carries its SpecCounters")
    batch_size = rec.batch_size
    if type(batch_size) is not int or batch_size < 0:
        batch_size = check_count(batch_size, "batch_size")
    step_time_s = rec.step_time_s
    if step_time_s is not None and (type(step_time_s) is not float or not 0.0 <= step_time_s < _INF):
        step_time_s = check_measure(step_time_s, "step_time_s")
    scheduled = rec.num_scheduled_tokens
    if scheduled is not None and (type(scheduled) is not int or scheduled < 0):
        scheduled = check_count(scheduled, "num_scheduled_tokens")
    k = sp.num_spec_tokens
    if k is not None and (type(k) is not int or k < 0):
        k = check_count(k, "spec.num_spec_tokens")
    drafts, draft_tokens, accepted, generated = (
        sp.drafts,
        sp.draft_tokens,
        sp.accepted_tokens,
        sp.generated_tokens,
    )
    if type(drafts) is not int or drafts < 0:
        drafts = check_count(drafts, "spec.drafts")
    if type(draft_tokens) is not int or draft_tokens < 0:
        draft_tokens = check_count(draft_tokens, "spec.draft_tokens")
    if type(accepted) is not int or accepted < 0:
        accepted = check_count(accepted, "spec.accepted_tokens")
    if type(generated) is not int or generated < 0:
        generated = check_count(generated, "spec.generated_tokens")
    per_pos_drafted = sp.draft_tokens_per_pos
    return [
        engine_id,
        rec.config_id,
        ts(rec.ts, "ts"),
        batch_size,
        step_time_s,
        scheduled,
        k,
        drafts,
        draft_tokens,
        accepted,
        int_list(sp.accepted_per_pos, "spec.accepted_per_pos"),
        None if per_pos_drafted is None else int_list(per_pos_drafted, "spec.draft_tokens_per_pos"),
        generated,
    ]


def request_values(rec: RequestRecord, ts: Callable[[Any, str], Any]) -> list[Any]:
    """Validated driver values in ``REQUEST_COLUMNS`` order (fast path as in :func:`step_values`)."""
    prompt, output = rec.prompt_tokens, rec.output_tokens
    if type(prompt) is not int or prompt < 0:
        prompt = check_count(prompt, "prompt_tokens")
    if type(output) is not int or output < 0:
        output = check_count(output, "output_tokens")
    latency_s = rec.latency_s
    if type(latency_s) is not float or not 0.0 <= latency_s < _INF:
        latency_s = check_measure(latency_s, "latency_s")
    k = rec.num_spec_tokens
    if k is not None and (type(k) is not int or k < 0):
        k = check_count(k, "num_spec_tokens")
    drafts, drafted, accepted = rec.num_spec_steps, rec.num_draft_tokens, rec.num_accepted_draft_tokens
    if type(drafts) is not int or drafts < 0:
        drafts = check_count(drafts, "num_spec_steps")
    if type(drafted) is not int or drafted < 0:
        drafted = check_count(drafted, "num_draft_tokens")
    if type(accepted) is not int or accepted < 0:
        accepted = check_count(accepted, "num_accepted_draft_tokens")
    mal, dar = rec.mean_acceptance_length, rec.draft_acceptance_rate
    if mal is not None and (type(mal) is not float or not 0.0 <= mal < _INF):
        mal = check_measure(mal, "mean_acceptance_length")
    if dar is not None and (type(dar) is not float or not 0.0 <= dar < _INF):
        dar = check_measure(dar, "draft_acceptance_rate")
    status = rec.status_code
    if type(status) is not int or status < 0:
        status = check_count(status, "status_code")
    per_step_accepted, per_step_drafted = rec.per_step_accepted, rec.per_step_drafted
    request_id, model_name, upstream_url = rec.request_id, rec.model_name, rec.upstream_url
    if not (
        type(request_id) is str
        and len(request_id) <= 256
        and type(model_name) is str
        and len(model_name) <= 512
        and type(upstream_url) is str
        and len(upstream_url) <= 2048
    ):
        request_id = _text(request_id, "request_id", 256)
        model_name = _text(model_name, "model_name", 512)
        upstream_url = _text(upstream_url, "upstream_url", 2048)
    return [
        ts(rec.ts, "ts"),
        request_id,
        model_name,
        upstream_url,
        rec.config_id,
        prompt,
        output,
        latency_s,
        k,
        drafts,
        drafted,
        accepted,
        int_list(rec.acceptance_histogram, "acceptance_histogram"),
        mal,
        dar,
        None if per_step_accepted is None else int_list(per_step_accepted, "per_step_accepted"),
        None if per_step_drafted is None else int_list(per_step_drafted, "per_step_drafted"),
        bool(rec.streamed),
        status,
    ]
