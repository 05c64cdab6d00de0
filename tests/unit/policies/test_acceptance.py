"""α from counters: the MLE, its interval, the K-dependent rates, and every way counters can be bad."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import optimize, stats

from bench.research.simulate import accepted_per_draft, counters_from_accepted, simulate_counters, simulate_evidence
from policies.acceptance import (
    AcceptanceEvidence,
    AlphaReason,
    IntervalMethod,
    alpha_interval,
    alpha_of_windows,
    estimate_alpha,
    evidence_from_counters,
    pool_evidence,
)
from policies.counters import SpecCounters

ESTIMATE_KEYS = [
    "num_spec_tokens",
    "drafts",
    "draft_tokens",
    "accepted_tokens",
    "draft_acceptance_rate",
    "mean_acceptance_length",
    "alpha",
    "alpha_ci",
    "conditional_acceptance_by_position",
]


def test_hand_computed_window() -> None:
    # K = 3, five drafts accepting 0, 1, 3, 2, 3 tokens.
    c = counters_from_accepted(np.array([0, 1, 3, 2, 3]), 3)
    assert (c.drafts, c.draft_tokens, c.accepted_tokens, c.accepted_per_pos) == (5, 15, 9, (4, 3, 2))
    est = estimate_alpha(c)
    # S = A = 9 accepted, F = D − a_2 = 3 rejections: α̂ = 9/12.
    assert est.alpha == pytest.approx(0.75)
    assert est.draft_acceptance_rate == pytest.approx(9 / 15)
    assert est.mean_acceptance_length == pytest.approx(1 + 9 / 5)
    assert est.conditional_acceptance_by_position == pytest.approx((4 / 5, 3 / 4, 2 / 3))
    assert est.reason is AlphaReason.OK
    lo, hi = est.alpha_ci or (0, 0)
    assert lo < 0.75 < hi
    assert "α = 0.750" in est.message


def test_to_dict_has_exactly_the_design_keys() -> None:
    d = estimate_alpha(simulate_counters(np.random.default_rng(0), 0.6, 4, 100)).to_dict()
    assert list(d) == ESTIMATE_KEYS
    assert isinstance(d["alpha_ci"], list) and len(d["alpha_ci"]) == 2
    assert len(d["conditional_acceptance_by_position"]) == 4


def test_mle_equals_direct_maximisation_of_per_draft_likelihood() -> None:
    """The closed form must equal maximising Π_j α^{n_j}(1−α)^{[n_j<K]} numerically."""
    rng = np.random.default_rng(7)
    k = 5
    n = accepted_per_draft(rng, [0.9, 0.8, 0.7, 0.6, 0.5], k, 2000)[0]

    def neg_loglik(a: float) -> float:
        return -float(np.sum(n * math.log(a) + (n < k) * math.log1p(-a)))

    direct = optimize.minimize_scalar(neg_loglik, bounds=(1e-6, 1 - 1e-6), method="bounded", options={"xatol": 1e-10})
    assert estimate_alpha(counters_from_accepted(n, k)).alpha == pytest.approx(direct.x, abs=1e-6)


def test_alpha_is_not_the_draft_acceptance_rate() -> None:
    c = simulate_counters(np.random.default_rng(1), 0.8, 5, 5000)
    est = estimate_alpha(c)
    assert est.alpha == pytest.approx(0.8, abs=0.02)
    # A/T = E[n]/K = α(1−α^K)/((1−α)K) ≈ 0.538 at α = 0.8, K = 5: far from α.
    assert est.draft_acceptance_rate == pytest.approx(0.8 * (1 - 0.8**5) / (0.2 * 5), abs=0.02)


def test_no_drafts_gives_none_with_reason() -> None:
    est = estimate_alpha(SpecCounters())
    assert est.alpha is None and est.alpha_ci is None
    assert est.reason is AlphaReason.NO_DRAFTS and est.reason == "no_drafts"
    assert est.draft_acceptance_rate is None and est.mean_acceptance_length is None
    assert list(est.to_dict()) == ESTIMATE_KEYS


def test_all_rejected_and_all_accepted_edges() -> None:
    zero = estimate_alpha(counters_from_accepted(np.zeros(50, dtype=np.int64), 3))
    assert zero.alpha == 0.0 and zero.alpha_ci is not None and zero.alpha_ci[0] == 0.0 and zero.alpha_ci[1] < 0.06
    full = estimate_alpha(counters_from_accepted(np.full(50, 3, dtype=np.int64), 3))
    assert full.alpha == 1.0 and full.alpha_ci is not None and full.alpha_ci[1] == 1.0 and full.alpha_ci[0] > 0.97


@pytest.mark.parametrize(
    ("counters", "fragment"),
    [
        (SpecCounters(10, 30, 12, (5, 4, 2), 3), "sum to 11"),
        (SpecCounters(10, 30, 31, (10, 10, 11), 3), "exceed draft tokens"),
        (SpecCounters(10, 30, 13, (4, 5, 4), 3), "must not increase"),
        (SpecCounters(10, 30, 9, (5, 4), 3), "2 per-position counters for K = 3"),
        (SpecCounters(10, 30, 12, (11, 1, 0), 3), "exceed drafts"),
    ],
)
def test_inconsistent_counters_say_what_is_wrong(counters: SpecCounters, fragment: str) -> None:
    est = estimate_alpha(counters)
    assert est.reason is AlphaReason.INCONSISTENT_COUNTERS
    assert est.alpha is None
    assert fragment in est.message


def test_negative_counter_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"cannot be negative.*reset"):
        estimate_alpha(SpecCounters(-1, 0, 0))


def test_missing_per_position_counts() -> None:
    est = estimate_alpha(SpecCounters(drafts=10, draft_tokens=30, accepted_tokens=12, num_spec_tokens=3))
    assert est.reason is AlphaReason.NO_PER_POSITION and est.alpha is None
    assert "num_accepted_tokens_per_pos" in est.message
    assert est.draft_acceptance_rate == pytest.approx(0.4)


def test_dynamic_k_without_per_position_drafts_is_refused_not_guessed() -> None:
    # 10 drafts, 25 draft tokens: K varied between 2 and 3 inside the window.
    est = estimate_alpha(SpecCounters(drafts=10, draft_tokens=25, accepted_tokens=12, accepted_per_pos=(6, 4, 2)))
    assert est.reason is AlphaReason.DYNAMIC_K_UNRESOLVED and est.alpha is None
    assert "per-step records" in est.message


def test_dynamic_k_with_per_position_drafts_is_accurate() -> None:
    rng = np.random.default_rng(3)
    parts = [counters_from_accepted(accepted_per_draft(rng, 0.65, k, 4000)[0], k) for k in (2, 5)]
    mixed = SpecCounters(
        drafts=8000,
        draft_tokens=parts[0].draft_tokens + parts[1].draft_tokens,
        accepted_tokens=parts[0].accepted_tokens + parts[1].accepted_tokens,
        accepted_per_pos=tuple(
            a + b for a, b in zip((*parts[0].accepted_per_pos, 0, 0, 0), parts[1].accepted_per_pos, strict=True)
        ),
        draft_tokens_per_pos=(8000, 8000, 4000, 4000, 4000),
    )
    est = estimate_alpha(mixed)
    assert est.reason is AlphaReason.OK
    assert est.alpha == pytest.approx(0.65, abs=0.015)


def test_profile_and_beta_intervals_agree_on_large_samples() -> None:
    ev = AcceptanceEvidence(7000.0, 3000.0, 3000.0)
    beta = alpha_interval(ev, method=IntervalMethod.BETA)
    prof = alpha_interval(ev, method=IntervalMethod.PROFILE)
    assert beta == pytest.approx(prof, abs=5e-4)
    wider = alpha_interval(ev, confidence=0.99)
    assert wider[0] < beta[0] and wider[1] > beta[1]


def test_pool_evidence_adds_windows_at_different_k_and_refuses_bad_ones() -> None:
    rng = np.random.default_rng(4)
    windows = [simulate_counters(rng, 0.55, k, 3000) for k in (1, 3, 6)]
    pooled = pool_evidence([*windows, SpecCounters()])
    assert pooled.evidence is not None
    assert pooled.evidence.successes / pooled.evidence.trials == pytest.approx(0.55, abs=0.01)
    bad = pool_evidence([windows[0], SpecCounters(10, 30, 12, (5, 4, 2), 3)])
    assert bad.evidence is None and bad.reason is AlphaReason.INCONSISTENT_COUNTERS


def test_confidence_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        estimate_alpha(SpecCounters(), confidence=1.0)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(alpha=st.floats(0.05, 0.95), k=st.integers(1, 10), seed=st.integers(0, 2**32 - 1))
def test_estimate_within_002_after_5000_drafts(alpha: float, k: int, seed: int) -> None:
    est = estimate_alpha(simulate_counters(np.random.default_rng(seed), alpha, k, 5000))
    assert est.alpha is not None
    assert abs(est.alpha - alpha) <= 0.02


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.9])
def test_error_distribution_after_5000_drafts(alpha: float, k: int) -> None:
    """Over 1 000 seeded runs: unbiased, and 99% of estimates within ±0.02 (worst case K = 1, α ≈ 0.5)."""
    s, f = simulate_evidence(np.random.default_rng(11), alpha, k, 5000, 1000)
    err = s / (s + f) - alpha
    assert abs(float(err.mean())) < 0.002
    assert float(np.quantile(np.abs(err), 0.99)) <= 0.02


@pytest.mark.parametrize("method", [IntervalMethod.BETA, IntervalMethod.PROFILE])
@pytest.mark.parametrize(("alpha", "k", "drafts"), [(0.3, 1, 5000), (0.6, 3, 5000), (0.85, 5, 5000), (0.7, 4, 300)])
def test_95_interval_coverage_over_1000_runs(alpha: float, k: int, drafts: int, method: IntervalMethod) -> None:
    s, f = simulate_evidence(np.random.default_rng(2024), alpha, k, drafts, 1000)
    if method is IntervalMethod.BETA:
        lo = stats.beta.ppf(0.025, s + 0.5, f + 0.5)
        hi = stats.beta.ppf(0.975, s + 0.5, f + 0.5)
    else:
        bounds = [alpha_interval(AcceptanceEvidence(a, b, 0.0), 0.95, method) for a, b in zip(s, f, strict=True)]
        lo, hi = np.array([b[0] for b in bounds]), np.array([b[1] for b in bounds])
    coverage = float(np.mean((lo <= alpha) & (alpha <= hi)))
    assert 0.93 <= coverage <= 0.97, coverage


def test_vectorised_interval_matches_the_function() -> None:
    ev = AcceptanceEvidence(1234.0, 567.0, 600.0)
    lo, hi = alpha_interval(ev)
    assert lo == pytest.approx(stats.beta.ppf(0.025, 1234.5, 567.5))
    assert hi == pytest.approx(stats.beta.ppf(0.975, 1234.5, 567.5))


def test_evidence_scaling_is_validated() -> None:
    with pytest.raises(ValueError, match="finite number ≥ 0"):
        AcceptanceEvidence(1, 1, 1).scaled(-0.5)
    assert evidence_from_counters(SpecCounters()).reason is AlphaReason.NO_DRAFTS


def test_effective_k_of_a_table_window() -> None:
    from policies.acceptance import effective_counters

    # engine at K_max = 4, the table drafted 2 per step: positions 3 and 4 are zero
    c = SpecCounters(100, 200, 150, (80, 70, 0, 0), num_spec_tokens=4)
    eff = effective_counters(c)
    assert eff is not None and eff.k == 2 and eff.accepted_per_pos == (80, 70)
    # half the steps drafted 2, half 3 (T/D = 2.5): split, 50 drafts at position 3
    split = effective_counters(SpecCounters(100, 250, 150, (80, 50, 20, 0), num_spec_tokens=4))
    assert split is not None and split.k == 3 and split.accepted_per_pos == (80, 50, 20)
    assert split.draft_tokens_per_pos == (100, 100, 50)
    # a draft longer than 3 was accepted, or position 3 accepted more than the 50 drafted there: not two K
    assert effective_counters(SpecCounters(100, 250, 160, (80, 50, 20, 10), num_spec_tokens=4)) is None
    assert effective_counters(SpecCounters(100, 250, 190, (80, 50, 60, 0), num_spec_tokens=4)) is None
    assert effective_counters(c.__class__()) == c.__class__()


def test_alpha_of_windows_pools_windows_at_their_effective_k() -> None:
    from policies.acceptance import alpha_of_windows, estimate_alpha, pool_evidence

    # one config at K_max = 4 under a table: half the windows drafted 4 per step, half 2 (α = 0.8 i.i.d.)
    at4 = SpecCounters(1000, 4000, 800 + 640 + 512 + 410, (800, 640, 512, 410), num_spec_tokens=4)
    at2 = SpecCounters(1000, 2000, 800 + 640, (800, 640, 0, 0), num_spec_tokens=4)
    pooled = alpha_of_windows([at4, at2, at4, at2])
    summed = estimate_alpha(at4 + at2 + at4 + at2)
    assert pooled.alpha is not None and pooled.alpha == pytest.approx(0.8, abs=0.01)
    # the summed counters mix two K (T/D = 3 ≠ 4): read at K_max they are refused, not mis-estimated
    assert summed.alpha is None and pooled.alpha_ci is not None
    assert "pooled over windows at K = [2, 4]" in pooled.message
    assert pool_evidence([at4]).evidence is not None
    # every window at the config's K: the summed counters' estimate, exactly
    assert alpha_of_windows([at4, at4]) == estimate_alpha(at4 + at4)
    # one window mixed K 4 and 2 (a load step inside it): left out, the others at K = 4 give α; the summed
    # counters (T ≠ K·D, no per-position draft counts) cannot
    mixed = SpecCounters(1000, 3000, 800 + 640 + 256 + 205, (800, 640, 256, 205), num_spec_tokens=4)
    assert estimate_alpha(at4 + at4 + mixed).alpha is None
    around = alpha_of_windows([at4, mixed, at4])
    assert around.alpha is not None and around.alpha == pytest.approx(0.8, abs=0.01)
    assert around.alpha == alpha_of_windows([at4, at4]).alpha
    assert "pooled over windows at K = [4]" in around.message


def counters(rng: np.random.Generator, alpha: float, k: int, drafts: int) -> SpecCounters:
    """One window of i.i.d. acceptance at ``alpha``: accepted length per draft, truncated at K."""
    surv = np.concatenate([[1.0], np.cumprod(np.full(k, alpha))])
    p = surv - np.append(surv[1:], 0.0)
    exact = rng.multinomial(drafts, p)
    at_least = np.cumsum(exact[::-1])[::-1]
    per_pos = tuple(int(x) for x in at_least[1:])
    return SpecCounters(drafts, drafts * k, sum(per_pos), per_pos, k)


def mixed_4_5(rng: np.random.Generator, alpha: float, n5: int, n4: int) -> SpecCounters:
    """One window of a table drafting 5 for ``n5`` drafts and 4 for ``n4`` (the engine at K_max = 5)."""
    at5, at4 = counters(rng, alpha, 5, n5), counters(rng, alpha, 4, n4)
    return at5 + SpecCounters(at4.drafts, at4.draft_tokens, at4.accepted_tokens, (*at4.accepted_per_pos, 0), 5)


def test_windows_that_drafted_at_two_neighbouring_k_give_alpha() -> None:
    # live, 6 Dec 16:06: 4 streams under a table drafting 5 at 1–3 sequences and 4 at 4–5; every window
    # mixed the two. The summed counters of each cannot be read; split, the windows pooled cover the truth.
    rng = np.random.default_rng(7)

    for alpha in (0.55, 0.8, 0.9):
        windows = [
            mixed_4_5(rng, alpha, int(600 * share), 600 - int(600 * share))
            for share in (0.1, 0.3, 0.5, 0.7, 0.9)
            for _ in range(4)
        ]
        assert all(estimate_alpha(w).alpha is None for w in windows)  # T ≠ K·D: the summed counters cannot
        est = alpha_of_windows(windows)
        assert est.alpha is not None and est.alpha_ci is not None
        assert est.alpha_ci[0] - 0.01 < alpha < est.alpha_ci[1] + 0.01, (alpha, est)


def test_small_split_windows_give_valid_and_unbiased_per_position_trials() -> None:
    # live, 6 Dec: a 2-s window split at K = 4 / 5 had 5 drafts accepted at position 5 where 3.66 were expected
    # to reach it; PositionData refused the counts and every decision whose evidence held the window failed
    from policies.acceptance import effective_counters
    from policies.positional import PositionData

    split = effective_counters(SpecCounters(10, 42, 36, (9, 9, 8, 8, 2), num_spec_tokens=5))
    assert split is not None and split.draft_tokens_per_pos == (10, 10, 10, 10, 2)
    alone = PositionData.from_counters(split)  # expected reach at position 5: 8 × 2 / 10 = 1.6 < 2 accepted
    assert alone.trials == (10.0, 9.0, 9.0, 8.0, 2.0) and alone.successes == (9.0, 9.0, 8.0, 8.0, 2.0)
    # small mixed windows of a draft at α, as a table's row boundary makes them: pooled, every position reads α
    # (the expected reach is summed; raised to the acceptances window by window, position 5 read 0.884 at 0.9)
    for alpha in (0.6, 0.9):
        rng = np.random.default_rng(11)
        windows = []
        for _ in range(3000):
            n = int(rng.integers(2, 60))
            n5 = int(rng.integers(1, n))
            eff = effective_counters(mixed_4_5(rng, alpha, n5, n - n5))
            assert eff is not None and eff.draft_tokens_per_pos is not None
            windows.append(eff)
        pooled = PositionData.from_windows(windows)
        rates = [s / t for s, t in zip(pooled.successes, pooled.trials, strict=True)]
        assert all(abs(r - alpha) < 0.01 for r in rates), (alpha, rates)
        # every window alone is valid too (no ValueError), whatever it accepted
        assert all(PositionData.from_counters(w).trials[4] >= w.accepted_per_pos[4] for w in windows[:500])


def test_wandering_windows_are_overdispersed_and_widen_the_interval() -> None:
    rng = np.random.default_rng(2)
    steady = [counters(rng, 0.7, 3, 4000) for _ in range(30)]
    noisy = [counters(rng, float(np.clip(0.7 + 0.04 * rng.standard_normal(), 0, 0.99)), 3, 4000) for _ in range(30)]
    a, b = alpha_of_windows(steady), alpha_of_windows(noisy)
    assert a.dispersion < 1.5 < 10 < b.dispersion
    assert a.alpha_ci is not None and b.alpha_ci is not None
    width = lambda ci: ci[1] - ci[0]  # noqa: E731
    assert width(b.alpha_ci) > 3 * width(a.alpha_ci)
    assert b.alpha_ci[0] < 0.7 < b.alpha_ci[1]
