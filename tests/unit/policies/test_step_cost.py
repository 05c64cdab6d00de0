"""The step-cost model T(B, K) (policies/step_cost.py): the fit, measured cells laid over a model, and the
draft pass of a K = 0 step.

A K = 0 step of an engine that loaded a draft model still runs one draft pass (vLLM keeps the draft's
KV cache in sync), so a per-batch-size table's K = 0 is not "speculation off". Measured cells: this
engine's mean step times where measured, the model elsewhere.
"""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import UTC, datetime

import numpy as np
import pytest

from policies.acceptance_model import ConstantAlphaModel
from policies.choose_k import KChoiceSnapshot, choose_k, goodput_over_load
from policies.k_table import KTableSnapshot, k_table
from policies.step_cost import (
    MeasuredStepCost,
    StepCostModel,
    StepCostReason,
    batch_cell,
    design_matrix,
    fit_step_cost,
    fit_target_cost,
    step_times_table,
    with_measured_cells,
)

# The lab's T(B, K) as bench_live pins it (fitted from the lab table (docs/lab.md) on a faster machine), in seconds;
# LOADED is the same engine with its draft model loaded.
LAB = StepCostModel(fixed_s=0.00208, per_token_s=0.0000953, draft_fixed_s=0.001566, draft_per_seq_s=0.000217)
LOADED = replace(LAB, draft_pass_at_k0=True)
NOW = datetime(2026, 12, 3, tzinfo=UTC)


def synthetic(rng: np.random.Generator, truth: StepCostModel, n: int, noise: float = 0.03):
    b = rng.integers(1, 65, n)
    k = rng.integers(0, 8, n)
    y = np.array([truth.step_time_s(int(bb), int(kk)) for bb, kk in zip(b, k, strict=True)])
    return b, k, y * (1 + noise * rng.standard_normal(n))


def test_fit_recovers_parameters_and_cost_ratio() -> None:
    truth = StepCostModel(0.012, 0.0004, 0.0015, 0.00005)
    b, k, y = synthetic(np.random.default_rng(0), truth, 400)
    fit = fit_step_cost(b, k, y)
    assert fit.reason is StepCostReason.OK and fit.model is not None
    for name in ("fixed_s", "per_token_s", "draft_fixed_s"):
        assert getattr(fit.model, name) == pytest.approx(getattr(truth, name), rel=0.15)
    assert fit.cost_ratio is not None and fit.cost_ratio_ci is not None
    assert fit.cost_ratio_ci[0] <= truth.cost_ratio(1) <= fit.cost_ratio_ci[1]
    lo, hi = fit.model.step_time_interval_s(16, 4)
    assert lo <= truth.step_time_s(16, 4) <= hi


def test_fit_interval_covers_truth_most_of_the_time() -> None:
    truth = StepCostModel(0.01, 0.0003, 0.002, 0.0001)
    rng = np.random.default_rng(1)
    hits = 0
    for _ in range(100):
        fit = fit_step_cost(*synthetic(rng, truth, 120, noise=0.05))
        assert fit.model is not None
        lo, hi = fit.model.step_time_interval_s(32, 3)
        hits += lo <= truth.step_time_s(32, 3) <= hi
    assert hits >= 88


def test_weights_count_as_repeated_observations() -> None:
    truth = StepCostModel(0.01, 0.0003, 0.002, 0.0001)
    b = np.array([1, 8, 32, 1, 8, 32])
    k = np.array([0, 0, 0, 4, 4, 4])
    y = np.array([truth.step_time_s(int(x), int(z)) for x, z in zip(b, k, strict=True)])
    fit = fit_step_cost(b, k, y, weight=[100] * 6)
    assert fit.model is not None and fit.model.step_time_s(16, 2) == pytest.approx(truth.step_time_s(16, 2), rel=1e-6)


def test_one_k_cannot_separate_draft_from_target() -> None:
    fit = fit_step_cost([1, 2, 4, 8], [3, 3, 3, 3], [0.01, 0.011, 0.013, 0.017])
    assert fit.model is None and fit.reason is StepCostReason.K_NOT_VARIED
    assert "calibration sweep" in fit.message


