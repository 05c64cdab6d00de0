"""The daemon's TOML config: valid files load; every bad key or value names the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tuner.cli.main import app
from tuner.config import ConfigError, Mode, load_config, parse_config

EXAMPLE = Path(__file__).resolve().parents[3] / "docs" / "spectuner.example.toml"

MINIMAL = {
    "engine": {"metrics_url": "http://127.0.0.1:8000"},
    "speculative": {"method": "ngram", "num_speculative_tokens": 3},
}


def with_(base: dict, section: str, **values: object) -> dict:
    out = {k: dict(v) for k, v in base.items()}
    out.setdefault(section, {}).update(values)
    return out


def problems(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value.problems


def test_example_file_loads_with_documented_defaults() -> None:
    cfg = load_config(EXAMPLE)
    assert cfg.controller.mode is Mode.ADVISORY
    assert cfg.actuator.kind == "restart" and cfg.actuator.restart is not None
    assert cfg.speculative.to_spec_config().to_vllm() == {
        "method": "draft_model",
        "model": "/models/draft-small",
        "num_speculative_tokens": 3,
    }
    assert cfg.base_dir == EXAMPLE.parent
    assert cfg.resolve("engine.log") == EXAMPLE.parent / "engine.log"


def test_minimal_config_gets_defaults() -> None:
    cfg = parse_config(MINIMAL)
    assert cfg.actuator.kind == "none"
    assert cfg.guardrails.cooldown_s == 600.0
    assert cfg.policy.k_max == 8


def test_unknown_key_is_named_with_the_fix() -> None:
    [p] = problems(with_(MINIMAL, "guardrails", cooldown=5))
    assert p.startswith("guardrails.cooldown: is not a known key")
    assert "spelling" in p


def test_missing_required_key_is_named() -> None:
    data = {"speculative": MINIMAL["speculative"]}
    [p] = problems(data)
    assert p == "engine: is required — add it"


def test_bad_value_names_key_and_value() -> None:
    [p] = problems(with_(MINIMAL, "guardrails", cooldown_s=-1))
    assert p.startswith("guardrails.cooldown_s:") and "-1" in p


def test_bad_mode_lists_the_choices() -> None:
    [p] = problems(with_(MINIMAL, "controller", mode="yolo"))
    assert p.startswith("controller.mode:") and "advisory" in p and "auto" in p


def test_every_problem_is_reported_at_once() -> None:
    data = with_(with_(MINIMAL, "policy", k_max=-2), "controller", decide_interval_s=0)
    found = problems(data)
    assert {p.split(":")[0] for p in found} == {"policy.k_max", "controller.decide_interval_s"}


def test_actuator_kind_needs_its_table() -> None:
    [p] = problems(with_(MINIMAL, "actuator", kind="webhook"))
    assert p.startswith("actuator:") and "[actuator.webhook]" in p


def test_auto_mode_needs_an_actuator() -> None:
    [p] = problems(with_(MINIMAL, "controller", mode="auto"))
    assert "actuator.kind" in p and "advisory" in p


def test_draft_method_needs_a_model() -> None:
    data = with_(MINIMAL, "speculative", method="draft_model")
    [p] = problems(data)
    assert p.startswith("speculative:") and "model =" in p


def test_starting_k_above_k_max_is_refused() -> None:
    data = with_(with_(MINIMAL, "speculative", num_speculative_tokens=9), "policy", k_max=4)
    [p] = problems(data)
    assert "k_max" in p and "num_speculative_tokens" in p


def test_a_shadow_wait_cap_below_its_interval_is_refused() -> None:
    shadow = {"record_dir": "traffic", "target": "target", "evaluate_interval_s": 600.0}
    [p] = problems(with_(MINIMAL, "shadow", **shadow, evaluate_interval_max_s=300.0))
    assert "evaluate_interval_max_s" in p and "evaluate_interval_s = 600" in p
    assert parse_config(with_(MINIMAL, "shadow", **shadow)).shadow.evaluate_interval_max_s is None  # 4 × 600


def test_bad_url_and_maintenance_window() -> None:
    data = with_(MINIMAL, "engine", metrics_url="localhost:8000")
    data = with_(data, "guardrails", maintenance_windows=[{"days": [7], "start": "02:00", "end": "03:00"}])
    found = problems(data)
    keys = {p.split(":")[0] for p in found}
    assert keys == {"engine.metrics_url", "guardrails.maintenance_windows.0.days"}


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine\nmetrics_url = 1\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


@pytest.mark.parametrize(
    ("tail", "named"),
    [
        ("[guardrails]\ncooldown_s = -5\n", "guardrails.cooldown_s"),
        (  # a rolling apply needs at least two replicas
            '[actuator]\nkind = "restart"\nstrategy = "rolling"\n'
            '[actuator.restart]\nargv = ["vllm", "serve", "m", "--port", "8000"]\n'
            '[actuator.front_door]\nengine_url = "http://127.0.0.1:8000"\nlisten = "127.0.0.1:8001"\n'
            "replica_ports = [8000]\n",
            "replica_ports lists 1 distinct port(s)",
        ),
    ],
)
def test_run_exits_2_naming_the_key(tmp_path: Path, tail: str, named: str) -> None:
    path = tmp_path / "spectuner.toml"
    path.write_text(
        '[engine]\nmetrics_url = "http://127.0.0.1:8000"\n'
        '[speculative]\nmethod = "ngram"\nnum_speculative_tokens = 3\n' + tail
    )
    result = CliRunner().invoke(app, ["run", "--config", str(path)])
    assert result.exit_code == 2
    assert named in result.output and len(result.output.strip().splitlines()) == 1


def test_run_check_validates_and_exits_0(tmp_path: Path) -> None:
    # --check opens the database too; a missing schema is a usage error naming the fix.
    path = tmp_path / "spectuner.toml"
    path.write_text(
        '[engine]\nmetrics_url = "http://127.0.0.1:8000"\n[speculative]\nmethod = "ngram"\nnum_speculative_tokens = 3\n'
    )
    result = CliRunner().invoke(app, ["run", "--config", str(path), "--check"])
    assert result.exit_code == 2
    assert "spectuner db upgrade" in result.output


def test_draft_candidates_swap_and_memory_sections() -> None:
    data = {
        **MINIMAL,
        "drafts": [
            {"name": "small", "model": "/models/small", "prior_alpha": 0.7},
            {"name": "ngram", "method": "ngram", "extra": {"prompt_lookup_max": 5}, "draft_fixed_s": 0.0095},
        ],
        "swap": {"threshold": 0.35, "duration_s": 120, "statistic": "draft_acceptance_rate"},
        "memory": {"budget_bytes": 2_000_000_000},
        "policy": {"per_batch_size": True, "max_batch_size": 64, "step_cost": {"fixed_s": 0.03}},
    }
    cfg = parse_config(data)
    assert [d.name for d in cfg.drafts] == ["small", "ngram"] and cfg.drafts[0].method == "draft_model"
    assert (cfg.drafts[1].draft_fixed_s, cfg.drafts[1].draft_per_seq_s) == (0.0095, None)
    assert cfg.swap.threshold == 0.35 and cfg.swap.statistic == "draft_acceptance_rate"
    assert cfg.memory.budget_bytes == 2_000_000_000
    assert cfg.policy.step_cost is not None and cfg.policy.step_cost.per_token_s == 0.0


def test_bad_draft_candidates_are_named() -> None:
    dupes = {**MINIMAL, "drafts": [{"name": "a", "model": "/m"}, {"name": "a", "model": "/n"}]}
    assert any("appear more than once" in p for p in problems(dupes))
    no_model = {**MINIMAL, "drafts": [{"name": "b"}]}
    assert any(p.startswith("drafts.0") and "needs a model" in p for p in problems(no_model))
    ngram_model = {**MINIMAL, "drafts": [{"name": "c", "method": "ngram", "model": "/m"}]}
    assert any("loads no model" in p for p in problems(ngram_model))
    bad_threshold = {**MINIMAL, "swap": {"threshold": 1.5}}
    assert any(p.startswith("swap.threshold") for p in problems(bad_threshold))
    # a pass given in milliseconds by mistake (95 for 0.095 s) is refused, not taken as 95 s
    ms = {**MINIMAL, "drafts": [{"name": "n", "method": "ngram", "draft_fixed_s": 95}]}
    assert any(p.startswith("drafts.0.draft_fixed_s") for p in problems(ms))


def test_shadow_section_is_off_by_default_and_names_what_evaluation_needs() -> None:
    assert parse_config(MINIMAL).shadow.record_dir is None
    on = parse_config({**MINIMAL, "shadow": {"record_dir": "traffic", "target": "/models/t", "candidates": ["ngram"]}})
    assert on.shadow.evaluate_interval_s == 900.0 and on.shadow.record_sample_rate == 0.05
    record_only = parse_config({**MINIMAL, "shadow": {"record_dir": "traffic", "evaluate_interval_s": 0}})
    assert record_only.shadow.target is None
    no_target = problems({**MINIMAL, "shadow": {"record_dir": "traffic"}})
    assert any(p.startswith("shadow") and "needs target" in p for p in no_target), no_target
    no_record = problems({**MINIMAL, "shadow": {"target": "/models/t"}})
    assert any("need record_dir" in p for p in no_record), no_record
    assert any(p.startswith("shadow.record_sample_rate") for p in problems(
        {**MINIMAL, "shadow": {"record_dir": "d", "evaluate_interval_s": 0, "record_sample_rate": 0}}))
