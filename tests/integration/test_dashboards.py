"""dashboards/alerts.yml with Prometheus' own promtool (Debian package ``prometheus``): the rules are
valid, the unit tests in alerts_test.yml pass (each rule fires, and stays quiet, when it should), and
those tests would catch a weakened rule."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests import dashboard_queries as DQ


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is needed: run `make system-deps` (or `apt-get install -y prometheus`)", pytrace=False
        )
    return path


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_promtool(), *args], capture_output=True, text=True, timeout=120, cwd=cwd, check=False)


def test_rules_are_valid() -> None:
    result = _run("check", "rules", DQ.ALERTS.name, cwd=DQ.DASHBOARDS)
    assert result.returncode == 0, result.stdout + result.stderr
    rules = sum(len(g["rules"]) for g in yaml.safe_load(DQ.ALERTS.read_text())["groups"])
    assert f"SUCCESS: {rules} rules found" in result.stdout


def test_rule_unit_tests_pass() -> None:
    result = _run("test", "rules", DQ.ALERT_TESTS.name, cwd=DQ.DASHBOARDS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_rule_is_tested_firing_and_quiet() -> None:
    rules = {r["alert"] for g in yaml.safe_load(DQ.ALERTS.read_text())["groups"] for r in g["rules"]}
    tests = yaml.safe_load(DQ.ALERT_TESTS.read_text())["tests"]
    checks = [c for t in tests for c in t.get("alert_rule_test", [])]
    fires = {c["alertname"] for c in checks if c.get("exp_alerts")}
    quiet = {c["alertname"] for c in checks if not c.get("exp_alerts")}
    assert rules == fires, f"rules never shown firing: {sorted(rules - fires)}"
    assert rules == quiet, f"rules never shown staying quiet: {sorted(rules - quiet)}"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("expr: spectuner_alpha_upper < 0.4", "expr: spectuner_alpha < 0.4"),  # point estimate, not the bound
        ("expr: spectuner_alpha_upper < 0.4\n        for: 10m", "expr: spectuner_alpha_upper < 0.4\n        for: 1m"),
        ("spectuner_last_scrape_age_seconds > 120", "spectuner_last_scrape_age_seconds > 30"),
        ("expr: spectuner_engine_up == 0\n        for: 1m", "expr: spectuner_engine_up == 0\n        for: 0m"),
        ("increase(spectuner_rollbacks_total[15m]) > 0", "increase(spectuner_rollbacks_total[30m]) > 0"),
        ('{daemon_job="decide"} == 1\n        for: 2m', '{daemon_job="decide"} == 1\n        for: 0m'),
        ('{daemon_job="decide"} == 1', ' == 1'),  # every job, not the controller's
    ],
)
def test_the_unit_tests_catch_a_weakened_rule(old: str, new: str, tmp_path: Path) -> None:
    text = DQ.ALERTS.read_text()
    assert old in text
    (tmp_path / "alerts.yml").write_text(text.replace(old, new))
    shutil.copyfile(DQ.ALERT_TESTS, tmp_path / "alerts_test.yml")
    result = _run("test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert result.returncode != 0, f"changing {old!r} to {new!r} went unnoticed"