def test_one_k_with_a_known_cost_ratio_fits_the_target() -> None:
    truth = StepCostModel.from_cost_ratio(0.08, target_step_s=0.02, per_token_s=0.0005)
    b = np.array([1, 2, 4, 8, 16, 16])
    y = np.array([truth.step_time_s(int(x), 3) for x in b])
    fit = fit_step_cost(b, [3] * 6, y, draft_cost_ratio=0.08)
    assert fit.reason is StepCostReason.FIXED_COST_RATIO and fit.model is not None
    assert "c = 0.080" in fit.message and "other K" in fit.message
    for name in ("fixed_s", "per_token_s", "draft_fixed_s", "draft_per_seq_s"):
        assert getattr(fit.model, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    # the K it never saw is predicted from the ratio, including the per-token growth with B
    assert fit.model.step_time_s(16, 0) == pytest.approx(truth.step_time_s(16, 0), rel=1e-6)


def test_a_wrong_cost_ratio_still_fits_the_observed_k_exactly() -> None:
    truth = StepCostModel(0.02, 0.0005, 0.004, 0.0)
    b = np.array([1, 4, 16])
    y = np.array([truth.step_time_s(int(x), 2) for x in b])
    fit = fit_step_cost(b, [2, 2, 2], y, draft_cost_ratio=0.5)
    assert fit.model is not None
    for x in (1, 4, 16):
        assert fit.model.step_time_s(x, 2) == pytest.approx(truth.step_time_s(x, 2), rel=0.05)


def test_one_batch_size_gives_a_flat_model_and_says_so() -> None:
    fit = fit_step_cost([4] * 6, [0, 1, 2, 3, 4, 5], [0.010, 0.012, 0.014, 0.016, 0.018, 0.020])
    assert fit.reason is StepCostReason.BATCH_NOT_VARIED and fit.model is not None
    assert fit.model.step_time_s(4, 3) == pytest.approx(0.016, rel=1e-6)
    assert fit.cost_ratio == pytest.approx(0.2, rel=1e-6)
    assert "batch size 4" in fit.message


def test_two_k_at_one_batch_size_measure_the_per_token_cost_given_the_cost_ratio() -> None:
    # gpu_code_rag's chat: 16 requests all day, K = 3 then 5. The slope in K at B = 16 is c·T(16, 0) plus
    # the verification of one more token per sequence; with c known it gives per_token_s, and the best K
    # at 16 is 4 — a model flat in B (Leviathan's, per_token_s = 0) said 5 and more.
    truth = StepCostModel.from_cost_ratio(0.08, target_step_s=0.025, per_token_s=0.0001)
    y = [truth.step_time_s(16, 3), truth.step_time_s(16, 5)]
    fit = fit_step_cost([16, 16], [3, 5], y, weight=[27, 700], draft_cost_ratio=0.08)
    assert fit.reason is StepCostReason.FIXED_COST_RATIO and fit.model is not None
    assert fit.model.per_token_s == pytest.approx(0.0001, rel=1e-6)
    assert fit.model.fixed_s == pytest.approx(0.025, rel=1e-6)
    assert "slope in K at B = 16" in fit.message
    alpha = ConstantAlphaModel(0.75, 0.74, 0.76)
    best = choose_k(KChoiceSnapshot(now=NOW, acceptance=alpha, step_cost=fit.model, batch_size=16, k_max=8))
    assert best.k == 4
    # one K at one batch size still cannot tell a per-token cost from a fixed one: flat, as before
    one = fit_step_cost([16], [3], y[:1], draft_cost_ratio=0.08)
    assert one.model is not None and one.model.per_token_s == 0.0 and "flat in B" in one.message
    # ... and says its per-token cost is assumed (the K policy then moves up only half-way), the pair does not
    assert one.model.per_token_assumed and not fit.model.per_token_assumed
    assert not StepCostModel.from_cost_ratio(0.08, 0.025).per_token_assumed  # Leviathan's: by configuration


def test_steps_under_another_draft_measure_the_target_after_a_swap() -> None:
    # Right after a swap to ngram (c ≈ 0.008) the engine has one K at one batch size of its own; the 8B's
    # steps before the swap (c = 0.08, K = 3 and 5) measure the same target.
    target = StepCostModel.from_cost_ratio(0.08, target_step_s=0.025, per_token_s=0.0001)
    ngram = StepCostModel.from_cost_ratio(0.008, target_step_s=0.025, per_token_s=0.0001)
    b, k = [16, 16, 16], [3, 5, 6]
    y = [target.step_time_s(16, 3), target.step_time_s(16, 5), ngram.step_time_s(16, 6)]
    fit = fit_target_cost(b, k, y, [30, 700, 40], [0.08, 0.08, 0.008], draft_cost_ratio=0.008)
    assert fit.model is not None and fit.reason is StepCostReason.FIXED_COST_RATIO
    for name in ("fixed_s", "per_token_s", "draft_fixed_s", "draft_per_seq_s"):
        assert getattr(fit.model, name) == pytest.approx(getattr(ngram, name), rel=1e-6)
    assert "other drafts" in fit.message
    # the new draft's steps alone are flat in B: K is over-chosen
    alone = fit_step_cost([16], [6], y[2:], draft_cost_ratio=0.008)
    assert alone.model is not None and alone.model.per_token_s == 0.0
    bad = fit_target_cost(b, k, y, [1, 1, 1], [0.08, -1.0, 0.008], draft_cost_ratio=0.008)
    assert bad.model is None and bad.reason is StepCostReason.INVALID_INPUT


@pytest.mark.parametrize(
    ("b", "k", "y", "fragment"),
    [
        ([1, 2], [0, 1], [0.01], "equal lengths"),
        ([1, 2, 3], [0, 1, 1], [0.01, -0.02, 0.01], "step_time_s[1]"),
        ([0, 2, 3], [0, 1, 1], [0.01, 0.02, 0.01], "batch_size[0]"),
        ([1, 2, 3], [0, 1.5, 1], [0.01, 0.02, 0.01], "k[1]"),
        ([1, 2], [0, 1], [0.01, 0.02], "at least 3"),
    ],
)
def test_bad_observations_are_named(b: list[float], k: list[float], y: list[float], fragment: str) -> None:
    fit = fit_step_cost(b, k, y)
    assert fit.model is None and fragment in fit.message


def test_model_round_trips_and_validates() -> None:
    model = StepCostModel.from_cost_ratio(0.05, target_step_s=0.02, per_token_s=0.001)
    assert model.cost_ratio(1) == pytest.approx(0.05) and model.cost_ratio(64) == pytest.approx(0.05)
    assert StepCostModel.from_dict(model.to_dict()) == model
    assumed = replace(StepCostModel.from_cost_ratio(0.05), per_token_assumed=True)
    assert StepCostModel.from_dict(assumed.to_dict()) == assumed
    with pytest.raises(ValueError, match="per_token_assumed must be true or false"):
        StepCostModel.from_dict({**model.to_dict(), "per_token_assumed": "yes"})
    with pytest.raises(ValueError, match="missing 'per_token_s'"):
        StepCostModel.from_dict({"fixed_s": 1.0})
    with pytest.raises(ValueError, match="finite number ≥ 0"):
        StepCostModel(-1.0, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match=r"cost ratio c .* must be a finite number ≥ 0"):
        StepCostModel.from_cost_ratio(-0.1)
    table = step_times_table(model, [1, 8], 3)
    assert table.shape == (2, 4) and table[1, 3] == pytest.approx(model.step_time_s(8, 3))


# -- measured cells ---------------------------------------------------------------------------------


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


def test_an_unmeasured_k_takes_the_level_of_the_cells_nearest_in_batch_size() -> None:
    """The live run of 7 Dec 16:48: the pinned model ran × 1.05 and × 1.03 at one stream (K = 3, 5) and
    × 0.94 at 16 streams (K = 1). One level over the three (× 1.00) priced plain decoding at 16 streams 6 %
    above what the engine's own steps there say; the level of the nearest cells prices it at × 0.94."""
    pinned = StepCostModel(0.0483, 0.004235, 0.0062, 0.000724, free_tokens=5.36)
    b, k, n = [1, 1, 15.66], [3, 5, 1], [382, 1557, 629]
    times = [pinned.step_time_s(bi, ki) * f for bi, ki, f in zip(b, k, [1.05, 1.03, 0.94], strict=True)]
    model = with_measured_cells(pinned, b, k, times, n, min_steps=50)
    assert isinstance(model, MeasuredStepCost)
    assert model.scale == pytest.approx(0.995, abs=0.002)  # the level over all cells, as the messages quote
    assert model.level(16, 0) == pytest.approx(0.94, abs=0.001)
    assert model.level(1, 0) == pytest.approx((382 * 1.05 + 1557 * 1.03) / 1939, abs=0.001)
    assert model.step_time_s(16, 0) == pytest.approx(pinned.step_time_s(16, 0) * model.level(16, 0))
    assert model.plain_step_time_s(16) == model.step_time_s(16, 0)
    # midway (B = 4: 6 bands from each), both clusters speak, by their steps
    assert model.level(4, 2) == pytest.approx((382 * 1.05 + 1557 * 1.03 + 629 * 0.94) / 2568, abs=0.001)
    # far beyond every cell the nearest speak (no underflow to a 0/0 level)
    assert model.level(10_000, 3) == pytest.approx(0.94, abs=0.001)
    # a measured cell keeps its own factor
    assert model.step_time_s(1, 5) == pytest.approx(times[1])


def test_an_unmeasured_cells_interval_is_taken_to_the_engines_level_with_its_mean() -> None:
    rng = np.random.default_rng(3)
    b = np.repeat([1.0, 4.0, 16.0, 64.0], 40)
    k = np.tile([0.0, 1.0, 3.0, 5.0], 40)
    t = np.array([LAB.step_time_s(bi, int(ki)) for bi, ki in zip(b, k, strict=True)])
    fitted = fit_step_cost(b, k, t * (1 + 0.03 * rng.standard_normal(t.size)), find_knee=False).model
    assert fitted is not None and fitted.covariance is not None
    measured = with_measured_cells(fitted, [16], [1], [1.2 * fitted.step_time_s(16, 1)], [100], min_steps=50)
    assert isinstance(measured, MeasuredStepCost)
    lo, hi = fitted.step_time_interval_s(16, 3)
    mlo, mhi = measured.step_time_interval_s(16, 3)
    assert measured.step_time_s(16, 3) == pytest.approx(1.2 * fitted.step_time_s(16, 3))
    assert (mhi - mlo) == pytest.approx(1.2 * (hi - lo))


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


# -- the draft pass of a K = 0 step -------------------------------------------------------------------


def test_a_loaded_k0_step_costs_one_draft_pass_and_plain_decoding_none() -> None:
    draft_pass = LAB.draft_fixed_s + LAB.draft_per_seq_s * 4
    assert LOADED.step_time_s(4, 0) == pytest.approx(LAB.step_time_s(4, 0) + draft_pass)
    assert LOADED.plain_step_time_s(4) == pytest.approx(LAB.step_time_s(4, 0)) == LAB.plain_step_time_s(4)
    assert LOADED.step_time_s(4, 3) == LAB.step_time_s(4, 3)  # K ≥ 1: K passes either way
    assert [LOADED.draft_passes(k) for k in (0, 1, 3)] == [1, 1, 3] and LAB.draft_passes(0) == 0
    rows = design_matrix(np.array([4.0, 4.0]), np.array([0.0, 0.0]), [True, False])
    assert rows.tolist() == [[1.0, 4.0, 1.0, 4.0], [1.0, 4.0, 0.0, 0.0]]
    assert LAB.with_draft_pass_at_k0(True) == LOADED and LOADED.with_draft_pass_at_k0(True) is LOADED
    assert StepCostModel.from_dict(LOADED.to_dict()) == LOADED
    assert StepCostModel.from_dict({k: v for k, v in LAB.to_dict().items() if k != "draft_pass_at_k0"}) == LAB
    with pytest.raises(ValueError, match="draft_pass_at_k0 must be true or false"):
        StepCostModel.from_dict({**LAB.to_dict(), "draft_pass_at_k0": "yes"})


def test_the_fit_reads_loaded_k0_steps_as_target_plus_a_draft_pass() -> None:
    b = np.array([1, 2, 4, 8, 16] * 3, float)
    k = np.array([0] * 5 + [3] * 5 + [0] * 5, float)
    loaded = np.array([True] * 10 + [False] * 5)  # the last five: an engine without a draft (speculation off)
    t = design_matrix(b, k, loaded) @ LAB.parameters
    fit = fit_step_cost(b, k, t, draft_pass_at_k0=loaded)
    assert fit.model is not None and fit.reason is StepCostReason.OK
    assert fit.model.parameters == pytest.approx(LAB.parameters, rel=1e-6)
    # read as plain steps, the same K = 0 steps would put the draft's pass into the target's cost
    naive = fit_step_cost(b, k, t)
    assert naive.model is not None
    assert naive.model.fixed_s > 1.2 * LAB.fixed_s or naive.model.per_token_s > 1.2 * LAB.per_token_s


def test_under_the_plugins_skip_a_k0_step_keeps_the_pass_only_when_a_prompt_enters() -> None:
    """The plugin skips the draft's pass in decode-only K = 0 steps; a closed loop of B sequences of L output
    tokens starts B / L requests a step, so a share 1 − exp(−B / L) of its K = 0 steps keeps the pass."""
    skip = LAB.with_k0_skip(64.0)
    draft_pass = LAB.draft_fixed_s + LAB.draft_per_seq_s * 64
    share = 1.0 - math.exp(-1.0)
    assert skip.k0_passes(64) == pytest.approx(share) and skip.k0_passes(1) == pytest.approx(1 - math.exp(-1 / 64))
    assert skip.step_time_s(64, 0) == pytest.approx(LAB.step_time_s(64, 0) + share * draft_pass)
    assert skip.step_time_s(64, 3) == LAB.step_time_s(64, 3) and skip.plain_step_time_s(64) == LAB.plain_step_time_s(64)
    assert skip.design_row(64, 0) @ LAB.parameters == pytest.approx(skip.step_time_s(64, 0))
    assert LAB.with_k0_skip(0.0) is LAB and LAB.k0_passes(64) == 0.0 and LOADED.k0_passes(64) == 1.0
    assert StepCostModel.from_dict(skip.to_dict()) == skip and "k0_skip_output_tokens" not in LAB.to_dict()
    with pytest.raises(ValueError, match="k0_skip_output_tokens"):
        StepCostModel.from_dict({**LAB.to_dict(), "k0_skip_output_tokens": "many"})
    table = step_times_table(skip, [1, 16, 64], 2)
    assert table[2, 0] == pytest.approx(skip.step_time_s(64, 0))
    assert table[1, 2] == pytest.approx(skip.step_time_s(16, 2))
    # fitted from such an engine's steps, the share per observation recovers the truth
    b = np.array([1, 2, 4, 8, 16, 32, 64] * 2, float)
    k = np.array([0] * 7 + [3] * 7, float)
    passes = skip.k0_passes_array(b)
    t = design_matrix(b, k, passes) @ LAB.parameters
    fit = fit_step_cost(b, k, t, draft_pass_at_k0=passes)
    assert fit.model is not None and fit.model.parameters == pytest.approx(LAB.parameters, rel=1e-6)
    # measured cells laid over it keep the skip (their factors were measured against it)
    cells = with_measured_cells(skip, [64.0], [0.0], [skip.step_time_s(64, 0) * 1.1], [100], 50)
    assert isinstance(cells, MeasuredStepCost) and cells.k0_skip_output_tokens == 64.0
    assert cells.step_time_s(64, 0) == pytest.approx(1.1 * skip.step_time_s(64, 0))
    assert cells.linear().k0_skip_output_tokens == 64.0


def test_loaded_k0_and_k1_alone_cannot_separate_draft_from_target() -> None:
    b = np.array([1, 4, 16, 1, 4, 16], float)
    k = np.array([0, 0, 0, 1, 1, 1], float)
    t = design_matrix(b, k, True) @ LAB.parameters
    fit = fit_step_cost(b, k, t, draft_pass_at_k0=True)
    assert fit.model is None and fit.reason is StepCostReason.K_NOT_VARIED
    assert "1 draft pass(es) per step (K = 0, 1)" in fit.message
    bad = fit_step_cost(b, k, t, draft_pass_at_k0=[True, False])
    assert bad.reason is StepCostReason.INVALID_INPUT and "2 entries for 6 observations" in bad.message


def test_a_table_with_the_draft_loaded_keeps_drafting_where_k0_would_only_save_verification() -> None:
    """The lab's predictable prompts at 16 streams: no speculation 766 tok/s, medium K = 3 772, a table
    with K = 0 at 16 streams 590 (bench/results/live_cells.md). Read as plain decoding, K = 0 wins at 16;
    with its draft pass counted, drafting wins."""
    alpha = ConstantAlphaModel(0.95, 0.94, 0.96)

    def table(model: StepCostModel) -> list[list[int]]:
        snap = KTableSnapshot(now=NOW, acceptance=alpha, step_cost=model, max_batch_size=16, k_max=5)
        return k_table(snap).as_vllm()

    assert table(LAB)[-1][2] == 0
    rows = table(LOADED)
    assert all(kk >= 1 for _, _, kk in rows), rows
    # the speedup is still over plain decoding, not over the loaded K = 0
    d = choose_k(KChoiceSnapshot(now=NOW, acceptance=alpha, step_cost=LOADED, batch_size=16, k_max=5, k0_is_off=False))
    k0 = d.by_k[0]
    assert k0.step_time_s == pytest.approx(LOADED.step_time_s(16, 0))
    assert k0.speedup == pytest.approx(LOADED.plain_step_time_s(16) / LOADED.step_time_s(16, 0)) and k0.speedup < 1


def test_one_k_per_engine_reads_k0_as_restarting_without_the_draft() -> None:
    alpha = ConstantAlphaModel(0.3, 0.25, 0.35)
    d = choose_k(KChoiceSnapshot(now=NOW, acceptance=alpha, step_cost=LOADED, batch_size=16, k_max=5))
    assert d.k == 0 and d.by_k[0].speedup == pytest.approx(1.0)
    assert d.by_k[0].step_time_s == pytest.approx(LOADED.plain_step_time_s(16))
    bins = [(60.0, 16.0)]
    off = goodput_over_load(alpha, LOADED, bins, 0)
    assert off.tokens_per_s == pytest.approx(16 / LOADED.plain_step_time_s(16))


def test_measured_loaded_k0_cells_set_the_level_of_plain_decoding() -> None:
    # this engine: K = 0 at B = 1 measured 11.4 ms with its draft loaded (the lab: 5.8 ms without one)
    model = with_measured_cells(LOADED, [1, 1], [0, 3], [0.0114, 0.025], [100, 100], min_steps=50)
    assert isinstance(model, MeasuredStepCost) and model.draft_pass_at_k0
    assert model.step_time_s(1, 0) == pytest.approx(0.0114)
    factor = 0.0114 / LOADED.step_time_s(1, 0)
    assert model.plain_step_time_s(1) == pytest.approx(LAB.plain_step_time_s(1) * factor)
    assert model.linear() == LOADED
    # switching the flag drops the cells: they were measured against the other reading of K = 0
    assert model.with_draft_pass_at_k0(False) == LAB
    # an engine whose K = 0 steps are plain (ngram): its K = 0 cells are plain decoding itself
    ngram = with_measured_cells(LAB, [1], [0], [0.0058], [100], min_steps=50)
    assert ngram.plain_step_time_s(1) == pytest.approx(0.0058)


def test_a_lookup_drafts_in_one_pass_and_verifies_only_the_share_of_steps_it_drafted_at() -> None:
    model = StepCostModel(fixed_s=0.04, per_token_s=0.0025, draft_fixed_s=0.002, draft_per_seq_s=0.0001)
    lookup = replace(model, proposal_share=0.4, lookup_proposer=True)
    for batch, k in ((1, 3), (64, 1), (16, 5)):
        # the target scores B·(1 + share·K) tokens; one lookup a step drafts all K tokens
        want = 0.04 + 0.0025 * batch * (1 + 0.4 * k) + (0.002 + 0.0001 * batch)
        assert lookup.step_time_s(batch, k) == pytest.approx(want)
        # a draft model: K passes, every sequence verifies K + 1 tokens
        assert model.step_time_s(batch, k) == pytest.approx(
            0.04 + 0.0025 * batch * (k + 1) + k * (0.002 + 0.0001 * batch)
        )
    assert lookup.step_time_s(8, 0) == lookup.plain_step_time_s(8) == model.plain_step_time_s(8)
    assert [lookup.draft_passes(k) for k in (0, 1, 5)] == [0, 1, 1]
    assert StepCostModel.from_dict(lookup.to_dict()) == lookup
    cov = ((1e-8, 0.0, 0.0, 0.0), (0.0, 1e-10, 0.0, 0.0), (0.0, 0.0, 1e-8, 0.0), (0.0, 0.0, 0.0, 1e-10))
    lo, hi = replace(lookup, covariance=cov).step_time_interval_s(16, 5)
    assert lo < lookup.step_time_s(16, 5) < hi
    # a draft model's dict is as it always was
    assert "proposal_share" not in model.to_dict() and "lookup_proposer" not in model.to_dict()
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="proposal_share"):
            replace(model, proposal_share=bad)


