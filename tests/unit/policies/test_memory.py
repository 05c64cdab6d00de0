"""The memory model (policies/memory.py): config.json → KV bytes, weights, budgets."""

from __future__ import annotations

import pytest

from policies.memory import (
    DraftFootprint,
    KvCapacity,
    MemoryBudget,
    MemoryReason,
    check_memory,
    dtype_bytes,
    kv_bytes_per_token,
    speculation_bytes,
    weight_bytes,
)

MiB = 2**20

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
}


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


# gpu_memory_bound's calibration: 70B FP8 (327 680 KV bytes per token), 65 GB of KV pool with no draft,
# 8 192-token contexts; an 8B FP8 draft (8 GB, 131 072 B/token) and a 1B (2.5 GB, 32 768 B/token)
DRAFT_8B = DraftFootprint("draft_model", 8_000_000_000, 131072)
DRAFT_1B = DraftFootprint("draft_model", 2_500_000_000, 32768)


def test_kv_capacity_caps_each_config_from_the_pool_the_engine_reports() -> None:
    # the engine runs the 8B at K = 3: vLLM sized its pool after loading it
    tokens = (65e9 - 8e9) / (327680 + 131072)
    kv = KvCapacity(tokens, 327680, 8192, DRAFT_8B, 3)
    assert kv.bytes == pytest.approx(65e9)
    assert (kv.max_batch(None, 0), kv.max_batch(DRAFT_1B, 3), kv.max_batch(DRAFT_8B, 3)) == (24, 21, 15)
    assert kv.max_batch(DraftFootprint("ngram"), 3) == 24  # no weights, no KV; its 3 lookahead slots fit
    assert kv.max_batch(DraftFootprint("draft_model", 70_000_000_000, 0), 1) == 0  # weights alone overflow
    # measured under the 1B instead: the same pool, so the same caps
    under_1b = KvCapacity((65e9 - 2.5e9) / (327680 + 32768), 327680, 8192, DRAFT_1B, 3)
    assert (under_1b.max_batch(None, 0), under_1b.max_batch(DRAFT_8B, 3)) == (24, 15)
    with pytest.raises(ValueError, match="> 0"):
        KvCapacity(0.0, 327680, 8192)
