"""The sidecar beside a CPU engine: its threads and its replays take cores the engine would use
(``[engine] sidecar_cpu_share``, ``[shadow] cpu_share``); a run's replays share one error."""

from __future__ import annotations

import tomllib
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tuner.sim.engine import SimConfig, SimEngine
from tuner.sim.run import StoreFactory, simulate, start_config
from tuner.sim.scenario import Scenario, ScenarioError, parse_scenario
from tuner.sim.shadow import ShadowFeed
from tuner.store.shadow import latest_shadow_results

SCENARIOS = Path(__file__).resolve().parents[4] / "bench" / "scenarios"
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def lab(**engine: Any) -> Scenario:
    data = tomllib.loads((SCENARIOS / "lab_phases.toml").read_text())
    data["engine"] = {**data["engine"], **engine}
    return parse_scenario(data, "lab_phases")


def test_the_cpu_other_processes_take_slows_every_step_by_its_share() -> None:
    engine = SimEngine(lab())
    starts = np.arange(0.0, 20.0, 2.0)
    ends = starts + 2.0
    cfg = SimConfig("good", 3)
    alone = engine.windows(cfg, starts, ends, np.random.default_rng(1))
    shared = engine.windows(cfg, starts, ends, np.random.default_rng(1), np.full(len(starts), 0.2))
    for a, s in zip(alone, shared, strict=True):
        assert s.step_s == pytest.approx(a.step_s / 0.8)  # the plugin's step records see it too
    ratio = sum(s.generation_tokens for s in shared) / sum(a.generation_tokens for a in alone)
    assert ratio == pytest.approx(0.8, abs=0.02)


def test_replays_take_their_share_only_while_they_run() -> None:
    scenario = lab()
    assert scenario.shadow is not None
    section = scenario.shadow.model_copy(update={"interval_s": 90, "run_s": 40, "cpu_share": 0.15})
    feed = ShadowFeed(scenario, section, SimEngine(scenario), np.random.default_rng(0))
    with StoreFactory() as stores:
        store = stores.new()
        for t in range(0, 100, 5):
            feed.tick(T0 + timedelta(seconds=t), float(t), store)
        store.close()
    starts = np.array([80.0, 88.0, 90.0, 120.0, 128.0, 130.0])
    taken = feed.cpu_taken(starts, starts + 2.0)
    # the run began at the 90-s tick and ends at 130 s: windows before it, and after it, pay nothing;
    # the window 129-131 s... here 128-130 lies inside, 88-90 before
    assert taken.tolist() == pytest.approx([0.0, 0.0, 0.15, 0.15, 0.15, 0.0])
    assert feed.cpu_taken(np.array([129.0]), np.array([131.0]))[0] == pytest.approx(0.075)  # half the window


def test_spectuner_pays_for_its_sidecar_and_the_fixed_configs_do_not() -> None:
    quiet, busy = lab(), lab(sidecar_cpu_share=0.1)
    off = SimConfig(None, 0)
    with StoreFactory() as stores:
        runs = {
            name: (
                simulate(s, SimEngine(s), "spectuner", start_config(s), stores=stores),
                simulate(s, SimEngine(s), "fixed:off", off),
            )
            for name, s in (("quiet", quiet), ("busy", busy))
        }
    assert runs["busy"][1].total_tokens == runs["quiet"][1].total_tokens  # a fixed config runs no sidecar
    assert runs["busy"][0].total_tokens < 0.95 * runs["quiet"][0].total_tokens


def test_a_runs_replays_share_one_error_and_shares_out_of_range_are_refused() -> None:
    scenario = lab()
    assert scenario.shadow is not None
    section = scenario.shadow.model_copy(update={"interval_s": 90, "run_s": 0, "bias_sd": 0.05,
                                                 "tokens_per_run": 200_000})  # fmt: skip
    engine = SimEngine(scenario)
    feed = ShadowFeed(scenario, section, engine, np.random.default_rng(4))
    misses, moves = [], []
    with StoreFactory() as stores:
        store = stores.new()
        for t in range(0, 1080, 90):
            feed.tick(T0 + timedelta(seconds=t), float(t), store)
            got = latest_shadow_results(store)
            if t >= 90:
                good, medium = got["good"].alpha, got["medium"].alpha
                assert good is not None and medium is not None
                true = {n: float(engine.alpha(n, np.array([float(t)]))[0]) for n in ("good", "medium")}
                misses.append((good - medium) - (true["good"] - true["medium"]))
                moves.append(good - true["good"])
        store.close()
    # each run moved both drafts by one draw of sd 0.05: their difference stays the true one, to the
    # binomial's few thousandths, while each alone misses by the draw
    assert len(misses) == 11 and max(abs(m) for m in misses) < 0.01
    assert np.std(moves) > 0.02
    with pytest.raises(ScenarioError, match="sidecar_cpu_share"):
        lab(sidecar_cpu_share=0.95)
