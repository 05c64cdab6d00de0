"""Draft choice: the "stays below 0.4" trigger, candidate ranking, memory fit, fallbacks."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from bench.research.simulate import simulate_counters
from policies.acceptance import AcceptanceEvidence
from policies.counters import SpecCounters
from policies.draft_choice import (
    DraftCandidate,
    DraftChoiceSnapshot,
    DraftDecision,
    DraftReason,
    DraftTriggerConfig,
    SpecWindow,
    TriggerReason,
    TriggerStatistic,
    capped_batch,
    check_trigger,
    choose_draft,
    choose_enable,
)
from policies.memory import KvCapacity, MemoryBudget
from policies.step_cost import StepCostModel

NOW = datetime(2026, 1, 1, 12, tzinfo=UTC)
CONFIG = DraftTriggerConfig(threshold=0.4, duration_s=600, min_drafts=2000, segments=3)

SMALL = DraftCandidate("small", "draft_model", "/models/small", params=50_000_000, kv_bytes_per_token=4096,
                       prior_alpha=0.7, cost_ratio=0.05)  # fmt: skip
TINY = DraftCandidate("tiny", "draft_model", "/models/tiny", params=10_000_000, kv_bytes_per_token=1024,
                      prior_alpha=0.5, cost_ratio=0.02)  # fmt: skip
BIG = DraftCandidate("big", "draft_model", "/models/big", params=3_000_000_000, kv_bytes_per_token=65536,
                     prior_alpha=0.9, cost_ratio=0.08)  # fmt: skip
NGRAM = DraftCandidate("ngram", "ngram", prior_alpha=0.45, speculative_config={"prompt_lookup_max": 5})
CURRENT = DraftCandidate("current", "draft_model", "/models/current", params=50_000_000,
                         kv_bytes_per_token=4096, prior_alpha=0.6, cost_ratio=0.05)  # fmt: skip


def windows(alphas: list[float], k: int = 3, drafts: int = 400, step_s: int = 60, seed: int = 0) -> list[SpecWindow]:
    """One 60 s window per α, the last ending at NOW."""
    rng = np.random.default_rng(seed)
    n = len(alphas)
    return [
        SpecWindow(
            NOW - timedelta(seconds=step_s * (n - i)),
            NOW - timedelta(seconds=step_s * (n - i - 1)),
            simulate_counters(rng, a, k, drafts),
        )
        for i, a in enumerate(alphas)
    ]


def snapshot(ws: list[SpecWindow], **kw: object) -> DraftChoiceSnapshot:
    base = DraftChoiceSnapshot(
        now=NOW, current="current", current_k=3, windows=ws, candidates=(CURRENT, SMALL, TINY, BIG, NGRAM),
        history={}, batch_size=1, k_max=8, step_cost=StepCostModel.from_cost_ratio(0.05, 0.02), config=CONFIG,
    )  # fmt: skip
    return replace(base, **kw)  # type: ignore[arg-type]


def test_trigger_needs_low_acceptance_that_stays() -> None:
    check = check_trigger(windows([0.25] * 10), NOW, CONFIG)
    assert check.triggered and check.reason is TriggerReason.TRIGGERED
    assert check.upper is not None and check.upper < 0.4 and check.drafts >= 2000
    assert "stayed below 0.4" in check.message


def test_one_bad_window_does_not_trigger() -> None:
    check = check_trigger(windows([0.7] * 9 + [0.0]), NOW, CONFIG)
    assert not check.triggered and check.reason is TriggerReason.ABOVE_THRESHOLD


def test_recovery_inside_the_duration_cancels() -> None:
    # pooled over ten minutes it is low, but the last slice recovered
    check = check_trigger(windows([0.1] * 6 + [0.45] * 4), NOW, CONFIG)
    assert not check.triggered and check.reason is TriggerReason.RECOVERED
    assert "slice 3 of 3" in check.message
    # a recovery far beyond sampling noise: the windows' spread already leaves the pooled α not clearly low
    jump = check_trigger(windows([0.1] * 7 + [0.6] * 3), NOW, CONFIG)
    assert not jump.triggered and jump.reason is TriggerReason.ABOVE_THRESHOLD
    assert jump.value is not None and jump.value < 0.4 and jump.upper is not None and jump.upper > 0.4


def test_upper_end_not_point_estimate_decides() -> None:
    # α ≈ 0.38: the point is below 0.4 but the interval is not, with few drafts
    few = DraftTriggerConfig(threshold=0.4, duration_s=600, min_drafts=100, segments=1)
    check = check_trigger(windows([0.38] * 10, drafts=15), NOW, few)
    assert not check.triggered and check.reason is TriggerReason.ABOVE_THRESHOLD
    assert check.value is not None and check.value < 0.45


def test_too_few_drafts_and_not_covered() -> None:
    assert check_trigger(windows([0.2] * 10, drafts=100), NOW, CONFIG).reason is TriggerReason.TOO_FEW_DRAFTS
    assert check_trigger(windows([0.2] * 5), NOW, CONFIG).reason is TriggerReason.NOT_COVERED


def test_raw_draft_acceptance_rate_option() -> None:
    # α = 0.5 at K = 6: draft acceptance rate ≈ 0.16, below 0.4; α itself is not
    ws = windows([0.5] * 10, k=6)
    assert not check_trigger(ws, NOW, CONFIG).triggered
    raw = replace(CONFIG, statistic=TriggerStatistic.DRAFT_ACCEPTANCE_RATE)
    check = check_trigger(ws, NOW, raw)
    assert check.triggered and "draft acceptance rate" in check.message


def test_keep_when_not_triggered() -> None:
    # BIG (prior 0.9) would confidently beat α 0.7 and be proposed beyond failure; without it the draft stays
    decision = choose_draft(snapshot(windows([0.7] * 10), candidates=(CURRENT, SMALL, TINY, NGRAM)))
    assert decision.reason is DraftReason.KEEP_NOT_TRIGGERED and decision.candidate is None
    assert decision.current is not None and decision.predicted_speedup > 1


def test_switch_to_the_best_candidate_by_prior() -> None:
    decision = choose_draft(snapshot(windows([0.2] * 10)))
    assert decision.reason is DraftReason.SWITCH_DRAFT
    assert decision.candidate is BIG  # best prior α; no memory limit given
    lo, hi = decision.predicted_speedup_ci
    assert lo < decision.predicted_speedup < hi
    assert decision.ranking[0].name == "big"
    assert "Switching to big" in decision.message


def test_measured_history_overrides_the_prior() -> None:
    history = {"big": AcceptanceEvidence(300.0, 2700.0, 2700.0)}  # measured α ≈ 0.1 on this target
    decision = choose_draft(snapshot(windows([0.2] * 10), history=history))
    assert decision.candidate is SMALL
    big = next(s for s in decision.ranking if s.name == "big")
    assert big.source == "measured+prior" and big.alpha < 0.2


def test_memory_fit_excludes_candidates() -> None:
    memory = MemoryBudget(budget_bytes=2 * 2**30, target_kv_bytes_per_token=131072, tokens_per_seq=1024)
    decision = choose_draft(snapshot(windows([0.2] * 10), memory=memory))
    assert decision.candidate is SMALL  # big needs 6 GB of weights
    big = next(s for s in decision.ranking if s.name == "big")
    assert not big.fits_memory


def test_fallback_to_ngram_then_off() -> None:
    bad = {n: AcceptanceEvidence(100.0, 1900.0, 1900.0) for n in ("small", "tiny", "big")}
    decision = choose_draft(snapshot(windows([0.2] * 10), history=bad))
    assert decision.reason is DraftReason.FALLBACK_NGRAM and decision.candidate is NGRAM
    costly = replace(CURRENT, cost_ratio=0.3)  # at α ≈ 0.2 the current draft no longer pays either
    others = (costly, SMALL, TINY, BIG, NGRAM)
    verify_cost = StepCostModel.from_cost_ratio(0.05, 0.02, per_token_s=0.002)  # extra tokens cost 10% each
    worse = {n: AcceptanceEvidence(10.0, 20000.0, 20000.0) for n in ("small", "tiny", "big", "ngram")}
    off = choose_draft(snapshot(windows([0.2] * 10), history=worse, candidates=others, step_cost=verify_cost))
    assert off.reason is DraftReason.DISABLE_SPECULATION and off.k == 0 and off.candidate is None


def test_keep_when_no_candidate_is_better() -> None:
    cheap = replace(CURRENT, cost_ratio=0.0)
    decision = choose_draft(snapshot(windows([0.35] * 10, drafts=2000), candidates=(cheap, TINY), history={
        "tiny": AcceptanceEvidence(100.0, 1900.0, 1900.0)}))  # fmt: skip
    assert decision.reason is DraftReason.KEEP_NO_BETTER_CANDIDATE


def test_candidate_validation() -> None:
    with pytest.raises(ValueError, match="needs a model path"):
        DraftCandidate("x", "draft_model")
    with pytest.raises(ValueError, match="alpha must lie in"):
        DraftCandidate("x", "ngram", prior_alpha=1.5)
    with pytest.raises(ValueError, match="threshold"):
        DraftTriggerConfig(threshold=0)
    assert NGRAM.footprint().weights_bytes == 0 and NGRAM.cost_ratio_for(None) == 0.0
    assert DraftCandidate("y", "eagle", "/p", params=100).cost_ratio_for(1000) == 0.1


def test_a_candidates_own_prior_strength_outweighs_the_configs() -> None:
    """A fleet prior carries its own strength: history weighs against it, not against the config's 200."""
    history = {"big": AcceptanceEvidence(300.0, 2700.0, 2700.0)}  # measured α ≈ 0.1 here
    strong = replace(BIG, prior_strength_trials=100_000.0, prior_source="fleet (5 engine(s))")
    decision = choose_draft(snapshot(windows([0.2] * 10), history=history, candidates=(CURRENT, SMALL, strong)))
    big = next(s for s in decision.ranking if s.name == "big")
    assert big.alpha > 0.85 and decision.candidate is strong  # the fleet's 100k tokens dominate 3k measured
    assert big.prior == "fleet (5 engine(s)) 0.90 worth 100000 tokens"
    default = choose_draft(snapshot(windows([0.2] * 10), history=history))
    assert next(s for s in default.ranking if s.name == "big").prior == "configured 0.90 worth 200 tokens"
    with pytest.raises(ValueError, match="prior strength"):
        replace(BIG, prior_strength_trials=-1.0)


