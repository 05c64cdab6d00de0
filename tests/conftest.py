"""Test tiers by directory: tests/unit -> unit, tests/integration -> integration, tests/live -> live,
tests/gpu -> gpu (skipped unless asked for on a CUDA machine: tests/gpu/conftest.py); tests/research
(the research code in bench/research, pure and fast) -> unit.

Shared test doubles (the fake clock, decision contexts) live in ``tests/fakes.py``.

Live tests share one lab engine per session (fixtures in ``tests/live/conftest.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

_TIERS = {"unit": "unit", "integration": "integration", "live": "live", "gpu": "gpu", "research": "unit"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).parts
        for directory, tier in _TIERS.items():
            if directory in parts:
                item.add_marker(getattr(pytest.mark, tier))
