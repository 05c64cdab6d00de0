"""`spectuner status --fleet` on a real store, SQLite and PostgreSQL: five engines of one target written
by five "sidecars" into one database, grouped by (target, draft, config), pooled α̂ with its widened
interval, the one engine with a broken draft flagged, a change in flight shown as pending, an engine
without a recorded config left ungrouped. In-process through typer's runner (the console script's
import time is paid once in test_admin_cli)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from typer.testing import CliRunner

from policies.acceptance import alpha_of_windows
from tests.integration.fleet_factories import K3, REPLICAS, TARGET, key, write_fleet
from tuner.cli.main import app
from tuner.store import Store

pytestmark = pytest.mark.integration

runner = CliRunner()


def run_json(*args: str) -> Any:
    result = runner.invoke(app, [*args, "--json"], env={"SPECTUNER_DB": ""})
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture
def fleet(db_url: str) -> Iterator[tuple[str, Store, dict[str, list[Any]]]]:
    store = Store(db_url)
    try:
        yield db_url, store, write_fleet(store, datetime.now(UTC))
    finally:
        store.close()


def test_fleet_groups_pools_and_flags_the_broken_draft(fleet: tuple[str, Store, dict[str, list[Any]]]) -> None:
    url, _, written = fleet
    doc = run_json("status", "--fleet", "--db", url, "--window-s", "600")
    assert doc["engines"] == 7
    big, small = doc["groups"]
    assert (big["method"], big["draft_model"], big["target"]) == ("draft_model", "/drafts/good", TARGET)
    assert big["spec_config"] == K3.to_vllm() and big["fingerprint"] == K3.fingerprint
    assert sorted(e["url"] for e in big["engines"]) == [key(h).url for h in sorted(REPLICAS)[:5]]
    # the pooled α̂ is THE α̂ (alpha_of_windows) over every window of the group
    pooled = alpha_of_windows([c for h in sorted(REPLICAS)[:5] for c in written[h]])
    assert big["alpha"] == pytest.approx(pooled.alpha)
    assert big["alpha_ci_binomial"] == pytest.approx(list(pooled.alpha_ci or ()))
    lo, hi = big["alpha_ci"]
    blo, bhi = big["alpha_ci_binomial"]
    assert lo < blo and hi > bhi and big["dispersion"] > 5  # the broken replica makes the engines differ
    assert big["outliers"] == [f"{key('10.0.0.5').url}#0"]
    broken = next(e for e in big["engines"] if e["url"] == key("10.0.0.5").url)
    assert broken["outlier"]["verdict"] == "outlier" and "broken draft" in broken["outlier"]["reason"]
    assert broken["alpha"] == pytest.approx(alpha_of_windows(written["10.0.0.5"]).alpha)
    healthy = [e for e in big["engines"] if e is not broken]
    assert {e["outlier"]["verdict"] for e in healthy} == {"in_line"}
    # the change in flight on 10.0.0.2, by engine and for the group
    assert [p["proposed_config"] for p in big["pending"]] == [K3.with_k(4).to_vllm()]
    changed = next(e for e in big["engines"] if e["url"] == key("10.0.0.2").url)
    assert changed["pending"][0]["status"] == "applied" and changed["config"]["num_spec_tokens"] == 3
    # the prior a new engine with this draft would start from: all five replicas, τ > 0 (one is far off)
    prior = big["draft_prior"]
    assert prior["reason"] == "pooled" and prior["engines"] == 5 and prior["between_engine_sd"] > 0.05
    # the ngram replica: a group of one, its interval from its own windows, nobody to be an outlier of
    assert small["method"] == "ngram" and len(small["engines"]) == 1 and small["outliers"] == []
    assert small["engines"][0]["outlier"]["verdict"] == "not_judged"
    assert doc["ungrouped"][0]["url"] == key("10.0.0.9").url


def test_fleet_window_and_human_output(fleet: tuple[str, Store, dict[str, list[Any]]]) -> None:
    url, _, _ = fleet
    # 48 s back: the windows ending 40, 30, 20, 10 and 0 s before the fixture's now (8 s of slack for a slow box)
    doc = run_json("status", "--fleet", "--db", url, "--window-s", "48")
    assert {e["windows"] for g in doc["groups"] for e in g["engines"]} == {5}
    # a wide terminal: Rich squeezes a table into 80 columns and cuts the cells this test reads
    result = runner.invoke(app, ["status", "--fleet", "--db", url], env={"SPECTUNER_DB": "", "COLUMNS": "240"})
    assert result.exit_code == 0, result.output
    text = result.output
    assert "7 engine(s) in 2 group(s)" in text
    assert "OUTLIER" in text and "10.0.0.5" in text
    assert "pooled" in text and "φ =" in text
    assert "change applied (audit id" in text
    assert "prior for a new engine with this draft" in text
    assert "no config recorded yet" in text


def test_fleet_on_an_empty_store_and_with_engine_is_refused(db_url: str) -> None:
    doc = run_json("status", "--fleet", "--db", db_url)
    assert doc["groups"] == [] and doc["engines"] == 0
    result = runner.invoke(app, ["status", "--fleet", "--db", db_url], env={"SPECTUNER_DB": ""})
    assert result.exit_code == 0 and "no engine series" in result.output
    bad = runner.invoke(
        app, ["status", "--fleet", "--engine", "http://127.0.0.1:8000", "--db", db_url], env={"SPECTUNER_DB": ""}
    )
    assert bad.exit_code == 2 and "drop --engine" in bad.output
