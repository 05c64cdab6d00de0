"""The fast ingest encoders write exactly what SQLAlchemy's types would (no database needed, but
they exist for the store, so they are tested beside it)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy.dialects import sqlite
from sqlalchemy.dialects.sqlite.base import DATETIME

from tuner.store.ingest import int_list, sqlite_ts
from tuner.store.rows import FieldError

_processor = DATETIME().bind_processor(sqlite.dialect())
assert _processor is not None
_SA_SQLITE_DATETIME = _processor


@settings(max_examples=2000, deadline=None)
@given(
    st.datetimes(min_value=datetime(1900, 1, 1), max_value=datetime(2200, 1, 1)),
    st.integers(min_value=-14 * 60, max_value=14 * 60),
)
def test_sqlite_timestamps_match_sqlalchemys_format(naive: datetime, offset_min: int) -> None:
    aware = naive.replace(tzinfo=UTC).astimezone(timezone(timedelta(minutes=offset_min)))
    assert sqlite_ts(aware) == _SA_SQLITE_DATETIME(naive)
    assert sqlite_ts(aware) == sqlite_ts(aware)  # the per-second cache gives the same answer


def test_sqlite_timestamps_refuse_naive_values() -> None:
    with pytest.raises(FieldError, match="timezone-aware"):
        sqlite_ts(datetime(2026, 1, 1))


@given(st.lists(st.integers(min_value=0, max_value=2**62), max_size=20))
def test_int_lists_are_json(values: list[int]) -> None:
    assert json.loads(int_list(values, "x")) == values
    assert json.loads(int_list(tuple(values), "x")) == values
    assert json.loads(int_list(tuple(values), "x")) == values  # cached


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ((1, -2), r"x\[1\] is -2"),
        ((1, 2.5), r"x\[1\] is 2\.5"),
        (("7",), r"x\[0\] is '7'"),
        ([float("nan")], r"x\[0\] is nan"),
        (5, "expected a sequence of counts"),
    ],
)
def test_int_lists_refuse_what_is_not_a_count(values: object, message: str) -> None:
    with pytest.raises(FieldError, match=message):
        int_list(values, "x")


def test_integral_floats_are_stored_as_ints() -> None:
    assert int_list([3.0, 0.0], "x") == "[3, 0]"