# An engine whose target pass is flat until it scores 6 tokens, then grows 3.6 ms a token (the roofline's
# knee; the gpu-like lab's CPU engine measured ~40 ms flat up to 4-6 tokens).
KNEE = StepCostModel(0.045, 0.0036, 0.0078, 0.00105, free_tokens=6.0)


def _sweep(rng: np.random.Generator, truth: StepCostModel, noise: float = 0.03):
    """A calibration sweep: every K = 0..5 at 1-64 streams, four visits each, ±3 % step noise."""
    grid = [(b, k) for b in (1, 2, 4, 8, 16, 32, 64) for k in range(6)] * 4
    b = np.array([g[0] for g in grid], float)
    k = np.array([g[1] for g in grid], float)
    y = np.array([truth.step_time_s(bb, int(kk)) for bb, kk in grid]) * (1 + noise * rng.standard_normal(len(grid)))
    return b, k, y


def _table_ks(model: StepCostModel, alpha: float) -> np.ndarray:
    table = k_table(KTableSnapshot(now=NOW, acceptance=ConstantAlphaModel(alpha, alpha, alpha), step_cost=model,
                                   max_batch_size=64, k_max=5))
    return np.array([k for lo, hi, k in table.as_vllm() for _ in range(lo, hi + 1)])