def _windows(alpha: float, n: int = 10, drafts: int = 2000, k: int = 3) -> list[SpecWindow]:
    rng = np.random.default_rng(7)
    out = []
    for i in range(n):
        surv = np.concatenate([[1.0], np.cumprod(np.full(k, alpha))])
        exact = rng.multinomial(drafts, surv - np.append(surv[1:], 0.0))
        per_pos = tuple(int(x) for x in np.cumsum(exact[::-1])[::-1][1:])
        end = NOW - timedelta(seconds=60 * (n - i - 1))
        out.append(
            SpecWindow(end - timedelta(seconds=60), end, SpecCounters(drafts, drafts * k, sum(per_pos), per_pos, k))
        )
    return out


RUNNING_8B = DraftCandidate("running", "draft_model", "/m/8b", params=8_000_000_000, prior_alpha=0.75, cost_ratio=0.08)
NGRAM_60 = DraftCandidate("ngram", "ngram", prior_alpha=0.6)


def _choice(alpha: float) -> DraftReason:
    snap = DraftChoiceSnapshot(
        now=NOW, current="running", current_k=3, windows=_windows(alpha), candidates=(RUNNING_8B, NGRAM_60), history={},
        batch_size=8, k_max=8, step_cost=StepCostModel.from_cost_ratio(0.08, 0.025, 0.0001),
        config=DraftTriggerConfig(threshold=0.4, duration_s=600, min_drafts=2000, segments=3),
    )  # fmt: skip
    return choose_draft(snap).reason


