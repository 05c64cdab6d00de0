"""The fleet view's policy: groups, pooled α̂ with an honest interval, outliers, the hierarchical prior."""

from __future__ import annotations

import numpy as np
import pytest

from bench.research.simulate import simulate_counters
from policies.acceptance import AcceptanceEvidence, alpha_interval, alpha_of_windows
from policies.counters import SpecCounters
from policies.fleet import (
    EngineWindows,
    FleetSettings,
    OutlierVerdict,
    PriorReason,
    PriorSettings,
    fleet_prior,
    group_fleet,
    shrink,
)
from policies.spec_config import SpecConfig

DRAFT = SpecConfig("draft_model", "/models/draft", 4)
TARGET = "meta/target"


def _engine(
    rng: np.random.Generator, name: str, alpha: float, config: SpecConfig = DRAFT, windows: int = 4, drafts: int = 500
) -> EngineWindows:
    k = config.k or 1
    return EngineWindows(name, TARGET, config, tuple(simulate_counters(rng, alpha, k, drafts) for _ in range(windows)))


def test_groups_by_target_draft_and_fingerprint() -> None:
    rng = np.random.default_rng(1)
    same_other_key_order = SpecConfig.from_vllm(
        {"num_speculative_tokens": 4, "model": "/models/draft", "method": "draft_model"}
    )
    engines = [
        _engine(rng, "a", 0.7),
        _engine(rng, "b", 0.7, same_other_key_order),
        _engine(rng, "c", 0.7, DRAFT.with_k(3)),  # another K: another config
        EngineWindows("d", "other/target", DRAFT, (simulate_counters(rng, 0.7, 4, 500),)),
    ]
    groups = group_fleet(engines)
    assert [sorted(e.engine for e in g.engines) for g in groups] == [["a", "b"], ["c"], ["d"]]
    assert groups[0].key.target == TARGET and groups[0].key.draft_model == "/models/draft"
    assert groups[0].key.fingerprint == DRAFT.fingerprint
    assert groups[2].key.target == "other/target"


def test_pooled_point_is_alpha_of_windows_over_the_group() -> None:
    rng = np.random.default_rng(2)
    engines = [_engine(rng, f"e{i}", a) for i, a in enumerate((0.6, 0.7, 0.8))]
    (group,) = group_fleet(engines)
    expected = alpha_of_windows([w for e in engines for w in e.windows])
    assert group.alpha == pytest.approx(expected.alpha)
    assert group.pooled.alpha_ci == pytest.approx(expected.alpha_ci)
    # the engines differ far more than sampling allows: φ ≫ 1 widens the interval
    assert group.dispersion.dispersion > 5
    assert group.alpha_ci is not None and expected.evidence is not None
    binomial = alpha_interval(expected.evidence)  # every token as an independent trial
    assert group.alpha_ci[1] - group.alpha_ci[0] > 2 * (binomial[1] - binomial[0])
    assert "widened by √φ" in group.message


def test_widened_interval_covers_the_fleet_mean_where_the_binomial_one_does_not() -> None:
    """Engines' α drawn around μ = 0.7 (sd 0.05): the pooled interval is about the fleet, so it must
    cover μ at roughly its nominal rate; the binomial interval (tokens as independent) does not."""
    rng = np.random.default_rng(3)
    mu, sd, reps = 0.7, 0.05, 150
    covered = covered_binomial = 0
    for _ in range(reps):
        alphas = np.clip(rng.normal(mu, sd, size=8), 0.05, 0.95)
        (group,) = group_fleet([_engine(rng, f"e{i}", float(a), windows=1, drafts=800) for i, a in enumerate(alphas)])
        lo, hi = group.alpha_ci or (1.0, 0.0)
        assert group.pooled.evidence is not None
        blo, bhi = alpha_interval(group.pooled.evidence)  # every token as an independent trial
        covered += lo <= mu <= hi
        covered_binomial += blo <= mu <= bhi
    assert covered / reps >= 0.85
    assert covered_binomial / reps <= 0.5


