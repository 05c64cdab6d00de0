"""The simulated engine against closed forms, and the scenario format's validation."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from policies.acceptance import estimate_alpha
from policies.counters import SpecCounters
from policies.memory import DraftFootprint, KvCapacity
from policies.speedup import expected_tokens_per_step
from tuner.sim.engine import OFF, SimConfig, SimEngine
from tuner.sim.run import daemon_config
from tuner.sim.scenario import ScenarioError, load_scenario, parse_scenario

SCENARIOS = Path(__file__).resolve().parents[4] / "bench" / "scenarios"


def scenario_data(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": "t",
        "duration_s": 3600,
        "seed": 1,
        "engine": {"target_step_s": 0.025, "per_token_s": 0.0001, "step_time_cv": 0.0},
        "drafts": [{"name": "d", "cost_ratio": 0.08, "alpha": 0.7}],
        "start": {"draft": "d", "k": 3},
        "load": {"kind": "constant", "concurrency": 8},
    }
    data.update(changes)
    return data


def engine_of(**changes: Any) -> SimEngine:
    return SimEngine(parse_scenario(scenario_data(**changes)))


def draw(engine: SimEngine, cfg: SimConfig, n: int = 200, seed: int = 0) -> SpecCounters:
    starts = 10.0 * np.arange(n, dtype=np.float64)
    windows = engine.windows(cfg, starts, starts + 10.0, np.random.default_rng(seed))
    total = SpecCounters()
    for w in windows:
        assert w.spec is not None
        total = total + w.spec
    return total


@pytest.mark.parametrize("alpha", [0.3, 0.7, 0.95])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_expected_tokens_is_the_closed_form(alpha: float, k: int) -> None:
    engine = engine_of(drafts=[{"name": "d", "cost_ratio": 0.08, "alpha": alpha}])
    assert float(engine.expected_tokens(SimConfig("d", k), 0.0)) == pytest.approx(expected_tokens_per_step(alpha, k))
    assert float(engine.expected_tokens(OFF, 0.0)) == 1.0


@pytest.mark.parametrize("alpha,k", [(0.4, 2), (0.75, 4), (0.9, 8)])
def test_drawn_counters_match_the_model(alpha: float, k: int) -> None:
    engine = engine_of(drafts=[{"name": "d", "cost_ratio": 0.08, "alpha": alpha}])
    total = draw(engine, SimConfig("d", k))
    # tokens per draft = E(α, K) within sampling error; α̂'s interval covers α
    per_draft = 1.0 + total.accepted_tokens / total.drafts
    assert per_draft == pytest.approx(expected_tokens_per_step(alpha, k), rel=0.01)
    est = estimate_alpha(total)
    assert est.alpha_ci is not None and est.alpha_ci[0] <= alpha <= est.alpha_ci[1]
    # counters are internally consistent, like vLLM's
    assert total.draft_tokens == k * total.drafts
    assert sum(total.accepted_per_pos) == total.accepted_tokens
    assert list(total.accepted_per_pos) == sorted(total.accepted_per_pos, reverse=True)


def test_position_decay_shapes_conditional_acceptance() -> None:
    engine = engine_of(drafts=[{"name": "d", "cost_ratio": 0.08, "alpha": 0.8, "position_decay": 0.1}])
    total = draw(engine, SimConfig("d", 4))
    a = total.accepted_per_pos
    conditional = [a[0] / total.drafts] + [a[i] / a[i - 1] for i in range(1, 4)]
    assert conditional == pytest.approx([0.8 * 0.9**i for i in range(4)], abs=0.01)


def test_goodput_follows_the_step_cost_model() -> None:
    engine = engine_of()
    cfg = SimConfig("d", 3)
    b = 8.0
    step_s = 0.025 + 0.0001 * b * 4 + 3 * 0.08 * (0.025 + 0.0001 * b)  # T(B, K) with draft cost c × target's
    expected = b * expected_tokens_per_step(0.7, 3) / step_s
    assert float(engine.expected_goodput(cfg, 0.0)) == pytest.approx(expected)
    total = draw(engine, cfg)
    assert total.generated_tokens / 2000.0 == pytest.approx(expected, rel=0.01)
    # no speculation: B tokens per target step
    off = engine.windows(OFF, np.array([0.0]), np.array([10.0]), np.random.default_rng(0))[0]
    assert off.spec is None and off.generation_tokens == pytest.approx(10.0 * b / (0.025 + 0.0001 * b), abs=1)


def test_a_tables_k0_runs_the_draft_models_pass_but_not_ngrams() -> None:
    engine = engine_of(
        drafts=[{"name": "d", "cost_ratio": 0.08, "alpha": 0.7}, {"name": "n", "method": "ngram", "alpha": 0.5}]
    )
    b = np.array([8.0])
    target = 0.025 + 0.0001 * 8
    table = ((1, 4, 3), (5, 16, 0))
    assert engine.step_time_s(SimConfig("d", 3, table), b)[0] == pytest.approx(target * 1.08)  # one draft pass
    assert engine.step_time_s(SimConfig("n", 3, table), b)[0] == pytest.approx(target)
    assert engine.step_time_s(OFF, b)[0] == pytest.approx(target)


def test_an_engine_that_skips_the_k0_pass_keeps_it_only_in_steps_with_a_prompt() -> None:
    """``[engine] skip_draft_pass_at_k0`` (the plugin's skip): a table's K = 0 costs the target alone but in
    the steps a new request's prompt enters (B / output_tokens a step: a share 1 − exp(−B / output_tokens)),
    which keep the draft's pass; its K > 0 rows cost what they cost before; the controller the simulator
    builds is told ([plugin])."""
    data = scenario_data(engine={**scenario_data()["engine"], "skip_draft_pass_at_k0": True})
    data["load"] = {**data["load"], "output_tokens": 32}
    engine = SimEngine(parse_scenario(data))
    table = ((1, 4, 3), (5, 16, 0))
    at_8, at_2 = np.array([8.0]), np.array([2.0])
    off = engine.step_time_s(OFF, at_8)[0]
    with_pass = engine_of().step_time_s(SimConfig("d", 3, table), at_8)[0]
    share = 1.0 - math.exp(-8 / 32)
    assert engine.step_time_s(SimConfig("d", 3, table), at_8)[0] == pytest.approx(off + share * (with_pass - off))
    assert engine.step_time_s(SimConfig("d", 3, table), at_2)[0] == pytest.approx(
        engine_of().step_time_s(SimConfig("d", 3, table), at_2)[0]
    )
    config = daemon_config(engine.scenario, engine)
    assert config.plugin.skip_draft_pass_at_k0 and not config.plugin.skip_draft_pass_at_k0_prompts
    assert not daemon_config(engine_of().scenario, engine_of()).plugin.skip_draft_pass_at_k0


def test_an_engine_that_skips_the_k0_pass_in_prompt_steps_too_decodes_plainly_at_k0() -> None:
    """``[engine] skip_draft_pass_at_k0_prompts`` (an engine without prefix caching): every K = 0 step costs
    the target alone; the controller the simulator builds is told. Alone, the key is refused at load."""
    engine_keys = {**scenario_data()["engine"], "skip_draft_pass_at_k0": True, "skip_draft_pass_at_k0_prompts": True}
    engine = SimEngine(parse_scenario(scenario_data(engine=engine_keys)))
    table = ((1, 4, 3), (5, 16, 0))
    for b in (np.array([8.0]), np.array([16.0])):
        assert engine.step_time_s(SimConfig("d", 3, table), b)[0] == pytest.approx(engine.step_time_s(OFF, b)[0])
    assert engine.step_time_s(SimConfig("d", 3, table), np.array([2.0]))[0] == pytest.approx(
        engine_of().step_time_s(SimConfig("d", 3, table), np.array([2.0]))[0]
    )
    assert daemon_config(engine.scenario, engine).plugin.skip_draft_pass_at_k0_prompts
    alone = {**scenario_data()["engine"], "skip_draft_pass_at_k0_prompts": True}
    with pytest.raises(ScenarioError, match="needs skip_draft_pass_at_k0 = true"):
        parse_scenario(scenario_data(engine=alone))


def test_a_lookup_drafts_in_one_pass_and_only_at_its_share_of_the_steps() -> None:
    """A prompt lookup matches once a step for all K tokens (one pass, not K) and drafts only at a share of
    the steps; the others verify one token alone: E = 1 + share·(E(α, K) − 1), the target scores
    B·(1 + share·K) tokens, and the counters count drafts only where it drafted (as vLLM's do), while every
    step's token is generated. Its shadow replay drafts at the same share."""
    from datetime import UTC, datetime

    from tuner.sim.scenario import ShadowSection
    from tuner.sim.shadow import ShadowFeed

    ngram = {"name": "n", "method": "ngram", "alpha": 0.9, "draft_fixed_s": 0.002, "proposal_share": 0.4}
    engine = engine_of(drafts=[{"name": "d", "cost_ratio": 0.08, "alpha": 0.7}, ngram])
    cfg, b = SimConfig("n", 5), 8.0
    e = 1 + 0.4 * (expected_tokens_per_step(0.9, 5) - 1)
    assert float(engine.expected_tokens(cfg, 0.0)) == pytest.approx(e)
    step_s = 0.025 + 0.0001 * b * (1 + 0.4 * 5) + 0.002  # one lookup pass at K = 5
    assert engine.step_time_s(cfg, np.array([b]))[0] == pytest.approx(step_s)
    assert float(engine.expected_goodput(cfg, 0.0)) == pytest.approx(b * e / step_s)
    total = draw(engine, cfg)
    seq_steps = 2000.0 * b / step_s
    assert total.drafts == pytest.approx(0.4 * seq_steps, rel=0.02)
    assert total.generated_tokens == pytest.approx(seq_steps + total.accepted_tokens, rel=1e-3)
    assert total.generated_tokens / 2000.0 == pytest.approx(b * e / step_s, rel=0.01)
    feed = ShadowFeed(engine.scenario, ShadowSection(tokens_per_run=20_000), engine, np.random.default_rng(1))
    shares = {r.candidate: r.proposal_share for r in feed._evaluate(datetime(2026, 1, 1, tzinfo=UTC), 0.0)}
    assert shares["d"] == 1.0 and shares["n"] == pytest.approx(0.4, abs=0.02)


def test_free_tokens_flatten_the_target_pass_until_the_batch_fills_it() -> None:
    engine = engine_of(
        engine={"target_step_s": 0.04, "per_token_s": 0.003, "free_tokens": 8, "step_time_cv": 0.0},
        drafts=[{"name": "n", "method": "ngram", "alpha": 0.5}],
        start={"draft": "n", "k": 3},
    )
    steps = engine.step_time_s(OFF, np.array([1.0, 8.0, 16.0, 64.0]))
    assert steps == pytest.approx([0.04, 0.04, 0.04 + 0.003 * 8, 0.04 + 0.003 * 56])
    # verification scores B·(K+1) tokens: K = 3 at 2 streams is still within the flat part, at 4 it is not
    assert engine.step_time_s(SimConfig("n", 3), np.array([2.0, 4.0])) == pytest.approx([0.04, 0.04 + 0.003 * 8])


def test_memory_caps_the_batch_and_refuses_what_does_not_fit() -> None:
    memory = {"kv_pool_bytes": 1e9, "target_kv_bytes_per_token": 1e5, "tokens_per_seq": 1000}
    engine = engine_of(
        engine={"target_step_s": 0.025, "memory": memory},
        drafts=[
            {"name": "d", "cost_ratio": 0.08, "alpha": 0.7, "weights_bytes": 2e8, "kv_bytes_per_token": 1e5},
            {"name": "huge", "cost_ratio": 0.08, "alpha": 0.7, "weights_bytes": 2e9},
        ],
        load={"kind": "constant", "concurrency": 64},
    )
    assert engine.max_batch(OFF) == 10
    assert engine.max_batch(SimConfig("d", 3)) == 3  # 0.8e9 / (2e5 × 1003)
    assert float(engine.batch(SimConfig("d", 3), 0.0)) == 3.0
    assert engine.start_problem(SimConfig("huge", 1)) is not None
    assert float(engine.expected_goodput(SimConfig("huge", 1), 0.0)) == 0.0


def test_failing_configs_and_schedules() -> None:
    engine = engine_of(
        engine={"target_step_s": 0.025, "failing_configs": [{"draft": "d", "k": [5]}]},
        drafts=[{"name": "d", "cost_ratio": 0.08, "alpha": 0.7, "alpha_schedule": [[0, 0.8], [100, 0.8], [200, 0.2]]}],
    )
    assert engine.start_problem(SimConfig("d", 5)) is not None
    assert engine.start_problem(SimConfig("d", 4)) is None
    assert engine.alpha("d", np.array([50.0, 150.0, 500.0])) == pytest.approx([0.8, 0.5, 0.2])


def test_load_shapes() -> None:
    diurnal = engine_of(load={"kind": "diurnal", "trough_concurrency": 4, "peak_concurrency": 100, "peak_at_s": 0})
    assert diurnal.concurrency(np.array([0.0, 43200.0])) == pytest.approx([100.0, 4.0])
    bursty = engine_of(load={"kind": "bursty", "concurrency": 2, "burst_concurrency": 50, "burst_every_s": 600})
    c = bursty.concurrency(np.arange(0.0, 3600.0, 10.0))
    assert set(np.unique(c)) == {2.0, 50.0}
    phases = engine_of(
        load={
            "kind": "phases",
            "phases": [
                {"duration_s": 100, "concurrency": 1},
                {"duration_s": 100, "concurrency": 16, "alpha_scale": {"d": 0.5}},
            ],
        }
    )
    assert phases.concurrency(np.array([50.0, 150.0, 900.0])) == pytest.approx([1, 16, 16])
    assert phases.alpha("d", np.array([50.0, 150.0])) == pytest.approx([0.7, 0.35])


def test_same_world_for_every_policy() -> None:
    """Load, jitter and step noise depend on the scenario's seed only, not on the run's generator."""
    engine = engine_of(drafts=[{"name": "d", "cost_ratio": 0.08, "alpha": 0.7, "alpha_jitter_sd": 0.05}])
    t = np.arange(0.0, 600.0, 10.0)
    assert np.array_equal(
        engine.alpha("d", t, jitter=True),
        engine_of(drafts=[{"name": "d", "cost_ratio": 0.08, "alpha": 0.7, "alpha_jitter_sd": 0.05}]).alpha(
            "d", t, jitter=True
        ),
    )


def test_bad_scenarios_name_every_problem(tmp_path: Path) -> None:
    data = scenario_data(start={"draft": "nope", "k": 3})
    data["engine"] = {"target_step_s": -1, "restart_downtim_s": 5}
    with pytest.raises(ScenarioError) as err:
        parse_scenario(data, "x.toml")
    text = str(err.value)
    assert "engine.target_step_s" in text and "engine.restart_downtim_s: is not a known key" in text
    with pytest.raises(ScenarioError, match=r"start\.draft 'nope' is not one of"):
        parse_scenario(scenario_data(start={"draft": "nope", "k": 3}))
    with pytest.raises(ScenarioError, match="unknown guardrail"):
        parse_scenario(scenario_data(controller={"guardrails": {"cooldown": 5}}))
    bad = tmp_path / "bad.toml"
    bad.write_text("name = [")
    with pytest.raises(ScenarioError, match="not valid TOML"):
        load_scenario(bad)
    with pytest.raises(ScenarioError, match="file not found"):
        load_scenario(tmp_path / "missing.toml")


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.toml")), ids=lambda p: p.stem)
def test_every_bench_scenario_is_valid(path: Path) -> None:
    scenario = load_scenario(path)
    engine = SimEngine(scenario)
    assert tomllib.loads(path.read_text())["name"] == scenario.name
    start = SimConfig(scenario.start.draft, scenario.start.k)
    assert engine.start_problem(start) is None


def base() -> dict[str, Any]:
    return tomllib.loads((SCENARIOS / "gpu_memory_bound.toml").read_text())


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda d: d["load"].update(concurrency=4), "do not apply to kind = 'diurnal'"),
        (lambda d: d.update(change_at_s=90000), "is not before duration_s"),
        (lambda d: d["drafts"].append({"name": "ng", "method": "ngram", "alpha": 0.3, "weights_bytes": 1e9}),
         "loads no model"),
        (lambda d: d["engine"].update(failing_configs=[{"k": [9]}]), "above controller.k_max"),
        (lambda d: d["drafts"][0].update(proposal_share=0.5), "proposal_share applies to ngram or suffix"),
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


def test_the_engine_reports_its_kv_pool_and_usage_and_they_give_back_its_caps() -> None:
    """What cache_config_info and kv_cache_usage_perc show under each config is enough for the controller's
    KvCapacity to find the engine's own batch caps (24 without a draft, 21 with the 1B, 15 with the 8B)."""
    engine = SimEngine(parse_scenario(base()))
    footprints = {"llama-8b": DraftFootprint("draft_model", 8_000_000_000, 131072),
                  "llama-1b": DraftFootprint("draft_model", 2_500_000_000, 32768)}  # fmt: skip
    for cfg in (OFF, SimConfig("llama-8b", 3), SimConfig("llama-1b", 3)):
        cache = engine.cache_config(cfg)
        assert cache is not None
        tokens = int(cache["num_gpu_blocks"]) * int(cache["block_size"])
        (peak,) = engine.windows(cfg, np.array([43195.0]), np.array([43205.0]), np.random.default_rng(0))
        assert peak.batch == engine.max_batch(cfg) and peak.waiting > 0 and peak.kv_usage is not None
        per_seq = peak.kv_usage * tokens / peak.batch - cfg.k
        assert per_seq == pytest.approx(8192, rel=2e-3)
        running = None if cfg.off else footprints[str(cfg.draft)]
        kv = KvCapacity(tokens, 327680, per_seq, running, cfg.k)
        caps = (kv.max_batch(None, 0), kv.max_batch(footprints["llama-1b"], 3), kv.max_batch(footprints["llama-8b"], 3))
        assert caps == (24, 21, 15)
    assert engine_of().cache_config(OFF) is None  # no [engine.memory]: nothing to report
    (window,) = engine_of().windows(OFF, np.array([0.0]), np.array([10.0]), np.random.default_rng(0))
    assert window.kv_usage is None


def test_a_requests_alpha_spread_averages_over_the_requests_a_window_saw() -> None:
    # alpha_request_sd: a window's α moves by sd/√n, n = requests running + those finished in it, so windows
    # at one stream scatter like a live engine's and those at 64 streams far less.
    def window_alphas(concurrency: int, request_sd: float) -> np.ndarray:
        draft = {"name": "d", "cost_ratio": 0.08, "alpha": 0.7, "alpha_request_sd": request_sd}
        engine = engine_of(drafts=[draft], load={"kind": "constant", "concurrency": concurrency, "output_tokens": 64})
        starts = 2.0 * np.arange(1000, dtype=np.float64)
        windows = engine.windows(SimConfig("d", 1), starts, starts + 2.0, np.random.default_rng(3))
        return np.array([w.spec.accepted_tokens / w.spec.draft_tokens for w in windows if w.spec is not None])

    # one stream: a step of ~27 ms, 1.7 tokens a step, so ~1 running + ~2 finished requests in 2 s
    excess_one = window_alphas(1, 0.1).var() - window_alphas(1, 0.0).var()
    assert excess_one == pytest.approx(0.1**2 / 2.95, rel=0.3)
    # 64 streams: 64 running + ~84 finished
    excess_many = window_alphas(64, 0.1).var() - window_alphas(64, 0.0).var()
    assert excess_many < excess_one / 10
    one = window_alphas(1, 0.1)
    assert abs(one.mean() - 0.7) < 0.01  # spread, not bias
