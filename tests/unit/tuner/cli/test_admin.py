"""The admin CLI's pure parts: the lazy command table, override validation, draft specs, helpers."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest
import typer

from tuner.cli import common, main
from tuner.cli.apply import check_config
from tuner.controller.drafts import DraftRegistryError, DraftSpec

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def _first_paragraph(text: str | None) -> str:
    return " ".join((text or "").split("\n\n")[0].split())


@pytest.mark.parametrize("module", sorted(main._HELP))
def test_help_table_matches_the_real_commands(module: str) -> None:
    """`spectuner --help` shows _HELP without importing the modules: it must say what the commands say."""
    assert module in main._COMMAND_MODULES
    loaded = main.load_commands(module)
    assert set(loaded) == set(main._HELP[module]), f"fix _HELP[{module!r}] in tuner/cli/main.py"
    for name, text in main._HELP[module].items():
        wanted = _first_paragraph(loaded[name].help)
        assert " ".join(text.split()) == wanted, (
            f"_HELP[{module!r}][{name!r}] in tuner/cli/main.py differs from its docstring; set it to {wanted!r}"
        )


def test_help_imports_no_heavy_module() -> None:
    code = (
        "import sys\n"
        "from tuner.cli.main import app\n"
        "try:\n"
        "    app(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = [m for m in ('sqlalchemy', 'scipy', 'numpy', 'vllm', 'torch', 'httpx') if m in sys.modules]\n"
        "print('HEAVY=' + ','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.rstrip().endswith("HEAVY="), out[-300:]
    for name in ("status", "history", "apply", "pause", "resume", "drafts", "estimate", "db", "report"):
        assert name in out


GOOD = {"method": "draft_model", "model": "/m/draft", "num_speculative_tokens": 4}


@pytest.mark.parametrize(
    ("config", "k_max", "fragment"),
    [
        ({"method": "magic", "num_speculative_tokens": 2}, None, "not a vLLM speculative method"),
        ({"num_speculative_tokens": 2}, None, "not a vLLM speculative method"),
        ({**GOOD, "num_speculative_tokens": -1}, None, "integer ≥ 0"),
        ({**GOOD, "num_speculative_tokens": 2.5}, None, "integer ≥ 0"),
        ({**GOOD, "num_speculative_tokens": True}, None, "integer ≥ 0"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, None, 'needs "model"'),
        ({**GOOD, "num_speculative_tokens_per_batch_size": [[2, 4, 3]]}, None, "must start at 1"),
        ({**GOOD, "num_speculative_tokens_per_batch_size": [[1, 4, 3], [6, 8, 1]]}, None, "must start at 5"),
        ({**GOOD, "num_speculative_tokens_per_batch_size": [[1, 4, 3, 9]]}, None, "expected [lo, hi, K]"),
        ({**GOOD, "num_speculative_tokens_per_batch_size": [[1, 4, 6]]}, None, "K=6 above num_speculative_tokens=4"),
        ({**GOOD, "num_speculative_tokens_per_batch_size": "1-4:3"}, None, "rows [lo, hi, K]"),
        (GOOD, 3, "above the engine's K_max 3"),
        ({"method": "off", "num_speculative_tokens": 2}, None, 'method "off" takes no other keys'),
        ([1, 2], None, "must be a JSON object"),
    ],
)
def test_bad_override_configs_are_refused_with_the_reason(config: object, k_max: int | None, fragment: str) -> None:
    with pytest.raises(ValueError) as exc:
        check_config(config, k_max)
    assert fragment in str(exc.value)


def test_good_override_configs_pass() -> None:
    table = {**GOOD, "num_speculative_tokens_per_batch_size": [[1, 4, 4], [5, 16, 0]]}
    assert check_config(table, 4) == table
    assert check_config({"method": "ngram", "num_speculative_tokens": 0}, 0)["num_speculative_tokens"] == 0
    assert check_config({"method": "off"}, 2) == {"method": "off"}
    assert check_config({"method": "deepseek_mtp", "num_speculative_tokens": 1}, None)["method"] == "deepseek_mtp"


def test_draft_spec_validates_and_builds_the_vllm_config() -> None:
    spec = DraftSpec("good", "draft_model", "/m/good", 530_000, "float32", {"draft_tensor_parallel_size": 1})
    assert spec.to_spec_config(3).to_vllm() == {
        "method": "draft_model",
        "model": "/m/good",
        "num_speculative_tokens": 3,
        "draft_tensor_parallel_size": 1,
    }
    assert DraftSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert DraftSpec("ng", "ngram", extra={"prompt_lookup_max": 5}).to_spec_config(0).to_vllm() == {
        "method": "ngram",
        "num_speculative_tokens": 0,
        "prompt_lookup_max": 5,
    }
    bad = [
        ({"name": "", "method": "ngram"}, "not usable"),
        ({"name": "has space", "method": "ngram"}, "not usable"),
        ({"name": "x", "method": "medusa"}, "is not one of"),
        ({"name": "x", "method": "eagle3"}, "needs a model"),
        ({"name": "x", "method": "suffix", "model": "/m"}, "uses no draft model"),
        ({"name": "x", "method": "ngram", "num_params": -5}, "integer ≥ 0"),
        ({"name": "x", "method": "ngram", "extra": {"num_speculative_tokens": 3}}, "may not set"),
    ]
    for kwargs, fragment in bad:
        with pytest.raises(DraftRegistryError, match=fragment):
            DraftSpec(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(DraftRegistryError, match="integer ≥ 0"):
        spec.to_spec_config(-1)


def test_since_parsing() -> None:
    assert common.parse_since("24h", NOW) == NOW - timedelta(hours=24)
    assert common.parse_since("90s", NOW) == NOW - timedelta(seconds=90)
    assert common.parse_since("1.5d", NOW) == NOW - timedelta(hours=36)
    assert common.parse_since("2026-12-01T08:00:00Z", NOW) == datetime(2026, 12, 1, 8, tzinfo=UTC)
    assert common.parse_since("2026-12-01T09:00:00+01:00", NOW) == datetime(2026, 12, 1, 8, tzinfo=UTC)
    for bad in ("yesterday", "2026-12-01T08:00:00"):  # no zone: refused, not guessed (as `spectuner report`)
        with pytest.raises(typer.Exit) as exc:
            common.parse_since(bad, NOW)
        assert exc.value.exit_code == common.EXIT_USAGE


def test_who_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(common.USER_ENV_VAR, "ops-bot")
    assert common.default_by(None) == "ops-bot"
    assert common.default_by(" alice ") == "alice"
    monkeypatch.delenv(common.USER_ENV_VAR)
    assert common.default_by(None)  # the login name (or uid:N)
    with pytest.raises(typer.Exit):
        common.default_by("  ")


def test_ago() -> None:
    assert common.ago(NOW - timedelta(seconds=42), NOW) == "42s ago"
    assert common.ago(NOW - timedelta(seconds=192), NOW) == "3m12s ago"
    assert common.ago(NOW - timedelta(hours=2), NOW) == "2h ago"
    assert common.ago(NOW - timedelta(days=1, hours=3), NOW) == "1d3h ago"
    assert common.ago(None, NOW) == "—"


def test_run_prints_a_blocked_tick_only_when_it_changes() -> None:
    from tuner.cli.run import TickPrinter

    p = TickPrinter()
    shown = [
        p.should_print(action, reason)
        for action, reason in [
            ("blocked", "override_waiting"),
            ("blocked", "override_waiting"),
            ("blocked", "override_waiting"),
            ("blocked", "paused"),
            ("blocked", "override_waiting"),
            ("hold", "no_gain"),
            ("blocked", "override_waiting"),
            ("applied", "override"),
            ("applied", "override"),
        ]
    ]
    assert shown == [True, False, False, True, True, False, True, True, True]
