"""spectuner's full policy (tuner/controller/policy.py ``propose``): draft swap, then K or the table.

Contexts are built from i.i.d. acceptance counts with a known α (tests.fakes.make_context, as
build_context does), so every expected outcome follows from the closed forms in docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from policies.acceptance import AcceptanceEvidence
from policies.counters import SpecCounters
from policies.draft_choice import DraftCandidate, DraftTriggerConfig
from policies.spec_config import OFF, SpecConfig
from policies.step_cost import StepCostModel, fit_step_cost
from tests.fakes import declining_counters, iid_counters, make_context
from tuner.config import PolicySection, StepCostSection
from tuner.controller.context import DecisionContext
from tuner.controller.policy import PolicyReason, _table_streak_key, propose, propose_k
from tuner.controller.settings import PolicySettings

WEAK = DraftCandidate("weak", "draft_model", "/models/weak", params=1000, prior_alpha=0.3, cost_ratio=0.1)
GOOD = DraftCandidate("good", "draft_model", "/models/good", params=1000, prior_alpha=0.9, cost_ratio=0.1)
MEDIUM = DraftCandidate("medium", "draft_model", "/models/medium", params=1000, prior_alpha=0.7, cost_ratio=0.1)


def pinned(model: StepCostModel) -> StepCostSection:
    """``[policy.step_cost]`` holding this model (what an operator pins)."""
    return StepCostSection(
        fixed_s=model.fixed_s,
        per_token_s=model.per_token_s,
        draft_fixed_s=model.draft_fixed_s,
        draft_per_seq_s=model.draft_per_seq_s,
    )


def evidence(
    spec: SpecConfig | dict[str, object],
    alpha: float,
    *,
    k: int = 3,
    windows: int = 30,
    window_s: float = 20.0,
    drafts_per_window: int = 200,
    candidates: tuple[DraftCandidate, ...] = (WEAK, GOOD, MEDIUM),
    batch: float = 1.0,
    failed: tuple[SpecConfig | dict[str, object], ...] = (),
    history: dict[str, AcceptanceEvidence] | None = None,
) -> DecisionContext:
    wins = [iid_counters(alpha, k, drafts_per_window) for _ in range(windows)]
    return make_context(
        spec,
        wins,
        window_s=window_s,
        batch=batch,
        candidates=candidates,
        history=history,
        failed=failed,
        cost_ratio=0.1,
    )


SWAP = DraftTriggerConfig(threshold=0.4, duration_s=300.0, min_drafts=500, segments=3)
SETTINGS = PolicySettings(PolicySection(k_max=6, cost_ratio=0.1), swap=SWAP)
WEAK_SPEC = {"method": "draft_model", "model": "/models/weak", "num_speculative_tokens": 3}


def test_weak_draft_is_swapped_for_the_best_candidate() -> None:
    out = propose(evidence(WEAK_SPEC, 0.25), SETTINGS)
    assert out.reason is PolicyReason.SWAP_DRAFT
    assert out.target is not None and out.target.model == "/models/good"
    assert out.predicted_gain is not None and out.predicted_gain > 1.5
    assert out.predicted_gain_ci is not None and out.predicted_gain_ci[0] > 1.0
    assert out.details is not None and "acceptance_low" in out.details
    assert out.acceptance_low is not None and out.acceptance_low == out.details["acceptance_low"]
    assert out.details["trigger"]["upper"] < 0.4
    assert out.alternative is None  # below the floor the draft goes: no K change of it is offered instead


def test_a_candidate_that_failed_to_start_is_not_proposed_again() -> None:
    failed = ({"method": "draft_model", "model": "/models/good", "num_speculative_tokens": 5},)
    ctx = evidence(WEAK_SPEC, 0.25, failed=failed)
    assert ctx.failed_candidates == frozenset({"good"})
    out = propose(ctx, SETTINGS)
    assert out.reason is PolicyReason.SWAP_DRAFT
    assert out.target is not None and out.target.model == "/models/medium"


def test_acceptance_above_threshold_keeps_the_draft_and_tunes_k() -> None:
    spec = {"method": "draft_model", "model": "/models/medium", "num_speculative_tokens": 1}
    out = propose(evidence(spec, 0.75, k=1, candidates=(WEAK, MEDIUM)), SETTINGS)
    assert out.reason is PolicyReason.CHANGE_K  # no swap: K tuning alone
    assert out.target is not None and out.target.model == "/models/medium"
    assert out.target.k is not None and out.target.k > 1


def test_a_candidate_that_confidently_beats_a_good_draft_is_proposed_beyond_failure() -> None:
    # α 0.75 is well above the 0.4 floor, but GOOD (prior 0.9, same cost) is confidently faster
    spec = {"method": "draft_model", "model": "/models/medium", "num_speculative_tokens": 1}
    out = propose(evidence(spec, 0.75, k=1), SETTINGS)
    assert out.reason is PolicyReason.SWAP_DRAFT
    assert out.target is not None and out.target.model == "/models/good"
    assert out.acceptance_low is None and "acceptance_low" not in (out.details or {})
    assert out.predicted_gain_ci is not None and out.predicted_gain_ci[0] > 1.0
    # medium's own K change (K = 1 is far from its best) is part of that gain: it comes with the swap, for
    # the controller to take first where it applies without a restart
    alt = out.alternative
    assert alt is not None and alt.reason is PolicyReason.CHANGE_K and alt.target is not None
    assert alt.target.model == "/models/medium" and (alt.target.k or 0) > 1
    assert alt.predicted_gain_ci is not None and alt.predicted_gain_ci[0] > 1.0


def test_too_little_evidence_never_swaps() -> None:
    # 30 s of data against a 300 s duration: "stays below" is not established
    out = propose(evidence(WEAK_SPEC, 0.25, windows=3, window_s=10.0), SETTINGS)
    assert out.reason is not PolicyReason.SWAP_DRAFT
    assert not (out.details or {}).get("acceptance_low")
    assert out.acceptance_low is None


def test_low_acceptance_with_no_better_candidate_keeps_and_says_so() -> None:
    poor = DraftCandidate("poor", "draft_model", "/models/poor", params=1000, prior_alpha=0.05, cost_ratio=0.1)
    out = propose(evidence(WEAK_SPEC, 0.3, candidates=(WEAK, poor)), SETTINGS)
    assert out.reason is not PolicyReason.SWAP_DRAFT
    assert (out.details or {}).get("acceptance_low")
    assert out.acceptance_low


def test_measured_history_outweighs_an_optimistic_prior() -> None:
    # "good" claims 0.9 but measured 0.2 on this target over 20 000 tokens: medium wins.
    history = {"good": AcceptanceEvidence(successes=4000.0, failures=16000.0, drafts=16000.0)}
    out = propose(evidence(WEAK_SPEC, 0.25, history=history), SETTINGS)
    assert out.target is not None and out.target.model == "/models/medium"


TABLE_COST = StepCostModel(fixed_s=2e-3, per_token_s=1e-3, draft_fixed_s=2e-4, draft_per_seq_s=1e-4)
TABLE_SETTINGS = PolicySettings(
    PolicySection(k_max=5, step_cost=pinned(TABLE_COST), per_batch_size=True, max_batch_size=16), swap=None
)
GOOD_K5 = {"method": "draft_model", "model": "/models/good", "num_speculative_tokens": 5}
# a lone stream and bursts of 16, alternating: the load a table serves without another change
MIXED_LOAD = tuple((20.0, 16.0 if i % 2 else 1.0) for i in range(30))


def test_per_batch_size_table_follows_the_load() -> None:
    # The target's cost grows with the tokens it scores: speculation pays at batch 1, not at 16.
    settings = TABLE_SETTINGS
    assert settings.pinned_step_cost == TABLE_COST
    spec = GOOD_K5
    ev = replace(evidence(spec, 0.8, k=5, batch=16.0, candidates=(GOOD,)), batch_profile=MIXED_LOAD)
    out = propose(ev, settings)
    assert out.reason is PolicyReason.CHANGE_K_TABLE
    assert out.target is not None
    rows = out.target.to_vllm()["num_speculative_tokens_per_batch_size"]
    assert rows[0][0] == 1 and rows[-1][1] == 16
    assert rows[0][2] > rows[-1][2]  # more speculation at low load than at high load
    assert out.target.to_vllm()["num_speculative_tokens"] == 5  # the engine keeps K_max; the table picks per step
    assert out.predicted_gain is not None and out.predicted_gain > 1.0
    # Applying that table and measuring the same: the table is kept (no flapping).
    same_ev = evidence(out.target, 0.8, k=5, batch=16.0, candidates=(GOOD,))
    same = propose(replace(same_ev, batch_profile=MIXED_LOAD), settings)
    assert same.reason is PolicyReason.KEEP and same.target is None


def test_a_tables_streak_key_is_its_k_where_the_load_runs() -> None:
    # Two tables that differ only at batch sizes the load does not visit propose the same change for the
    # streak rail (their boundaries there move with α's noise from tick to tick); one that differs where
    # the load runs does not.
    target = SpecConfig("draft_model", "/models/good", 5)
    at_one = ((1.0, 1.0), (1.0, 1.2), (0.01, 9.0))  # 9 streams for 1 % of the time: not visited
    a = _table_streak_key(target, ((1, 3, 5), (4, 10, 3), (11, 16, 1)), at_one)
    b = _table_streak_key(target, ((1, 3, 5), (4, 11, 3), (12, 16, 2)), at_one)
    c = _table_streak_key(target, ((1, 1, 4), (2, 16, 1)), at_one)
    assert a == b != c
    assert "at 1:5" in a and "/models/good" in a and "K_max=5" in a
    mixed = _table_streak_key(target, ((1, 3, 5), (4, 10, 3), (11, 16, 1)), MIXED_LOAD)
    assert mixed.endswith("at 1:5,16:1")
    ev = replace(evidence(GOOD_K5, 0.8, k=5, batch=16.0, candidates=(GOOD,)), batch_profile=MIXED_LOAD)
    out = propose(ev, TABLE_SETTINGS)
    assert out.reason is PolicyReason.CHANGE_K_TABLE and out.streak_key is not None
    assert out.streak_key.startswith("table draft_model /models/good K_max=5 at 1:")


def test_under_a_sustained_full_batch_a_table_drops_its_draft() -> None:
    # 16 streams for the whole load window: the table's best row there still runs the draft model's pass
    # (K = 0) or verifies twice the tokens (K = 1); only an engine without the draft reaches plain decoding.
    # That is a restart, and coming back when the load falls is another: the proposal says so.
    full = replace(evidence(GOOD_K5, 0.8, k=5, batch=16.0, candidates=(GOOD,)), load_profile=((600.0, 16.0),))
    out = propose(full, TABLE_SETTINGS)
    assert out.reason is PolicyReason.DROP_DRAFT and out.target is not None
    assert out.target.describe() == "speculation off"
    assert out.restarts == 2
    assert out.predicted_gain is not None and out.predicted_gain_ci is not None
    assert out.predicted_gain_ci[0] > 1.0 and "best table" in out.message
    assert out.details["drop_draft"]["mean_load"] == 16.0
    # where the load came from unknown, the way back is charged as a restart at today's goodput
    assert out.way_back_share == 1.0 and out.way_back_lag_s == 0.0 and "Bringing the draft back" not in out.message
    # it rose from one stream: the way back stops an engine serving one stream (a fraction of today's
    # tokens a second), after the load window's wait for that load to be sustained, short of the table
    rose = propose(replace(full, load_before=1.0), TABLE_SETTINGS)
    assert rose.reason is PolicyReason.DROP_DRAFT and rose.restarts == 2
    assert 0.0 < rose.way_back_share < 1.0 and rose.way_back_lag_s > 0.0
    assert "at the load this one rose from (1.0 requests)" in rose.message
    assert rose.details["drop_draft"]["way_back_share"] == rose.way_back_share
    # from a load no lower than today's: charged as before
    assert propose(replace(full, load_before=32.0), TABLE_SETTINGS).way_back_share == 1.0
    # a lone stream half the time: the table wins there by far more than the draft costs at 16 — keep it
    mixed = replace(full, load_profile=tuple((20.0, b) for _, b in MIXED_LOAD))
    kept = propose(mixed, TABLE_SETTINGS)
    assert kept.reason is not PolicyReason.DROP_DRAFT
    assert kept.target is None or kept.target.speculates


def test_the_way_back_from_a_dropped_draft_is_judged_as_a_table_over_the_load() -> None:
    # Speculation is off after a busy spell; the load is a lone stream again: the draft comes back with a
    # table, and the predicted gain is that table's over the load window, not one K's at its mean.
    history = {"good": AcceptanceEvidence(successes=16000.0, failures=4000.0, drafts=8000.0)}
    off = replace(
        make_context(OFF, [SpecCounters() for _ in range(30)], window_s=20.0, candidates=(GOOD,), history=history),
        load_profile=((600.0, 1.0),),
    )
    out = propose(off, TABLE_SETTINGS)
    assert out.reason is PolicyReason.ENABLE_SPECULATION and out.target is not None
    assert out.target.to_vllm()["num_speculative_tokens_per_batch_size"][0][2] >= 1
    assert "Its table over the load seen" in out.message
    assert out.predicted_gain_ci is not None and out.predicted_gain_ci[0] > 1.0
    # still 16 streams: the table would lose to plain decoding, so it stays off
    busy = propose(replace(off, load_profile=((600.0, 16.0),)), TABLE_SETTINGS)
    assert busy.target is None


def test_k_is_left_alone_while_low_acceptance_is_being_confirmed() -> None:
    # 60 s of a clearly bad draft against a 300 s trigger: no swap yet, and no K change either (a K = 0
    # table would stop the very drafts the swap decision needs).
    settings = PolicySettings(PolicySection(k_max=6, cost_ratio=0.1, per_batch_size=True), swap=SWAP)
    out = propose(evidence(WEAK_SPEC, 0.2, windows=3, window_s=20.0), settings)
    assert out.reason is PolicyReason.KEEP and out.target is None
    assert (out.details or {}).get("swap_pending")
    assert out.swap_pending
    # without any other candidate there is nothing to wait for: K is tuned
    alone = propose(evidence(WEAK_SPEC, 0.2, windows=3, window_s=20.0, candidates=(WEAK,)), settings)
    assert alone.target is not None
    assert not alone.swap_pending


def test_k_is_left_alone_while_a_candidate_beats_the_running_draft_on_its_newest_evidence() -> None:
    # The running draft's acceptance just fell 0.8 → 0.45 (above the 0.4 floor): on the newest 100 s the
    # medium draft (prior 0.7) beats it, over the trigger's 300 s not yet. A K change now would restart the
    # engine and begin the running draft's evidence again, delaying the swap by a whole duration.
    wins = [iid_counters(0.8, 3, 200) for _ in range(25)] + [iid_counters(0.45, 3, 200) for _ in range(5)]
    ctx = make_context(WEAK_SPEC, wins, window_s=20.0, candidates=(WEAK, MEDIUM), cost_ratio=0.1)
    out = propose(ctx, SETTINGS)
    assert out.reason is PolicyReason.KEEP and out.target is None and out.swap_pending
    assert "medium" in out.message and "K unchanged" in out.message
    # without the candidate, K is tuned for the running draft as before
    alone = propose(make_context(WEAK_SPEC, wins, window_s=20.0, candidates=(WEAK,), cost_ratio=0.1), SETTINGS)
    assert alone.target is not None and not alone.swap_pending


def test_under_a_table_a_busy_spell_does_not_switch_speculation_off() -> None:
    # mostly 1 stream with bursts of 16: at a high mean batch no draft pays with one K; with a
    # table the candidates are ranked where the table speculates (the low end of the load). The table
    # drafts less at 16 streams but not 0: a table's K = 0 still pays the draft model's catch-up pass.
    cost = pinned(StepCostModel(fixed_s=2e-3, per_token_s=1e-3, draft_fixed_s=2e-4, draft_per_seq_s=1e-4))
    ev = evidence(WEAK_SPEC, 0.25, batch=1.0)
    profile = tuple((20.0, 16.0 if i % 3 == 0 else 1.0) for i in range(30))
    ev = replace(ev, batch_profile=profile, mean_batch_size=16.0)
    table = propose(ev, PolicySettings(PolicySection(k_max=4, step_cost=cost, per_batch_size=True), swap=SWAP))
    assert table.reason is PolicyReason.SWAP_DRAFT and table.target is not None
    rows = table.target.to_vllm()["num_speculative_tokens_per_batch_size"]
    assert rows[0][2] >= 1 and rows[-1][2] < rows[0][2]
    single = propose(ev, PolicySettings(PolicySection(k_max=4, step_cost=cost, per_batch_size=False), swap=SWAP))
    assert single.reason is PolicyReason.DISABLE_SPECULATION
    assert single.target is not None and single.target.describe() == "speculation off"


def test_a_k_that_failed_is_replaced_by_the_next_best_k() -> None:
    spec = {"method": "draft_model", "model": "/models/medium", "num_speculative_tokens": 1}
    best = propose(evidence(spec, 0.75, k=1, candidates=(WEAK, MEDIUM)), SETTINGS)
    assert best.target is not None
    failed = (best.target,)
    second = propose(evidence(spec, 0.75, k=1, failed=failed, candidates=(WEAK, MEDIUM)), SETTINGS)
    assert second.target is not None and second.target != best.target
    assert second.target.k not in (1, best.target.k)
    assert "failed lately" in second.message


def test_a_burst_in_the_load_horizon_does_not_make_k_chase_it() -> None:
    """One K for the load of the last hour: evidence taken during a burst (mean batch 160) proposes the
    K that serves the whole hour, not the burst's own best K; the message says over which load."""
    cost = pinned(StepCostModel.from_cost_ratio(0.08, target_step_s=0.025, per_token_s=0.0001))
    settings = PolicySettings(PolicySection(k_max=8, cost_ratio=0.08, step_cost=cost))
    spec = {"method": "draft_model", "model": "/models/good", "num_speculative_tokens": 3}
    burst = evidence(spec, 0.75, k=3, batch=160.0, candidates=())
    profile = tuple([(10.0, 8.0)] * 330 + [(10.0, 160.0)] * 30)
    during_burst_alone = propose(burst, settings)
    over_the_hour = propose(replace(burst, load_profile=profile), settings)
    assert during_burst_alone.reason is PolicyReason.CHANGE_K  # at B = 160 alone a smaller K wins
    assert during_burst_alone.target is not None and during_burst_alone.target.k is not None
    assert during_burst_alone.target.k < 3
    assert over_the_hour.reason is PolicyReason.KEEP, over_the_hour.message
    assert "Over the load of the last 3600 s (batch 8–160" in over_the_hour.message


