"""Lab unit fixtures: a manifest without weights, and the CLI run as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tuner.lab.models import BUILDER_VERSION, Manifest, ModelInfo


def spectuner(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tuner.cli.main", *args], capture_output=True, text=True,
                          timeout=60)


@pytest.fixture
def fake_models(tmp_path: Path) -> Path:
    """A manifest as `lab build-models` writes it, without weights: enough for the checks made before
    any engine starts."""
    d = tmp_path / "models"
    d.mkdir()
    m = Manifest(
        build_key="x", builder_version=BUILDER_VERSION, tokenizer_path=str(d / "tokenizer"),
        target=ModelInfo(name="target", path=str(d / "target")),
        drafts={"good": ModelInfo(name="good", path=str(d / "draft-good")),
                "ngram": ModelInfo(name="ngram", path="", method="ngram")},
        build_seconds=0.0,
    )
    (d / "manifest.json").write_text(json.dumps(m.to_json()))
    return d
