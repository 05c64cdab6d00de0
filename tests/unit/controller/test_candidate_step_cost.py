"""A swap proposes each draft candidate at the K the step times this engine measured under it favour
(tuner/controller/step_cost.py ``candidate_step_costs``), ranking every candidate on the linear T(B, K)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import pytest

from policies.draft_choice import DraftCandidate, DraftChoiceSnapshot, choose_enable
from policies.spec_config import SpecConfig
from policies.step_cost import MeasuredStepCost, StepCostModel
from tuner.controller.step_cost import StepGroup, candidate_step_costs

NOW = datetime(2026, 12, 5, 12, tzinfo=UTC)
TARGET = StepCostModel.from_cost_ratio(0.0, 0.02, 0.0001)  # the target alone: 20 ms + 0.1 ms a token
BIG = DraftCandidate("big", "draft_model", "/m/8b", prior_alpha=0.75, cost_ratio=0.08)
SMALL = DraftCandidate("small", "draft_model", "/m/1b", prior_alpha=0.6, cost_ratio=0.03)
NGRAM = DraftCandidate("ngram", "ngram", prior_alpha=0.3)
BIG_SPEC = SpecConfig("draft_model", "/m/8b", 3)


def linear(c: DraftCandidate) -> StepCostModel:
    assert c.cost_ratio is not None
    return TARGET.with_draft_ratio(c.cost_ratio)


def groups_at(spec: SpecConfig, cells: dict[tuple[int, int], float], model: StepCostModel) -> list[StepGroup]:
    """Steps under ``spec`` measured at factor × ``model``'s T(B, K), 500 at each (B, K)."""
    return [StepGroup(spec, float(b), float(k), f * model.step_time_s(b, k), 500.0) for (b, k), f in cells.items()]


def test_a_candidate_that_ran_carries_its_measured_cells_and_one_that_did_not_has_none() -> None:
    measured = {(15, 3): 0.9, (15, 2): 1.05}
    groups = groups_at(BIG_SPEC, measured, linear(BIG))
    groups.append(StepGroup(None, 15.0, 3.0, 1.0, 500.0))  # a config outside the horizon: nobody's
    out = candidate_step_costs(groups, TARGET, [BIG, SMALL, NGRAM], None, min_steps=100)
    assert set(out) == {"big"}
    model = out["big"]
    assert isinstance(model, MeasuredStepCost)
    assert model.step_time_s(15, 3) == pytest.approx(0.9 * linear(BIG).step_time_s(15, 3), rel=1e-6)
    assert model.step_time_s(15, 2) == pytest.approx(1.05 * linear(BIG).step_time_s(15, 2), rel=1e-6)
    # too few steps for a cell: the candidate is ranked on the linear model
    assert candidate_step_costs(groups, TARGET, [BIG], None, min_steps=1000) == {}
    # the running draft's fitted draft terms are not the candidate's: its own cost ratio is
    fitted = replace(TARGET, draft_fixed_s=0.5, draft_per_seq_s=0.5)
    again = candidate_step_costs(groups, fitted, [BIG], None, min_steps=100)["big"]
    assert again.linear().draft_fixed_s == pytest.approx(0.08 * 0.02)


def test_the_swap_ranks_a_draft_at_the_k_its_measured_cells_favour() -> None:
    # Memory-bound long contexts: every step reads each sequence's KV whatever K is, a cost the linear
    # model books per scored token; measured, K = 3 is cheaper and K = 2 dearer than the model says.
    base = snapshot()
    plain = {r.name: r for r in choose_enable(base).ranking}
    measured = {(b, k): 1.0 + 0.12 * (2 - k) for b in (12, 14, 15, 16) for k in (1, 2, 3, 4, 5)}
    own = candidate_step_costs(groups_at(BIG_SPEC, measured, linear(BIG)), TARGET, [BIG], None, min_steps=100)
    with_cells = {r.name: r for r in choose_enable(replace(base, step_cost_of=own)).ranking}
    assert plain["big"].k < with_cells["big"].k
    assert "which this engine's steps under it favour" in with_cells["big"].message
    # ranked on the linear model at that K (a draft that never ran has no cells to lift it: both alike)
    assert with_cells["big"].speedup <= plain["big"].speedup
    assert with_cells["small"] == plain["small"]


def snapshot() -> DraftChoiceSnapshot:
    return DraftChoiceSnapshot(
        now=NOW,
        current=None,
        current_k=0,
        windows=(),
        candidates=(BIG, SMALL),
        history={},
        batch_size=15,
        k_max=5,
        step_cost=TARGET,
    )