# -- propose_k alone (was in test_controller_verify.py) ------------------------------------------------


def k_evidence(spec: SpecCounters, k: int, method: str = "draft_model") -> DecisionContext:
    """One config's measured evidence: 300 s of 100 tokens/s at batch 1 (no candidates: no swap)."""
    config = {"method": method, "model": "/d", "num_speculative_tokens": k}
    return make_context(config, [spec], window_s=300.0)


def iid(alpha: float, k: int, drafts: int) -> SpecCounters:
    return iid_counters(alpha, k, drafts, rounding="floor")


def test_propose_k_moves_to_leviathans_best_k() -> None:
    # α = 0.8, c = 0.05 ⇒ K = 8 at batch 1 (docs/architecture.md); from K = 2 the gain is well above 1.
    out = propose_k(k_evidence(iid(0.8, 2, 20000), 2), PolicySettings(PolicySection(k_max=8, cost_ratio=0.05)))
    assert out.reason is PolicyReason.CHANGE_K and out.target is not None
    assert out.target.k == 8 and out.target.model == "/d"
    assert out.target == SpecConfig("draft_model", "/d", 8)
    assert out.predicted_gain is not None and out.predicted_gain_ci is not None
    assert 1.0 < out.predicted_gain_ci[0] <= out.predicted_gain <= out.predicted_gain_ci[1]