def _goodput(truth: StepCostModel, alpha: float, b: int, k: int) -> float:
    return b * (1 - alpha ** (k + 1)) / (1 - alpha) / truth.step_time_s(b, k)


@pytest.mark.parametrize("seed", range(4))
def test_the_fit_finds_the_rooflines_knee_and_its_table_loses_less_than_the_straight_lines(seed: int) -> None:
    b, k, y = _sweep(np.random.default_rng(seed), KNEE)
    fit = fit_step_cost(b, k, y)
    line = fit_step_cost(b, k, y, find_knee=False)
    assert fit.model is not None and line.model is not None
    assert fit.model.free_tokens == pytest.approx(6.0, abs=1.0)
    assert "flat up to" in fit.message and line.model.free_tokens == 0.0
    assert fit.model.step_time_s(4, 0) == pytest.approx(KNEE.step_time_s(4, 0), rel=0.05)  # flat below the knee

    def worst(model: StepCostModel) -> float:  # the worst batch's goodput under the truth, ÷ its best K's
        ks = _table_ks(model, 0.95)
        return min(_goodput(KNEE, 0.95, bb, int(ks[bb - 1])) / max(_goodput(KNEE, 0.95, bb, kk) for kk in range(6))
                   for bb in range(1, 65))

    assert worst(fit.model) >= 0.97
    assert worst(fit.model) > worst(line.model)


