"""spectuner's full policy (tuner/controller/policy.py ``propose``): draft swap, then K or the table.

Evidence is built from i.i.d. acceptance counts with a known α, so every expected outcome follows
from the closed forms in DESIGN.md.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from collectors.records import EngineKey
from policies.acceptance import AcceptanceEvidence
from policies.counters import SpecCounters
from policies.draft_choice import DraftCandidate, DraftTriggerConfig, SpecWindow
from policies.step_cost import StepCostModel
from tuner.controller.evidence import Evidence
from tuner.controller.policy import PolicyReason, PolicySettings, current_table, propose
from tuner.controller.reconcile import change_kind
from tuner.store import EngineConfigRecord, StoredConfig

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
KEY = EngineKey("http://127.0.0.1:8000/metrics", "m", "0")
WEAK = DraftCandidate("weak", "draft_model", "/models/weak", params=1000, prior_alpha=0.3, cost_ratio=0.1)
GOOD = DraftCandidate("good", "draft_model", "/models/good", params=1000, prior_alpha=0.9, cost_ratio=0.1)
MEDIUM = DraftCandidate("medium", "draft_model", "/models/medium", params=1000, prior_alpha=0.7, cost_ratio=0.1)


def counters(alpha: float, k: int, drafts: int) -> SpecCounters:
    """Expected counts of ``drafts`` drafts of K tokens at per-token acceptance α (i.i.d.)."""
    per_pos = tuple(round(drafts * alpha ** (i + 1)) for i in range(k))
    return SpecCounters(drafts, drafts * k, sum(per_pos), per_pos, num_spec_tokens=k)


def evidence(
    spec: dict[str, object],
    alpha: float,
    *,
    k: int = 3,
    windows: int = 30,
    window_s: float = 20.0,
    drafts_per_window: int = 200,
    candidates: tuple[DraftCandidate, ...] = (WEAK, GOOD, MEDIUM),
    batch: float = 1.0,
    failed: tuple[dict[str, object], ...] = (),
    history: dict[str, AcceptanceEvidence] | None = None,
) -> Evidence:
    start = NOW - timedelta(seconds=windows * window_s)
    cfg = StoredConfig(1, KEY, EngineConfigRecord(method=str(spec["method"]), started_at=start, spec_config=spec))
    wins = tuple(
        SpecWindow(
            start + timedelta(seconds=i * window_s),
            start + timedelta(seconds=(i + 1) * window_s),
            counters(alpha, k, drafts_per_window),
        )
        for i in range(windows)
    )
    total = SpecCounters()
    for w in wins:
        total = total + w.counters
    rates = tuple(100.0 for _ in wins)
    return Evidence(
        now=NOW,
        keys=(KEY,),
        config=cfg,
        spec=total,
        windows=windows,
        duration_s=windows * window_s,
        generation_tokens=100.0 * windows * window_s,
        window_rates=rates,
        mean_batch_size=batch,
        batch_profile=tuple((window_s, batch) for _ in wins),
        trigger_windows=wins,
        candidates=candidates,
        history=history or {},
        failed_configs=failed,
    )


SWAP = DraftTriggerConfig(threshold=0.4, duration_s=300.0, min_drafts=500, segments=3)
SETTINGS = PolicySettings(k_max=6, cost_ratio=0.1, swap=SWAP)
WEAK_SPEC = {"method": "draft_model", "model": "/models/weak", "num_speculative_tokens": 3}


def test_weak_draft_is_swapped_for_the_best_candidate() -> None:
    out = propose(evidence(WEAK_SPEC, 0.25), SETTINGS)
    assert out.reason is PolicyReason.SWAP_DRAFT
    assert out.target is not None and out.target["model"] == "/models/good"
    assert out.predicted_gain is not None and out.predicted_gain > 1.5
    assert out.predicted_gain_ci is not None and out.predicted_gain_ci[0] > 1.0
    assert out.details is not None and "acceptance_low" in out.details
    assert out.details["trigger"]["upper"] < 0.4


def test_a_candidate_that_failed_to_start_is_not_proposed_again() -> None:
    failed = ({"method": "draft_model", "model": "/models/good", "num_speculative_tokens": 5},)
    out = propose(evidence(WEAK_SPEC, 0.25, failed=failed), SETTINGS)
    assert out.reason is PolicyReason.SWAP_DRAFT
    assert out.target is not None and out.target["model"] == "/models/medium"


def test_acceptance_above_threshold_keeps_the_draft_and_tunes_k() -> None:
    spec = {"method": "draft_model", "model": "/models/medium", "num_speculative_tokens": 1}
    out = propose(evidence(spec, 0.75, k=1), SETTINGS)
    assert out.reason is PolicyReason.CHANGE_K  # no swap: K tuning alone
    assert out.target is not None and out.target["model"] == "/models/medium"
    assert out.target["num_speculative_tokens"] > 1


def test_too_little_evidence_never_swaps() -> None:
    # 30 s of data against a 300 s duration: "stays below" is not established
    out = propose(evidence(WEAK_SPEC, 0.25, windows=3, window_s=10.0), SETTINGS)
    assert out.reason is not PolicyReason.SWAP_DRAFT
    assert not (out.details or {}).get("acceptance_low")


def test_low_acceptance_with_no_better_candidate_keeps_and_says_so() -> None:
    poor = DraftCandidate("poor", "draft_model", "/models/poor", params=1000, prior_alpha=0.05, cost_ratio=0.1)
    out = propose(evidence(WEAK_SPEC, 0.3, candidates=(WEAK, poor)), SETTINGS)
    assert out.reason is not PolicyReason.SWAP_DRAFT
    assert (out.details or {}).get("acceptance_low")


def test_measured_history_outweighs_an_optimistic_prior() -> None:
    # "good" claims 0.9 but measured 0.2 on this target over 20 000 tokens: medium wins.
    history = {"good": AcceptanceEvidence(successes=4000.0, failures=16000.0, drafts=16000.0)}
    out = propose(evidence(WEAK_SPEC, 0.25, history=history), SETTINGS)
    assert out.target is not None and out.target["model"] == "/models/medium"


def test_per_batch_size_table_follows_the_load() -> None:
    # The target's cost grows with the tokens it scores: speculation pays at batch 1, not at 16.
    cost = StepCostModel(fixed_s=2e-3, per_token_s=1e-3, draft_fixed_s=2e-4, draft_per_seq_s=1e-4)
    settings = PolicySettings(k_max=5, step_cost=cost, per_batch_size=True, max_batch_size=16, swap=None)
    spec = {"method": "draft_model", "model": "/models/good", "num_speculative_tokens": 5}
    out = propose(evidence(spec, 0.8, k=5, batch=16.0, candidates=(GOOD,)), settings)
    assert out.reason is PolicyReason.CHANGE_K_TABLE
    assert out.target is not None
    rows = out.target["num_speculative_tokens_per_batch_size"]
    assert rows[0][0] == 1 and rows[-1][1] == 16
    assert rows[0][2] > rows[-1][2]  # more speculation at low load than at high load
    assert out.target["num_speculative_tokens"] == 5  # the engine keeps K_max; the table picks per step
    assert out.predicted_gain is not None and out.predicted_gain > 1.0
    # Applying that table and measuring the same: the table is kept (no flapping).
    same = propose(evidence(out.target, 0.8, k=5, batch=16.0, candidates=(GOOD,)), settings)
    assert same.reason is PolicyReason.KEEP and same.target is None


def test_current_table_without_rows_is_one_row_at_k() -> None:
    assert current_table({"method": "ngram", "num_speculative_tokens": 4}, 8) == [[1, 8, 4]]
    assert current_table({"num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 8, 0]]}, 8) == [
        [1, 2, 3],
        [3, 8, 0],
    ]


@pytest.mark.parametrize(
    ("before", "after", "kind"),
    [
        (WEAK_SPEC, {**WEAK_SPEC, "model": "/models/good"}, "draft_swapped"),
        (WEAK_SPEC, {"method": "off", "num_speculative_tokens": 0}, "draft_swapped"),
        (WEAK_SPEC, {**WEAK_SPEC, "num_speculative_tokens": 5}, "k_changed"),
        (WEAK_SPEC, {**WEAK_SPEC, "num_speculative_tokens_per_batch_size": [[1, 16, 2]]}, "k_changed"),
        (WEAK_SPEC, dict(WEAK_SPEC), None),
        ({}, WEAK_SPEC, None),
    ],
)
def test_change_kind(before: dict[str, object], after: dict[str, object], kind: str | None) -> None:
    assert change_kind(before, after) == kind


def test_k_is_left_alone_while_low_acceptance_is_being_confirmed() -> None:
    # 60 s of a clearly bad draft against a 300 s trigger: no swap yet, and no K change either (a K = 0
    # table would stop the very drafts the swap decision needs).
    settings = PolicySettings(k_max=6, cost_ratio=0.1, swap=SWAP, per_batch_size=True)
    out = propose(evidence(WEAK_SPEC, 0.2, windows=3, window_s=20.0), settings)
    assert out.reason is PolicyReason.KEEP and out.target is None
    assert (out.details or {}).get("swap_pending")
    # without any other candidate there is nothing to wait for: K is tuned
    alone = propose(evidence(WEAK_SPEC, 0.2, windows=3, window_s=20.0, candidates=(WEAK,)), settings)
    assert alone.target is not None


def test_effective_k_of_a_table_window() -> None:
    from tuner.controller.evidence import effective_counters

    # engine at K_max = 4, the table drafted 2 per step: positions 3 and 4 are zero
    c = SpecCounters(100, 200, 150, (80, 70, 0, 0), num_spec_tokens=4)
    eff = effective_counters(c)
    assert eff is not None and eff.k == 2 and eff.accepted_per_pos == (80, 70)
    assert effective_counters(SpecCounters(100, 250, 150, (80, 50, 20, 0), num_spec_tokens=4)) is None  # mixed K
    assert effective_counters(c.__class__()) == c.__class__()


def test_under_a_table_a_busy_spell_does_not_switch_speculation_off() -> None:
    # mostly 1 stream with bursts of 16: at a high mean batch no draft pays with one K; with a
    # table the candidates are ranked where the table speculates (the low end of the load). The table
    # drafts less at 16 streams but not 0: a table's K = 0 still pays the draft model's catch-up pass.
    cost = StepCostModel(fixed_s=2e-3, per_token_s=1e-3, draft_fixed_s=2e-4, draft_per_seq_s=1e-4)
    ev = evidence(WEAK_SPEC, 0.25, batch=1.0)
    profile = tuple((20.0, 16.0 if i % 3 == 0 else 1.0) for i in range(30))
    ev = ev.__class__(**{**ev.__dict__, "batch_profile": profile, "mean_batch_size": 16.0})
    table = propose(ev, PolicySettings(k_max=4, step_cost=cost, per_batch_size=True, swap=SWAP))
    assert table.reason is PolicyReason.SWAP_DRAFT and table.target is not None
    rows = table.target["num_speculative_tokens_per_batch_size"]
    assert rows[0][2] >= 1 and rows[-1][2] < rows[0][2]
    single = propose(ev, PolicySettings(k_max=4, step_cost=cost, per_batch_size=False, swap=SWAP))
    assert single.reason is PolicyReason.DISABLE_SPECULATION


def test_a_k_that_failed_is_replaced_by_the_next_best_k() -> None:
    spec = {"method": "draft_model", "model": "/models/medium", "num_speculative_tokens": 1}
    best = propose(evidence(spec, 0.75, k=1), SETTINGS)
    assert best.target is not None
    failed = (best.target,)
    second = propose(evidence(spec, 0.75, k=1, failed=failed), SETTINGS)
    assert second.target is not None and second.target != best.target
    assert second.target["num_speculative_tokens"] not in (1, best.target["num_speculative_tokens"])
    assert "failed lately" in second.message


def test_a_burst_in_the_load_horizon_does_not_make_k_chase_it() -> None:
    """One K for the load of the last hour: evidence taken during a burst (mean batch 160) proposes the
    K that serves the whole hour, not the burst's own best K; the message says over which load."""
    cost = StepCostModel.from_cost_ratio(0.08, target_step_s=0.025, per_token_s=0.0001)
    settings = PolicySettings(k_max=8, cost_ratio=0.08, step_cost=cost)
    spec = {"method": "draft_model", "model": "/models/good", "num_speculative_tokens": 3}
    burst = evidence(spec, 0.75, k=3, batch=160.0, candidates=())
    profile = tuple([(10.0, 8.0)] * 330 + [(10.0, 160.0)] * 30)
    during_burst_alone = propose(burst, settings)
    over_the_hour = propose(replace(burst, load_profile=profile), settings)
    assert during_burst_alone.reason is PolicyReason.CHANGE_K  # at B = 160 alone a smaller K wins
    assert during_burst_alone.target is not None and during_burst_alone.target["num_speculative_tokens"] < 3
    assert over_the_hour.reason is PolicyReason.KEEP, over_the_hour.message
    assert "Over the load of the last 3600 s (batch 8–160" in over_the_hour.message