def test_propose_k_keeps_the_best_and_skips_without_data() -> None:
    keep = propose_k(k_evidence(iid(0.8, 8, 20000), 8), PolicySettings(PolicySection(k_max=8, cost_ratio=0.05)))
    assert keep.reason is PolicyReason.KEEP and keep.target is None
    assert propose_k(k_evidence(SpecCounters(), 3), PolicySettings()).reason is PolicyReason.NO_DRAFTS
    off = propose_k(k_evidence(SpecCounters(), 0, method="off"), PolicySettings())
    assert off.reason is PolicyReason.NO_SPECULATION


def test_a_head_method_plans_k_with_per_position_acceptance() -> None:
    """The same counters under EAGLE (a head on the target's hidden states) and under a separate draft
    model: one α pooled over positions 0.95 → 0.35 overstates the deep positions, so both plan K per
    position (the head by construction, the draft because its positions reject one α) and say why in the
    audit details; where one α fits the positions, a draft model keeps it and a head does not."""
    windows = [declining_counters(400, (0.95, 0.8, 0.6, 0.45, 0.35)) for _ in range(30)]
    settings = PolicySettings(PolicySection(k_max=8, cost_ratio=0.02))
    head = propose_k(make_context(SpecConfig("eagle", "/heads/e1", 5), windows), settings)
    draft = propose_k(make_context(SpecConfig("draft_model", "/drafts/d1", 5), windows), settings)
    assert head.details["acceptance_model"]["choice"].startswith("positional")  # per position, with the reason
    assert draft.details["acceptance_model"]["choice"] == "positional_constant_alpha_rejected"
    assert (head.target.k if head.target else 5) == (draft.target.k if draft.target else 5) < 8
    flat = [iid_counters(0.8, 5, 400) for _ in range(30)]
    head_flat = propose_k(make_context(SpecConfig("eagle", "/heads/e1", 5), flat), settings)
    draft_flat = propose_k(make_context(SpecConfig("draft_model", "/drafts/d1", 5), flat), settings)
    assert head_flat.details["acceptance_model"]["choice"].startswith("positional")
    assert "acceptance_model" not in draft_flat.details


