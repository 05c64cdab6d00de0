"""The step-cost fit T(B, K) and the memory model (config.json → KV bytes, budgets)."""

from __future__ import annotations

import numpy as np
import pytest

from policies.memory import (
    DraftFootprint,
    MemoryBudget,
    MemoryReason,
    check_memory,
    dtype_bytes,
    kv_bytes_per_token,
    speculation_bytes,
    weight_bytes,
)
from policies.step_cost import StepCostModel, StepCostReason, fit_step_cost, step_times_table

MiB = 2**20

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
}


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
    with pytest.raises(ValueError, match="missing 'per_token_s'"):
        StepCostModel.from_dict({"fixed_s": 1.0})
    with pytest.raises(ValueError, match="finite number ≥ 0"):
        StepCostModel(-1.0, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match=r"cost ratio c .* must be a finite number ≥ 0"):
        StepCostModel.from_cost_ratio(-0.1)
    table = step_times_table(model, [1, 8], 3)
    assert table.shape == (2, 4) and table[1, 3] == pytest.approx(model.step_time_s(8, 3))


def test_kv_bytes_of_known_models() -> None:
    # Llama-3-8B: 32 layers × 2 × 8 KV heads × 128 head dim × 2 bytes = 128 KiB per token.
    assert kv_bytes_per_token(LLAMA3_8B) == 131072
    assert kv_bytes_per_token(LLAMA3_8B, kv_cache_dtype="fp8") == 65536
    mha = {"num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 256, "torch_dtype": "float32"}
    assert kv_bytes_per_token(mha) == 4 * 2 * 4 * 64 * 4
    explicit = {**mha, "head_dim": 128, "num_key_value_heads": 2}
    assert kv_bytes_per_token(explicit) == 4 * 2 * 2 * 128 * 4
    nested = {"torch_dtype": "float16", "text_config": {k: v for k, v in mha.items() if k != "torch_dtype"}}
    assert kv_bytes_per_token(nested) == 4 * 2 * 4 * 64 * 2


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ({"num_attention_heads": 4, "hidden_size": 256, "torch_dtype": "float32"}, "number of layers"),
        (
            {"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 256, "torch_dtype": "float32"},
            "not a multiple",
        ),
        ({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256}, "no dtype"),
        (
            {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256, "torch_dtype": "float7"},
            "unknown dtype",
        ),
        (
            {
                "num_hidden_layers": "2",
                "num_attention_heads": 4,
                "hidden_size": 256,
                "torch_dtype": "float32",
            },
            "positive integer",
        ),
    ],
)
def test_bad_config_is_a_clear_error(config: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        kv_bytes_per_token(config)


def test_weights_and_dtypes() -> None:
    assert weight_bytes(1_000_000_000, "bfloat16") == 2_000_000_000
    assert weight_bytes(3, "int4") == 2
    assert dtype_bytes("torch.float32") == 4
    with pytest.raises(ValueError, match="integer ≥ 0"):
        weight_bytes(-5, "float16")


def test_footprint_from_config_and_ngram_is_free() -> None:
    fp = DraftFootprint.from_config("draft_model", LLAMA3_8B, 1_000_000)
    assert fp.weights_bytes == 2_000_000 and fp.kv_bytes_per_token == 131072
    ngram = DraftFootprint("ngram")
    assert speculation_bytes(ngram, 8, 256, 4096, 131072) == 0
    with pytest.raises(ValueError, match="loads no model"):
        DraftFootprint("suffix", weights_bytes=1)


def test_speculation_bytes_formula() -> None:
    fp = DraftFootprint("draft_model", weights_bytes=1000, kv_bytes_per_token=10)
    # weights + B × (draft KV × (context + K) + target KV × K)
    assert speculation_bytes(fp, 3, 4, 100, 50) == 1000 + 4 * (10 * 103 + 50 * 3)
    assert speculation_bytes(fp, 0, 4, 100, 50) == 0


def test_budget_bytes_and_min_concurrency() -> None:
    fp = DraftFootprint("draft_model", weights_bytes=200 * MiB, kv_bytes_per_token=16384)
    pool = 4 * 2**30
    budget = MemoryBudget(
        min_kv_concurrency=30, kv_pool_bytes=pool, target_kv_bytes_per_token=131072, tokens_per_seq=1024
    )
    ok = check_memory(DraftFootprint("ngram"), 8, 16, budget)
    assert ok.fits and ok.kv_concurrency == pytest.approx(pool / (131072 * 1024))
    bad = check_memory(fp, 4, 16, budget)
    assert not bad.fits and bad.reason is MemoryReason.BELOW_MIN_CONCURRENCY
    assert bad.kv_concurrency == pytest.approx((pool - 200 * MiB) / ((131072 + 16384) * 1028))
    assert "below the required 30" in bad.message
    tight = check_memory(fp, 4, 16, MemoryBudget(budget_bytes=100 * MiB))
    assert not tight.fits and tight.reason is MemoryReason.OVER_BUDGET_BYTES and "MiB budget" in tight.message
    with pytest.raises(ValueError, match="needs kv_pool_bytes"):
        MemoryBudget(min_kv_concurrency=2)
    with pytest.raises(ValueError, match="cannot be negative"):
        MemoryBudget(budget_bytes=-1)
