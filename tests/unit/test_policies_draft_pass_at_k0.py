"""A K = 0 step of an engine that loaded a draft model still runs one draft pass (vLLM keeps the draft's
KV cache in sync), so a per-batch-size table's K = 0 is not "speculation off"."""

from __future__ import annotations

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
    design_matrix,
    fit_step_cost,
    with_measured_cells,
)

# The lab's T(B, K) as bench_live pins it, in seconds; LOADED is the same engine with its draft model loaded.
LAB = StepCostModel(fixed_s=0.00208, per_token_s=0.0000953, draft_fixed_s=0.001566, draft_per_seq_s=0.000217)
LOADED = replace(LAB, draft_pass_at_k0=True)
NOW = datetime(2026, 12, 3, tzinfo=UTC)


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
