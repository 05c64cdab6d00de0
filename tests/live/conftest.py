"""Live-tier fixtures: the lab models (built once, cached) and one shared lab engine per session.

The engine runs the near-perfect ``good`` draft at K=3 and is shared by every live test that does not
need a config of its own; tests that need another config start a ``LabServer`` themselves.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tuner.lab.models import Manifest, build_models
from tuner.lab.serve import LabServer

REPO = Path(__file__).resolve().parents[2]
MODELS_DIR = Path(os.environ.get("SPECTUNER_LAB_MODELS", REPO / ".lab" / "models"))


@pytest.fixture(scope="session")
def lab_models() -> Manifest:
    return build_models(MODELS_DIR)


@pytest.fixture(scope="session")
def lab_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lab")


@pytest.fixture(scope="session")
def lab_engine(lab_models: Manifest, lab_workdir: Path) -> Iterator[LabServer]:
    server = LabServer(draft="good", k=3, models_dir=MODELS_DIR, workdir=lab_workdir / "engine-good")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def start_lab_server(lab_models: Manifest, tmp_path: Path) -> Iterator[object]:
    """Factory for a test's own engine: ``start_lab_server(draft="weak", k=3)``; stopped after the test."""
    servers: list[LabServer] = []

    def _start(**kwargs: object) -> LabServer:
        kwargs.setdefault("models_dir", MODELS_DIR)
        kwargs.setdefault("workdir", tmp_path / f"engine-{len(servers)}")
        server = LabServer(**kwargs)  # type: ignore[arg-type]
        servers.append(server)
        server.start()
        return server

    yield _start
    for s in servers:
        s.stop()