def test_a_draft_models_falling_positions_stop_k_before_one_alpha_would() -> None:
    # ngram on code/RAG: copied spans end, so acceptance falls 0.85 → 0.77 over K = 3's positions; one α
    # (0.81) would plan K = 7 at batch 16, the positions say fewer; counters one α explains keep K = 7.
    cost = StepCostModel.from_cost_ratio(0.008, 0.025, 0.0001)
    settings = PolicySettings(PolicySection(k_max=8, cost_ratio=0.008, step_cost=pinned(cost)))
    spec = SpecConfig("ngram", None, 3)
    falling = [declining_counters(4000, (0.85, 0.81, 0.77)) for _ in range(30)]
    out = propose_k(make_context(spec, falling, batch=16.0), settings)
    assert out.details["acceptance_model"]["choice"] == "positional_constant_alpha_rejected"
    assert out.target is not None and out.target.k is not None and 4 <= out.target.k <= 6
    one_alpha = propose_k(make_context(spec, [iid_counters(0.81, 3, 4000) for _ in range(30)], batch=16.0), settings)
    assert one_alpha.target is not None and one_alpha.target.k == 7 and "acceptance_model" not in one_alpha.details


def test_an_mtp_engine_is_a_running_candidate_without_a_draft_path() -> None:
    ctx = make_context(SpecConfig("mtp", None, 2), [iid_counters(0.8, 2, 300) for _ in range(10)])
    assert ctx.running is not None and ctx.running.method == "mtp" and ctx.running.path is None
    assert not ctx.running.free and ctx.running.in_target