def test_a_candidate_that_confidently_beats_the_running_draft_is_proposed_above_the_floor() -> None:
    assert _choice(0.45) is DraftReason.FALLBACK_NGRAM  # α 0.45 > 0.4: the floor alone would keep it
    assert _choice(0.8) is DraftReason.KEEP_NOT_TRIGGERED  # the running draft is good: no swap


def test_a_draft_the_floor_just_swapped_out_is_not_proposed_back_beyond_failure() -> None:
    # ngram left with α below 0.4; its history (a good period before the fall) still ranks it above the
    # running draft: without the exclusion the controller would swap straight back
    snap = DraftChoiceSnapshot(
        now=NOW, current="running", current_k=3, windows=_windows(0.45), candidates=(RUNNING_8B, NGRAM_60),
        history={"ngram": AcceptanceEvidence(8500.0, 1500.0, 3000.0)}, batch_size=8, k_max=8,
        step_cost=StepCostModel.from_cost_ratio(0.08, 0.025, 0.0001),
        config=DraftTriggerConfig(threshold=0.4, duration_s=600, min_drafts=2000, segments=3),
    )  # fmt: skip
    assert choose_draft(snap).reason is DraftReason.FALLBACK_NGRAM
    held = choose_draft(replace(snap, not_opportunistic=frozenset({"ngram"})))
    assert held.reason is DraftReason.KEEP_NOT_TRIGGERED and held.candidate is None
    # the floor itself still ranks it: acceptance that stays low may send the engine back to it
    low = choose_draft(replace(snap, windows=_windows(0.2), not_opportunistic=frozenset({"ngram"})))
    assert low.reason is DraftReason.FALLBACK_NGRAM


