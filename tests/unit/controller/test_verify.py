"""Realized-gain judgement and the prompt-shift correction (tuner/controller/verify.py), pure (no store)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from collectors.records import EngineKey, WindowRecord
from policies.counters import SpecCounters
from policies.spec_config import SpecConfig
from tuner.controller.context import DecisionInputs
from tuner.controller.verify import SHIFT_MIN_DRAFTS, VerifyReason, judge, judge_at_matched_load, prompt_shift


def test_regression_beyond_noise_rolls_back() -> None:
    verdict = judge([100, 102, 98, 101, 99], [80, 82, 79, 81, 80], tolerance=0.05)
    assert verdict.reason is VerifyReason.REGRESSED and verdict.rollback
    assert verdict.realized_gain == pytest.approx(80.4 / 100)


def test_a_burst_ending_is_not_a_regression() -> None:
    # Decided during a burst (160 running, 5000 tok/s) and judged after it (8 running, 700 tok/s): the raw
    # comparison reads a 7× loss; at matched load the change is no worse.
    before_r = [700, 710, 690, 5000, 5050, 4950, 5020]
    before_b = [8, 8, 8, 160, 160, 158, 161]
    after_r = [705, 698, 712, 701]
    after_b = [8, 8, 8, 8]
    assert judge(before_r, after_r).rollback
    verdict = judge_at_matched_load(before_r, before_b, after_r, after_b)
    assert verdict.reason is VerifyReason.NO_WORSE and not verdict.rollback
    assert verdict.realized_gain == pytest.approx(704 / 700, rel=1e-3) and "matched load" in verdict.message


def test_a_real_regression_at_matched_load_rolls_back() -> None:
    before_r = [700, 710, 690, 5000, 5050, 4950]
    before_b = [8, 8, 8, 160, 160, 158]
    after_r = [4000, 4050, 560, 570, 555]  # 20% slower in both bands
    after_b = [160, 159, 8, 8, 8]
    verdict = judge_at_matched_load(before_r, before_b, after_r, after_b)
    assert verdict.reason is VerifyReason.REGRESSED and verdict.rollback
    assert verdict.realized_gain == pytest.approx(0.8, abs=0.01)


def test_no_common_load_keeps_the_change_and_says_why() -> None:
    verdict = judge_at_matched_load([5000, 5050, 4950], [160, 160, 160], [700, 710, 690], [8, 8, 8])
    assert verdict.reason is VerifyReason.NO_DATA and not verdict.rollback
    assert "load changed (160–160 requests running before, 8–8 after)" in verdict.message


def test_without_batch_sizes_it_is_the_plain_comparison() -> None:
    verdict = judge_at_matched_load([100, 102, 98], [], [80, 82, 79], [])
    assert verdict == judge([100, 102, 98], [80, 82, 79])
    # one load on both sides: the plain comparison and its tokens/s message
    same = judge_at_matched_load([100, 102, 98], [1, 0, 1], [80, 82, 79], [1, 1, 1])
    assert same == judge([100, 102, 98], [80, 82, 79]) and "tokens/s" in same.message


def test_a_loss_within_noise_is_kept() -> None:
    verdict = judge([100, 150, 50, 120, 80], [90, 140, 40, 110, 70], tolerance=0.05)  # 10% lower, noisy
    assert verdict.reason is VerifyReason.NO_WORSE and not verdict.rollback


def test_a_loss_within_tolerance_is_kept_even_if_significant() -> None:
    verdict = judge([100.0] * 4 + [100.1], [97.0] * 4 + [97.1], tolerance=0.05)
    assert not verdict.rollback


def test_improvement_and_no_data() -> None:
    assert judge([100, 101, 99], [130, 131, 129]).reason is VerifyReason.IMPROVED
    no_data = judge([100, 101], [50, 50, 50])
    assert no_data.reason is VerifyReason.NO_DATA and not no_data.rollback and no_data.realized_gain is None


def test_acceptance_shift_is_the_ratio_of_tokens_per_step() -> None:
    from tuner.controller.verify import acceptance_shift

    assert acceptance_shift(0.8, 0.8, 3) == 1.0
    assert acceptance_shift(0.8, 0.6, 2) == pytest.approx((1 + 0.6 + 0.36) / (1 + 0.8 + 0.64))
    assert acceptance_shift(1.0, 0.5, 1) == pytest.approx(1.5 / 2.0)
    assert acceptance_shift(0.5, 0.9, 0) == 1.0  # nothing drafted: acceptance cannot matter
    assert acceptance_shift(0.8, 0.6, 1.5) == pytest.approx((1 - 0.6**2.5) / 0.4 / ((1 - 0.8**2.5) / 0.2))
    with pytest.raises(ValueError, match="alpha_after must be in"):
        acceptance_shift(0.8, 1.2, 2)
    with pytest.raises(ValueError, match="k_after must be"):
        acceptance_shift(0.8, 0.6, -1)


def shift_of(inputs: dict[str, object], proposed: dict[str, object], after: list[WindowRecord]) -> tuple[float, str]:
    """prompt_shift as the controller's verification calls it: on the audit row's stored inputs."""
    read = DecisionInputs.from_json(inputs)
    return prompt_shift(
        read.current_config,
        read.drafts,
        float(read.accepted_per_pos[0]) if read.accepted_per_pos else None,
        SpecConfig.from_vllm(proposed),
        [w.spec for w in after if w.spec is not None],
    )


def test_a_draft_swap_is_judged_on_raw_rates() -> None:
    """A swap moves α on purpose: its realized gain is the raw throughput ratio, never corrected. A K
    change under the same draft is corrected by the first position's acceptance."""
    key = EngineKey("http://127.0.0.1:8000/metrics", "m", "0")
    t0 = datetime(2026, 12, 3, tzinfo=UTC)
    good = {"method": "draft_model", "model": "/drafts/good", "num_speculative_tokens": 2}
    weak = {**good, "model": "/drafts/weak"}
    inputs = {"current_config": weak, "drafts": 6000, "accepted_per_pos": [1800, 540]}
    spec = SpecCounters(300, 600, 270 + 243, (270, 243))  # α = 0.9 at both positions
    after = [WindowRecord(key=key, start=t0, end=t0 + timedelta(seconds=10), spec=spec, generation_tokens=900.0)]
    assert shift_of(inputs, good, after) == (1.0, "")
    same_draft = {**inputs, "current_config": {**good, "num_speculative_tokens": 4}}
    shift, note = shift_of(same_draft, good, after)
    assert shift == pytest.approx((1 + 0.9 + 0.81) / (1 + 0.3 + 0.09), rel=0.01) and "0.300 → 0.900" in note
    assert shift_of({**same_draft, "drafts": 100}, good, after) == (1.0, "")  # too few drafts before
    for bad in (None, [], ["n/a"], "1800"):  # an older or hand-edited audit row: raw rates, no crash
        assert shift_of({**same_draft, "accepted_per_pos": bad}, good, after) == (1.0, "")


def test_prompt_shift_needs_enough_drafts_after_and_a_known_config() -> None:
    before = SpecConfig("draft_model", "/drafts/good", 4)
    after_config = before.with_k(2)
    few = [SpecCounters(SHIFT_MIN_DRAFTS - 1, 2 * (SHIFT_MIN_DRAFTS - 1), 0, (0, 0))]
    assert prompt_shift(before, 6000, 1800.0, after_config, few) == (1.0, "")
    many = [SpecCounters(300, 600, 270 + 243, (270, 243))]
    assert prompt_shift(None, 6000, 1800.0, after_config, many) == (1.0, "")
    assert prompt_shift(before, 6000, 1800.0, None, many) == (1.0, "")
    assert prompt_shift(before, 6000, None, after_config, many) == (1.0, "")
    assert prompt_shift(before, 6000, 1800.0, after_config, many)[0] > 1.0