def test_shadow_evidence_ranks_a_candidate_that_was_never_served() -> None:
    # No serving history at all: shadow replay measured "good" at 0.2 over 20 000 tokens, so medium wins;
    # without the shadow evidence good's optimistic prior would.
    shadow = {"good": AcceptanceEvidence(successes=4000.0, failures=16000.0, drafts=16000.0)}
    ctx = evidence(WEAK_SPEC, 0.25)
    assert propose(ctx, SETTINGS).target.model == "/models/good"  # type: ignore[union-attr]
    out = propose(replace(ctx, shadow=shadow), SETTINGS)
    assert out.target is not None and out.target.model == "/models/medium"
    # how much a replay counted shows in the audit row, and in the message when the chosen draft has one
    weight = "replay error σ 0.020 (configured; no two replays of one regime yet)"
    weighed = propose(replace(ctx, shadow=shadow, shadow_weight=weight), SETTINGS)
    assert weighed.details["shadow_weight"] == weight and weight not in weighed.message  # medium: never replayed
    both = {**shadow, "medium": AcceptanceEvidence(successes=16000.0, failures=4000.0, drafts=8000.0)}
    chosen = propose(replace(ctx, shadow=both, shadow_weight=weight), SETTINGS)
    assert chosen.target is not None and chosen.target.model == "/models/medium"
    assert f"Its shadow replays counted with {weight}." in chosen.message
    assert "shadow_weight" not in propose(ctx, SETTINGS).details


