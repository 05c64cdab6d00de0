"""The live benchmark's ratios and intervals (bench/live_stats.py)."""

from __future__ import annotations

import math

import pytest

from bench.live_stats import fixed_means, pooled_log_sd, summarize_live

PHASES = {"p1": 180.0, "p2": 180.0}


def test_pooled_spread_is_the_log_residual_sd_over_repeated_configs() -> None:
    sd = pooled_log_sd({"a": [1.0, math.exp(0.2)], "b": [5.0, 5.0 * math.exp(-0.2)], "c": [3.0]})
    # residuals ±0.1 in both repeated configs: ss = 0.04 over 2 degrees of freedom
    assert sd == pytest.approx(math.sqrt(0.04 / 2))
    assert pooled_log_sd({"a": [1.0], "b": [2.0]}) is None


def test_oracle_switches_per_phase_and_a_perfect_follower_matches_it() -> None:
    cells = {
        "p1": {"off": [10.0, 10.4], "a": [20.0, 19.6], "b": [12.0, 12.2]},
        "p2": {"off": [30.0, 29.0], "a": [18.0, 18.5], "b": [40.0, 41.0]},
    }
    means = fixed_means(cells)
    s = summarize_live(cells, {"p1": means["p1"]["a"], "p2": means["p2"]["b"]}, PHASES, 6.0, reference="a")
    assert s.oracle_per_phase == {"p1": "a", "p2": "b"}
    assert s.vs_oracle.value == pytest.approx(1.0)
    assert s.vs_oracle.lo < 1.0 < s.vs_oracle.hi
    # the best single config (b: 26.1 on average) loses phase 1; following the oracle beats it
    assert s.best_fixed == "b"
    followed = means["p1"]["a"] + means["p2"]["b"]
    assert s.vs_best_fixed.value == pytest.approx(followed / (means["p1"]["b"] + means["p2"]["b"]))
    assert s.vs_best_fixed.lo > 1.0
    assert s.worst_phase_vs_off is not None and s.worst_phase == "p2"
    assert s.worst_phase_vs_off.value == pytest.approx(means["p2"]["b"] / means["p2"]["off"])


def test_intervals_widen_with_the_cells_scatter_and_narrow_with_repeats() -> None:
    def width(rates_a: list[float], rates_b: list[float]) -> float:
        cells = {"p1": {"a": rates_a, "b": rates_b}, "p2": {"a": rates_a, "b": rates_b}}
        s = summarize_live(cells, {"p1": 20.0, "p2": 20.0}, PHASES, 6.0, off=None)
        return s.vs_oracle.hi - s.vs_oracle.lo

    quiet = width([20.0, 20.2], [10.0, 10.1])
    noisy = width([20.0, 24.0], [10.0, 12.0])
    more = width([20.0, 24.0] * 4, [10.0, 12.0] * 4)
    assert noisy > 3 * quiet
    assert more < noisy


def test_identical_repeats_give_zero_spread_not_the_default() -> None:
    cells = {"p1": {"a": [20.0, 20.0]}, "p2": {"a": [20.0, 20.0]}}
    s = summarize_live(cells, {"p1": 20.0, "p2": 20.0}, PHASES, 6.0, off=None)
    assert s.cell_log_sd == {"p1": 0.0, "p2": 0.0}
    assert s.vs_oracle.lo == pytest.approx(1.0) and s.vs_oracle.hi == pytest.approx(1.0)


def test_unrepeated_phase_gets_a_wide_default_spread() -> None:
    cells = {"p1": {"a": [20.0]}, "p2": {"a": [20.0]}}
    s = summarize_live(cells, {"p1": 20.0, "p2": 20.0}, PHASES, 6.0, off=None)
    assert s.cell_log_sd == {"p1": 0.1, "p2": 0.1}
    assert s.vs_oracle.hi - s.vs_oracle.lo > 0.05


@pytest.mark.parametrize(
    ("cells", "spectuner", "phase_s", "message"),
    [
        ({"p1": {"a": [1.0]}}, {}, PHASES, "no phases"),
        ({"p1": {"a": [1.0]}}, {"p1": 1.0, "p2": 1.0}, PHASES, "'p2' has no fixed-config cells"),
        ({"p1": {"a": [1.0]}}, {"p1": 1.0}, {"p1": 0.0}, "no positive length"),
        ({"p1": {"a": [1.0]}, "p2": {"b": [1.0]}}, {"p1": 1.0, "p2": 1.0}, PHASES, "measured in every phase"),
    ],
)
def test_unusable_input_is_refused_with_the_reason(
    cells: dict[str, dict[str, list[float]]], spectuner: dict[str, float], phase_s: dict[str, float], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        summarize_live(cells, spectuner, phase_s, 6.0)