def _shifted(before: float, after: float, n_after: int, n: int = 10) -> list[SpecWindow]:
    """``n`` 60 s windows ending at NOW: α ``before``, then ``after`` in the last ``n_after``."""
    old = _windows(before, n)[: n - n_after]
    new = _windows(after, n)[n - n_after :]
    return old + new


def _shift_snapshot(ws: list[SpecWindow]) -> DraftChoiceSnapshot:
    return DraftChoiceSnapshot(
        now=NOW, current="running", current_k=5, windows=ws, candidates=(RUNNING_8B, NGRAM_60), history={},
        batch_size=16, k_max=8, step_cost=StepCostModel.from_cost_ratio(0.08, 0.025, 0.0001),
        config=DraftTriggerConfig(threshold=0.4, duration_s=600, min_drafts=2000, segments=3),
    )  # fmt: skip


def test_a_candidate_that_beats_the_running_draft_on_its_newest_slice_holds_k_for_the_swap() -> None:
    # gpu_code_rag at the start of the code period: the 8B falls from 0.8 to 0.45 and ngram (prior 0.6)
    # would beat it, but the older windows still vouch for the 8B over the trigger's 600 s. A K change now
    # would restart the engine and begin the 8B's evidence again: the swap came 720 s after it.
    held = choose_draft(_shift_snapshot(_shifted(0.8, 0.45, 4)))
    assert held.reason is DraftReason.KEEP_NOT_TRIGGERED and held.candidate is None
    assert held.swap_pending is not None and "ngram" in held.swap_pending
    # once the whole duration is at the new acceptance, the swap itself is proposed
    assert choose_draft(_shift_snapshot(_windows(0.45))).reason is DraftReason.FALLBACK_NGRAM
    # nothing pending when the running draft is fine lately, or its newest slice holds too few drafts
    assert choose_draft(_shift_snapshot(_windows(0.8))).swap_pending is None
    assert choose_draft(_shift_snapshot(_shifted(0.45, 0.8, 4))).swap_pending is None
    thin = [replace(w, counters=SpecCounters(100, 500, 60, (40, 15, 5, 0, 0), 5)) for w in _windows(0.45)][-4:]
    assert choose_draft(_shift_snapshot(_shifted(0.8, 0.45, 4)[:6] + thin)).swap_pending is None