def test_propose_k_moves_half_way_while_the_fit_cannot_measure_the_verification_cost() -> None:
    """gpu_code_rag's first change: every step so far ran K = 3 at batch 16, so the fitted T(B, K) is flat in B
    (verifying more tokens looks free) and said K = 5 — worse than K = 3 at the true cost, a restart that did
    not pay (the best is 4). With such a fit a move up goes half-way (at least one step), and the new K's
    steps then measure the per-token cost."""
    fitted = fit_step_cost([16], [3], [0.0312], draft_cost_ratio=0.08).model
    assert fitted is not None and fitted.per_token_assumed
    ctx = replace(k_evidence(iid(0.75, 3, 20000), 3), step_cost=fitted, mean_batch_size=16.0)
    settings = PolicySettings(PolicySection(k_max=8, cost_ratio=0.08))
    out = propose_k(ctx, settings)
    assert out.reason is PolicyReason.CHANGE_K and out.target == SpecConfig("draft_model", "/d", 4), out.message
    assert "K = 5 is predicted best with verification taken as free" in out.message and "half-way" in out.message
    # the same fit with its per-token cost measured moves straight to the model's best K
    measured = propose_k(replace(ctx, step_cost=replace(fitted, per_token_assumed=False)), settings)
    assert measured.target == SpecConfig("draft_model", "/d", 5), measured.message


