"""`spectuner lab calibrate`: the crossover read from measured rows, and bad input refused before an engine starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.unit.tuner.lab.conftest import spectuner
from tuner.lab.calibrate import CalibrationPlan, calibrate, crossover, fitted_lookup_pass, fitted_step_cost
from tuner.lab.closed_loop import (
    GPU_LIKE_LOOKUP_PASS,
    GPU_LIKE_STEP_COST,
    LAB_DRAFT_COST_RATIO,
    LAB_STEP_COST,
    lab_cost_model,
    lab_lookup_pass,
)
from tuner.lab.models import BUILDER_VERSION, Manifest, ModelInfo


def _rows(pairs: dict[int, tuple[float, float]]) -> dict[str, dict[str, float | None]]:
    return {str(n): {"off": off, "good/K=3": sp} for n, (off, sp) in pairs.items()}


def test_crossover_is_the_pair_of_stream_counts_where_speculation_stops_paying() -> None:
    rows = _rows({1: (22.0, 54.0), 4: (78.0, 113.0), 16: (182.0, 202.0), 32: (239.0, 231.0), 64: (287.0, 254.0)})
    assert crossover(rows, "good/K=3") == [16, 32]


def test_crossover_orders_stream_counts_numerically_not_as_text() -> None:
    # "16" < "4" as text; the crossover must still read 4 -> 16
    rows = _rows({16: (180.0, 150.0), 4: (80.0, 110.0), 1: (20.0, 50.0)})
    assert crossover(rows, "good/K=3") == [4, 16]


@pytest.mark.parametrize(
    "pairs",
    [
        {1: (20.0, 50.0), 64: (280.0, 300.0)},  # wins everywhere measured
        {1: (50.0, 20.0), 64: (280.0, 250.0)},  # loses everywhere measured
        {1: (20.0, 50.0)},  # one row
    ],
)
def test_no_crossover_when_the_rows_do_not_show_one(pairs: dict[int, tuple[float, float]]) -> None:
    assert crossover(_rows(pairs), "good/K=3") is None



@pytest.mark.parametrize("draft", ["nope", "ngram"])
def test_calibrate_refuses_a_draft_that_is_not_a_draft_model(fake_models: Path, draft: str) -> None:
    with pytest.raises(ValueError, match="choose one of: good"):
        calibrate(fake_models, CalibrationPlan(draft=draft))
    assert not list(fake_models.glob("calibrate-*")), "nothing is started or left behind"



@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--streams", "1,four"], "--streams must be comma-separated integers"),
        (["--streams", "0,4"], "--streams must be positive integers"),
        (["--draft", "nope"], "'nope' is not a draft model of this lab"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(fake_models: Path, args: list[str], says: str) -> None:
    r = spectuner("lab", "calibrate", "--models-dir", str(fake_models), *args)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_cli_without_models_names_the_build_command(tmp_path: Path) -> None:
    r = spectuner("lab", "calibrate", "--models-dir", str(tmp_path / "nothing"))
    assert r.returncode == 2
    assert "spectuner lab build-models" in r.stderr


def test_the_fitted_step_cost_reproduces_the_measured_throughput() -> None:
    # rows generated from a known T(B, K): the fit must recover it and predict the rows back
    true = {"fixed_s": 0.042, "per_token_s": 0.0028, "draft_fixed_s": 0.0094, "draft_per_seq_s": 0.00075}
    k, length = 3, 3.7

    def step(b: int, kk: int) -> float:
        return (true["fixed_s"] + true["per_token_s"] * b * (kk + 1)
                + kk * (true["draft_fixed_s"] + true["draft_per_seq_s"] * b))

    rows: dict[str, dict[str, float | None]] = {
        str(b): {"off": b / step(b, 0), "good/K=3": b * length / step(b, k)} for b in (1, 4, 16, 32, 64)
    }
    fitted = fitted_step_cost(rows, "good/K=3", k, length)
    assert fitted["reason"] == "ok"
    for name, value in true.items():
        assert fitted["model"][name] == pytest.approx(value, rel=1e-3), name
    assert "free_tokens" not in fitted["model"]  # a straight engine's model has no knee


def test_the_fitted_step_cost_finds_the_knee_of_an_engine_flat_at_few_tokens() -> None:
    # the 7 Dec calibration of the gpu-like lab, as rows: plain decoding 43 ms at 1 stream and 39 ms at 4
    # (flat), 77 ms at 16; a straight line through them read a 28 ms pass and a 0.13 cost ratio
    off = {"1": 23.4, "4": 103.54, "16": 208.65, "32": 236.41, "64": 248.34}
    spec = {"1": 67.61, "4": 134.49, "16": 164.1, "32": 184.4, "64": 188.9}
    rows: dict[str, dict[str, float | None]] = {n: {"off": off[n], "good/K=3": spec[n]} for n in off}
    fitted = fitted_step_cost(rows, "good/K=3", 3, 3.386)
    model = fitted["model"]
    assert 3.0 < model["free_tokens"] < 7.0 and "flat up to" in fitted["message"]
    assert model == GPU_LIKE_STEP_COST  # the recipe's figures are this calibration
    for n, tok_s in off.items():  # plain decoding's step back within 15 % (1 stream read slower than 4)
        b = float(n)
        predicted = model["fixed_s"] + model["per_token_s"] * max(b - model["free_tokens"], 0.0)
        assert b / tok_s == pytest.approx(predicted, rel=0.15), n


def test_no_step_cost_without_a_speculating_row() -> None:
    rows: dict[str, dict[str, float | None]] = {"1": {"off": 20.0, "good/K=3": None},
                                                "64": {"off": 290.0, "good/K=3": None}}
    fitted = fitted_step_cost(rows, "good/K=3", 3, None)
    assert fitted["model"] is None and fitted["message"]


def _lookup_rows(
    target: dict[str, float], fixed_s: float, per_seq_s: float, share: float, k: int, accepted_per_draft: float
) -> dict[str, dict[str, float]]:
    """What the worker records at each stream count for a lookup whose pass and share are known: n
    requests of 64 tokens, drafting at ``share`` of their sequence steps, timed with T(B, K) built
    independently (one pass a step; the target scores the sequence's token plus the drafted ones, those past
    its knee at the per-token cost)."""
    rows: dict[str, dict[str, float]] = {}
    for n in (1, 4, 16, 64):
        tokens = 64.0 * n
        seq_steps = tokens / (1 + share * accepted_per_draft)  # each drafting step adds its accepted tokens
        drafts = share * seq_steps
        batch_steps = seq_steps / n
        scored = max(n * (1 + share * k) - target.get("free_tokens", 0.0), 0.0)  # past the target's knee
        step_s = target["fixed_s"] + target["per_token_s"] * scored + fixed_s + per_seq_s * n
        rows[str(n)] = {"seconds": batch_steps * step_s, "tokens": tokens, "num_drafts": drafts,
                        "num_draft_tokens": drafts * k, "num_accepted_tokens": drafts * accepted_per_draft}
    return rows


@pytest.mark.parametrize(("fixed_s", "per_seq_s"), [(0.0095, 0.0), (0.004, 0.0002), (0.0, 0.0005)])
def test_a_lookups_own_pass_and_share_are_recovered_from_its_timed_rows(fixed_s: float, per_seq_s: float) -> None:
    rows = _lookup_rows(GPU_LIKE_STEP_COST, fixed_s, per_seq_s, share=0.4, k=3, accepted_per_draft=2.2)
    got = fitted_lookup_pass(rows, GPU_LIKE_STEP_COST)
    assert got["model"]["draft_fixed_s"] == pytest.approx(fixed_s, abs=2e-6)
    assert got["model"]["draft_per_seq_s"] == pytest.approx(per_seq_s, abs=2e-7)
    assert got["proposal_share"] == pytest.approx(0.4, abs=1e-4)
    assert got["proposal_share_by_streams"] == {n: pytest.approx(0.4, abs=1e-4) for n in ("1", "4", "16", "64")}
    for n, residual_ms in got["residual_ms"].items():  # what the target's pass leaves of each step
        assert residual_ms == pytest.approx(1000 * (fixed_s + per_seq_s * int(n)), abs=0.01)


def test_a_lookup_pass_is_never_negative_and_is_withheld_without_a_target_or_drafts() -> None:
    # a lookup measured faster than the target model predicts (noise, or the model's misfit): no negative cost
    rows = _lookup_rows(GPU_LIKE_STEP_COST, -0.002, 0.0, share=0.4, k=3, accepted_per_draft=2.2)
    got = fitted_lookup_pass(rows, GPU_LIKE_STEP_COST)
    assert got["model"] == {"draft_fixed_s": 0.0, "draft_per_seq_s": 0.0}
    assert fitted_lookup_pass(rows, None)["model"] is None
    idle = {n: {**r, "num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0} for n, r in rows.items()}
    assert "drafted nothing" in fitted_lookup_pass(idle, GPU_LIKE_STEP_COST)["message"]


def test_the_labs_lookup_pass_is_its_own_calibration_else_its_recipes_figures() -> None:
    assert lab_lookup_pass(_manifest("tiny")) is None  # priced by the lab's ratio, as before
    assert lab_lookup_pass(_manifest("gpu-like")) == GPU_LIKE_LOOKUP_PASS
    own = {"draft_fixed_s": 0.007, "draft_per_seq_s": 0.0001}
    calibrated = {"drafts": {"ngram": {"lookup_pass": {"model": own}}}}
    assert lab_lookup_pass(_manifest("tiny", calibrated)) == own
    assert lab_lookup_pass(_manifest("gpu-like", {"drafts": {"ngram": {"lookup_pass": {"model": None}}}})) \
        == GPU_LIKE_LOOKUP_PASS


def _manifest(recipe: str, calibration: dict[str, Any] | None = None) -> Manifest:
    return Manifest(build_key="x", builder_version=BUILDER_VERSION, tokenizer_path="t",
                    target=ModelInfo(name="target", path="p"), drafts={}, build_seconds=0.0,
                    recipe={"name": recipe}, calibration=calibration)


def test_the_controller_gets_the_labs_own_calibration_else_its_recipes_figures() -> None:
    assert lab_cost_model(_manifest("tiny")) == (LAB_STEP_COST, LAB_DRAFT_COST_RATIO)
    model, c = lab_cost_model(_manifest("gpu-like"))
    assert model == GPU_LIKE_STEP_COST and 0.1 < c < 0.3
    own = {"fixed_s": 0.05, "per_token_s": 0.003, "draft_fixed_s": 0.005, "draft_per_seq_s": 0.0003}
    model, c = lab_cost_model(_manifest("gpu-like", {"step_cost": {"model": own}}))
    assert model == own and c == pytest.approx(0.0053 / 0.053, abs=1e-3)
    # with a knee the target's pass at batch 1 is its flat part alone
    knee = {**own, "free_tokens": 4.0}
    model, c = lab_cost_model(_manifest("gpu-like", {"step_cost": {"model": knee}}))
    assert model == knee and c == pytest.approx(0.0053 / 0.05, abs=1e-3)