# gpu_memory_bound: 70B FP8 with 8k contexts; the 8B draft leaves room for 15 sequences, the 1B for 21
BIG_8B = DraftCandidate("8b", "draft_model", "/m/8b", params=8_000_000_000, dtype="fp8", kv_bytes_per_token=131072,
                        prior_alpha=0.75, cost_ratio=0.08)  # fmt: skip
SMALL_1B = DraftCandidate("1b", "draft_model", "/m/1b", params=2_500_000_000, dtype="fp8", kv_bytes_per_token=32768,
                          prior_alpha=0.6, cost_ratio=0.03)  # fmt: skip
KV_UNDER_8B = KvCapacity((65e9 - 8e9) / (327680 + 131072), 327680, 8192, BIG_8B.footprint(), 3)
TARGET_70B = StepCostModel.from_cost_ratio(0.08, 0.02, 0.0001)


def _memory_choice(demand: float) -> DraftDecision:
    snap = DraftChoiceSnapshot(
        now=NOW, current="8b", current_k=3, windows=_windows(0.75), candidates=(BIG_8B, SMALL_1B),
        history={"1b": AcceptanceEvidence(60_000.0, 40_000.0, 40_000.0)},  # measured on this traffic
        batch_size=min(round(demand), 15), k_max=6, step_cost=TARGET_70B, config=CONFIG, demand=demand,
        kv=KV_UNDER_8B,
    )  # fmt: skip
    return choose_draft(snap)


def test_candidates_are_ranked_at_the_batch_their_memory_lets_them_run() -> None:
    assert capped_batch(KV_UNDER_8B, 32.0, SMALL_1B.footprint(), 3, TARGET_70B, 15)[0] == 21
    batch, scale = capped_batch(KV_UNDER_8B, 32.0, BIG_8B.footprint(), 3, TARGET_70B, 15)
    assert batch == 15
    assert scale == pytest.approx((15 / TARGET_70B.plain_step_time_s(15)) / (24 / TARGET_70B.plain_step_time_s(24)))
    assert capped_batch(None, 32.0, BIG_8B.footprint(), 3, TARGET_70B, 15) == (15, 1.0)  # no pool known
    # at the peak 17 requests wait behind the 8B: the 1B, with room for 21, is confidently faster
    peak = _memory_choice(32.0)
    assert peak.reason is DraftReason.SWITCH_DRAFT and peak.candidate is SMALL_1B
    assert peak.current is not None and "batch 15 (memory cap" in peak.current.message
    one_b = next(s for s in peak.ranking if s.name == "1b")
    assert "batch 21 (memory cap" in one_b.message and one_b.speedup_ci[0] > peak.current.speedup_ci[1]
    # at the trough nothing waits: every draft runs all 8 sequences and the 8B's α wins
    assert _memory_choice(8.0).reason is DraftReason.KEEP_NOT_TRIGGERED


# -- turning speculation back on ---------------------------------------------------------------------

# a target whose verification gets expensive with batch (8B on one GPU: 7 ms + 23 µs per scored token)
TARGET_8B = StepCostModel.from_cost_ratio(0.0, 0.007, 0.000023)
DRAFT_1B = DraftCandidate("1b", "draft_model", "/models/1b", prior_alpha=0.55, cost_ratio=0.2)


def off_snapshot(batch: int, history: dict[str, AcceptanceEvidence] | None = None) -> DraftChoiceSnapshot:
    return snapshot([], current=None, current_k=0, candidates=(DRAFT_1B,), history=history or {},
                    batch_size=batch, step_cost=TARGET_8B)  # fmt: skip