def test_a_straight_engine_gets_no_knee_and_an_exact_one_needs_none() -> None:
    for seed in range(3):  # noise alone does not buy a knee: it must pay for its parameter
        b, k, y = _sweep(np.random.default_rng(seed), StepCostModel(0.012, 0.0004, 0.0015, 0.00005))
        fit = fit_step_cost(b, k, y)
        assert fit.model is not None and fit.model.free_tokens == 0.0 and "flat up to" not in fit.message
    b, k, y = _sweep(np.random.default_rng(0), LAB, noise=0.0)
    exact = fit_step_cost(b, k, y)
    assert exact.model is not None and exact.model.free_tokens == 0.0
    assert exact.model.parameters == pytest.approx(LAB.parameters, rel=1e-6)


def _one_k(rng: np.random.Generator, truth: StepCostModel, k: int, noise: float = 0.03):
    """Steps at one K over 1-64 streams, four visits each (K held while the load moves)."""
    b = np.array([1, 2, 4, 8, 16, 32, 64] * 4, float)
    y = np.array([truth.step_time_s(bb, k) for bb in b]) * (1 + noise * rng.standard_normal(b.size))
    return b, np.full(b.size, float(k)), y


def test_one_k_over_several_batch_sizes_shows_the_knee_given_the_cost_ratio() -> None:
    c = 0.15  # the draft's pass is c × the target's, as the fixed-ratio fit takes it
    truth = StepCostModel(0.045, 0.0036, c * 0.045, c * 0.0036, free_tokens=6.0)
    for seed in range(3):
        b, k, y = _one_k(np.random.default_rng(seed), truth, 1)
        fit = fit_step_cost(b, k, y, draft_cost_ratio=c)
        assert fit.model is not None and fit.reason is StepCostReason.FIXED_COST_RATIO
        assert fit.model.free_tokens == pytest.approx(6.0, abs=1.5) and "flat up to" in fit.message
        assert fit.model.step_time_s(4, 1) == pytest.approx(truth.step_time_s(4, 1), rel=0.06)
        straight = fit_step_cost(b, k, y, draft_cost_ratio=c, find_knee=False)
        assert straight.model is not None and straight.model.free_tokens == 0.0
        # the knee's model prices a step it did not see (16 streams at K = 3) closer than the line

        def error(model: StepCostModel) -> float:
            return abs(model.step_time_s(16, 3) / truth.step_time_s(16, 3) - 1)

        assert error(fit.model) <= 0.06 and error(fit.model) < error(straight.model)
        # a straight engine's steps at one K buy no knee
        line = StepCostModel(0.012, 0.0004, c * 0.012, c * 0.0004)
        b, k, y = _one_k(np.random.default_rng(seed), line, 1)
        plain = fit_step_cost(b, k, y, draft_cost_ratio=c)
        assert plain.model is not None and plain.model.free_tokens == 0.0


