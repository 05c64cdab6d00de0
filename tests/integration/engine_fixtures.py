"""Helpers for tests that run tests/integration/fake_engine.py as a real server process."""

from __future__ import annotations

import sys
from pathlib import Path

FAKE_ENGINE = Path(__file__).resolve().parent / "fake_engine.py"


def fake_engine_argv(port: int, *extra: str) -> list[str]:
    return [sys.executable, str(FAKE_ENGINE), "--port", str(port), *extra]