def test_a_swap_under_a_table_is_judged_against_the_k_the_table_drafts_at_that_load() -> None:
    """medium runs a per-batch-size table (engine K = 5, K = 2 from 5 streams up) at 16 streams; good
    (prior 0.9) is ranked there. The gain is good's speedup over medium's at K = 2, what is in force at
    16 streams, exactly as for medium at a plain K = 2 — not over medium at the engine's K = 5 (5 Dec
    simulator, lab_phases: that read 1.017x as 1.075x and restarted the engine at 64 streams)."""
    cost = pinned(StepCostModel(fixed_s=0.04, per_token_s=0.0027, draft_fixed_s=0.0105, draft_per_seq_s=0.00064))
    settings = PolicySettings(PolicySection(k_max=5, step_cost=cost, per_batch_size=True, max_batch_size=64), swap=SWAP)
    table = {
        "method": "draft_model",
        "model": "/models/medium",
        "num_speculative_tokens": 5,
        "num_speculative_tokens_per_batch_size": [[1, 4, 5], [5, 64, 2]],
    }
    plain = {"method": "draft_model", "model": "/models/medium", "num_speculative_tokens": 2}
    history = {"good": AcceptanceEvidence(successes=2800.0, failures=200.0, drafts=1000.0)}
    under_table = propose(evidence(table, 0.85, k=2, batch=16.0, candidates=(GOOD, MEDIUM), history=history), settings)
    under_plain = propose(evidence(plain, 0.85, k=2, batch=16.0, candidates=(GOOD, MEDIUM), history=history), settings)
    assert under_plain.reason is PolicyReason.SWAP_DRAFT, under_plain.message
    assert under_table.reason is PolicyReason.SWAP_DRAFT, under_table.message
    assert under_table.predicted_gain is not None and under_plain.predicted_gain is not None
    assert under_table.predicted_gain == pytest.approx(under_plain.predicted_gain, rel=1e-6)