def test_one_engine_group_uses_the_dispersion_between_its_windows() -> None:
    rng = np.random.default_rng(4)
    windows = tuple(simulate_counters(rng, a, 4, 500) for a in (0.5, 0.9, 0.5, 0.9))  # a bursty prompt mix
    (group,) = group_fleet([EngineWindows("solo", TARGET, DRAFT, windows)])
    assert group.dispersion.dispersion > 5
    assert "one engine" in group.message
    assert all(c.verdict is OutlierVerdict.NOT_JUDGED for c in group.checks)


def test_a_broken_draft_on_one_engine_is_the_only_outlier() -> None:
    rng = np.random.default_rng(5)
    engines = [_engine(rng, f"ok{i}", 0.7) for i in range(5)] + [_engine(rng, "broken", 0.45)]
    (group,) = group_fleet(engines)
    assert [c.engine for c in group.outliers] == ["broken"]
    bad = group.outliers[0]
    assert bad.alpha is not None and bad.rest_alpha is not None and bad.alpha < bad.rest_alpha
    assert bad.p_value is not None and bad.threshold is not None and bad.p_value < bad.threshold
    assert bad.threshold == pytest.approx(0.01 / 6)
    assert "below" in bad.reason and "broken draft" in bad.reason
    assert "1 outlier(s)" in group.message


def test_no_false_outliers_among_identical_engines() -> None:
    rng = np.random.default_rng(6)
    flagged = 0
    for _ in range(40):
        (group,) = group_fleet([_engine(rng, f"e{i}", 0.7, windows=1) for i in range(6)])
        flagged += len(group.outliers)
        assert all(c.verdict is OutlierVerdict.IN_LINE for c in group.checks)
    assert flagged == 0


def test_a_real_but_small_difference_is_not_an_outlier() -> None:
    rng = np.random.default_rng(7)
    engines = [_engine(rng, f"e{i}", 0.70, drafts=20000) for i in range(4)] + [_engine(rng, "x", 0.67, drafts=20000)]
    (group,) = group_fleet(engines)
    x = next(c for c in group.checks if c.engine == "x")
    assert x.verdict is OutlierVerdict.IN_LINE
    assert x.p_value is not None and x.threshold is not None and x.p_value < x.threshold
    assert "small difference" in x.reason
    loose = group_fleet(engines, FleetSettings(outlier_min_effect=0.01))[0]
    assert [c.engine for c in loose.outliers] == ["x"]


def test_outliers_need_three_engines_and_evidence() -> None:
    rng = np.random.default_rng(8)
    (two,) = group_fleet([_engine(rng, "a", 0.7), _engine(rng, "b", 0.3)])
    assert all(c.verdict is OutlierVerdict.NOT_JUDGED for c in two.checks)
    assert "nobody can tell" in two.checks[0].reason
    tiny = EngineWindows("tiny", TARGET, DRAFT, (simulate_counters(rng, 0.1, 4, 10),))
    (group,) = group_fleet([_engine(rng, f"e{i}", 0.7) for i in range(3)] + [tiny])
    check = next(c for c in group.checks if c.engine == "tiny")
    assert check.verdict is OutlierVerdict.NOT_JUDGED and "fewer than 100" in check.reason


def test_a_group_without_drafts_says_so() -> None:
    (group,) = group_fleet([EngineWindows("idle", TARGET, DRAFT, (SpecCounters(),))])
    assert group.alpha is None and group.alpha_ci is None
    assert "no acceptance evidence" in group.message


@pytest.mark.parametrize(
    "bad",
    [
        {"confidence": 1.0},
        {"outlier_significance": 0.0},
        {"outlier_min_effect": -0.1},
        {"min_engines_for_outliers": 2},
        {"min_engine_trials": float("nan")},
    ],
)
def test_settings_out_of_range_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        FleetSettings(**bad)  # type: ignore[arg-type]


# -- the hierarchical prior ------------------------------------------------------------------------


