"""`spectuner lab calibrate` end to end on the tiny lab: real vLLM engines, figures stored in the manifest.

The physics (c, the 1-stream gain, the crossover) are machine facts measured on a quiet machine
(docs/lab.md); on a loaded CI box only what the command must always deliver is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.live.conftest import MODELS_DIR
from tuner.lab.models import MANIFEST, Manifest


def test_calibrate_measures_every_config_and_stores_it(lab_models: Manifest, tmp_path: Path) -> None:
    # a copy of the manifest (its paths are absolute): the shared lab's own manifest stays untouched,
    # so the closed-loop tests keep the tiny lab's documented step cost
    models = tmp_path / "models"
    models.mkdir()
    shared = (MODELS_DIR / MANIFEST).read_text()
    (models / MANIFEST).write_text(shared)
    r = subprocess.run(
        [sys.executable, "-m", "tuner.cli.main", "lab", "calibrate", "--models-dir", str(models),
         "--streams", "1,4", "--max-tokens", "16", "--json"],
        capture_output=True, text=True, timeout=1200,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert "calibrate: off at 1,4 streams" in r.stderr  # progress shown while it works

    for n in ("1", "4"):
        row = out["throughput"][n]
        assert row["off"] > 0 and row["good/K=3"] > 0
        assert row["speculation_gain"] == round(row["good/K=3"] / row["off"], 3)
    drafts = out["drafts"]
    # the good draft's speculation really ran: vLLM counted its accepted tokens
    assert drafts["good"]["acceptance_rate_k3"] > 0.5
    assert drafts["good"]["agreement"] == lab_models.drafts["good"].greedy_agreement
    # drafts of one shape share one timing (the target's shape: c = 1); ngram has no weights
    by_shape: dict[tuple[int, ...], set[float]] = {}
    for name, info in lab_models.drafts.items():
        if info.method == "ngram":
            assert drafts[name]["cost_ratio"] is None
            continue
        cfg = json.loads((Path(info.path) / "config.json").read_text())
        shape = (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"])
        by_shape.setdefault(shape, set()).add(drafts[name]["cost_ratio"])
    assert all(len(costs) == 1 and min(costs) > 0 for costs in by_shape.values()), by_shape
    assert drafts["copy"]["cost_ratio"] == 1.0
    fitted = out["step_cost"]
    assert fitted["model"] is not None or fitted["message"]
    # the lab's ngram timed too, with the lookup the lab serves: its own pass (in seconds, beyond the
    # target's) and the share of steps it drafted at, read from the engine's counters
    assert all(out["throughput"][n]["ngram/K=3"] > 0 for n in ("1", "4"))
    lookup = drafts["ngram"]["lookup_pass"]
    assert drafts["ngram"]["mean_acceptance_length_k3"] > 1.0
    assert 0.0 < lookup["proposal_share"] <= 1.0
    if fitted["model"] is not None:
        assert lookup["model"]["draft_fixed_s"] >= 0 and lookup["model"]["draft_per_seq_s"] >= 0
        assert set(lookup["residual_ms"]) == {"1", "4"}

    stored = json.loads((models / MANIFEST).read_text())["calibration"]
    assert stored["throughput"] == out["throughput"]
    assert not list(models.glob("calibrate-*")), "the engines' work files are removed after a run"
    assert (MODELS_DIR / MANIFEST).read_text() == shared