def test_speculation_comes_back_on_at_a_batch_where_a_draft_surely_pays() -> None:
    measured = {"1b": AcceptanceEvidence(successes=55_000, failures=45_000)}
    decision = choose_enable(off_snapshot(8, measured))
    assert decision.reason is DraftReason.ENABLE_SPECULATION and decision.candidate is DRAFT_1B
    assert decision.k >= 1 and decision.predicted_speedup_ci[0] > 1.0
    assert "turning it back on" in decision.message and "batch 8" in decision.message


def test_speculation_stays_off_where_every_k_loses_to_plain_decoding() -> None:
    measured = {"1b": AcceptanceEvidence(successes=55_000, failures=45_000)}
    decision = choose_enable(off_snapshot(256, measured))
    assert decision.reason is DraftReason.KEEP_OFF and decision.candidate is None and decision.k == 0
    assert "stays off at batch 256: no K pays" in decision.message and "does not pay" in decision.message


def test_a_prior_alone_with_a_wide_interval_does_not_turn_speculation_on() -> None:
    # α ≈ 0.55 worth 200 pseudo-tokens: the interval reaches where K = 1 loses at batch 64
    unsure = replace(DRAFT_1B, prior_alpha=0.5)
    snap = replace(off_snapshot(64), candidates=(unsure,), config=replace(CONFIG, prior_strength_trials=20.0))
    decision = choose_enable(snap)
    assert decision.reason is DraftReason.KEEP_OFF, decision.message


def _at_16_streams(ngram: DraftCandidate) -> DraftDecision:
    # the lab's shape: a 41 ms target pass growing 3 ms a scored token, a model draft at c = 0.2 of it
    running = DraftCandidate("running", "draft_model", "/m/d", params=19_000_000, prior_alpha=0.8, cost_ratio=0.2)
    snap = DraftChoiceSnapshot(
        now=NOW, current="running", current_k=1, windows=_windows(0.8, k=1), candidates=(running, ngram),
        history={"ngram": AcceptanceEvidence(8000.0, 2000.0, 2000.0)}, batch_size=16, k_max=5,
        step_cost=StepCostModel.from_cost_ratio(0.2, 0.041, 0.003),
        config=DraftTriggerConfig(threshold=0.4, duration_s=600, min_drafts=2000, segments=3),
    )  # fmt: skip
    return choose_draft(snap)


def test_a_draft_pass_measured_in_seconds_prices_a_host_side_proposer_under_load() -> None:
    # Priced as 0.2 × the target's pass, ngram pays the target's per-token growth on every sequence (18 ms
    # a step at 16 streams, its one lookup pass) and beats the running draft by less than 3 %; its own pass,
    # 9.5 ms flat, makes it the clearly better choice there, as the lab's fixed cells measured (ngram/K = 3
    # at 16 streams 236 tok/s, the model drafts 198-213).
    as_ratio = DraftCandidate("ngram", "ngram", prior_alpha=0.5, cost_ratio=0.2)
    ratio = _at_16_streams(as_ratio)
    assert ratio.current is not None and ratio.predicted_speedup < ratio.current.speedup * 1.03
    chosen = _at_16_streams(replace(as_ratio, draft_fixed_s=0.0095, draft_per_seq_s=0.0))
    assert chosen.candidate is not None and chosen.candidate.name == "ngram"
    assert chosen.current is not None and chosen.predicted_speedup > chosen.current.speedup * 1.03


def test_a_measured_draft_pass_must_be_seconds() -> None:
    with pytest.raises(ValueError, match="draft_fixed_s must be ≥ 0 seconds"):
        DraftCandidate("ngram", "ngram", draft_fixed_s=-0.001)
    with pytest.raises(ValueError, match="draft_per_seq_s"):
        DraftCandidate("ngram", "ngram", draft_per_seq_s=float("nan"))