def test_prior_pools_every_k_of_the_draft_and_estimates_between_engine_spread() -> None:
    rng = np.random.default_rng(9)
    alphas = (0.62, 0.66, 0.70, 0.74, 0.78)
    engines = [
        _engine(rng, f"e{i}", a, DRAFT if i % 2 else DRAFT.with_k(2), drafts=3000) for i, a in enumerate(alphas)
    ] + [_engine(rng, "ngram", 0.2, SpecConfig("ngram", None, 3))]
    prior = fleet_prior(engines, TARGET, DRAFT.draft)
    assert prior.reason is PriorReason.POOLED and prior.engines == 5
    assert prior.mean == pytest.approx(np.mean(alphas), abs=0.02)
    assert prior.between_engine_sd == pytest.approx(np.std(alphas, ddof=1), abs=0.025)
    # a Beta whose spread matches the engines': strength ≈ μ(1−μ)/τ² − 1
    assert prior.strength_trials is not None and 40 < prior.strength_trials < 200
    assert prior.a is not None and prior.b is not None
    assert prior.to_dict()["alpha"] == pytest.approx(prior.mean)


def test_prior_of_alike_engines_is_capped() -> None:
    rng = np.random.default_rng(10)
    engines = [_engine(rng, f"e{i}", 0.7, drafts=5000) for i in range(4)]
    prior = fleet_prior(engines, TARGET, DRAFT.draft, PriorSettings(max_strength_trials=150.0))
    assert prior.strength_trials == pytest.approx(150.0)
    assert "(capped)" in prior.message


def test_prior_is_calibrated_for_a_new_engine() -> None:
    """A new engine's true α falls in the prior's central 90 % about 90 % of the time."""
    from scipy import stats

    rng = np.random.default_rng(11)
    inside, reps = 0, 120
    for _ in range(reps):
        alphas = np.clip(rng.normal(0.65, 0.06, size=7), 0.05, 0.95)
        engines = [_engine(rng, f"e{i}", float(a), windows=1, drafts=1500) for i, a in enumerate(alphas[:6])]
        prior = fleet_prior(engines, TARGET, DRAFT.draft)
        assert prior.a is not None and prior.b is not None
        lo, hi = stats.beta.ppf([0.05, 0.95], prior.a, prior.b)
        inside += lo <= alphas[6] <= hi
    assert 0.78 <= inside / reps <= 0.98


def test_prior_from_one_engine_is_weak_and_from_none_is_absent() -> None:
    rng = np.random.default_rng(12)
    one = fleet_prior([_engine(rng, "only", 0.7)], TARGET, DRAFT.draft)
    assert one.reason is PriorReason.SINGLE_ENGINE
    assert one.strength_trials == pytest.approx(10.0)
    assert one.mean == pytest.approx(0.7, abs=0.03)
    none = fleet_prior([_engine(rng, "only", 0.7)], TARGET, ("eagle", "/models/eagle"))
    assert none.reason is PriorReason.NO_EVIDENCE and none.a is None and none.mean is None
    assert shrink(none, AcceptanceEvidence(10, 5, 5)) is None


def test_prior_excludes_the_asking_engine() -> None:
    rng = np.random.default_rng(13)
    engines = [_engine(rng, "me", 0.2), _engine(rng, "other", 0.8)]
    prior = fleet_prior(engines, TARGET, DRAFT.draft, exclude="me")
    assert prior.reason is PriorReason.SINGLE_ENGINE and prior.engine_names == ("other",)


def test_shrink_moves_little_evidence_toward_the_group_and_lots_barely() -> None:
    rng = np.random.default_rng(14)
    engines = [_engine(rng, f"e{i}", a, drafts=3000) for i, a in enumerate((0.66, 0.7, 0.74))]
    prior = fleet_prior(engines, TARGET, DRAFT.draft)
    assert prior.mean is not None
    little = shrink(prior, AcceptanceEvidence(successes=4, failures=6, drafts=6))
    lots = shrink(prior, AcceptanceEvidence(successes=4000, failures=6000, drafts=6000))
    assert little is not None and lots is not None
    assert abs(little.alpha - prior.mean) < abs(0.4 - prior.mean) / 2  # mostly the fleet's
    assert lots.alpha == pytest.approx(0.4, abs=0.01)  # mostly its own
    assert little.prior_weight > 0.8 > 0.1 > lots.prior_weight
    assert little.alpha_ci[0] < little.alpha < little.alpha_ci[1]