def test_a_swap_to_a_lookup_applies_a_table_priced_with_the_lookups_own_pass_and_share() -> None:
    """The table a swap applies is the candidate's: T(B, K) with its own pass beside the target (ngram: one
    host pass a step, ~free here) and its α at the share of steps it drafts at — not the running draft's K
    passes of 10.5 ms + 0.64 ms a sequence with drafting at every step (6 Dec live run: ngram ranked at K = 5
    for 4 streams was applied with K = 2 there and K = 0 from 22 streams; ngram/K = 5 made 106 tok/s, the
    table 76)."""
    from policies.acceptance_model import ConstantAlphaModel, sparse
    from policies.k_table import KTableSnapshot, k_table

    lab = StepCostModel(fixed_s=0.04, per_token_s=0.0027, draft_fixed_s=0.0105, draft_per_seq_s=0.00064)
    settings = PolicySettings(
        PolicySection(k_max=5, step_cost=pinned(lab), per_batch_size=True, max_batch_size=64), swap=SWAP
    )
    ngram = DraftCandidate("ngram", "ngram", prior_alpha=0.5, cost_ratio=0.26, draft_fixed_s=0.0,
                           draft_per_seq_s=0.0, proposal_share=0.45)  # fmt: skip
    history = {"ngram": AcceptanceEvidence(successes=8500.0, failures=1500.0, drafts=3500.0)}
    ctx = evidence(WEAK_SPEC, 0.25, batch=4.0, candidates=(WEAK, ngram), history=history)
    out = propose(ctx, settings)
    assert out.reason is PolicyReason.FALLBACK_NGRAM and out.target is not None and out.target.method == "ngram"
    rows = [tuple(r) for r in out.target.to_vllm()["num_speculative_tokens_per_batch_size"]]

    ranked = next(r for r in (out.details or {})["ranking"] if r["name"] == "ngram")
    a, (lo, hi) = ranked["alpha"], ranked["alpha_ci"]

    def table(model: StepCostModel, share: float) -> list[tuple[int, int, int]]:
        snap = KTableSnapshot(now=ctx.now, acceptance=sparse(ConstantAlphaModel(a, min(lo, a), max(hi, a)), share),
                              step_cost=model, max_batch_size=64, k_max=5, confidence=0.95)  # fmt: skip
        return [tuple(r) for r in k_table(snap).rows]

    own = StepCostModel(fixed_s=0.04, per_token_s=0.0027, draft_fixed_s=0.0, draft_per_seq_s=0.0,
                        proposal_share=0.45, lookup_proposer=True)  # fmt: skip
    assert rows == table(own, 0.45)
    k_at_4 = next(k for b0, b1, k in rows if b0 <= 4 <= b1)
    assert k_at_4 >= 4 and rows[-1][2] >= 1  # it drafts deep at 4 streams and still drafts at 64
    assert rows != table(lab, 1.0)  # what the running draft's pricing gave


def test_a_swaps_streak_key_is_the_draft_it_runs_whatever_table_comes_with_it() -> None:
    # The table a swap would apply is recomputed every tick and its boundaries move with α's noise; keyed on
    # the whole config, a swap proposed tick after tick restarted its streak each time (the simulator's
    # lab_phases: "proposed 1 time(s) in a row" four ticks running).
    cost = pinned(StepCostModel(fixed_s=2e-3, per_token_s=1e-3, draft_fixed_s=2e-4, draft_per_seq_s=1e-4))
    table_settings = PolicySettings(PolicySection(k_max=4, step_cost=cost, per_batch_size=True), swap=SWAP)
    profile = tuple((20.0, 16.0 if i % 3 == 0 else 1.0) for i in range(30))
    outs = []
    for good_alpha in (0.8, 0.97):  # good's measured α moves between ticks
        history = {"good": AcceptanceEvidence(successes=good_alpha * 3000, failures=(1 - good_alpha) * 3000)}
        ev = replace(evidence(WEAK_SPEC, 0.25, batch=1.0), batch_profile=profile, mean_batch_size=16.0,
                     history=history)  # fmt: skip
        out = propose(ev, table_settings)
        assert out.reason is PolicyReason.SWAP_DRAFT and out.target is not None, out.message
        outs.append(out)
    assert outs[0].target is not None and outs[1].target is not None
    assert outs[0].target.fingerprint != outs[1].target.fingerprint  # two different tables ...
    assert outs[0].streak_key == outs[1].streak_key == "draft draft_model /models/good"  # ... one change
    off = propose(
        replace(evidence(WEAK_SPEC, 0.25, batch=1.0), batch_profile=profile, mean_batch_size=16.0),
        PolicySettings(PolicySection(k_max=4, step_cost=cost, per_batch_size=False), swap=SWAP),
    )
    assert off.reason is PolicyReason.DISABLE_SPECULATION and off.streak_key == "off"
