"""The GPU step-cost benchmark's arithmetic, and its whole path on the CPU with tiny shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.bench_gpu_step_cost import LLAMA_8B, crossover_batch, main, speculation_gain, tokens_per_step


def test_tokens_per_step_is_the_geometric_sum() -> None:
    assert tokens_per_step(0.5, 0) == 1.0
    assert tokens_per_step(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert tokens_per_step(1.0, 3) == 4.0


def test_gain_weighs_verification_and_drafting_against_a_plain_step() -> None:
    # verification as cheap as a decode step, a free draft: the gain is the tokens per step
    target = {(1, 1): 10.0, (1, 4): 10.0}
    assert speculation_gain(target, {1: 0.0}, 1, 3, 0.5) == pytest.approx(1.875)
    # verification 2x a decode step, drafts at c = 0.25: 1.875 x 10 / (20 + 3 x 2.5)
    target = {(1, 1): 10.0, (1, 4): 20.0}
    assert speculation_gain(target, {1: 2.5}, 1, 3, 0.5) == pytest.approx(18.75 / 27.5)


def test_crossover_is_the_first_batch_that_loses() -> None:
    assert crossover_batch([(64, 0.9), (1, 2.0), (16, 1.1)]) == 64
    assert crossover_batch([(1, 2.0), (64, 1.01)]) is None


def test_published_shapes_have_their_published_sizes() -> None:
    assert 7.9e9 < LLAMA_8B.params < 8.1e9  # Llama 3.1 8B: 8.03 B parameters


def test_the_benchmark_runs_end_to_end_on_cpu_smoke_shapes(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert main(["--device", "cpu", "--smoke", "--replays", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (pair,) = result["pairs"]
    assert [r["batch"] for r in pair["rows"]] == [1, 4]
    for r in pair["rows"]:
        assert r["target_ms"]["1"] > 0 and r["draft_ms"] > 0
        assert set(r["gain"]) == {"a0.75_k1", "a0.75_k3"}
