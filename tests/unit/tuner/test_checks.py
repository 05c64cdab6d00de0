"""Start-time checks shared by `spectuner run` and `run --check`, and the exporter's bind rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tuner.checks import start_problems
from tuner.config import ConfigError, parse_config

pytestmark = pytest.mark.unit

BASE: dict[str, Any] = {
    "engine": {"metrics_url": "http://127.0.0.1:8000"},
    "speculative": {"method": "ngram", "num_speculative_tokens": 3},
}


def cfg(tmp_path: Path, **sections: dict[str, Any]) -> Any:
    return parse_config({**BASE, **sections}, base_dir=tmp_path)


def test_a_good_config_has_no_problems(tmp_path: Path) -> None:
    assert start_problems(cfg(tmp_path)) == []


def test_an_unset_secret_env_is_a_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPT_TEST_HOOK_KEY", raising=False)
    sink = {"name": "ops", "kind": "webhook", "url": "http://127.0.0.1:9/x", "secret_env": "SPT_TEST_HOOK_KEY"}
    c = cfg(tmp_path, alerts={"enabled": True, "sinks": [sink]})
    [problem] = start_problems(c)
    assert "SPT_TEST_HOOK_KEY" in problem and "not set" in problem
    monkeypatch.setenv("SPT_TEST_HOOK_KEY", "k")
    assert start_problems(c) == []


def test_a_draft_path_that_does_not_exist_is_a_problem(tmp_path: Path) -> None:
    c = cfg(
        tmp_path,
        speculative={"method": "draft_model", "model": "./drafts/missing", "num_speculative_tokens": 3},
        drafts=[{"name": "gone", "model": "/nonexistent/draft"}, {"name": "hub", "model": "org/some-draft"}],
    )
    problems = start_problems(c)
    assert len(problems) == 2, problems  # the hub name is vLLM's to resolve
    assert "[speculative] model './drafts/missing'" in problems[0] and "[[drafts]] gone" in problems[1]
    (tmp_path / "drafts" / "missing").mkdir(parents=True)
    assert len(start_problems(c)) == 1


def test_an_empty_token_file_is_a_problem(tmp_path: Path) -> None:
    c = cfg(tmp_path, plugin={"ingest_listen": "127.0.0.1:8766"})
    assert start_problems(c) == []  # `run` creates it
    (tmp_path / "plugin.token").write_text("\n")
    [problem] = start_problems(c)
    assert "is empty" in problem


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.com"])
def test_a_non_loopback_exporter_needs_allow_remote(tmp_path: Path, host: str) -> None:
    with pytest.raises(ConfigError, match="allow_remote"):
        cfg(tmp_path, exporters={"prometheus": {"enabled": True, "host": host}})
    c = cfg(tmp_path, exporters={"prometheus": {"enabled": True, "host": host, "allow_remote": True}})
    assert c.exporters.prometheus.host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_exporters_need_nothing(tmp_path: Path, host: str) -> None:
    assert cfg(tmp_path, exporters={"prometheus": {"enabled": True, "host": host}}).exporters.prometheus.host == host
