"""Realized-gain judgement and the K proposal, pure (no store)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from collectors.records import EngineKey
from policies.counters import SpecCounters
from tuner.controller.evidence import Evidence
from tuner.controller.policy import PolicyReason, PolicySettings, propose_k
from tuner.controller.verify import VerifyReason, judge, judge_at_matched_load
from tuner.store import EngineConfigRecord, StoredConfig

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
KEY = EngineKey("http://127.0.0.1:1/metrics", "m")


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


def evidence(spec: SpecCounters, k: int, method: str = "draft_model") -> Evidence:
    cfg = StoredConfig(
        1,
        KEY,
        EngineConfigRecord(
            method=method,
            started_at=NOW,
            num_spec_tokens=k,
            spec_config={"method": method, "model": "/d", "num_speculative_tokens": k},
        ),
    )
    return Evidence(NOW, (KEY,), cfg, spec, 30, 300.0, 30000.0, (100.0,) * 30, 1.0)


def iid(alpha: float, k: int, drafts: int) -> SpecCounters:
    per_pos = tuple(int(drafts * alpha ** (i + 1)) for i in range(k))
    return SpecCounters(drafts, drafts * k, sum(per_pos), per_pos)


def test_propose_k_moves_to_leviathans_best_k() -> None:
    # α = 0.8, c = 0.05 ⇒ K = 8 at batch 1 (DESIGN.md); from K = 2 the gain is well above 1.
    out = propose_k(evidence(iid(0.8, 2, 20000), 2), PolicySettings(k_max=8, cost_ratio=0.05))
    assert out.reason is PolicyReason.CHANGE_K and out.target is not None
    assert out.target["num_speculative_tokens"] == 8 and out.target["model"] == "/d"
    assert out.predicted_gain is not None and out.predicted_gain_ci is not None
    assert 1.0 < out.predicted_gain_ci[0] <= out.predicted_gain <= out.predicted_gain_ci[1]


def test_propose_k_keeps_the_best_and_skips_without_data() -> None:
    keep = propose_k(evidence(iid(0.8, 8, 20000), 8), PolicySettings(k_max=8, cost_ratio=0.05))
    assert keep.reason is PolicyReason.KEEP and keep.target is None
    assert propose_k(evidence(SpecCounters(), 3), PolicySettings()).reason is PolicyReason.NO_DRAFTS
    off = propose_k(evidence(SpecCounters(), 0, method="off"), PolicySettings())
    assert off.reason is PolicyReason.NO_SPECULATION


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


def test_a_draft_swap_is_judged_on_raw_rates() -> None:
    """A swap moves α on purpose: its realized gain is the raw throughput ratio, never corrected. A K
    change under the same draft is corrected by the first position's acceptance."""
    from datetime import timedelta

    from collectors.records import WindowRecord
    from tuner.controller.reconcile import _acceptance_shift

    key = EngineKey("http://127.0.0.1:8000/metrics", "m", "0")
    t0 = datetime(2026, 12, 3, tzinfo=UTC)
    good = {"method": "draft_model", "model": "/drafts/good", "num_speculative_tokens": 2}
    weak = {**good, "model": "/drafts/weak"}
    inputs = {"current_config": weak, "drafts": 6000, "accepted_per_pos": [1800, 540]}
    spec = SpecCounters(300, 600, 270 + 243, (270, 243))  # α = 0.9 at both positions
    after = [WindowRecord(key=key, start=t0, end=t0 + timedelta(seconds=10), spec=spec, generation_tokens=900.0)]
    assert _acceptance_shift(inputs, good, after) == (1.0, "")
    same_draft = {**inputs, "current_config": {**good, "num_speculative_tokens": 4}}
    shift, note = _acceptance_shift(same_draft, good, after)
    assert shift == pytest.approx((1 + 0.9 + 0.81) / (1 + 0.3 + 0.09), rel=0.01) and "0.300 → 0.900" in note
    assert _acceptance_shift({**same_draft, "drafts": 100}, good, after) == (1.0, "")  # too few drafts before
    for bad in (None, [], ["n/a"], "1800"):  # an older or hand-edited audit row: raw rates, no crash
        assert _acceptance_shift({**same_draft, "accepted_per_pos": bad}, good, after) == (1.0, "")
