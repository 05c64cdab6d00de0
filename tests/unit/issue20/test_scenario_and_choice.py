"""Issue 20: scenario keys that do not apply are refused at load (one line, exit 2); the engine's
per-sequence KV read; a candidate that confidently beats the running draft is proposed beyond failure."""

from __future__ import annotations

import tomllib
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from policies.counters import SpecCounters
from policies.draft_choice import (
    DraftCandidate,
    DraftChoiceSnapshot,
    DraftReason,
    DraftTriggerConfig,
    SpecWindow,
    choose_draft,
)
from policies.step_cost import StepCostModel
from tuner.cli.main import app
from tuner.sim.engine import OFF, SimConfig, SimEngine
from tuner.sim.scenario import ScenarioError, parse_scenario

SCENARIOS = Path(__file__).resolve().parents[3] / "bench" / "scenarios"
NOW = datetime(2026, 1, 1, 12, tzinfo=UTC)


def base() -> dict[str, Any]:
    return tomllib.loads((SCENARIOS / "gpu_memory_bound.toml").read_text())


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.toml")), ids=lambda p: p.stem)
def test_every_shipped_scenario_loads(path: Path) -> None:
    parse_scenario(tomllib.loads(path.read_text()), str(path))


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda d: d["load"].update(concurrency=4), "do not apply to kind = 'diurnal'"),
        (lambda d: d.update(change_at_s=90000), "is not before duration_s"),
        (lambda d: d["drafts"].append({"name": "ng", "method": "ngram", "alpha": 0.3, "weights_bytes": 1e9}),
         "loads no model"),
        (lambda d: d["engine"].update(failing_configs=[{"k": [9]}]), "above controller.k_max"),
        (lambda d: d["controller"].update(daemon={"policy": {"evidence_windw_s": 10}}), "evidence_windw_s"),
    ],
)  # fmt: skip
def test_keys_that_do_not_apply_are_refused(change: Any, expected: str) -> None:
    data = base()
    change(data)
    with pytest.raises(ScenarioError) as err:
        parse_scenario(data, "x.toml")
    assert expected in err.value.one_line()
    assert "\n" not in err.value.one_line()


def test_cli_says_it_in_one_line_with_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    text = (SCENARIOS / "gpu_memory_bound.toml").read_text().replace("[controller]", "[controller]\nk_maxx = 3")
    bad.write_text(text)
    result = CliRunner().invoke(app, ["simulate", "--scenario", str(bad), "--json"])
    assert result.exit_code == 2
    assert "k_maxx" in result.output


def test_memory_caps_the_batch_and_long_contexts_cost_kv_reads() -> None:
    data = base()
    engine = SimEngine(parse_scenario(data))
    caps = {c.label: engine.max_batch(c) for c in (OFF, SimConfig("llama-8b", 3), SimConfig("llama-1b", 3))}
    assert caps == {"off": 24, "llama-8b/K=3": 15, "llama-1b/K=3": 21}  # the calibration in the file
    data["engine"]["kv_read_s_per_token"] = 0.0
    no_read = SimEngine(parse_scenario(data))
    b = np.array([20.0])
    extra = engine.step_time_s(OFF, b) - no_read.step_time_s(OFF, b)
    assert extra[0] == pytest.approx(5.5e-8 * 8192 * 20)


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


RUNNING = DraftCandidate("running", "draft_model", "/m/8b", params=8_000_000_000, prior_alpha=0.75, cost_ratio=0.08)
NGRAM = DraftCandidate("ngram", "ngram", prior_alpha=0.6)


def _choice(alpha: float) -> DraftReason:
    snap = DraftChoiceSnapshot(
        now=NOW, current="running", current_k=3, windows=_windows(alpha), candidates=(RUNNING, NGRAM), history={},
        batch_size=8, k_max=8, step_cost=StepCostModel.from_cost_ratio(0.08, 0.025, 0.0001),
        config=DraftTriggerConfig(threshold=0.4, duration_s=600, min_drafts=2000, segments=3),
    )  # fmt: skip
    return choose_draft(snap).reason


def test_a_candidate_that_confidently_beats_the_running_draft_is_proposed_above_the_floor() -> None:
    assert _choice(0.45) is DraftReason.FALLBACK_NGRAM  # α 0.45 > 0.4: the floor alone would keep it
    assert _choice(0.8) is DraftReason.KEEP_NOT_TRIGGERED  # the running draft is good: no swap