def test_a_candidate_is_surely_faster_by_the_interval_of_the_ratio_not_by_disjoint_intervals() -> None:
    """Two drafts' speedups rest on independent evidence: the candidate is surely faster when the interval of
    the ratio (theirs in quadrature) is above 1, though its own interval still overlaps the running draft's."""

    def decide(alpha: float) -> DraftDecision:
        history = {"small": AcceptanceEvidence(alpha * 3000, (1 - alpha) * 3000)}  # measured on this target
        return choose_draft(snapshot(windows([0.7] * 10), candidates=(CURRENT, SMALL), history=history))

    better = decide(0.73)
    small = next(s for s in better.ranking if s.name == "small")
    assert better.current is not None and small.speedup_ci[0] < better.current.speedup_ci[1]  # overlapping
    assert better.reason is DraftReason.SWITCH_DRAFT and better.candidate is SMALL
    assert decide(0.71).reason is DraftReason.KEEP_NOT_TRIGGERED  # within the noise of the running draft's 0.7


def test_a_lookup_is_ranked_on_the_steps_it_drafts_at_not_as_if_it_drafted_at_every_one() -> None:
    # ngram accepts 91 % of what it drafts, a small draft model 80 %; but the lookup finds a match at 30 % of
    # the steps (the others verify one token alone), so it makes fewer tokens a step than the draft model
    history = {"ngram": AcceptanceEvidence(9100.0, 900.0, 3000.0), "small": AcceptanceEvidence(8000.0, 2000.0, 3000.0)}
    low = windows([0.2] * 10)
    every_step = choose_draft(snapshot(low, candidates=(CURRENT, SMALL, NGRAM), history=history))
    assert every_step.candidate is not None and every_step.candidate.name == "ngram"
    sparse_ngram = replace(NGRAM, proposal_share=0.3)
    decision = choose_draft(snapshot(low, candidates=(CURRENT, SMALL, sparse_ngram), history=history))
    assert decision.candidate is not None and decision.candidate.name == "small"
    ngram = next(s for s in decision.ranking if s.name == "ngram")
    assert ngram.proposal_share == 0.3 and "drafting at 30% of its steps" in ngram.message
    # its speedup is 1 + share × (what it would add drafting at every step), at the same K and cost
    full = next(s for s in every_step.ranking if s.name == "ngram")
    assert ngram.k == full.k == 8  # the cost is one step at batch 1 either way (no per-token cost here)
    assert ngram.speedup == pytest.approx(1 + 0.3 * (full.speedup - 1), rel=1e-6)
    with pytest.raises(ValueError, match="proposal share"):
        replace(NGRAM, proposal_share=0.0)


def test_a_swap_planned_on_free_verification_goes_half_way_up_from_the_running_k() -> None:
    """Fitted from steps at one K and one batch size, the step-cost model takes verification's per-token
    cost as 0 (``per_token_assumed``), which overrates larger K; a swap then moves K at most half-way up from
    the running K (at least one step), as the K policy does — the candidate's steps measure the cost."""
    free = StepCostModel.from_cost_ratio(0.05, 0.02)  # no per-token cost: E grows with K, the step does not
    measured_free = choose_draft(snapshot(windows([0.2] * 10), step_cost=free))
    assert measured_free.candidate is BIG and measured_free.k == 8  # verification known to be ~free: K_max
    assumed = replace(free, per_token_assumed=True)
    for running_k, expect in ((3, 6), (2, 5), (7, 8)):  # running K + ceil((8 - K) / 2)
        decision = choose_draft(snapshot(windows([0.2] * 10), step_cost=assumed, current_k=running_k))
        big = next(s for s in decision.ranking if s.name == "big")
        assert decision.candidate is BIG and decision.k == big.k == expect, running_k
        if expect < 8:
            assert f"half-way up from the running K = {running_k}" in big.message
            full = next(s for s in measured_free.ranking if s.name == "big")
            assert big.speedup < full.speedup  # its speedup is the one at the K it is proposed at
