"""Measured cells over a step-cost model: this engine's mean step times where measured, the model elsewhere."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from policies.acceptance_model import ConstantAlphaModel
from policies.choose_k import KChoiceSnapshot, choose_k
from policies.step_cost import (
    MeasuredStepCost,
    StepCostModel,
    batch_cell,
    step_times_table,
    with_measured_cells,
)

# The lab's T(B, K) as bench_live pins it (fitted from LAB.md's table on a faster machine), in seconds.
LAB = StepCostModel(fixed_s=0.00208, per_token_s=0.0000953, draft_fixed_s=0.001566, draft_per_seq_s=0.000217)
NOW = datetime(2026, 12, 3, tzinfo=UTC)


def test_batch_bands_are_25_percent_wide() -> None:
    assert [batch_cell(b) for b in (0.5, 1, 1.2, 2, 4, 14, 16)] == [0, 0, 0, 3, 6, 11, 12]
    assert batch_cell(1.25) == 1  # the band's lower edge belongs to it


def test_a_cell_reproduces_its_measured_mean_and_the_rest_takes_the_engines_level() -> None:
    # 60 steps at B = 4 without drafts, 18 ms (the lab CPU engine's quirk); 100 at B = 1 with K = 3, 25 ms
    model = with_measured_cells(LAB, [4, 4, 1], [0, 0, 3], [0.018, 0.018, 0.025], [30, 30, 100], min_steps=50)
    assert isinstance(model, MeasuredStepCost)
    assert model.step_time_s(4, 0) == pytest.approx(0.018)
    assert model.step_time_s(1, 3) == pytest.approx(0.025)
    assert model.is_measured(4, 0) and model.is_measured(1, 3)
    assert not model.is_measured(4, 3) and not model.is_measured(16, 0)
    # unmeasured cells: the model × Σ measured / Σ predicted over the measured cells of their kind
    assert model.scale == pytest.approx(0.025 / LAB.step_time_s(1, 3))
    assert model.scale_no_draft == pytest.approx(0.018 / LAB.step_time_s(4, 0))
    assert model.step_time_s(16, 2) == pytest.approx(LAB.step_time_s(16, 2) * model.scale)
    assert model.step_time_s(16, 0) == pytest.approx(LAB.step_time_s(16, 0) * model.scale_no_draft)
    # a kind without cells takes the level over all cells
    only_k0 = with_measured_cells(LAB, [4, 1], [0, 0], [0.018, 0.009], [60, 60], min_steps=50)
    assert isinstance(only_k0, MeasuredStepCost)
    overall = (60 * 0.018 + 60 * 0.009) / (60 * LAB.step_time_s(4, 0) + 60 * LAB.step_time_s(1, 0))
    assert only_k0.scale == pytest.approx(overall) == only_k0.scale_no_draft
    assert model.step_time_interval_s(4, 0) == (model.step_time_s(4, 0), model.step_time_s(4, 0))
    table = step_times_table(model, [1, 4], 3)
    assert table[1, 0] == pytest.approx(0.018) and table[0, 3] == pytest.approx(0.025)
    cells = model.to_dict()["measured_cells"]
    assert [(c["k"], c["steps"], round(c["mean_batch_size"], 3)) for c in cells] == [(3, 100, 1.0), (0, 60, 4.0)]
    assert type(model.linear()) is StepCostModel and model.linear().parameters.tolist() == LAB.parameters.tolist()


def test_a_cell_with_too_few_steps_leaves_the_model_alone() -> None:
    assert with_measured_cells(LAB, [4], [0], [0.018], [49], min_steps=50) is LAB
    assert with_measured_cells(LAB, [], [], [], [], min_steps=50) is LAB


def test_within_a_band_the_models_slope_is_kept() -> None:
    model = with_measured_cells(LAB, [13, 14], [0, 0], [0.030, 0.034], [50, 50], min_steps=50)
    assert model.is_measured(12, 0) and not model.is_measured(16, 0)
    ratio = model.step_time_s(14, 0) / model.step_time_s(13, 0)
    assert ratio == pytest.approx(LAB.step_time_s(14, 0) / LAB.step_time_s(13, 0))


def test_bad_rows_are_refused_or_skipped() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        with_measured_cells(LAB, [1, 2], [0], [0.01], [60], min_steps=50)
    with pytest.raises(ValueError, match="min_steps"):
        with_measured_cells(LAB, [1], [0], [0.01], [60], min_steps=0)
    # NaN, zero time, zero steps: skipped, not counted
    out = with_measured_cells(LAB, [1, 1, 1], [0, 0, 0], [float("nan"), 0.0, 0.01], [60, 60, 0], min_steps=50)
    assert out is LAB


def test_a_measured_slow_step_without_drafts_makes_drafting_win_where_the_model_said_it_loses() -> None:
    """The lab run of 3 Dec: at 4 streams no speculation gave 218 tok/s, medium/K=3 409; the pinned model said
    K = 0. With the two cells measured (18 ms without drafts, 38 ms at K = 3) drafting wins. At 16 streams
    nothing is measured: the model at each kind's measured level decides — a step without drafts is 7.3×
    the model here, one with drafts 3.5×, so drafting wins there too, where the bare model said K = 0."""
    alpha = ConstantAlphaModel(0.95, 0.94, 0.96)

    def best(model: StepCostModel, b: int) -> int:
        return choose_k(KChoiceSnapshot(now=NOW, acceptance=alpha, step_cost=model, batch_size=b, k_max=3)).k

    assert best(LAB, 4) == 0
    measured = with_measured_cells(LAB, [4, 4], [0, 3], [0.018, 0.038], [200, 200], min_steps=50)
    assert best(measured, 4) > 0  # K = 3 measured, K = 1 at the drafting level: both beat K = 0
    assert isinstance(measured, MeasuredStepCost)
    assert (round(measured.scale_no_draft, 1), round(measured.scale, 1)) == (7.3, 3.5)
    assert best(LAB, 16) == 0 and best(measured, 16) > 0
