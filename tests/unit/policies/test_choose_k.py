"""E(α, K), Leviathan's speedup, best K under memory, and the per-batch-size K table."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.research.simulate import accepted_per_draft
from policies.acceptance_model import ConstantAlphaModel
from policies.choose_k import KChoiceSnapshot, KReason, choose_k, goodput_over_load, load_bins
from policies.k_table import (
    AcceptanceBucket,
    KTableReason,
    KTableSnapshot,
    k_table,
    merge_ranges,
    off_gain_over_load,
)
from policies.memory import DraftFootprint, MemoryBudget, check_memory
from policies.speedup import (
    expected_tokens_from_conditional,
    expected_tokens_per_step,
    leviathan_speedup,
)
from policies.step_cost import StepCostModel

NOW = datetime(2026, 1, 1, tzinfo=UTC)
MiB = 2**20


def snap(alpha: float, c: float, k_max: int = 16, batch: int = 1, **kw: Any) -> KChoiceSnapshot:
    return KChoiceSnapshot(NOW, ConstantAlphaModel.exact(alpha), StepCostModel.from_cost_ratio(c), batch, k_max, **kw)


def test_expected_tokens_formula_and_edges() -> None:
    assert expected_tokens_per_step(0.8, 0) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens_from_conditional([0.5, 0.5]) == pytest.approx(expected_tokens_per_step(0.5, 2))
    with pytest.raises(ValueError, match="alpha must lie in"):
        expected_tokens_per_step(1.2, 3)
    with pytest.raises(ValueError, match="integer ≥ 0"):
        expected_tokens_per_step(0.5, -1)


def test_expected_tokens_matches_simulation() -> None:
    n = accepted_per_draft(np.random.default_rng(5), 0.7, 6, 200_000)[0]
    assert float(n.mean() + 1) == pytest.approx(expected_tokens_per_step(0.7, 6), rel=0.005)


@pytest.mark.parametrize(("alpha", "c", "best_k", "speedup"), [(0.8, 0.05, 8, 3.09), (0.7, 0.1, 4, 1.98)])
def test_leviathan_reference_points(alpha: float, c: float, best_k: int, speedup: float) -> None:
    decision = choose_k(snap(alpha, c, k_max=20))
    assert decision.k == best_k
    assert round(decision.speedup, 2) == speedup
    assert decision.speedup == pytest.approx(leviathan_speedup(alpha, best_k, c))
    assert decision.reason is KReason.SPECULATE
    # the neighbours really are worse
    assert leviathan_speedup(alpha, best_k - 1, c) < decision.speedup > leviathan_speedup(alpha, best_k + 1, c)


def test_k_zero_when_speculation_does_not_pay() -> None:
    decision = choose_k(snap(0.1, 0.5, k_max=8))
    assert decision.k == 0 and decision.reason is KReason.SPECULATION_DOES_NOT_PAY
    assert decision.speedup == 1.0
    assert "does not pay" in decision.message


def test_k_max_zero() -> None:
    decision = choose_k(snap(0.9, 0.01, k_max=0))
    assert decision.k == 0 and decision.reason is KReason.K_MAX_ZERO


def test_memory_limits_k_and_says_so() -> None:
    draft = DraftFootprint("draft_model", weights_bytes=100 * MiB, kv_bytes_per_token=1024)
    # 8 sequences × (1024 × (1000 + K) + 4096 × K) bytes + weights: K = 8 needs ≈ 108.1 MiB.
    budget = MemoryBudget(budget_bytes=int(108 * MiB), target_kv_bytes_per_token=4096, tokens_per_seq=1000)
    decision = choose_k(snap(0.8, 0.05, k_max=16, batch=8, draft=draft, memory=budget))
    assert decision.reason is KReason.MEMORY_LIMITED
    assert 0 < decision.k < 8
    assert check_memory(draft, decision.k, 8, budget).fits
    assert not check_memory(draft, decision.k + 1, 8, budget).fits
    assert "fits memory" in decision.message and "budget" in decision.message


def test_no_k_fits_memory() -> None:
    draft = DraftFootprint("draft_model", weights_bytes=500 * MiB, kv_bytes_per_token=1024)
    budget = MemoryBudget(budget_bytes=100 * MiB, tokens_per_seq=100)
    decision = choose_k(snap(0.8, 0.05, draft=draft, memory=budget))
    assert decision.k == 0 and decision.reason is KReason.NO_K_FITS_MEMORY


def test_uncertain_alpha_gives_a_speedup_interval_and_gain_vs_current() -> None:
    model = ConstantAlphaModel(0.75, 0.70, 0.80)
    decision = choose_k(KChoiceSnapshot(NOW, model, StepCostModel.from_cost_ratio(0.05), 1, 12, current_k=2))
    lo, hi = decision.speedup_ci
    assert lo < decision.speedup < hi
    assert decision.gain_vs_current is not None and decision.gain_vs_current > 1.0
    assert decision.gain_vs_current_ci is not None
    assert decision.gain_vs_current_ci[0] < decision.gain_vs_current < decision.gain_vs_current_ci[1]


def test_fitted_cost_model_uncertainty_widens_the_interval() -> None:
    exact = StepCostModel(0.01, 0.0, 0.0005, 0.0)
    fuzzy = StepCostModel(
        0.01,
        0.0,
        0.0005,
        0.0,
        covariance=tuple(tuple(float(x) for x in r) for r in np.diag([1e-7, 0, 1e-9, 0])),
    )
    model = ConstantAlphaModel(0.75, 0.70, 0.80)
    a = choose_k(KChoiceSnapshot(NOW, model, exact, 1, 8))
    b = choose_k(KChoiceSnapshot(NOW, model, fuzzy, 1, 8))
    assert a.k == b.k and a.speedup == pytest.approx(b.speedup)
    assert b.speedup_ci[0] < a.speedup_ci[0] and b.speedup_ci[1] > a.speedup_ci[1]


def test_snapshot_validation() -> None:
    with pytest.raises(ValueError, match="K_max must be an integer ≥ 0"):
        snap(0.5, 0.1, k_max=-1)
    with pytest.raises(ValueError, match="batch size"):
        snap(0.5, 0.1, batch=0)
    with pytest.raises(ValueError, match="footprint"):
        snap(0.5, 0.1, memory=MemoryBudget(budget_bytes=1))


def test_merge_ranges() -> None:
    assert merge_ranges([4, 4, 3, 3, 3, 0]) == ((1, 2, 4), (3, 5, 3), (6, 6, 0))
    assert merge_ranges([2]) == ((1, 1, 2),)
    with pytest.raises(ValueError):
        merge_ranges([])


def test_k_table_shrinks_k_with_load() -> None:
    cost = StepCostModel.from_cost_ratio(0.1, per_token_s=0.02)
    table = k_table(KTableSnapshot(NOW, ConstantAlphaModel.exact(0.7), cost, 64, 8))
    assert table.reason is KTableReason.VARIES_WITH_BATCH
    ks = [k for _, _, k in table.rows]
    assert ks == sorted(ks, reverse=True) and ks[0] == 4
    assert table.rows[0][0] == 1 and table.rows[-1][1] == 64
    assert table.k_for(1) == 4 and table.k_for(64) == ks[-1]
    assert table.as_vllm() == [list(r) for r in table.rows]


def test_k_table_turns_speculation_off_at_high_load() -> None:
    cost = StepCostModel.from_cost_ratio(0.2, per_token_s=0.2)
    table = k_table(KTableSnapshot(NOW, ConstantAlphaModel.exact(0.5), cost, 32, 6))
    assert table.rows[-1][2] == 0
    assert table.decisions[-1].reason is KReason.SPECULATION_DOES_NOT_PAY


def test_dropping_the_draft_is_weighed_against_a_table_on_the_load() -> None:
    # the draft model's pass is 0.2 of the target's and still runs at a table's K = 0 (draft_pass_at_k0)
    cost = replace(StepCostModel.from_cost_ratio(0.2, per_token_s=0.2), draft_pass_at_k0=True)
    alpha = ConstantAlphaModel(0.5, 0.45, 0.55)
    table = k_table(KTableSnapshot(NOW, alpha, cost, 32, 6)).rows
    assert table[-1][2] == 0
    full = off_gain_over_load(NOW, alpha, cost, table, [(600.0, 32.0)], 32, 6)
    assert full is not None
    # at 32 streams the table's row is K = 0 with the draft's pass: T(32, 0) = 1 + 6.4 + 0.2 · 7.4 → 1.2×
    assert full.gain == pytest.approx((1.0 + 0.2 * 32 + 0.2 * (1.0 + 0.2 * 32)) / (1.0 + 0.2 * 32))
    assert full.interval[0] <= full.gain <= full.interval[1]
    lone = off_gain_over_load(NOW, alpha, cost, table, [(600.0, 1.0)], 32, 6)
    assert lone is not None and lone.interval[1] < 1.0  # one stream: the table speculates and wins
    half = off_gain_over_load(NOW, alpha, cost, table, [(300.0, 1.0), (300.0, 32.0)], 32, 6)
    assert half is not None and lone.gain < half.gain < full.gain
    assert off_gain_over_load(NOW, alpha, cost, table, [], 32, 6) is None


def test_k_table_constant_under_leviathan() -> None:
    table = k_table(KTableSnapshot(NOW, ConstantAlphaModel.exact(0.8), StepCostModel.from_cost_ratio(0.05), 16, 12))
    assert table.rows == ((1, 16, 8),) and table.reason is KTableReason.CONSTANT


def test_k_table_uses_per_bucket_acceptance() -> None:
    buckets = (AcceptanceBucket(9, 16, ConstantAlphaModel.exact(0.2)),)
    table = k_table(
        KTableSnapshot(
            NOW,
            ConstantAlphaModel.exact(0.8),
            StepCostModel.from_cost_ratio(0.3),
            16,
            8,
            acceptance_by_batch_size=buckets,
        )
    )
    assert table.k_for(4) > 0 and table.k_for(12) == 0


def test_k_table_memory_binds_at_high_batch() -> None:
    draft = DraftFootprint("draft_model", weights_bytes=10 * MiB, kv_bytes_per_token=2048)
    budget = MemoryBudget(budget_bytes=40 * MiB, target_kv_bytes_per_token=8192, tokens_per_seq=512)
    table = k_table(
        KTableSnapshot(NOW, ConstantAlphaModel.exact(0.8), StepCostModel.from_cost_ratio(0.05), 64, 8, draft, budget)
    )
    for b, decision in enumerate(table.decisions, start=1):
        assert check_memory(draft, decision.k, b, budget).fits
    assert table.k_for(1) == 8 and table.k_for(64) < 8


@st.composite
def cost_models(draw: st.DrawFn) -> StepCostModel:
    return StepCostModel(
        fixed_s=draw(st.floats(0.001, 0.1)),
        per_token_s=draw(st.floats(0.0, 0.01)),
        draft_fixed_s=draw(st.floats(0.0, 0.05)),
        draft_per_seq_s=draw(st.floats(0.0, 0.005)),
    )


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    alpha=st.floats(0.0, 1.0),
    cost=cost_models(),
    k_max=st.integers(0, 12),
    batch=st.integers(1, 64),
    weights_mib=st.integers(0, 200),
    kv_per_token=st.integers(0, 65536),
    budget_mib=st.integers(0, 400),
    tokens=st.integers(1, 4096),
)
def test_property_k_in_bounds_and_never_over_budget(
    alpha: float,
    cost: StepCostModel,
    k_max: int,
    batch: int,
    weights_mib: int,
    kv_per_token: int,
    budget_mib: int,
    tokens: int,
) -> None:
    draft = DraftFootprint("draft_model", weights_mib * MiB, kv_per_token)
    budget = MemoryBudget(budget_bytes=budget_mib * MiB, target_kv_bytes_per_token=4096, tokens_per_seq=tokens)
    decision = choose_k(KChoiceSnapshot(NOW, ConstantAlphaModel.exact(alpha), cost, batch, k_max, draft, budget))
    assert 0 <= decision.k <= k_max
    assert check_memory(draft, decision.k, batch, budget).fits
    best_feasible = max(o.goodput_tokens_per_s for o in decision.by_k if o.fits_memory)
    assert decision.by_k[decision.k].goodput_tokens_per_s == pytest.approx(best_feasible)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(cost=cost_models(), k_max=st.integers(0, 10), max_batch=st.integers(1, 48), alpha=st.floats(0.0, 1.0))
def test_property_k_table_is_contiguous_from_one(cost: StepCostModel, k_max: int, max_batch: int, alpha: float) -> None:
    table = k_table(KTableSnapshot(NOW, ConstantAlphaModel.exact(alpha), cost, max_batch, k_max))
    assert table.rows[0][0] == 1 and table.rows[-1][1] == max_batch
    for (lo, hi, k), nxt in zip(table.rows, table.rows[1:], strict=False):
        assert lo <= hi and nxt[0] == hi + 1 and nxt[2] != k
    assert all(0 <= k <= k_max for _, _, k in table.rows)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    a1=st.floats(0.0, 1.0),
    a2=st.floats(0.0, 1.0),
    cost=cost_models(),
    k=st.integers(0, 12),
    batch=st.integers(1, 64),
)
def test_property_goodput_monotone_in_alpha(a1: float, a2: float, cost: StepCostModel, k: int, batch: int) -> None:
    lo, hi = sorted((a1, a2))
    d_lo = choose_k(KChoiceSnapshot(NOW, ConstantAlphaModel.exact(lo), cost, batch, k))
    d_hi = choose_k(KChoiceSnapshot(NOW, ConstantAlphaModel.exact(hi), cost, batch, k))
    # at every fixed K and for the best K
    for o_lo, o_hi in zip(d_lo.by_k, d_hi.by_k, strict=True):
        assert o_hi.goodput_tokens_per_s >= o_lo.goodput_tokens_per_s * (1 - 1e-12)
    assert d_hi.speedup >= d_lo.speedup * (1 - 1e-12)


def test_load_bins_group_by_band_and_weight_by_time() -> None:
    bins = load_bins([(10.0, 8.0), (10.0, 8.4), (5.0, 160.0), (10.0, 0.0), (0.0, 50.0)])
    assert [round(s) for s, _ in bins] == [20, 5]  # 0 running is left out, and so is a 0-second window
    assert bins[0][1] == pytest.approx(8.2) and bins[1][1] == pytest.approx(160.0)


def test_one_k_for_a_bursty_load_is_the_fixed_k_oracle() -> None:
    # 70B/8B (c = 0.08) with a per-token verify cost: the best K at B = 8 is large, at B = 160 small; over
    # 55 min at 8 and 5 min at 160 the best single K lies between — and is what brute force over K says.
    cost = StepCostModel.from_cost_ratio(0.08, target_step_s=0.025, per_token_s=0.0001)
    alpha = ConstantAlphaModel(0.75, 0.74, 0.76)
    bins = load_bins([(3300.0, 8.0), (300.0, 160.0)])
    scores = [goodput_over_load(alpha, cost, bins, k) for k in range(9)]
    best = max(scores, key=lambda g: g.tokens_per_s).k

    def total(k: int, b: float, seconds: float) -> float:
        return seconds * b * alpha.expected_tokens(k) / cost.step_time_s(b, k)

    brute = max(range(9), key=lambda k: total(k, 8.0, 3300.0) + total(k, 160.0, 300.0))
    at_b8 = choose_k(KChoiceSnapshot(NOW, alpha, cost, 8, 8)).k
    at_b160 = choose_k(KChoiceSnapshot(NOW, alpha, cost, 160, 8)).k
    assert best == brute and at_b160 < best < at_b8
    lo, hi = scores[best].interval
    assert lo < scores[best].tokens_per_s < hi


def test_a_memory_cap_makes_k_zero_win_when_the_draft_costs_too_many_batch_slots() -> None:
    """K = 0 drops the draft: 24 sequences fit instead of 8. At a demand of 24 plain decoding serves three
    times the batch, which beats what speculation gains per sequence; at the same batch it would not."""
    snap = KChoiceSnapshot(
        now=NOW,
        acceptance=ConstantAlphaModel(0.6, 0.58, 0.62),
        step_cost=StepCostModel.from_cost_ratio(0.08, target_step_s=0.02, per_token_s=0.0001),
        batch_size=24,
        k_max=4,
        current_k=3,
    )
    uncapped = choose_k(snap)
    assert uncapped.k > 0
    capped = choose_k(replace(snap, batch_caps=(24, 8, 8, 8, 8)))
    assert capped.k == 0 and capped.reason is KReason.SPECULATION_DOES_NOT_PAY
    k3 = capped.by_k[3]
    assert k3.goodput_tokens_per_s == pytest.approx(8 * k3.expected_tokens_per_step / k3.step_time_s)
    assert k3.speedup < 1.0  # over plain decoding at its own batch of 24
    assert capped.gain_vs_current is not None and capped.gain_vs_current > 1.0
    # a load profile: each bin's demand is capped per K too
    assert goodput_over_load(snap.acceptance, snap.step_cost, ((60.0, 24.0),), 3, cap=8).tokens_per_s == pytest.approx(
        goodput_over_load(snap.acceptance, snap.step_cost, ((60.0, 8.0),), 3).tokens_per_s
    )
    with pytest.raises(ValueError, match="one entry per K"):
        replace(snap, batch_caps=(24, 8))
