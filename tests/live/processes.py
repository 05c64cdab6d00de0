"""Server processes for live tests: each in its own session, so a stop takes its whole group (an engine
a sidecar started included)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path


def spawn(argv: list[str], log: Path, cwd: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """A server process in its own session (stopped by group), its output in ``log``."""
    with log.open("wb") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd,
            env=None if env is None else dict(env),
        )  # fmt: skip


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    """SIGTERM to the group, SIGKILL after ``timeout_s``."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
