"""`spectuner status` and the report show α by context length from the tap's per-request records, and the
report the candidates' shadow results (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from collectors.records import EngineKey, RequestRecord, WindowRecord
from policies.acceptance import AcceptanceEvidence
from policies.counters import SpecCounters
from tuner.cli.main import app
from tuner.report import write_report
from tuner.store import Store
from tuner.store.shadow import ShadowResult, write_shadow_result

pytestmark = pytest.mark.integration
K = 3


def test_status_shows_a_collapse_on_long_prompts_and_a_cutoff(db_url: str, tmp_path: Path) -> None:
    now = datetime.now(UTC)
    key = EngineKey("http://127.0.0.1:9/metrics", "m")
    rng = np.random.default_rng(5)
    records = []
    for prompt, alpha in [(700, 0.8), (1500, 0.8), (3000, 0.65), (6000, 0.5), (20000, 0.15)]:
        for i in range(25):
            acc = []
            for _ in range(30):
                n = 0
                while n < K and rng.random() < alpha:
                    n += 1
                acc.append(n)
            hist = tuple(acc.count(j) for j in range(K + 1))
            records.append(
                RequestRecord(now - timedelta(seconds=60 + i), f"r{prompt}-{i}", "m", prompt, 60, 1.0, K, 30, 90,
                              sum(acc), hist, per_step_accepted=tuple(acc), per_step_drafted=(K,) * 30)
            )
    other = RequestRecord(now - timedelta(seconds=5), "x", "other-model", 30000, 60, 1.0, K, 30, 90, 0, (30, 0, 0, 0))
    with Store(db_url) as store:
        spec = SpecCounters(drafts=10, draft_tokens=30, accepted_tokens=20, accepted_per_pos=(8, 7, 5))
        store.write_windows([WindowRecord(key, now - timedelta(seconds=20), now - timedelta(seconds=10), spec, 50.0)])
        store.write_requests([*records, other])
    result = CliRunner().invoke(app, ["status", "--db", db_url, "--json"], env={"SPECTUNER_DB": ""})
    assert result.exit_code == 0, result.output
    (engine,) = json.loads(result.output)["engines"]
    view = engine["by_context_length"]
    assert sum(b["requests"] for b in view["bands"]) == len(records)  # the other model's request is not counted
    assert view["collapse"] is True and view["slope_ci"][1] < 0
    assert view["cutoff_tokens"] == 16384
    human = CliRunner().invoke(app, ["status", "--db", db_url], env={"SPECTUNER_DB": ""})
    assert human.exit_code == 0 and "collapses on long contexts" in human.output
    bad = CliRunner().invoke(app, ["status", "--db", db_url, "--length-edges", "100,50"], env={"SPECTUNER_DB": ""})
    assert bad.exit_code == 2 and "--length-edges" in bad.output

    # the report carries the same view, and the candidates' shadow results
    with Store(db_url) as store:
        write_shadow_result(
            store,
            ShadowResult("lookup", "ngram", None, now, 3, 300, 3, AcceptanceEvidence(80.0, 20.0, 40.0), 0.8,
                         (0.71, 0.87), True, "not_needed"),
        )
        result_report = write_report(store, tmp_path / "report", now=now)
    (label, report_view) = next(iter(result_report.data.context_length.items()))
    assert report_view["collapse"] is True and report_view["cutoff_tokens"] == 16384
    html = result_report.index_html.read_text()
    assert 'id="context-length"' in html and "collapses on long contexts" in html
    assert 'id="shadow-table"' in html and "lookup" in html and "greedy-only" in html
    saved = json.loads(result_report.report_json.read_text())
    assert saved["shadow"][0]["candidate"] == "lookup" and saved["context_length"][label]["collapse"] is True
