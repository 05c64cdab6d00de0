"""The sim-to-live calibration (bench/fit_lab_phases.py) recovers a known engine from its cells."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from bench.fit_lab_phases import PARAMS, _cells, _config, _with, fit
from tuner.sim.engine import SimEngine
from tuner.sim.scenario import load_scenario

SCENARIO = Path(__file__).resolve().parents[3] / "bench" / "scenarios" / "lab_phases.toml"
TRUE = {
    "target_step_s": 0.05,
    "per_token_s": 0.004,
    "free_tokens": 7.0,
    "model_draft_fixed_s": 0.006,
    "model_draft_per_seq_s": 0.0015,
    "ngram_draft_fixed_s": 0.009,
    "ngram_draft_per_seq_s": 0.0002,
}
LABELS = ["off", *(f"{d}/K={k}" for d in ("good", "medium", "weak", "ngram") for k in (1, 3, 5))]


def live_from(theta: dict[str, float], noise_sd: float = 0.0) -> dict[str, object]:
    """A live result whose fixed cells are the scenario's expected goodput under ``theta`` (× log noise)."""
    scenario = load_scenario(SCENARIO)
    engine = SimEngine(_with(scenario, np.array([theta[p] for p in PARAMS])))
    rng = np.random.default_rng(7)
    rates: dict[str, dict[str, float]] = {}
    t = 0.0
    for p in scenario.load.phases:
        mid = np.array([t + p.duration_s / 2])
        rates[p.name] = {
            c: float(engine.expected_goodput(_config(c), mid)[0]) * math.exp(noise_sd * rng.normal()) for c in LABELS
        }
        t += p.duration_s
    rates[scenario.load.phases[0].name]["good/table"] = 1.0  # a table cell is not a single config: not fitted
    return {"summary": {"fixed_mean_rate": rates}}


def test_the_fit_recovers_a_known_engine_from_its_cells() -> None:
    doc = fit(live_from(TRUE), load_scenario(SCENARIO))
    assert doc["cells"] == 6 * len(LABELS)
    assert doc["rms_log_error"]["after"] < 0.01 < doc["rms_log_error"]["before"]
    for p, v in TRUE.items():
        assert doc["fitted"][p] == pytest.approx(v, rel=0.05), p


def test_noisy_cells_leave_an_error_of_their_noise_and_plain_decoding_fits_closely() -> None:
    doc = fit(live_from(TRUE, noise_sd=0.05), load_scenario(SCENARIO))
    assert doc["rms_log_error"]["after"] < 0.07
    assert doc["fitted"]["target_step_s"] == pytest.approx(0.05, rel=0.15)
    assert doc["fitted"]["free_tokens"] == pytest.approx(7.0, abs=3.0)


def test_a_phase_the_scenario_does_not_run_is_refused() -> None:
    live = {"summary": {"fixed_mean_rate": {"nightly c=8": {"off": 10.0}}}}
    with pytest.raises(SystemExit, match="nightly c=8"):
        _cells(live, load_scenario(SCENARIO))
