"""The override check the CLI runs before writing an override and the daemon before applying it."""

from __future__ import annotations

import dataclasses

import pytest

from policies.draft_choice import DraftCandidate
from policies.memory import MemoryBudget
from policies.spec_config import OFF
from tuner.controller.override_check import KNOWN_KEYS, check_override, validate_spec_config

pytestmark = pytest.mark.unit

DRAFT = DraftCandidate(
    "small", "draft_model", "/models/small", params=100_000_000, kv_bytes_per_token=4096, dtype="bfloat16"
)


def test_known_keys_are_vllms_own() -> None:
    from vllm.config import SpeculativeConfig

    fields = {f.name for f in dataclasses.fields(SpeculativeConfig) if f.init}
    assert fields >= KNOWN_KEYS, sorted(KNOWN_KEYS - fields)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"method": "ngram", "num_speculative_tokens": 1000}, "above 64"),
        ({"method": "off", "num_speculative_tokens": 3}, 'method "off" takes no other keys'),
        ({"method": "off", "num_speculative_tokens": False}, "drop num_speculative_tokens"),
        ({"method": "off", "model": "/models/small"}, "drop model"),
        ({"method": "ngram", "num_speculative_tokens": 9}, "K_max 8"),
        ({"method": "ngram", "num_speculative_tokens": 2, "evil": 1}, "'evil'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_model_config": {}}, "draft_model_config"),
        ({"method": "rm -rf", "num_speculative_tokens": 2}, "not a vLLM speculative method"),
        ({"method": "ngram", "num_speculative_tokens": -1}, "integer ≥ 0"),
        ({"method": "ngram", "num_speculative_tokens": True}, "integer ≥ 0"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, 'needs "model"'),
        ({"method": "draft_model", "model": "/elsewhere", "num_speculative_tokens": 2}, "not a candidate"),
        ({"method": "eagle", "model": "/models/small", "num_speculative_tokens": 2}, "not a candidate"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 8, 99]]},
            "above num_speculative_tokens",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": float("nan")}, "finite"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 10**8, 2]]},
            "stops at 4096",
        ),
    ],
)
def test_bad_overrides_are_refused_with_a_reason(spec: dict[str, object], needle: str) -> None:
    reason = check_override(spec, k_max=8, drafts=[DRAFT])
    assert reason is not None and reason.startswith("override refused: ")
    assert needle in reason


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "off"},
        OFF.to_vllm(),  # how spectuner writes "off" (a canary's promotion order to the untouched replicas)
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
        {"method": "suffix", "num_speculative_tokens": 8},
        {"method": "draft_model", "model": "/models/small", "num_speculative_tokens": 4},
        {
            "method": "draft_model",
            "model": "/models/small",
            "num_speculative_tokens": 4,
            "num_speculative_tokens_per_batch_size": [[1, 4, 4], [5, 16, 1]],
        },
    ],
)
def test_good_overrides_pass(spec: dict[str, object]) -> None:
    assert check_override(spec, k_max=8, drafts=[DRAFT]) is None


def test_memory_budget_is_checked_at_the_largest_k_and_batch() -> None:
    spec = {"method": "draft_model", "model": "/models/small", "num_speculative_tokens": 4}
    weights = 200_000_000  # 100 M bf16 parameters
    roomy = MemoryBudget(budget_bytes=weights + 64 * 4096 * (2048 + 4), tokens_per_seq=2048)
    assert check_override(spec, k_max=8, drafts=[DRAFT], memory=roomy, running_seqs=64) is None
    reason = check_override(spec, k_max=8, drafts=[DRAFT], memory=roomy, running_seqs=65)
    assert reason is not None and "budget" in reason
    # ngram loads nothing: no budget can refuse it
    tight = MemoryBudget(budget_bytes=0, tokens_per_seq=2048)
    assert check_override({"method": "ngram", "num_speculative_tokens": 4}, k_max=8, drafts=[], memory=tight) is None


def test_validate_returns_a_copy() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    out = validate_spec_config(spec, None)
    assert out == spec and out is not spec
