"""The CLI boundary: whatever a command raises becomes one line on stderr and the right exit code.

Commands catch the failures they expect and say what to do about them; this is the net under them.
No traceback reaches an operator: a usage or configuration problem exits 2, anything else 1, and
``--verbose`` logs the traceback for a bug report.
"""

from __future__ import annotations

import logging

from tuner.cli.common import EXIT_RUNTIME, EXIT_USAGE

log = logging.getLogger("spectuner.cli")

_MAX_MESSAGE_CHARS = 500


def one_line(text: str) -> str:
    """``text`` on one line (newlines folded), at most a few hundred characters."""
    flat = " ".join(part.strip() for part in text.strip().splitlines() if part.strip())
    return flat if len(flat) <= _MAX_MESSAGE_CHARS else flat[: _MAX_MESSAGE_CHARS - 1] + "…"


def describe_failure(exc: BaseException) -> tuple[int, str]:
    """The exit code and the one-line message for an exception no command caught."""
    from sqlalchemy.exc import SQLAlchemyError

    from tuner.config import ConfigError
    from tuner.store import DatabaseUrlError, SchemaError

    if isinstance(exc, ConfigError | DatabaseUrlError | SchemaError):
        return EXIT_USAGE, one_line(str(exc))
    if isinstance(exc, SQLAlchemyError):
        # The driver's first line (refused, unknown host, not a database...), never the SQL.
        detail = str(getattr(exc, "orig", None) or exc).strip()
        return (
            EXIT_RUNTIME,
            f"the database failed: {one_line(detail.splitlines()[0] if detail else type(exc).__name__)}",
        )
    if isinstance(exc, PermissionError):
        return EXIT_RUNTIME, f"permission denied: {one_line(str(exc))}"
    if isinstance(exc, OSError):
        return EXIT_RUNTIME, one_line(str(exc)) or type(exc).__name__
    if isinstance(exc, MemoryError):
        return EXIT_RUNTIME, "out of memory: the request is too large for this machine"
    text = one_line(str(exc))
    return EXIT_RUNTIME, (
        f"unexpected {type(exc).__name__}{': ' + text if text else ''} "
        "(run with --verbose for the traceback and report it)"
    )