def test_steps_under_several_drafts_show_the_targets_knee_after_a_swap() -> None:
    # after a swap the target's fit reads the steps under the old draft (c = 0.15, K = 1) and the new one's
    # (c = 0.01, K = 3) over the loads they ran at: the target's knee is the same under both
    old = StepCostModel(0.045, 0.0036, 0.15 * 0.045, 0.15 * 0.0036, free_tokens=6.0)
    new = StepCostModel(0.045, 0.0036, 0.01 * 0.045, 0.01 * 0.0036, free_tokens=6.0)
    rng = np.random.default_rng(7)
    b1, k1, y1 = _one_k(rng, old, 1)
    b2, k2, y2 = _one_k(rng, new, 3)
    b, k, y = np.concatenate([b1, b2]), np.concatenate([k1, k2]), np.concatenate([y1, y2])
    ratios = [0.15] * b1.size + [0.01] * b2.size
    fit = fit_target_cost(b, k, y, np.ones(b.size), ratios, draft_cost_ratio=0.01)
    assert fit.model is not None and fit.model.free_tokens == pytest.approx(6.0, abs=1.5)
    assert fit.model.step_time_s(16, 3) == pytest.approx(new.step_time_s(16, 3), rel=0.06)
    flat = fit_target_cost(b, k, y, np.ones(b.size), ratios, draft_cost_ratio=0.01, find_knee=False)
    assert flat.model is not None and flat.model.free_tokens == 0.0


