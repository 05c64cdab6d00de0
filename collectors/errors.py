"""Typed collector errors: every way a scrape can go wrong has a machine-readable reason."""

from __future__ import annotations

from enum import StrEnum


class ScrapeErrorReason(StrEnum):
    """Why a scrape produced no record. Collectors count errors per reason."""

    HTTP_STATUS = "http_status"  # the engine answered, but not 200
    TIMEOUT = "timeout"  # no complete answer within timeout_s
    CONNECTION = "connection"  # refused, reset, DNS...
    TRUNCATED = "truncated"  # body cut short (no final newline, short read, missing # EOF)
    TOO_LARGE = "too_large"  # body over the configured limit
    EMPTY = "empty"  # 200 with an empty body
    MALFORMED = "malformed"  # not valid Prometheus exposition text
    INVALID_VALUE = "invalid_value"  # NaN, infinite, negative or fractional count
    DUPLICATE_SERIES = "duplicate_series"  # the same metric + labels twice on one page
    INCONSISTENT = "inconsistent"  # values that cannot all be true at once (e.g. accepted > drafted)


class ScrapeError(Exception):
    """A scrape (or a /metrics dump) that must not produce any record.

    ``reason`` is machine-readable; ``str(error)`` says what is wrong and, where it helps, what to do.
    """

    def __init__(self, reason: ScrapeErrorReason, message: str, *, source: str = "") -> None:
        self.reason = reason
        self.message = message
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{reason.value}: {message}")
