"""Fleet mode: the replicas run the scenario's engine physics, changes have their true effect, and on seeded
trials the canary makes fewer wrong verdicts than before/after under strong drift while both are right
without drift."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from policies.canary import CanaryDecision
from tuner.sim.engine import SimEngine
from tuner.sim.fleet import DRIFTS, ChangeOutcome, FleetSettings, FleetWorld, Truth, run_fleet, summarize
from tuner.sim.scenario import LoadSection, Scenario, load_scenario

REPO = Path(__file__).resolve().parents[4]
SEEDS = (1, 2, 3, 4)
CHANGES = 45
QUIET = FleetSettings(replica_noise_sd=0.0, replica_alpha_sd=0.0, router_imbalance_sd=0.0, replica_bias_sd=0.0)


@pytest.fixture(scope="module")
def scenario() -> Scenario:
    return load_scenario(REPO / "bench" / "scenarios" / "gpu_diurnal.toml")


@pytest.fixture(scope="module")
def trials(scenario: Scenario) -> dict[tuple[str, int], list[ChangeOutcome]]:
    settings = FleetSettings(changes=CHANGES)
    return {(level, seed): run_fleet(scenario, DRIFTS[level], seed, settings) for level in ("none", "strong")
            for seed in SEEDS}  # fmt: skip


def _wrong(outcomes: list[ChangeOutcome], judge: str) -> tuple[int, int]:
    s = summarize(outcomes, 300.0)[judge]
    return s["wrong_promotions"], s["wrong_rollbacks"]


def test_replicas_follow_the_engine_physics_and_the_change_its_true_effect(scenario: Scenario) -> None:
    """Without noise or drift a replica's goodput is SimEngine's expected goodput at the replica's load; the
    changed replica's is (1 + effect) times that from the change on, the untouched replicas' is not."""
    constant = scenario.model_copy(update={"load": LoadSection(kind="constant", concurrency=48.0)})
    world = FleetWorld(scenario, QUIET, DRIFTS["none"], seed=5)
    rng = np.random.default_rng(0)
    changed = world.windows(0, 0.0, 600.0, 300.0, -0.15, rng)
    untouched = world.windows(1, 0.0, 600.0, 300.0, 0.0, rng)
    expected = float(SimEngine(constant).expected_goodput(world.config, np.array([150.0]))[0])
    rate = changed.tokens / world.interval_s
    before, after = changed.start_s < 300.0, changed.start_s >= 300.0
    assert rate[before] == pytest.approx(expected, rel=1e-9)
    assert rate[after] == pytest.approx(0.85 * expected, rel=1e-9)
    assert untouched.tokens / world.interval_s == pytest.approx(expected, rel=1e-9)
    assert changed.tpot_s[after] == pytest.approx(changed.tpot_s[before][0] / 0.85, rel=1e-9)
    # the counters are the engine's: tokens per draft = E, the first position's acceptance = α
    spec = changed.spec[0]
    assert spec.generated_tokens / spec.drafts == pytest.approx(float(world.engine.expected_tokens(world.config,
                                                                np.array([0.0]))[0]), rel=1e-3)  # fmt: skip
    assert spec.accepted_per_pos[0] / spec.drafts == pytest.approx(scenario.draft("llama-8b").alpha, rel=1e-3)


def test_drift_moves_every_replica_alike(scenario: Scenario) -> None:
    world = FleetWorld(scenario, QUIET, DRIFTS["strong"], seed=5)
    rng = np.random.default_rng(0)
    a = world.windows(0, 0.0, 3600.0, 1e9, 0.0, rng)
    b = world.windows(2, 0.0, 3600.0, 1e9, 0.0, rng)
    assert a.tokens == pytest.approx(b.tokens, rel=1e-9)  # same minutes, same load, same prompts
    assert a.tokens.max() / a.tokens.min() > 1.3  # and the load and prompts did move over the hour


def test_same_seed_same_trial_and_seeds_differ(scenario: Scenario) -> None:
    settings = FleetSettings(changes=6)
    first = run_fleet(scenario, DRIFTS["moderate"], 7, settings)
    assert first == run_fleet(scenario, DRIFTS["moderate"], 7, settings)
    assert first != run_fleet(scenario, DRIFTS["moderate"], 8, settings)
    assert sorted(o.truth for o in first) == sorted([Truth.BETTER] * 2 + [Truth.WORSE] * 2 + [Truth.NEUTRAL] * 2)


@pytest.mark.parametrize("seed", SEEDS)
def test_without_drift_both_judgements_are_right(trials: dict[tuple[str, int], list[ChangeOutcome]], seed: int) -> None:
    outcomes = trials[("none", seed)]
    assert _wrong(outcomes, "before_after") == (0, 0)
    assert _wrong(outcomes, "controller") == (0, 0)
    # The canary never promotes a worse change; it may roll back a few neutral ones it could not show to be
    # within its 2 % tolerance (by 30 minutes, or on one unlucky minute): a cautious error, and rare.
    promoted, rolled_back = _wrong(outcomes, "canary")
    assert promoted == 0
    assert rolled_back <= 3
    assert all(o.truth is Truth.NEUTRAL for o in outcomes if o.wrong(o.canary))


@pytest.mark.parametrize("seed", SEEDS)
def test_under_strong_drift_the_canary_is_wrong_less_often(
    trials: dict[tuple[str, int], list[ChangeOutcome]], seed: int
) -> None:
    outcomes = trials[("strong", seed)]
    canary = sum(_wrong(outcomes, "canary"))
    before_after = sum(_wrong(outcomes, "before_after"))
    assert _wrong(outcomes, "canary")[0] == 0
    assert before_after >= canary + 3, (canary, before_after)


def test_pooled_strong_drift_before_after_errs_on_both_sides(
    trials: dict[tuple[str, int], list[ChangeOutcome]],
) -> None:
    """Drift fools before/after both ways: worse changes kept under rising load, good ones rolled back."""
    pooled = [o for seed in SEEDS for o in trials[("strong", seed)]]
    promoted, rolled_back = _wrong(pooled, "before_after")
    assert promoted >= 3 and rolled_back >= 10
    assert sum(_wrong(pooled, "canary")) * 3 <= promoted + rolled_back


def test_a_clear_change_is_decided_at_the_first_look(trials: dict[tuple[str, int], list[ChangeOutcome]]) -> None:
    """Better and worse changes are decided with the minimum samples (5 minutes = the verify window here);
    neutral ones take longer to be shown within tolerance."""
    pooled = [o for seed in SEEDS for o in trials[("strong", seed)]]
    first_look = 5 * 60.0
    clear = [o.canary_s for o in pooled if o.truth is not Truth.NEUTRAL]
    assert max(clear) == first_look
    neutral = [o.canary_s for o in pooled if o.truth is Truth.NEUTRAL]
    assert np.median(neutral) > first_look
    assert all(o.canary in (CanaryDecision.PROMOTE, CanaryDecision.ROLLBACK) for o in pooled)


@pytest.mark.parametrize(
    "change", [{"replicas": 2}, {"changes": 2}, {"replica_noise_sd": 0.6}, {"worse_effects": (0.1,)}]
)
def test_settings_out_of_range_are_refused(change: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="fleet setting"):
        replace(FleetSettings(), **change)  # type: ignore[arg-type]
