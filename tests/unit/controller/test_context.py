"""The decision context and the audit's inputs (tuner/controller/context.py), pure: the store-reading
builder is tested on real stores in tests/integration (test_controller, test_alpha_surfaces)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from policies.acceptance import alpha_of_windows
from policies.counters import SpecCounters
from policies.draft_choice import DraftCandidate
from policies.memory import DraftFootprint
from policies.spec_config import SpecConfig
from policies.step_cost import StepCostModel
from tests.fakes import iid_counters, make_context
from tuner.config import MemorySection, PolicySection
from tuner.controller.context import DecisionInputs, kv_capacity
from tuner.controller.settings import PolicySettings

SPEC = {"method": "draft_model", "model": "/drafts/good", "num_speculative_tokens": 4}


def test_inputs_round_trip_through_json() -> None:
    ctx = make_context(SPEC, [iid_counters(0.8, 4, 200) for _ in range(3)], batch=2.0)
    inputs = ctx.to_inputs({"alpha": 0.8, "k_reason": "best"})
    data = inputs.to_json()
    assert data["current_config"] == SPEC and data["drafts"] == 600 and data["windows"] == 3
    assert data["window_rates"] == [100.0] * 3 and data["window_batches"] == [2.0] * 3
    assert data["policy"] == {"alpha": 0.8, "k_reason": "best"} and data["step_cost"] is None
    assert DecisionInputs.from_json(data) == inputs
    with_cost = replace(ctx, step_cost=StepCostModel.from_cost_ratio(0.05))
    step_cost = with_cost.to_inputs().to_json()["step_cost"]
    assert step_cost["source"] == "fitted" and StepCostModel.from_dict(step_cost["model"]).draft_fixed_s == 0.05


def test_inputs_of_an_old_or_hand_edited_row_read_with_the_unusable_fields_empty() -> None:
    read = DecisionInputs.from_json(
        {
            "current_config": {"method": 3},
            "drafts": "many",
            "accepted_per_pos": ["n/a"],
            "window_rates": [1.0, "x"],
            "window_batches": [1, None, "y"],
            "duration_s": True,
            "policy": [],
        }
    )
    assert read.current_config is None and read.drafts is None and read.accepted_per_pos == ()
    assert read.window_rates == () and read.window_batches == (1.0, None, None)
    assert read.duration_s is None and read.policy == {}
    assert DecisionInputs.from_json({}) == DecisionInputs()


def test_the_fake_context_is_built_as_build_context_builds_it() -> None:
    # windows of a table at K_max = 4 drafting 4 and 2: α̂ is alpha_of_windows of the windows, not of the sum
    at4 = SpecCounters(1000, 4000, 800 + 640 + 512 + 410, (800, 640, 512, 410), num_spec_tokens=4)
    at2 = SpecCounters(1000, 2000, 800 + 640, (800, 640, 0, 0), num_spec_tokens=4)
    good = DraftCandidate("good", "draft_model", "/drafts/good")
    other = DraftCandidate("other", "draft_model", "/drafts/other")
    failed = [SpecConfig("draft_model", "/drafts/other", 2)]
    ctx = make_context(SPEC, [at4, at2], candidates=(other,), failed=failed)
    assert ctx.alpha == alpha_of_windows([at4, at2]) and ctx.spec == SpecCounters() + at4 + at2  # as summarize()
    assert ctx.running is not None and ctx.running.name == "current:good"  # not configured: named by its path
    assert [c.name for c in ctx.candidates] == ["other", "current:good"]
    assert ctx.failed_candidates == frozenset({"other"}) and ctx.failed == tuple(failed)
    assert len(ctx.trigger_windows) == 2
    configured = make_context(SPEC, [at4], candidates=(good, other))
    assert configured.running == good and configured.candidates == (good, other)
    assert make_context(SPEC, [at4]).candidates == ()  # no candidates: swapping off, none listed


def test_the_kv_pool_comes_from_cache_config_and_the_context_per_sequence_from_kv_usage() -> None:
    # 8B FP8 draft at K = 3 on a 70B FP8 target: 124 348 tokens of pool (7 771 blocks of 16); 15 sequences
    # of 8 192 tokens + 3 lookahead slots fill 98.9 % of it
    spec = {"method": "draft_model", "model": "/m/8b", "num_speculative_tokens": 3}
    eight_b = DraftCandidate("8b", "draft_model", "/m/8b", params=8_000_000_000, dtype="fp8", kv_bytes_per_token=131072)
    ctx = make_context(spec, [iid_counters(0.75, 3, 200)] * 3, batch=15.0, candidates=(eight_b,))
    tokens = 7771 * 16
    ctx = replace(ctx, kv_usage=15 * (8192 + 3) / tokens, mean_demand=32.0)
    settings = PolicySettings.from_sections(PolicySection(), MemorySection(target_kv_bytes_per_token=327680))
    cache = {"num_gpu_blocks": "7771", "block_size": "16", "cache_dtype": "fp8"}
    kv = kv_capacity(ctx, cache, settings)
    assert kv is not None and kv.tokens == tokens and kv.tokens_per_seq == pytest.approx(8192)
    assert kv.running == DraftFootprint("draft_model", 8_000_000_000, 131072) and kv.running_k == 3
    assert (kv.max_batch(None, 0), kv.max_batch(kv.running, 3)) == (24, 15)
    # anything missing: no capacity (the policy then ranks every config at the batch running now)
    assert kv_capacity(ctx, None, settings) is None
    unsized = make_context(spec, [iid_counters(0.75, 3, 200)] * 3, batch=15.0)  # the 8B not registered
    assert unsized.running is not None and unsized.running.params == 0
    assert kv_capacity(replace(unsized, kv_usage=ctx.kv_usage, mean_demand=32.0), cache, settings) is None
    assert kv_capacity(ctx, {"num_gpu_blocks": "n/a", "block_size": "16"}, settings) is None
    assert kv_capacity(ctx, cache, PolicySettings.from_sections(PolicySection(), MemorySection())) is None
    # no KV usage scraped: [memory] tokens_per_seq stands in
    fallback = PolicySettings.from_sections(
        PolicySection(), MemorySection(target_kv_bytes_per_token=327680, tokens_per_seq=4096)
    )
    unscraped = kv_capacity(replace(ctx, kv_usage=None), cache, fallback)
    assert unscraped is not None and unscraped.tokens_per_seq == 4096

