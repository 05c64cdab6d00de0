"""``[swap] fleet_prior``: a candidate's prior α from the other engines of the same target in one store
(tuner/controller/fleet_prior.py), on a real store (SQLite and PostgreSQL) with the controller's own
decide loop and a fake actuator at our seam."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest

from collectors.records import EngineKey, WindowRecord
from policies.draft_choice import DraftCandidate, DraftTriggerConfig
from policies.fleet import PriorReason
from tests.fakes import FakeClock
from tests.integration.test_controller import KEY, SETTINGS, T0, FakeActuator, config_record, iid, write_windows
from tuner.controller.controller import Controller
from tuner.controller.evidence import HistoryCache
from tuner.controller.fleet_prior import fleet_engines, with_fleet_priors
from tuner.store import AppliedBy, Store

pytestmark = pytest.mark.integration

WEAK = {"method": "draft_model", "model": "/models/weak", "num_speculative_tokens": 3}
GOOD = {"method": "draft_model", "model": "/models/good", "num_speculative_tokens": 4}
# the operator typed a pessimistic prior for "good": alone it never beats the weak draft
GOOD_CANDIDATE = DraftCandidate("good", "draft_model", "/models/good", prior_alpha=0.1, cost_ratio=0.05)
UNSEEN = DraftCandidate("unseen", "draft_model", "/models/unseen", prior_alpha=0.5, cost_ratio=0.05)


def replica(i: int, target: str = "fake-target") -> EngineKey:
    return EngineKey(f"http://10.0.0.{i}:8000/metrics", target, "0")


def serve(store: Store, key: EngineKey, spec: dict[str, object], alpha: float) -> None:
    """An hour of ``spec`` on another engine, ended two hours before T0 (within the history horizon)."""
    start = T0 - timedelta(hours=3)
    record = config_record(spec, start, AppliedBy.STARTUP)
    config_id = store.record_config(key, replace(record, ended_at=start + timedelta(hours=1)))
    store.write_windows(
        [
            WindowRecord(
                key=key,
                start=start + timedelta(seconds=60 * i),
                end=start + timedelta(seconds=60 * (i + 1)),
                spec=iid(alpha, 4, 300),
                generation_tokens=6000.0,
                config_id=config_id,
            )
            for i in range(60)
        ]
    )


def fleet_store(db_url: str) -> tuple[Store, FakeClock]:
    store = Store(db_url)
    clock = FakeClock(T0)
    store.record_config(KEY, config_record(WEAK, T0, AppliedBy.STARTUP))
    clock.now = write_windows(store, T0, 30, k=3, rate=60.0, alpha=0.25)
    for i, alpha in zip((1, 2, 3), (0.82, 0.86, 0.84), strict=True):
        serve(store, replica(i), GOOD, alpha)
    serve(store, replica(4, "another-target"), GOOD, 0.2)  # another target: not this engine's fleet
    return store, clock


def test_fleet_priors_come_from_the_other_engines_of_this_target(db_url: str) -> None:
    store, clock = fleet_store(db_url)
    try:
        assert sorted(fleet_engines(store, [KEY])) == [replica(i).url for i in (1, 2, 3)]
        caches: dict[str, HistoryCache] = {}
        candidates, priors = with_fleet_priors(store, [KEY], clock.now, 7 * 86400.0, [GOOD_CANDIDATE, UNSEEN], caches)
        good, unseen = candidates
        assert priors["good"].reason is PriorReason.POOLED and priors["good"].engines == 3
        assert good.prior_alpha == pytest.approx(0.84, abs=0.03)
        assert good.prior_strength_trials == priors["good"].strength_trials
        assert good.prior_source == "fleet (3 engine(s))"
        assert priors["unseen"].reason is PriorReason.NO_EVIDENCE and unseen == UNSEEN  # configured prior kept
        assert sorted(caches) == [replica(i).url for i in (1, 2, 3)]  # ended periods are read once per engine
        again, _ = with_fleet_priors(store, [KEY], clock.now, 7 * 86400.0, [GOOD_CANDIDATE, UNSEEN], caches)
        assert again == candidates
        # this engine's own periods never count toward its fleet prior
        assert (
            with_fleet_priors(store, [replica(1)], clock.now, 7 * 86400.0, [GOOD_CANDIDATE], {})[1]["good"].engines == 2
        )
    finally:
        store.close()


@pytest.mark.parametrize("fleet_prior", [False, True])
def test_the_fleet_prior_decides_a_swap_the_typed_prior_would_not(db_url: str, fleet_prior: bool) -> None:
    store, clock = fleet_store(db_url)
    try:
        act = FakeActuator(WEAK, clock)
        policy = replace(SETTINGS.policy, swap=DraftTriggerConfig(duration_s=200, min_drafts=500, segments=2))
        settings = replace(SETTINGS, policy=policy, fleet_prior=fleet_prior)
        ctl = Controller(store, act, settings, clock, candidates=lambda: [GOOD_CANDIDATE])
        ctl.decide(clock.now)
        result = ctl.decide(clock.now + timedelta(seconds=10))
        d = store.decisions(newest_first=True, limit=1)[0]  # a held decision repeated is recorded once
        (ranked,) = d.decision.inputs["policy"]["ranking"]
        if fleet_prior:
            assert result.action == "applied" and act.applied[-1]["model"] == "/models/good", result.message
            assert d.decision.reason == "swap_draft"
            assert ranked["prior"].startswith("fleet (3 engine(s)) 0.8") and ranked["alpha"] > 0.7
        else:
            assert act.applied == [] and result.action == "blocked" and "No candidate beats" in result.message
            assert ranked["prior"] == "configured 0.10 worth 200 tokens" and ranked["alpha"] < 0.2
    finally:
        store.close()