def test_the_knee_round_trips_and_shapes_every_prediction() -> None:
    assert StepCostModel.from_dict(KNEE.to_dict()) == KNEE
    assert "free_tokens" not in LAB.to_dict()  # a straight model's dict is as it always was
    with pytest.raises(ValueError, match="free_tokens"):
        StepCostModel(0.045, 0.0036, 0.0, 0.0, free_tokens=-1.0)
    with pytest.raises(ValueError, match="free_tokens"):
        StepCostModel.from_dict({**KNEE.to_dict(), "free_tokens": "six"})
    # below the knee a pass costs its fixed part; past it per token; the draft's pass is linear in B
    assert KNEE.plain_step_time_s(4) == pytest.approx(0.045)
    assert KNEE.plain_step_time_s(16) == pytest.approx(0.045 + 0.0036 * 10)
    assert KNEE.step_time_s(2, 2) == pytest.approx(0.045 + 2 * (0.0078 + 0.00105 * 2))
    assert KNEE.cost_ratio(1) == pytest.approx((0.0078 + 0.00105) / 0.045)
    table = step_times_table(KNEE, [1, 4, 16], 3)
    assert table == pytest.approx(np.array([[KNEE.step_time_s(bb, kk) for kk in range(4)] for bb in (1, 4, 16)]))
    assert KNEE.design_row(16, 1) @ KNEE.parameters == pytest.approx(KNEE.step_time_s(16, 1))
    # a draft swapped in keeps the target's knee; measured cells keep it too
    assert KNEE.with_draft_ratio(0.1).free_tokens == 6.0 and KNEE.with_draft_cost(0.001, 0.0).free_tokens == 6.0
    measured = with_measured_cells(KNEE, [16.0], [1], [KNEE.step_time_s(16, 1) * 1.2], [100], 50)
    assert measured.free_tokens == 6.0 and measured.linear().free_tokens == 6.0
    assert measured.step_time_s(16, 1) == pytest.approx(KNEE.step_time_s(16, 1) * 1.2)
