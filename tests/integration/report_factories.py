"""A realistic 90-minute history for the report tests, written through the store's own API.

One engine series, 10-second windows whose counters come from a simulated draft with position-dependent
acceptance (c_i = α·decay^i, as real drafts behave) and a step-cost model (step time grows with K):

  0–20 min   medium draft, K=3, predictable prompts        (α ≈ 0.74)
  15–17 min  idle (windows with no tokens)
  20–35 min  medium draft, K=3, hard prompts                (α ≈ 0.30, below the 0.4 line)
  35 min     decision #1: swap to the good draft           → verified, realized gain from the windows
  35–50 min  good draft, K=3                                (α ≈ 0.9); the restart window is a reset
  50 min     decision #2: K 3 → 5                          → rolled back at 60 min (regression)
  62 min     decision #3: K 3 → 4, blocked by cooldown     (no realized gain)
  75 min     decision #4: K 3 → 4                          → verified
  75–90 min  good draft, K=4
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import numpy as np

from collectors.records import EngineKey, EventRecord, WindowRecord
from policies.counters import SpecCounters
from tuner.store import AppliedBy, DecisionRecord, DecisionStatus, EngineConfigRecord, Store

T0 = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)
KEY = EngineKey(url="http://127.0.0.1:8000/metrics", model_name="lab-target", engine="0")
MEDIUM = "/srv/models/draft-medium"
GOOD = "/srv/models/draft-good"
WINDOW_S = 10
BATCH = 4
STEP_S = 0.02  # target step alone
COST_PER_K = 0.2  # each drafted position adds 20% of a target step


@dataclass
class Story:
    key: EngineKey
    config_ids: list[int] = field(default_factory=list)
    decision_ids: list[int] = field(default_factory=list)
    windows: list[WindowRecord] = field(default_factory=list)
    realized: dict[int, float] = field(default_factory=dict)
    end: datetime = T0


def _minute(m: float) -> datetime:
    return T0 + timedelta(minutes=m)


def _spec(rng: np.random.Generator, alpha: float, decay: float, k: int) -> SpecCounters:
    steps = int(WINDOW_S / (STEP_S * (1 + COST_PER_K * k)) * rng.uniform(0.93, 1.07))
    drafts = BATCH * steps
    cond = np.array([alpha * decay**i for i in range(k)])
    accepted_to = np.cumprod(rng.random((drafts, k)) < cond, axis=1)  # accepted up to the first rejection
    per_pos = tuple(int(x) for x in accepted_to.sum(axis=0))
    accepted = sum(per_pos)
    return SpecCounters(
        drafts=drafts,
        draft_tokens=drafts * k,
        accepted_tokens=accepted,
        accepted_per_pos=per_pos,
        num_spec_tokens=k,
        generated_tokens=drafts + accepted,
    )


def _windows(
    rng: np.random.Generator,
    start_min: float,
    end_min: float,
    alpha: float,
    decay: float,
    k: int,
    config_id: int,
    *,
    idle: tuple[float, float] | None = None,
    reset_first: bool = False,
) -> list[WindowRecord]:
    out = []
    t = _minute(start_min)
    while t < _minute(end_min):
        end = t + timedelta(seconds=WINDOW_S)
        busy = idle is None or not (_minute(idle[0]) <= t < _minute(idle[1]))
        spec = _spec(rng, alpha, decay, k) if busy else SpecCounters(accepted_per_pos=(0,) * k, num_spec_tokens=k)
        out.append(
            WindowRecord(
                key=KEY,
                start=t,
                end=end,
                spec=spec,
                generation_tokens=float(spec.generated_tokens),
                prompt_tokens=float(BATCH * 12 if busy else 0),
                requests_running=float(BATCH if busy else 0),
                requests_waiting=0.0,
                kv_cache_usage=0.2 if busy else 0.0,
                reset=reset_first and not out,
                config_id=config_id,
            )
        )
        t = end
    return out


def _rate(windows: list[WindowRecord], since: datetime, until: datetime) -> float:
    rates = [
        w.generation_tokens / w.duration_s
        for w in windows
        if since <= w.start and w.end <= until and w.generation_tokens > 0 and not w.reset
    ]
    return statistics.fmean(rates)


def _config(method: str, model: str, k: int) -> dict[str, object]:
    return {"method": method, "model": model, "num_speculative_tokens": k}


def populate(store: Store, *, decisions: bool = True, seed: int = 7) -> Story:
    """Write the history above; ``decisions=False`` writes windows and the start-up config only."""
    rng = np.random.default_rng(seed)
    story = Story(KEY)

    def config(at_min: float, model: str, k: int, by: str, decision_id: int | None = None) -> int:
        cid = store.record_config(
            KEY,
            EngineConfigRecord(
                method="draft_model",
                started_at=_minute(at_min),
                applied_by=by,
                draft_model=model,
                num_spec_tokens=k,
                spec_config=_config("draft_model", model, k),
                decision_id=decision_id,
            ),
        )
        story.config_ids.append(cid)
        return cid

    def decision(at_min: float, reason: str, model: str, k: int, predicted: float, status: str, msg: str) -> int:
        did = store.record_decision(
            DecisionRecord(
                created_at=_minute(at_min),
                action="change",
                reason=reason,
                message=msg,
                inputs={"window_rates": []},
                mode="auto",
                engine=KEY,
                proposed_config=_config("draft_model", model, k),
                predicted_gain=predicted,
                status=status,
            )
        )
        story.decision_ids.append(did)
        return did

    c1 = config(0, MEDIUM, 3, AppliedBy.STARTUP)
    w = _windows(rng, 0, 20, 0.74, 0.95, 3, c1, idle=(15, 17))
    w += _windows(rng, 20, 35, 0.30, 0.9, 3, c1)
    if not decisions:
        w += _windows(rng, 35, 90, 0.30, 0.9, 3, c1)
        store.write_windows(w)
        story.windows, story.end = w, _minute(90)
        return story

    store.write_events([EventRecord(_minute(30), "acceptance_low", "α̂ upper end below 0.4 for 10 min", "warning", KEY)])
    d1 = decision(35, "draft_swap", GOOD, 3, 2.0, DecisionStatus.APPLYING, "Swap the draft: α̂ 0.30 < 0.4.")
    c2 = config(35, GOOD, 3, AppliedBy.RESTART, d1)
    store.update_decision(d1, status=DecisionStatus.APPLIED, at=_minute(35))
    w += _windows(rng, 35, 50, 0.9, 0.9, 3, c2, reset_first=True)

    d2 = decision(50, "change_k", GOOD, 5, 1.10, DecisionStatus.APPLYING, "K 3 → 5: goodput 1.10× predicted.")
    c3 = config(50, GOOD, 5, AppliedBy.RESTART, d2)
    store.update_decision(d2, status=DecisionStatus.APPLIED, at=_minute(50))
    w += _windows(rng, 50, 60, 0.9, 0.9, 5, c3, reset_first=True)
    c4 = config(60, GOOD, 3, AppliedBy.ROLLBACK, d2)
    w += _windows(rng, 60, 75, 0.9, 0.9, 3, c4, reset_first=True)

    decision(62, "cooldown", GOOD, 4, 1.08, DecisionStatus.BLOCKED, "K 3 → 4 held back: cooldown.")
    d4 = decision(75, "change_k", GOOD, 4, 1.06, DecisionStatus.APPLYING, "K 3 → 4: goodput 1.06× predicted.")
    c5 = config(75, GOOD, 4, AppliedBy.RESTART, d4)
    store.update_decision(d4, status=DecisionStatus.APPLIED, at=_minute(75))
    w += _windows(rng, 75, 90, 0.9, 0.9, 4, c5, reset_first=True)
    store.write_windows(w)

    # Verification: realized gain = mean per-window goodput after / before, as the controller measures it.
    for did, before, after, status in (
        (d1, (25, 35), (35, 45), DecisionStatus.VERIFIED),
        (d2, (40, 50), (50, 60), DecisionStatus.ROLLED_BACK),
        (d4, (65, 75), (75, 85), DecisionStatus.VERIFIED),
    ):
        gain = _rate(w, _minute(after[0]), _minute(after[1])) / _rate(w, _minute(before[0]), _minute(before[1]))
        story.realized[did] = gain
        store.update_decision(did, status=status, at=_minute(after[1]), realized_gain=gain,
                              status_message=f"realized {gain:.3f}× ({status})")
    store.write_events([
        EventRecord(_minute(35), "config_applied", "Applied draft-good K=3", "info", KEY, {"decision_id": d1}),
        EventRecord(_minute(60), "regression_rolled_back", "K=5 lost throughput; back to K=3", "warning", KEY,
                    {"decision_id": d2}),
    ])
    story.windows, story.end = w, _minute(90)
    return story
