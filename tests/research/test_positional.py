"""Per-position acceptance, constant-α goodness of fit, decay extrapolation, other sources, groups."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from bench.research.estimators import (
    counters_from_histogram,
    estimate_alpha_from_histograms,
    estimate_alpha_from_steps,
    estimate_alpha_pooled,
)
from bench.research.groups import GroupReason, batch_size_bucket, estimate_by_group, prompt_length_bucket
from bench.research.simulate import accepted_per_draft, counters_from_accepted, simulate_counters
from policies.acceptance import AlphaReason, estimate_alpha
from policies.counters import SpecCounters
from policies.dispersion import DispersionReason, estimate_dispersion
from policies.positional import FitReason, PositionalModel, PositionData, check_constant_alpha

DECAY = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]


def positions(rng: np.random.Generator, acceptance: float | list[float], k: int, drafts: int) -> PositionData:
    return PositionData.from_counters(simulate_counters(rng, acceptance, k, drafts))


def test_position_data_from_counters_and_histogram_agree() -> None:
    n = accepted_per_draft(np.random.default_rng(0), DECAY, 4, 1000)[0]
    hist = np.bincount(n, minlength=5)
    a = PositionData.from_counters(counters_from_accepted(n, 4))
    b = PositionData.from_histogram(hist)
    assert a == b
    assert a.trials[0] == 1000 and a.trials[1] == a.successes[0]
    with pytest.raises(ValueError, match="0 ≤ successes ≤ trials"):
        PositionData((5.0,), (6.0,))


def test_constant_alpha_fits_iid_data_at_about_the_nominal_rate() -> None:
    rng = np.random.default_rng(1)
    rejections = sum(
        check_constant_alpha(positions(rng, 0.6, 5, 2000), significance=0.05).reason
        is FitReason.CONSTANT_ALPHA_REJECTED
        for _ in range(300)
    )
    assert 5 <= rejections <= 27  # 5% of 300 = 15, binomial ±3 sd


def test_constant_alpha_rejected_for_decaying_drafts() -> None:
    check = check_constant_alpha(positions(np.random.default_rng(2), DECAY, 5, 3000))
    assert check.reason is FitReason.CONSTANT_ALPHA_REJECTED
    assert check.p_value is not None and check.p_value < 1e-6
    assert "per-position model" in check.message
    # over-dispersion weakens the evidence, so a large φ can make it fit again
    assert check_constant_alpha(positions(np.random.default_rng(2), DECAY, 5, 3000), dispersion=1e4).reason is (
        FitReason.CONSTANT_ALPHA_FITS
    )


def test_constant_alpha_needs_two_positions() -> None:
    check = check_constant_alpha(positions(np.random.default_rng(3), 0.5, 1, 100))
    assert check.reason is FitReason.TOO_FEW_POSITIONS and "K ≥ 2" in check.message


def test_interpolation_uses_observed_positions() -> None:
    model = PositionalModel.fit(positions(np.random.default_rng(4), DECAY, 6, 20000))
    for k in (1, 3, 6):
        truth = float(np.cumprod(DECAY[:k]).sum())
        lo, hi = model.expected_tokens_interval(k)
        assert lo <= 1 + truth <= hi
        assert not model.predict(k).extrapolated


def test_extrapolation_widens_beyond_observed_k() -> None:
    model = PositionalModel.fit(positions(np.random.default_rng(5), DECAY, 3, 5000))
    widths = [np.subtract(*model.expected_tokens_interval(k)[::-1]) for k in range(1, 9)]
    assert all(b > a for a, b in itertools.pairwise(widths))
    rate_widths = [np.subtract(*model.predict(k).draft_acceptance_rate_ci[::-1]) for k in (3, 6)]
    assert rate_widths[1] > 3 * rate_widths[0]
    p = model.predict(6)
    assert p.extrapolated and "extrapolated beyond the observed K = 3" in p.message


@pytest.mark.parametrize("acceptance", [DECAY, [0.7] * 8, [0.5, 0.6, 0.7, 0.75, 0.8, 0.8, 0.8, 0.8]])
def test_extrapolated_prediction_covers_truth_for_several_shapes(acceptance: list[float]) -> None:
    model = PositionalModel.fit(positions(np.random.default_rng(6), acceptance, 3, 3000))
    for k in (4, 6, 8):
        truth = float(np.cumprod(acceptance[:k]).sum()) / k
        lo, hi = model.predict(k).draft_acceptance_rate_ci
        assert lo <= truth <= hi, (k, lo, truth, hi)


def test_prediction_interval_for_a_new_run_covers_its_measurement() -> None:
    """Estimate at K = 4, measure 100 fresh runs at K = 2 with 1 000 drafts: ~95% inside."""
    rng = np.random.default_rng(7)
    model = PositionalModel.fit(positions(rng, DECAY, 4, 4000))
    lo, hi = model.predict(2, drafts=1000).draft_acceptance_rate_ci
    rates = accepted_per_draft(rng, DECAY, 2, 1000, runs=200).mean(axis=1) / 2
    inside = float(np.mean((lo <= rates) & (rates <= hi)))
    assert inside >= 0.9


def test_expected_tokens_are_computed_once_per_k_and_agree_with_predict() -> None:
    # a K table asks one model for every batch size: E(K) and its interval are kept per K
    model = PositionalModel.fit(positions(np.random.default_rng(9), DECAY, 4, 4000), max_k=8)
    for k in range(0, 9):
        first = (model.expected_tokens(k), model.expected_tokens_interval(k))
        assert (model.expected_tokens(k), model.expected_tokens_interval(k)) == first
        if k:
            p = model.predict(k)
            assert first[0] == pytest.approx(p.expected_tokens_per_step)
            assert first[1] == pytest.approx(p.expected_tokens_ci)
    assert sorted(model._tokens) == list(range(9))
    with pytest.raises(ValueError, match="beyond this model's max_k = 8"):
        model.expected_tokens_interval(9)  # a K it cannot answer is refused every time, never cached
    with pytest.raises(ValueError, match="beyond this model's max_k = 8"):
        model.expected_tokens(9)


def test_model_validates_inputs() -> None:
    model = PositionalModel.fit(positions(np.random.default_rng(8), 0.5, 2, 100), max_k=4)
    with pytest.raises(ValueError, match="beyond this model's max_k = 4"):
        model.expected_tokens(5)
    with pytest.raises(ValueError, match="K = 0 has no acceptance"):
        model.predict(0)
    with pytest.raises(ValueError, match="≥ 1"):
        PositionalModel.fit(positions(np.random.default_rng(8), 0.5, 2, 100), dispersion=0.5)
    with pytest.raises(ValueError, match="no drafts"):
        PositionalModel.fit(PositionData((), ()))


def test_dispersion_is_one_for_binomial_groups_and_large_for_mixed_ones() -> None:
    rng = np.random.default_rng(9)
    same = [positions(rng, 0.6, 3, 300) for _ in range(50)]
    phi_same = estimate_dispersion(same)
    assert phi_same.reason is DispersionReason.ESTIMATED and phi_same.dispersion < 1.3
    mixed = [positions(rng, float(a), 3, 300) for a in rng.uniform(0.2, 0.9, 50)]
    assert estimate_dispersion(mixed).dispersion > 5
    assert estimate_dispersion(same[:1]).reason is DispersionReason.TOO_FEW_GROUPS


def test_histograms_estimate_alpha_and_widen_for_heterogeneous_requests() -> None:
    rng = np.random.default_rng(10)
    alphas = rng.uniform(0.3, 0.9, 200)
    hists = [np.bincount(accepted_per_draft(rng, float(a), 4, 50)[0], minlength=5) for a in alphas]
    narrow = estimate_alpha_from_histograms(hists, widen_for_dispersion=False)
    wide = estimate_alpha_from_histograms(hists)
    assert narrow.alpha == wide.alpha
    assert narrow.alpha_ci is not None and wide.alpha_ci is not None
    assert (wide.alpha_ci[1] - wide.alpha_ci[0]) > 2 * (narrow.alpha_ci[1] - narrow.alpha_ci[0])
    assert "over-dispersion" in wide.message


def test_histogram_counters_are_exact() -> None:
    c = counters_from_histogram([2, 1, 0, 3])  # K = 3: two drafts accepted 0, one 1, three all 3
    assert c == SpecCounters(
        drafts=6, draft_tokens=18, accepted_tokens=10, accepted_per_pos=(4, 3, 3), num_spec_tokens=3
    )
    assert estimate_alpha(c).alpha == pytest.approx(10 / (10 + 3))
    with pytest.raises(ValueError, match="K \\+ 1 ≥ 2 entries"):
        counters_from_histogram([5])


def test_steps_from_a_per_batch_size_table_pool_exactly() -> None:
    rng = np.random.default_rng(11)
    steps = []
    for k in [5, 5, 2, 0, 2, 5] * 200:
        n = accepted_per_draft(rng, 0.7, k, 8)[0]
        c = counters_from_accepted(n, k)
        # the plugin reports K_max = 5 positions even when the step drafted fewer
        steps.append(
            SpecCounters(c.drafts, c.draft_tokens, c.accepted_tokens, (*c.accepted_per_pos, *(0,) * (5 - k)), 5)
        )
    est = estimate_alpha_from_steps(steps)
    assert est.reason is AlphaReason.OK and est.num_spec_tokens == 5
    assert est.alpha == pytest.approx(0.7, abs=0.02)
    # the same counters summed into one /metrics window cannot be resolved
    total = steps[0]
    for s in steps[1:]:
        total = total + s
    assert estimate_alpha(total).reason is AlphaReason.DYNAMIC_K_UNRESOLVED


def test_pooled_estimate_reports_a_bad_item() -> None:
    est = estimate_alpha_pooled(
        [simulate_counters(np.random.default_rng(0), 0.5, 2, 10), SpecCounters(3, 6, 9, (3, 3), 2)]
    )
    assert est.reason is AlphaReason.INCONSISTENT_COUNTERS and "pooled items" in est.message
    assert estimate_alpha_pooled([]).reason is AlphaReason.NO_DRAFTS


def test_buckets() -> None:
    assert [batch_size_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 200)] == [
        (1, 1), (2, 2), (3, 4), (3, 4), (5, 8), (5, 8), (9, 16), (129, 256),
    ]  # fmt: skip
    assert prompt_length_bucket(10) == "0-128" and prompt_length_bucket(129) == "129-512"
    assert prompt_length_bucket(10_000) == ">8192"
    with pytest.raises(ValueError, match="≥ 1"):
        batch_size_bucket(0)


def test_groups_that_differ_and_groups_that_agree() -> None:
    rng = np.random.default_rng(12)
    differ = [("short", simulate_counters(rng, 0.8, 3, 2000)), ("long", simulate_counters(rng, 0.5, 3, 2000))]
    res = estimate_by_group(differ)
    assert res.reason is GroupReason.GROUPS_DIFFER
    assert res.estimates["short"].alpha == pytest.approx(0.8, abs=0.03)
    agree = [(b, simulate_counters(rng, 0.6, 3, 2000)) for b in ((1, 1), (2, 2), (3, 4))]
    assert estimate_by_group(agree).reason is GroupReason.GROUPS_AGREE
    assert estimate_by_group(agree[:1]).reason is GroupReason.TOO_FEW_GROUPS
